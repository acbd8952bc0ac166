// Tests of io/: SHA-256 against FIPS vectors; the safetensors reader's every rule; save_model/load_model on
// both backends and in every precision; training checkpoints that resume bit for bit (SGD, AdamW, loss scaler,
// schedule); loads that fail leaving the model, optimizer and scaler untouched; writes that survive a kill
// before the rename, a file-size limit and a read-only directory with the previous checkpoint intact.
#include <gtest/gtest.h>

#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "lockstep/amp/loss_scaler.hpp"
#include "io_common.hpp"
#include "lockstep/comm/run_on_devices.hpp"
#include "lockstep/nn/batch_norm.hpp"
#include "lockstep/nn/sequential.hpp"
#include "test_support.hpp"

extern char** environ;

using namespace lockstep;
using namespace lockstep_test;
using namespace parallel_test;
using namespace io_test;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards.
class scratch {
 public:
  scratch() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "." + info->name();
    for (char& c : name)
      if (c == '/') c = '_';
    dir_ = fs::temp_directory_path() / ("lockstep_test_io." + std::to_string(::getpid()) + "." + name);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~scratch() {
    std::error_code ec;
    fs::permissions(dir_, fs::perms::all, ec);
    fs::remove_all(dir_, ec);
  }
  [[nodiscard]] const fs::path& path() const { return dir_; }

 private:
  fs::path dir_;
};

std::vector<std::byte> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> v((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(v.size());
  std::memcpy(out.data(), v.data(), v.size());
  return out;
}
json_value read_json(const fs::path& p) {
  const auto b = file_bytes(p);
  return json_value::parse(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
}
void write_bytes(const fs::path& p, std::span<const std::byte> b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// ---- SHA-256 ---------------------------------------------------------------------------------------------------

std::string sha_of(std::string_view text) {
  sha256 h;
  h.update(std::as_bytes(std::span(text.data(), text.size())));
  return h.hex_digest();
}

std::string json_error_of(std::string_view text) {
  try {
    (void)json_value::parse(text);
  } catch (const json_error& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(json, round_trips_every_kind_with_sorted_keys_and_exact_doubles) {
  json_value m{{"z", 1}, {"a", "x"}};
  m["position"]["step"] = std::int64_t{-100};
  m["lrs"] = std::vector<float>{0.1f, 0.01f};
  m["name"] = "quote \" backslash \\ newline \n tab \t \x01 \xc3\xa9";
  m["big"] = std::uint64_t{18446744073709551615u};
  m["whole"] = 100.0;
  m["tiny"] = 1e-5;
  m["list"].push_back(true);
  m["list"].push_back(nullptr);
  EXPECT_EQ(m.dump(),
            R"({"a":"x","big":18446744073709551615,"list":[true,null],"lrs":[0.10000000149011612,0.009999999776482582],)"
            R"("name":"quote \" backslash \\ newline \n tab \t \u0001 )" "\xc3\xa9" R"(","position":{"step":-100},"tiny":1e-05,)"
            R"("whole":100.0,"z":1})");
  for (const int indent : {-1, 1, 4}) {
    const json_value back = json_value::parse(m.dump(indent));
    EXPECT_EQ(back, m);
    EXPECT_EQ(back.dump(indent), m.dump(indent));
  }
  EXPECT_EQ(json_value::parse(m.dump()).at("lrs").at(1).get<float>(), 0.01f);
  EXPECT_EQ(json_value::parse(R"("\ud83d\ude00 \u00e9 \/")").get<std::string>(), "\xf0\x9f\x98\x80 \xc3\xa9 /");
  // one number type: integers of either sign and doubles compare by value
  EXPECT_EQ(json_value::parse("1"), json_value(1));
  EXPECT_EQ(json_value::parse("1.0"), json_value(1));
  EXPECT_NE(json_value::parse("-1"), json_value(std::uint64_t{18446744073709551615u}));
  EXPECT_EQ(json_value::parse("18446744073709551616").dump(), "1.8446744073709552e+19");  // past 64 bits: a double
  // doubles laid out as nlohmann::json lays them out (manifests of earlier versions hash alike)
  for (const auto& [v, text] : {std::pair{1e-4, "0.0001"}, std::pair{1e-5, "1e-05"}, std::pair{12.5, "12.5"},
                                std::pair{1e14, "100000000000000.0"}, std::pair{1e15, "1e+15"},
                                std::pair{-1.5e300, "-1.5e+300"}, std::pair{-0.0, "-0.0"}, std::pair{0.0, "0.0"},
                                std::pair{5e-324, "5e-324"}, std::pair{0.001234, "0.001234"}}) {
    EXPECT_EQ(json_value(v).dump(), text);
    EXPECT_EQ(json_value::parse(text).get<double>(), v);
  }
  EXPECT_EQ(json_value::parse("1e-400").get<double>(), 0.0);    // below a double's range: zero, as strtod reads it
  EXPECT_EQ(json_value::parse("-0.0000e-999").dump(), "-0.0");
  static_assert(sizeof(json_value) == 16);                      // a kind and a word: containers live on the heap
}

TEST(json, references_stay_valid_while_members_are_added_and_values_copy_from_themselves) {
  json_value j{{"y", 2}, {"sub", json_value{{"k", "v"}}}};
  j["x"] = j["y"];  // the right side is evaluated first: adding "x" must not move "y"
  j["a"] = j["sub"];
  j.update(j["sub"]);
  EXPECT_EQ(j.dump(), R"({"a":{"k":"v"},"k":"v","sub":{"k":"v"},"x":2,"y":2})");
  j = j["sub"];
  EXPECT_EQ(j.dump(), R"({"k":"v"})");
  json_value list = json_value::array();
  list.push_back(1);
  list.push_back(list[0]);
  EXPECT_EQ(list.dump(), "[1,1]");
  // changing a value as what it is not is a programming error
  json_value text("x");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { text.push_back(1); }), "cannot append to a string");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { list["k"] = 1; }), "cannot set a member of an array");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { text.update(json_value::object()); }), "cannot update a string");
  json_value none;
  none.update(json_value::object());
  EXPECT_TRUE(none.is_object());
  EXPECT_EQ(json_value(j.members()), j);
}

