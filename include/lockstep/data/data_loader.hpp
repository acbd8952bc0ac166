// lockstep/data/data_loader.hpp — batches of a dataset on a device, in the sampler's order, assembled by worker
// threads in pinned host memory and copied to the device ahead of their use (PyTorch's DataLoader with
// num_workers and pin_memory, done with streams and events).
//
// Threading model
// ---------------
//   The training thread (the one thread that calls start_epoch() and next()) never waits for a device. In
//   next() it records, on the compute stream, that the previous batch is done with; queues on the loader's
//   copy stream the host-to-device copy of every batch the workers have finished, in batch order; and makes
//   the compute stream wait for the copy of the batch it returns (an event), so that work queued on the
//   compute stream after next() reads the batch, while the host goes on at once.
//
//   Worker threads (options.workers of them, started by the constructor and alive until the destructor) claim
//   whole batches in order: batch k holds the sampler's positions [k * batch_size, (k + 1) * batch_size).
//   A worker first waits until the pinned slot it assembles into has been copied out of (the copy event of
//   the slot's previous batch), then fetches each sample straight into its row, converting f32 inputs to
//   options.input_type. Workers finish out of order; next() delivers batches 0, 1, 2, ... all the same.
//   They check for cancellation between samples.
//
//   The copy stream (owned by the loader, on the compute stream's device) runs the copies. Before it copies
//   into a device slot it waits for the event the compute stream recorded when the slot's previous batch was
//   released, so a slot is never overwritten while queued work may still read it.
//
// Prefetch
// --------
//   `prefetch` (P) is how many batches beyond the one being trained on may be in flight at once: being
//   assembled, waiting in pinned memory, or copied to the device. While the user holds batch k, workers work
//   on batches k+1 .. k+P at most and then wait. The loader owns P pinned slots and P + 1 device slots (the
//   batch in use plus P ahead) of batch_size rows each, all allocated by the constructor: no device memory is
//   allocated afterwards. A smaller last batch is a view of the first rows of its slot. Workers beyond P have
//   nothing to do: for W busy workers, set prefetch >= W.
//
// Lifetime of a batch
// -------------------
//   The tensors of a batch returned by next() are views of a device slot. They are valid for work queued on
//   the compute stream until the next call to next() or start_epoch(), or the loader's destruction; work on
//   another stream must first wait for an event recorded on the compute stream after next() returned.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"
#include "lockstep/core/shape.hpp"
#include "lockstep/core/thread_name.hpp"
#include "lockstep/data/dataset.hpp"
#include "lockstep/data/sampler.hpp"
#include "lockstep/device/host_platform.hpp"
#include "lockstep/device/query.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/device_buffer.hpp"
#include "lockstep/runtime/pinned_buffer.hpp"
#include "lockstep/runtime/stream.hpp"
#include "lockstep/runtime/tensor.hpp"

namespace lockstep {

/// What an epoch does with the samples left over when the sampler's size is not a multiple of the batch size:
/// `keep` delivers them as a smaller last batch, `drop` leaves them out.
enum class last_batch : std::uint8_t { keep, drop };

/// How a data_loader batches, converts and stages.
struct data_loader_options {
  /// Samples per batch; at least 1.
  std::size_t batch_size = 128;
  /// Worker threads; 0 picks min(4 x device_count_hint, the cores this process may run on), at least 1.
  int workers = 0;
  /// The GPU count of the "4 workers per GPU" rule of thumb behind the default worker count; at least 1.
  int device_count_hint = 1;
  /// Batches staged ahead of the one being trained on (see the file comment); 0 means max(2, workers), so that
  /// every worker has a batch to assemble; values below 2 are raised to 2, so that one batch can be copied
  /// while the next is assembled.
  std::size_t prefetch = 0;
  /// A smaller last batch, or none.
  last_batch tail = last_batch::keep;
  /// The dtype of the inputs on the device. A dataset with f32 inputs may ask for f16 or bf16 (mixed precision):
  /// workers convert in pinned memory, rounding to nearest even (`convert<T>`). Otherwise it must equal the
  /// dataset's input type.
  dtype input_type = dtype::f32;
};

namespace detail {

/// A data_loader's geometry, checked and resolved from the dataset's layout and the options.
struct loader_plan {
  std::size_t batch_size = 0;
  int workers = 0;
  std::size_t prefetch = 0;  // P: pinned slots; device slots are P + 1
  last_batch tail = last_batch::keep;
  dtype input_type = dtype::f32;   // on the device
  dtype target_type = dtype::i32;  // on the device, as the dataset writes it
  bool convert = false;            // f32 from the dataset, converted to input_type by the workers
  std::vector<std::size_t> input_dims;   // one sample's
  std::vector<std::size_t> target_dims;  // one sample's; {} for a scalar
  std::size_t input_elements = 0;        // per sample
  std::size_t fetch_input_bytes = 0;     // per sample, as the dataset writes it
  std::size_t input_row_bytes = 0;       // per sample, in input_type
  std::size_t target_row_bytes = 0;      // per sample

