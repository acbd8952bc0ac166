// The samples' command line (mlp_train, cnn_train): the options every sample has, with errors that say what was
// wrong; a sample's model adds its own (model_recipe::parse in sample.hpp).
#pragma once

#include <lockstep/core/dtype.hpp>
#include <lockstep/data/idx.hpp>

#include <algorithm>
#include <charconv>
#include <functional>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace sample {

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct options {
  std::string data = std::string(lockstep::default_fashion_mnist_dir);
  std::string devices;  // empty: lockstep::default_devices()
  std::string mode = "single";
  int epochs = 5;
  std::int64_t batch = 128;
  float lr = 0.05f;
  float momentum = 0.9f;
  float weight_decay = 0.0f;
  float clip_grad_norm = 0.0f;  // 0: no clipping
  bool deterministic = false;   // the same bits on any number of devices and in any mode
  std::int64_t chunk_rows = 32;
  std::string exact_sums = "auto";  // --mode ddp --deterministic: auto (partials gathered when few) or accumulators
  int zero = 0;                 // --mode ddp: ZeRO stage
  std::string host_collectives = "auto";  // --mode ddp on host devices: auto, communication or compute
  std::string optimizer = "sgd";
  std::string lr_schedule = "cosine";
  std::uint64_t seed = 0;
  int workers = 0;
  lockstep::dtype precision = lockstep::dtype::f32;
  std::int64_t max_steps = 0;  // 0: no limit
  int print_every = 50;
  std::int64_t eval_batch = 1000;
  std::int64_t max_bad_steps = 0;  // f32 steps with a non-finite loss tolerated before the run stops
  std::int64_t max_skipped_steps = 20;  // f16/bf16 steps skipped in a row before the run stops
  // given on the command line (not defaults): on --resume these replace the checkpoint's values
  bool lr_given = false;
  bool momentum_given = false;
  bool weight_decay_given = false;
  std::string save;             // checkpoint root; empty: no checkpoints
  std::int64_t save_every = 0;  // steps between checkpoints; 0: only at the end (and on SIGTERM/SIGINT)
  int keep_last = 3;
  bool overwrite = false;       // save into a --save DIR that holds another run's checkpoints, removing them
  std::string resume;           // a checkpoint, or a root whose newest checkpoint is taken
  std::int64_t stop_after = 0;  // end the run after this many steps, the schedule still spanning --epochs
  std::string load_model;       // initial weights (safetensors)
  bool json = false;
  bool help = false;
};

