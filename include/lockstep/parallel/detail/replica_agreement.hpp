// lockstep/parallel/detail/replica_agreement.hpp — before DDP trains, every rank must wrap the same model and
// start from the same values: the parameters' and buffers' names, shapes and types are compared across ranks (a
// mismatch names the rank and the parameter), then rank 0's values are broadcast; before each forward, rank 0's
// buffers are. Settings (the wrapper's options at construction; the optimizer, scaler, clipping and precision at the
// first synchronized backward calls) are compared as lines of text, naming the first that differs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/comm/communicator.hpp"
#include "lockstep/config.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/parameter.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/tensor.hpp"

LOCKSTEP_DETAIL_BEGIN

/// Every rank must have the same parameters and buffers in the same order: names (first 56 bytes), shapes and types
/// (a parameter's compute type, a buffer's dtype) are gathered and compared on `s`. Throws precondition_error naming
/// the first rank and parameter (or buffer) that differ.
inline void check_same_parameters(const parameter_list& params, communicator_ref comm, stream_ref s) {
  const int world = comm.size();
  struct entry {
    const std::string* name;
    shape dims;
    dtype type;
    const char* kind;
    bool deferred;
  };
  constexpr std::int64_t deferred_bit = 1 << 16;
  std::vector<entry> entries;
  for (const auto& p : params) {
    entries.push_back({&p.name, p.param->dims(), p.param->compute_type(), "parameter", p.param->masters_deferred()});
  }
  for (const auto& b : params.buffers()) entries.push_back({&b.name, b.buffer->dims(), b.buffer->type(), "buffer", false});
  constexpr std::size_t name_bytes = 56;
  constexpr std::size_t record = name_bytes + 8 * shape::max_rank + 8 + 8;  // name, rank and dims, type
  // 1. the counts
  auto count = to_device(std::vector<std::int64_t>{static_cast<std::int64_t>(params.size()),
                                                   static_cast<std::int64_t>(params.buffers().size())},
                         s);
  device_buffer<std::int64_t> counts(2 * static_cast<std::size_t>(world), s);
  comm.all_gather(device_span<const std::int64_t>(count.span()), counts.span(), s);
  comm.synchronize(s);
  const auto all_counts = to_vector(device_span<const std::int64_t>(counts.span()), s);
  for (int r = 0; r < world; ++r) {
    for (std::size_t k = 0; k < 2; ++k) {
      if (all_counts[2 * static_cast<std::size_t>(r) + k] != all_counts[k]) {
        throw precondition_error(concat("distributed_data_parallel: rank ", r, " has ",
                                        all_counts[2 * static_cast<std::size_t>(r) + k],
                                        k == 0 ? " parameters" : " buffers", " but rank 0 has ", all_counts[k],
                                        ": every rank must wrap the same model"));
      }
    }
  }
  if (entries.empty()) return;
  // 2. name and shape of every parameter and buffer
  std::vector<std::uint8_t> mine(entries.size() * record, 0);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    std::uint8_t* rec = mine.data() + i * record;
    const std::string& name = *entries[i].name;
    std::memcpy(rec, name.data(), std::min(name.size(), name_bytes));
    const shape& dims = entries[i].dims;
    std::int64_t fields[shape::max_rank + 1] = {dims.rank()};
    for (int d = 0; d < dims.rank(); ++d) fields[d + 1] = dims[d];
    std::memcpy(rec + name_bytes, fields, sizeof fields);
    // the compute type too: it decides the buckets' layout (under ZeRO, the type gradients travel in); and whether
    // the master values are deferred, which decides what the constructor broadcasts
    const auto type = static_cast<std::int64_t>(entries[i].type) | (entries[i].deferred ? deferred_bit : 0);
    std::memcpy(rec + name_bytes + sizeof fields, &type, sizeof type);
  }
  auto mine_dev = to_device(mine, s);
  device_buffer<std::uint8_t> all(mine.size() * static_cast<std::size_t>(world), s);
  comm.all_gather(device_span<const std::uint8_t>(mine_dev.span()), all.span(), s);
  comm.synchronize(s);
  const auto everyone = to_vector(device_span<const std::uint8_t>(all.span()), s);
  auto describe = [&](const std::uint8_t* rec) {
    std::string name(reinterpret_cast<const char*>(rec), name_bytes);
    name.resize(std::strlen(name.c_str()));
    std::int64_t fields[shape::max_rank + 1];
    std::memcpy(fields, rec + name_bytes, sizeof fields);
    std::string dims = "[";
    for (std::int64_t d = 0; d < fields[0]; ++d) dims += (d ? ", " : "") + std::to_string(fields[d + 1]);
    std::int64_t type = 0;
    std::memcpy(&type, rec + name_bytes + sizeof fields, sizeof type);
    return "'" + name + "' " + dims + "] " + std::string(name_of(static_cast<dtype>(type & ~deferred_bit))) +
           ((type & deferred_bit) != 0 ? " with deferred master values (built inside deferred_master_values)" : "");
  };
  for (int r = 1; r < world; ++r) {
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::uint8_t* theirs = everyone.data() + (static_cast<std::size_t>(r) * entries.size() + i) * record;
      const std::uint8_t* first = everyone.data() + i * record;
      if (std::memcmp(theirs, first, record) != 0) {
        const std::size_t index = i < params.size() ? i : i - params.size();
        throw precondition_error(concat("distributed_data_parallel: ", entries[i].kind, " ", index, " of rank ", r,
                                        " is ", describe(theirs), " but rank 0's is ", describe(first),
                                        ": every rank must wrap the same model"));
      }
    }
  }
}

