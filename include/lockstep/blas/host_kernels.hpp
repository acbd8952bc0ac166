// lockstep/blas/host_kernels.hpp — which kernels a host device's GEMM runs, and why.
//
// A host GEMM can run on two libraries: OpenBLAS (always linked) and oneDNN (Debian's libdnnl-dev, linked when
// the build found it: LOCKSTEP_HAS_ONEDNN). Debian's OpenBLAS picks its kernels from the CPU's model number
// when it is loaded; on a CPU it does not know (an Intel Xeon of 2023, for one) it falls back to its SSE3
// kernels and runs at a quarter of the machine's speed, silently. oneDNN generates its kernels at run time
// from the CPU's features (AVX2, AVX-512, AVX512-BF16, AMX), so it has no such fallback, and it multiplies bf16
// on the CPU's bf16 units (AVX512-BF16 dot products, AMX tiles).
//
// The choice is a table from the CPU's instruction sets to kernels (docs/blas.md has it with the measurements
// it comes from), never a timing, so every process of a run, and a resumed run, multiplies with the same
// kernels and gets the same bits:
//
//   instruction set (as oneDNN sees it)   f32            bf16                      f16
//   AMX (avx512_core_amx)                 oneDNN         oneDNN, AMX tiles         via f32 (oneDNN)
//   AVX512-BF16                           oneDNN         oneDNN, AVX512-BF16       via f32 (oneDNN)
//   AVX-512, AVX2 + FMA                   oneDNN         via f32 (oneDNN)          via f32 (oneDNN)
//   older, other architectures, or no oneDNN in the build: OpenBLAS, and via f32 (OpenBLAS)
//
// "via f32": blocks of the operands converted to f32, multiplied by the f32 kernel, summed in f32 and rounded
// once (gemm.hpp). Debian's oneDNN 2.6 has no f16 matmul on CPUs, so f16 always goes this way.
//
// The user's explicit choice wins: LOCKSTEP_HOST_GEMM=openblas or =onednn (or `auto`, the table), and
// oneDNN's own ONEDNN_MAX_CPU_ISA (e.g. AVX2) lowers the instruction set the table reads. A program that runs
// OpenBLAS on kernels below its CPU (the fallback above) is told so by host_gemm_plan::str(), which
// lockstep-info and the samples print.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>

#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#if LOCKSTEP_HAS_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

extern "C" char* openblas_get_corename(void);  // OpenBLAS's name of the kernels it loaded ("Haswell", ...)

LOCKSTEP_ABI_BEGIN

/// The instruction sets that decide a host GEMM's kernels, weakest first.
enum class host_isa : std::uint8_t { baseline, avx2, avx512, avx512_bf16, amx };

/// "baseline", "AVX2+FMA", "AVX-512", "AVX512-BF16", "AMX".
constexpr std::string_view name_of(host_isa i) noexcept {
  switch (i) {
    case host_isa::baseline: return "baseline";
    case host_isa::avx2: return "AVX2+FMA";
    case host_isa::avx512: return "AVX-512";
    case host_isa::avx512_bf16: return "AVX512-BF16";
    case host_isa::amx: return "AMX";
  }
  return "?";
}

/// What a host GEMM of one dtype runs on.
enum class host_gemm_kernel : std::uint8_t {
  openblas,  ///< OpenBLAS's cblas_sgemm (f32)
  onednn,    ///< oneDNN's matmul in the GEMM's own type (f32; bf16 on AVX512-BF16 or AMX)
  via_f32,   ///< f16/bf16: blocks converted to f32 and multiplied by the f32 kernel, rounded once
};

constexpr std::string_view name_of(host_gemm_kernel k) noexcept {
  switch (k) {
    case host_gemm_kernel::openblas: return "OpenBLAS";
    case host_gemm_kernel::onednn: return "oneDNN";
    case host_gemm_kernel::via_f32: return "via f32";
  }
  return "?";
}

/// What the user asked for in LOCKSTEP_HOST_GEMM.
enum class host_gemm_request : std::uint8_t { automatic, openblas, onednn };

/// The CPU's features that matter to GEMM kernels, read with CPUID (and the OS's support for the registers).
struct host_cpu_features {
  bool avx2_fma = false;
  bool avx512 = false;       // AVX-512 F, BW, VL, DQ (oneDNN's avx512_core)
  bool avx512_bf16 = false;
  bool avx512_fp16 = false;
  bool amx_bf16 = false;     // AMX-BF16 and AMX-TILE

