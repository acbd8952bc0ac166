// lockstep/io/checkpoint.hpp — saving and loading models and whole training runs.
//
//   save_model(file, parameters_of(model), s)        one safetensors file of the fp32 master values and the
//   load_model(file, parameters_of(model), s)        buffers, with PyTorch's names ("0.weight", "bn1.running_mean"):
//                                                    torch's load_state_dict(strict=True) reads it
//
//   checkpoint_state st(parameters_of(model));       what a run needs to continue exactly: the model, and
//   st.optimizer(opt).scaler(scaler).schedule(sched); the optimizer, loss scaler and schedule it names
//   st.position = {.step = step, .epoch = e, ...};   where the loop stands (data order, dropout stream)
//   checkpointer saver(root, {.keep_last = 3});
//   saver.save(st, s [, comm]);                      root/step-000000000100/{model,training}.safetensors
//   saver.save_async(st, s [, comm]);                + manifest.json; asynchronously: written by a thread
//   load_checkpoint(root, st, s);                    the newest complete checkpoint, onto s's device
//
// Under ZeRO no device holds whole master values or optimizer state: `st.sharded(source)` names where a save reads
// them (distributed_data_parallel::visit_whole_state streams them to the host tensor by tensor; every rank calls
// save, rank 0 writes), and a load writes each rank's own range of them.
//
// Writes are atomic: files go into a temporary directory beside the final one, are synced, and the directory
// is renamed into place (or, when that step was saved before, exchanged with it in one renameat2); a crash at
// any point leaves the earlier checkpoints intact, and older ones are removed
// (keep_last) only once the new one is complete. Loads are all or nothing: both files are read, their
// checksums (XXH3-64, in the manifest) and every tensor's name, dtype and shape are checked, and only then is
// anything of the model, optimizer, scaler or schedule changed; any fault throws and leaves them as they were.
//
// Values are copied in stream order on the stream of the device that holds them into host staging memory
// (pinned_buffer), or, when a synchronous save runs on a host device, written straight from that device's memory:
// nothing passes through another device. Files are read by mapping them (no copy into a staging buffer) and
// checked with a 64-bit XXH3 hash of every byte, which runs at memory speed. A checkpoint written by N ranks loads on M: the state
// it holds is the replicated state of data parallelism, and `run_position::epoch_samples` counts samples of the
// epoch's global order, which distributed_sampler::set_start resumes on any number of ranks.
#pragma once

// xxHash (Debian: libxxhash-dev) as header-only code: no library to link, and no clash with a program that links
// libxxhash itself (its inline mode gives every function internal linkage and a private name).
#if defined(XXH_INLINE_ALL)
#include <xxhash.h>
#else
#define XXH_INLINE_ALL
#include <xxhash.h>
#undef XXH_INLINE_ALL
#endif
#include <signal.h>
#include <stdio.h>  // renameat2
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/amp/loss_scaler.hpp"
#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/core/thread_name.hpp"
#include "lockstep/io/file.hpp"
#include "lockstep/io/json.hpp"
#include "lockstep/io/safetensors.hpp"
#include "lockstep/io/sha256.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/optim/adamw.hpp"
#include "lockstep/optim/lr_schedule.hpp"
#include "lockstep/optim/sgd.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/pinned_buffer.hpp"
#include "lockstep/runtime/stream.hpp"

LOCKSTEP_ABI_BEGIN

/// Where a save reads whole fp32 tensors that no device holds whole (ZeRO shards the master values and the
/// optimizer state: distributed_data_parallel::visit_whole_state is one). Called with f, it calls f(p, which,
/// values) once for every parameter p of the model with its master values (which == master_values_tensor) and for
/// each of its optimizer state tensors (which = 0, 1), in any order, with the values in host memory (valid during
/// the call). Collective: every rank of a distributed save calls it.
using whole_state_source =
    std::function<void(const std::function<void(const parameter&, int, std::span<const float>)>&)>;

/// The version of the checkpoint layout this header writes (and the newest it reads).
inline constexpr int checkpoint_format_version = 1;

/// Where a training loop stands: what it needs, beyond the model and optimizer, to continue exactly.
struct run_position {
  std::int64_t step = 0;              ///< optimizer steps taken in the run
  std::uint64_t epoch = 0;            ///< the epoch in progress (or the next one, when epoch_samples is 0)
  std::uint64_t epoch_samples = 0;    ///< entries of that epoch's global sample order already trained on
  std::uint64_t data_seed = 0;        ///< the sampler's shuffling seed
  std::uint64_t dropout_seed = 0;     ///< context::seed()
  std::uint64_t dropout_step = 0;     ///< context::step() of the next step
  int world_size = 1;                 ///< ranks of the run that wrote it (informational: any number may resume)
  dtype precision = dtype::f32;       ///< the compute precision of the run that wrote it
};

/// Whether a checkpoint's files are flushed to the storage device before it is published.
enum class durability : std::uint8_t {
  fsync,       ///< fsync the files and directories: a power loss keeps the checkpoint (the default)
  page_cache,  ///< leave it to the page cache: survives a crash of the process, not of the machine
};

/// When a checkpointer checks that its root can be written (see checkpoint_options::check_root).
enum class root_check : std::uint8_t { at_construction, at_first_save };

struct checkpoint_options {
  /// Keep the newest `keep_last` checkpoints under the root and remove older ones once a new one is complete;
  /// 0 keeps every one.
  std::size_t keep_last = 0;
  lockstep::durability durability = durability::fsync;
  /// Called with the temporary directory once its files are written and synced, before it is renamed into
  /// place. Tests use it to kill a process at the worst moment; it may throw to abandon the save.
  std::function<void(const std::filesystem::path&)> before_publish = {};
  /// `at_construction`: the constructor creates the root when missing and checks that files can be created in it,
  /// so that an unwritable root (a regular file, a read-only or forbidden directory) fails before any training
  /// instead of at the first save. `at_first_save`: no check until the first save, for a rank that never writes
  /// (a distributed save writes on rank 0 only, whose root may not exist on the others' machines). (The writer
  /// lock is checkpointer::lock()'s, or the first save's.)
  root_check check_root = root_check::at_construction;
  /// Save into a root that holds checkpoints of other runs (another checkpoint_state::run_id: a run that was not
  /// resumed from them): they are removed once this run's first checkpoint there is complete. Off (the default),
  /// such a save is refused before it writes anything, naming them (checkpointer::expect_own_root says so before
  /// training): a fresh run that forgot to resume would otherwise mix its steps with the other run's (loading the
  /// root takes the latest step, whichever run wrote it) and keep_last would delete the other run's.
  bool overwrite = false;
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

inline constexpr const char* model_file_name = "model.safetensors";
inline constexpr const char* training_file_name = "training.safetensors";
inline constexpr const char* manifest_file_name = "manifest.json";
inline constexpr const char* module_prefix = "module.";

/// A new run's identity: 16 hex digits from the kernel's random source (the time and the pid if it fails).
inline std::string new_run_id() {
  std::uint64_t v = 0;
  if (::getrandom(&v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) {
    v = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull ^
        static_cast<std::uint64_t>(::getpid());
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(v));
  return out;
}

/// The run this process trains (the default checkpoint_state::run_id): a new one per process, until
/// load_checkpoint makes it the loaded checkpoint's run (the process then goes on with that run).
inline std::mutex& process_run_mutex() {
  static std::mutex m;
  return m;
}
inline std::optional<std::string>& process_run_storage() {
  static std::optional<std::string> id;
  return id;
}
inline std::string process_run_id() {
  std::lock_guard lock(process_run_mutex());
  auto& id = process_run_storage();
  if (!id) id = new_run_id();
  return *id;
}
inline void adopt_process_run_id(const std::string& id) {
  std::lock_guard lock(process_run_mutex());
  process_run_storage() = id;
}

inline std::vector<std::int64_t> dims_of(const shape& s) {
  std::vector<std::int64_t> out;
  for (int i = 0; i < s.rank(); ++i) out.push_back(s[i]);
  return out;
}

/// XXH3-64 of a sequence of byte ranges, as 16 hex digits: the checksum a manifest keeps of each file.
class content_hash {
 public:
  content_hash() noexcept { XXH3_64bits_reset(&state_); }
  void update(std::span<const std::byte> data) noexcept { XXH3_64bits_update(&state_, data.data(), data.size()); }
  [[nodiscard]] std::string hex() const {
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(XXH3_64bits_digest(&state_)));
    return text;
  }

 private:
  XXH3_state_t state_;
};

/// The checksum a manifest keeps of itself ("checksum"): XXH3-64 of its compact JSON text without that member
/// (keys sorted), so that an edited position (step, epoch, epoch_samples) or file entry is found on load. It is
/// computed from the text as written (`manifest_text`: the file, or any dump of it; the whitespace between tokens
/// and the top-level "checksum" member are left out), never from a new dump of the parsed values: manifests written
/// by earlier lockstep versions (with nlohmann::json, whose Grisu2 digits are in rare cases one longer than
/// std::to_chars' shortest) keep checking against the checksum they were written with; those versions re-dumped
/// the values they read, so they verify this version's manifests except in those rare cases.
inline std::string manifest_checksum(std::string_view manifest_text) {
  std::string text, member;  // the compact text without "checksum"; the top-level member being read
  bool in_string = false, escaped = false;
  int depth = 0;
  const auto end_member = [&] {
    if (!member.empty() && !member.starts_with("\"checksum\":")) {
      if (text.size() > 1) text += ',';
      text += member;
    }
    member.clear();
  };
  for (const char ch : manifest_text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') {
      continue;
    } else if (ch == '"') {
      in_string = true;
    } else if ((ch == '{' || ch == '[') && depth++ == 0) {
      text += ch;
      continue;
    } else if ((ch == '}' || ch == ']') && --depth == 0) {
      end_member();
      text += ch;
      continue;
    } else if (ch == ',' && depth == 1) {
      end_member();
      continue;
    }
    (depth > 0 ? member : text) += ch;
  }
  content_hash h;
  h.update(std::as_bytes(std::span(text)));
  return h.hex();
}