TEST(json, refuses_what_rfc_8259_refuses_naming_the_byte) {
  EXPECT_CONTAINS(json_error_of(R"({"a":1,"a":2})"), "the key \"a\" appears twice in one object at byte 7");
  EXPECT_CONTAINS(json_error_of(R"({"x":{"b":1,"b":1}})"), "appears twice");  // at any depth
  EXPECT_CONTAINS(json_error_of("[1,]"), "at byte 3");
  EXPECT_CONTAINS(json_error_of("{\"a\":1,}"), "expected a key string");
  EXPECT_CONTAINS(json_error_of("01"), "text after the value");
  EXPECT_CONTAINS(json_error_of("1."), "digits after its '.'");
  EXPECT_CONTAINS(json_error_of("-"), "at byte 1");
  EXPECT_CONTAINS(json_error_of("1e400"), "beyond the range of a double");
  EXPECT_CONTAINS(json_error_of("-123456.7e99999999999999999999"), "beyond the range of a double");
  EXPECT_CONTAINS(json_error_of("1e9223372036854775807"), "beyond the range of a double");
  EXPECT_EQ(json_value::parse("0.01e-9223372036854775808").get<double>(), 0.0);
  EXPECT_CONTAINS(json_error_of("nul"), "unknown literal");
  EXPECT_CONTAINS(json_error_of("NaN"), "at byte 0");
  EXPECT_CONTAINS(json_error_of("\"\x01\""), "control character");
  EXPECT_CONTAINS(json_error_of("\"\xc0\xaf\""), "not valid UTF-8");      // an overlong '/'
  EXPECT_CONTAINS(json_error_of("\"\xed\xa0\x80\""), "not valid UTF-8");  // a surrogate, encoded
  EXPECT_CONTAINS(json_error_of(R"("\ud800")"), "without its low surrogate");
  EXPECT_CONTAINS(json_error_of(R"("\udc00")"), "lone low surrogate");
  EXPECT_CONTAINS(json_error_of(R"("\x")"), "unknown escape");
  EXPECT_CONTAINS(json_error_of("\"abc"), "closing quote");
  EXPECT_CONTAINS(json_error_of("// comment\n1"), "at byte 0");
  EXPECT_CONTAINS(json_error_of(""), "unexpected end");
  EXPECT_CONTAINS(json_error_of(std::string(300, '[')), "nesting deeper than 256");
  EXPECT_EQ(json_error_of(std::string(256, '[') + "1" + std::string(256, ']')), "(accepted)");  // 256 levels
  EXPECT_CONTAINS(json_error_of(std::string(257, '[') + std::string(257, ']')), "nesting deeper than 256");
  // reading a value as what it is not
  const json_value v = json_value::parse(R"({"n":-5,"s":"x","f":0.5,"big":300})");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)v.at("missing"); }), "no member 'missing'");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)v.at("n").get<unsigned>(); }), "does not fit");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)v.at("big").get<std::uint8_t>(); }), "does not fit");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)v.at("f").get<int>(); }), "expected an integer, got number");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)v.at("s").get<float>(); }), "expected a number, got string");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)json_value::parse("1e300").get<float>(); }), "beyond the range");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)json_value::parse("3.5e38").get<float>(); }), "beyond the range");
  EXPECT_EQ(json_value::parse("3.4028235e+38").get<float>(), std::numeric_limits<float>::max());  // rounds to it
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)json_value(std::nan("")).dump(); }), "no NaN or infinity");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)json_value(std::string("\xff")).dump(); }), "not valid UTF-8");
  EXPECT_CONTAINS(message_of<json_error>([&] { (void)json_value{{"a", 1}, {"a", 2}}; }), "given twice");
  EXPECT_EQ(v.value("missing", 7), 7);
  EXPECT_EQ(v.value("n", 7), -5);
  static_assert(std::is_base_of_v<data_error, json_error>);
}

TEST(checkpoint, a_manifest_checksum_covers_the_text_as_written_without_its_own_member) {
  // The bytes hashed: the compact text without the top-level "checksum" member, whatever the spelling of its
  // numbers (an earlier lockstep's JSON writer spelled some doubles otherwise) and wherever the member sits.
  const std::string rest = R"({"a":1,"lr":1.0E-2,"n":{"checksum":"inner"}})";
  const std::string want = detail::checksum_of(std::as_bytes(std::span(rest)));
  EXPECT_EQ(detail::manifest_checksum(rest), want);
  EXPECT_EQ(detail::manifest_checksum(R"({"a":1,"checksum":"0123","lr":1.0E-2,"n":{"checksum":"inner"}})"), want);
  EXPECT_EQ(detail::manifest_checksum(R"({"checksum":"0","a":1,"lr":1.0E-2,"n":{"checksum":"inner"}})"), want);
  EXPECT_EQ(detail::manifest_checksum("{\n \"a\": 1,\n \"lr\": 1.0E-2,\n \"n\": {\n  \"checksum\": \"inner\"\n },"
                                      "\n \"checksum\": \"0\"\n}\n"),
            want);
  EXPECT_NE(detail::manifest_checksum(R"({"a":1,"lr":0.01,"n":{"checksum":"inner"}})"), want);
  EXPECT_NE(detail::manifest_checksum(R"({"a":2,"lr":1.0E-2,"n":{"checksum":"inner"}})"), want);
  // spaces inside strings are content
  EXPECT_NE(detail::manifest_checksum(R"({"a":"x y"})"), detail::manifest_checksum(R"({"a":"xy"})"));
}

TEST(checkpoint, a_manifest_written_by_earlier_lockstep_reads_and_its_checksum_holds) {
  // tests/data/manifest_written_by_nlohmann: the manifest bench/compile_time/training_file.cpp saved with lockstep at
  // df23007, whose JSON writer was nlohmann::json (f16 AdamW with a loss scaler on 2 host devices, step 3).
  const fs::path kept = fs::path(LOCKSTEP_SOURCE_DIR) / "tests" / "data" / "manifest_written_by_nlohmann";
  const json_value m = detail::read_manifest(kept);
  EXPECT_EQ(m.at("position").at("step").get<int>(), 3);
  EXPECT_EQ(m.at("optimizer").at("groups").at(0).at("lr").get<float>(), 0.01f);
  // The same text with its step edited is refused.
  scratch t;
  const auto b = file_bytes(kept / "manifest.json");
  std::string text(reinterpret_cast<const char*>(b.data()), b.size());
  const auto at = text.find("\"step\": 3,");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 10, "\"step\": 4,");
  write_bytes(t.path() / "manifest.json", std::as_bytes(std::span(text)));
  EXPECT_CONTAINS(message_of<data_error>([&] { (void)detail::read_manifest(t.path()); }),
                  "the manifest was changed after it was written");
}