  /// The strongest of host_isa the CPU has.
  [[nodiscard]] host_isa isa() const noexcept {
    if (amx_bf16 && avx512_bf16) return host_isa::amx;
    if (avx512_bf16) return host_isa::avx512_bf16;
    if (avx512) return host_isa::avx512;
    if (avx2_fma) return host_isa::avx2;
    return host_isa::baseline;
  }

  /// "AVX2+FMA AVX-512 AVX512-BF16" and so on; "none of AVX2, AVX-512, AMX" when it has none.
  [[nodiscard]] std::string str() const {
    std::string s;
    auto add = [&](bool has, const char* name) {
      if (!has) return;
      if (!s.empty()) s += ' ';
      s += name;
    };
    add(avx2_fma, "AVX2+FMA");
    add(avx512, "AVX-512");
    add(avx512_bf16, "AVX512-BF16");
    add(avx512_fp16, "AVX512-FP16");
    add(amx_bf16, "AMX-BF16");
    return s.empty() ? std::string("none of AVX2, AVX-512, AMX") : s;
  }

  /// This CPU's features (read once).
  static const host_cpu_features& detect() {
    static const host_cpu_features f = read();
    return f;
  }

 private:
  static host_cpu_features read() noexcept {
    host_cpu_features f;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    // __builtin_cpu_supports checks the OS's support of the registers too (XCR0) for AVX2 and AVX-512.
    f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (f.avx512 && __get_cpuid_count(7, 0, &a, &b, &c, &d)) {
      f.avx512_fp16 = (d >> 23) & 1u;
      f.amx_bf16 = ((d >> 22) & 1u) && ((d >> 24) & 1u);
      unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
      if (a >= 1 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) f.avx512_bf16 = (a1 >> 5) & 1u;
    }
#endif
    return f;
  }
};

/// The kernels of a host GEMM for each dtype, and what they were chosen from.
struct host_gemm_plan {
  host_gemm_kernel f32 = host_gemm_kernel::openblas;
  host_gemm_kernel bf16 = host_gemm_kernel::via_f32;
  host_gemm_kernel f16 = host_gemm_kernel::via_f32;
  host_isa isa = host_isa::baseline;  // the instruction set the table read (oneDNN's, when it is linked)
  host_gemm_request request = host_gemm_request::automatic;

  friend bool operator==(const host_gemm_plan&, const host_gemm_plan&) = default;

  /// The table of the file comment: the kernels for instruction set `isa` (oneDNN's effective one; baseline
  /// when oneDNN is not linked, `onednn_linked` false) and the user's `request`. Pure: the same inputs give
  /// the same plan on every machine. Throws precondition_error when oneDNN is requested but not linked.
  static host_gemm_plan choose(host_isa isa, bool onednn_linked, host_gemm_request request) {
    LOCKSTEP_EXPECTS(onednn_linked || request != host_gemm_request::onednn,
                     "LOCKSTEP_HOST_GEMM=onednn, but this program was built without oneDNN: install Debian's "
                     "libdnnl-dev and rebuild (lockstep's CMake package finds it), or unset LOCKSTEP_HOST_GEMM");
    host_gemm_plan p;
    p.isa = isa;
    p.request = request;
    const bool use_onednn = request == host_gemm_request::onednn ||
                            (request == host_gemm_request::automatic && onednn_linked && isa >= host_isa::avx2);
    if (use_onednn) {
      p.f32 = host_gemm_kernel::onednn;
      if (isa >= host_isa::avx512_bf16) p.bf16 = host_gemm_kernel::onednn;
    }
    return p;
  }

  /// The value of LOCKSTEP_HOST_GEMM (`auto`, `openblas` or `onednn`; unset or empty is `auto`). Throws
  /// precondition_error for any other value.
  static host_gemm_request parse_request(const char* value) {
    const std::string_view v = value ? value : "";
    if (v.empty() || v == "auto") return host_gemm_request::automatic;
    if (v == "openblas") return host_gemm_request::openblas;
    if (v == "onednn") return host_gemm_request::onednn;
    throw precondition_error(detail::concat("LOCKSTEP_HOST_GEMM='", v,
                                            "' is not a host GEMM choice: use auto (the default: the table of "
                                            "docs/blas.md), openblas or onednn"));
  }

  /// The plan of this process: the table for oneDNN's effective instruction set and LOCKSTEP_HOST_GEMM, chosen
  /// once (the first host blas_handle asks). Throws precondition_error for an invalid LOCKSTEP_HOST_GEMM.
  static const host_gemm_plan& process() {
    static const host_gemm_plan p = choose(linked_isa(), LOCKSTEP_HAS_ONEDNN != 0,
                                           parse_request(std::getenv("LOCKSTEP_HOST_GEMM")));
    return p;
  }