  /// Batches in an epoch of `n` samples.
  [[nodiscard]] std::size_t batches_for(std::size_t n) const noexcept {
    return tail == last_batch::keep ? (n + batch_size - 1) / batch_size : n / batch_size;
  }
};

/// Checks the options against the layout (precondition_error saying what is wrong and how to fix it) and
/// resolves the defaults.
inline loader_plan make_loader_plan(const sample_layout& layout, const data_loader_options& options) {
  LOCKSTEP_EXPECTS(options.batch_size >= 1, "data_loader: batch_size must be at least 1, got 0");
  LOCKSTEP_EXPECTS(options.workers >= 0, "data_loader: workers must be >= 0 (0 picks a default), got ",
                   options.workers);
  LOCKSTEP_EXPECTS(options.device_count_hint >= 1 && options.device_count_hint <= 4096,
                   "data_loader: device_count_hint must be 1 to 4096, got ", options.device_count_hint);
  LOCKSTEP_EXPECTS(layout.input_shape.size() <= static_cast<std::size_t>(shape::max_rank - 1),
                   "data_loader: a sample's input has shape ", format_dims(layout.input_shape), " of rank ",
                   layout.input_shape.size(), "; with the batch dimension a tensor has at most ", shape::max_rank,
                   " dimensions, so a sample has at most ", shape::max_rank - 1, " (flatten it in the dataset)");
  LOCKSTEP_EXPECTS(layout.target_shape.size() <= static_cast<std::size_t>(shape::max_rank - 1),
                   "data_loader: a sample's target has shape ", format_dims(layout.target_shape), " of rank ",
                   layout.target_shape.size(), "; with the batch dimension a tensor has at most ",
                   shape::max_rank, " dimensions, so a sample has at most ", shape::max_rank - 1);
  const bool convert = options.input_type != layout.input_type;
  if (convert) {
    LOCKSTEP_EXPECTS(layout.input_type == dtype::f32, "data_loader: options.input_type is ",
                     name_of(options.input_type), " but the dataset's inputs are ", name_of(layout.input_type),
                     "; the loader converts only f32 inputs (to f16 or bf16): set options.input_type = dtype::",
                     name_of(layout.input_type));
    LOCKSTEP_EXPECTS(options.input_type == dtype::f16 || options.input_type == dtype::bf16,
                     "data_loader: options.input_type is ", name_of(options.input_type),
                     "; f32 inputs convert to f16 or bf16 only (or stay f32)");
  }

  loader_plan plan;
  plan.batch_size = options.batch_size;
  if (options.workers > 0) {
    plan.workers = options.workers;
  } else {
    const auto cores = static_cast<std::int64_t>(detail::host_cores());  // its affinity mask's (taskset, mpirun)
    plan.workers = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(4 * options.device_count_hint,
                                                                                       cores)));
  }
  plan.prefetch = std::max<std::size_t>(
      options.prefetch == 0 ? static_cast<std::size_t>(plan.workers) : options.prefetch, 2);
  plan.tail = options.tail;
  plan.input_type = options.input_type;
  plan.target_type = layout.target_type;
  plan.convert = convert;
  plan.input_dims = layout.input_shape;
  plan.target_dims = layout.target_shape;
  for (std::size_t d : plan.input_dims) {
    LOCKSTEP_EXPECTS(d <= static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()),
                     "data_loader: input dimension ", d, " does not fit a tensor shape");
  }
  for (std::size_t d : plan.target_dims) {
    LOCKSTEP_EXPECTS(d <= static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()),
                     "data_loader: target dimension ", d, " does not fit a tensor shape");
  }
  plan.input_elements = layout.input_elements();
  plan.fetch_input_bytes = layout.input_bytes();
  plan.input_row_bytes = plan.input_elements * size_of(plan.input_type);
  plan.target_row_bytes = layout.target_bytes();
  const std::size_t row_bytes = std::max({plan.fetch_input_bytes, plan.input_row_bytes, plan.target_row_bytes,
                                          std::size_t{1}});
  LOCKSTEP_EXPECTS(plan.batch_size <= (std::size_t{1} << 48) / row_bytes, "data_loader: a batch of ",
                   plan.batch_size, " samples of ", row_bytes, " bytes is not plausible");
  return plan;
}

