// lockstep/parallel/detail/global_batch.hpp — distributed_data_parallel's side of a loss's share of the global batch
// (nn/context.hpp's batch_share): each training forward sums the ranks' rows (one 8-byte all-reduce on the
// communication stream that only the loss waits for; none when the context knows them, or on one rank), so that a
// loss whose mean divides by the global batch needs no help from the user, and each synchronized backward sums the
// ranks' losses in place, so that the loss reads as the global batch's on every rank. It also gives each forward
// its default row offset (dropout masks follow the global row) and keeps the context's step with the others' on a
// rank without rows.
#pragma once

#include <cstdint>
#include <utility>

#include "lockstep/config.hpp"
#include "lockstep/kernels/elementwise.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/parallel/detail/ddp_replica.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_DETAIL_BEGIN

class global_batch {
 public:
  /// For r's rank; `sums`: gradients are summed over the ranks (gradient_reduction::sum), so that a training
  /// forward's loss is a share. Registers the share with r's context (the last one constructed on it wins).
  global_batch(ddp_replica& r, bool sums)
      : r_(&r), sums_(sums), rows_(shape{1}, dtype::i64, r.compute_stream()), rows_ready_(r.get_device()),
        no_loss_(shape{1}, dtype::f32, r.compute_stream()) {
    r.ctx->set_share(&share_);
  }
  global_batch(const global_batch&) = delete;
  global_batch& operator=(const global_batch&) = delete;
  ~global_batch() {
    if (r_->ctx->share() == &share_) r_->ctx->set_share(nullptr);
  }

  /// Whether a forward's loss is a share of the global batch's: training, with gradients summed over the ranks.
  [[nodiscard]] bool shares() const noexcept { return r_->ctx->training() && sums_; }
  /// Whether count() ran since the last backward.
  [[nodiscard]] bool counted() const noexcept { return counted_; }

  /// The global batch of this step, `rows` being this rank's: the rows summed over the ranks on the communication
  /// stream (the loss waits for the event after it; nothing when the context was told them), and this rank's
  /// default row offset. Every rank calls it once per step (in forward, or in the backward of a rank without a
  /// forward), before ZeRO's gathers and the buffers' broadcast.
  void count(std::int64_t rows) {
    share_ = {};
    counted_ = shares();
    if (!counted_) return;
    context& ctx = *r_->ctx;
    ctx.set_share(&share_);  // (two wrappers may share a context: the one that ran forward last)
    step_at_share_ = ctx.step();
    ctx.default_row_offset(r_->comm.rank() * rows);
    if (ctx.global_rows() > 0 || r_->comm.size() == 1) {
      share_.global_rows = ctx.global_rows() > 0 ? ctx.global_rows() : rows;
      return;
    }
    // the sum on the communication stream; only the loss's factor waits for it (rows_ready), not the forward
    const stream_ref s = ctx.stream();
    if (rows_summed_) s.wait(rows_ready_);  // the last sum has read rows_ before it is written again
    launch_elementwise(1, kernels::fill_op<std::int64_t>{rows_.as<std::int64_t>(), rows}, s, "batch rows");
    r_->after(r_->comm_stream, s);
    r_->comm.all_reduce(rows_.data(), rows_.data(), 1, dtype::i64, reduce_op::sum, r_->comm_stream);
    rows_ready_.record(r_->comm_stream);
    rows_summed_ = true;
    share_.global_rows_on_device = rows_.as<std::int64_t>();
    share_.rows_ready = &rows_ready_;
  }

  /// The forward's output `y`, whose loss (computed next, in training) is this rank's share.
  void forward_output(const tensor_view& y) {
    if (!shares()) return;
    share_.pending = true;
    share_.output = y.data();
    share_.rows = y.dims().rank() == 0 ? 1 : y.dims()[0];
    share_.values = y.numel();
  }

  /// At a backward (after count()): the step's loss ran, so a later forward outside the wrapper (evaluation) is not
  /// a share; a rank whose loss did not run (no rows) keeps its step with the others' (dropout masks of the next
  /// steps).
  void loss_ran() {
    counted_ = false;
    share_.output = nullptr;
    share_.pending = false;
    context& ctx = *r_->ctx;
    if (shares() && ctx.step() == step_at_share_) ctx.advance_step();
  }

  /// A backward without communication (no_sync): the loss stays this rank's share.
  void keep_local_loss() noexcept { share_.loss = nullptr; }

  /// The ranks' shares of the loss (what the loss registered, or zero) summed in place on the communication stream,
  /// before the buckets. Returns whether it did (the compute stream must then wait for the communication stream
  /// before the loss is read).
  bool sum_loss() {
    float* loss = std::exchange(share_.loss, nullptr);
    if (!shares() || r_->comm.size() == 1) return false;
    const stream_ref s = r_->compute_stream();
    if (loss == nullptr) {
      loss = no_loss_.as<float>();
      fill_zero(no_loss_.span<float>(), s);
    }
    r_->after(r_->comm_stream, s);
    r_->comm.all_reduce(loss, loss, 1, dtype::f32, reduce_op::sum, r_->comm_stream);
    return true;
  }

 private:
  ddp_replica* r_;
  bool sums_;
  batch_share share_;                // the context's: the global batch of this step's loss
  bool counted_ = false;             // count() ran since the last backward
  std::uint64_t step_at_share_ = 0;  // the context's step when the rows were counted
  tensor rows_;                      // the global batch's rows (i64, summed over the ranks)
  event rows_ready_;                 // recorded on the communication stream after their sum
  bool rows_summed_ = false;
  tensor no_loss_;                   // a zero loss, for a rank whose loss was not registered
};

LOCKSTEP_DETAIL_END
