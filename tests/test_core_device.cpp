// Tests of core/ (errors, units) and device/ (parsing, device sets, visibility, host platform, properties).
//
// Tests that change process-wide state (the host platform configuration, CUDA visibility) run their body in
// a fresh child process through GoogleTest's "threadsafe" death-test machinery, so that they see the state
// of a program that just started, whatever ran before them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/core/units.hpp"
#include "lockstep/device/device.hpp"
#include "lockstep/device/device_guard.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/device/host_platform.hpp"
#include "lockstep/device/query.hpp"
#include "lockstep/device/visibility.hpp"
#include "test_support.hpp"

using namespace lockstep;
using namespace lockstep_test;

namespace {

// Runs `body` in a fresh process; the test passes when the body returns normally (exit code 0) and fails with
// the child's output otherwise.
template <class F>
void in_fresh_process(F body) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        try {
          body();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "unexpected exception: %s\n", e.what());
          std::exit(3);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace

// ---- core ----------------------------------------------------------------------------------------------------

TEST(units, format_bytes_reads_like_a_person_writes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(std::uint64_t{4} << 30), "4.00 GiB");
}

TEST(units, parse_bytes_accepts_binary_suffixes_and_rejects_garbage) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("64K"), 64u << 10);
  EXPECT_EQ(parse_bytes("512M"), 512u << 20);
  EXPECT_EQ(parse_bytes("4G"), std::uint64_t{4} << 30);
  EXPECT_EQ(parse_bytes("4GiB"), std::uint64_t{4} << 30);
  EXPECT_EQ(parse_bytes(" 2 GB "), std::uint64_t{2} << 30);
  EXPECT_EQ(parse_bytes("1T"), std::uint64_t{1} << 40);
  EXPECT_FALSE(parse_bytes(""));
  EXPECT_FALSE(parse_bytes("G"));
  EXPECT_FALSE(parse_bytes("4X"));
  EXPECT_FALSE(parse_bytes("4Gx"));
  EXPECT_FALSE(parse_bytes("-1"));
  EXPECT_FALSE(parse_bytes("99999999999999999999"));
  EXPECT_FALSE(parse_bytes("99999999999T"));
}

TEST(errors, precondition_messages_name_the_file_line_and_the_problem) {
  const std::string msg = message_of<precondition_error>([] {
    const int n = 0;
    LOCKSTEP_EXPECTS(n > 0, "batch must hold at least one sample, got ", n);
  });
  EXPECT_CONTAINS(msg, "test_core_device.cpp:");
  EXPECT_CONTAINS(msg, "batch must hold at least one sample, got 0");
  const std::string bare = message_of<precondition_error>([] { LOCKSTEP_EXPECTS(1 + 1 == 3); });
  EXPECT_CONTAINS(bare, "precondition failed: 1 + 1 == 3");
}

TEST(errors, short_file_and_call_name) {
  EXPECT_EQ(detail::short_file("/x/y/include/lockstep/runtime/device_buffer.hpp"), "runtime/device_buffer.hpp");
  EXPECT_EQ(detail::short_file("/x/kernels/lockstep/kernels/reduce.hpp"), "kernels/reduce.hpp");
  EXPECT_EQ(detail::short_file("/a/b/c.cpp"), "c.cpp");
  EXPECT_EQ(detail::call_name("cudaMemcpyAsync(dst, src, n, kind, s)"), "cudaMemcpyAsync");
  EXPECT_EQ(detail::call_name("::ncclGroupEnd()"), "ncclGroupEnd");
}

TEST(errors, hierarchy_lets_users_catch_by_family) {
  EXPECT_THROW(throw device_error("x"), precondition_error);
  EXPECT_THROW(throw out_of_memory_error("x"), error);
  EXPECT_EQ(cuda_error("x", 2).code(), 2);
}

// ---- device strings ------------------------------------------------------------------------------------------

TEST(device_string, parses_the_spellings_users_know) {
  EXPECT_EQ(parse_device("cuda"), (device{device_kind::cuda, 0}));
  EXPECT_EQ(parse_device("cuda:1"), (device{device_kind::cuda, 1}));
  EXPECT_EQ(parse_device(" cuda:12 "), (device{device_kind::cuda, 12}));
  EXPECT_EQ(parse_device("cpu"), (device{device_kind::host, 0}));
  EXPECT_EQ(parse_device("host"), (device{device_kind::host, 0}));
  EXPECT_EQ(parse_device("host:2"), (device{device_kind::host, 2}));
  EXPECT_EQ(parse_device("cpu:3"), (device{device_kind::host, 3}));
  EXPECT_EQ(parse_device("3", device_kind::host), (device{device_kind::host, 3}));
  EXPECT_EQ(parse_device("3", device_kind::cuda), (device{device_kind::cuda, 3}));
  EXPECT_EQ((device{device_kind::cuda, 1}).str(), "cuda:1");
  EXPECT_EQ((device{device_kind::host, 0}).str(), "host:0");
}