/// The XXH3-64 checksum of `data` (16 hex digits).
inline std::string checksum_of(std::span<const std::byte> data) {
  content_hash h;
  h.update(data);
  return h.hex();
}

/// How a save gets device values to the file writer.
enum class staging : std::uint8_t {
  snapshot,  ///< copied into host staging memory in stream order: training may go on and change them
  direct,    ///< host devices only: written from the device's own memory, which must not change until written
};

/// Index of the first element of `bytes` bytes of `type` at `data` that is NaN or infinite (all exponent bits set),
/// or -1 (also for non-floating types).
inline std::int64_t first_non_finite(dtype type, const std::byte* data, std::size_t bytes) {
  auto scan = [&]<class Bits>(Bits exponent) -> std::int64_t {
    const std::size_t n = bytes / sizeof(Bits);
    for (std::size_t i = 0; i < n; ++i) {
      Bits v;
      std::memcpy(&v, data + i * sizeof(Bits), sizeof(Bits));
      if ((v & exponent) == exponent) return static_cast<std::int64_t>(i);
    }
    return -1;
  };
  if (data == nullptr) return -1;
  switch (type) {
    case dtype::f32: return scan(std::uint32_t{0x7f800000u});
    case dtype::f16: return scan(std::uint16_t{0x7c00u});
    case dtype::bf16: return scan(std::uint16_t{0x7f80u});
    default: return -1;
  }
}

/// The tensors of one file being saved: each from device memory or from host bytes. stage() decides where the
/// file's bytes come from; the writer then owns or points at them until the file is written.
class file_writer {
 public:
  void add_device(std::string name, const tensor_view& source) {
    entries_.push_back(entry{{std::move(name), source.type(), dims_of(source.dims()), nullptr}, source, {}});
  }
  void add_host(std::string name, dtype type, std::vector<std::int64_t> shape, std::vector<std::byte> bytes) {
    entries_.push_back(entry{{std::move(name), type, std::move(shape), nullptr}, {}, std::move(bytes)});
  }
  /// Bytes of device tensors a snapshot copies.
  [[nodiscard]] std::size_t device_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& e : entries_)
      if (!e.device.empty()) n += e.meta.size_bytes();
    return n;
  }
  /// Gets every tensor's bytes ready on `s`: device tensors are copied into `staging` (device_bytes() bytes) in
  /// stream order, or, with staging::direct on a host device, used where they are. Builds the header.
  void stage(std::byte* staging_memory, staging how, stream_ref s, const std::map<std::string, std::string>& metadata) {
    std::vector<safetensors_source> sources;
    pieces_.clear();
    std::size_t at = 0;
    for (auto& e : entries_) {
      const std::size_t n = e.meta.size_bytes();
      const std::byte* data = reinterpret_cast<const std::byte*>(e.host.data());
      if (!e.device.empty()) {
        LOCKSTEP_EXPECTS(e.device.get_device() == s.get_device(), "checkpoint: tensor '", e.meta.name, "' is on ",
                         e.device.get_device().str(), " but the save runs on a stream of ", s.get_device().str(),
                         "; save with a stream of the device that holds the model");
        if (how == staging::direct && s.get_device().is_host()) {
          data = static_cast<const std::byte*>(e.device.data());
        } else {
          copy(std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(staging_memory + at), n),
               device_span<const std::uint8_t>(e.device.bytes()), s);
          data = staging_memory + at;
          at += n;
        }
      }
      e.meta.data = data;
      sources.push_back(e.meta);
      if (n > 0) pieces_.emplace_back(data, n);
    }
    header_ = safetensors_header_bytes(sources, metadata);
  }
  /// The first floating-point tensor among `names` holding a value that is not finite (NaN or infinity), by name,
  /// with the index of that element; nullopt when every value is finite. Reads the staged bytes (after the staging
  /// copies ran).
  [[nodiscard]] std::optional<std::pair<std::string, std::int64_t>> first_non_finite(
      const std::set<std::string>& names) const {
    for (const auto& e : entries_) {
      if (!names.contains(e.meta.name)) continue;
      const std::int64_t at = detail::first_non_finite(e.meta.type, e.meta.data, e.meta.size_bytes());
      if (at >= 0) return std::pair{e.meta.name, at};
    }
    return std::nullopt;
  }
  /// The tensors' names, in file order.
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : entries_) out.push_back(e.meta.name);
    return out;
  }
  /// The file: its header, then the pieces of its data in order (valid once the staging copies have run).
  [[nodiscard]] const std::string& header() const noexcept { return header_; }
  [[nodiscard]] const std::vector<std::span<const std::byte>>& pieces() const noexcept { return pieces_; }

 private:
  struct entry {
    safetensors_source meta;
    tensor_view device;
    std::vector<std::byte> host;
  };
  std::vector<entry> entries_;
  std::string header_;
  std::vector<std::span<const std::byte>> pieces_;
};

/// A safetensors file mapped into memory and validated.
struct loaded_file {
  std::filesystem::path path;
  mapped_file map;
  std::uint64_t size = 0;
  safetensors_header header;
  std::set<std::string> consumed;
  bool module_prefix_stripped = false;

  [[nodiscard]] std::span<const std::byte> data_of(const safetensors_tensor& t) const {
    return map.bytes().subspan(header.data_offset + t.begin, t.size_bytes());
  }
};

/// Maps `path`; when `expected` has a size and checksum (from a manifest), checks both before parsing. Throws
/// io_error (cannot read) or data_error (corrupt).
inline loaded_file read_safetensors_file(const std::filesystem::path& path, const json_value* expected) {
  loaded_file f;
  f.path = path;
  f.map = mapped_file(path);
  f.size = f.map.size();
  if (expected != nullptr) {
    const auto want = expected->at("bytes").get<std::uint64_t>();
    if (f.size != want) {
      throw data_error(concat(path.string(), ": the file has ", f.size, " bytes but the manifest says ", want,
                              " (truncated or replaced)"));
    }
  }
  if (expected != nullptr) {
    const auto want = expected->at("xxh3_64").get<std::string>();
    const std::string got = checksum_of(f.map.bytes());
    if (got != want) {
      throw data_error(concat(path.string(), ": checksum mismatch (XXH3-64 ", got, ", the manifest says ", want,
                              "): the file is corrupt"));
    }
  }
  f.header = parse_safetensors_header(f.map.bytes(), f.size, path.string());
  return f;
}

/// The tensor `name` of `f`, checked for dtype and shape; for a model file, a name with DataParallel's
/// "module." prefix is accepted too. Marks it consumed. Throws data_error naming the file and the tensor.
inline const safetensors_tensor& expect_tensor(loaded_file& f, const std::string& name, dtype type,
                                               const std::vector<std::int64_t>& shape, bool allow_module_prefix) {
  const safetensors_tensor* t = f.header.find(name);
  if (t == nullptr && allow_module_prefix) {
    t = f.header.find(module_prefix + name);
    if (t != nullptr) f.module_prefix_stripped = true;
  }
  if (t == nullptr) {
    throw data_error(concat(f.path.string(), ": tensor '", name, "' is missing (the file has ", f.header.tensors.size(),
                            " tensors; the model or optimizer being loaded differs from the one saved)"));
  }
  if (t->type != type) {
    throw data_error(concat(f.path.string(), ": tensor '", name, "' has dtype ", safetensors_dtype_name(t->type),
                            ", expected ", safetensors_dtype_name(type)));
  }
  if (t->shape != shape) {
    throw data_error(concat(f.path.string(), ": tensor '", name, "' has shape ", shape_text(t->shape), ", expected ",
                            shape_text(shape)));
  }
  f.consumed.insert(t->name);
  return *t;
}

/// Checks that `f` holds exactly the master values of `params` (F32, their shapes; "module." prefixes accepted)
/// and its buffers (their dtypes and shapes), and returns each parameter's tensor, in order, then each buffer's.
/// Throws data_error naming the first fault.
inline std::vector<const safetensors_tensor*> expect_model(loaded_file& f, const parameter_list& params);

/// Writes validated master values into `params` (refreshing working copies) in stream order on `s`.
inline void apply_model(const loaded_file& f, const std::vector<const safetensors_tensor*>& tensors,
                        const parameter_list& params, stream_ref s);

/// Throws data_error naming the first tensor of `f` that nothing expected.
inline void expect_no_extra_tensors(const loaded_file& f) {
  for (const auto& t : f.header.tensors) {
    if (!f.consumed.contains(t.name)) {
      throw data_error(concat(f.path.string(), ": tensor '", t.name, "' is not part of what is being loaded (",
                              f.header.tensors.size() - f.consumed.size(), " unexpected tensors; a different model?)"));
    }
  }
}

/// Copies a validated tensor's bytes to device memory in stream order on `s` (the file must outlive the copy): all
/// of them, or with `elements` that range of a flat view (a ZeRO shard).
inline void copy_to_device(const loaded_file& f, const safetensors_tensor& t, const tensor_view& dst, stream_ref s,
                           std::optional<element_range> elements = std::nullopt) {
  auto src = f.data_of(t);
  if (elements) {
    const std::size_t es = size_of(t.type);
    LOCKSTEP_EXPECTS(elements->end * es <= src.size(), "checkpoint: elements [", elements->begin, ", ", elements->end,
                     ") of tensor '", t.name, "' (", src.size() / es, " elements)");
    src = src.subspan(static_cast<std::size_t>(elements->begin) * es, static_cast<std::size_t>(elements->size()) * es);
  }
  copy(dst.bytes(), std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(src.data()), src.size()), s);
}