/// The options every sample has (after the usage line and the model's own options).
inline constexpr const char* common_usage =
    "  --data DIR            IDX files (default /usr/share/datasets/fashion-mnist)\n"
    "  --devices SPEC        devices: \"0,1\", \"cuda:0,cuda:1\", \"host:0\", \"all\" (default: all GPUs, else host)\n"
    "  --mode M              single (default), dp (DataParallel) or ddp (DistributedDataParallel: one thread\n"
    "                        per device, or one process per rank under mpirun -np N)\n"
    "  --epochs N            epochs (default 5)\n"
    "  --batch N             global batch size (default 128)\n"
    "  --lr X                learning rate (default 0.05)\n"
    "  --lr-schedule S       cosine (default: from --lr down to 0 over the run, stepped every batch) or constant\n"
    "  --momentum X          SGD momentum (default 0.9)\n"
    "  --weight-decay X      weight decay (default 0)\n"
    "  --clip-grad-norm X    clip the gradients' total 2-norm to X before each step (default: no clipping)\n"
    "  --deterministic       the same weights (weights_sha256) on 1..N devices, in every mode: batches in\n"
    "                        chunks of --chunk-rows rows, gradients summed exactly (docs/determinism.md)\n"
    "  --chunk-rows N        rows per chunk under --deterministic (default 32)\n"
    "  --exact-sums S        --mode ddp --deterministic: auto (default: the chunks' partial gradients gathered when\n"
    "                        the batch has few chunks) or accumulators (exact sums all-reduced); the same bits\n"
    "  --zero S              --mode ddp: 0 (default) keeps a whole copy of the training state per device; 1 shards\n"
    "                        the optimizer state and fp32 master weights over the ranks (ZeRO-1), 2 the gradients too,\n"
    "                        3 the weights too (gathered a few layers at a time in a step)\n"
    "  --host-collectives S  --mode ddp on host devices: the stream the collectives run on: auto (default: the\n"
    "                        compute stream when this process has fewer than two cores per rank), communication\n"
    "                        or compute (the same results either way)\n"
    "  --optimizer NAME      sgd (default) or adamw\n"
    "  --precision P         f32 (default), f16 or bf16\n"
    "  --seed N              seed of initialization and shuffling (default 0)\n"
    "  --workers N           data loader worker threads (default: min(4 x devices, cores))\n"
    "  --max-steps N         stop after N training steps (default: no limit)\n"
    "  --print-every N       progress every N steps (default 50)\n"
    "  --eval-batch N        batch size of the test evaluation (default 1000)\n"
    "  --max-bad-steps N     f32: steps with a non-finite loss to tolerate before stopping with an error\n"
    "                        (default 0: the first one stops the run; f16/bf16 skip such steps instead)\n"
    "  --max-skipped-steps N f16/bf16: steps the loss scaler may skip in a row (gradients not finite even as\n"
    "                        the scale backs off) before stopping with an error (default 20: from the first\n"
    "                        scale, 65536, 16 back-offs reach the floor of 1)\n"
    "  --save DIR            write checkpoints under DIR (DIR/step-N/: model.safetensors, training.safetensors,\n"
    "                        manifest.json) at the end of the run, every --save-every steps, and on SIGTERM or\n"
    "                        SIGINT (then the run stops after the current step; with several ranks within\n"
    "                        10 steps, all at the same one)\n"
    "  --save-every N        also save every N steps (default: only at the end)\n"
    "  --keep-last K         keep the newest K checkpoints under DIR, 0 for all (default 3)\n"
    "  --overwrite           save into a DIR that holds another run's checkpoints (one this run did not\n"
    "                        --resume from), replacing them; without it such a DIR is refused before training\n"
    "  --resume DIR          continue the run saved in DIR (a step-N directory, or a --save DIR: its newest)\n"
    "                        with the same model options, --optimizer, --precision, --batch, --seed,\n"
    "                        --lr-schedule, --epochs and --max-steps (the devices and the mode may change)\n"
    "  --stop-after N        end the run after its Nth step (saving with --save), as a pre-empted job would;\n"
    "                        unlike --max-steps, the learning-rate schedule still spans --epochs\n"
    "  --load-model FILE     start from the weights of a safetensors file (lockstep's or PyTorch's);\n"
    "                        with --epochs 0, only evaluate them\n"
    "  --json                print one JSON line with the results instead of text\n"
    "  --help                this text\n"
    "\n"
    "environment:\n"
    "  LOCKSTEP_COMM_TIMEOUT       seconds a collective waits for the other ranks before failing (default 300):\n"
    "                              a rank that stopped or hangs is named after this long, and the run ends\n"
    "  LOCKSTEP_COMM_CHECK         1 (default): check that all ranks issue the same collectives; 0: do not\n"
    "  LOCKSTEP_HOST_DEVICES       number of host devices (default: 2)\n"
    "  CUDA_VISIBLE_DEVICES        the GPUs this process sees\n";

namespace options_detail {

template <class T>
T parse_number(std::string_view flag, std::string_view text) {
  T value{};
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc{} || p != end) {
    throw usage_error(std::string(flag) + " expects a number, got '" + std::string(text) + "'");
  }
  return value;
}