/// [rows, dims...]; the plan has checked that dims has at most three entries that fit an int64.
inline shape batch_shape(std::int64_t rows, const std::vector<std::size_t>& dims) {
  const auto d = [&](std::size_t i) { return static_cast<std::int64_t>(dims[i]); };
  switch (dims.size()) {
    case 0: return shape{rows};
    case 1: return shape{rows, d(0)};
    case 2: return shape{rows, d(0), d(1)};
    default: return shape{rows, d(0), d(1), d(2)};
  }
}

/// Why a worker could not assemble a batch; turned into a data_error by next() for that batch.
struct batch_failure {
  std::exception_ptr error;
  std::string message;                // the original exception's what()
  std::optional<std::size_t> sample;  // the dataset index being fetched (none: waiting for the staging slot)
  std::size_t row = 0;                // the sample's row in the batch
  int worker = 0;
};

}  // namespace detail

}  // namespace lockstep

LOCKSTEP_ABI_BEGIN

/// One batch on the device, as returned by data_loader::next(). The tensors are views of a slot of the loader:
/// see "Lifetime of a batch" in the file comment.
struct batch {
  tensor_view input;   // [rows, input_shape...] of options.input_type
  tensor_view target;  // [rows, target_shape...] of the dataset's target type ([rows] for a scalar target)
  std::int64_t rows = 0;
  std::size_t index = 0;  // batch number within the epoch: 0, 1, 2, ...
};

/// Batches of `D` in the order of `S`, delivered on the device of a compute stream. See the file comment for
/// the threading model and what prefetch means. Not copyable or movable (its workers point at it). The loader
/// is used by one thread; the dataset must outlive it and its `fetch` must be safe to call concurrently.
///
///   data_loader loader(train_set, random_sampler(train_set.size(), seed), ctx.stream(), {.batch_size = 256});
///   for (std::uint64_t epoch = 0; epoch < epochs; ++epoch) {
///     loader.start_epoch(epoch);
///     while (std::optional<batch> b = loader.next()) step(b->input, b->target);  // queued on ctx.stream()
///   }
template <dataset D, sampler S>
class data_loader {
 public:
  /// Starts the workers and allocates the pinned and device slots; produces nothing until start_epoch(). The
  /// dataset and the compute stream must outlive the loader.
  /// Throws precondition_error when an option is invalid or does not fit the dataset's layout (see
  /// data_loader_options), device_error when the compute stream's device does not exist, out_of_memory_error
  /// when the slots do not fit.
  data_loader(const D& data, S order, stream_ref compute, data_loader_options options = {})
      : dataset_(&data),
        sampler_(std::move(order)),
        compute_(checked_stream(compute)),
        plan_(detail::make_loader_plan(data.layout(), options)),
        dataset_size_(static_cast<std::size_t>(data.size())),
        copy_stream_(compute.get_device()) {
    const std::size_t slots = plan_.prefetch;
    const device dev = compute_.get_device();
    for (std::size_t p = 0; p < slots; ++p) {
      pinned_inputs_.emplace_back(plan_.batch_size * plan_.input_row_bytes, dev);
      pinned_targets_.emplace_back(plan_.batch_size * plan_.target_row_bytes, dev);
      copied_.emplace_back(dev);
      staging_.emplace_back();
    }
    const auto rows = static_cast<std::int64_t>(plan_.batch_size);
    for (std::size_t d = 0; d < slots + 1; ++d) {
      consumed_.emplace_back(dev);
      device_inputs_.emplace_back(detail::batch_shape(rows, plan_.input_dims), plan_.input_type, copy_stream_);
      device_targets_.emplace_back(detail::batch_shape(rows, plan_.target_dims), plan_.target_type, copy_stream_);
    }
    try {
      workers_.reserve(static_cast<std::size_t>(plan_.workers));
      for (int w = 0; w < plan_.workers; ++w) workers_.emplace_back([this, w] { work(w); });
    } catch (...) {
      stop_workers();
      throw;
    }
  }