inline std::vector<const safetensors_tensor*> expect_model(loaded_file& f, const parameter_list& params) {
  std::vector<const safetensors_tensor*> out;
  for (const auto& p : params) out.push_back(&expect_tensor(f, p.name, dtype::f32, dims_of(p.param->dims()), true));
  for (const auto& b : params.buffers()) {
    out.push_back(&expect_tensor(f, b.name, b.buffer->type(), dims_of(b.buffer->dims()), true));
  }
  expect_no_extra_tensors(f);
  if (f.module_prefix_stripped) {
    std::clog << "lockstep: " << f.path.string() << ": tensor names carry DataParallel's 'module.' prefix; "
              << "loaded without it\n";
  }
  return out;
}

inline void apply_model(const loaded_file& f, const std::vector<const safetensors_tensor*>& tensors,
                        const parameter_list& params, stream_ref s) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    parameter& p = *params[i].param;
    if (!p.is_sharded() && !p.masters_deferred()) {
      copy_to_device(f, *tensors[i], p.value(), s);
      p.refresh_working_copy(s);
      continue;
    }
    // ZeRO (or master values deferred, which the load gives whole): this rank's range of the master values, and the values forward reads whole, from one parameter's
    // values on the device at a time (no collective: every rank reads the file)
    tensor whole(p.dims(), dtype::f32, s);
    copy_to_device(f, *tensors[i], whole.view(), s);
    p.load_values(whole.view(), s);
  }
  for (std::size_t i = 0; i < params.buffers().size(); ++i) {
    copy_to_device(f, *tensors[params.size() + i], params.buffers()[i].buffer->view(), s);
  }
}

/// Calls buffer(name, values) for the buffers and parameters() where the parameters' master values go, in the order
/// of a model file: buffers of 8-byte elements (batch norm's i64 num_batches_tracked) first, so that every tensor's
/// data stays aligned to its element size (a loader that maps the file and views its bytes as i64 needs 8), then the
/// parameters' master values, then the other buffers.
template <class Buffer, class Parameters>
void in_model_file_order(const parameter_list& params, Buffer&& buffer, Parameters&& parameters) {
  for (const auto& b : params.buffers())
    if (size_of(b.buffer->type()) == 8) buffer(b.name, b.buffer->view());
  parameters();
  for (const auto& b : params.buffers())
    if (size_of(b.buffer->type()) != 8) buffer(b.name, b.buffer->view());
}

/// A host tensor's bytes.
template <class T>
std::vector<std::byte> host_bytes(std::span<const T> values) {
  std::vector<std::byte> out(values.size_bytes());
  if (!out.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

/// Whole fp32 tensors a save read from a whole_state_source (the writing rank keeps them in host memory until the
/// file writer takes them), by parameter and tensor (master_values_tensor, or an optimizer state's index).
class whole_tensors {
 public:
  void keep(const parameter& p, int which, std::span<const float> values) {
    LOCKSTEP_EXPECTS(std::cmp_equal(values.size(), p.numel()), "checkpoint: the whole-state source gave ", values.size(),
                     " values of parameter ", p.name(), " (tensor ", which, "), which has ", p.numel());
    LOCKSTEP_EXPECTS(tensors_.emplace(std::pair{&p, which}, host_bytes(values)).second,
                     "checkpoint: the whole-state source gave tensor ", which, " of parameter ", p.name(), " twice");
  }
  /// The bytes of tensor `which` of `p`, taken out; nullopt when the source gave none (a parameter it does not
  /// shard: saved from the device).
  [[nodiscard]] std::optional<std::vector<std::byte>> take(const parameter& p, int which) {
    const auto it = tensors_.find(std::pair{&p, which});
    if (it == tensors_.end()) return std::nullopt;
    std::vector<std::byte> out = std::move(it->second);
    tensors_.erase(it);
    return out;
  }

 private:
  std::map<std::pair<const parameter*, int>, std::vector<std::byte>> tensors_;
};

/// Adds what a model file holds to `w` (in_model_file_order): the master values from `whole` when it has them.
inline void add_model_tensors(file_writer& w, const parameter_list& params, whole_tensors* whole = nullptr) {
  const auto device = [&](const std::string& name, const tensor_view& t) { w.add_device(name, t); };
  in_model_file_order(params, device, [&] {
    for (const auto& p : params) {
      auto kept = whole != nullptr ? whole->take(*p.param, master_values_tensor) : std::nullopt;
      if (kept) {
        w.add_host(p.name, dtype::f32, dims_of(p.param->dims()), std::move(*kept));
      } else {
        w.add_device(p.name, p.param->value());  // (throws for a sharded parameter, naming the fix)
      }
    }
  });
}

template <class T>
std::vector<T> host_values(const loaded_file& f, const safetensors_tensor& t) {
  std::vector<T> out(t.size_bytes() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), f.data_of(t).data(), t.size_bytes());
  return out;
}

/// The bytes of `span` on the host; synchronizes `s`.
inline std::vector<std::uint8_t> read_device(device_span<std::uint8_t> span, stream_ref s) {
  return to_vector(device_span<const std::uint8_t>(span), s);
}

/// One part of a checkpoint besides the model: what it adds on save, checks and restores on load.
struct checkpoint_part {
  /// `whole`: where the optimizer state comes from when the state is sharded (checkpoint_state::sharded), or null
  std::function<void(file_writer& training, json_value& manifest, stream_ref s, whole_tensors* whole)> save;
  std::function<void(loaded_file& training, const json_value& manifest)> validate;
  std::function<void(loaded_file& training, const json_value& manifest, stream_ref s)> apply;
};

inline json_value options_json(const sgd_options& o) {
  return {{"lr", o.lr}, {"momentum", o.momentum}, {"dampening", o.dampening}, {"weight_decay", o.weight_decay},
          {"nesterov", o.nesterov == nesterov::yes}};
}
inline json_value options_json(const adamw_options& o) {
  return {{"lr", o.lr}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps}, {"weight_decay", o.weight_decay}};
}
inline void restore_options(sgd_options& o, const json_value& j) {
  o.lr = j.at("lr").get<float>();
  o.momentum = j.at("momentum").get<float>();
  o.dampening = j.at("dampening").get<float>();
  o.weight_decay = j.at("weight_decay").get<float>();
  o.nesterov = j.at("nesterov").get<bool>() ? nesterov::yes : nesterov::no;
}
inline void restore_options(adamw_options& o, const json_value& j) {
  o.lr = j.at("lr").get<float>();
  o.beta1 = j.at("beta1").get<float>();
  o.beta2 = j.at("beta2").get<float>();
  o.eps = j.at("eps").get<float>();
  o.weight_decay = j.at("weight_decay").get<float>();
}

