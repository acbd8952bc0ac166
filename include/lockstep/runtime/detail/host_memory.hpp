// lockstep/runtime/detail/host_memory.hpp — the memory of one host virtual device.
//
// Each host device has its own accounting and limit, so that running out of memory on host:1 fails like a
// full GPU does, and a caching pool, so that a steady-state training step takes no memory from the system
// (what cudaMallocAsync's pool does on a GPU).
//
// Frees are stream-ordered, like cudaFreeAsync: a block freed on stream s becomes reusable by any stream once
// the work queued on s before the free has run, and by s itself at once (its later work runs after).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/core/units.hpp"
#include "lockstep/device/host_platform.hpp"
#include "lockstep/runtime/detail/host_stream.hpp"

namespace lockstep {

/// Memory statistics of one device.
struct memory_stats {
  std::uint64_t bytes_in_use = 0;         // held by live allocations (rounded to the pool's granularity)
  std::uint64_t peak_bytes_in_use = 0;    // since start or the last reset
  std::uint64_t bytes_reserved = 0;       // taken from the system: in use plus cached
  std::uint64_t peak_bytes_reserved = 0;  // since start or the last reset
  std::uint64_t allocations = 0;          // allocation requests served since start or the last reset
  std::uint64_t frees = 0;                // deallocations since start or the last reset
  std::uint64_t system_allocations = 0;   // requests that had to take memory from the system (malloc/cudaMalloc)
  std::uint64_t live_allocations = 0;     // allocations not yet freed
  std::uint64_t limit = 0;                // capacity of the device (0 when unknown)
};

namespace host_backend {

/// Granularity of pool blocks, and alignment of every allocation (as cudaMalloc guarantees 256 B).
inline constexpr std::size_t allocation_granularity = 256;

/// The live allocation of a host device that holds an address.
struct block_owner {
  int device;
  const void* base;
  std::size_t size;
};

/// Which host device's live allocation holds an address: what lets host_strictness::strict refuse a kernel on
/// host:1 that touches host:0's memory, as a GPU would fault. Kept by every device's pool in strict mode only.
/// Adding never allocates: a pool takes a node (make_node) before it changes anything, and gets it back on free.
class address_registry {
  struct entry {
    std::uintptr_t end;
    int device;
  };
  using map = std::map<std::uintptr_t, entry>;

 public:
  using node = map::node_type;

  static address_registry& instance() {
    static address_registry r;
    return r;
  }

  /// A free node for a later add. `owner` (the caller's address) is a key no block can have while it lives.
  /// Throws std::bad_alloc; changes nothing then.
  [[nodiscard]] node make_node(const void* owner) {
    std::unique_lock lock(mutex_);
    return blocks_.extract(blocks_.emplace(address(owner), entry{}).first);
  }

  /// Records [p, p + size) as memory of `device`, in `n` (from make_node or remove; left empty).
  void add(node& n, const void* p, std::size_t size, int device) noexcept {
    n.key() = address(p);
    n.mapped() = entry{address(p) + size, device};
    std::unique_lock lock(mutex_);
    blocks_.erase(address(p));  // a stale entry, if any
    blocks_.insert(std::move(n));
  }

  /// Forgets the block at `p`; returns its node for reuse (empty if `p` was not recorded).
  node remove(const void* p) noexcept {
    std::unique_lock lock(mutex_);
    return blocks_.extract(address(p));
  }

  /// The live block holding `p`, if any host device's pool handed it out.
  [[nodiscard]] std::optional<block_owner> find(const void* p) const {
    const std::uintptr_t a = address(p);
    std::shared_lock lock(mutex_);
    auto it = blocks_.upper_bound(a);
    if (it == blocks_.begin()) return std::nullopt;
    --it;
    if (a >= it->second.end) return std::nullopt;
    return block_owner{it->second.device, reinterpret_cast<const void*>(it->first), it->second.end - it->first};
  }

 private:
  static std::uintptr_t address(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p); }

