// The samples' runner (sample.hpp): the command line, the modes, the training loop, checkpoints and the report of
// mlp_train and cnn_train, compiled once for both. The model comes from the sample's model_recipe.
#include <lockstep/lockstep.hpp>
#include <lockstep/amp/loss_scaler.hpp>
#include <lockstep/blas/gemm_rate.hpp>
#include <lockstep/comm/run_on_devices.hpp>
#include <lockstep/io/checkpoint.hpp>
#include <lockstep/io/preemption.hpp>
#include <lockstep/parallel/data_parallel.hpp>
#include <lockstep/parallel/distributed_data_parallel.hpp>
#if defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI
#include <lockstep/comm/mpi.hpp>
#include <lockstep/comm/processes.hpp>
#endif

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sample.hpp"

namespace sample {
namespace {

using namespace lockstep;
using clock_type = std::chrono::steady_clock;

// SIGTERM/SIGINT become "save and stop" while a run saves checkpoints (set by run()).
const preemption_guard* active_preemption = nullptr;

// The optimizer of either kind, and under f16/bf16 the loss scaler, behind one interface: the end of a step.
class any_optimizer {
 public:
  /// `ctx` is where the loss is computed: it gets the scaler's scale.
  any_optimizer(const options& o, std::span<parameter* const> params, stream_ref s, context& loss_ctx)
      : params_(params.begin(), params.end()) {
    if (o.optimizer == "adamw") {
      adamw_.emplace(params, adamw_options{.lr = o.lr, .weight_decay = o.weight_decay});
    } else {
      sgd_.emplace(params, sgd_options{.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay});
    }
    if (o.precision != dtype::f32) {
      scaler_.emplace(s, loss_scaler_options::for_precision(o.precision));
      scaler_->attach(loss_ctx);
    }
    if (o.clip_grad_norm > 0.0f) {
      clipper_.emplace(s);
      max_norm_ = o.clip_grad_norm;
    }
  }
  /// Check (with every rank of `ranks`), step (skipped on overflow), update the scale: all on `s`.
  void step(stream_ref s, std::optional<communicator_ref> ranks = std::nullopt) {
    step_inputs in{};
    if (scaler_) {
      scaler_->unscale_and_check(params_, s, ranks);
      in = scaler_->optimizer_inputs();
    }
    // after the overflow check, on the unscaled gradients; under DDP every rank holds all of them (reduced), so
    // no ranks; under ZeRO each holds a shard, and the norm adds the ranks' parts
    if (clipper_) in = clipper_->clip_grad_norm(params_, {.max_norm = max_norm_}, s, in, sharded_ ? ranks : std::nullopt);
    sgd_ ? sgd_->step(s, in) : adamw_->step(s, in);
    if (scaler_) scaler_->update(s);
    if (sgd_schedule_) sgd_schedule_->step();
    if (adamw_schedule_) adamw_schedule_->step();
  }
  /// Under --lr-schedule cosine, the rate anneals from --lr to 0 over `total_steps` (the run's steps).
  void schedule(const options& o, std::int64_t total_steps) {
    if (o.lr_schedule != "cosine" || total_steps < 1) return;
    const cosine_schedule cosine{.total_steps = total_steps};
    if (sgd_) sgd_schedule_.emplace(*sgd_, cosine);
    if (adamw_) adamw_schedule_.emplace(*adamw_, cosine);
  }
  void zero_grad() { sgd_ ? sgd_->zero_grad() : adamw_->zero_grad(); }
  /// Calls f with the optimizer itself (sgd or adamw).
  template <class F>
  void visit(F&& f) {
    sgd_ ? f(*sgd_) : f(*adamw_);
  }
  /// The rate (--lr: the schedule's base rate), momentum (SGD) and weight decay in effect.
  struct hyperparameters {
    float lr = 0;
    std::optional<float> momentum;
    float weight_decay = 0;
  };
  [[nodiscard]] hyperparameters in_effect() {
    hyperparameters h;
    visit([&](auto& opt) {
      h.lr = opt.options(0).lr;
      h.weight_decay = opt.options(0).weight_decay;
      if constexpr (requires { opt.options(0).momentum; }) h.momentum = opt.options(0).momentum;
    });
    if (sgd_schedule_) h.lr = sgd_schedule_->base_lr(0);
    if (adamw_schedule_) h.lr = adamw_schedule_->base_lr(0);
    return h;
  }
  /// After a resume: --lr, --momentum and --weight-decay given on the command line replace what the checkpoint
  /// restored (as a PyTorch user changing the rate after loading expects); returns a sentence per change.
  std::vector<std::string> apply_given(const options& o) {
    const hyperparameters was = in_effect();
    std::vector<std::string> changes;
    auto note = [&](const char* flag, float now, float before) {
      changes.push_back(detail::concat(flag, " ", now, " (the checkpoint had ", before, ")"));
    };
    visit([&](auto& opt) {
      for (std::size_t g = 0; g < opt.group_count(); ++g) {
        if (o.weight_decay_given) opt.options(g).weight_decay = o.weight_decay;
        if constexpr (requires { opt.options(g).momentum; }) {
          if (o.momentum_given) opt.options(g).momentum = o.momentum;
        }
        if (o.lr_given && !sgd_schedule_ && !adamw_schedule_) opt.options(g).lr = o.lr;
      }
      if (o.lr_given) {
        const std::vector<float> base(opt.group_count(), o.lr);
        if (sgd_schedule_) sgd_schedule_->restore(sgd_schedule_->last_step(), base);
        if (adamw_schedule_) adamw_schedule_->restore(adamw_schedule_->last_step(), base);
      }
    });
    if (o.lr_given && o.lr != was.lr) note("--lr", o.lr, was.lr);
    if (o.momentum_given && was.momentum && o.momentum != *was.momentum) note("--momentum", o.momentum, *was.momentum);
    if (o.weight_decay_given && o.weight_decay != was.weight_decay) note("--weight-decay", o.weight_decay, was.weight_decay);
    return changes;
  }
  /// Under ZeRO the gradients are sharded over the ranks: clipping adds the ranks' parts.
  void set_sharded(bool sharded) { sharded_ = sharded; }
  [[nodiscard]] std::uint64_t state_bytes() const { return sgd_ ? sgd_->state_bytes() : adamw_->state_bytes(); }
  /// Names the optimizer, its schedule and the scaler in a checkpoint.
  void add_to(checkpoint_state& st) {
    sgd_ ? (void)st.optimizer(*sgd_) : (void)st.optimizer(*adamw_);
    if (sgd_schedule_) st.schedule(*sgd_schedule_);
    if (adamw_schedule_) st.schedule(*adamw_schedule_);
    if (scaler_) st.scaler(*scaler_);
  }
  [[nodiscard]] std::optional<loss_scaler_telemetry> scaler_state(stream_ref s) const {
    if (!scaler_) return std::nullopt;
    return scaler_->read(s);
  }
  /// f16/bf16: throws numeric_error when the scaler skipped more than --max-skipped-steps steps in a row (the
  /// gradients are not finite even at the floor of the scale: the run diverged). Reads the scaler on `s`, the
  /// stream it steps on. Every rank skips the same steps, so every rank decides alike.
  void check_skips(const options& o, stream_ref s) {
    if (!scaler_) return;
    const loss_scaler_telemetry t = scaler_->read(s);
    if (t.consecutive_skipped_steps <= o.max_skipped_steps) return;
    throw numeric_error(detail::concat(
        "the loss scaler skipped the last ", static_cast<long long>(t.consecutive_skipped_steps), " steps in a row (",
        static_cast<long long>(t.skipped_steps), " of ", static_cast<long long>(t.steps), " so far; the scale is down to ",
        t.scale, "): the gradients are not finite at any scale, the run diverged. Lower --lr (now ", in_effect().lr,
        "), or give --max-skipped-steps N to allow N skips in a row"));
  }
  /// The total gradient norm of the last step (before clipping), under --clip-grad-norm; synchronizes `s`.
  [[nodiscard]] std::optional<float> last_grad_norm(stream_ref s) const {
    if (!clipper_) return std::nullopt;
    return clipper_->total_norm(s);
  }