/// PyTorch's names of an optimizer's state tensors.
inline const char* state_name(bool adam, int which) {
  if (!adam) return "momentum_buffer";
  return which == 0 ? "exp_avg" : "exp_avg_sq";
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// What a training checkpoint holds: the model's parameters (by reference) and, once named, the optimizer,
/// loss scaler and learning-rate schedule, plus the loop's position and the program's own JSON entries. The
/// referenced objects must outlive it. Saving reads them; loading writes them (all or nothing).
class checkpoint_state {
 public:
  /// The model's parameters, in checkpoint order, with the names the files use.
  explicit checkpoint_state(parameter_list model) : model_(std::move(model)) {
    std::set<std::string> names;
    for (const auto& p : model_) {
      LOCKSTEP_EXPECTS(names.insert(p.name).second, "checkpoint_state: two parameters are named '", p.name, "'");
    }
    for (const auto& b : model_.buffers()) {
      LOCKSTEP_EXPECTS(names.insert(b.name).second, "checkpoint_state: two parameters or buffers are named '", b.name,
                       "'");
    }
  }

  /// The optimizer whose state (momentum or moments, step counts, options) the checkpoint holds. Its parameters
  /// must be the model's.
  template <class Optimizer>
    requires(std::same_as<Optimizer, sgd> || std::same_as<Optimizer, adamw>)
  checkpoint_state& optimizer(Optimizer& opt) {
    constexpr bool adam = std::same_as<Optimizer, adamw>;
    constexpr int state_count = adam ? 2 : 1;
    std::map<const parameter*, std::string> names;
    for (const auto& p : model_) names[p.param] = p.name;
    for (std::size_t g = 0; g < opt.group_count(); ++g)
      for (const parameter* p : opt.params(g))
        LOCKSTEP_EXPECTS(names.contains(p), "checkpoint_state::optimizer: parameter '", p->name(),
                         "' of the optimizer is not one of the model's");
    const char* kind = adam ? "adamw" : "sgd";
    // The state tensors of every group that has them: (group, index, which, name).
    auto each_state = [&opt, names](auto&& f) {
      for (std::size_t g = 0; g < opt.group_count(); ++g) {
        if (!Optimizer::group_needs_state(opt.options(g))) continue;
        for (std::size_t i = 0; i < opt.params(g).size(); ++i) {
          const parameter* p = opt.params(g)[i];
          for (int k = 0; k < state_count; ++k)
            f(g, i, k, "optimizer.state." + names.at(p) + "." + detail::state_name(adam, k));
        }
      }
    };
    auto group_names = [&opt, names](std::size_t g) {
      std::vector<std::string> out;
      for (const parameter* p : opt.params(g)) out.push_back(names.at(p));
      return out;
    };
    const auto groups = [&opt] { return static_cast<std::int64_t>(opt.group_count()); };
    detail::checkpoint_part part;
    part.save = [&opt, each_state, group_names, groups, kind](detail::file_writer& w, json_value& m, stream_ref s,
                                                              detail::whole_tensors* whole) {
      opt.materialize_state(s);  // zeroes before the first step: the same updates, and a uniform layout
      each_state([&](std::size_t g, std::size_t i, int k, std::string name) {
        const parameter& p = *opt.params(g)[i];
        auto kept = whole != nullptr ? whole->take(p, k) : std::nullopt;
        if (kept) {
          w.add_host(std::move(name), dtype::f32, detail::dims_of(p.dims()), std::move(*kept));
          return;
        }
        LOCKSTEP_EXPECTS(!p.is_sharded(), "checkpoint: parameter '", p.name(), "' is sharded over the ranks (ZeRO), and "
                         "so is its optimizer state: name where a save reads them whole (checkpoint_state::sharded with "
                         "distributed_data_parallel::visit_whole_state), or save inside "
                         "distributed_data_parallel::consolidated(optimizer)");
        w.add_device(std::move(name), opt.state(g, i, k));
      });
      const auto raw = detail::read_device(opt.step_counters(), s);
      std::vector<kernels::optimizer_counters> c(opt.group_count());
      std::memcpy(c.data(), raw.data(), c.size() * sizeof c[0]);
      std::vector<std::int64_t> steps;
      std::vector<float> bc1, bc2;
      for (const auto& x : c) {
        steps.push_back(x.step);
        bc1.push_back(x.bias_correction1);
        bc2.push_back(x.bias_correction2);
      }
      w.add_host("optimizer.step", dtype::i64, std::vector<std::int64_t>{groups()}, detail::host_bytes(std::span<const std::int64_t>(steps)));
      w.add_host("optimizer.bias_correction1", dtype::f32, std::vector<std::int64_t>{groups()}, detail::host_bytes(std::span<const float>(bc1)));
      w.add_host("optimizer.bias_correction2", dtype::f32, std::vector<std::int64_t>{groups()}, detail::host_bytes(std::span<const float>(bc2)));
      json_value gs = json_value::array();
      for (std::size_t g = 0; g < opt.group_count(); ++g) {
        json_value j = detail::options_json(opt.options(g));
        j["params"] = group_names(g);
        gs.push_back(std::move(j));
      }
      m["optimizer"] = {{"kind", kind}, {"groups", std::move(gs)}};
    };
    part.validate = [&opt, each_state, group_names, groups, kind](detail::loaded_file& f, const json_value& m) {
      if (!m.contains("optimizer")) throw data_error("the checkpoint holds no optimizer, but one was given to load");
      const auto& o = m.at("optimizer");
      const std::string saved = o.at("kind").get<std::string>();
      if (saved != kind) {
        throw data_error(detail::concat("the checkpoint's optimizer is ", saved, ", this run's is ", kind));
      }
      const auto& gs = o.at("groups");
      if (gs.size() != opt.group_count()) {
        throw data_error(detail::concat("the checkpoint's optimizer has ", gs.size(), " parameter groups, this run's ",
                                        opt.group_count()));
      }
      for (std::size_t g = 0; g < opt.group_count(); ++g) {
        if (gs[g].at("params").get<std::vector<std::string>>() != group_names(g)) {
          throw data_error(detail::concat("parameter group ", g, " of the checkpoint's optimizer holds other parameters "
                                          "than this run's"));
        }
        std::remove_cvref_t<decltype(opt.options(g))> probe{};
        detail::restore_options(probe, gs[g]);  // throws (json) when a field is missing
      }
      each_state([&](std::size_t g, std::size_t i, int k, const std::string& name) {
        const parameter& p = *opt.params(g)[i];
        detail::expect_tensor(f, name, dtype::f32, detail::dims_of(p.dims()), false);
        // each rank loads the range it updates (ZeRO: its shard) into state of that size
        const tensor_view held = opt.state(g, i, k);
        LOCKSTEP_EXPECTS(held.empty() || held.numel() == p.shard().size(), "load_checkpoint: the optimizer state of ",
                         p.name(), " covers ", held.numel(), " elements but this rank updates ", p.shard().size(),
                         " of them: it was allocated before distributed_data_parallel sharded the parameters (ZeRO); "
                         "build the wrapper before loading");
      });
      detail::expect_tensor(f, "optimizer.step", dtype::i64, std::vector<std::int64_t>{groups()}, false);
      detail::expect_tensor(f, "optimizer.bias_correction1", dtype::f32, std::vector<std::int64_t>{groups()}, false);
      detail::expect_tensor(f, "optimizer.bias_correction2", dtype::f32, std::vector<std::int64_t>{groups()}, false);
    };
    part.apply = [&opt, each_state](detail::loaded_file& f, const json_value& m, stream_ref s) {
      opt.materialize_state(s);
      // every rank its own range (ZeRO: the parameter's shard; the state tensor is that range, flat)
      each_state([&](std::size_t g, std::size_t i, int k, const std::string& name) {
        detail::copy_to_device(f, *f.header.find(name), opt.state(g, i, k), s, opt.params(g)[i]->shard());
      });
      const auto steps = detail::host_values<std::int64_t>(f, *f.header.find("optimizer.step"));
      const auto bc1 = detail::host_values<float>(f, *f.header.find("optimizer.bias_correction1"));
      const auto bc2 = detail::host_values<float>(f, *f.header.find("optimizer.bias_correction2"));
      std::vector<kernels::optimizer_counters> c(steps.size());
      for (std::size_t g = 0; g < c.size(); ++g) c[g] = {steps[g], bc1[g], bc2[g]};
      const auto counters = opt.step_counters();
      copy(counters, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(c.data()), counters.size()), s);
      s.synchronize();  // `c` is a local
      const auto& gs = m.at("optimizer").at("groups");
      for (std::size_t g = 0; g < opt.group_count(); ++g) detail::restore_options(opt.options(g), gs[g]);
    };
    parts_["optimizer"] = std::move(part);
    return *this;
  }

  /// The loss scaler whose scale, growth tracker and counts the checkpoint holds.
  checkpoint_state& scaler(loss_scaler& sc) {
    // The saved fields of kernels::scaler_state, by offset: one table for save, validate and apply.
    struct field {
      const char* name;
      dtype type;
      std::size_t offset;
      bool required = true;  // false: added later; older checkpoints lack it (it loads as 0)
    };
    static const field fields[] = {
        {"scaler.scale", dtype::f32, offsetof(kernels::scaler_state, scale)},
        {"scaler.inv_scale", dtype::f32, offsetof(kernels::scaler_state, inv_scale)},
        {"scaler.growth_tracker", dtype::i32, offsetof(kernels::scaler_state, growth_tracker)},
        {"scaler.steps", dtype::i64, offsetof(kernels::scaler_state, steps)},
        {"scaler.skipped_steps", dtype::i64, offsetof(kernels::scaler_state, skipped_steps)},
        {"scaler.last_overflow_step", dtype::i64, offsetof(kernels::scaler_state, last_overflow_step)},
        {"scaler.consecutive_skips", dtype::i64, offsetof(kernels::scaler_state, consecutive_skips), false}};
    detail::checkpoint_part part;
    part.save = [&sc](detail::file_writer& w, json_value& m, stream_ref s, detail::whole_tensors*) {
      const auto raw = detail::read_device(sc.state_bytes(), s);
      for (const field& x : fields) {
        std::vector<std::byte> b(size_of(x.type));
        std::memcpy(b.data(), raw.data() + x.offset, b.size());
        w.add_host(x.name, x.type, std::vector<std::int64_t>{}, std::move(b));
      }
      m["scaler"] = {{"dynamic", sc.options().dynamic}, {"growth_interval", sc.options().growth_interval}};
    };
    part.validate = [](detail::loaded_file& f, const json_value& m) {
      if (!m.contains("scaler")) {
        throw data_error("the checkpoint holds no loss scaler, but one was given to load (an f32 checkpoint into an "
                         "f16/bf16 run?)");
      }
      for (const field& x : fields) {
        if (x.required || f.header.find(x.name) != nullptr) {
          detail::expect_tensor(f, x.name, x.type, std::vector<std::int64_t>{}, false);
        }
      }
    };
    part.apply = [&sc](detail::loaded_file& f, const json_value&, stream_ref s) {
      kernels::scaler_state st{};  // found_inf and the per-step count start at zero
      for (const field& x : fields) {
        const safetensors_tensor* t = f.header.find(x.name);
        if (t != nullptr) std::memcpy(reinterpret_cast<std::byte*>(&st) + x.offset, f.data_of(*t).data(), size_of(x.type));
      }
      copy(sc.state_bytes(), std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(&st), sizeof st), s);
      s.synchronize();  // `st` is a local
    };
    parts_["scaler"] = std::move(part);
    return *this;
  }

  /// The learning-rate schedule whose step and base rates the checkpoint holds.
  template <class Optimizer, class Schedule>
  checkpoint_state& schedule(lr_scheduler<Optimizer, Schedule>& sched) {
    detail::checkpoint_part part;
    part.save = [&sched](detail::file_writer&, json_value& m, stream_ref, detail::whole_tensors*) {
      m["schedule"] = {{"step", sched.last_step()}, {"base_lrs", sched.base_lrs()}};
    };
    part.validate = [&sched](detail::loaded_file&, const json_value& m) {
      if (!m.contains("schedule")) throw data_error("the checkpoint holds no learning-rate schedule, but one was given to load");
      const auto step = m.at("schedule").at("step").get<std::int64_t>();
      const auto bases = m.at("schedule").at("base_lrs").get<std::vector<float>>();
      if (step < 0 || bases.size() != sched.group_count()) {
        throw data_error(detail::concat("the checkpoint's schedule is at step ", step, " with ", bases.size(),
                                        " base rates; this run's optimizer has ", sched.group_count(), " groups"));
      }
    };
    part.apply = [&sched](detail::loaded_file&, const json_value& m, stream_ref) {
      sched.restore(m.at("schedule").at("step").get<std::int64_t>(),
                    m.at("schedule").at("base_lrs").get<std::vector<float>>());
    };
    parts_["schedule"] = std::move(part);
    return *this;
  }

  /// The model's master values and the optimizer's state are sharded over the ranks (ZeRO): a save reads them whole
  /// from `source` (distributed_data_parallel::visit_whole_state: checkpointer::save calls it on every rank, rank 0
  /// keeps what it gives in host memory and writes it), so that saving needs no more device memory than training.
  /// A load needs nothing: each rank writes its own range of them.
  checkpoint_state& sharded(whole_state_source source) {
    sharded_ = std::move(source);
    return *this;
  }
  [[nodiscard]] const whole_state_source& sharded_source() const noexcept { return sharded_; }

  /// The loop's position: set it before saving; load_checkpoint sets it.
  run_position position;
  /// The run's identity, recorded in every checkpoint it saves. By default the process's run: a new random one per
  /// process, or the run of the checkpoint the process loaded last (load_checkpoint also sets this state's; empty
  /// for a checkpoint written before runs had identities), so that the states and checkpointers a program makes,
  /// one per save or one per run, save as one run, and a resumed run goes on as itself. A checkpointer saves only
  /// into a root whose checkpoints are this run's (checkpoint_options::overwrite). Set it to train several runs in
  /// one process. Each process of a distributed save has its own until they resume: rank 0's is written.
  std::string run_id = detail::process_run_id();
  /// The program's own entries, saved in the manifest and restored by load_checkpoint.
  json_value user = json_value::object();

  [[nodiscard]] const parameter_list& model() const noexcept { return model_; }
  [[nodiscard]] const std::map<std::string, detail::checkpoint_part>& parts() const noexcept { return parts_; }

 private:
  parameter_list model_;
  std::map<std::string, detail::checkpoint_part> parts_;
  whole_state_source sharded_;
};

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