/// One line of the settings check_same_settings compares: "ROLE#INDEX 'NAME': VALUE", where the setting of role
/// ROLE is VALUE from parameter INDEX (named NAME) on, until the next line of the same role.
inline std::string settings_line(std::string_view role, std::size_t index, const std::string& name,
                                 const std::string& value) {
  return concat(role, '#', index, " '", name, "': ", value);
}

/// What every rank must train with (check_same_settings): the context's precision, then per update role (the
/// learning rate, the loss scaler, the clipper...) a line where the setting changes along the parameters (in their
/// order, the same on every rank).
inline std::vector<std::string> settings_lines(const context& ctx, const parameter_list& params) {
  std::vector<std::string> lines{settings_line(
      "precision", 0, "", concat("compute in ", name_of(ctx.compute_type()), ctx.deterministic() ? ", deterministic" : ""))};
  for (std::size_t r = 0; r < update_role_count; ++r) {
    std::string last;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& text = params[i].param->update_settings(static_cast<update_role>(r));
      const std::string value = text != nullptr ? *text : std::string("none");
      if (i > 0 && value == last) continue;
      last = value;
      lines.push_back(settings_line(name_of(static_cast<update_role>(r)), i, params[i].name, value));
    }
  }
  return lines;
}

/// Every rank must train with the same settings: `lines` (settings_line, the same order on every rank) are gathered
/// on `s` (the first 4 KiB, and a hash of all of them) and compared with rank 0's. Throws precondition_error naming
/// the first setting that differs, its parameter and both values.
inline void check_same_settings(const std::vector<std::string>& lines, communicator_ref comm, stream_ref s) {
  const int world = comm.size();
  if (world == 1) return;
  std::string text;
  for (const auto& l : lines) text += l + '\n';
  constexpr std::size_t record = 4096, kept = record - 8;
  std::uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a of the whole text
  for (const char c : text) hash = (hash ^ static_cast<std::uint8_t>(c)) * 0x100000001b3ull;
  std::vector<std::uint8_t> mine(record, 0);
  std::memcpy(mine.data(), &hash, 8);
  std::memcpy(mine.data() + 8, text.data(), std::min(text.size(), kept));
  auto mine_dev = to_device(mine, s);
  device_buffer<std::uint8_t> all(record * static_cast<std::size_t>(world), s);
  comm.all_gather(device_span<const std::uint8_t>(mine_dev.span()), all.span(), s);
  comm.synchronize(s);
  const auto everyone = to_vector(device_span<const std::uint8_t>(all.span()), s);
  struct setting {
    std::string role, name, value;
    std::size_t index = 0;
  };
  const auto settings_of = [&](int r) {
    const char* at = reinterpret_cast<const char*>(everyone.data() + static_cast<std::size_t>(r) * record + 8);
    const std::string t(at, strnlen(at, kept));
    std::vector<setting> out;
    for (std::size_t begin = 0; begin < t.size();) {
      const std::size_t end = std::min(t.find('\n', begin), t.size());
      const std::string line = t.substr(begin, end - begin);
      begin = end + 1;
      const std::size_t hash_mark = line.find('#'), quote = line.find(" '"), colon = line.find("': ");
      if (hash_mark == std::string::npos || quote == std::string::npos || colon == std::string::npos) continue;
      out.push_back({line.substr(0, hash_mark), line.substr(quote + 2, colon - quote - 2), line.substr(colon + 3),
                     static_cast<std::size_t>(std::strtoull(line.c_str() + hash_mark + 1, nullptr, 10))});
    }
    return out;
  };
  // the value of `role` at parameter `index`: the last line of that role at or before it
  const auto value_at = [](const std::vector<setting>& in, const std::string& role, std::size_t index) {
    std::string v = "none";
    for (const auto& e : in) {
      if (e.role == role && e.index <= index) v = e.value;
    }
    return v;
  };
  for (int r = 1; r < world; ++r) {
    if (std::memcmp(everyone.data(), everyone.data() + static_cast<std::size_t>(r) * record, 8) == 0) continue;
    const auto first = settings_of(0), theirs = settings_of(r);
    std::string difference = "(the difference lies past the first 4 KiB of their settings)";
    bool found = false;
    for (const auto* in : {&first, &theirs}) {
      for (const auto& e : *in) {
        const std::string a = value_at(first, e.role, e.index), b = value_at(theirs, e.role, e.index);
        if (found || a == b) continue;
        difference = e.name.empty() ? concat("for the ", e.role, ", rank 0 has ", a, " and rank ", r, " has ", b)
                                    : concat("for the ", e.role, " of '", e.name, "', rank 0 has ", a, " and rank ",
                                             r, " has ", b);
        found = true;  // the first difference is enough
      }
    }
    throw precondition_error(concat("distributed_data_parallel: the ranks do not train with the same settings: ",
                                    difference, ". Every rank must use the same optimizer options, loss scaler, "
                                    "gradient clipping, precision and wrapper options (were the ranks started with other options?)"));
  }
}