inline float parse_float(std::string_view flag, std::string_view text) {
  try {
    std::size_t used = 0;
    const float v = std::stof(std::string(text), &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw usage_error(std::string(flag) + " expects a number, got '" + std::string(text) + "'");
}

}  // namespace options_detail

/// A list of positive widths, "256,256" (a model's option, such as --hidden).
inline std::vector<std::int64_t> parse_widths(std::string_view flag, std::string_view list) {
  std::vector<std::int64_t> widths;
  if (list.empty()) {
    throw usage_error(std::string(flag) + " needs at least one width, as in " + std::string(flag) + " 256,256");
  }
  while (true) {
    const auto comma = list.find(',');
    const auto item = list.substr(0, comma);
    const auto width = options_detail::parse_number<std::int64_t>(flag, item);
    if (width < 1) throw usage_error(std::string(flag) + " widths must be positive, got " + std::string(item));
    widths.push_back(width);
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return widths;
}

/// A number in [low, high) (a model's option, such as --dropout).
inline float parse_fraction(std::string_view flag, std::string_view text, float low, float high) {
  const float v = options_detail::parse_float(flag, text);
  if (!(v >= low && v < high)) {
    throw usage_error(std::string(flag) + " must be in [" + std::to_string(low).substr(0, 3) + ", " +
                      std::to_string(high).substr(0, 3) + "), got " + std::string(text));
  }
  return v;
}

/// A model's own option: returns whether `flag` is one, taking its value (when it has one) from `value()`.
using model_option_parser = std::function<bool(std::string_view flag, const std::function<std::string_view()>& value)>;

/// Parses argv: the common options, and the model's through `model_option` (throws usage_error).
inline options parse_options(int argc, char** argv, const model_option_parser& model_option) {
  using options_detail::parse_float;
  using options_detail::parse_number;
  options o;
  std::vector<std::string_view> given;  // the options on the command line, to check what depends on what
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    given.push_back(flag);
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw usage_error(std::string(flag) + " needs a value");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      o.help = true;
    } else if (flag == "--json") {
      o.json = true;
    } else if (flag == "--data") {
      o.data = value();
    } else if (flag == "--devices") {
      o.devices = value();
    } else if (flag == "--mode") {
      o.mode = value();
      if (o.mode != "single" && o.mode != "dp" && o.mode != "ddp") {
        throw usage_error("--mode must be single, dp or ddp, got '" + o.mode + "'");
      }
    } else if (flag == "--epochs") {
      o.epochs = parse_number<int>(flag, value());
      if (o.epochs < 0) throw usage_error("--epochs must be at least 1 (or 0 with --load-model: evaluate only)");
    } else if (flag == "--batch") {
      o.batch = parse_number<std::int64_t>(flag, value());
      if (o.batch < 1) throw usage_error("--batch must be at least 1");
    } else if (flag == "--lr") {
      o.lr = parse_float(flag, value());
      o.lr_given = true;
      if (!(o.lr > 0.0f)) throw usage_error("--lr must be a positive number, got " + std::string(argv[i]));
    } else if (flag == "--momentum") {
      o.momentum = parse_float(flag, value());
      o.momentum_given = true;
      if (!(o.momentum >= 0.0f && o.momentum < 1.0f)) {
        throw usage_error("--momentum must be in [0, 1) (0.9 is usual), got " + std::string(argv[i]));
      }
    } else if (flag == "--weight-decay") {
      o.weight_decay = parse_float(flag, value());
      o.weight_decay_given = true;
      if (!(o.weight_decay >= 0.0f)) throw usage_error("--weight-decay must be >= 0, got " + std::string(argv[i]));
    } else if (flag == "--clip-grad-norm") {
      o.clip_grad_norm = parse_float(flag, value());
      if (!(o.clip_grad_norm > 0.0f) || o.clip_grad_norm - o.clip_grad_norm != 0.0f) {
        throw usage_error("--clip-grad-norm must be a positive number, got " + std::string(argv[i]));
      }
    } else if (flag == "--deterministic") {
      o.deterministic = true;
    } else if (flag == "--chunk-rows") {
      o.chunk_rows = parse_number<std::int64_t>(flag, value());
      if (o.chunk_rows < 1) throw usage_error("--chunk-rows must be at least 1 (a power of two such as 32 is usual)");
    } else if (flag == "--exact-sums") {
      o.exact_sums = value();
      if (o.exact_sums != "auto" && o.exact_sums != "accumulators") {
        throw usage_error("--exact-sums must be auto or accumulators, got " + o.exact_sums);
      }
    } else if (flag == "--host-collectives") {
      o.host_collectives = value();
      if (o.host_collectives != "auto" && o.host_collectives != "communication" && o.host_collectives != "compute") {
        throw usage_error("--host-collectives must be auto, communication or compute, got " + o.host_collectives);
      }
    } else if (flag == "--zero") {
      o.zero = parse_number<int>(flag, value());
      if (o.zero < 0 || o.zero > 3) throw usage_error("--zero must be 0, 1, 2 or 3, got " + std::string(argv[i]));
    } else if (flag == "--optimizer") {
      o.optimizer = value();
      if (o.optimizer != "sgd" && o.optimizer != "adamw") {
        throw usage_error("--optimizer must be sgd or adamw, got '" + o.optimizer + "'");
      }
    } else if (flag == "--lr-schedule") {
      o.lr_schedule = value();
      if (o.lr_schedule != "cosine" && o.lr_schedule != "constant") {
        throw usage_error("--lr-schedule must be cosine or constant, got '" + o.lr_schedule + "'");
      }
    } else if (flag == "--precision") {
      const std::string_view p = value();
      try {
        o.precision = lockstep::parse_dtype(p);
      } catch (const std::exception&) {
        o.precision = lockstep::dtype::u8;
      }
      if (!lockstep::is_floating(o.precision)) {
        throw usage_error("--precision must be f32, f16 or bf16, got '" + std::string(p) + "'");
      }
    } else if (flag == "--seed") {
      const std::string_view v = value();
      if (!v.empty() && v.front() == '-') throw usage_error("--seed must be a non-negative integer, got " + std::string(v));
      o.seed = parse_number<std::uint64_t>(flag, v);
    } else if (flag == "--workers") {
      o.workers = parse_number<int>(flag, value());
      if (o.workers < 0) throw usage_error("--workers must be >= 0");
    } else if (flag == "--max-steps") {
      o.max_steps = parse_number<std::int64_t>(flag, value());
      if (o.max_steps < 1) throw usage_error("--max-steps must be at least 1 (leave it out for no limit)");
    } else if (flag == "--print-every") {
      o.print_every = parse_number<int>(flag, value());
      if (o.print_every < 1) throw usage_error("--print-every must be at least 1");
    } else if (flag == "--eval-batch") {
      o.eval_batch = parse_number<std::int64_t>(flag, value());
      if (o.eval_batch < 1) throw usage_error("--eval-batch must be at least 1");
    } else if (flag == "--max-skipped-steps") {
      o.max_skipped_steps = parse_number<std::int64_t>(flag, value());
      if (o.max_skipped_steps < 1) throw usage_error("--max-skipped-steps must be at least 1");
    } else if (flag == "--max-bad-steps") {
      o.max_bad_steps = parse_number<std::int64_t>(flag, value());
      if (o.max_bad_steps < 0) throw usage_error("--max-bad-steps must be >= 0");
    } else if (flag == "--save") {
      o.save = value();
      if (o.save.empty()) throw usage_error("--save needs a directory");
    } else if (flag == "--save-every") {
      o.save_every = parse_number<std::int64_t>(flag, value());
      if (o.save_every < 1) throw usage_error("--save-every must be at least 1");
    } else if (flag == "--keep-last") {
      o.keep_last = parse_number<int>(flag, value());
      if (o.keep_last < 0) throw usage_error("--keep-last must be >= 0 (0 keeps every checkpoint)");
    } else if (flag == "--overwrite") {
      o.overwrite = true;
    } else if (flag == "--resume") {
      o.resume = value();
      if (o.resume.empty()) throw usage_error("--resume needs a directory");
    } else if (flag == "--stop-after") {
      o.stop_after = parse_number<std::int64_t>(flag, value());
      if (o.stop_after < 1) throw usage_error("--stop-after must be at least 1");
    } else if (flag == "--load-model") {
      o.load_model = value();
      if (o.load_model.empty()) throw usage_error("--load-model needs a file");
    } else if (!model_option || !model_option(flag, value)) {
      throw usage_error("unknown option '" + std::string(flag) + "'");
    }
  }
  if (o.epochs == 0 && o.load_model.empty()) {
    throw usage_error("--epochs 0 trains nothing: give --load-model FILE to evaluate a saved model");
  }
  auto was_given = [&](std::string_view f) { return std::find(given.begin(), given.end(), f) != given.end(); };
  if (o.save_every > 0 && o.save.empty()) throw usage_error("--save-every needs --save DIR");
  // An option whose effect depends on another must not be silently ignored without it.
  if (was_given("--keep-last") && o.save.empty()) {
    throw usage_error("--keep-last prunes the checkpoints under --save DIR: give --save DIR too");
  }
  if (o.overwrite && o.save.empty()) {
    throw usage_error("--overwrite replaces another run's checkpoints under --save DIR: give --save DIR too");
  }
  if (was_given("--chunk-rows") && !o.deterministic) {
    throw usage_error("--chunk-rows sets the chunks of --deterministic: give --deterministic too");
  }
  if (was_given("--exact-sums") && !(o.deterministic && o.mode == "ddp")) {
    throw usage_error("--exact-sums chooses how --mode ddp --deterministic sums gradients: give both");
  }
  if (was_given("--host-collectives") && o.mode != "ddp") {
    throw usage_error("--host-collectives chooses the stream of DDP's collectives: use it with --mode ddp");
  }
  if (o.zero > 0 && o.mode != "ddp") {
    throw usage_error("--zero " + std::to_string(o.zero) + " shards the training state over DDP's ranks: use it with "
                      "--mode ddp (--mode " + o.mode + " keeps one copy)");
  }
  if (!o.resume.empty() && !o.load_model.empty()) {
    throw usage_error("--resume and --load-model both set the weights: give one of them");
  }
  return o;
}

}  // namespace sample