inline json_value position_json(const run_position& p) {
  return {{"step", p.step},
          {"epoch", p.epoch},
          {"epoch_samples", p.epoch_samples},
          {"data_seed", p.data_seed},
          {"dropout_seed", p.dropout_seed},
          {"dropout_step", p.dropout_step},
          {"world_size", p.world_size},
          {"precision", std::string(name_of(p.precision))}};
}

inline run_position position_from_json(const json_value& j) {
  run_position p;
  p.step = j.at("step").get<std::int64_t>();
  p.epoch = j.at("epoch").get<std::uint64_t>();
  p.epoch_samples = j.at("epoch_samples").get<std::uint64_t>();
  p.data_seed = j.at("data_seed").get<std::uint64_t>();
  p.dropout_seed = j.at("dropout_seed").get<std::uint64_t>();
  p.dropout_step = j.at("dropout_step").get<std::uint64_t>();
  p.world_size = j.at("world_size").get<int>();
  const auto precision = j.at("precision").get<std::string>();
  bool known = false;
  for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
    if (name_of(t) == precision) {
      p.precision = t;
      known = true;
    }
  }
  if (!known) throw data_error(concat("unknown precision '", precision, "'"));
  return p;
}

/// A checkpoint staged for writing by any thread: its files' headers and data (in staging memory, or, for a
/// direct save, the device memory itself), and its manifest.
struct staged_checkpoint {
  std::int64_t step = 0;
  pinned_buffer<std::byte> staging;  // the snapshot of device values
  file_writer model;
  file_writer training;
  std::set<std::string> parameters;  // the names of the model file's parameters (its buffers may hold what they like)
  json_value manifest;
  std::optional<event> copied;       // recorded after the staging copies
};

/// "step-000000000100".
inline std::string checkpoint_dir_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%012lld", static_cast<long long>(step));
  return name;
}

/// The step of a directory name "step-<digits>", or -1.
inline std::int64_t step_of_dir_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step-") != 0) return -1;
  std::int64_t v = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

/// Gets everything `st` saves ready on `s` (see staging; a snapshot reuses `reuse` when it is large enough);
/// returns once the copies are queued (small state is read at once, which synchronizes `s`).
/// `whole`: the master values and optimizer state read from checkpoint_state::sharded_source, or null.
inline std::unique_ptr<staged_checkpoint> stage_checkpoint(checkpoint_state& st, stream_ref s, staging how,
                                                           pinned_buffer<std::byte>& reuse, whole_tensors* whole) {
  auto out = std::make_unique<staged_checkpoint>();
  out->step = st.position.step;
  add_model_tensors(out->model, st.model(), whole);
  for (const auto& p : st.model()) out->parameters.insert(p.name);
  json_value manifest;
  for (const auto& [name, part] : st.parts()) part.save(out->training, manifest, s, whole);
  const bool direct = how == staging::direct && s.get_device().is_host();
  const std::size_t snapshot = direct ? 0 : out->model.device_bytes() + out->training.device_bytes();
  out->staging = reuse.size() >= snapshot ? std::move(reuse) : pinned_buffer<std::byte>(snapshot, s.get_device());
  const std::map<std::string, std::string> meta{
      {"lockstep.version", concat(LOCKSTEP_VERSION_MAJOR, '.', LOCKSTEP_VERSION_MINOR, '.', LOCKSTEP_VERSION_PATCH)},
      {"lockstep.step", std::to_string(st.position.step)}};
  std::byte* const base = out->staging.size() > 0 ? out->staging.data() : nullptr;  // none for a direct save
  out->model.stage(base, how, s, meta);
  out->training.stage(base != nullptr ? base + out->model.device_bytes() : nullptr, how, s, meta);
  manifest["format"] = "lockstep-checkpoint";
  manifest["version"] = checkpoint_format_version;
  manifest["lockstep_version"] = meta.at("lockstep.version");
  manifest["position"] = position_json(st.position);
  manifest["run"] = st.run_id;
  manifest["tensors"] = {{model_file_name, out->model.names()}, {training_file_name, out->training.names()}};
  manifest["user"] = st.user;
  try {
    (void)manifest.dump();  // now, not after the tensor files are written: JSON has no NaN, and text must be UTF-8
  } catch (const json_error& e) {
    throw precondition_error(concat("checkpoint: the manifest cannot be written (", e.what(),
                                    "): state.user and the optimizer's options must hold finite numbers, and every name "
                                    "must be valid UTF-8"));
  }
  out->manifest = std::move(manifest);
  out->copied.emplace(s.get_device());
  out->copied->record(s);
  return out;
}

/// Writes one staged file; returns its manifest entry (size and XXH3-64 checksum).
inline json_value write_staged_file(const std::filesystem::path& path, const file_writer& f, durability d) {
  posix_file out(path, O_WRONLY | O_CREAT | O_TRUNC);
  content_hash hash;
  const auto header = std::as_bytes(std::span(f.header()));
  std::uint64_t bytes = header.size();
  out.write_all(header);
  hash.update(header);
  for (const auto& piece : f.pieces()) {
    out.write_all(piece);
    hash.update(piece);
    bytes += piece.size();
  }
  if (d == durability::fsync) out.sync();
  out.close();
  return {{"bytes", bytes}, {"xxh3_64", hash.hex()}};
}

/// Removes what earlier saves left behind when their process died before publishing or while pruning:
/// ".step-*.tmp.<pid>" directories (with ".old" or ".pruned" after the pid: set aside to be removed) under `root`.
/// A save runs under the root's writer lock, so none of them belongs to a save in progress: those of a process
/// that no longer exists, of this process (a failed removal, or a restarted container's trainer with the same pid),
/// and every one set aside are removed; an unpublished one of another live process is left alone (a save of a
/// process that does not take the lock).
inline void remove_leftovers(const std::filesystem::path& root) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    const auto mark = name.rfind(".tmp.");
    if (name.rfind(".step-", 0) != 0 || mark == std::string::npos) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + mark + 5, &end, 10);
    const bool set_aside = *end == '.';  // ".old", ".pruned"
    const bool gone = pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    if (set_aside || gone || pid == ::getpid()) std::filesystem::remove_all(e.path(), ec);
  }
}