/// Rank 0's fp32 values to every rank, on `s` (after the whole device's work: the model's initialization ran on
/// some stream); working copies refreshed. Returns when done. Small parameters go packed, in packs of at most
/// `pack_elements` (16 MiB), larger ones in place: the staging never doubles the model's masters.
inline void broadcast_parameters(const parameter_list& params, communicator_ref comm, stream_ref s,
                                 std::size_t pack_elements = std::size_t{4} << 20) {
  LOCKSTEP_EXPECTS(pack_elements > 0, "broadcast_parameters: packs of 0 elements");
  if (comm.size() == 1 || params.empty()) return;
  synchronize(s.get_device());
  // (deferred master values have none to broadcast yet: broadcast_deferred_parameters streams them once sharded)
  const auto numel = [&](std::size_t i) {
    return params[i].param->masters_deferred() ? std::size_t{0} : static_cast<std::size_t>(params[i].param->numel());
  };
  std::size_t packed_total = 0;  // of the parameters that go packed
  for (std::size_t i = 0; i < params.size(); ++i) packed_total += numel(i) < pack_elements ? numel(i) : 0;
  device_buffer<float> pack;
  for (std::size_t i = 0; i < params.size();) {
    if (numel(i) >= pack_elements) {
      comm.broadcast(params[i].param->value().span<float>(), 0, s);
      params[i].param->refresh_working_copy(s);
      ++i;
      continue;
    }
    std::size_t end = i, elements = 0;
    while (end < params.size() && numel(end) < pack_elements && elements + numel(end) <= pack_elements) {
      elements += numel(end++);
    }
    if (elements == 0) {  // parameters without elements
      i = end;
      continue;
    }
    if (pack.size() == 0) pack = device_buffer<float>(std::min(pack_elements, packed_total), s);
    std::size_t offset = 0;
    for (std::size_t k = i; k < end; ++k) {
      if (numel(k) == 0) continue;
      copy(pack.span().subspan(offset, numel(k)), params[k].param->value().span<const float>(), s);
      offset += numel(k);
    }
    comm.broadcast(pack.span().subspan(0, elements), 0, s);
    offset = 0;
    for (std::size_t k = i; k < end; ++k) {
      if (numel(k) == 0) continue;
      copy(params[k].param->value().span<float>(), device_span<const float>(pack.span().subspan(offset, numel(k))), s);
      params[k].param->refresh_working_copy(s);
      offset += numel(k);
    }
    i = end;
  }
  comm.synchronize(s);
}

