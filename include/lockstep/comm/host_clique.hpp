// lockstep/comm/host_clique.hpp — collectives between the host devices of one process, through shared memory.
//
// A host clique is k communicators, one per host device. A collective is a task on the rank's stream worker.
// The k tasks of one collective (the n-th collective of every rank: sequence numbers are per clique and per
// rank, assigned when the collective is queued) meet in a rendezvous slot:
//
//   1. arrive: under the clique's mutex, check that this call matches the first rank's (kind, count, dtype, op,
//      root), and publish the send/recv pointers. The last rank to arrive commits the slot.
//   2. wait for the commit: spin briefly on an atomic, then block on a condition variable until the deadline
//      (arrival + timeout). A timeout, a mismatch or an abort fails the slot for every rank, under the mutex,
//      so that either all ranks go on to step 3 or none does.
//   3. work: every rank does its share, reading the others' buffers directly. all_reduce is a fused
//      reduce-scatter + all-gather: rank r reduces chunk r (1/k of the elements) of all k inputs, in f32, and
//      writes the result into chunk r of all k outputs, so every rank reads and writes about 2N bytes in total
//      (like a memcpy of N). reduce and reduce_scatter split the same way; broadcast and all_gather copy.
//      all_reduce_exact splits the same way too: rank r sums chunk r of every rank's terms exactly (copying its
//      peers' terms a piece at a time first) and writes the rounded values into chunk r of every output.
//      The loops work on blocks that stay in L1 (f16/bf16 are widened a block at a time and rounded once) and
//      vectorize; when the buffers cannot stay in the last-level cache the outputs are written with
//      non-temporal stores (see stream_outputs).
//   4. finish: wait until every rank has done its share (peers write into this rank's recv buffer, and read its
//      send buffer, until then), so that later work on the stream sees the final data and may reuse the buffers.
//
// A failed collective throws in the worker and surfaces at the next synchronization of the stream: timeout_error
// when a rank did not arrive in time (naming it), precondition_error when the ranks called different
// collectives (naming the difference), lockstep::error after abort() (with its reason). The clique stays usable
// after a timeout or a mismatch (the sequence numbers stay aligned); after abort() it is not.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>
#endif

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/device/device_set.hpp"
#include "lockstep/kernels/exact.hpp"
#include "lockstep/kernels/host_loop.hpp"  // host_has_avx2
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/stream.hpp"
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

// The 16-bit conversions are core/half.hpp's: branch-free on the host, so the block loops below vectorize.

template <class T>
[[gnu::always_inline]] inline void widen(float* __restrict dst, const T* __restrict src, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, half>) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = half_bits_to_float(src[i].bits);
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(std::uint32_t{src[i].bits} << 16);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  }
}

