// lockstep/core/random.hpp — counter-based random numbers that are the same on the host and on the device.
//
// Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3", SC11; the
// Random123 library) is a keyed bijection of a 128-bit counter: the i-th random number is a pure function of
// (key, i), with no state to carry between threads or devices. It uses only 32-bit integer multiplies, xors
// and adds, so the host and every GPU produce the same bits, and `uniform_float` maps them to floats exactly.
// That is what lets a dropout mask drawn on a GPU be reproduced on the CPU from the same seed.
//
// The stateless helpers (`philox_uniform4`, `philox_uniform`) use this layout:
//   key     = {seed lo, seed hi}
//   counter = {block lo, block hi, offset lo, offset hi}, block = index / 4
// and element `index` of a stream is word `index % 4` of the block `index / 4`. `offset` names an independent
// stream under one seed (say, one per dropout layer and step). A kernel that draws four elements per call
// and one that draws a single element therefore produce the same numbers for the same indices.
#pragma once

#include <cstdint>

#include "lockstep/config.hpp"

LOCKSTEP_ABI_BEGIN

/// The 64-bit key of a Philox4x32 generator.
struct philox_key {
  std::uint32_t k0;
  std::uint32_t k1;
};

/// Four 32-bit words: a Philox counter, or the random words it maps to.
struct uint4x32 {
  std::uint32_t v[4];
};

/// Four floats, uniform in [0, 1).
struct float4x32 {
  float v[4];
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// Philox4x32 with `Rounds` rounds (Random123's philox4x32_R): the key is bumped by the Weyl constants
/// before every round but the first.
template <int Rounds>
LOCKSTEP_HD constexpr uint4x32 philox4x32_rounds(uint4x32 ctr, philox_key key) noexcept {
  constexpr std::uint32_t multiplier0 = 0xD2511F53u;
  constexpr std::uint32_t multiplier1 = 0xCD9E8D57u;
  constexpr std::uint32_t weyl0 = 0x9E3779B9u;  // 2^32 / golden ratio
  constexpr std::uint32_t weyl1 = 0xBB67AE85u;  // 2^32 * (sqrt(3) - 1)
  for (int round = 0; round < Rounds; ++round) {
    if (round != 0) {
      key.k0 += weyl0;
      key.k1 += weyl1;
    }
    // One 32x32->64 multiply gives both halves (nvcc emits a single mul.wide.u32).
    const std::uint64_t p0 = std::uint64_t{multiplier0} * ctr.v[0];
    const std::uint64_t p1 = std::uint64_t{multiplier1} * ctr.v[2];
    const auto hi0 = static_cast<std::uint32_t>(p0 >> 32);
    const auto lo0 = static_cast<std::uint32_t>(p0);
    const auto hi1 = static_cast<std::uint32_t>(p1 >> 32);
    const auto lo1 = static_cast<std::uint32_t>(p1);
    ctr = uint4x32{{hi1 ^ ctr.v[1] ^ key.k0, lo1, hi0 ^ ctr.v[3] ^ key.k1, lo0}};
  }
  return ctr;
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Philox4x32-10: the four random words for `counter` under `key`. Pure, constexpr, identical on host and
/// device. Matches Random123's known-answer vectors (counter 0, key 0: 6627e8d5 e169c58d bc57ac4c 9b00dbd8).
LOCKSTEP_HD constexpr uint4x32 philox4x32_10(uint4x32 counter, philox_key key) noexcept {
  return detail::philox4x32_rounds<10>(counter, key);
}

/// Maps 32 random bits to a float uniform in [0, 1): the top 24 bits times 2^-24. Every result is a multiple
/// of 2^-24, computed exactly, so host and device agree bit for bit. The largest result is 1 - 2^-24.
LOCKSTEP_HD constexpr float uniform_float(std::uint32_t bits) noexcept {
  return static_cast<float>(bits >> 8) * 0x1p-24f;
}

/// The four random words of block `block` of stream `offset` under `seed` (layout in the file comment).
LOCKSTEP_HD constexpr uint4x32 philox_block(std::uint64_t seed, std::uint64_t offset,
                                            std::uint64_t block) noexcept {
  const philox_key key{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
  const uint4x32 counter{{static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                          static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(offset >> 32)}};
  return philox4x32_10(counter, key);
}

/// Uniform floats in [0, 1) for elements 4 * block .. 4 * block + 3 of stream `offset` under `seed`.
LOCKSTEP_HD constexpr float4x32 philox_uniform4(std::uint64_t seed, std::uint64_t offset,
                                                std::uint64_t block) noexcept {
  const uint4x32 r = philox_block(seed, offset, block);
  return float4x32{
      {uniform_float(r.v[0]), uniform_float(r.v[1]), uniform_float(r.v[2]), uniform_float(r.v[3])}};
}

/// The uniform float in [0, 1) for element `index` of stream `offset` under `seed`: word `index % 4` of block
/// `index / 4`, so `philox_uniform(s, o, 4 * b + j) == philox_uniform4(s, o, b).v[j]`. Costs one Philox call;
/// a kernel that needs consecutive elements should call `philox_uniform4` once per four.
LOCKSTEP_HD constexpr float philox_uniform(std::uint64_t seed, std::uint64_t offset,
                                           std::uint64_t index) noexcept {
  return uniform_float(philox_block(seed, offset, index >> 2).v[index & 3u]);
}

LOCKSTEP_ABI_END
