// lockstep/data/sampler.hpp — the order in which an epoch visits a dataset's indices, on one process or split
// across the ranks of a distributed run.
//
// Shuffled orders are the same on every platform and with every compiler: they are a Fisher–Yates shuffle
// driven by SplitMix64 with an exactly specified bounded draw, never by std::shuffle or
// std::uniform_int_distribution, whose outputs the standard leaves to the implementation. Ranks of a
// distributed run (possibly built by different compilers) therefore agree on the permutation.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"

namespace lockstep {

/// Produces the order of one epoch.
///
/// - `s.size()`: how many indices `indices()` returns (per epoch; per rank for a distributed sampler).
/// - `s.set_epoch(e)`: selects epoch `e`; a shuffling sampler's order depends on it.
/// - `s.indices()`: the order for the current epoch, a `std::vector<std::size_t>` of `size()` dataset indices.
template <class S>
concept sampler = requires(S& s, const S& cs, std::uint64_t epoch) {
  { cs.size() } -> std::convertible_to<std::size_t>;
  s.set_epoch(epoch);
  { cs.indices() } -> std::same_as<std::vector<std::size_t>>;
};

/// Whether a distributed sampler shuffles.
enum class sample_order : std::uint8_t { sequential, shuffled };

/// What a distributed sampler does when the dataset does not split evenly across the ranks: `pad` repeats
/// indices from the start of the order so every rank gets ceil(n / world_size); `drop` leaves out the last
/// n mod world_size indices of the order so every rank gets floor(n / world_size).
enum class tail_policy : std::uint8_t { pad, drop };

namespace detail {

/// SplitMix64's output function (Steele, Lea and Flood, 2014; Vigna's splitmix64.c): a bijection on 64 bits.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// The SplitMix64 generator, bit for bit as in Vigna's reference splitmix64.c.
class splitmix64 {
 public:
  constexpr explicit splitmix64(std::uint64_t state) noexcept : state_(state) {}

  /// The next 64-bit output.
  constexpr std::uint64_t next() noexcept {
    state_ += 0x9E3779B97F4A7C15ULL;
    return mix64(state_);
  }

