// lockstep/comm/detail/host_reduce.hpp — the host's reduction arithmetic, shared by the host clique
// (comm/host_clique.hpp) and the MPI communicator (comm/mpi.hpp): f16/bf16 widened to f32 a block at a time and
// rounded once, the vectorized combine loops, streaming stores for buffers larger than the last-level cache,
// the split of a collective into per-rank chunks, and all_reduce_exact's per-tensor runs and NaN poisoning.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>
#endif

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/kernels/host_loop.hpp"  // LOCKSTEP_HOST_AVX2_CLONES, cpu_has_avx2
#include "lockstep/runtime/tensor.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

LOCKSTEP_DETAIL_BEGIN

namespace host_comm {

/// Host devices are at most 64 (host_platform.hpp), so are the ranks of a clique.
inline constexpr int max_ranks = 64;

/// Elements per block of a reduction: the f32 accumulator (8 KiB) and a widened input stay in L1.
inline constexpr std::size_t block_elements = 2048;

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// ---- the inner loops. Plain loops over restrict pointers and a constant op: the compiler vectorizes them. ----

/// acc[i] = x[i] op y[i].
template <reduce_op Op>
[[gnu::always_inline]] inline void combine2(float* __restrict acc, const float* __restrict x, const float* __restrict y,
                                            std::size_t n) noexcept {
  if constexpr (Op == reduce_op::max) {
    // NaN-propagating: a NaN gradient must not vanish in a max (the loss scaler looks for it).
    for (std::size_t i = 0; i < n; ++i) acc[i] = (x[i] > y[i] || x[i] != x[i]) ? x[i] : y[i];
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] = x[i] + y[i];
  }
}

/// acc[i] = acc[i] op x[i].
template <reduce_op Op>
[[gnu::always_inline]] inline void combine(float* __restrict acc, const float* __restrict x, std::size_t n) noexcept {
  if constexpr (Op == reduce_op::max) {
    for (std::size_t i = 0; i < n; ++i) acc[i] = (acc[i] > x[i] || acc[i] != acc[i]) ? acc[i] : x[i];
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
  }
}

// The 16-bit conversions are core/half_runs.hpp's: AVX2 and F16C where the CPU has them (chosen at run time), else
// core/half.hpp's branch-free loops; the same bits either way. Built for baseline x86-64, the loops here had run
// 4 lanes of SSE2 with the bf16 rounding's packing done in shuffles: a bf16 all-reduce of a 784-1024-1024-10
// gradient took 14% of a DDP step's samples on 2 host devices (an Intel Xeon with AMX, whose bf16 GEMMs are fast).

/// The size of the last-level cache (sysconf), or 32 MiB when the system does not say.
/// The last-level cache one core can use: LOCKSTEP_HOST_LLC_BYTES when set to a positive number of bytes (for
/// machines whose reported L3 is not what a core sees: a VM may report every core complex's L3 together, 508 MiB
/// on a 2-core AMD EPYC guest), else the L3 size the C library reports, else 32 MiB.
inline std::size_t last_level_cache_bytes() noexcept {
  static const std::size_t bytes = [] {
    if (const char* text = std::getenv("LOCKSTEP_HOST_LLC_BYTES"); text != nullptr && *text != '\0') {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(text, &end, 10);
      if (end != text && *end == '\0' && v > 0) return static_cast<std::size_t>(v);
    }
    long l3 = -1;
#if defined(_SC_LEVEL3_CACHE_SIZE)
    l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return l3 > 0 ? static_cast<std::size_t>(l3) : std::size_t{32} << 20;
  }();
  return bytes;
}