TEST(device_string, a_list_is_not_a_device_and_the_message_shows_both_correct_spellings) {
  const std::string msg = message_of<device_error>([] { (void)parse_device("cuda:1,2"); });
  EXPECT_CONTAINS(msg, "'cuda:1,2'");
  EXPECT_CONTAINS(msg, "names exactly one device");
  EXPECT_CONTAINS(msg, "\"cuda:1,cuda:2\"");
  EXPECT_CONTAINS(msg, "\"1,2\"");
  EXPECT_CONTAINS(msg, "\"cuda:1\"");
}

TEST(device_string, rejects_malformed_strings_with_the_reason) {
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device("gpu:0"); }), "spelled \"cuda\"");
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device("tpu"); }), "unknown device kind 'tpu'");
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device("cuda:"); }), "is not a device index");
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device("cuda:-1"); }), "'-1' is not a device index");
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device("cuda:x"); }), "'x' is not a device index");
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device(""); }), "unknown device kind ''");
}

TEST(device_list, parses_ids_and_prefixed_lists) {
  auto a = parse_device_list("0,1,2", device_kind::host);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[2], (device{device_kind::host, 2}));
  auto b = parse_device_list("cuda:0, cuda:2", device_kind::host);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[1], (device{device_kind::cuda, 2}));
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device_list("cuda:1,2", device_kind::cuda); }),
                  "\"cuda:1,cuda:2\"");
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device_list("0,,1", device_kind::host); }),
                  "empty entry");
  EXPECT_CONTAINS(message_of<device_error>([] { (void)parse_device_list(" ", device_kind::host); }),
                  "empty device list");
}

// ---- device sets (these use the default host platform: 2 host devices) -------------------------------------------

TEST(device_set, all_and_lists_of_host_devices) {
  if (cuda_available()) GTEST_SKIP() << "bare ids mean GPUs on this machine";
  device_set all("all");
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all.kind(), device_kind::host);
  EXPECT_EQ(all.str(), "host:0,host:1");
  EXPECT_EQ(device_set("1,0")[0], (device{device_kind::host, 1}));
  EXPECT_EQ((device_set{1}).front(), (device{device_kind::host, 1}));
  EXPECT_EQ(device_set("host:0,host:1"), all);
  EXPECT_EQ(all.index_of(device{device_kind::host, 1}), 1);
  EXPECT_EQ(all.index_of(device{device_kind::host, 7}), -1);
}

TEST(device_set, out_of_range_ids_name_the_visible_count) {
  const std::string msg = message_of<device_error>([] { (void)device_set::parse("0,5", device_kind::host); });
  EXPECT_CONTAINS(msg, "host:5 does not exist");
  EXPECT_CONTAINS(msg, "2 host devices are configured");
  EXPECT_CONTAINS(msg, "valid ids 0..1");
}

TEST(device_set, duplicates_are_errors) {
  const std::string msg = message_of<device_error>([] { (void)device_set::parse("1,1", device_kind::host); });
  EXPECT_CONTAINS(msg, "lists host:1 twice");
  EXPECT_CONTAINS(msg, "2 host devices are visible");
}

TEST(device_set, kinds_cannot_be_mixed) {
  const std::string msg = message_of<device_error>([] { (void)device_set::parse("host:0,cuda:0", device_kind::host); });
  EXPECT_CONTAINS(msg, "mixes host:0 and cuda:0");
}

TEST(device_set, gpus_that_do_not_exist_say_why) {
  if (cuda_available()) GTEST_SKIP() << "this machine has GPUs";
  const std::string msg = message_of<device_error>([] { (void)device_set::parse("cuda:0", device_kind::cuda); });
  EXPECT_CONTAINS(msg, "cuda:0 does not exist: no GPU can be used");
  EXPECT_CONTAINS(msg, cuda_status().reason());
}

TEST(device_set, default_devices_fall_back_to_host_with_the_reason) {
  const auto selection = default_devices();
  ASSERT_FALSE(selection.devices.empty());
  if (cuda_available()) {
    EXPECT_EQ(selection.devices.kind(), device_kind::cuda);
    EXPECT_CONTAINS(selection.reason, "GPU");
  } else {
    EXPECT_EQ(selection.devices.kind(), device_kind::host);
    EXPECT_EQ(selection.devices.size(), 2u);
    EXPECT_CONTAINS(selection.reason, "no GPU: ");
    EXPECT_CONTAINS(selection.reason, "using 2 host devices");
  }
}

