// Shared by the communicator tests (test_comm: host cliques and NCCL in one process; test_comm_mpi: processes
// under mpirun): every rank's input, the reference result of a reduction, and exact comparisons.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/kernels/exact.hpp"

/// Expects two vectors to hold the same bits, showing the first elements of both otherwise.
#define EXPECT_SAME(actual, expected, what) \
  EXPECT_TRUE(comm_test::same_bits(actual, expected))  \
      << what << ": got " << comm_test::show(actual) << ", expected " << comm_test::show(expected)

namespace comm_test {

using namespace lockstep;

template <class T>
T value(long v) {
  if constexpr (is_storage_float_v<T>) {
    return convert<T>(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

/// Rank r's input element i: small integers (exact in f16/bf16 sums), both signs, rarely zero, different on
/// every rank; integers of the widest types also use their high bits.
template <class T>
std::vector<T> input(int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const long small = static_cast<long>((i * 7 + static_cast<std::size_t>(rank) * 13 + 3) % 17);
    if constexpr (is_storage_float_v<T>) {
      v[i] = value<T>(small - 8);
    } else if constexpr (std::is_same_v<T, std::uint8_t>) {
      v[i] = static_cast<T>(small * 13 + rank + 1);
    } else if constexpr (std::is_same_v<T, std::int64_t>) {
      v[i] = (static_cast<std::int64_t>(rank + 1) << 40) - small * 1000003;
    } else {
      v[i] = static_cast<T>(small * 100000 - rank);
    }
  }
  return v;
}

template <class T>
T sentinel() {
  return value<T>(99);
}

/// The reduction of the ranks' inputs as the library defines it: in f32, rounded once.
template <class T>
std::vector<T> reference(const std::vector<std::vector<T>>& in, reduce_op op, std::size_t offset, std::size_t n) {
  std::vector<T> out(n);
  const int k = static_cast<int>(in.size());
  for (std::size_t i = 0; i < n; ++i) {
    float acc = to_float(in[0][offset + i]);
    for (int r = 1; r < k; ++r) {
      const float x = to_float(in[static_cast<std::size_t>(r)][offset + i]);
      acc = op == reduce_op::max ? std::max(acc, x) : acc + x;
    }
    if (op == reduce_op::mean) acc /= static_cast<float>(k);
    out[i] = convert<T>(acc);
  }
  return out;
}

/// all_reduce_exact's inputs: term t (of all the ranks' terms, counted from rank 0's first) element i, of both
/// signs and of magnitudes from about 2^-40 to 2^24 (2^-24 to 2^12 in f16), so that many elements' sums take the
/// term-by-term path and some terms are rounded by the fixed point.
template <class T>
T exact_term(std::size_t t, std::size_t i) {
  const std::uint64_t h = (i * 2654435761u + t * 40503u + 17u) * 0x9e3779b97f4a7c15ull;
  const auto mantissa = static_cast<float>((h >> 8) % (1u << 20) + 1u);
  const bool is_half = std::is_same_v<T, lockstep::half>;
  const int low = is_half ? -24 : -40, span = is_half ? 37 : 65;
  const int e = static_cast<int>((h >> 40) % static_cast<std::uint64_t>(span)) + low - 20;
  const float v = std::ldexp(((h >> 63) != 0u ? -1.0f : 1.0f) * mantissa, e);
  return convert<T>(v);
}

/// The exact sum of terms [0, total) at each of n elements, rounded once (the scalar integer path of
/// kernels/exact.hpp: a reference independent of the vectorized double path).
template <class T>
std::vector<T> exact_reference(std::size_t total, std::size_t n) {
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::int64_t hi = 0, lo = 0, outside = 0;
    for (std::size_t t = 0; t < total; ++t) kernels::exact_add(to_float(exact_term<T>(t, i)), hi, lo, outside);
    out[i] = convert<T>(kernels::exact_detail::round_limbs_integer(hi, lo));
  }
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
std::string show(const std::vector<T>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size() && i < 12; ++i) {
    if (i) s += ", ";
    if constexpr (is_storage_float_v<T>) {
      s += std::to_string(to_float(v[i]));
    } else {
      s += std::to_string(static_cast<long long>(v[i]));
    }
  }
  return s + (v.size() > 12 ? ", ...]" : "]");
}

/// Calls f.template operator()<T>() for each T.
template <class... T, class F>
void for_each_type(F f) {
  (f.template operator()<T>(), ...);
}

/// Every reduction.
constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::mean, reduce_op::max};

}  // namespace comm_test