template <class T>
[[gnu::always_inline]] inline void narrow(T* __restrict dst, const float* __restrict src, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, half>) {
    for (std::size_t i = 0; i < n; ++i) dst[i].bits = float_to_half_bits(src[i]);
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    for (std::size_t i = 0; i < n; ++i) dst[i].bits = float_to_bfloat16_bits(src[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = convert<T>(src[i]);
  }
}

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
      bool aligned32 = host_has_avx2();
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
      widen(acc, inputs[0] + b, len);
      for (int r = 1; r < k; ++r) {
        widen(widened, inputs[r] + b, len);
        combine<Op>(acc, widened, len);
      }
    }
    if constexpr (Op == reduce_op::mean) {
      const float divisor = static_cast<float>(k);
      for (std::size_t i = 0; i < len; ++i) acc[i] /= divisor;
    }
    const void* result = acc;
    if constexpr (!std::is_same_v<T, float>) {
      narrow(rounded, acc, len);  // round once, copy m times
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
/// tensors (tensor 0 for the whole range when the call packs one). Shared with MPI.
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

/// recv[i] = NaN for i in [from, to) (all_reduce_exact's answer to a term outside the window). Shared with MPI.
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

/// The shared state of one clique: the rendezvous slots, keyed by sequence number.
class clique_state {
 public:
  clique_state(std::vector<device> devices, std::chrono::milliseconds timeout)
      : devices_(std::move(devices)), timeout_(timeout) {}

  [[nodiscard]] int size() const noexcept { return static_cast<int>(devices_.size()); }
  [[nodiscard]] device device_of(int rank) const { return devices_.at(static_cast<std::size_t>(rank)); }

  /// Runs rank `rank`'s part of collective `seq` (on the rank's stream worker). Throws on failure.
  void run(int rank, std::uint64_t seq, const collective_call& c) {
    const int k = size();
    slot* s = nullptr;
    bool committed_here = false;
    bool failed_here = false;
    {
      std::unique_lock lock(mutex_);
      auto& entry = slots_[seq];
      if (!entry) entry = std::make_unique<slot>();
      s = entry.get();
      const bool was_gathering = s->state.load(std::memory_order_relaxed) == gathering;
      if (was_gathering) {
        if (aborted_) {
          fail_locked(*s, failure::aborted, abort_reason_);
        } else if (s->first_rank < 0) {
          s->first = c;
          s->first_rank = rank;
        } else if (const std::string diff = s->first.difference(c); !diff.empty()) {
          // Name the lower rank first, so the message does not depend on who arrived first.
          const bool first_is_lower = s->first_rank < rank;
          const int lo = first_is_lower ? s->first_rank : rank, hi = first_is_lower ? rank : s->first_rank;
          const collective_call& lo_call = first_is_lower ? s->first : c;
          const collective_call& hi_call = first_is_lower ? c : s->first;
          fail_locked(
              *s, failure::mismatch,
              concat(rank_name(lo, device_of(lo)), " called ", lo_call.signature(), ", ", rank_name(hi, device_of(hi)),
                     " called ", hi_call.signature(), " (", lo_call.difference(hi_call), ')'));
        }
      }
      if (s->state.load(std::memory_order_relaxed) == gathering) {
        const auto r = static_cast<std::size_t>(rank);
        s->send[r] = c.send;
        s->recv[r] = c.recv;
        s->stride[r] = c.stride;
        s->arrived[r] = true;
        if (++s->arrivals == k) {
          s->state.store(committed, std::memory_order_release);
          committed_here = true;
        }
      }
      failed_here = was_gathering && s->state.load(std::memory_order_relaxed) == failed;
    }
    if (committed_here) {
      cv_.notify_all();
    } else {
      if (failed_here) cv_.notify_all();  // wake the ranks waiting for this slot: it failed (mismatch, abort)
      wait_for_commit(rank, seq, *s, c);  // throws (having left the slot) when the collective failed
    }
    if (c.kind != collective_kind::barrier) {
      work(rank, c, *s);
      wait_for_all_finished(rank, seq, *s, c);
      // all_reduce_exact: a term outside the window, in any rank's share, makes its tensor NaN; each rank writes
      // its own recv, now that no peer writes into it any more
      if (c.kind == collective_kind::all_reduce_exact && s->outside.load(std::memory_order_acquire) != 0) {
        std::lock_guard lock(s->outside_mutex);
        poison_exact_tensors(c, s->outside_of);
      }
    }
    std::lock_guard lock(mutex_);
    leave_locked(seq, *s);
  }

  /// Throws lockstep::error with the reason once the clique was aborted.
  void rethrow_failure(int rank) {
    std::lock_guard lock(mutex_);
    if (!aborted_) return;
    throw error(concat("the host clique of ", rank_name(rank, device_of(rank)), " was aborted: ", abort_reason_));
  }

  /// Fails every collective not yet committed, and every later one, with `reason`.
  void abort(const std::string& reason) {
    {
      std::lock_guard lock(mutex_);
      if (!aborted_) {
        aborted_ = true;
        abort_reason_ = reason;
      }
      for (auto& [seq, s] : slots_) {
        if (s->state.load(std::memory_order_relaxed) == gathering) fail_locked(*s, failure::aborted, abort_reason_);
      }
    }
    cv_.notify_all();
  }

 private:
  enum slot_state : int { gathering, committed, failed };
  enum class failure : std::uint8_t { none, mismatch, timeout, aborted };

  struct slot {
    collective_call first;  // the signature every rank must match
    int first_rank = -1;
    std::array<const void*, max_ranks> send{};
    std::array<void*, max_ranks> recv{};
    std::array<std::size_t, max_ranks> stride{};  // all_reduce_exact: each rank's distance between its terms
    std::array<bool, max_ranks> arrived{};
    int arrivals = 0;
    int left = 0;
    std::atomic<int> state{gathering};  // written under the mutex; read by spinning ranks without it
    std::atomic<int> finished{0};       // ranks that have done their share of the work
    // all_reduce_exact: whether any share met terms outside the exact window, and how many in each tensor
    mutable std::atomic<std::int64_t> outside{0};
    mutable std::mutex outside_mutex;
    mutable std::vector<std::int64_t> outside_of;
    failure why = failure::none;
    std::string detail;        // the mismatch, the abort reason
    std::vector<int> missing;  // ranks that had not arrived at a timeout
  };

  void fail_locked(slot& s, failure why, std::string detail) {
    s.why = why;
    s.detail = std::move(detail);
    if (why == failure::timeout) {
      for (int r = 0; r < size(); ++r) {
        if (!s.arrived[static_cast<std::size_t>(r)]) s.missing.push_back(r);
      }
    }
    s.state.store(failed, std::memory_order_release);
  }

  void leave_locked(std::uint64_t seq, slot& s) {
    if (++s.left == size()) slots_.erase(seq);
  }

  /// Builds the error of a failed slot as seen by `rank`, leaves the slot and throws it.
  [[noreturn]] void throw_failure_locked(int rank, std::uint64_t seq, slot& s, const collective_call& c) {
    const std::string where = concat(name_of(c.kind), " #", seq, " on ", rank_name(rank, device_of(rank)));
    const failure why = s.why;
    std::string text;
    if (why == failure::timeout) {
      std::string who;
      bool self_missing = false;
      for (std::size_t i = 0; i < s.missing.size(); ++i) {
        if (s.missing[i] == rank) self_missing = true;
        if (i > 0) who += ", ";
        who += i == 0 && s.missing.size() == 1 ? rank_name(s.missing[i], device_of(s.missing[i]))
                                               : concat(s.missing[i], " (", device_of(s.missing[i]).str(), ')');
      }
      const bool one = s.missing.size() == 1;
      text = concat(where, ": ", one ? "" : "ranks ", who, " did not join within ", format_duration(timeout_), "; ",
                    one ? "it" : "they",
                    " may have failed, exited or be stuck (timeout: comm_options::timeout or "
                    "LOCKSTEP_COMM_TIMEOUT)");
      if (self_missing) text += "; this rank arrived after the others had given up";
    } else if (why == failure::mismatch) {
      text = concat(where, ": the ranks called different collectives: ", s.detail,
                    "; every rank must issue the same collectives in the same order with the same count, dtype, op "
                    "and root");
    } else {
      text = concat(where, " was aborted: ", s.detail);
    }
    leave_locked(seq, s);  // `s` may be destroyed from here on
    if (why == failure::timeout) throw timeout_error(text);
    if (why == failure::mismatch) throw precondition_error(text);
    throw error(text);
  }

  void wait_for_commit(int rank, std::uint64_t seq, slot& s, const collective_call& c) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    if (spin_until([&] { return s.state.load(std::memory_order_acquire) != gathering; }) &&
        s.state.load(std::memory_order_acquire) == committed) {
      return;
    }
    std::unique_lock lock(mutex_);
    while (s.state.load(std::memory_order_relaxed) == gathering) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
          s.state.load(std::memory_order_relaxed) == gathering) {
        fail_locked(s, failure::timeout, {});
        lock.unlock();
        cv_.notify_all();
        lock.lock();
      }
    }
    if (s.state.load(std::memory_order_relaxed) == failed) throw_failure_locked(rank, seq, s, c);
  }

  /// Waits until every rank has done its share. Deliberately deaf to abort(): the peers are in the middle of
  /// plain memory loops that write into this rank's buffers and cannot block, so returning early would let the
  /// caller free or reuse buffers under them. The timeout stays as a guard against a bug.
  void wait_for_all_finished(int rank, std::uint64_t seq, slot& s, const collective_call& c) {
    const int k = size();
    if (s.finished.fetch_add(1, std::memory_order_acq_rel) + 1 == k) {
      { std::lock_guard lock(mutex_); }  // a rank that checked the count under the mutex is now waiting
      cv_.notify_all();
      return;
    }
    if (spin_until([&] { return s.finished.load(std::memory_order_acquire) == k; })) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::unique_lock lock(mutex_);
    if (!cv_.wait_until(lock, deadline, [&] { return s.finished.load(std::memory_order_acquire) == k; })) {
      throw timeout_error(concat(name_of(c.kind), " #", seq, " on ", rank_name(rank, device_of(rank)),
                                 ": the other ranks did not finish their share of the copy within ",
                                 format_duration(timeout_), " (a rank's worker thread is stalled)"));
    }
  }

  /// This rank's share of the data movement; runs once every rank has published its pointers.
  void work(int rank, const collective_call& c, const slot& s) const {
    const int k = size();
    const auto r = static_cast<std::size_t>(rank);
    const std::size_t es = size_of(c.type);
    switch (c.kind) {
      case collective_kind::all_reduce:
      case collective_kind::reduce: {
        const auto [begin, end] = chunk_of(c.count, k, rank, es);
        if (begin == end) return;
        std::array<const void*, max_ranks> in{};
        std::array<void*, max_ranks> out{};
        for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) in[j] = advance(s.send[j], begin * es);
        int outputs = 1;
        if (c.kind == collective_kind::all_reduce) {
          for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) out[j] = advance(s.recv[j], begin * es);
          outputs = k;
        } else {
          out[0] = advance(s.recv[static_cast<std::size_t>(c.root)], begin * es);
        }
        std::size_t distinct_outputs = 1;
        if (c.kind == collective_kind::all_reduce) {
          distinct_outputs = 0;
          for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) distinct_outputs += s.recv[j] != s.send[j];
        }
        const std::size_t touched = c.count * es * (static_cast<std::size_t>(k) + distinct_outputs);
        // All-reduce: this rank's own output through the cache, its peers' with streaming stores (see
        // stream_outputs).
        reduce_range(c.type, c.op, in.data(), k, out.data(), outputs, end - begin, stream_outputs(touched),
                     c.kind == collective_kind::all_reduce ? rank : -1);
        return;
      }
      case collective_kind::reduce_scatter: {
        if (c.count == 0) return;
        std::array<const void*, max_ranks> in{};
        for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) in[j] = advance(s.send[j], r * c.count * es);
        void* out = s.recv[r];
        const std::size_t touched = c.count * es * static_cast<std::size_t>(k) * static_cast<std::size_t>(k + 1);
        reduce_range(c.type, c.op, in.data(), k, &out, 1, c.count, stream_outputs(touched));
        return;
      }
      case collective_kind::broadcast: {
        const void* src = s.send[static_cast<std::size_t>(c.root)];
        if (c.count != 0 && s.recv[r] != src) std::memcpy(s.recv[r], src, c.count * es);
        return;
      }
      case collective_kind::all_gather: {
        if (c.count == 0) return;
        for (int j = 0; j < k; ++j) {
          void* dst = advance(s.recv[r], static_cast<std::size_t>(j) * c.count * es);
          const void* src = s.send[static_cast<std::size_t>(j)];
          if (dst != src) std::memcpy(dst, src, c.count * es);
        }
        return;
      }
      case collective_kind::all_reduce_exact: {
        // this rank's share of the elements: every rank's terms summed exactly, rounded once and written into
        // every rank's recv. A piece at a time, the peers' terms first copied into a buffer of this thread: a
        // memcpy streams another core's cache lines twice as fast as the sum's loop reading them in place.
        const auto [begin, end] = chunk_of(c.count, k, rank, es);
        if (begin == end) return;
        std::vector<std::int64_t> outside(std::max<std::size_t>(c.tensors, 1), 0);
        dispatch_floating(c.type, "all_reduce_exact", [&]<class T>() {
          const std::size_t terms = c.terms, peers = static_cast<std::size_t>(k - 1);
          const std::size_t piece = std::max<std::size_t>(16, (std::size_t{256} << 10) / (sizeof(T) * terms * std::max<std::size_t>(peers, 1)));
          thread_local std::vector<std::byte> staging;
          staging.resize(std::min(piece, end - begin) * terms * peers * sizeof(T));
          T* copies = reinterpret_cast<T*>(staging.data());
          for (std::size_t p0 = begin; p0 < end; p0 += piece) {
            const std::size_t len = std::min(piece, end - p0);
            for (std::size_t owner = 0, at = 0; owner < static_cast<std::size_t>(k); ++owner) {
              if (owner == r) continue;
              for (std::size_t t = 0; t < terms; ++t, ++at) {
                std::memcpy(copies + at * len, static_cast<const T*>(s.send[owner]) + t * s.stride[owner] + p0, len * sizeof(T));
              }
            }
            for_each_tensor_run(c, p0, p0 + len, [&](std::size_t tensor, std::size_t b, std::size_t e) {
              auto term = [&](std::size_t t) -> const T* {
                const std::size_t owner = t / terms, i = t % terms;
                if (owner == r) return static_cast<const T*>(s.send[owner]) + i * s.stride[owner] + b;
                return copies + ((owner < r ? owner : owner - 1) * terms + i) * len + (b - p0);
              };
              std::array<T*, max_ranks> out{};  // this rank's own first: the sums are written there, then copied
              for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
                out[j] = static_cast<T*>(s.recv[j == 0 ? r : (j <= r ? j - 1 : j)]) + b;
              }
              run_host_loop(e - b, kernels::exact_sums_host_op<T, decltype(term)>{
                                       term, terms * static_cast<std::size_t>(k), out.data(), k, &outside[tensor]});
            });
          }
        });
        if (std::any_of(outside.begin(), outside.end(), [](std::int64_t o) { return o != 0; })) {
          std::lock_guard lock(s.outside_mutex);
          s.outside_of.resize(outside.size(), 0);
          for (std::size_t j = 0; j < outside.size(); ++j) s.outside_of[j] += outside[j];
          s.outside.fetch_add(1, std::memory_order_acq_rel);
        }
        return;
      }
      case collective_kind::barrier:
        return;
    }
  }

  const std::vector<device> devices_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::unique_ptr<slot>> slots_;
  bool aborted_ = false;
  std::string abort_reason_;
};