 private:
  std::vector<parameter*> params_;
  std::optional<sgd> sgd_;
  std::optional<adamw> adamw_;
  std::optional<lr_scheduler<sgd, cosine_schedule>> sgd_schedule_;
  std::optional<lr_scheduler<adamw, cosine_schedule>> adamw_schedule_;
  std::optional<loss_scaler> scaler_;
  std::optional<gradient_clipper> clipper_;
  float max_norm_ = 0.0f;
  bool sharded_ = false;
};

// Counts, on the device, the steps whose loss is not finite and keeps the first one's number: a step never waits
// for it. state = {steps with a non-finite loss, 2^24 - the first such step}, floats so that ranks can combine
// them with a max all-reduce (steps are exact in a float up to 2^24).
struct watch_loss_op {
  const float* loss;
  float* state;
  float step;
  LOCKSTEP_HD void operator()(std::size_t) const {
    const float v = *loss;
    if (v - v == 0.0f) return;  // finite: inf - inf and NaN - NaN are NaN
    state[0] += 1.0f;
    if (state[1] == 0.0f) state[1] = 16777216.0f - step;
  }
};

// An f32 run whose loss stops being finite has diverged: it ends with an error naming the first such step (after
// --max-bad-steps of them), found at the next progress line or the end of an epoch. f16/bf16 runs skip such steps
// (the loss scaler) and report how many.
class loss_watch {
 public:
  loss_watch(const options& o, stream_ref s)
      : o_(o), s_(s), state_(to_device(std::vector<float>{0.0f, 0.0f}, s)) {}
  /// After the loss of step `step` (1-based) is queued on the watch's stream.
  void after_step(const tensor_view& loss, std::int64_t step) {
    if (o_.precision != dtype::f32) return;
    launch_elementwise(1, watch_loss_op{loss.as<float>(), state_.data(), static_cast<float>(step)}, s_, "loss watch");
  }
  /// Throws numeric_error when too many steps had a non-finite loss (on any rank of `ranks`: a collective).
  void check(std::optional<communicator_ref> ranks = std::nullopt) {
    if (o_.precision != dtype::f32) return;
    if (ranks && ranks->size() > 1) {
      ranks->all_reduce(state_.span(), reduce_op::max, s_);
      ranks->synchronize(s_);
    }
    const auto v = to_vector(device_span<const float>(state_.span()), s_);
    if (v[0] <= static_cast<float>(o_.max_bad_steps)) return;
    throw numeric_error(detail::concat(
        "the loss is not finite (NaN or infinity) from step ", static_cast<long long>(16777216.0f - v[1]), " on (",
        static_cast<long long>(v[0]), " such steps so far): the run diverged. Lower --lr, or train in f16/bf16, "
        "which skip such steps, or give --max-bad-steps N to tolerate N of them"));
  }

 private:
  const options& o_;
  stream_ref s_;
  device_buffer<float> state_;
};

struct datasets {
  mnist_dataset train;
  mnist_dataset test;
  std::int64_t inputs;
};

struct run_result {
  double accuracy = 0;
  std::int64_t correct = 0;
  std::int64_t tested = 0;
  std::string weights_sha256;
  std::string checkpoint;  // the last checkpoint written
  std::string stopped;     // why the run ended early ("SIGTERM", "--stop-after"), or empty
  std::int64_t resumed_at = -1;  // the step --resume continued from
  float lr = 0;                  // the learning rate in effect (the schedule's base rate)
  std::vector<std::string> changed_on_resume;  // hyperparameters the command line changed on --resume
  double train_seconds = 0;
  std::int64_t samples = 0;
  std::int64_t steps = 0;
  float final_loss = 0;
  std::optional<loss_scaler_telemetry> scaler;
  std::optional<float> last_grad_norm;  // under --clip-grad-norm
  std::vector<device_report> devices;
  std::string collectives_on;  // --mode ddp: "compute stream" or "communication stream" (rank 0's)
};

// Prints the live progress line (or one line per report when stdout is not a terminal).
class progress {
 public:
  progress(const options& o, std::size_t steps_per_epoch, bool enabled)
      : o_(o), steps_per_epoch_(steps_per_epoch), enabled_(enabled && !o.json), live_(::isatty(STDOUT_FILENO) != 0) {}
  [[nodiscard]] bool due(std::size_t epoch_step) const {
    return epoch_step % static_cast<std::size_t>(o_.print_every) == 0 || epoch_step == steps_per_epoch_;
  }
  void line(int epoch, std::size_t epoch_step, float loss, double samples_per_second, const std::string& memory) const {
    if (!enabled_) return;
    std::printf("%sepoch %d/%d  step %zu/%zu  loss %.4f  %.0f samples/s  memory %s%s", live_ ? "\r" : "", epoch + 1,
                o_.epochs, epoch_step, steps_per_epoch_, loss, samples_per_second, memory.c_str(), live_ ? "   " : "\n");
    std::fflush(stdout);
  }
  void end_epoch() const {
    if (enabled_ && live_) std::printf("\n");
  }

