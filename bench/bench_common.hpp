// bench/bench_common.hpp — what bench_collectives and bench_training share: failure accounting (Google
// Benchmark 1.7 exits 0 after SkipWithError, so the programs count real failures themselves and return
// non-zero), skips that are not failures (no GPU), size options, timing, and the results the summaries printed
// after the run are made of.
//
// Header-only and included by exactly one translation unit per program.
#pragma once

#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/units.hpp"
#include "lockstep/device/device.hpp"

namespace lockstep_bench {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// ---- failures and skips ---------------------------------------------------------------------------------------

/// Prefix of the SkipWithError messages that are skips, not failures (Google Benchmark 1.7 has no SkipWithMessage).
inline constexpr std::string_view skip_prefix = "skipped: ";

struct failure {
  std::string benchmark;
  std::string message;
};

inline std::vector<failure>& failures() {
  static std::vector<failure> list;
  return list;
}

/// Marks the benchmark failed (reported as ERROR OCCURRED and counted: the program exits with 1).
inline void fail(benchmark::State& st, const std::string& name, const std::string& message) {
  failures().push_back({name, message});
  st.SkipWithError(message.c_str());
}

/// Marks the benchmark skipped (reported as ERROR OCCURRED: 'skipped: ...'; not a failure).
inline void skip(benchmark::State& st, const std::string& why) {
  const std::string text = std::string(skip_prefix) + why;
  st.SkipWithError(text.c_str());
}

/// what() of an exception and of every exception nested in it: "a: b: c".
inline std::string describe(const std::exception& e) {
  std::string text = e.what();
  try {
    std::rethrow_if_nested(e);
  } catch (const std::exception& inner) {
    const std::string more = describe(inner);
    if (text.find(more) == std::string::npos) text += " [nested: " + more + "]";
  } catch (...) {
    text += " [nested: an exception that is not a std::exception]";
  }
  return text;
}

/// Runs a benchmark body; an exception fails the benchmark with its message instead of ending the program.
template <class F>
void guarded(benchmark::State& st, const std::string& name, F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    fail(st, name, describe(e));
  } catch (...) {
    fail(st, name, "an exception that is not a std::exception");
  }
}

// ---- options ---------------------------------------------------------------------------------------------------

/// Parses "4096", "4K", "16M", "1G" (lockstep's parse_bytes); exits with a message otherwise.
inline std::size_t parse_size_or_exit(std::string_view what, std::string_view text) {
  const auto v = lockstep::parse_bytes(text);
  if (!v || *v == 0) {
    std::fprintf(stderr, "%.*s: '%.*s' is not a size (write e.g. 1048576, 1M or 256M)\n", static_cast<int>(what.size()),
                 what.data(), static_cast<int>(text.size()), text.data());
    std::exit(2);
  }
  return static_cast<std::size_t>(*v);
}

/// Removes `--name=value` from argv and returns the value (the last one given), if any.
inline std::optional<std::string> take_flag(int& argc, char** argv, std::string_view name) {
  std::optional<std::string> value;
  const std::string prefix = "--" + std::string(name) + "=";
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.substr(0, prefix.size()) == prefix) {
      value = std::string(arg.substr(prefix.size()));
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  argv[argc] = nullptr;
  return value;
}

/// The value of `--name=value` without removing it (Google Benchmark's own flags, read for our use too).
inline std::optional<std::string> peek_flag(int argc, char** argv, std::string_view name) {
  if (name == "benchmark_list_tests") {  // also given as a bare flag
    for (int i = 1; i < argc; ++i) {
      if (std::string_view(argv[i]) == "--benchmark_list_tests") return std::string("true");
    }
  }
  std::optional<std::string> value;
  const std::string prefix = "--" + std::string(name) + "=";
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.substr(0, prefix.size()) == prefix) value = std::string(arg.substr(prefix.size()));
  }
  return value;
}

/// True when --benchmark_list_tests (or =true/=1) was given.
inline bool listing_only(int argc, char** argv) {
  const auto v = peek_flag(argc, argv, "benchmark_list_tests");
  return v && (*v == "true" || *v == "1");
}