/// One rank's endpoint of a host clique.
class clique_member final : public communicator_impl {
 public:
  clique_member(std::shared_ptr<clique_state> state, int rank) : state_(std::move(state)), rank_(rank) {}

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return state_->size(); }
  [[nodiscard]] device get_device() const noexcept override { return state_->device_of(rank_); }
  [[nodiscard]] bool supports(collective_kind) const noexcept override { return true; }

  void enqueue(const collective_call& c, stream_ref s) override {
    const std::uint64_t seq = next_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    host_backend::stream_state* on = &s.host_state();
    enqueue_host(
        s,
        [state = state_, rank = rank_, seq, c, on] {
          // Work this collective depends on failed: its buffers hold nothing valid. Fail the collective on every
          // rank (abort) rather than let the others complete a step with this rank's stale data.
          if (auto why = reason_not_to_run(*on, concat(name_of(c.kind), " #", seq, " on ",
                                                       rank_name(rank, state->device_of(rank))))) {
            state->abort(*why);
            throw error(*why);
          }
          state->run(rank, seq, c);
        },
        name_of(c.kind).data(), true);
  }

  void rethrow_failure() override { state_->rethrow_failure(rank_); }

  void abort(const std::string& reason) noexcept override {
    try {
      state_->abort(reason);
    } catch (...) {
      // Out of memory while copying the reason: nothing better can be done in a noexcept path.
    }
  }

 private:
  std::shared_ptr<clique_state> state_;  // shared with the other ranks and with queued collectives
  int rank_;
  std::atomic<std::uint64_t> next_seq_{0};
};

}  // namespace host_comm

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// One communicator per device of `devices` (host devices of this process), rank i on devices[i]. The ranks
/// exchange through shared memory; see the file comment for the algorithm. Collectives of the returned
/// communicators must be queued on streams of their own devices, one rank per thread or all from one thread
/// (they are stream-ordered, so one thread may queue every rank's part without deadlock). Throws
/// precondition_error when `devices` is empty, not of kind host, or the timeout is not positive.
inline std::vector<communicator> make_host_clique(const device_set& devices, comm_options options = {}) {
  LOCKSTEP_EXPECTS(!devices.empty(), "make_host_clique: the device set is empty");
  LOCKSTEP_EXPECTS(devices.kind() == device_kind::host, "make_host_clique: expected host devices, got ", devices.str(),
                   " (GPUs use make_nccl_clique)");
  LOCKSTEP_EXPECTS(options.timeout.count() > 0, "make_host_clique: comm_options::timeout must be positive, got ",
                   options.timeout.count(), " ms");
  auto state = std::make_shared<detail::host_comm::clique_state>(devices.devices(), options.timeout);
  std::vector<communicator> out;
  out.reserve(devices.size());
  for (int r = 0; r < state->size(); ++r) {
    out.push_back(communicator::from_impl(std::make_unique<detail::host_comm::clique_member>(state, r)));
  }
  return out;
}

LOCKSTEP_ABI_END