TEST(sha256, matches_the_fips_180_vectors) {
  EXPECT_EQ(sha_of(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha_of("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // a million 'a', fed in uneven pieces (exercises the partial-block path)
  sha256 h;
  const std::string a(1000, 'a');
  std::size_t fed = 0;
  for (std::size_t piece = 1; fed < 1'000'000; piece = piece % 997 + 1) {
    const std::size_t n = std::min(piece, 1'000'000 - fed);
    h.update(std::as_bytes(std::span(a.data(), n)));
    fed += n;
  }
  EXPECT_EQ(h.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// ---- safetensors ------------------------------------------------------------------------------------------------

// A file of the given header text (padded by nothing) and `data_bytes` zero bytes.
std::vector<std::byte> raw_file(const std::string& header, std::size_t data_bytes) {
  std::vector<std::byte> f(8 + header.size() + data_bytes, std::byte{0});
  for (int i = 0; i < 8; ++i) f[static_cast<std::size_t>(i)] = static_cast<std::byte>((header.size() >> (8 * i)) & 0xff);
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

std::string parse_error(const std::vector<std::byte>& f) {
  return message_of<data_error>([&] { (void)parse_safetensors_header(f, f.size(), "x.safetensors"); });
}

TEST(safetensors, writes_what_it_reads_with_aligned_data_and_the_pt_format) {
  const std::vector<float> w{1, 2, 3, 4, 5, 6};
  const std::vector<std::int64_t> n{7};
  const std::vector<safetensors_source> src{{"fc1.weight", dtype::f32, {2, 3}, std::as_bytes(std::span(w)).data()},
                                            {"count", dtype::i64, {}, std::as_bytes(std::span(n)).data()},
                                            {"empty", dtype::bf16, {0, 4}, nullptr}};
  const std::string header = safetensors_header_bytes(src, {{"lockstep.step", "3"}});
  EXPECT_EQ(header.size() % 8, 0u);
  std::vector<std::byte> file(header.size() + 32);
  std::memcpy(file.data(), header.data(), header.size());
  std::memcpy(file.data() + header.size(), w.data(), 24);
  std::memcpy(file.data() + header.size() + 24, n.data(), 8);
  const auto h = parse_safetensors_header(file, file.size(), "t");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.data_offset, header.size());
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.metadata.at("lockstep.step"), "3");
  const auto* t = h.find("fc1.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->type, dtype::f32);
  EXPECT_EQ(t->shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(t->begin, 0u);
  EXPECT_EQ(t->end, 24u);
  EXPECT_EQ(h.find("count")->shape, std::vector<std::int64_t>{});
  EXPECT_EQ(h.find("empty")->size_bytes(), 0u);
}

TEST(safetensors, rejects_every_violation_with_the_file_the_tensor_and_the_rule) {
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const auto valid = raw_file("{" + a + "}   ", 8);  // padded with spaces: valid
  EXPECT_EQ(parse_safetensors_header(valid, valid.size(), "ok").find("a")->size_bytes(), 8u);

  EXPECT_CONTAINS(parse_error(raw_file("{" + a + "}", 4)), "truncated");
  EXPECT_CONTAINS(parse_error(raw_file("{" + a + "}", 12)), "trailing bytes");
  EXPECT_CONTAINS(parse_error(raw_file("{" + a + "," + a + "}", 8)),
                  "the key \"a\" appears twice in one object at byte 54 of the header");
  EXPECT_CONTAINS(parse_error(raw_file(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8)),
                  "dtype 'F64', which lockstep does not read");
  EXPECT_CONTAINS(parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)),
                  "tensor 'a' of shape [3] and dtype F32 needs 12 bytes");
  EXPECT_CONTAINS(parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                       12)),
                  "tensor 'b' [4, 12) overlaps");
  EXPECT_CONTAINS(parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12)),
                  "gap of 4 bytes before tensor 'a'");
  EXPECT_CONTAINS(parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)),
                  "non-negative integer");
  EXPECT_CONTAINS(parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8)), "needs data_offsets");
  EXPECT_CONTAINS(parse_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":1}})", 8)),
                  "__metadata__ entry 'k' must be a string");
  EXPECT_CONTAINS(parse_error(raw_file(" {}", 0)), "does not start with '{'");
  EXPECT_CONTAINS(parse_error(raw_file("{\"a\":", 0)), "its JSON header is refused (JSON: unexpected end");
  EXPECT_CONTAINS(parse_error(raw_file(R"({"a":1})", 0)), "x.safetensors: not a valid safetensors file: tensor 'a' must map to an object");
  const auto empty = raw_file("{}", 0);  // no tensors at all is a valid file
  EXPECT_TRUE(parse_safetensors_header(empty, empty.size(), "e").tensors.empty());
  // a header length over the limit, and one longer than the file
  std::vector<std::byte> big(16, std::byte{0});
  big[3] = std::byte{0x10};  // 0x10000000 = 268 MB
  EXPECT_CONTAINS(parse_error(big), "over the limit of 100000000");
  std::vector<std::byte> short_file(16, std::byte{0});
  short_file[0] = std::byte{100};
  EXPECT_CONTAINS(parse_error(short_file), "only 8 bytes follow it");
  EXPECT_CONTAINS(parse_error(std::vector<std::byte>(5)), "fewer than the 8");
}

// ---- save_model / load_model ------------------------------------------------------------------------------------

class model_io : public backend_and_dtype {};

INSTANTIATE_TEST_SUITE_P(all, model_io,
                         ::testing::Combine(::testing::Values(device_kind::host, device_kind::cuda),
                                            ::testing::Values(dtype::f32, dtype::f16, dtype::bf16)),
                         param_name);

TEST_P(model_io, round_trips_the_master_values_and_refreshes_the_working_copies) {
  scratch dir;
  stream s(dev());
  context ctx(s, type());
  graph a = make_model(ctx);
  const auto file = dir.path() / "model.safetensors";
  save_model(file, parameters_of(a), s);
  // a different initialization, then the load
  context ctx2(s, type());
  graph b = make_model(ctx2, 123);
  ASSERT_NE(weights_sha256(parameters_of(a), s), weights_sha256(parameters_of(b), s));
  load_model(file, parameters_of(b), s);
  EXPECT_EQ(weights_sha256(parameters_of(a), s), weights_sha256(parameters_of(b), s));
  const auto pa = parameters_of(a), pb = parameters_of(b);
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].name, pb[i].name);
    const auto wa = pa[i].param->compute_value(), wb = pb[i].param->compute_value();
    EXPECT_EQ(to_vector(device_span<const std::uint8_t>(wa.bytes()), s), to_vector(device_span<const std::uint8_t>(wb.bytes()), s))
        << pa[i].name << ": the working copy was not refreshed";
  }
  // names and the SHA-256 of the data section are PyTorch's and sha256sum's
  const auto bytes = file_bytes(file);
  const auto h = parse_safetensors_header(bytes, bytes.size(), "m");
  EXPECT_NE(h.find("fc1.weight"), nullptr);
  EXPECT_NE(h.find("out.bias"), nullptr);
  sha256 data;
  data.update(std::span(bytes).subspan(h.data_offset));
  EXPECT_EQ(data.hex_digest(), weights_sha256(parameters_of(a), s));
}

TEST(model_io, a_sequential_uses_pytorch_indices_and_a_module_prefix_is_accepted) {
  scratch dir;
  stream s(device{device_kind::host, 0});
  context ctx(s);
  initializer init(1);
  sequential m(linear(4, 3, ctx, init), relu(), linear(3, 2, ctx, init));
  const auto file = dir.path() / "seq.safetensors";
  save_model(file, parameters_of(m), s);
  const auto bytes = file_bytes(file);
  const auto h = parse_safetensors_header(bytes, bytes.size(), "m");
  std::vector<std::string> names;
  for (const auto& t : h.tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));

  // The same values under DataParallel's names ("module.0.weight"), as a PyTorch user saves them.
  std::vector<safetensors_source> src;
  for (const auto& t : h.tensors) src.push_back({"module." + t.name, t.type, t.shape, bytes.data() + h.data_offset + t.begin});
  const std::string header = safetensors_header_bytes(src);
  std::vector<std::byte> prefixed(header.size() + bytes.size() - h.data_offset);
  std::memcpy(prefixed.data(), header.data(), header.size());
  std::memcpy(prefixed.data() + header.size(), bytes.data() + h.data_offset, bytes.size() - h.data_offset);
  write_bytes(dir.path() / "module.safetensors", prefixed);
  initializer other(9);
  sequential m2(linear(4, 3, ctx, other), relu(), linear(3, 2, ctx, other));
  load_model(dir.path() / "module.safetensors", parameters_of(m2), s);
  EXPECT_EQ(weights_sha256(parameters_of(m), s), weights_sha256(parameters_of(m2), s));
}