  data_loader(const data_loader&) = delete;
  data_loader& operator=(const data_loader&) = delete;

  /// Stops the workers (each within one sample) and joins them, even mid-epoch; then waits for the copy stream
  /// to finish its queued copies, which wait in turn for the compute stream to be done with every batch handed
  /// out. Never throws.
  ~data_loader() {
    stop_workers();
    try {
      // Device slots are freed in stream order on the copy stream: after the compute stream is done with them.
      if (held_) consumed_[held_slot_].record(compute_);
      for (const event& e : consumed_) copy_stream_.wait(e);
    } catch (...) {
      // A failing record or wait leaves nothing better to do in a destructor.
    }
    try {
      // Pinned memory must outlive the copies that read it (cudaFreeHost does not wait for them).
      copy_stream_.synchronize();
    } catch (...) {
      // An error kept by the copy stream has nobody left to report it to.
    }
  }

  /// Selects epoch `epoch` of the sampler (`set_epoch`) and starts producing its batches. An unfinished epoch
  /// is cancelled first: its workers stop within one sample and are waited for; the batch last returned by
  /// next() is released. Throws precondition_error when the sampler yields an index outside the dataset (naming
  /// its position and value); the loader then has no epoch in progress.
  ///
  /// `skip` resumes an epoch: the first `skip` entries of the epoch's global order are left out (a
  /// distributed_sampler splits what is left over its ranks, so a run may resume on another number of ranks;
  /// other samplers drop them from the front). Batches are then counted from the resumed position.
  void start_epoch(std::uint64_t epoch, std::size_t skip = 0) {
    release_held();
    {
      std::unique_lock lock(mutex_);
      cancel_locked(lock, phase::idle);
    }
    sampler_.set_epoch(epoch);
    std::vector<std::size_t> order;
    if constexpr (requires { sampler_.set_start(skip); }) {
      sampler_.set_start(skip);
      order = sampler_.indices();
      sampler_.set_start(0);
    } else {
      order = sampler_.indices();
      order.erase(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(std::min(skip, order.size())));
    }
    for (std::size_t i = 0; i < order.size(); ++i) {
      LOCKSTEP_EXPECTS(order[i] < dataset_size_, "data_loader: the sampler's index ", order[i], " at position ", i,
                       " of epoch ", epoch, " is out of range for a dataset of ", dataset_size_,
                       " samples; build the sampler with the dataset's size");
    }
    {
      std::lock_guard lock(mutex_);
      order_ = std::move(order);
      batches_ = plan_.batches_for(order_.size());
      epoch_ = epoch;
      next_claim_ = 0;
      delivered_ = 0;
      copies_queued_ = 0;
      for (staging_slot& s : staging_) s = staging_slot{};
      phase_ = phase::running;
    }
    work_ready_.notify_all();
  }