/// The complete checkpoints under `root` (step-N directories holding a manifest), oldest first.
inline std::vector<std::pair<std::int64_t, std::filesystem::path>> complete_checkpoints(const std::filesystem::path& root) {
  std::vector<std::pair<std::int64_t, std::filesystem::path>> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const std::int64_t step = step_of_dir_name(e.path().filename().string());
    if (step >= 0 && std::filesystem::exists(e.path() / manifest_file_name, ec)) out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// The run that wrote the checkpoint in `dir` (its manifest's "run"; empty for one written before runs had
/// identities), or nullopt when its manifest cannot be read (a damaged checkpoint: whose it is cannot be told).
inline std::optional<std::string> manifest_run(const std::filesystem::path& dir) {
  try {
    posix_file in(dir / manifest_file_name, O_RDONLY);
    std::string text(in.size(), '\0');
    in.read_all(std::as_writable_bytes(std::span(text)));
    const auto manifest = json_value::parse(text);
    if (!manifest.is_object()) return std::nullopt;
    const auto run = manifest.find("run");
    return run != nullptr && run->is_string() ? run->get<std::string>() : std::string();
  } catch (...) {
    return std::nullopt;
  }
}

/// The complete checkpoints under `root` that another run than `run` wrote, oldest first.
inline std::vector<std::pair<std::int64_t, std::filesystem::path>> other_runs_checkpoints(
    const std::filesystem::path& root, const std::string& run) {
  auto all = complete_checkpoints(root);
  std::erase_if(all, [&](const auto& e) {
    const auto theirs = manifest_run(e.second);
    return !theirs || *theirs == run;
  });
  return all;
}

/// The refusal of a save into a root that holds other runs' checkpoints.
inline std::string other_runs_refusal(const std::filesystem::path& root,
                                      const std::vector<std::pair<std::int64_t, std::filesystem::path>>& others) {
  std::string names;
  for (std::size_t i = 0; i < others.size() && i < 3; ++i) {
    names += concat(i == 0 ? "" : ", ", others[others.size() - 1 - i].second.filename().string());
  }
  if (others.size() > 3) names += concat(" and ", others.size() - 3, " more");
  const std::string run = manifest_run(others.back().second).value_or("");
  return concat("checkpointer: ", root.string(), " holds checkpoints of another run (", names,
                run.empty() ? std::string(", written before runs had identities") : concat(", run ", run),
                "): this run did not resume from them, and saving beside them would mix the two runs (loading the "
                "root takes the latest step, whichever run wrote it) and let keep_last delete the other run's. Resume "
                "that run (load_checkpoint of the root before training; mlp_train --resume ", root.string(),
                "), save under another root, or replace them (checkpoint_options::overwrite; mlp_train --overwrite)");
}

/// Takes checkpoint `dir` out of its step-N name first (one rename), then removes it: a kill during the removal
/// leaves a ".step-N.tmp.<pid>.pruned" directory, which is no checkpoint and which a later save removes.
inline void remove_checkpoint(const std::filesystem::path& root, const std::filesystem::path& dir) {
  std::error_code ec;
  const std::filesystem::path aside = root / ("." + dir.filename().string() + ".tmp." + std::to_string(::getpid()) + ".pruned");
  std::filesystem::rename(dir, aside, ec);
  std::filesystem::remove_all(ec ? dir : aside, ec);
}

/// Writes a staged checkpoint under `root` atomically; returns its directory.
inline std::filesystem::path write_checkpoint(const std::filesystem::path& root, staged_checkpoint& c,
                                              const checkpoint_options& o) {
  make_directories(root);
  remove_leftovers(root);
  // another run's checkpoints: refused before anything is written, or (overwrite) removed once this one is published
  const auto other_runs = other_runs_checkpoints(root, c.manifest.value("run", std::string()));
  if (!other_runs.empty() && !o.overwrite) throw precondition_error(other_runs_refusal(root, other_runs));
  const std::string name = checkpoint_dir_name(c.step);
  const std::filesystem::path tmp = root / ("." + name + ".tmp." + std::to_string(::getpid()));
  const std::filesystem::path final_dir = root / name;
  {
    std::error_code ec;  // left by a killed earlier process that had this pid (containers reuse pids)
    std::filesystem::remove_all(tmp, ec);
  }
  if (::mkdir(tmp.c_str(), 0755) != 0) throw_io(errno, "creating the directory", tmp);
  try {
    c.copied->synchronize();
    // A diverged run's weights are never saved as a checkpoint: the ones before stay (nothing is pruned either)
    if (const auto bad = c.model.first_non_finite(c.parameters)) {
      const auto kept = complete_checkpoints(root);
      throw numeric_error(concat(
          "checkpoint of step ", c.step, " not saved: ", bad->first, " holds a value that is not finite (NaN or "
          "infinity) at element ", bad->second, ": the run diverged. ",
          kept.empty() ? std::string("No earlier checkpoint is under ") + root.string()
                       : concat("The checkpoints saved before are kept; the newest is ", kept.back().second.string()),
          " (lower the learning rate, or train in f16/bf16 with loss scaling, which skips such steps)"));
    }
    json_value manifest = c.manifest;
    // The two files at once: writing to the page cache and hashing are both bound by one core's copy speed.
    json_value training_entry;
    std::exception_ptr training_failure;
    std::thread training_writer([&] {
      detail::name_this_thread("ckpt training");
      try {
        training_entry = write_staged_file(tmp / training_file_name, c.training, o.durability);
      } catch (...) {
        training_failure = std::current_exception();
      }
    });
    try {
      manifest["files"][model_file_name] = write_staged_file(tmp / model_file_name, c.model, o.durability);
    } catch (...) {
      training_writer.join();
      throw;
    }
    training_writer.join();
    if (training_failure) std::rethrow_exception(training_failure);
    manifest["files"][training_file_name] = std::move(training_entry);
    manifest["checksum"] = manifest_checksum(manifest.dump());  // last: it covers everything above
    {
      const std::string text = manifest.dump(1) + "\n";
      posix_file out(tmp / manifest_file_name, O_WRONLY | O_CREAT | O_TRUNC);
      out.write_all(std::as_bytes(std::span(text)));
      if (o.durability == durability::fsync) out.sync();
      out.close();
    }
    if (o.durability == durability::fsync) sync_directory(tmp);
    if (o.before_publish) o.before_publish(tmp);
    std::error_code ec;
    if (std::filesystem::exists(final_dir, ec)) {
      // The same step saved again: swap the two directories in one step, so that step-N is always complete,
      // then remove the old one (now under the temporary name; a crash before that leaves it for cleanup).
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
        std::filesystem::remove_all(tmp, ec);
      } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
        // A file system without the exchange (NFS, some FUSE): the old one aside, the new one in, a short
        // window in which step-N is missing (the previous step is still complete).
        const std::filesystem::path old = root / ("." + name + ".tmp." + std::to_string(::getpid()) + ".old");
        rename_path(final_dir, old);
        rename_path(tmp, final_dir);
        std::filesystem::remove_all(old, ec);
      } else {
        throw_io(errno, "exchanging", tmp, concat("with ", final_dir.string()));
      }
    } else {
      rename_path(tmp, final_dir);
    }
    if (o.durability == durability::fsync) sync_directory(root);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
    throw;
  }
  // keep_last counts the checkpoint just written and the newest others by step number. Checkpoints of later
  // steps that stay (an earlier run that went further) get a warning: loading the root takes the latest step.
  for (const auto& [step, dir] : other_runs) {
    if (step != c.step) remove_checkpoint(root, dir);  // (one of the same step was exchanged with this one)
  }
  auto others = complete_checkpoints(root);
  std::erase_if(others, [&](const auto& e) { return e.first == c.step; });
  if (o.keep_last > 0) {
    while (others.size() > o.keep_last - 1) {
      remove_checkpoint(root, others.front().second);
      others.erase(others.begin());
    }
  }
  if (!others.empty() && others.back().first > c.step) {
    std::clog << "lockstep: " << root.string() << " holds " << others.back().second.filename().string()
              << ", a later step than the checkpoint just written (" << name
              << "); loading the root takes the latest step: remove it, or save each run under its own root\n";
  }
  return final_dir;
}

/// How often the ranks of a distributed save meet while rank 0 writes (wait_for_root): the longest a collective of
/// the save waits for rank 0. Communicator timeouts must exceed it (they are seconds to minutes).
inline constexpr std::chrono::milliseconds save_poll{100};

/// Every rank waits, in rounds, until rank 0's write is over: each round is a one-word broadcast from rank 0 saying
/// whether it still writes. Rank 0 waits up to save_poll for its writer first (`written(save_poll)`: whether it has
/// finished). A collective's timeout counts from when a rank reaches it (host cliques: the rendezvous deadline;
/// MPI: the polled request; NCCL: the watchdog, from when the stream reaches it, and comm.synchronize), so one
/// broadcast waiting for a write longer than the timeout failed a healthy run; a round waits for rank 0 about
/// save_poll at most, whatever the write takes, and a rank 0 that died or stopped is still noticed within the
/// communicator's timeout.
template <class Written>
void wait_for_root(communicator_ref comm, stream_ref s, Written&& written) {
  device_buffer<std::int64_t> word(1, s);
  for (;;) {
    const std::int64_t writing = comm.rank() == 0 && !written(save_poll) ? 1 : 0;
    fill(word.span(), writing, s);
    comm.broadcast(word.span(), 0, s);
    comm.synchronize(s);
    if (to_vector(device_span<const std::int64_t>(word.span()), s)[0] == 0) return;
  }
}