TEST(model_io, buffers_are_saved_with_pytorchs_names_aligned_and_count_in_weights_sha256) {
  scratch dir;
  stream s(device{device_kind::host, 0});
  context ctx(s);
  initializer init(1);
  sequential m(linear(4, 3, ctx, init), batch_norm(3, ctx));
  const std::string untrained = weights_sha256(parameters_of(m), s);
  tensor x(shape{5, 4}, dtype::f32, s);
  fill_zero(x.bytes(), s);
  (void)m.forward(x, ctx);  // the running statistics and num_batches_tracked move; the parameters do not
  EXPECT_NE(weights_sha256(parameters_of(m), s), untrained);
  const auto file = dir.path() / "bn.safetensors";
  save_model(file, parameters_of(m), s);
  const auto bytes = file_bytes(file);
  const auto h = parse_safetensors_header(bytes, bytes.size(), "bn");
  std::vector<std::string> names;
  for (const auto& t : h.tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"1.num_batches_tracked", "0.weight", "0.bias", "1.weight", "1.bias",
                                             "1.running_mean", "1.running_var"}));  // 8-byte elements first: aligned
  for (const auto& t : h.tensors) EXPECT_EQ((h.data_offset + t.begin) % size_of(t.type), 0u) << t.name;
  EXPECT_EQ(h.find("1.num_batches_tracked")->type, dtype::i64);
  EXPECT_TRUE(h.find("1.num_batches_tracked")->shape.empty());  // a scalar, as PyTorch's
  initializer other(2);
  sequential m2(linear(4, 3, ctx, other), batch_norm(3, ctx));
  load_model(file, parameters_of(m2), s);
  EXPECT_EQ(weights_sha256(parameters_of(m2), s), weights_sha256(parameters_of(m), s));
  EXPECT_EQ(to_vector(m2.get<1>().running_var().span<const float>(), s),
            to_vector(m.get<1>().running_var().span<const float>(), s));
  // a file without the buffers (a model saved without its batch norm's state) is refused, naming the first
  sequential plain(linear(4, 3, ctx, init));
  save_model(dir.path() / "plain.safetensors", parameters_of(plain), s);
  sequential with_bn(linear(4, 3, ctx, init), batch_norm(3, ctx, batch_norm_options{.affine = false}));
  EXPECT_CONTAINS(message_of<data_error>([&] { load_model(dir.path() / "plain.safetensors", parameters_of(with_bn), s); }),
                  "tensor '1.running_mean' is missing");
}

TEST(model_io, a_mismatched_file_throws_and_changes_nothing) {
  scratch dir;
  stream s(device{device_kind::host, 0});
  context ctx(s);
  initializer init(1);
  sequential small(linear(4, 3, ctx, init), relu(), linear(3, 2, ctx, init));
  sequential wider(linear(4, 5, ctx, init), relu(), linear(5, 2, ctx, init));
  sequential shorter(linear(4, 3, ctx, init));
  save_model(dir.path() / "small.safetensors", parameters_of(small), s);
  const std::string before = weights_sha256(parameters_of(wider), s);
  EXPECT_CONTAINS(message_of<data_error>([&] { load_model(dir.path() / "small.safetensors", parameters_of(wider), s); }),
                  "tensor '0.weight' has shape [3, 4], expected [5, 4]");
  EXPECT_EQ(weights_sha256(parameters_of(wider), s), before);
  EXPECT_CONTAINS(message_of<data_error>([&] { load_model(dir.path() / "small.safetensors", parameters_of(shorter), s); }),
                  "tensor '2.weight' is not part of what is being loaded");
  EXPECT_CONTAINS(message_of<io_error>([&] { load_model(dir.path() / "none.safetensors", parameters_of(small), s); }),
                  "No such file or directory");
}

// ---- training checkpoints ------------------------------------------------------------------------------------

class checkpoint_resume : public ::testing::TestWithParam<std::tuple<device_kind, dtype, bool>> {
 protected:
  void SetUp() override {
    if (kind() == device_kind::cuda && !cuda_available()) GTEST_SKIP() << "no GPU: " << cuda_status().reason();
  }
  device_kind kind() const { return std::get<0>(GetParam()); }
  device dev() const { return device{kind(), 0}; }
  dtype precision() const { return std::get<1>(GetParam()); }
  bool adam() const { return std::get<2>(GetParam()); }
};

INSTANTIATE_TEST_SUITE_P(all, checkpoint_resume,
                         ::testing::Combine(::testing::Values(device_kind::host, device_kind::cuda),
                                            ::testing::Values(dtype::f32, dtype::f16, dtype::bf16), ::testing::Bool()),
                         [](const auto& p) {
                           return std::string(name_of(std::get<0>(p.param))) + "_" +
                                  std::string(name_of(std::get<1>(p.param))) + (std::get<2>(p.param) ? "_adamw" : "_sgd");
                         });

TEST_P(checkpoint_resume, continues_bit_for_bit) {
  scratch dir;
  run straight(dev(), precision(), adam());
  straight.train(10);

  run first(dev(), precision(), adam());
  first.train(4);
  checkpointer saver(dir.path());
  auto st = first.state();
  st.position.epoch = 1;
  st.position.epoch_samples = 96;
  st.user["note"] = "hello";
  const fs::path written = saver.save(st, first.s);
  EXPECT_EQ(written, dir.path() / "step-000000000004");
  EXPECT_TRUE(fs::exists(written / "model.safetensors"));
  EXPECT_TRUE(fs::exists(written / "training.safetensors"));
  EXPECT_TRUE(fs::exists(written / "manifest.json"));

  run resumed(dev(), precision(), adam());
  resumed.train(1);  // a different state, fully replaced by the load
  auto rs = resumed.state();
  EXPECT_EQ(load_checkpoint(dir.path(), rs, resumed.s), written);
  EXPECT_EQ(resumed.fingerprint(), first.fingerprint());
  EXPECT_EQ(rs.position.step, 4);
  EXPECT_EQ(rs.position.epoch, 1u);
  EXPECT_EQ(rs.position.epoch_samples, 96u);
  EXPECT_EQ(rs.position.precision, precision());
  EXPECT_EQ(rs.user["note"], "hello");
  resumed.step = rs.position.step;
  resumed.train(6);
  EXPECT_EQ(resumed.fingerprint(), straight.fingerprint());
  EXPECT_EQ(weights_sha256(parameters_of(resumed.model), resumed.s), weights_sha256(parameters_of(straight.model), straight.s));
}