  /// The next batch of the epoch in sampler order, or nullopt at its end (and on every call after it). Releases
  /// the batch returned before (see "Lifetime of a batch"). Blocks only until the workers have assembled the
  /// batch, and never on a device itself: work queued on the compute stream after this call waits for the copy.
  /// (Workers reuse a pinned slot once its copy has run, so a host more than `prefetch` batches ahead of the
  /// device waits for it there: that is the back-pressure.)
  /// Throws data_error when a worker could not assemble this batch (the message names the dataset index, the
  /// batch, the worker and the original message, which stays nested); the epoch is then over and
  /// start_epoch() starts another. Throws precondition_error when no epoch was started.
  std::optional<batch> next() {
    LOCKSTEP_EXPECTS(phase_ != phase::idle,
                     "data_loader::next(): no epoch in progress; call start_epoch(epoch) before each epoch");
    LOCKSTEP_EXPECTS(phase_ != phase::failed, "data_loader::next(): epoch ", epoch_,
                     " ended with an error (thrown by an earlier next()); call start_epoch(epoch) to go on");
    release_held();
    const std::size_t k = delivered_;
    if (phase_ == phase::finished || k == batches_) {
      std::lock_guard lock(mutex_);
      phase_ = phase::finished;
      return std::nullopt;
    }

    std::unique_lock lock(mutex_);
    batch_done_.wait(lock, [&] { return copies_queued_ > k || staging_[k % plan_.prefetch].finished(k); });
    if (copies_queued_ == k && staging_[k % plan_.prefetch].status == slot_status::failed) {
      detail::batch_failure failure = std::move(staging_[k % plan_.prefetch].failure);
      cancel_locked(lock, phase::failed);
      lock.unlock();
      throw_failure(failure, k);
    }
    // Every batch assembled so far, in order: their copies may start while batch k trains.
    const std::size_t first = copies_queued_;
    std::size_t last = first;
    while (last < batches_ && staging_[last % plan_.prefetch].ready(last)) ++last;
    lock.unlock();

    try {
      for (std::size_t j = first; j < last; ++j) queue_copy(j);
      copies_queued_ = last;
      compute_.wait(copied_[k % plan_.prefetch]);
    } catch (...) {
      lock.lock();
      cancel_locked(lock, phase::failed);
      throw;
    }

    lock.lock();
    delivered_ = k + 1;
    lock.unlock();
    work_ready_.notify_all();

    const std::size_t slot = k % (plan_.prefetch + 1);
    held_ = true;
    held_slot_ = slot;
    const auto rows = static_cast<std::int64_t>(rows_of(k));
    return batch{device_inputs_[slot].view().slice_rows(0, rows), device_targets_[slot].view().slice_rows(0, rows),
                 rows, k};
  }

  /// Batches in an epoch of the sampler's current size: ceil(size / batch_size) with last_batch::keep,
  /// floor(size / batch_size) with drop.
  [[nodiscard]] std::size_t batches_per_epoch() const { return plan_.batches_for(sampler_.size()); }
  /// Number of worker threads.
  [[nodiscard]] int workers() const noexcept { return plan_.workers; }
  /// Batches staged ahead (the resolved option: at least 2).
  [[nodiscard]] std::size_t prefetch() const noexcept { return plan_.prefetch; }
  [[nodiscard]] std::size_t batch_size() const noexcept { return plan_.batch_size; }
  /// The epoch last passed to start_epoch().
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// The device batches are delivered on: the compute stream's.
  [[nodiscard]] device get_device() const noexcept { return compute_.get_device(); }
  /// The compute stream batches are ordered on.
  [[nodiscard]] stream_ref compute_stream() const noexcept { return compute_; }
  /// The loader's own copy stream (for profiling, or to order other work after its copies).
  [[nodiscard]] stream_ref copy_stream() const noexcept { return copy_stream_; }

 private:
  enum class phase : std::uint8_t { idle, running, finished, failed };
  enum class slot_status : std::uint8_t { empty, assembling, ready, failed };

  // The state of one pinned slot (batch j uses slot j % P). Guarded by mutex_.
  struct staging_slot {
    std::size_t batch_index = std::numeric_limits<std::size_t>::max();
    slot_status status = slot_status::empty;
    detail::batch_failure failure;

    [[nodiscard]] bool ready(std::size_t j) const noexcept {
      return batch_index == j && status == slot_status::ready;
    }
    [[nodiscard]] bool finished(std::size_t j) const noexcept {
      return batch_index == j && (status == slot_status::ready || status == slot_status::failed);
    }
  };

  static stream_ref checked_stream(stream_ref s) {
    LOCKSTEP_EXPECTS(s.native_handle() != nullptr || s.get_device().is_cuda(),
                     "data_loader: the compute stream of ", s.get_device().str(), " is not a valid stream");
    check_device_exists(s.get_device());
    return s;
  }

  [[nodiscard]] std::size_t rows_of(std::size_t j) const noexcept {
    return std::min(plan_.batch_size, order_.size() - j * plan_.batch_size);
  }

  // The batch last returned is done with once the work queued on the compute stream so far has run.
  void release_held() {
    if (!held_) return;
    consumed_[held_slot_].record(compute_);
    held_ = false;
  }

  // Stops producing the current epoch: workers abandon their batch at the next sample; returns once none is
  // busy, so the caller may reset what the workers read. The copies already queued stay queued: the copy
  // events keep pinned slots, and the consumed events device slots, from being reused too early.
  void cancel_locked(std::unique_lock<std::mutex>& lock, phase to) {
    phase_ = to;
    generation_.fetch_add(1, std::memory_order_acq_rel);
    batch_done_.wait(lock, [&] { return busy_ == 0; });
    for (staging_slot& s : staging_) s = staging_slot{};
    next_claim_ = 0;
  }