/// Rank 0's outcome (0 or an error message) told to every rank: the barrier after a distributed save (after
/// wait_for_root: rank 0 is ready to send it).
inline void agree_on_save(communicator_ref comm, stream_ref s, const std::string& error_on_root) {
  constexpr std::size_t bytes = 1024;
  std::vector<std::uint8_t> message(bytes, 0);
  if (comm.rank() == 0 && !error_on_root.empty()) {
    message[0] = 1;
    std::memcpy(message.data() + 1, error_on_root.data(), std::min(error_on_root.size(), bytes - 2));
  }
  auto buffer = to_device(message, s);
  comm.broadcast(buffer.span(), 0, s);
  comm.synchronize(s);
  const auto got = to_vector(device_span<const std::uint8_t>(buffer.span()), s);
  if (got[0] != 0 && comm.rank() != 0) {
    throw io_error(concat("rank 0 could not write the checkpoint: ", reinterpret_cast<const char*>(got.data() + 1)));
  }
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Writes checkpoints of one run under a root directory, synchronously or in the background.
class checkpointer {
 public:
  /// Throws io_error when the root cannot be written (checkpoint_options::check_root).
  explicit checkpointer(std::filesystem::path root, checkpoint_options options = {})
      : root_(std::move(root)), options_(std::move(options)) {
    if (options_.check_root == root_check::at_construction) detail::expect_writable_directory(root_, "checkpointer");
  }

  /// Takes the root's writer lock now (flock on ROOT/.lockstep-writer.lock, held until the checkpointer ends;
  /// the kernel drops it if the process dies): a root another run is writing is refused here, before any
  /// training, naming its holder. The writing rank's first save takes it otherwise (and is refused the same way,
  /// before it writes anything). Call it on the rank that writes (rank 0 of a distributed save); a second
  /// checkpointer of the same root in this process is refused too. Throws io_error.
  void lock() {
    if (!lock_.held()) lock_ = detail::directory_lock(root_, "checkpointer");
  }
  checkpointer(const checkpointer&) = delete;
  checkpointer& operator=(const checkpointer&) = delete;
  /// Waits for a background write; its error, if any, is printed to std::clog (a destructor cannot throw:
  /// call wait() to handle it).
  ~checkpointer() {
    if (writer_.joinable()) writer_.join();
    if (failure_) {
      try {
        std::rethrow_exception(failure_);
      } catch (const std::exception& e) {
        std::clog << "lockstep: an asynchronous checkpoint save failed: " << e.what() << "\n";
      }
    }
  }

  [[nodiscard]] const std::filesystem::path& root() const noexcept { return root_; }

  /// Throws precondition_error when the root holds complete checkpoints of another run than `state`'s
  /// (checkpoint_state::run_id) and checkpoint_options::overwrite is off, as the first save would: call it before
  /// training (after loading what the run resumes from) to refuse at once. On the rank that writes.
  void expect_own_root(const checkpoint_state& state) const {
    if (options_.overwrite) return;
    const auto others = detail::other_runs_checkpoints(root_, state.run_id);
    if (!others.empty()) throw precondition_error(detail::other_runs_refusal(root_, others));
  }

  /// Saves `state` as root/step-<position.step> and returns that directory, once it is complete. With a
  /// communicator of several ranks every rank calls it with the same position: rank 0 writes (its state is
  /// every rank's, under data parallelism) and no rank returns before the checkpoint is complete; when rank 0
  /// fails, every rank throws. Waits for an earlier save_async first. Throws io_error (disk full, read-only
  /// directory...) or precondition_error; a failed save leaves earlier checkpoints as they were.
  std::filesystem::path save(checkpoint_state& state, stream_ref s, std::optional<communicator_ref> ranks = std::nullopt) {
    // The caller waits, so nothing changes the values before they are written: a host device's memory is
    // written as it is, without a snapshot.
    start(state, s, ranks, detail::staging::direct);
    auto path = wait();
    return path.value_or(root_ / detail::checkpoint_dir_name(state.position.step));
  }

  /// Starts a save: the state is copied into host staging memory in stream order on `s` (small state, such as
  /// step counts, is read at once, which waits for `s`), and a background thread writes it while training
  /// goes on. Waits for the previous save first, throwing its error. Every rank of `ranks` calls it.
  void save_async(checkpoint_state& state, stream_ref s, std::optional<communicator_ref> ranks = std::nullopt) {
    start(state, s, ranks, detail::staging::snapshot);
  }

  /// Waits for the save in progress (every rank of a distributed save calls it) and returns its directory
  /// (nullopt when none was in progress, and on ranks other than 0). Throws what the save threw.
  std::optional<std::filesystem::path> wait() {
    if (!pending_) return std::nullopt;
    pending_ = false;
    // the other ranks wait for rank 0's write in rounds shorter than the communicator's timeout, not in one
    // collective (a large save on a slow disk may take longer than the timeout)
    if (ranks_) {
      try {
        detail::wait_for_root(*ranks_, *stream_, [this](std::chrono::milliseconds d) { return written(d); });
      } catch (...) {
        // A round failed (a peer gone, an abort): the write still reads the staged snapshot; let it end before
        // anything else may start, and forget its outcome (the run has failed on every rank).
        finish_writer();
        failure_ = nullptr;
        written_.reset();
        throw;
      }
    }
    finish_writer();
    // This save's outcome, taken out first: whatever happens below, a later save starts without it.
    const std::exception_ptr failure = std::exchange(failure_, nullptr);
    std::optional<std::filesystem::path> written = std::exchange(written_, std::nullopt);
    std::string message;
    if (failure) {
      try {
        std::rethrow_exception(failure);
      } catch (const std::exception& e) {
        message = e.what();
      } catch (...) {
        message = "unknown error";
      }
    }
    if (ranks_) detail::agree_on_save(*ranks_, *stream_, message);
    if (failure) std::rethrow_exception(failure);
    return written;
  }

 private:
  /// Joins the writer thread (if any) and keeps the snapshot's staging memory for the next save.
  void finish_writer() {
    if (writer_.joinable()) writer_.join();
    if (staged_) {
      spare_ = std::move(staged_->staging);  // reused by the next snapshot
      staged_.reset();
    }
  }

  void start(checkpoint_state& state, stream_ref s, std::optional<communicator_ref> ranks, detail::staging how) {
    wait();
    const std::optional<communicator_ref> group = ranks && ranks->size() > 1 ? ranks : std::nullopt;
    const bool writes = !group || group->rank() == 0;
    // Sharded state: every rank takes part in the source's collectives, before rank 0 may be refused the root's
    // lock below, and rank 0 keeps the whole tensors; when it cannot (out of host memory, a tensor given twice),
    // the source still runs to its end, so that the ranks stay matched, and every rank hears of it as of a refused
    // lock. A collective of the source that fails throws at once (the communicator's fault handling fails the peers).
    std::optional<detail::whole_tensors> whole;
    std::exception_ptr not_kept;
    if (state.sharded_source()) {
      whole.emplace();
      state.sharded_source()([&](const parameter& p, int which, std::span<const float> values) {
        if (!writes || not_kept) return;
        try {
          whole->keep(p, which, values);
        } catch (...) {
          not_kept = std::current_exception();
        }
      });
    }
    ranks_ = group;
    stream_ = s;
    pending_ = true;
    if (!writes) return;
    if (not_kept) {
      failure_ = not_kept;
      return;
    }
    try {
      lock();  // one writer per root: refused before anything is written (the other ranks hear of it)
      staged_ = detail::stage_checkpoint(state, s, how, spare_, whole ? &*whole : nullptr);
    } catch (...) {
      failure_ = std::current_exception();
      return;
    }
    writing_ = true;
    try {
      writer_ = std::thread([this] {
        detail::name_this_thread("ckpt writer");
        try {
          written_ = detail::write_checkpoint(root_, *staged_, options_);
        } catch (...) {
          failure_ = std::current_exception();
        }
        {
          const std::lock_guard lock(writing_mutex_);
          writing_ = false;
        }
        writing_cv_.notify_all();
      });
    } catch (...) {
      writing_ = false;
      failure_ = std::current_exception();
    }
  }

  // Waits up to `d` for the background write; whether none is running any more.
  bool written(std::chrono::milliseconds d) {
    std::unique_lock lock(writing_mutex_);
    return writing_cv_.wait_for(lock, d, [this] { return !writing_; });
  }

  std::filesystem::path root_;
  checkpoint_options options_;
  detail::directory_lock lock_;  // the root's writer lock (lock(), or the first save)
  std::optional<communicator_ref> ranks_;
  std::optional<stream_ref> stream_;
  bool pending_ = false;
  std::unique_ptr<detail::staged_checkpoint> staged_;
  pinned_buffer<std::byte> spare_;
  std::thread writer_;
  std::mutex writing_mutex_;
  std::condition_variable writing_cv_;
  bool writing_ = false;  // the writer thread runs (guarded by writing_mutex_ once it started)
  std::exception_ptr failure_;
  std::optional<std::filesystem::path> written_;
};

/// The newest complete checkpoint under `root` (a step-N directory with a manifest), or nullopt.
inline std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root) {
  auto all = detail::complete_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

LOCKSTEP_ABI_END

LOCKSTEP_DETAIL_BEGIN

/// Reads and checks `dir`/manifest.json: its format, version and its checksum of itself. Throws data_error or
/// io_error.
inline json_value read_manifest(const std::filesystem::path& dir) {
  const auto path = dir / manifest_file_name;
  posix_file in(path, O_RDONLY);
  std::string text(in.size(), '\0');
  in.read_all(std::as_writable_bytes(std::span(text)));
  json_value manifest;
  try {
    manifest = json_value::parse(text);
    if (!manifest.is_object() || manifest.value("format", "") != "lockstep-checkpoint") {
      throw data_error(concat(path.string(), ": not a lockstep checkpoint manifest"));
    }
    if (manifest.value("version", 0) > checkpoint_format_version) {
      throw data_error(concat(path.string(), ": written in checkpoint format ", manifest.value("version", 0),
                              ", newer than this lockstep's ", checkpoint_format_version));
    }
    // Manifests written before lockstep checksummed them have none: the step the files were saved at is still
    // compared with the position's on load.
    if (manifest.contains("checksum")) {
      const std::string kept = manifest.at("checksum").get<std::string>();
      const std::string now = manifest_checksum(text);
      if (kept != now) {
        throw data_error(concat(
            path.string(), ": the manifest was changed after it was written (it hashes to ", now,
            ", its checksum says ", kept, "): an edited position (step, epoch, epoch_samples) would resume the run "
            "at the wrong place. Restore the file, or resume from another checkpoint"));
      }
    }
  } catch (const json_error& e) {
    throw data_error(concat(path.string(), ": not a valid manifest (", e.what(), ")"));
  }
  return manifest;
}

/// Whether the checkpoint in `dir` reads back whole: its manifest and both files' sizes and checksums (what a load
/// checks before it looks at the content).
inline bool checkpoint_intact(const std::filesystem::path& dir) noexcept {
  try {
    const json_value manifest = read_manifest(dir);
    const auto& files = manifest.at("files");
    for (const char* file : {model_file_name, training_file_name}) (void)read_safetensors_file(dir / file, &files.at(file));
    return true;
  } catch (...) {
    return false;
  }
}

/// For the error of a checkpoint `bad` that did not load: when it does not read back whole (corrupt, cut short, a file
/// missing), the newest intact checkpoint of its root before it and how to load it; "" when `bad` is intact (the
/// error is a mismatch with the run, not damage) or not a step-N directory. Reads the checkpoints' files again: for
/// the failure path only.
inline std::string newest_intact_hint(const std::filesystem::path& given) {
  std::filesystem::path bad = given.lexically_normal();
  if (bad.filename().empty()) bad = bad.parent_path();  // "ck/step-N/"
  const std::int64_t bad_step = step_of_dir_name(bad.filename().string());
  if (bad_step < 0 || checkpoint_intact(bad)) return {};
  const std::filesystem::path root = bad.has_parent_path() ? bad.parent_path() : std::filesystem::path(".");
  const auto all = complete_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->first >= bad_step || !checkpoint_intact(it->second)) continue;
    return concat(". The newest intact checkpoint before it is ", it->second.string(),
                  ": load that directory by name (load_checkpoint(\"", it->second.string(), "\", ...); the sample: "
                  "--resume ", it->second.string(), "), or remove the broken one");
  }
  return concat(". No intact checkpoint before it is under ", root.string());
}