TEST(checkpoint, a_save_before_the_first_step_resumes_as_a_first_step) {
  scratch dir;
  const device d{device_kind::host, 0};
  run straight(d, dtype::f32, false);
  straight.train(3);
  run fresh(d, dtype::f32, false);
  checkpointer saver(dir.path());
  auto st = fresh.state();
  saver.save(st, fresh.s);
  run resumed(d, dtype::f32, false);
  auto rs = resumed.state();
  load_checkpoint(dir.path(), rs, resumed.s);
  resumed.train(3);
  EXPECT_EQ(resumed.fingerprint(), straight.fingerprint());
}

TEST(checkpoint, a_user_entry_that_json_cannot_hold_is_refused_before_anything_is_written) {
  scratch dir;
  run r(device{device_kind::host, 0}, dtype::f32, false);
  r.train(1);
  checkpointer saver(dir.path());
  auto st = r.state();
  st.user["loss"] = std::nan("");
  EXPECT_CONTAINS(message_of<precondition_error>([&] { saver.save(st, r.s); }),
                  "state.user and the optimizer's options must hold finite numbers");
  for (const auto& e : fs::directory_iterator(dir.path())) {
    const std::string name = e.path().filename().string();
    EXPECT_FALSE(name.starts_with("step-") || name.starts_with(".step-")) << name;  // a checkpoint, or a staging one
  }
  st.user["loss"] = 0.5;
  EXPECT_EQ(saver.save(st, r.s), dir.path() / "step-000000000001");
}

TEST(checkpoint, a_file_given_for_a_checkpoint_and_a_directory_given_for_a_model_are_named_with_the_fix) {
  scratch dir;
  const device d{device_kind::host, 0};
  run origin(d, dtype::f32, false);
  origin.train(1);
  checkpointer saver(dir.path());
  auto st = origin.state();
  const fs::path good = saver.save(st, origin.s);
  const auto before = origin.fingerprint();
  // a checkpoint's own file where its directory belongs
  const std::string m = message_of<io_error>([&] { load_checkpoint(good / "model.safetensors", st, origin.s); });
  EXPECT_CONTAINS(m, "model.safetensors is a file; a checkpoint is the directory that holds its files (" +
                         good.string() + ")");
  // a directory where a model file belongs (mmap used to say "No such device")
  const std::string d_msg = message_of<io_error>([&] { load_model(good, parameters_of(origin.model), origin.s); });
  EXPECT_CONTAINS(d_msg, "a directory, not a file: give the file in it, e.g. its model.safetensors");
  EXPECT_EQ(origin.fingerprint(), before);
}

// An unwritable root is refused when the checkpointer is built, not at the first save after training (issue 27,
// item 3; the read-only directory is checkpoint_faults' case, in a child that can drop root's rights).
TEST(checkpoint, an_unwritable_root_is_refused_when_the_checkpointer_is_built) {
  scratch dir;
  const fs::path file = dir.path() / "a_file";
  { std::ofstream(file) << "x"; }
  const std::string m = message_of<io_error>([&] { checkpointer saver(file); });
  EXPECT_CONTAINS(m, "checkpointer: " + file.string() + " exists and is not a directory");
  const std::string under = message_of<io_error>([&] { checkpointer saver(file / "below"); });
  EXPECT_CONTAINS(under, "cannot write checkpoints under " + (file / "below").string());
  // a missing root is created, and the probe leaves nothing behind
  checkpointer now(dir.path() / "now" / "deeper");
  EXPECT_TRUE(fs::is_directory(dir.path() / "now" / "deeper"));
  EXPECT_TRUE(fs::is_empty(dir.path() / "now" / "deeper"));
  // a rank that never writes does not touch its root
  checkpointer later(dir.path() / "later", checkpoint_options{.check_root = root_check::at_first_save});
  EXPECT_FALSE(fs::exists(dir.path() / "later"));
}

// One run writes a root at a time (issue 27, item 1): lock() refuses a root another writer holds, naming the
// holder; a writer that did not lock first is refused at its first save, which writes nothing; once the holder
// ends (or its process dies: the kernel drops a flock), the root is free.
TEST(checkpoint, a_second_writer_of_a_root_is_refused_naming_the_first) {
  scratch dir;
  std::optional<checkpointer> first(std::in_place, dir.path());
  first->lock();
  checkpointer second(dir.path());  // building one is fine: ranks that never write build one too
  const std::string m = message_of<io_error>([&] { second.lock(); });
  EXPECT_CONTAINS(m, "checkpointer: " + dir.path().string() + " is being written by another run (process " +
                         std::to_string(::getpid()) + " on ");
  EXPECT_CONTAINS(m, "save this one under another directory");
  run r(device{device_kind::host, 0}, dtype::f32, false);
  r.train(1);
  auto st = r.state();
  EXPECT_CONTAINS(message_of<io_error>([&] { second.save(st, r.s); }), "is being written by another run");
  EXPECT_FALSE(latest_checkpoint(dir.path()).has_value());
  first.reset();
  const fs::path saved = second.save(st, r.s);
  // readers need no lock: loading while a writer holds the root works
  load_checkpoint(saved, st, r.s);
}

// Issue 28, item 10: rank 0's write (slowed by before_publish to 4x the clique's timeout) does not fail the other
// ranks, which wait for it in rounds shorter than the timeout (detail::save_poll) rather than in one broadcast;
// synchronous and asynchronous saves alike.
TEST(checkpoint, a_distributed_save_longer_than_the_communicator_timeout_completes_on_every_rank) {
  scratch dir;
  const auto timeout = std::chrono::milliseconds(400);
  for (const bool async : {false, true}) {
    const fs::path root = dir.path() / (async ? "async" : "sync");
    fs::create_directories(root);
    std::vector<std::optional<fs::path>> saved(2);
    run_on_devices(
        device_set("host:0,host:1"),
        [&](rank_context& rc) {
          run r(rc.get_device(), dtype::f32, false);
          r.train(1);
          checkpointer saver(root, checkpoint_options{.before_publish = [&](const fs::path&) {
                                                        std::this_thread::sleep_for(4 * timeout);
                                                      },
                                                      .check_root = root_check::at_first_save});
          auto st = r.state();
          const auto u = static_cast<std::size_t>(rc.rank());
          if (async) {
            saver.save_async(st, r.s, rc.comm());
            saved[u] = saver.wait();
          } else {
            saved[u] = saver.save(st, r.s, rc.comm());
          }
        },
        comm_options{.timeout = timeout});
    SCOPED_TRACE(async ? "save_async" : "save");
    ASSERT_TRUE(saved[0].has_value());
    EXPECT_EQ(latest_checkpoint(root), saved[0]);
    if (!async) {
      EXPECT_EQ(saved[1], saved[0]);  // save() gives every rank the directory
    }
  }
}