/// Whether a reduction that touches `bytes` in total (every rank's inputs and distinct outputs) writes its
/// outputs with non-temporal stores. When the buffers cannot all stay in the last-level cache, streaming stores
/// skip the read-for-ownership of every output line (a third of the memory traffic); when they can, ordinary
/// stores keep the result in cache for the work that reads it next (measured: an in-place all-reduce of 16 MiB
/// on 2 ranks, 32 MiB touched with a 35 MiB L3, runs 1.5x faster without streaming; out of place, 64 MiB
/// touched, slightly faster with it). When a rank writes several outputs (an all-reduce), its own output still
/// goes through the cache and only its peers' are streamed: a core then has ordinary stores (whose reads for
/// ownership the L2 prefetches) and write-combined ones in flight at once. Measured out of place on 2 ranks,
/// 16 to 64 MiB: 10-15% faster than streaming both outputs; with one output, either way is as fast.
inline bool stream_outputs(std::size_t bytes) noexcept { return bytes > last_level_cache_bytes(); }

/// memcpy with non-temporal stores where the ISA has them; callers fence once at the end (store_fence).
inline void copy_streaming(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(__SSE2__)
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  const std::size_t head = std::min(bytes, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  for (; bytes >= 16; bytes -= 16, d += 16, s += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  std::memcpy(d, s, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}

/// Orders earlier non-temporal stores before later stores (they are weakly ordered on x86).
inline void store_fence() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// outputs[j][i] = op over r < k of inputs[r][i], for i < n and j < m. An output may be one of the inputs (in
/// place): each block is read from every input before it is written to any output.
#if defined(__SSE2__)
/// a op b on four floats (max NaN-propagating, as combine()).
template <reduce_op Op>
inline __m128 combine4(__m128 a, __m128 b) noexcept {
  if constexpr (Op == reduce_op::max) {
    const __m128 take_a = _mm_or_ps(_mm_cmpgt_ps(a, b), _mm_cmpunord_ps(a, a));
    return _mm_or_ps(_mm_and_ps(take_a, a), _mm_andnot_ps(take_a, b));
  } else {
    return _mm_add_ps(a, b);
  }
}

/// The f32 reduction for buffers that do not fit in the cache, in one pass: each input is read once and each
/// output written once, with non-temporal stores straight from registers. Written with SSE2 intrinsics because
/// the compiler does not emit non-temporal stores from plain C++; it is 10-15% faster than the block loop
/// followed by copy_streaming (16 MiB out of place on 2 ranks). Outputs must be 16-byte aligned and must not
/// alias an input (in place, a streaming store would evict the line the next load reads: 5x slower).
/// outputs[cached] (when 0 <= cached < m) is written with ordinary stores: see stream_outputs. Elements before
/// `first` (a multiple of 4) are left alone.
template <reduce_op Op>
void reduce_range_streaming(const float* const* inputs, int k, float* const* outputs, int m, std::size_t n,
                            int cached, std::size_t first = 0) noexcept {
  const __m128 divisor = _mm_set1_ps(static_cast<float>(k));
  const std::size_t n4 = n - n % 4;
  std::size_t i = first;
  for (; i < n4; i += 4) {
    __m128 v = _mm_loadu_ps(inputs[0] + i);
    for (int r = 1; r < k; ++r) v = combine4<Op>(v, _mm_loadu_ps(inputs[r] + i));
    if constexpr (Op == reduce_op::mean) v = _mm_div_ps(v, divisor);
    for (int j = 0; j < m; ++j) {
      if (j == cached) {
        _mm_store_ps(outputs[j] + i, v);
      } else {
        _mm_stream_ps(outputs[j] + i, v);
      }
    }
  }
  for (; i < n; ++i) {
    float acc = inputs[0][i];
    for (int r = 1; r < k; ++r) {
      const float x = inputs[r][i];
      if constexpr (Op == reduce_op::max) {
        acc = (acc > x || acc != acc) ? acc : x;
      } else {
        acc += x;
      }
    }
    if constexpr (Op == reduce_op::mean) acc /= static_cast<float>(k);
    for (int j = 0; j < m; ++j) outputs[j][i] = acc;
  }
  _mm_sfence();
}

#if LOCKSTEP_HOST_AVX2_CLONES
/// a op b on eight floats (max NaN-propagating, as combine()).
template <reduce_op Op>
__attribute__((target("avx2"))) inline __m256 combine8(__m256 a, __m256 b) noexcept {
  if constexpr (Op == reduce_op::max) {
    return _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
  } else {
    return _mm256_add_ps(a, b);
  }
}

/// reduce_range_streaming a cache line at a time: each output gets a whole 64-byte line (two 32-byte
/// non-temporal stores) before the next output, so every write-combining buffer leaves full. Measured on 2
/// ranks, 16 and 64 MiB out of place: 15-20% faster than 16-byte stores alternating between the outputs.
/// Chosen at run time where the CPU has AVX2; outputs must be 32-byte aligned.
template <reduce_op Op>
__attribute__((target("avx2"))) void reduce_range_streaming_avx2(const float* const* inputs, int k, float* const* outputs,
                                                                  int m, std::size_t n, int cached) noexcept {
  const __m256 divisor = _mm256_set1_ps(static_cast<float>(k));
  const std::size_t lines = n - n % 16;
  for (std::size_t i = 0; i < lines; i += 16) {
    __m256 lo = _mm256_loadu_ps(inputs[0] + i);
    __m256 hi = _mm256_loadu_ps(inputs[0] + i + 8);
    for (int r = 1; r < k; ++r) {
      lo = combine8<Op>(lo, _mm256_loadu_ps(inputs[r] + i));
      hi = combine8<Op>(hi, _mm256_loadu_ps(inputs[r] + i + 8));
    }
    if constexpr (Op == reduce_op::mean) {
      lo = _mm256_div_ps(lo, divisor);
      hi = _mm256_div_ps(hi, divisor);
    }
    for (int j = 0; j < m; ++j) {
      if (j == cached) {
        _mm256_store_ps(outputs[j] + i, lo);
        _mm256_store_ps(outputs[j] + i + 8, hi);
      } else {
        _mm256_stream_ps(outputs[j] + i, lo);
        _mm256_stream_ps(outputs[j] + i + 8, hi);
      }
    }
  }
  reduce_range_streaming<Op>(inputs, k, outputs, m, n, cached, lines);  // the last partial line, and the fence
}
#endif
#endif

template <class T, reduce_op Op>
void reduce_range(const T* const* inputs, int k, T* const* outputs, int m, std::size_t n, bool streaming,
                  int cached) noexcept {
#if defined(__SSE2__)
  if constexpr (std::is_same_v<T, float>) {
    bool one_pass = streaming;
    for (int j = 0; j < m && one_pass; ++j) {
      one_pass = reinterpret_cast<std::uintptr_t>(outputs[j]) % 16 == 0;
      for (int r = 0; r < k && one_pass; ++r) one_pass = outputs[j] != inputs[r];
    }
    if (one_pass) {
#if LOCKSTEP_HOST_AVX2_CLONES
      bool aligned32 = cpu_has_avx2();
      for (int j = 0; j < m && aligned32; ++j) aligned32 = reinterpret_cast<std::uintptr_t>(outputs[j]) % 32 == 0;
      if (aligned32) return reduce_range_streaming_avx2<Op>(inputs, k, outputs, m, n, cached);
#endif
      return reduce_range_streaming<Op>(inputs, k, outputs, m, n, cached);
    }
  }
#endif
  alignas(64) float acc[block_elements];
  alignas(64) float widened[block_elements];
  alignas(64) T rounded[block_elements];
  // `len` is a compile-time constant for full blocks: with a known trip count the loops vectorize at -O2 as
  // well (GCC's -O2 cost model vectorizes only loops that need no scalar epilogue). The last partial block,
  // if any, takes the runtime-length path.
  auto block = [&](std::size_t b, auto len) {
    if constexpr (std::is_same_v<T, float>) {
      if (k == 1) {
        std::memcpy(acc, inputs[0] + b, len * sizeof(float));
      } else {
        combine2<Op>(acc, inputs[0] + b, inputs[1] + b, len);
        for (int r = 2; r < k; ++r) combine<Op>(acc, inputs[r] + b, len);
      }
    } else {
      widen_run(inputs[0] + b, acc, static_cast<std::int64_t>(len));
      for (int r = 1; r < k; ++r) {
        widen_run(inputs[r] + b, widened, static_cast<std::int64_t>(len));
        combine<Op>(acc, widened, len);
      }
    }
    if constexpr (Op == reduce_op::mean) {
      const float divisor = static_cast<float>(k);
      for (std::size_t i = 0; i < len; ++i) acc[i] /= divisor;
    }
    const void* result = acc;
    if constexpr (!std::is_same_v<T, float>) {
      narrow_run(acc, rounded, static_cast<std::int64_t>(len));  // round once, copy m times
      result = rounded;
    }
    for (int j = 0; j < m; ++j) {
      if (streaming && j != cached) {
        copy_streaming(outputs[j] + b, result, len * sizeof(T));
      } else {
        std::memcpy(outputs[j] + b, result, len * sizeof(T));
      }
    }
  };
  std::size_t b = 0;
  for (; n - b >= block_elements; b += block_elements) block(b, std::integral_constant<std::size_t, block_elements>{});
  if (b < n) block(b, n - b);
  if (streaming) store_fence();
}

/// i64 sum or max: exact integer arithmetic (in rank order, like the floats; the order does not matter).
inline void reduce_range_i64(reduce_op op, const void* const* inputs, int k, void* const* outputs, int m,
                             std::size_t n) noexcept {
  constexpr std::size_t block = 1024;
  std::int64_t acc[block];
  for (std::size_t b = 0; b < n; b += block) {
    const std::size_t len = std::min(block, n - b);
    std::memcpy(acc, static_cast<const std::int64_t*>(inputs[0]) + b, len * sizeof(std::int64_t));
    for (int r = 1; r < k; ++r) {
      const std::int64_t* x = static_cast<const std::int64_t*>(inputs[r]) + b;
      if (op == reduce_op::max) {
        for (std::size_t i = 0; i < len; ++i) acc[i] = std::max(acc[i], x[i]);
      } else {
        // unsigned addition wraps instead of being undefined; exact whenever the true sum fits
        for (std::size_t i = 0; i < len; ++i) {
          acc[i] = static_cast<std::int64_t>(static_cast<std::uint64_t>(acc[i]) + static_cast<std::uint64_t>(x[i]));
        }
      }
    }
    for (int j = 0; j < m; ++j) std::memcpy(static_cast<std::int64_t*>(outputs[j]) + b, acc, len * sizeof(std::int64_t));
  }
}

/// The reduction for a dtype and an op: the one dispatch of the host clique.
/// With `streaming`, outputs[cached] (if 0 <= cached < m) is still written through the cache.
inline void reduce_range(dtype type, reduce_op op, const void* const* inputs, int k, void* const* outputs, int m,
                         std::size_t n, bool streaming, int cached = -1) {
  auto typed = [&]<class T>() {
    std::array<const T*, max_ranks> in{};
    std::array<T*, max_ranks> out{};
    for (int r = 0; r < k; ++r) in[static_cast<std::size_t>(r)] = static_cast<const T*>(inputs[r]);
    for (int j = 0; j < m; ++j) out[static_cast<std::size_t>(j)] = static_cast<T*>(outputs[j]);
    switch (op) {
      case reduce_op::sum:
        return reduce_range<T, reduce_op::sum>(in.data(), k, out.data(), m, n, streaming, cached);
      case reduce_op::mean:
        return reduce_range<T, reduce_op::mean>(in.data(), k, out.data(), m, n, streaming, cached);
      case reduce_op::max:
        return reduce_range<T, reduce_op::max>(in.data(), k, out.data(), m, n, streaming, cached);
    }
  };
  switch (type) {
    case dtype::f32:
      return typed.template operator()<float>();
    case dtype::f16:
      return typed.template operator()<half>();
    case dtype::bf16:
      return typed.template operator()<bfloat16>();
    case dtype::i64:
      if (op != reduce_op::mean) return reduce_range_i64(op, inputs, k, outputs, m, n);
      break;
    default:
      break;
  }
  throw precondition_error(concat("host clique: cannot reduce dtype ", name_of(type), " with ", name_of(op)));
}

/// Elements [begin, end) of chunk r of n elements split over k ranks; chunk boundaries fall on 64-byte
/// multiples so that no two ranks write the same cache line of an output and every chunk starts aligned.
inline std::pair<std::size_t, std::size_t> chunk_of(std::size_t n, int k, int r, std::size_t element_size) {
  const std::size_t unit = std::max<std::size_t>(1, 64 / element_size);
  const std::size_t units = n / unit + (n % unit != 0 ? 1 : 0);
  const auto uk = static_cast<std::size_t>(k);
  auto start = [&](std::size_t i) { return std::min(n, ((units / uk) * i + std::min(i, units % uk)) * unit); };
  return {start(static_cast<std::size_t>(r)), start(static_cast<std::size_t>(r) + 1)};
}

template <class T>
inline T* advance(T* p, std::size_t bytes) noexcept {
  if constexpr (std::is_const_v<T>) {
    return static_cast<T*>(static_cast<const std::byte*>(p) + bytes);
  } else {
    return static_cast<T*>(static_cast<std::byte*>(p) + bytes);
  }
}

/// Spins for a short while until `done()` is true; false when it is still false afterwards. Spinning first
/// keeps a collective whose ranks arrive together off the kernel's futex path; blocking afterwards keeps a
/// waiting rank from burning a core that its peers need.
template <class Done>
bool spin_until(Done done) {
  constexpr auto spin_time = std::chrono::microseconds(50);
  const auto start = std::chrono::steady_clock::now();
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() - start > spin_time) return false;
  }
}

/// Calls f(tensor, b, e) for the runs of elements [begin, end) of an all_reduce_exact that lie in one of its
/// tensors (tensor 0 for the whole range when the call packs one).
template <class F>
void for_each_tensor_run(const collective_call& c, std::size_t begin, std::size_t end, F&& f) {
  if (c.tensors == 0) {
    if (begin < end) f(std::size_t{0}, begin, end);
    return;
  }
  auto j = static_cast<std::size_t>(std::upper_bound(c.ends, c.ends + c.tensors, begin) - c.ends);
  for (std::size_t b = begin; b < end && j < c.tensors; ++j) {
    const std::size_t e = std::min(end, c.ends[j]);
    if (e > b) f(j, b, e);
    b = std::max(b, e);
  }
}

/// recv[i] = NaN for i in [from, to) (all_reduce_exact's answer to a term outside the window).
inline void poison_exact(dtype type, void* recv, std::size_t from, std::size_t to) {
  dispatch_floating(type, "all_reduce_exact", [&]<class T>() {
    std::fill(static_cast<T*>(recv) + from, static_cast<T*>(recv) + to, convert<T>(std::numeric_limits<float>::quiet_NaN()));
  });
}

/// Poisons, in recv, the tensors of all_reduce_exact `c` whose count of terms outside the window is not 0
/// (outside[j] for tensor j; outside[0] for the whole of a call that packs one tensor).
inline void poison_exact_tensors(const collective_call& c, const std::vector<std::int64_t>& outside) {
  if (c.tensors == 0) {
    if (!outside.empty() && outside[0] != 0) poison_exact(c.type, c.recv, 0, c.count);
    return;
  }
  for (std::size_t j = 0; j < c.tensors && j < outside.size(); ++j) {
    if (outside[j] != 0) poison_exact(c.type, c.recv, j == 0 ? 0 : c.ends[j - 1], c.ends[j]);
  }
}

}  // namespace host_comm

LOCKSTEP_DETAIL_END