/// "4KiB", "16MiB", "1GiB"; other sizes in bytes ("1000B").
inline std::string size_label(std::size_t bytes) {
  if (bytes >= (std::size_t{1} << 30) && bytes % (std::size_t{1} << 30) == 0)
    return std::to_string(bytes >> 30) + "GiB";
  if (bytes >= (std::size_t{1} << 20) && bytes % (std::size_t{1} << 20) == 0)
    return std::to_string(bytes >> 20) + "MiB";
  if (bytes >= (std::size_t{1} << 10) && bytes % (std::size_t{1} << 10) == 0)
    return std::to_string(bytes >> 10) + "KiB";
  return std::to_string(bytes) + "B";
}

// ---- results -------------------------------------------------------------------------------------------------------
//
// Two records: latest(), written by the benchmark bodies at the end of every run (Google Benchmark runs a body
// several times to pick the iteration count; the last run is the one it reports), read by later benchmarks of
// the same run for their ratio counters (vs_f32, vs_single); and reported(), the rows exactly as Google
// Benchmark reported them (captured by the display reporter), read by the summaries: with
// --benchmark_repetitions the summary takes the median repetition.

/// What one benchmark measured.
struct measurement {
  double seconds_per_iteration = 0;
  double algbw = 0;  // GB/s (1e9 bytes per second), as nccl-tests
  double busbw = 0;
  double samples_per_second = 0;
  double peak_bytes = 0;
  std::int64_t repetitions = 1;  // > 1: a median over this many repetitions
};

inline std::map<std::string, measurement>& latest() {
  static std::map<std::string, measurement> m;
  return m;
}

inline const measurement* find_latest(const std::string& name) {
  const auto it = latest().find(name);
  return it == latest().end() ? nullptr : &it->second;
}

inline std::map<std::string, std::vector<measurement>>& reported() {
  static std::map<std::string, std::vector<measurement>> m;
  return m;
}

/// The reported row of the benchmark registered as `name` (the median by time of its repetitions), or null.
inline const measurement* find_result(const std::string& name) {
  auto it = reported().find(name);
  if (it == reported().end() || it->second.empty()) return nullptr;
  std::vector<measurement>& v = it->second;
  std::sort(v.begin(), v.end(), [](const measurement& a, const measurement& b) {
    return a.seconds_per_iteration < b.seconds_per_iteration;
  });
  return &v[(v.size() - 1) / 2];
}

/// How many repetitions of `name` were reported.
inline std::size_t reported_count(const std::string& name) {
  const auto it = reported().find(name);
  if (it == reported().end()) return 0;
  return it->second.size() == 1 ? static_cast<std::size_t>(it->second.front().repetitions) : it->second.size();
}

/// Sets the algbw/busbw counters (GB/s, nccl-tests' definitions: algbw = bytes / time, busbw = algbw * factor)
/// from the total manual time of the run, and records them under `name`.
inline void set_bandwidth(benchmark::State& st, const std::string& name, double bytes, double factor,
                          double total_seconds) {
  const auto iterations = static_cast<double>(st.iterations());
  if (iterations <= 0 || total_seconds <= 0) return;
  const double per_iteration = total_seconds / iterations;
  const double algbw = bytes / per_iteration / 1e9;
  st.counters["algbw"] = algbw;
  st.counters["busbw"] = algbw * factor;
  st.counters["bytes"] = benchmark::Counter(bytes, benchmark::Counter::kDefaults, benchmark::Counter::OneK::kIs1024);
  measurement& m = latest()[name];
  m.seconds_per_iteration = per_iteration;
  m.algbw = algbw;
  m.busbw = algbw * factor;
}