LOCKSTEP_DETAIL_END

LOCKSTEP_ABI_BEGIN

/// Loads a checkpoint into `state` onto the device of `s`: `where` is a checkpoint directory, or a root whose
/// newest complete checkpoint is taken. Reads and checks everything first (checksums, every tensor's name,
/// dtype and shape, the optimizer's kind and groups), then writes the model's master values (and refreshes
/// their f16/bf16 working copies), the optimizer, scaler and schedule, and sets `state.position` and
/// `state.user`. Throws data_error (corrupt or different content) or io_error, leaving every object as it was.
/// Synchronizes `s`. Returns the directory loaded.
inline std::filesystem::path load_checkpoint(const std::filesystem::path& where, checkpoint_state& state, stream_ref s) {
  std::filesystem::path dir = where;
  std::error_code ec;
  if (!std::filesystem::exists(where / detail::manifest_file_name, ec)) {
    if (std::filesystem::is_regular_file(where, ec)) {
      throw io_error(detail::concat("loading a checkpoint: ", where.string(), " is a file; a checkpoint is the "
                                    "directory that holds its files (", where.parent_path().string(),
                                    "), or the root above it (its newest complete checkpoint is loaded)"),
                     ENOTDIR);
    }
    if (!std::filesystem::is_directory(where, ec)) {
      throw io_error(detail::concat("loading a checkpoint: ", where.string(), " does not exist"), ENOENT);
    }
    auto latest = latest_checkpoint(where);
    if (!latest) {
      throw data_error(detail::concat(where.string(), ": no checkpoint here (neither a manifest.json nor a step-N "
                                      "directory holding one)"));
    }
    dir = *latest;
  }
  try {
    const json_value manifest = detail::read_manifest(dir);
    const auto& files = manifest.at("files");
    detail::loaded_file model = detail::read_safetensors_file(dir / detail::model_file_name, &files.at(detail::model_file_name));
    detail::loaded_file training =
        detail::read_safetensors_file(dir / detail::training_file_name, &files.at(detail::training_file_name));
    // ---- validate everything
    const auto model_tensors = detail::expect_model(model, state.model());
    for (const auto& [name, part] : state.parts()) {
      try {
        part.validate(training, manifest);
      } catch (const json_error& e) {
        throw data_error(detail::concat("the manifest's ", name, " entry is malformed (", e.what(), ")"));
      }
    }
    detail::expect_no_extra_tensors(training);
    const run_position position = detail::position_from_json(manifest.at("position"));
    // The tensors' files (checked by their checksums above) carry the step they were saved at.
    for (const detail::loaded_file* f : {&model, &training}) {
      const auto step = f->header.metadata.find("lockstep.step");
      if (step != f->header.metadata.end() && step->second != std::to_string(position.step)) {
        throw data_error(detail::concat(dir.string(), "/", detail::manifest_file_name, " says step ", position.step,
                                        " but ", f->path.filename().string(), " was saved at step ", step->second,
                                        ": the manifest was edited or belongs to another checkpoint; resume from "
                                        "another checkpoint"));
      }
    }
    // The optimizer's and the scaler's state belong to a precision (an f16 scale means nothing to bf16).
    for (const auto& p : state.model()) {
      if (p.param->compute_type() != position.precision) {
        throw data_error(detail::concat("the checkpoint was written by a run in ", name_of(position.precision),
                                        ", but parameter '", p.name, "' computes in ", name_of(p.param->compute_type()),
                                        "; resume in the same precision (load_model takes the weights alone into any)"));
      }
    }
    // ---- apply
    detail::apply_model(model, model_tensors, state.model(), s);
    for (const auto& [name, part] : state.parts()) part.apply(training, manifest, s);
    s.synchronize();
    state.position = position;
    state.user = manifest.value("user", json_value::object());
    state.run_id = manifest.value("run", std::string());  // the resumed run goes on as itself,
    detail::adopt_process_run_id(state.run_id);            // in every state this process makes from now on
  } catch (const json_error& e) {
    throw data_error(detail::concat(dir.string(), "/", detail::manifest_file_name, ": malformed (", e.what(), ")",
                                    detail::newest_intact_hint(dir)));
  } catch (const data_error& e) {
    throw data_error(detail::concat("loading checkpoint ", dir.string(), ": ", e.what(), detail::newest_intact_hint(dir)));
  } catch (const io_error& e) {
    throw io_error(detail::concat(e.what(), detail::newest_intact_hint(dir)), e.code());
  }
  return dir;
}

/// Writes the fp32 master values of `params` and its buffers to `file` (safetensors, PyTorch's names) atomically: a temporary
/// file beside it, synced, then renamed. Copies through host staging in stream order on `s`, a stream of the
/// parameters' device, and synchronizes it.
inline void save_model(const std::filesystem::path& file, const parameter_list& params, stream_ref s,
                       durability d = durability::fsync) {
  detail::file_writer w;
  detail::add_model_tensors(w, params);
  pinned_buffer<std::byte> staging(s.get_device().is_host() ? 0 : w.device_bytes(), s.get_device());
  w.stage(staging.data(), detail::staging::direct, s, {});
  s.synchronize();
  const auto dir = file.has_parent_path() ? file.parent_path() : std::filesystem::path(".");
  detail::make_directories(dir);
  const auto tmp = dir / ("." + file.filename().string() + ".tmp." + std::to_string(::getpid()));
  try {
    (void)detail::write_staged_file(tmp, w, d);
    detail::rename_path(tmp, file);
    if (d == durability::fsync) detail::sync_directory(dir);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw;
  }
}

/// Loads fp32 master values from a safetensors file (lockstep's, or PyTorch's: a "module." prefix is stripped
/// with a notice on std::clog) into `params`, refreshing f16/bf16 working copies, in stream order on `s`,
/// which it synchronizes. Every name, dtype (F32) and shape is checked before any value changes; a missing,
/// extra or mismatched tensor throws data_error naming it.
inline void load_model(const std::filesystem::path& file, const parameter_list& params, stream_ref s) {
  detail::loaded_file f = detail::read_safetensors_file(file, nullptr);
  const auto tensors = detail::expect_model(f, params);
  detail::apply_model(f, tensors, params, s);
  s.synchronize();
}

/// What gives the whole fp32 master values of a parameter list when no device holds them whole (ZeRO:
/// distributed_data_parallel::visit_master_values): called with f, it calls f(k, values) for every parameter k of
/// the list, in order, with the values in host memory.
using master_values_source =
    std::function<void(const std::function<void(std::size_t, std::span<const float>)>&)>;

/// weights_sha256 of `params` with their master values from `source` (the buffers from the device, on `s`): the
/// same digest as weights_sha256(params, s) of the whole values. Throws precondition_error when the source gives
/// other parameters than the list's, or in another order.
inline std::string weights_sha256(const parameter_list& params, stream_ref s, const master_values_source& source) {
  sha256 h;
  const auto device_tensor = [&](const std::string&, const tensor_view& t) {
    const auto bytes = to_vector(device_span<const std::uint8_t>(t.bytes()), s);
    h.update(std::as_bytes(std::span(bytes)));
  };
  detail::in_model_file_order(params, device_tensor, [&] {
    std::size_t next = 0;
    source([&](std::size_t k, std::span<const float> values) {
      LOCKSTEP_EXPECTS(k == next && k < params.size() && std::cmp_equal(values.size(), params[k].param->numel()),
                       "weights_sha256: the master values' source gave parameter ", k, " (", values.size(),
                       " values) where parameter ", next, " of ", params.size(), " was due",
                       next < params.size() ? detail::concat(" (", params[next].name, ", ", params[next].param->numel(),
                                                             " values)")
                                            : std::string());
      h.update(std::as_bytes(values));
      ++next;
    });
    LOCKSTEP_EXPECTS(next == params.size(), "weights_sha256: the master values' source gave ", next, " of the ",
                     params.size(), " parameters");
  });
  return h.hex_digest();
}

/// SHA-256 of the fp32 master values of `params` and of its buffers, as 64 hex digits: the bytes of the model file's
/// data section (in its order: detail::in_model_file_order), so `weights_sha256` of two runs is equal exactly when
/// their weights (and running statistics) are. Synchronizes `s`.
inline std::string weights_sha256(const parameter_list& params, stream_ref s) {
  return weights_sha256(params, s, [&](const std::function<void(std::size_t, std::span<const float>)>& f) {
    detail::visit_values_on_host(params, s, f);
  });
}

LOCKSTEP_ABI_END