 private:
  const options& o_;
  std::size_t steps_per_epoch_;
  bool enabled_;
  bool live_;
};

std::string memory_in_use(const std::vector<device>& devices) {
  std::string s;
  for (const device d : devices) {
    if (!s.empty()) s += ", ";
    s += d.str() + " " + format_bytes(get_memory_stats(d).bytes_in_use);
  }
  return s;
}

// The test set's correct answers, evaluated on ctx's device; sets r.accuracy, r.correct, r.tested.
// The test set's accuracy into r, each batch's output from forward(input) (the model's, or the DDP wrapper's).
template <class Forward>
void evaluate_with(Forward&& forward, const mnist_dataset& test, context& ctx, const options& o, run_result& r) {
  data_loader loader(test, sequential_sampler(test.size()), ctx.stream(),
                     data_loader_options{.batch_size = static_cast<std::size_t>(o.eval_batch),
                                         .workers = o.workers,
                                         .input_type = ctx.compute_type()});
  const run_mode before = ctx.mode();
  ctx.set_mode(run_mode::eval);
  accuracy_counter acc;
  loader.start_epoch(0);
  while (auto b = loader.next()) acc.add(forward(b->input), b->target, ctx);
  ctx.set_mode(before);
  r.correct = static_cast<std::int64_t>(acc.correct(ctx.stream()));
  r.tested = static_cast<std::int64_t>(acc.rows());
  r.accuracy = static_cast<double>(r.correct) / static_cast<double>(r.tested);
}

void evaluate(graph& model, const mnist_dataset& test, context& ctx, const options& o, run_result& r) {
  evaluate_with([&](const tensor_view& x) { return model.forward(x, ctx); }, test, ctx, o, r);
}

bool step_limit_reached(const options& o, std::int64_t step) {
  return (o.max_steps > 0 && step >= o.max_steps) || (o.stop_after > 0 && step >= o.stop_after);
}

// What --save, --resume, --load-model and SIGTERM ask of one rank's run (every rank has one; with a
// communicator, rank 0 writes and the others join). The checkpoint holds the model, the optimizer, its schedule
// and the scaler, the loop's position, and the options that must not change across a resume.
class run_checkpoints {
 public:
  /// `model_options`: the model's (model_recipe::describe), saved with the common ones and checked on --resume.
  run_checkpoints(const options& o, json_value model_options, graph& model, any_optimizer& optimizer, stream_ref s,
                  std::optional<communicator_ref> comm, const preemption_guard* preemption)
      : o_(o), model_options_(std::move(model_options)), state_(parameters_of(model)), s_(s), comm_(comm),
        preemption_(preemption), optimizer_(&optimizer) {
    optimizer.add_to(state_);
    state_.position.data_seed = o.seed;
    state_.position.dropout_seed = o.seed;
    state_.position.world_size = comm ? comm->size() : 1;
    state_.position.precision = o.precision;
    if (!o.save.empty()) {
      // rank 0 writes (and checks now, before any training, that it can); the others never write
      saver_.emplace(o.save, checkpoint_options{.keep_last = static_cast<std::size_t>(o.keep_last),
                                                .check_root = comm && comm->rank() != 0 ? root_check::at_first_save
                                                                                        : root_check::at_construction,
                                                .overwrite = o.overwrite});
      // one run writes a root at a time: a root another run is writing is refused now, before training
      if (!comm || comm->rank() == 0) saver_->lock();
    }
  }

  /// Under ZeRO: where saves read the whole master values and optimizer state (distributed_data_parallel::
  /// visit_whole_state) and weights_sha256 the master values (visit_master_values), so that neither needs more
  /// device memory than training. (Loads write each rank's own range.)
  void set_sharded(whole_state_source state, master_values_source masters) {
    state_.sharded(std::move(state));
    masters_ = std::move(masters);
  }

  /// Loads --load-model or --resume; returns where the loop starts. Refuses a --save DIR that holds another run's
  /// checkpoints (without --overwrite) now, before training.
  run_position start() {
    if (!o_.load_model.empty()) load_model(o_.load_model, state_.model(), s_);
    if (o_.resume.empty()) {
      expect_own_root();
      return state_.position;
    }
    const std::filesystem::path dir = load_checkpoint(o_.resume, state_, s_);
    // What shapes the model, the data order or the learning rates must be as it was (the schedule's length
    // comes from --epochs and --max-steps).
    std::vector<std::string> keys = {"optimizer", "precision", "batch", "seed", "lr_schedule", "epochs", "max_steps"};
    for (const auto& [key, ignored] : model_options_.members()) keys.push_back(key);
    const json_value now = options_json();
    for (const std::string& key : keys) {
      if (state_.user.value(key, json_value()) != now[key]) {
        std::string flag = key;
        std::replace(flag.begin(), flag.end(), '_', '-');
        throw precondition_error(detail::concat("--resume ", dir.string(), ": the checkpoint was written with --", flag,
                                                " ", state_.user.value(key, json_value()).dump(), ", this run has ",
                                                now[key].dump(), "; resume with the options of the run that saved it"));
      }
    }
    changed_ = optimizer_->apply_given(o_);
    if (!o_.json && (!comm_ || comm_->rank() == 0)) {
      std::printf("resumed from %s at step %lld (epoch %llu, %llu samples into it)\n", dir.string().c_str(),
                  static_cast<long long>(state_.position.step), static_cast<unsigned long long>(state_.position.epoch + 1),
                  static_cast<unsigned long long>(state_.position.epoch_samples));
      for (const std::string& c : changed_) std::printf("resumed with %s, from step %lld on\n", c.c_str(),
                                                         static_cast<long long>(state_.position.step + 1));
    }
    expect_own_root();
    return state_.position;
  }

  /// On the writing rank: a --save DIR with another run's checkpoints is refused unless --overwrite.
  void expect_own_root() const {
    if (saver_ && (!comm_ || comm_->rank() == 0)) saver_->expect_own_root(state_);
  }

  /// Saves at `at` (every rank calls it at the same steps); r.checkpoint gets the directory written.
  void save(const run_position& at, run_result& r) {
    if (!saver_) return;
    state_.position.step = at.step;
    state_.position.epoch = at.epoch;
    state_.position.epoch_samples = at.epoch_samples;
    state_.position.dropout_step = static_cast<std::uint64_t>(at.step);
    state_.user = options_json();
    r.checkpoint = saver_->save(state_, s_, comm_).string();
    last_saved_ = at.step;
  }
  [[nodiscard]] bool saved_at(std::int64_t step) const { return last_saved_ == step; }
  /// The learning rate in effect (--lr, or on --resume the checkpoint's unless --lr was given).
  [[nodiscard]] float lr_in_effect() const { return optimizer_->in_effect().lr; }
  /// The hyperparameters the command line changed on --resume (sentences), for the report.
  [[nodiscard]] const std::vector<std::string>& changed_on_resume() const noexcept { return changed_; }
  [[nodiscard]] bool save_due(std::int64_t step) const { return saver_ && o_.save_every > 0 && step % o_.save_every == 0; }