  /// The instruction set oneDNN generates code for (its effective ISA: the CPU's, lowered by
  /// ONEDNN_MAX_CPU_ISA), or baseline without oneDNN.
  static host_isa linked_isa() noexcept {
#if LOCKSTEP_HAS_ONEDNN
    const auto v = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    auto has = [v](unsigned mask) { return (v & mask) == mask; };
    if (has(dnnl_cpu_isa_avx512_core_amx)) return host_isa::amx;
    if (has(dnnl_cpu_isa_avx512_core_bf16)) return host_isa::avx512_bf16;
    if (has(dnnl_cpu_isa_avx512_core)) return host_isa::avx512;
    if (has(dnnl_cpu_isa_avx2)) return host_isa::avx2;
#endif
    return host_isa::baseline;
  }

  /// The kernel of dtype `t` (f32, f16 or bf16).
  [[nodiscard]] host_gemm_kernel for_dtype(dtype t) const noexcept {
    return t == dtype::bf16 ? bf16 : t == dtype::f16 ? f16 : f32;
  }

  /// OpenBLAS's name of its kernels ("Haswell", "SkylakeX", "Prescott", ...).
  static std::string openblas_core() {
    const char* name = openblas_get_corename();
    return name ? std::string(name) : std::string("unknown");
  }

  /// Whether OpenBLAS's kernels `core` use less of the CPU than `cpu` offers: its SSE kernels on an AVX2 or
  /// AVX-512 CPU, its AVX2 kernels on an AVX-512 CPU. Names as OpenBLAS 0.3.x's dynamic-arch build gives them.
  static bool openblas_below(std::string_view core, host_isa cpu) noexcept {
    auto any_of = [core](std::initializer_list<std::string_view> names) {
      for (auto n : names)
        if (core == n) return true;
      return false;
    };
    const bool avx512_core = any_of({"SkylakeX", "Cooperlake", "SapphireRapids"});
    const bool avx2_core = avx512_core || any_of({"Haswell", "Zen", "Excavator"});
    if (cpu >= host_isa::avx512) return !avx512_core;
    if (cpu >= host_isa::avx2) return !avx2_core;
    return false;
  }

  /// One line for people: "f32 oneDNN, bf16 oneDNN (AVX512-BF16), f16 via f32 (oneDNN); CPU: AVX2+FMA ...",
  /// with a warning when a GEMM runs on OpenBLAS kernels below the CPU, and how to fix it.
  [[nodiscard]] std::string str() const {
    const host_cpu_features& cpu = host_cpu_features::detect();
    const std::string core = openblas_core();
    const std::string f32_name = f32 == host_gemm_kernel::openblas ? "OpenBLAS (" + core + " kernels)"
                                                                     : std::string("oneDNN");
    auto dtype_line = [&](host_gemm_kernel k) {
      if (k == host_gemm_kernel::via_f32) return "via f32 (" + f32_name + ")";
      if (k == host_gemm_kernel::onednn) return detail::concat("oneDNN (", name_of(isa), ")");
      return f32_name;
    };
    std::string s = detail::concat("f32 ", f32_name, ", bf16 ", dtype_line(bf16), ", f16 ", dtype_line(f16),
                                   "; CPU: ", cpu.str());
    if (LOCKSTEP_HAS_ONEDNN) s += detail::concat("; oneDNN generates ", name_of(isa), " code");
    if (request != host_gemm_request::automatic) {
      s += detail::concat("; chosen by LOCKSTEP_HOST_GEMM=", request == host_gemm_request::openblas ? "openblas" : "onednn");
    }
    if (f32 == host_gemm_kernel::openblas && openblas_below(core, cpu.isa())) {
      s += detail::concat("; WARNING: OpenBLAS runs its ", core, " kernels on a CPU with ", name_of(cpu.isa()),
                          ", a fraction of its speed: ",
                          LOCKSTEP_HAS_ONEDNN ? "unset LOCKSTEP_HOST_GEMM (oneDNN is linked)"
                                              : "install Debian's libdnnl-dev and rebuild",
                          ", or set OPENBLAS_CORETYPE (e.g. ", cpu.isa() >= host_isa::avx512 ? "SkylakeX" : "Haswell",
                          ") before the program starts");
    }
    return s;
  }
};

LOCKSTEP_ABI_END