// Each way a load can fail leaves the model, the optimizer (state, counts, rate) and the scaler bit for bit.
TEST(checkpoint, every_faulty_load_throws_and_changes_nothing) {
  scratch dir;
  const device d{device_kind::host, 0};
  run origin(d, dtype::f16, true);
  origin.train(3);
  checkpointer saver(dir.path());
  auto st = origin.state();
  const fs::path good = saver.save(st, origin.s);

  run target(d, dtype::f16, true);
  target.train(2);
  const auto before = target.fingerprint();
  auto attempt = [&](const fs::path& where) {
    auto ts = target.state();
    std::string m = message_of<data_error>([&] { load_checkpoint(where, ts, target.s); });
    EXPECT_EQ(target.fingerprint(), before) << "after: " << m;
    return m;
  };
  auto variant = [&](const std::string& name, auto&& change) {
    const fs::path v = dir.path() / name;
    fs::copy(good, v);
    change(v);
    return v;
  };
  const auto training = [](const fs::path& v) { return v / "training.safetensors"; };

  // a flipped byte in the data: the checksum
  EXPECT_CONTAINS(attempt(variant("flipped", [&](const fs::path& v) {
                    auto b = file_bytes(v / "model.safetensors");
                    b[b.size() - 3] ^= std::byte{0x40};
                    write_bytes(v / "model.safetensors", b);
                  })),
                  "checksum mismatch");
  // a truncated file
  EXPECT_CONTAINS(attempt(variant("truncated", [&](const fs::path& v) {
                    auto b = file_bytes(training(v));
                    b.resize(b.size() - 5);
                    write_bytes(training(v), b);
                  })),
                  "truncated or replaced");
  // Rewrites the training file through `edit` (of its tensors) and fixes the manifest's size and checksum, as
  // a file written by another program would be: the structural checks must catch it.
  auto rewrite = [&](const std::string& name, auto&& edit) {
    return variant(name, [&](const fs::path& v) {
      const auto b = file_bytes(training(v));
      const auto h = parse_safetensors_header(b, b.size(), "t");
      std::vector<safetensors_source> src;
      std::vector<std::vector<std::byte>> keep;
      for (const auto& t : h.tensors) src.push_back({t.name, t.type, t.shape, b.data() + h.data_offset + t.begin});
      edit(src, keep);
      const std::string header = safetensors_header_bytes(src);
      std::vector<std::byte> out(header.size());
      std::memcpy(out.data(), header.data(), header.size());
      for (const auto& t : src) out.insert(out.end(), t.data, t.data + t.size_bytes());
      write_bytes(training(v), out);
      auto m = read_json(v / "manifest.json");
      m["files"]["training.safetensors"]["bytes"] = out.size();
      m["files"]["training.safetensors"]["xxh3_64"] = detail::checksum_of(out);
      m["checksum"] = detail::manifest_checksum(m.dump());
      std::ofstream(v / "manifest.json") << m.dump();
    });
  };
  EXPECT_CONTAINS(attempt(rewrite("missing", [](auto& src, auto&) {
                    src.erase(std::find_if(src.begin(), src.end(), [](const auto& t) { return t.name == "optimizer.state.fc2.bias.exp_avg"; }));
                  })),
                  "tensor 'optimizer.state.fc2.bias.exp_avg' is missing");
  EXPECT_CONTAINS(attempt(rewrite("extra", [](auto& src, auto& keep) {
                    keep.emplace_back(8);
                    src.push_back({"stray", dtype::f32, {2}, keep.back().data()});
                  })),
                  "tensor 'stray' is not part of what is being loaded");
  EXPECT_CONTAINS(attempt(rewrite("dtype", [](auto& src, auto&) {
                    for (auto& t : src)
                      if (t.name == "scaler.steps") t.type = dtype::f32, t.shape = {2};  // 8 bytes, the wrong type
                  })),
                  "tensor 'scaler.steps' has dtype F32, expected I64");
  EXPECT_CONTAINS(attempt(rewrite("shape", [](auto& src, auto&) {
                    for (auto& t : src)
                      if (t.name == "optimizer.state.out.weight.exp_avg_sq") t.shape = {16, 10};
                  })),
                  "tensor 'optimizer.state.out.weight.exp_avg_sq' has shape [16, 10], expected [10, 16]");
  // a header over the format's limit
  EXPECT_CONTAINS(attempt(variant("huge_header", [&](const fs::path& v) {
                    auto b = file_bytes(training(v));
                    b[3] = std::byte{0x10};
                    write_bytes(training(v), b);
                    auto m = read_json(v / "manifest.json");
                    m["files"]["training.safetensors"]["xxh3_64"] = detail::checksum_of(b);
                    m["checksum"] = detail::manifest_checksum(m.dump());
                    std::ofstream(v / "manifest.json") << m.dump();
                  })),
                  "over the limit of 100000000");
  // An edited position (issue 27, item 6): the manifest's checksum of itself; rehashed, or without a checksum (as
  // older lockstep wrote them), the step the tensors' files were saved at.
  const auto edit_manifest = [&](const std::string& name, auto&& edit) {
    return variant(name, [&](const fs::path& v) {
      auto m = read_json(v / "manifest.json");
      edit(m);
      std::ofstream(v / "manifest.json") << m.dump(1);
    });
  };
  for (const char* field : {"step", "epoch", "epoch_samples"}) {
    EXPECT_CONTAINS(attempt(edit_manifest(std::string("edited_") + field,
                                          [&](json_value& m) { m["position"][field] = 1000; })),
                    "the manifest was changed after it was written");
  }
  EXPECT_CONTAINS(attempt(edit_manifest("rehashed_step",
                                        [](json_value& m) {
                                          m["position"]["step"] = 1000;
                                          m["checksum"] = detail::manifest_checksum(m.dump());
                                        })),
                  "manifest.json says step 1000 but model.safetensors was saved at step ");
  EXPECT_CONTAINS(attempt(edit_manifest("unhashed_step",
                                        [](json_value& m) {
                                          m["position"]["step"] = 1000;
                                          m.erase("checksum");
                                        })),
                  "manifest.json says step 1000 but model.safetensors was saved at step ");
  // another optimizer, and no scaler where one is expected
  {
    run sgd_run(d, dtype::f16, false);
    auto ss = sgd_run.state();
    const auto b = sgd_run.fingerprint();
    const std::string mismatch = message_of<data_error>([&] { load_checkpoint(good, ss, sgd_run.s); });
    EXPECT_CONTAINS(mismatch, "the checkpoint's optimizer is adamw, this run's is sgd");
    EXPECT_EQ(mismatch.find("intact"), std::string::npos) << "an intact checkpoint that does not match the run is not "
                                                             "damaged: no other one is offered";
    EXPECT_EQ(sgd_run.fingerprint(), b);
  }
  {
    run f32_run(d, dtype::f32, true);
    checkpointer other(dir.path() / "f32");
    auto fs32 = f32_run.state();
    const fs::path f32_dir = other.save(fs32, f32_run.s);
    auto ts = target.state();
    EXPECT_CONTAINS(message_of<data_error>([&] { load_checkpoint(f32_dir, ts, target.s); }), "holds no loss scaler");
    EXPECT_EQ(target.fingerprint(), before);
  }
  // and the good one still loads
  auto ts = target.state();
  load_checkpoint(good, ts, target.s);
  EXPECT_EQ(target.fingerprint(), origin.fingerprint());
}