  /// Whether SIGTERM or SIGINT asked the run to stop: checked after every step, or with several ranks every 10
  /// steps (the ranks agree with a collective, so they stop at the same step).
  [[nodiscard]] bool stop_requested(std::int64_t step) const {
    if (preemption_ == nullptr) return false;
    if (comm_ && comm_->size() > 1) return step % 10 == 0 && preemption_->requested(comm_, s_);
    return preemption_->requested();
  }
  [[nodiscard]] std::string signal_name() const {
    return preemption_ != nullptr && preemption_->signal() == SIGINT ? "SIGINT" : "SIGTERM";
  }

  [[nodiscard]] std::string weights_sha256() {
    if (masters_) return lockstep::weights_sha256(state_.model(), s_, masters_);
    return lockstep::weights_sha256(state_.model(), s_);
  }

 private:
  [[nodiscard]] json_value options_json() const {
    json_value j = model_options_;
    j.update({{"optimizer", o_.optimizer}, {"precision", std::string(name_of(o_.precision))},
              {"batch", o_.batch},         {"seed", o_.seed},
              {"lr_schedule", o_.lr_schedule}, {"epochs", o_.epochs},
              {"max_steps", o_.max_steps}, {"mode", o_.mode}});
    // what the optimizer uses (changed on a resume when the command line says so): the manifest records it
    const any_optimizer::hyperparameters h = optimizer_->in_effect();
    j["lr"] = h.lr;
    j["weight_decay"] = h.weight_decay;
    if (h.momentum) j["momentum"] = *h.momentum;
    if (!changed_.empty()) j["changed_on_resume"] = changed_;
    return j;
  }