  mutable std::shared_mutex mutex_;
  map blocks_;  // start -> (end, device) of every live block, as requested (not rounded up)
};

class device_memory {
 public:
  /// host_strictness::strict: live blocks are registered in the address_registry.
  device_memory(int device, std::uint64_t limit, host_strictness strictness = host_strictness::lenient)
      : device_(device), limit_(limit), track_addresses_(strictness == host_strictness::strict) {}
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  ~device_memory() {
    for (auto& [size, p] : free_) ::operator delete(p, std::align_val_t{allocation_granularity});
    for (auto& b : pending_) {
      ::operator delete(b.ptr, std::align_val_t{allocation_granularity});
      b.stream->drop_ref();
    }
    // Live blocks at exit are the owners' leaks; they are not freed behind their backs.
  }

  /// Returns `bytes` (> 0) of memory usable by work queued on `s` (nullptr: any stream, after the caller
  /// synchronized). Throws out_of_memory_error naming the device, the request, the usage and the limit.
  void* allocate(std::size_t bytes, const stream_state* s) {
    const std::size_t size = round_up(bytes);
    std::unique_lock lock(mutex_);
    if (track_addresses_ && spare_.empty()) spare_ = address_registry::instance().make_node(this);  // may throw
    collect_pending_locked();
    void* p = take_cached_locked(size, s);
    if (!p) {
      if (reserved_ + size > limit_) {
        wait_pending(lock);
        p = take_cached_locked(size, s);
      }
    }
    if (!p) {
      if (reserved_ + size > limit_) release_cached_locked();
      if (reserved_ + size > limit_) {
        throw out_of_memory_error(detail::concat(
            "host:", device_, " is out of memory: tried to allocate ", format_bytes(bytes), "; ",
            format_bytes(in_use_), " in use by live allocations, ", format_bytes(reserved_ - in_use_),
            " cached, limit ", format_bytes(limit_),
            " (set by LOCKSTEP_HOST_DEVICE_MEMORY or configure_host_platform)"));
      }
      p = ::operator new(size, std::align_val_t{allocation_granularity}, std::nothrow);
      if (!p) {
        throw out_of_memory_error(detail::concat("host:", device_, " could not obtain ", format_bytes(size),
                                                 " from the system allocator (", format_bytes(reserved_),
                                                 " already reserved)"));
      }
      reserved_ += size;
      peak_reserved_ = std::max(peak_reserved_, reserved_);
      ++system_allocations_;
      live_.emplace(p, size);
    }
    // The requested bytes, not the block: strict mode then sees a span that runs into a block's slack.
    if (track_addresses_) address_registry::instance().add(spare_, p, bytes, device_);
    in_use_ += live_.at(p);
    peak_in_use_ = std::max(peak_in_use_, in_use_);
    ++allocations_;
    return p;
  }

  /// Returns `p` to the pool once the work queued on `s` so far has run (s == nullptr: at once).
  void deallocate(void* p, const stream_state* s) noexcept {
    if (!p) return;
    std::lock_guard lock(mutex_);
    auto it = live_.find(p);
    if (it == live_.end()) return;  // not ours: a caller bug, but destructors must not throw
    const std::size_t size = it->second;
    in_use_ -= size;
    ++frees_;
    live_.erase(it);
    if (track_addresses_) {
      auto n = address_registry::instance().remove(p);
      if (spare_.empty()) spare_ = std::move(n);
    }
    if (s == nullptr || s->idle()) {
      free_.emplace(size, p);
    } else {
      s->add_ref();
      pending_.push_back(pending_block{p, size, s, s->enqueued()});
    }
  }

  /// Hands every block pending on `s` to the free list; `s` is being destroyed after draining its work.
  void on_stream_destroyed(const stream_state* s) noexcept {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < pending_.size();) {
      if (pending_[i].stream == s) {
        free_.emplace(pending_[i].size, pending_[i].ptr);
        s->drop_ref();  // not the last: the stream being shut down still holds its own
        pending_[i] = pending_.back();
        pending_.pop_back();
      } else {
        ++i;
      }
    }
  }

  /// Gives cached blocks back to the system (after waiting for blocks whose free is still pending).
  void release_cached() {
    std::unique_lock lock(mutex_);
    wait_pending(lock);
    release_cached_locked();
  }

  [[nodiscard]] memory_stats stats() const {
    std::lock_guard lock(mutex_);
    memory_stats st;
    st.bytes_in_use = in_use_;
    st.peak_bytes_in_use = peak_in_use_;
    st.bytes_reserved = reserved_;
    st.peak_bytes_reserved = peak_reserved_;
    st.allocations = allocations_;
    st.frees = frees_;
    st.system_allocations = system_allocations_;
    st.live_allocations = live_.size();
    st.limit = limit_;
    return st;
  }