// Issue 27, item 7: a root whose newest checkpoint is corrupt names the newest intact one and how to load it.
TEST(checkpoint, a_corrupt_newest_checkpoint_names_the_newest_intact_one) {
  scratch dir;
  run r(device{device_kind::host, 0}, dtype::f32, false);
  checkpointer saver(dir.path());
  std::vector<fs::path> saved;
  for (int i = 0; i < 3; ++i) {
    r.train(1);
    auto st = r.state();
    saved.push_back(saver.save(st, r.s));
  }
  const auto flip = [](const fs::path& file) {
    auto b = file_bytes(file);
    b[b.size() - 3] ^= std::byte{0x40};
    write_bytes(file, b);
  };
  run target(device{device_kind::host, 0}, dtype::f32, false);
  auto ts = target.state();
  flip(saved[2] / "model.safetensors");
  std::string m = message_of<data_error>([&] { load_checkpoint(dir.path(), ts, target.s); });
  EXPECT_CONTAINS(m, "checksum mismatch");
  EXPECT_CONTAINS(m, "The newest intact checkpoint before it is " + saved[1].string());
  EXPECT_CONTAINS(m, "--resume " + saved[1].string());
  fs::remove(saved[1] / "training.safetensors");  // a missing file: io_error, with the same hint
  EXPECT_CONTAINS(message_of<io_error>([&] { load_checkpoint(saved[1], ts, target.s); }),
                  "The newest intact checkpoint before it is " + saved[0].string());
  EXPECT_CONTAINS(message_of<data_error>([&] { load_checkpoint(dir.path(), ts, target.s); }),
                  "The newest intact checkpoint before it is " + saved[0].string());
  flip(saved[0] / "training.safetensors");
  EXPECT_CONTAINS(message_of<data_error>([&] { load_checkpoint(dir.path(), ts, target.s); }),
                  "No intact checkpoint before it is under " + dir.path().string());
}

// Issue 27, item 7: pruning renames a checkpoint out of its step-N name before removing it, so a kill during the
// removal leaves no step-N directory that looks complete; a later save removes what such a kill left.
TEST(checkpoint, what_an_interrupted_pruning_leaves_is_no_checkpoint_and_is_removed_later) {
  scratch dir;
  run r(device{device_kind::host, 0}, dtype::f32, false);
  // set aside by this very pid (a restarted container's trainer gets its old pid), and an unpublished save of a
  // process that no longer exists
  for (const std::string& left : {".step-000000000001.tmp." + std::to_string(::getpid()) + ".pruned",
                                  std::string(".step-000000000000.tmp.999999999")}) {
    fs::create_directories(dir.path() / left);
    write_bytes(dir.path() / left / "manifest.json", std::vector<std::byte>(3, std::byte{'{'}));
  }
  EXPECT_EQ(latest_checkpoint(dir.path()), std::nullopt);
  checkpointer saver(dir.path(), {.keep_last = 1});
  for (int i = 0; i < 2; ++i) {
    r.train(1);
    auto st = r.state();
    saver.save(st, r.s);
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lockstep-writer.lock", "step-000000000002"}));
}

TEST(checkpoint, keep_last_removes_older_checkpoints_only_after_the_new_one_is_complete) {
  scratch dir;
  run r(device{device_kind::host, 0}, dtype::f32, false);
  {
    checkpointer saver(dir.path(), {.keep_last = 2});
    for (int i = 0; i < 4; ++i) {
      r.train(1);
      auto st = r.state();
      saver.save(st, r.s);
    }
  }  // one writer at a time: the next checkpointer takes the root's lock
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lockstep-writer.lock", "step-000000000003", "step-000000000004"}));
  EXPECT_EQ(latest_checkpoint(dir.path()), dir.path() / "step-000000000004");
  // a save whose publication fails keeps the newest two as they were
  {
    checkpointer failing(dir.path(), {.keep_last = 1, .before_publish = [](const fs::path&) { throw io_error("injected"); }});
    r.train(1);
    auto st = r.state();
    EXPECT_CONTAINS(message_of<io_error>([&] { failing.save(st, r.s); }), "injected");
  }
  names.clear();
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lockstep-writer.lock", "step-000000000003", "step-000000000004"}));
  // Issue 27 item 4: a new run from step 0 (it forgot to resume) into the same root is refused before it writes
  // (keep_last would delete the other run's checkpoints, and loading the root would take the other run's step 4),
  // by expect_own_root before training and by the save itself, naming the other run's checkpoints
  run again(device{device_kind::host, 0}, dtype::f32, false);
  again.train(1);
  auto st2 = again.state();
  {
    checkpointer restart(dir.path(), {.keep_last = 1});
    const std::string early = message_of<precondition_error>([&] { restart.expect_own_root(st2); });
    EXPECT_CONTAINS(early, "holds checkpoints of another run (step-000000000004, step-000000000003, run " + r.run_id);
    EXPECT_CONTAINS(early, "Resume that run");
    EXPECT_EQ(message_of<precondition_error>([&] { restart.save(st2, again.s); }), early);
  }
  names.clear();
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lockstep-writer.lock", "step-000000000003", "step-000000000004"}));
  // the run that resumed from the root saves there: its own checkpoints
  {
    run resumed(device{device_kind::host, 0}, dtype::f32, false);
    auto rs = resumed.state();
    EXPECT_EQ(load_checkpoint(dir.path(), rs, resumed.s), dir.path() / "step-000000000004");
    EXPECT_EQ(rs.run_id, r.run_id);
    checkpointer same(dir.path(), {.keep_last = 2});
    same.expect_own_root(rs);
    rs.position.step = 5;
    EXPECT_EQ(same.save(rs, resumed.s), dir.path() / "step-000000000005");
  }
  // with overwrite, the new run's first checkpoint replaces the other run's
  {
    checkpointer replace(dir.path(), {.keep_last = 2, .overwrite = true});
    replace.expect_own_root(st2);
    EXPECT_EQ(replace.save(st2, again.s), dir.path() / "step-000000000001");
  }
  names.clear();
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lockstep-writer.lock", "step-000000000001"}));
  EXPECT_EQ(latest_checkpoint(dir.path()), dir.path() / "step-000000000001");
  // states and checkpointers made one per save, with the default run_id (the process's run), save as one run
  scratch own;
  for (std::int64_t step = 1; step <= 3; ++step) {
    checkpoint_state each(parameters_of(r.model));
    each.position.step = step;
    checkpointer per_save(own.path(), {.keep_last = 2});
    per_save.expect_own_root(each);
    EXPECT_EQ(per_save.save(each, r.s), own.path() / detail::checkpoint_dir_name(step));
  }
}

TEST(checkpoint, a_diverged_model_is_never_saved_and_the_finite_checkpoints_stay) {
  // The repro: --lr 1e6 --save-every 1 --keep-last 2 left two checkpoints full of NaN and deleted the finite ones.
  scratch dir;
  run r(device{device_kind::host, 0}, dtype::f32, false);
  checkpointer saver(dir.path(), {.keep_last = 2});
  for (int i = 0; i < 2; ++i) {
    r.train(1);
    auto st = r.state();
    saver.save(st, r.s);
  }
  r.train(1);
  parameter& p = *r.params[1];  // a NaN in the middle of one tensor, as a diverged step leaves
  std::vector<float> values = to_vector(p.value().span<const float>(), r.s);
  values[values.size() / 2] = std::numeric_limits<float>::quiet_NaN();
  auto staged = to_device(values, r.s);
  copy(p.value().span<float>(), device_span<const float>(staged.span()), r.s);
  auto st = r.state();
  const std::string m = message_of<numeric_error>([&] { saver.save(st, r.s); });
  EXPECT_CONTAINS(m, "checkpoint of step 3 not saved: " + parameters_of(r.model)[1].name + " holds a value that is "
                     "not finite (NaN or infinity) at element " + std::to_string(values.size() / 2));
  EXPECT_CONTAINS(m, "the newest is " + (dir.path() / "step-000000000002").string());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".lockstep-writer.lock", "step-000000000001", "step-000000000002"}));
  // an infinity in f16 or bf16 bits is found too
  const std::uint16_t half_inf = 0x7c00, bf16_nan = 0x7fc1, finite[2] = {0x3c00, 0x7bff};
  EXPECT_EQ(detail::first_non_finite(dtype::f16, reinterpret_cast<const std::byte*>(&half_inf), 2), 0);
  EXPECT_EQ(detail::first_non_finite(dtype::bf16, reinterpret_cast<const std::byte*>(&bf16_nan), 2), 0);
  EXPECT_EQ(detail::first_non_finite(dtype::f16, reinterpret_cast<const std::byte*>(finite), 4), -1);
}