  const options& o_;
  json_value model_options_;
  checkpoint_state state_;
  stream_ref s_;
  std::optional<communicator_ref> comm_;
  const preemption_guard* preemption_;
  any_optimizer* optimizer_;
  std::vector<std::string> changed_;  // hyperparameters the command line changed on --resume
  std::optional<checkpointer> saver_;
  std::int64_t last_saved_ = -1;
  master_values_source masters_;
};

bool under_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr; }

/// The steps of the whole run: every epoch's batches, or --max-steps if that comes first.
std::int64_t total_steps(const options& o, std::size_t batches_per_epoch) {
  const std::int64_t all = static_cast<std::int64_t>(o.epochs) * static_cast<std::int64_t>(batches_per_epoch);
  return o.max_steps > 0 ? std::min(all, o.max_steps) : all;
}

// The epoch loop of every mode: epochs up to the step limit, per-epoch training time, progress lines, and the
// checkpoints: it starts where --resume left off, saves every --save-every steps, stops at the next step
// boundary after SIGTERM/SIGINT, and saves at the end.
// `step(batch)` queues one training step and returns the number of samples it covered (the global batch);
// `read_loss()` reads the last loss (a host synchronization: only when a progress line is due);
// `wait()` waits for the epoch's work; `memory()` gives the figures of the progress line.
template <class Loader, class Step, class ReadLoss, class Wait, class Memory>
void run_epochs(const options& o, Loader& loader, progress& show, run_result& r, run_checkpoints& ck, Step&& step,
                ReadLoss&& read_loss, Wait&& wait, Memory&& memory) {
  const run_position start = ck.start();
  r.lr = ck.lr_in_effect();
  r.changed_on_resume = ck.changed_on_resume();
  r.steps = start.step;
  if (!o.resume.empty()) r.resumed_at = start.step;
  run_position at = start;  // after the last step taken
  for (auto epoch = static_cast<int>(start.epoch); epoch < o.epochs && !step_limit_reached(o, r.steps) && r.stopped.empty();
       ++epoch) {
    const auto t0 = clock_type::now();
    const std::size_t skip = static_cast<std::uint64_t>(epoch) == start.epoch ? start.epoch_samples : 0;
    loader.start_epoch(static_cast<std::uint64_t>(epoch), skip);
    at = run_position{.step = r.steps, .epoch = static_cast<std::uint64_t>(epoch), .epoch_samples = skip};
    std::int64_t epoch_samples = 0;
    // steps of this epoch taken before a resume (a global batch each), so that the progress line goes on counting
    std::size_t epoch_step = skip / static_cast<std::size_t>(o.batch);
    bool epoch_done = true;
    while (auto b = loader.next()) {
      if (step_limit_reached(o, r.steps) || !r.stopped.empty()) {
        epoch_done = false;
        break;
      }
      const std::int64_t samples = step(*b);
      r.samples += samples;
      epoch_samples += samples;
      ++r.steps;
      at.step = r.steps;
      at.epoch_samples += static_cast<std::uint64_t>(samples);
      if (show.due(++epoch_step)) {
        r.final_loss = read_loss();
        show.line(epoch, epoch_step, r.final_loss,
                  static_cast<double>(epoch_samples) / std::chrono::duration<double>(clock_type::now() - t0).count(),
                  memory());
      }
      if (ck.save_due(r.steps)) ck.save(at, r);
      if (ck.stop_requested(r.steps)) r.stopped = ck.signal_name();
    }
    if (epoch_done) at = {.step = r.steps, .epoch = at.epoch + 1};  // the whole epoch was trained on
    wait();
    r.train_seconds += std::chrono::duration<double>(clock_type::now() - t0).count();
    show.end_epoch();
  }
  if (r.stopped.empty() && o.stop_after > 0 && r.steps >= o.stop_after) r.stopped = "--stop-after";
  // Nothing trained (a finished run resumed, or --epochs 0): no loss to read, nothing new to save. Every rank
  // takes the same branch, so the collectives in read_loss and save stay matched.
  const bool trained = r.steps > start.step;
  if (!ck.saved_at(r.steps) && (trained || o.resume.empty())) ck.save(at, r);
  r.final_loss = trained ? read_loss() : 0.0f;
}

// ---- one device ------------------------------------------------------------------------------------------------

run_result train_single(const options& o, const model_recipe& m, const datasets& data, device dev) {
  stream compute(dev);
  context ctx(compute, o.precision);
  ctx.set_seed(o.seed);
  if (o.deterministic) ctx.set_deterministic(deterministic_options{.chunk_rows = o.chunk_rows});
  graph model = m.build(data.inputs, ctx, o.seed);
  if (!o.json) summary(model, shape{data.inputs}, o.precision);  // torchinfo's table
  any_optimizer optimizer(o, parameters_of(model).pointers(), compute, ctx);
  softmax_cross_entropy loss(reduction::mean);
  data_loader loader(data.train, random_sampler(data.train.size(), o.seed), compute,
                     data_loader_options{.batch_size = static_cast<std::size_t>(o.batch), .workers = o.workers,
                                         .input_type = o.precision});
  optimizer.schedule(o, total_steps(o, loader.batches_per_epoch()));
  progress show(o, loader.batches_per_epoch(), true);
  timeline time(dev);
  run_result r;
  run_checkpoints ck(o, m.describe(), model, optimizer, compute, std::nullopt, active_preemption);
  loss_watch watch(o, compute);
  time.reset();  // what setup took becomes the report's setup peak
  run_epochs(
      o, loader, show, r, ck,
      [&](const auto& b) {
        ctx.set_step(static_cast<std::uint64_t>(r.steps));
        time.begin(phase::compute, compute);
        optimizer.zero_grad();
        loss.forward(model.forward(b.input, ctx), b.target, ctx);
        watch.after_step(loss.loss(), r.steps + 1);
        model.backward(loss.backward(ctx), ctx, input_grad::not_required);
        optimizer.step(compute);
        time.end(compute);
        return b.rows;
      },
      [&] {
        watch.check();
        optimizer.check_skips(o, compute);
        return loss.read_loss(compute);
      },
      [&] { compute.synchronize(); },
      [&] { return memory_in_use({dev}); });
  r.scaler = optimizer.scaler_state(compute);
  r.last_grad_norm = optimizer.last_grad_norm(compute);
  r.devices.push_back(time.report());
  r.weights_sha256 = ck.weights_sha256();  // after the report: its peak memory is training's
  if (r.stopped.empty() || r.stopped == "--stop-after") evaluate(model, data.test, ctx, o, r);
  return r;
}

// ---- DataParallel ----------------------------------------------------------------------------------------------

run_result train_dp(const options& o, const model_recipe& m, const datasets& data, const device_set& devices) {
  stream setup(devices.front());
  context build(setup, o.precision);
  graph model = m.build(data.inputs, build, o.seed);
  if (!o.json) summary(model, shape{data.inputs}, o.precision);  // torchinfo's table
  data_parallel dp(model, data_parallel_options{
                              .device_ids = devices,
                              .compute_type = o.precision,
                              .deterministic = o.deterministic ? std::optional(deterministic_options{.chunk_rows = o.chunk_rows})
                                                               : std::nullopt});
  dp.set_seed(o.seed);
  context& out = dp.output_context();
  const stream_ref s0 = dp.replica_context(0).stream();
  any_optimizer optimizer(o, parameters_of(model).pointers(), s0, out);
  softmax_cross_entropy loss(reduction::mean);
  data_loader loader(data.train, random_sampler(data.train.size(), o.seed), s0,
                     data_loader_options{.batch_size = static_cast<std::size_t>(o.batch), .workers = o.workers,
                                         .device_count_hint = static_cast<int>(devices.size()),
                                         .input_type = o.precision});
  optimizer.schedule(o, total_steps(o, loader.batches_per_epoch()));
  progress show(o, loader.batches_per_epoch(), true);
  run_result r;
  run_checkpoints ck(o, m.describe(), model, optimizer, s0, std::nullopt, active_preemption);
  loss_watch watch(o, out.stream());
  dp.reset_report();
  run_epochs(
      o, loader, show, r, ck,
      [&](const auto& b) {
        dp.set_step(static_cast<std::uint64_t>(r.steps));
        optimizer.zero_grad();
        // the labels are on device_ids[0], which is also the output device: the loss is computed there
        const tensor_view output = dp.forward(b.input);
        const tensor_view grad = dp.compute(out, [&] {  // as the report's computing time, not idle
          loss.forward(output, b.target, out);
          watch.after_step(loss.loss(), r.steps + 1);
          return loss.backward(out);
        });
        dp.backward(grad);
        dp.compute(dp.replica_context(0), [&] { optimizer.step(s0); });
        return b.rows;
      },
      [&] {
        watch.check();
        optimizer.check_skips(o, s0);
        return loss.read_loss(out.stream());
      },
      [&] {
        for (const device d : devices) synchronize(d);
      },
      [&] { return memory_in_use(devices.devices()); });
  r.scaler = optimizer.scaler_state(s0);
  r.last_grad_norm = optimizer.last_grad_norm(s0);
  r.devices = dp.report();
  r.weights_sha256 = ck.weights_sha256();
  if (r.stopped.empty() || r.stopped == "--stop-after") evaluate(model, data.test, dp.replica_context(0), o, r);
  return r;
}

// ---- DistributedDataParallel: one rank's training loop, for threads and for processes ---------------------------

// Trains on this rank's shard (distributed sampler) with the global batch split evenly; returns this rank's
// figures. Only rank 0 prints progress and evaluates. Under --deterministic every rank reads the global batch
// (the order of one device) and trains on its deterministic_shard of it: whole chunks, as even as they allow.
run_result train_ddp_rank(const options& o, const model_recipe& m, const run_hooks& hooks, const datasets& data,
                          context& ctx, communicator_ref comm, stream_ref comm_stream) {
  const int rank = comm.rank(), world = comm.size();
  const stream_ref compute = ctx.stream();
  if (o.deterministic) ctx.set_deterministic(deterministic_options{.chunk_rows = o.chunk_rows});
  graph model = [&] {
    // under ZeRO, f16/bf16 masters (ZeRO-3: also f32 ones) are never whole on the device: the wrapper writes this
    // rank's shard of them
    std::optional<deferred_master_values> defer;
    if (o.zero > 0) defer.emplace();
    return m.build(data.inputs, ctx, o.seed);
  }();
  if (rank == 0 && !o.json) summary(model, shape{data.inputs}, o.precision);  // torchinfo's table
  const host_collective_stream on = o.host_collectives == "compute"         ? host_collective_stream::compute_stream
                                    : o.host_collectives == "communication" ? host_collective_stream::communication_stream
                                                                            : host_collective_stream::automatic;
  distributed_data_parallel ddp(model, ctx, comm, comm_stream,
                                ddp_options{.zero = to_zero_stage(o.zero), .host_collectives = on});
  any_optimizer optimizer(o, parameters_of(model).pointers(), compute, ctx);
  optimizer.set_sharded(ddp.zero() != zero_stage::none);
  softmax_cross_entropy loss(reduction::mean);
  if (o.batch % world != 0 && !o.deterministic) {
    throw precondition_error(detail::concat(
        "--batch ", o.batch, " does not split evenly over ", world, " ranks (DDP gives every rank the same number of ",
        "rows); use a multiple of ", world, " such as ", (o.batch / world) * world > 0 ? (o.batch / world) * world : world,
        " or ", (o.batch / world + 1) * world, ", or --mode dp, which splits a batch unevenly"));
  }
  // one rank of one, under --deterministic: the whole shuffled order (random_sampler's), in global batches
  const int sampler_rank = o.deterministic ? 0 : rank, sampler_world = o.deterministic ? 1 : world;
  const auto local_batch = static_cast<std::size_t>(o.batch / sampler_world);
  data_loader loader(
      data.train,
      distributed_sampler(data.train.size(), sampler_rank, sampler_world, sample_order::shuffled, o.seed, tail_policy::pad),
      compute, data_loader_options{.batch_size = local_batch, .workers = o.workers, .input_type = o.precision});
  optimizer.schedule(o, total_steps(o, loader.batches_per_epoch()));
  progress show(o, loader.batches_per_epoch(), rank == 0);
  run_result r;
  run_checkpoints ck(o, m.describe(), model, optimizer, compute, comm, active_preemption);
  if (ddp.zero() != zero_stage::none) {
    ck.set_sharded([&](const auto& f) { optimizer.visit([&](auto& opt) { ddp.visit_whole_state(opt, f); }); },
                   [&](const auto& f) { ddp.visit_master_values(f); });
  }
  loss_watch watch(o, compute);
  if (hooks.before_training) hooks.before_training(world, under_mpirun() && o.mode == "ddp");
  const std::int64_t last_step = total_steps(o, loader.batches_per_epoch());
  ddp.reset_report();
  run_epochs(
      o, loader, show, r, ck,
      [&](const auto& b) {
        if (hooks.before_step) hooks.before_step(rank, r.steps + 1, last_step, ctx.get_device(), ddp.collective_stream());
        ctx.set_step(static_cast<std::uint64_t>(r.steps));
        optimizer.zero_grad();
        // shards are equal (the sampler pads), so the global batch is world x this rank's rows; the loss on the
        // wrapper's output is a mean over the global batch (the wrapper sums the ranks' rows), the gradients sums
        std::int64_t global = b.rows * world;
        tensor_view input = b.input, target = b.target;
        if (o.deterministic) {
          global = b.rows;
          const row_range mine = deterministic_shard(b.rows, o.chunk_rows, rank, world);
          ctx.set_row_offset(mine.begin);
          if (o.exact_sums == "auto") ctx.set_global_rows(b.rows);  // lets the wrapper gather partial gradients
          input = b.input.slice_rows(mine.begin, mine.rows);
          target = b.target.slice_rows(mine.begin, mine.rows);
        }
        const tensor_view output = ddp.forward(input);
        // the loss and the step as the report's computing time (ddp brackets its own forward and backward)
        const tensor_view grad = ddp.compute([&] {
          loss.forward(output, target, ctx);
          watch.after_step(loss.loss(), r.steps + 1);
          return loss.backward(ctx);
        });
        ddp.backward(grad);
        ddp.compute([&] { optimizer.step(compute, comm); });  // with mixed precision, every rank skips the same steps
        return global;
      },
      [&] {
        watch.check(comm);
        optimizer.check_skips(o, compute);
        return loss.read_loss(compute);  // the global batch's loss: the wrapper's backward summed the ranks' shares
      },
      [&] { comm.synchronize(compute); },
      [&] { return memory_in_use({ctx.get_device()}); });
  r.scaler = optimizer.scaler_state(compute);
  r.last_grad_norm = optimizer.last_grad_norm(compute);
  r.devices.push_back(ddp.report());
  r.collectives_on = ddp.collective_stream() == compute ? "compute stream" : "communication stream";
  r.devices.back().optimizer_bytes = optimizer.state_bytes();
  r.weights_sha256 = ck.weights_sha256();  // under ZeRO gathers one bucket at a time: after the report
  const bool evaluating = r.stopped.empty() || r.stopped == "--stop-after";  // (the same on every rank)
  if (ddp.zero() == zero_stage::parameters) {  // no rank holds the whole model: every rank evaluates through the
    if (evaluating) {                          // wrapper, which gathers it layer by layer (rank 0's result is kept)
      evaluate_with([&](const tensor_view& x) { return ddp.forward(x); }, data.test, ctx, o, r);
    }
    return r;
  }
  ddp.gather_parameters();  // under ZeRO-1/2: every rank's last update, before rank 0 evaluates the model alone
  if (rank == 0 && evaluating) evaluate(model, data.test, ctx, o, r);
  return r;
}

run_result train_ddp_threads(const options& o, const model_recipe& m, const run_hooks& hooks, const datasets& data,
                             const device_set& devices) {
  std::vector<run_result> ranks(devices.size());
  run_on_devices(devices, [&](rank_context& rc) {
    context ctx(rc.compute_stream(), o.precision);
    ctx.set_seed(o.seed);
    ranks[static_cast<std::size_t>(rc.rank())] = train_ddp_rank(o, m, hooks, data, ctx, rc.comm(), rc.comm_stream());
  });
  run_result r = ranks[0];
  r.devices.clear();
  for (auto& rank : ranks) r.devices.push_back(rank.devices.front());
  r.train_seconds = 0;
  for (auto& rank : ranks) r.train_seconds = std::max(r.train_seconds, rank.train_seconds);
  return r;
}

#if defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI
// One process per rank (mpirun): each takes its local device (GPU local_rank when there are GPUs, else its
// own host:0), and rank 0 gathers every rank's figures.
run_result train_ddp_mpi(const options& o, const model_recipe& m, const run_hooks& hooks, const datasets& data,
                         int& world_rank) {
  const device dev = process_device();
  stream compute(dev), comm_stream(dev);
  communicator comm = make_process_communicator(dev);  // NCCL on a GPU, MPI on a host device
  world_rank = comm.rank();
  context ctx(compute, o.precision);
  ctx.set_seed(o.seed);
  run_result r = train_ddp_rank(o, m, hooks, data, ctx, comm, comm_stream);
  // every rank's peak memory and times, to rank 0
  const device_report mine = r.devices.front();
  constexpr std::size_t fields = 11;
  auto local = to_device(std::vector<double>{static_cast<double>(mine.peak_bytes), mine.compute_ms,
                                             mine.communication_ms, mine.wall_ms, mine.idle_ms, r.train_seconds,
                                             static_cast<double>(mine.parameter_bytes),
                                             static_cast<double>(mine.gradient_bytes),
                                             static_cast<double>(mine.optimizer_bytes),
                                             static_cast<double>(mine.setup_peak_bytes),
                                             static_cast<double>(mine.gathered_peak_bytes)},
                         compute);
  device_buffer<double> all(fields * static_cast<std::size_t>(comm.size()), compute);
  comm.all_gather(local.data(), all.data(), fields, dtype::i64, compute);  // 8-byte elements, gathered as bytes
  comm.synchronize(compute);
  const auto v = to_vector(device_span<const double>(all.span()), compute);
  r.devices.clear();
  for (int k = 0; k < comm.size(); ++k) {
    const double* f = v.data() + fields * static_cast<std::size_t>(k);
    device_report d;
    d.device = device{dev.kind, dev.kind == device_kind::host ? 0 : k};
    d.peak_bytes = static_cast<std::uint64_t>(f[0]);
    d.compute_ms = f[1];
    d.communication_ms = f[2];
    d.wall_ms = f[3];
    d.idle_ms = f[4];
    r.train_seconds = std::max(r.train_seconds, f[5]);
    d.parameter_bytes = static_cast<std::uint64_t>(f[6]);
    d.gradient_bytes = static_cast<std::uint64_t>(f[7]);
    d.optimizer_bytes = static_cast<std::uint64_t>(f[8]);
    d.setup_peak_bytes = static_cast<std::uint64_t>(f[9]);
    d.gathered_peak_bytes = static_cast<std::uint64_t>(f[10]);
    r.devices.push_back(d);
  }
  return r;
}
#endif


std::string device_label(const device_report& d, std::size_t rank, bool processes) {
  return processes ? "rank " + std::to_string(rank) + " " + d.device.str() : d.device.str();
}

// A number for the --json report: JSON has no NaN or infinity, so a value that is not finite (a diverged loss, a
// rate over no time) is null.
json_value number_or_null(double v) { return std::isfinite(v) ? json_value(v) : json_value(nullptr); }

// The number of processes of the mpirun job this process belongs to (1 when not started by mpirun).
int mpirun_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* v = std::getenv(var)) return std::max(1, std::atoi(v));
  }
  return 1;
}