  /// Resets peaks to the current values and the counters to zero.
  void reset_stats() {
    std::lock_guard lock(mutex_);
    peak_in_use_ = in_use_;
    peak_reserved_ = reserved_;
    allocations_ = frees_ = system_allocations_ = 0;
  }

  [[nodiscard]] std::uint64_t limit() const noexcept { return limit_; }

 private:
  struct pending_block {
    void* ptr;
    std::size_t size;
    const stream_state* stream;
    std::uint64_t fence;  // usable by others once stream->completed() >= fence
  };

  static std::size_t round_up(std::size_t bytes) {
    LOCKSTEP_EXPECTS(bytes <= (std::size_t{1} << 48), "allocation of ", bytes, " bytes is not plausible");
    return (bytes + allocation_granularity - 1) / allocation_granularity * allocation_granularity;
  }

  // A block is reused for a request if it is at most a quarter larger: enough to absorb small changes of size
  // (padding, a few rows) without counting much more than the request as in use, as a GPU's pool counts the
  // request (a block up to twice the request, the rule until 2026-12-06, let a rank's half-sized gradient shard
  // take the whole parameter's freed block, and ZeRO's reported peaks differ by rank).
  static bool fits(std::size_t block, std::size_t request) { return block >= request && block - request <= request / 4; }

  void* take_cached_locked(std::size_t size, const stream_state* s) {
    if (auto it = free_.lower_bound(size); it != free_.end() && fits(it->first, size)) {
      const std::size_t block = it->first;
      void* p = it->second;
      free_.erase(it);
      live_.emplace(p, block);
      return p;
    }
    // A block freed on the requesting stream is safe for it at once: its earlier work runs first.
    if (s != nullptr) {
      for (std::size_t i = 0; i < pending_.size(); ++i) {
        if (pending_[i].stream == s && fits(pending_[i].size, size)) {
          void* p = pending_[i].ptr;
          live_.emplace(p, pending_[i].size);
          pending_[i].stream->drop_ref();
          pending_[i] = pending_.back();
          pending_.pop_back();
          return p;
        }
      }
    }
    return nullptr;
  }

  void collect_pending_locked() {
    for (std::size_t i = 0; i < pending_.size();) {
      if (pending_[i].stream->completed() >= pending_[i].fence) {
        free_.emplace(pending_[i].size, pending_[i].ptr);
        pending_[i].stream->drop_ref();
        pending_[i] = pending_.back();
        pending_.pop_back();
      } else {
        ++i;
      }
    }
  }

  // Waits, without holding the pool's lock (queued work may free memory meanwhile), until the streams of
  // the pending blocks have passed their frees. A block pending on the calling worker's own stream stays
  // pending: waiting for ourselves would never end.
  void wait_pending(std::unique_lock<std::mutex>& lock) {
    std::vector<std::pair<const stream_state*, std::uint64_t>> fences;
    for (auto& b : pending_) {
      if (b.stream->on_worker()) continue;
      b.stream->add_ref();
      fences.emplace_back(b.stream, b.fence);
    }
    lock.unlock();
    for (auto [stream, fence] : fences) {
      stream->wait_for(fence);
      stream->drop_ref();
    }
    lock.lock();
    collect_pending_locked();
  }

  void release_cached_locked() {
    for (auto& [size, p] : free_) {
      ::operator delete(p, std::align_val_t{allocation_granularity});
      reserved_ -= size;
    }
    free_.clear();
  }

  const int device_;
  const std::uint64_t limit_;
  const bool track_addresses_;
  address_registry::node spare_;  // for the next allocation's registry entry (strict mode)
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;      // cached blocks by size
  std::vector<pending_block> pending_;          // freed, waiting for their stream to pass the free
  std::unordered_map<void*, std::size_t> live_;  // block -> size
  std::uint64_t in_use_ = 0, peak_in_use_ = 0, reserved_ = 0, peak_reserved_ = 0;
  std::uint64_t allocations_ = 0, frees_ = 0, system_allocations_ = 0;
};

}  // namespace host_backend
}  // namespace lockstep