/// Rank 0's initial values of the parameters whose master values were deferred (deferred_master_values), once a
/// ZeRO wrapper has sharded them: streamed from rank 0's recipe in chunks of at most `chunk_elements`, each rank
/// writing its shard's master values and the whole working copy (parameter::write_values_range); the recipes are
/// then dropped. Beyond the shards, no device holds more than one chunk. On `s`; returns when done.
inline void broadcast_deferred_parameters(const parameter_list& params, communicator_ref comm, stream_ref s,
                                          std::int64_t chunk_elements = std::int64_t{4} << 20) {
  LOCKSTEP_EXPECTS(chunk_elements > 0, "broadcast_deferred_parameters: chunks of 0 elements");
  synchronize(s.get_device());  // the shards' master values were allocated on the compute stream
  std::vector<float> host;
  for (const auto& item : params) {
    parameter& p = *item.param;
    if (!p.has_initial_values()) continue;
    for (std::int64_t first = 0; first < p.numel(); first += chunk_elements) {
      const auto count = static_cast<std::size_t>(std::min(chunk_elements, p.numel() - first));
      device_buffer<float> chunk;
      if (comm.rank() == 0) {
        host.resize(count);
        p.initial_values_of(first, host);
        chunk = to_device(host, s);
      } else {
        chunk = device_buffer<float>(count, s);
      }
      comm.broadcast(chunk.span(), 0, s);
      p.write_values_range(first, tensor_view(chunk.data(), dtype::f32, shape{static_cast<std::int64_t>(count)},
                                              s.get_device()), s);
    }
  }
  comm.synchronize(s);
  for (const auto& item : params) item.param->forget_initial_values();  // only once every shard is written
}

/// Rank 0's buffers (running statistics) to every rank, packed into `flat` (bytes, grown on first use), in stream
/// order on `s`: what PyTorch's DDP does before each forward with broadcast_buffers.
inline void broadcast_buffers(const parameter_list& params, communicator_ref comm, stream_ref s, tensor& flat) {
  if (comm.size() == 1 || params.buffers().empty()) return;
  std::size_t total = 0;
  for (const auto& b : params.buffers()) total += b.buffer->view().size_bytes();
  flat.ensure(shape{static_cast<std::int64_t>(total)}, dtype::u8, s);
  auto each = [&](auto&& f) {
    std::size_t offset = 0;
    for (const auto& b : params.buffers()) {
      const device_span<std::uint8_t> bytes = b.buffer->view().bytes();
      f(bytes, flat.view().bytes().subspan(offset, bytes.size()));
      offset += bytes.size();
    }
  };
  each([&](device_span<std::uint8_t> buffer, device_span<std::uint8_t> packed) {
    copy(packed, device_span<const std::uint8_t>(buffer), s);
  });
  comm.broadcast(flat.view().data(), flat.view().data(), total, dtype::u8, 0, s);
  each([&](device_span<std::uint8_t> buffer, device_span<std::uint8_t> packed) {
    copy(buffer, device_span<const std::uint8_t>(packed), s);
  });
}

LOCKSTEP_DETAIL_END