/// The display reporter Google Benchmark would make from --benchmark_format, --benchmark_color and
/// --benchmark_counters_tabular, wrapped so that every reported row is also captured into reported().
class capturing_reporter : public benchmark::BenchmarkReporter {
 public:
  capturing_reporter(int argc, char** argv) {
    const std::string format = peek_flag(argc, argv, "benchmark_format").value_or("console");
    if (format == "json") {
      inner_ = std::make_unique<benchmark::JSONReporter>();
    } else if (format != "console") {
      // (csv is deprecated in Google Benchmark and would not compile with warnings as errors)
      std::fprintf(stderr, "--benchmark_format=%s is not supported by these programs: use console or json\n",
                   format.c_str());
      std::exit(2);
    } else {
      const std::string color = peek_flag(argc, argv, "benchmark_color").value_or("auto");
      const std::string tabular = peek_flag(argc, argv, "benchmark_counters_tabular").value_or("false");
      const bool use_color =
          color == "auto" ? ::isatty(STDOUT_FILENO) != 0 : (color == "true" || color == "yes" || color == "1");
      int options = benchmark::ConsoleReporter::OO_None;
      if (use_color) options |= benchmark::ConsoleReporter::OO_Color;
      if (tabular == "true" || tabular == "1") options |= benchmark::ConsoleReporter::OO_Tabular;
      inner_ =
          std::make_unique<benchmark::ConsoleReporter>(static_cast<benchmark::ConsoleReporter::OutputOptions>(options));
    }
  }
  bool ReportContext(const Context& context) override { return inner_->ReportContext(context); }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      // Every repetition's row, and the median aggregate (alone with --benchmark_report_aggregates_only).
      const bool median = r.run_type == Run::RT_Aggregate && r.aggregate_name == "median";
      if (r.error_occurred || (r.run_type != Run::RT_Iteration && !median) || r.iterations <= 0) continue;
      measurement m;
      m.seconds_per_iteration = r.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(r.time_unit);
      const auto counter = [&](const char* key) {
        const auto it = r.counters.find(key);
        return it == r.counters.end() ? 0.0 : it->second.value;
      };
      m.algbw = counter("algbw");
      m.busbw = counter("busbw");
      m.samples_per_second = counter("samples_per_s");
      m.peak_bytes = counter("peak_MiB") * 1024.0 * 1024.0;
      if (median) m.repetitions = r.repetitions;
      auto& list = reported()[r.run_name.function_name];
      if (median) list.clear();  // the median of the repetitions replaces them
      list.push_back(m);
    }
    inner_->ReportRuns(runs);
  }
  void Finalize() override { inner_->Finalize(); }

 private:
  std::unique_ptr<benchmark::BenchmarkReporter> inner_;
};

/// Where the summaries go: stdout, or stderr when stdout carries JSON (--benchmark_format=json).
inline FILE*& summary_out() {
  static FILE* out = stdout;
  return out;
}

/// What main reads from the command line before benchmark::Initialize removes Google Benchmark's flags.
struct launch {
  launch(int argc, char** argv) : listing(listing_only(argc, argv)), display(argc, argv) {
    if (peek_flag(argc, argv, "benchmark_format").value_or("console") == "json") summary_out() = stderr;
  }
  bool listing;  // --benchmark_list_tests: nothing runs, no summary
  capturing_reporter display;
};

template <class Summary>
int run_benchmarks(const char* program, int argc, char** argv, launch& how, Summary&& summary) {
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  const std::size_t ran = benchmark::RunSpecifiedBenchmarks(&how.display);
  const bool listing = how.listing;
  if (listing || ran == 0) {
    benchmark::Shutdown();
    if (ran == 0) std::fprintf(stderr, "%s: no benchmark matched the filter\n", program);
    return ran == 0 ? 1 : 0;
  }
  summary();
  benchmark::Shutdown();
  if (!failures().empty()) {
    std::fprintf(stderr, "%s: %zu benchmark%s FAILED:\n", program, failures().size(),
                 failures().size() == 1 ? "" : "s");
    for (const auto& f : failures()) std::fprintf(stderr, "  %s: %s\n", f.benchmark.c_str(), f.message.c_str());
    return 1;
  }
  return 0;
}

/// The backends this translation unit carries: host, and CUDA when compiled by nvcc (its rows skip without GPUs).
inline std::vector<lockstep::device_kind> backends() {
  std::vector<lockstep::device_kind> out{lockstep::device_kind::host};
#if LOCKSTEP_HAS_CUDA
  out.push_back(lockstep::device_kind::cuda);
#endif
  return out;
}

}  // namespace lockstep_bench