TEST(checkpoint, an_asynchronous_save_stages_in_stream_order_while_training_goes_on) {
  scratch dir;
  const device d{device_kind::host, 0};
  run r(d, dtype::f32, true);
  r.train(2);
  const auto at_save = r.fingerprint();
  checkpointer saver(dir.path());
  auto st = r.state();
  saver.save_async(st, r.s);
  r.train(3);  // queued behind the staging copies: the checkpoint holds step 2's values
  const auto path = saver.wait();
  ASSERT_TRUE(path.has_value());
  EXPECT_EQ(*path, dir.path() / "step-000000000002");
  EXPECT_FALSE(saver.wait().has_value());
  run back(d, dtype::f32, true);
  auto bs = back.state();
  load_checkpoint(*path, bs, back.s);
  EXPECT_EQ(back.fingerprint(), at_save);
  // an error of an asynchronous save surfaces at wait() (another root: `saver` still writes this one)
  checkpointer failing(dir.path() / "other", {.before_publish = [](const fs::path&) { throw io_error("disk on fire"); }});
  auto st2 = r.state();
  failing.save_async(st2, r.s);
  EXPECT_CONTAINS(message_of<io_error>([&] { (void)failing.wait(); }), "disk on fire");
}

// ---- faults of the file system, in a child process (this program, started with --io-fault-child) -----------------

// The child: trains one step and saves it (step 1) under `dir`, trains another and saves again (step 2) into
// `fault`:
//   kill      SIGKILL once the files are written and synced, before the rename that publishes them
//   fsize     a file-size limit (RLIMIT_FSIZE) far below the checkpoint's size: writes fail part-way
//   readonly  the directory made read-only (and, as root, the process turned into nobody, whom it binds)
// Prints the error of the second save and returns 3; returns 0 if it did not fail, 2 on a usage error.
int fault_child(const std::string& fault, const fs::path& dir) {
  try {
    run r(device{device_kind::host, 0}, dtype::f32, false);
    r.train(1);
    {
      checkpointer saver(dir);
      auto st = r.state();
      saver.save(st, r.s);
    }
    r.train(1);
    checkpoint_options o;
    if (fault == "kill") {
      o.before_publish = [](const fs::path&) { ::raise(SIGKILL); };
    } else if (fault == "fsize") {
      ::signal(SIGXFSZ, SIG_IGN);  // EFBIG from write() instead of a signal
      const rlimit limit{2000, 2000};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 2;
    } else if (fault == "readonly") {
      if (::chmod(dir.c_str(), 0555) != 0) return 2;
      if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 2;  // root ignores modes
    } else {
      return 2;
    }
    checkpointer saver(dir, o);
    auto st = r.state();
    saver.save(st, r.s);
    std::printf("the second save did not fail\n");
    return 0;
  } catch (const std::exception& e) {
    std::printf("%s\n", e.what());
    return 3;
  }
}

// Runs this program as the child with `args`; returns its exit status (or 128 + signal) and what it printed.
std::pair<int, std::string> run_child(const std::vector<std::string>& args) {
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  const fs::path out = fs::temp_directory_path() / ("lockstep_io_child." + std::to_string(::getpid()) + ".txt");
  std::vector<std::string> all{exe, "--io-fault-child"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(rc, 0) << "could not start " << exe;
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fs::remove(out);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), text};
}

// The child's first save (step 1) is complete; its second (step 2) meets `fault`. Afterwards step 1 must load
// exactly as the child saved it, and no partial step 2 may be visible.
void expect_previous_checkpoint_survives(const std::string& fault, int expected_status, const std::string& expected_text) {
  scratch dir;
  const auto [status, text] = run_child({fault, dir.path().string()});
  EXPECT_EQ(status, expected_status) << text;
  EXPECT_CONTAINS(text, expected_text);
  ASSERT_EQ(latest_checkpoint(dir.path()), dir.path() / "step-000000000001") << text;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    const auto name = e.path().filename().string();
    EXPECT_TRUE(name == "step-000000000001" || name.rfind(".step-", 0) == 0 || name == ".lockstep-writer.lock") << name;
  }
  run r(device{device_kind::host, 0}, dtype::f32, false);
  r.train(1);  // the child trained one step before its first save
  const auto expected = r.fingerprint();
  run loaded(device{device_kind::host, 0}, dtype::f32, false);
  auto st = loaded.state();
  load_checkpoint(dir.path(), st, loaded.s);
  EXPECT_EQ(loaded.fingerprint(), expected);
}

TEST(checkpoint_faults, a_kill_between_the_data_write_and_the_rename_leaves_the_previous_checkpoint) {
  expect_previous_checkpoint_survives("kill", 128 + SIGKILL, "");
}

TEST(checkpoint_faults, a_full_disk_is_an_error_and_leaves_the_previous_checkpoint) {
  // RLIMIT_FSIZE stands in for a full disk: the write fails part-way, as with ENOSPC
  expect_previous_checkpoint_survives("fsize", 3, "File too large");
}

TEST(checkpoint_faults, a_read_only_directory_is_an_error_and_leaves_the_previous_checkpoint) {
  // found when the checkpointer is built, before anything is trained or written
  expect_previous_checkpoint_survives("readonly", 3, "Permission denied); give a directory this process can write");
}

}  // namespace

// GoogleTest's main, or the fault tests' child (`--io-fault-child FAULT DIR`): one program, one compilation.
int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--io-fault-child") {
    if (argc != 4) {
      std::fprintf(stderr, "usage: test_io --io-fault-child kill|fsize|readonly DIR\n");
      return 2;
    }
    return fault_child(argv[2], argv[3]);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