TEST(cuda_status, no_gpu_is_a_reason_not_an_error) {
  const auto& st = cuda_status();
  EXPECT_EQ(st.compiled_in, LOCKSTEP_HAS_CUDA == 1);
  if (st.device_count > 0) GTEST_SKIP() << "this machine has GPUs";
  EXPECT_FALSE(st.reason().empty());
  if (!st.compiled_in) {
    EXPECT_CONTAINS(st.reason(), "compiled without nvcc");
  }
  if (st.error_name == "cudaErrorInsufficientDriver") {
    EXPECT_TRUE(st.reason().find("no CUDA driver (cudaErrorInsufficientDriver)") != std::string::npos ||
                st.reason().find("too old") != std::string::npos)
        << st.reason();
  }
}

// ---- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------------------------------

TEST(visibility, parses_cuda_visible_devices_as_the_runtime_does) {
  auto ordinals = [](std::string_view v, int n) {
    std::vector<int> out;
    for (const auto& e : parse_cuda_visible_devices(v, n)) out.push_back(e.ordinal);
    return out;
  };
  EXPECT_EQ(ordinals("1,2", 4), (std::vector<int>{1, 2}));
  EXPECT_EQ(ordinals("2,0", 4), (std::vector<int>{2, 0}));
  EXPECT_EQ(ordinals("1,-1,2", 4), (std::vector<int>{1}));  // stops at the first invalid entry
  EXPECT_EQ(ordinals("-1", 4), (std::vector<int>{}));
  EXPECT_EQ(ordinals("", 4), (std::vector<int>{}));
  EXPECT_EQ(ordinals("0,3,1", 2), (std::vector<int>{0}));  // 3 is out of range for 2 GPUs
  EXPECT_EQ(ordinals("0,0,1", 4), (std::vector<int>{0}));  // a repeat is invalid
  EXPECT_EQ(ordinals("0, 1", -1), (std::vector<int>{0, 1}));
  auto uuid = parse_cuda_visible_devices("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6,1", 4);
  ASSERT_EQ(uuid.size(), 2u);
  EXPECT_EQ(uuid[0].ordinal, -1);
  EXPECT_EQ(uuid[0].uuid, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6");
  EXPECT_EQ(uuid[1].ordinal, 1);
}

TEST(visibility, set_visible_devices_before_cuda_starts_sets_the_variables) {
  in_fresh_process([] {
    ::unsetenv("CUDA_VISIBLE_DEVICES");
    if (cuda_runtime_started()) std::exit(4);
    set_visible_devices("cuda:1,cuda:2");
    if (std::string(std::getenv("CUDA_VISIBLE_DEVICES")) != "1,2") std::exit(5);
    if (std::string(std::getenv("CUDA_DEVICE_ORDER")) != "PCI_BUS_ID") std::exit(6);
    set_visible_devices("0", cuda_device_order::fastest_first);
    if (std::string(std::getenv("CUDA_DEVICE_ORDER")) != "FASTEST_FIRST") std::exit(7);
  });
}

TEST(visibility, set_visible_devices_rejects_the_classic_misspelling) {
  in_fresh_process([] {
    const std::string msg = message_of<device_error>([] { set_visible_devices("cuda:1,2"); });
    if (msg.find("\"cuda:1,cuda:2\"") == std::string::npos) std::exit(4);
    const std::string host = message_of<device_error>([] { set_visible_devices("host:0"); });
    if (host.find("is not a GPU") == std::string::npos) std::exit(5);
  });
}

TEST(visibility, set_visible_devices_after_cuda_started_explains_why_it_cannot_work) {
  in_fresh_process([] {
#if LOCKSTEP_HAS_CUDA
    (void)cuda_status();  // starts the CUDA runtime for real
#else
    detail::mark_cuda_runtime_started("a CUDA translation unit of this program");  // what such a TU does
#endif
    if (!cuda_runtime_started()) std::exit(4);
    const std::string msg = message_of<device_error>([] { set_visible_devices("1,2"); });
    for (const char* needle : {"after the CUDA runtime started", "reads CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER once",
                               "CUDA_VISIBLE_DEVICES=1,2 ./app", "device_set (\"1,2\")"}) {
      if (msg.find(needle) == std::string::npos) {
        std::fprintf(stderr, "missing '%s' in: %s\n", needle, msg.c_str());
        std::exit(5);
      }
    }
  });
}

TEST(visibility, a_variable_changed_after_start_makes_device_selection_fail) {
  in_fresh_process([] {
    ::setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3", 1);
#if LOCKSTEP_HAS_CUDA
    (void)cuda_status();
#else
    detail::mark_cuda_runtime_started("a CUDA translation unit of this program");
#endif
    check_cuda_environment_unchanged();  // unchanged: fine
    ::setenv("CUDA_VISIBLE_DEVICES", "1,2", 1);  // the mistake of the notes: set too late
    const std::string msg = message_of<device_error>([] { (void)device_set::parse("all", device_kind::host); });
    if (msg.find("changed after the CUDA runtime started") == std::string::npos) std::exit(4);
    if (msg.find("'0,1,2,3'") == std::string::npos || msg.find("'1,2'") == std::string::npos) std::exit(5);
  });
}

// ---- host platform -------------------------------------------------------------------------------------------------

TEST(host_platform, environment_sets_count_and_memory) {
  in_fresh_process([] {
    ::setenv("LOCKSTEP_HOST_DEVICES", "3", 1);
    ::setenv("LOCKSTEP_HOST_DEVICE_MEMORY", "1G,2G,512M", 1);
    if (host_device_count() != 3) std::exit(4);
    const auto& c = host_platform_configuration();
    if (c.memory_limit(1) != (std::uint64_t{2} << 30) || c.memory_limit(2) != (std::uint64_t{512} << 20)) std::exit(5);
    if (get_device_properties(device{device_kind::host, 2}).total_memory != (std::uint64_t{512} << 20)) std::exit(6);
  });
}

TEST(host_platform, bad_environment_names_the_variable) {
  in_fresh_process([] {
    ::setenv("LOCKSTEP_HOST_DEVICES", "two", 1);
    const std::string msg = message_of<device_error>([] { (void)host_device_count(); });
    if (msg.find("LOCKSTEP_HOST_DEVICES='two'") == std::string::npos) std::exit(4);
  });
  in_fresh_process([] {
    ::setenv("LOCKSTEP_HOST_DEVICES", "2", 1);
    ::setenv("LOCKSTEP_HOST_DEVICE_MEMORY", "1G,2G,3G", 1);
    const std::string msg = message_of<device_error>([] { (void)host_device_count(); });
    if (msg.find("lists 3 sizes for 2 host devices") == std::string::npos) std::exit(4);
  });
}

TEST(host_platform, configure_works_before_start_and_explains_itself_after) {
  in_fresh_process([] {
    configure_host_platform(host_platform_config{4, {std::uint64_t{64} << 20}});
    if (host_device_count() != 4) std::exit(4);
    const std::string msg = message_of<device_error>(
        [] { configure_host_platform(host_platform_config{2, {std::uint64_t{1} << 30}}); });
    if (msg.find("after the host platform started with 4 devices") == std::string::npos) std::exit(5);
    if (host_device_count() != 4) std::exit(6);
  });
}

TEST(host_platform, environment_changed_after_start_makes_device_selection_fail) {
  in_fresh_process([] {
    ::setenv("LOCKSTEP_HOST_DEVICES", "2", 1);
    (void)device_set::parse("all", device_kind::host);
    ::setenv("LOCKSTEP_HOST_DEVICES", "4", 1);
    const std::string msg = message_of<device_error>([] { (void)device_set::parse("all", device_kind::host); });
    if (msg.find("changed after the host platform started") == std::string::npos) std::exit(4);
    if (msg.find("2 host devices remain") == std::string::npos) std::exit(5);
  });
}

// ---- guard and properties ------------------------------------------------------------------------------------------

TEST(device_guard, switches_the_current_host_device_and_restores_it) {
  EXPECT_EQ(current_device(device_kind::host).index, 0);
  {
    device_guard g(device{device_kind::host, 1});
    EXPECT_EQ(current_device(device_kind::host).index, 1);
    {
      device_guard inner(device{device_kind::host, 0});
      EXPECT_EQ(current_device(device_kind::host).index, 0);
    }
    EXPECT_EQ(current_device(device_kind::host).index, 1);
  }
  EXPECT_EQ(current_device(device_kind::host).index, 0);
  EXPECT_THROW(device_guard(device{device_kind::host, 9}), device_error);
}

TEST(properties, host_devices_describe_themselves) {
  const auto p = get_device_properties(device{device_kind::host, 1});
  EXPECT_CONTAINS(p.name, "host virtual device");
  EXPECT_EQ(p.total_memory, host_platform_configuration().memory_limit(1));
  EXPECT_EQ(p.multiprocessors, 1);
  EXPECT_EQ(p.compute_capability_major, 0);
  EXPECT_THROW((void)get_device_properties(device{device_kind::host, 9}), device_error);
  const auto m = peer_access_matrix({device{device_kind::host, 0}, device{device_kind::host, 1}});
  ASSERT_EQ(m.size(), 2u);
  EXPECT_TRUE(m[0][1] && m[1][0] && m[0][0]);
}

TEST(properties, gpus_report_compute_capability) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU: " << cuda_status().reason();
  const auto p = get_device_properties(device{device_kind::cuda, 0});
  EXPECT_GE(p.compute_capability_major, 7);
  EXPECT_GT(p.total_memory, 0u);
  EXPECT_GT(p.multiprocessors, 0);
  EXPECT_FALSE(p.pci_bus_id.empty());
}