  /// Uniform in [0, bound), without bias: outputs below 2^64 mod bound are rejected, so the accepted range is
  /// a whole number of copies of [0, bound). Precondition: bound >= 1.
  constexpr std::uint64_t below(std::uint64_t bound) noexcept {
    const std::uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
    for (;;) {
      const std::uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }

 private:
  std::uint64_t state_;
};

/// The permutation of 0..n-1 for (seed, epoch), identical on every platform:
///   state = mix64(mix64(seed) ^ epoch); order = 0, 1, ..., n-1;
///   for i = n-1 down to 1: j = splitmix64(state).below(i + 1); swap(order[i], order[j]).
inline std::vector<std::size_t> shuffled_indices(std::size_t n, std::uint64_t seed, std::uint64_t epoch) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  splitmix64 rng(mix64(mix64(seed) ^ epoch));
  for (std::size_t i = n; i > 1; --i) {
    const auto j = static_cast<std::size_t>(rng.below(i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

}  // namespace detail

/// Visits 0, 1, ..., n-1 in order, every epoch.
class sequential_sampler {
 public:
  /// `n` is the dataset's size.
  explicit sequential_sampler(std::size_t n) noexcept : n_(n) {}

  /// n.
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  /// Records the epoch; the order does not depend on it.
  void set_epoch(std::uint64_t epoch) noexcept { epoch_ = epoch; }
  /// The current epoch.
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// 0, 1, ..., n-1. O(n).
  [[nodiscard]] std::vector<std::size_t> indices() const {
    std::vector<std::size_t> order(n_);
    std::iota(order.begin(), order.end(), std::size_t{0});
    return order;
  }

 private:
  std::size_t n_;
  std::uint64_t epoch_ = 0;
};

/// Visits a permutation of 0..n-1 that depends only on (seed, epoch): the same on every platform and compiler
/// (the algorithm is spelled out at `detail::shuffled_indices`), different for each epoch. Call `set_epoch`
/// before each epoch, as with PyTorch's samplers.
class random_sampler {
 public:
  /// `n` is the dataset's size.
  random_sampler(std::size_t n, std::uint64_t seed) noexcept : n_(n), seed_(seed) {}

  /// n.
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  /// Selects the epoch whose permutation `indices()` returns.
  void set_epoch(std::uint64_t epoch) noexcept { epoch_ = epoch; }
  /// The current epoch.
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// The seed.
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }
  /// The permutation for (seed, epoch). O(n); computed on each call.
  [[nodiscard]] std::vector<std::size_t> indices() const { return detail::shuffled_indices(n_, seed_, epoch_); }

 private:
  std::size_t n_;
  std::uint64_t seed_;
  std::uint64_t epoch_ = 0;
};

/// Splits each epoch's order of 0..n-1 across the ranks of a distributed run, with the semantics of PyTorch's
/// DistributedSampler: every rank builds the same order (shuffled by (seed, epoch) as `random_sampler` does, or
/// sequential), brings it to `total_size()` entries (padding by repeating entries from the start of the order,
/// cyclically when n < world_size, or dropping the tail; see `tail_policy`), and takes entries
/// rank, rank + world_size, rank + 2 * world_size, ... So with `pad` the ranks together cover every index, and
/// with n divisible by world_size they are disjoint. The shuffled order is lockstep's, not bit-identical to
/// PyTorch's.
class distributed_sampler {
 public:
  /// Preconditions (precondition_error, naming the values): n >= 1, world_size >= 1, 0 <= rank < world_size.
  /// The defaults are PyTorch's (shuffle, seed 0, keep every sample by padding).
  distributed_sampler(std::size_t n, int rank, int world_size, sample_order order = sample_order::shuffled,
                      std::uint64_t seed = 0, tail_policy tail = tail_policy::pad)
      : n_(n), rank_(rank), world_size_(world_size), order_(order), seed_(seed), tail_(tail) {
    LOCKSTEP_EXPECTS(world_size >= 1, "distributed_sampler: world_size must be at least 1, got ", world_size);
    LOCKSTEP_EXPECTS(rank >= 0 && rank < world_size, "distributed_sampler: rank ", rank,
                     " is out of range for world_size ", world_size, "; ranks are 0 to ", world_size - 1);
    LOCKSTEP_EXPECTS(n >= 1, "distributed_sampler: the dataset must hold at least one sample, got n = ", n);
  }

  /// Indices this rank visits per epoch: ceil(n / world_size) with `pad`, floor(n / world_size) with `drop`
  /// (0 when n < world_size); after set_start(first), the same of the n - first entries left.
  [[nodiscard]] std::size_t size() const noexcept {
    const std::size_t left = start_ < n_ ? n_ - start_ : 0;
    const auto world = static_cast<std::size_t>(world_size_);
    return tail_ == tail_policy::pad ? (left + world - 1) / world : left / world;
  }
  /// Entries of the padded or truncated order over all ranks: size() * world_size.
  [[nodiscard]] std::size_t total_size() const noexcept { return size() * static_cast<std::size_t>(world_size_); }
  /// Resumes an epoch: indices() leaves out the first `first` entries of the epoch's order (the samples a run,
  /// of any number of ranks, trained on before it stopped) and splits the rest over this run's ranks, padded
  /// or truncated as usual. 0 (the default) is the whole epoch. It stays until changed: set it back to 0
  /// before the next epoch.
  void set_start(std::size_t first) noexcept { start_ = first; }
  /// The entries left out by set_start.
  [[nodiscard]] std::size_t start() const noexcept { return start_; }
  /// Selects the epoch; every rank must set the same one to get a consistent split.
  void set_epoch(std::uint64_t epoch) noexcept { epoch_ = epoch; }
  /// The current epoch.
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// This process's rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The number of ranks.
  [[nodiscard]] int world_size() const noexcept { return world_size_; }
  /// Shuffled or sequential.
  [[nodiscard]] sample_order order() const noexcept { return order_; }
  /// Pad or drop.
  [[nodiscard]] tail_policy tail() const noexcept { return tail_; }
  /// The seed.
  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }

  /// This rank's indices for the current epoch, in visiting order. O(n) time and memory; computed on each call.
  [[nodiscard]] std::vector<std::size_t> indices() const {
    std::vector<std::size_t> order;
    if (order_ == sample_order::shuffled) {
      order = detail::shuffled_indices(n_, seed_, epoch_);
    } else {
      order.resize(n_);
      std::iota(order.begin(), order.end(), std::size_t{0});
    }
    const auto world = static_cast<std::size_t>(world_size_);
    const std::size_t total = total_size();
    const std::size_t first = start_ < n_ ? start_ : n_;
    std::vector<std::size_t> mine;
    mine.reserve(size());
    // Entry k of the padded order is order[k % n]: PyTorch pads with indices * ceil(padding / n), cut to size.
    // A resumed epoch takes the same entries: with the same world size, `first` is a multiple of it and the
    // padded order ends where the uninterrupted epoch's does.
    for (std::size_t k = static_cast<std::size_t>(rank_); k < total; k += world) mine.push_back(order[(first + k) % n_]);
    return mine;
  }

 private:
  std::size_t n_;
  int rank_;
  int world_size_;
  sample_order order_;
  std::uint64_t seed_;
  tail_policy tail_;
  std::size_t start_ = 0;
  std::uint64_t epoch_ = 0;
};

static_assert(sampler<sequential_sampler>);
static_assert(sampler<random_sampler>);
static_assert(sampler<distributed_sampler>);

}  // namespace lockstep