  void stop_workers() noexcept {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_acq_rel);
    }
    work_ready_.notify_all();
    for (std::thread& t : workers_) {
      if (t.joinable()) t.join();
    }
  }

  // Queues the copy of batch j from its pinned slot into its device slot, after the compute stream released
  // that device slot's previous batch, and records the copy event.
  void queue_copy(std::size_t j) {
    const std::size_t p = j % plan_.prefetch;
    const std::size_t d = j % (plan_.prefetch + 1);
    const std::size_t rows = rows_of(j);
    const device dev = compute_.get_device();
    copy_stream_.wait(consumed_[d]);
    const std::size_t in_bytes = rows * plan_.input_row_bytes;
    lockstep::copy(device_span<std::byte>(static_cast<std::byte*>(device_inputs_[d].data()), in_bytes, dev),
         std::span<const std::byte>(pinned_inputs_[p].data(), in_bytes), copy_stream_);
    const std::size_t target_bytes = rows * plan_.target_row_bytes;
    lockstep::copy(device_span<std::byte>(static_cast<std::byte*>(device_targets_[d].data()), target_bytes, dev),
         std::span<const std::byte>(pinned_targets_[p].data(), target_bytes), copy_stream_);
    copied_[p].record(copy_stream_);
  }

  [[noreturn]] void throw_failure(const detail::batch_failure& f, std::size_t k) const {
    const std::string what =
        f.sample ? detail::concat("data_loader: worker ", f.worker, " of ", plan_.workers, " could not fetch sample ",
                                  *f.sample, " (dataset index; row ", f.row, " of batch ", k, " of epoch ", epoch_,
                                  "): ", f.message)
                 : detail::concat("data_loader: worker ", f.worker, " of ", plan_.workers,
                                  " failed while waiting for the pinned slot of batch ", k, " of epoch ", epoch_,
                                  ": ", f.message);
    std::string msg = detail::concat(detail::short_file(__FILE__), ':', __LINE__, ": ", what);
    if (!f.error) throw data_error(msg);
    try {
      std::rethrow_exception(f.error);
    } catch (...) {
      std::throw_with_nested(data_error(msg));
    }
  }

  // May a worker take batch next_claim_ now? At most P batches beyond the last one delivered.
  [[nodiscard]] bool claimable_locked() const noexcept {
    return phase_ == phase::running && next_claim_ < batches_ && next_claim_ < delivered_ + plan_.prefetch;
  }

  void work(int id) noexcept {
    detail::name_this_thread("loader", static_cast<std::size_t>(id));
    std::vector<float> scratch;  // one f32 input when converting
    std::unique_lock lock(mutex_);
    for (;;) {
      work_ready_.wait(lock, [&] { return stop_ || claimable_locked(); });
      if (stop_) return;
      const std::size_t j = next_claim_++;
      const std::uint64_t generation = generation_.load(std::memory_order_relaxed);
      staging_slot& slot = staging_[j % plan_.prefetch];
      slot.batch_index = j;
      slot.status = slot_status::assembling;
      ++busy_;
      lock.unlock();

      detail::batch_failure failure;
      failure.worker = id;
      const bool done = assemble(j, generation, scratch, failure);

      lock.lock();
      --busy_;
      if (generation_.load(std::memory_order_relaxed) == generation) {
        slot.status = done ? slot_status::ready : slot_status::failed;
        if (!done) slot.failure = std::move(failure);
      }
      lock.unlock();
      batch_done_.notify_all();
      lock.lock();
    }
  }

  // Fills pinned slot j % P with batch j. Returns true when complete; false when cancelled (failure.error is
  // empty) or failed (failure filled in).
  bool assemble(std::size_t j, std::uint64_t generation, std::vector<float>& scratch,
                detail::batch_failure& failure) noexcept {
    const std::size_t p = j % plan_.prefetch;
    try {
      // The slot's previous batch (P batches ago, or from an earlier epoch) must have been copied out.
      copied_[p].synchronize();
      if (plan_.convert && scratch.size() != plan_.input_elements) scratch.resize(plan_.input_elements);
    } catch (...) {
      keep(failure, std::nullopt, 0);
      return false;
    }
    std::byte* inputs = pinned_inputs_[p].data();
    std::byte* targets = pinned_targets_[p].data();
    const std::size_t rows = rows_of(j);
    for (std::size_t r = 0; r < rows; ++r) {
      if (generation_.load(std::memory_order_acquire) != generation) return false;
      const std::size_t index = order_[j * plan_.batch_size + r];
      try {
        const std::span<std::byte> target(targets + r * plan_.target_row_bytes, plan_.target_row_bytes);
        const std::span<std::byte> input(inputs + r * plan_.input_row_bytes, plan_.input_row_bytes);
        if (!plan_.convert) {
          dataset_->fetch(index, sample_ref{input, target});
        } else {
          dataset_->fetch(index, sample_ref{std::as_writable_bytes(std::span<float>(scratch)), target});
          convert_row(scratch.data(), input.data());
        }
      } catch (...) {
        keep(failure, index, r);
        return false;
      }
    }
    return true;
  }

  // Keeps the exception being handled, and its message, for next() to report.
  static void keep(detail::batch_failure& failure, std::optional<std::size_t> sample, std::size_t row) noexcept {
    failure.error = std::current_exception();
    failure.sample = sample;
    failure.row = row;
    try {
      try {
        std::rethrow_exception(failure.error);
      } catch (const std::exception& e) {
        failure.message = e.what();
      } catch (...) {
        failure.message = "an exception that is not a std::exception";
      }
    } catch (...) {
      // No memory for the message: the nested exception still carries it.
    }
  }

  // One sample's f32 input -> input_type (f16 or bf16), rounding to nearest even.
  void convert_row(const float* src, std::byte* dst) const {
    dispatch_floating(plan_.input_type, "data_loader input conversion", [&]<class T>() {
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(dst, src, plan_.input_elements * sizeof(float));
      } else {
        // Rows of a pinned batch are T-aligned (the batch is an array of T).
        detail::narrow_run(src, reinterpret_cast<T*>(dst), static_cast<std::int64_t>(plan_.input_elements));
      }
    });
  }

  // Configuration (constant after construction).
  const D* dataset_;
  S sampler_;
  stream_ref compute_;
  detail::loader_plan plan_;
  std::size_t dataset_size_;

  // Resources. Destroyed in reverse order: device slots (freed in stream order on the copy stream) before the
  // copy stream, which completes its copies before the events and the pinned slots go.
  std::vector<pinned_buffer<std::byte>> pinned_inputs_;   // [P] of [batch_size, input row bytes]
  std::vector<pinned_buffer<std::byte>> pinned_targets_;  // [P] of [batch_size, target row bytes]
  std::vector<event> copied_;    // [P] recorded on the copy stream after the last copy out of pinned slot p
  std::vector<event> consumed_;  // [P + 1] recorded on the compute stream when device slot d's batch is released
  stream copy_stream_;
  std::vector<tensor> device_inputs_;   // [P + 1] of [batch_size, input_shape...]
  std::vector<tensor> device_targets_;  // [P + 1] of [batch_size, target_shape...]

  // Shared with the workers, guarded by mutex_ (generation_ is also read without it between samples).
  std::mutex mutex_;
  std::condition_variable work_ready_;  // workers: a batch may be claimable, or stop
  std::condition_variable batch_done_;  // training thread: a batch finished, or a worker went idle
  std::vector<staging_slot> staging_;   // [P]
  std::vector<std::size_t> order_;      // the epoch's dataset indices; written only while no worker is busy
  phase phase_ = phase::idle;
  bool stop_ = false;
  std::size_t batches_ = 0;
  std::size_t next_claim_ = 0;  // the next batch a worker takes
  std::size_t delivered_ = 0;   // batches returned by next() this epoch
  int busy_ = 0;                // workers assembling a batch
  std::atomic<std::uint64_t> generation_{0};  // bumped to cancel what the workers are doing

  // The training thread's own.
  std::uint64_t epoch_ = 0;
  std::size_t copies_queued_ = 0;  // batches of this epoch whose copy has been queued
  bool held_ = false;              // a batch has been returned and not yet released
  std::size_t held_slot_ = 0;

  std::vector<std::thread> workers_;
};

LOCKSTEP_ABI_END