int run_program(const options& o, const model_recipe& m, const run_hooks& hooks) {
  if (o.mode != "ddp" && mpirun_world_size() > 1) {
    throw precondition_error(detail::concat(
        "started by mpirun as one of ", mpirun_world_size(), " processes, but with --mode ", o.mode,
        ": every process would train its own copy of the model alone; use --mode ddp (one rank per process), or run "
        "one process without mpirun"));
  }
  const bool processes = o.mode == "ddp" && under_mpirun();
#if !(defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI)
  if (processes) {
    std::fprintf(stderr, "%s: started by mpirun, but this build has no MPI (link lockstep::mpi)\n", m.program.c_str());
    return 1;
  }
#else
  std::optional<mpi_session> session;
  if (processes) session.emplace();
#endif
  std::optional<preemption_guard> guard;
  if (!o.save.empty()) {
    guard.emplace();
    active_preemption = &*guard;
  }
  const device_selection selection =
      o.devices.empty() ? default_devices() : device_selection{device_set(o.devices), "--devices " + o.devices};
  if (processes && !o.devices.empty()) {
    throw precondition_error("--devices " + o.devices + " has no effect under mpirun: each process takes the device of "
                             "its local rank (GPU local_rank, else host:0); leave it out, and choose GPUs for the job "
                             "with CUDA_VISIBLE_DEVICES");
  }
  // The test split is read on a second thread while this one reads the training split (decompressing the 47 MB of
  // training images is most of a short run's start-up). Its errors reach this thread through the future, after
  // the training split's (an error there leaves the future to wait for the test split in its destructor).
  std::future<mnist_dataset> test_split =
      std::async(std::launch::async, [&] { return load_fashion_mnist(o.data, mnist_split::test); });
  mnist_dataset train_split = load_fashion_mnist(o.data, mnist_split::train);
  datasets data{std::move(train_split), test_split.get(), 0};
  data.inputs = static_cast<std::int64_t>(data.train.layout().input_elements());
  if (data.test.rows() != data.train.rows() || data.test.cols() != data.train.cols()) {
    throw data_error(detail::concat("the test images in ", o.data, " (t10k-images-idx3-ubyte) are ", data.test.rows(),
                                    "x", data.test.cols(), " but the training images (train-images-idx3-ubyte) are ",
                                    data.train.rows(), "x", data.train.cols(),
                                    ": the model could not evaluate them; use files of one data set"));
  }

  if (!o.json && !processes && selection.devices.kind() == device_kind::host) {
    // Which kernels multiply, and how fast one core runs the first layer's forward product in this precision
    // (a measurement, not part of the run: a device too small for it says so and trains on).
    std::printf("host GEMM: %s\n", host_gemm_plan::process().str().c_str());
    const std::int64_t rows = std::max<std::int64_t>(1, o.batch / static_cast<std::int64_t>(
                                                              o.mode == "single" ? 1 : selection.devices.size()));
    const gemm_shape first = m.first_product(rows, data.inputs);
    try {
      stream s(selection.devices.front());
      blas_handle h(s);
      const double rate = gemm_rate(h, o.precision, first, 0.05);
      std::printf("           %s %.0f GFLOP/s on one core for the first layer (%lld x %lld x %lld)\n",
                  std::string(name_of(o.precision)).c_str(), rate, static_cast<long long>(first.m),
                  static_cast<long long>(first.n), static_cast<long long>(first.k));
    } catch (const out_of_memory_error& e) {
      std::printf("           rate not measured: %s\n", e.what());
    }
  }
  int world_rank = 0;
  run_result r;
  std::vector<std::string> device_names;
  if (o.mode == "single") {
    const device dev = selection.devices.front();
    if (!o.json) std::printf("devices: %s (%s); mode single on %s\n", selection.devices.str().c_str(), selection.reason.c_str(), dev.str().c_str());
    r = train_single(o, m, data, dev);
  } else if (o.mode == "dp") {
    if (!o.json) std::printf("devices: %s (%s); mode dp\n", selection.devices.str().c_str(), selection.reason.c_str());
    r = train_dp(o, m, data, selection.devices);
  } else if (!processes) {
    if (!o.json) std::printf("devices: %s (%s); mode ddp, one thread per device\n", selection.devices.str().c_str(), selection.reason.c_str());
    r = train_ddp_threads(o, m, hooks, data, selection.devices);
  } else {
#if defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI
    r = train_ddp_mpi(o, m, hooks, data, world_rank);
    if (world_rank == 0 && !o.json) std::printf("mode ddp, %zu processes (mpirun)\n", r.devices.size());
#endif
  }
  if (world_rank != 0) return 0;
  for (std::size_t i = 0; i < r.devices.size(); ++i) device_names.push_back(device_label(r.devices[i], i, processes));

  const double throughput = r.train_seconds > 0 ? static_cast<double>(r.samples) / r.train_seconds : 0.0;
  if (!o.json) {
    if (!r.stopped.empty()) std::printf("\nstopped by %s at step %lld\n", r.stopped.c_str(), static_cast<long long>(r.steps));
    if (!r.checkpoint.empty()) std::printf("\ncheckpoint         %s (resume with --resume %s)\n", r.checkpoint.c_str(), o.save.c_str());
    if (r.tested > 0) std::printf("\ntest accuracy      %.4f (%lld of %lld)\n", r.accuracy, static_cast<long long>(r.correct), static_cast<long long>(r.tested));
    std::printf("weights sha256     %s\n", r.weights_sha256.c_str());
    std::printf("training seconds   %.2f\n", r.train_seconds);
    std::printf("samples per second %.0f\n", throughput);
    if (r.resumed_at >= 0 && r.steps == r.resumed_at) {
      std::printf("final loss         none: nothing was left to train (the checkpoint is at step %lld, the run's end)\n",
                  static_cast<long long>(r.steps));
    } else {
      std::printf("final loss         %.4f\n", r.final_loss);
    }
    if (r.scaler) {
      std::printf("precision          %s, loss scale %g, %lld of %lld steps skipped (last overflow at step %lld)\n",
                  std::string(name_of(o.precision)).c_str(), static_cast<double>(r.scaler->scale),
                  static_cast<long long>(r.scaler->skipped_steps), static_cast<long long>(r.scaler->steps),
                  static_cast<long long>(r.scaler->last_overflow_step));
    }
    if (!r.collectives_on.empty()) std::printf("collectives        on the %s\n", r.collectives_on.c_str());
    std::printf("%-22s %12s %12s %12s %14s %10s\n", "device", "peak memory", "setup peak", "compute ms",
                "communicate ms", "idle ms");
    for (std::size_t i = 0; i < r.devices.size(); ++i) {
      const auto& d = r.devices[i];
      std::printf("%-22s %12s %12s %12.0f %14.0f %10.0f\n", device_names[i].c_str(), format_bytes(d.peak_bytes).c_str(),
                  format_bytes(d.setup_peak_bytes).c_str(), d.compute_ms, d.communication_ms, d.idle_ms);
    }
    if (o.mode == "ddp") {  // what the training state takes on each device (ZeRO shards it; ZeRO-3 gathers values)
      const bool gathers = o.zero == 3;
      std::printf("%-22s %12s %12s %14s%s\n", o.zero > 0 ? ("state, ZeRO-" + std::to_string(o.zero)).c_str() : "state",
                  "parameters", "gradients", "optimizer", gathers ? "  gathered peak" : "");
      for (std::size_t i = 0; i < r.devices.size(); ++i) {
        const auto& d = r.devices[i];
        std::printf("%-22s %12s %12s %14s", device_names[i].c_str(), format_bytes(d.parameter_bytes).c_str(),
                    format_bytes(d.gradient_bytes).c_str(), format_bytes(d.optimizer_bytes).c_str());
        if (gathers) std::printf(" %14s", format_bytes(d.gathered_peak_bytes).c_str());
        std::printf("\n");
      }
    }
    return 0;
  }
  json_value j;
  j["test_accuracy"] = r.accuracy;
  j["test_correct"] = r.correct;
  j["test_samples"] = r.tested;
  j["weights_sha256"] = r.weights_sha256;
  if (!r.checkpoint.empty()) j["checkpoint"] = r.checkpoint;
  if (!r.stopped.empty()) j["stopped"] = r.stopped;
  if (r.resumed_at >= 0) j["resumed_at_step"] = r.resumed_at;
  j["train_seconds"] = r.train_seconds;
  j["samples_per_second"] = number_or_null(throughput);
  j["epochs"] = o.epochs;
  j["steps"] = r.steps;
  j["batch"] = o.batch;
  j.update(m.describe());
  j["optimizer"] = o.optimizer;
  j["lr"] = r.lr;
  if (!r.changed_on_resume.empty()) j["changed_on_resume"] = r.changed_on_resume;
  j["lr_schedule"] = o.lr_schedule;
  if (o.clip_grad_norm > 0.0f) j["clip_grad_norm"] = o.clip_grad_norm;
  if (o.deterministic) j["chunk_rows"] = o.chunk_rows;
  if (o.deterministic && o.mode == "ddp") j["exact_sums"] = o.exact_sums;
  j["deterministic"] = o.deterministic;
  if (o.mode == "ddp") j["zero"] = o.zero;
  if (!r.collectives_on.empty()) j["collectives_on"] = r.collectives_on;
  if (r.last_grad_norm) j["last_grad_norm"] = number_or_null(*r.last_grad_norm);
  j["precision"] = std::string(name_of(o.precision));
  j["host_gemm"] = host_gemm_plan::process().str();
  j["mode"] = processes ? "ddp-mpi" : o.mode;
  if (r.resumed_at >= 0 && r.steps == r.resumed_at) {
    j["final_loss"] = nullptr;  // nothing was left to train
  } else {
    j["final_loss"] = number_or_null(r.final_loss);  // null also when the loss was not finite
  }
  if (r.scaler) {
    j["loss_scale"] = number_or_null(r.scaler->scale);
    j["skipped_steps"] = r.scaler->skipped_steps;
    j["last_overflow_step"] = r.scaler->last_overflow_step;
  }
  j["devices"] = device_names;
  json_value peak = json_value::object(), per_device = json_value::array();
  for (std::size_t i = 0; i < r.devices.size(); ++i) {
    const auto& d = r.devices[i];
    peak[device_names[i]] = d.peak_bytes;
    json_value entry{{"device", device_names[i]}, {"peak_memory_bytes", d.peak_bytes},
                     {"setup_peak_memory_bytes", d.setup_peak_bytes}, {"compute_ms", d.compute_ms},
                     {"communication_ms", d.communication_ms}, {"idle_ms", d.idle_ms}, {"wall_ms", d.wall_ms}};
    if (o.mode == "ddp") {
      entry["parameter_bytes"] = d.parameter_bytes;
      entry["gradient_bytes"] = d.gradient_bytes;
      entry["optimizer_bytes"] = d.optimizer_bytes;
      entry["gathered_peak_bytes"] = d.gathered_peak_bytes;  // (ZeRO-3; else 0)
    }
    per_device.push_back(std::move(entry));
  }
  j["peak_memory_bytes"] = peak;
  j["per_device"] = per_device;
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

int run(int argc, char** argv, const model_recipe& model, const run_hooks& hooks) {
  const std::string usage = "usage: " + model.program + " [options]\n" + model.usage + common_usage + hooks.usage;
  options o;
  try {
    o = parse_options(argc, argv, model.parse);
    if (model.check) model.check(o);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "%s: %s\n\n%s", model.program.c_str(), e.what(), usage.c_str());
    return 2;
  }
  if (o.help) {
    std::printf("%s", usage.c_str());
    return 0;
  }
  try {
    return run_program(o, model, hooks);
  } catch (const std::exception& e) {
#if defined(LOCKSTEP_WITH_MPI) && LOCKSTEP_WITH_MPI
    // One rank of an mpirun job: print, then end the whole job now (the others would wait for this rank).
    if (o.mode == "ddp" && under_mpirun()) lockstep::abort_mpi_job(model.program.c_str(), e);
#endif
    std::fprintf(stderr, "%s: %s\n", model.program.c_str(), e.what());
    return 1;
  }
}

}  // namespace sample
