// lockstep/blas/onednn_conv.hpp — host convolutions on oneDNN's convolution primitives (only with
// LOCKSTEP_HAS_ONEDNN).
//
// conv2d (nn/conv2d.hpp) runs its three passes — forward, the input gradient (backward data) and the weight and
// bias gradients (backward weights) — as oneDNN convolutions on a host device when the handle's GEMM plan names
// oneDNN for the type, outside deterministic mode. Measured on one core of an AMD EPYC (Zen 4, AVX-512) for the
// CNN sample's second convolution (batch 128, 32 -> 64 channels, 14 x 14, 3 x 3): 26 ms for the three passes
// against 67 ms for lockstep's im2col + GEMM + layout kernels, and 38 ms for PyTorch 1.13's convolutions.
//
// oneDNN chooses the layouts its kernels want (format_tag any: blocked, nChw16c and OIhw16i16o on AVX-512; its
// im2col kernel for plain layouts is mostly 2-3 times slower there), except where the key names plain layouts (one
// input channel below AVX-512, and its backward data on AVX-512: onednn_conv_layouts_for in convolution.hpp, where
// the im2col kernel is the faster one); reorders move the values between those and lockstep's
// plain NCHW / OIHW / [C] tensors before and after each pass, through a workspace taken from the handle's scratch
// memory: the blocked copies of the pass's tensors (each the size of the plain one, rounded up to 16 channels) and
// the primitive's scratchpad. So the workspace is bounded by the pass's tensors, a few times the layer's output
// (the reorders' own small scratchpads are oneDNN's); a backward that needs both passes holds both workspaces at
// once, its data pass reading the weights pass's copy of the output gradient when both read it in one layout
// (convolution.hpp). The weight and bias gradients are computed in f32 (also for bf16) and rounded once by the
// reorder into the plain gradient, which adds beta times what it held (its sum post-op) when gradients accumulate:
// one rounding, as the GEMMs. f16 has no oneDNN kernel on CPUs (the caller keeps im2col), nor has a shape oneDNN
// serves only with its reference loop.
#pragma once

#include "lockstep/blas/onednn.hpp"

#if LOCKSTEP_HAS_ONEDNN
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

LOCKSTEP_DETAIL_BEGIN

/// The three passes of a convolution.
enum class onednn_conv_pass : std::uint8_t { forward, backward_data, backward_weights };

/// The layouts a pass's primitive reads and writes: those oneDNN chooses for its kernels (blocked, with reorders
/// from and to lockstep's plain tensors), or lockstep's plain NCHW / OIHW tensors themselves (no reorder; oneDNN
/// then runs its gemm:jit kernels). convolution.hpp picks by the table of docs/blas.md (onednn_conv_layouts_for).
enum class onednn_conv_layouts : std::uint8_t { chosen_by_onednn, plain };

/// One pass of one convolution: NCHW input [n, c, h, w], weight [oc, c, k, k], square stride and padding; beta and
/// bias_beta apply to backward_weights' outputs (dW = dW' + beta dW, dbias = dbias' + bias_beta dbias).
struct onednn_conv_key {
  std::int64_t n = 0, c = 0, h = 0, w = 0, oc = 0, k = 0, stride = 1, padding = 0;
  dtype type = dtype::f32;
  bool bias = false;
  onednn_conv_pass pass = onednn_conv_pass::forward;
  float beta = 0.0f;
  float bias_beta = 0.0f;
  onednn_conv_layouts layouts = onednn_conv_layouts::chosen_by_onednn;

  [[nodiscard]] std::int64_t out_h() const noexcept { return (h + 2 * padding - k) / stride + 1; }
  [[nodiscard]] std::int64_t out_w() const noexcept { return (w + 2 * padding - k) / stride + 1; }
  friend bool operator==(const onednn_conv_key& x, const onednn_conv_key& y) noexcept {
    return x.n == y.n && x.c == y.c && x.h == y.h && x.w == y.w && x.oc == y.oc && x.k == y.k &&
           x.stride == y.stride && x.padding == y.padding && x.type == y.type && x.bias == y.bias &&
           x.pass == y.pass && x.layouts == y.layouts &&
           std::bit_cast<std::uint32_t>(x.beta) == std::bit_cast<std::uint32_t>(y.beta) &&
           std::bit_cast<std::uint32_t>(x.bias_beta) == std::bit_cast<std::uint32_t>(y.bias_beta);
  }
};

struct onednn_conv_key_hash {
  std::size_t operator()(const onednn_conv_key& key) const noexcept {
    auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    return onednn_key_hash({u(key.n), u(key.c), u(key.h), u(key.w), u(key.oc), u(key.k), u(key.stride),
                            u(key.padding),
                            static_cast<std::uint64_t>(key.type) | (std::uint64_t{key.bias} << 8) |
                                (static_cast<std::uint64_t>(key.pass) << 9) |
                                (static_cast<std::uint64_t>(key.layouts) << 11),
                            std::bit_cast<std::uint32_t>(key.beta) |
                                (std::uint64_t{std::bit_cast<std::uint32_t>(key.bias_beta)} << 32)});
  }
};

/// One pass of a convolution, created for its key: the convolution primitive, and per tensor the reorder between
/// lockstep's plain layout and the primitive's (when they differ). Its run() takes the plain tensors:
///   forward           a = x, b = weight, c = bias (or null)      -> out = y
///   backward_data     a = gy, b = weight                         -> out = gx
///   backward_weights  a = x, b = gy                              -> out = dweight, out2 = dbias (or null)
/// Runs on one stream's worker at a time (reorders, copy_of and reads_like read only what construction fixed).
class onednn_convolution {
 public:
  enum class slot : std::uint8_t { a, b, c, out, out2 };  // run()'s arguments
  static constexpr std::size_t max_arguments = 5;
  /// Copies of input tensors that another pass made in the layouts this pass reads (see copy_of): by slot, null
  /// where the pass reorders the plain tensor itself.
  using given_copies = std::array<const std::byte*, max_arguments>;

  explicit onednn_convolution(const onednn_conv_key& key) {
    const std::lock_guard lock(onednn_lifetime_mutex());
    const onednn_one_thread_scope one_thread;  // fixed when the primitives are created, on the queuing thread
    const dnnl_data_type_t t = key.type == dtype::bf16 ? dnnl_bf16 : key.type == dtype::f16 ? dnnl_f16 : dnnl_f32;
    const dnnl_dims_t src_dims{key.n, key.c, key.h, key.w}, weight_dims{key.oc, key.c, key.k, key.k};
    const dnnl_dims_t dst_dims{key.n, key.oc, key.out_h(), key.out_w()}, bias_dims{key.oc};
    const dnnl_dims_t strides{key.stride, key.stride}, padding{key.padding, key.padding};
    dnnl_memory_desc_t src_plain{}, weight_plain{}, dst_plain{}, bias_plain{}, src_any{}, weight_any{}, dst_any{};
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&src_plain, 4, src_dims, t, dnnl_nchw), "describing x");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&weight_plain, 4, weight_dims, t, dnnl_oihw), "describing W");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&dst_plain, 4, dst_dims, t, dnnl_nchw), "describing y");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&bias_plain, 1, bias_dims, t, dnnl_x), "describing the bias");
    // the layouts the primitives are described with: any (oneDNN's choice), or the plain ones
    const bool plain = key.layouts == onednn_conv_layouts::plain;
    const dnnl_format_tag_t image_tag = plain ? dnnl_nchw : dnnl_format_tag_any;
    const dnnl_format_tag_t weight_tag = plain ? dnnl_oihw : dnnl_format_tag_any;
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&src_any, 4, src_dims, t, image_tag), "describing x");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&weight_any, 4, weight_dims, t, weight_tag), "describing W");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&dst_any, 4, dst_dims, t, image_tag), "describing y");
    const dnnl_memory_desc_t* bias_md = key.bias ? &bias_plain : nullptr;
    // the parameters' gradients in f32, rounded once into the plain gradient by its reorder
    dnnl_memory_desc_t dweight_any{}, dbias_f32{};
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&dweight_any, 4, weight_dims, dnnl_f32, weight_tag),
                          "describing dW");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_desc_init_by_tag(&dbias_f32, 1, bias_dims, dnnl_f32, dnnl_x),
                          "describing the bias gradient");

    // the forward pass: the primitive of `forward`, and the hint of the backward passes
    dnnl_convolution_desc_t forward_desc{};
    LOCKSTEP_ONEDNN_CHECK(dnnl_convolution_forward_desc_init(&forward_desc, dnnl_forward_training,
                                                             dnnl_convolution_direct, &src_any, &weight_any, bias_md,
                                                             &dst_any, strides, padding, padding),
                          "describing a convolution");
    dnnl_primitive_desc_t forward_pd = nullptr;
    if (!made(dnnl_primitive_desc_create(&forward_pd, &forward_desc, nullptr, onednn_engine(), nullptr), key)) return;
    const onednn_pd_owner forward_owner(forward_pd, &dnnl_primitive_desc_destroy);

    const onednn_attr_owner attr_owner = onednn_attributes(true, 0.0f);
    dnnl_primitive_attr_t attr = attr_owner.get();
    dnnl_primitive_desc_t pd = nullptr;
    if (key.pass == onednn_conv_pass::forward) {
      if (!made(dnnl_primitive_desc_create(&pd, &forward_desc, attr, onednn_engine(), nullptr), key)) return;
    } else if (key.pass == onednn_conv_pass::backward_data) {
      dnnl_convolution_desc_t desc{};
      LOCKSTEP_ONEDNN_CHECK(dnnl_convolution_backward_data_desc_init(&desc, dnnl_convolution_direct, &src_any,
                                                                     &weight_any, &dst_any, strides, padding, padding),
                            "describing a convolution's backward data pass");
      if (!made(dnnl_primitive_desc_create(&pd, &desc, attr, onednn_engine(), forward_pd), key)) return;
    } else {
      dnnl_convolution_desc_t desc{};
      LOCKSTEP_ONEDNN_CHECK(dnnl_convolution_backward_weights_desc_init(&desc, dnnl_convolution_direct, &src_any,
                                                                        &dweight_any, key.bias ? &dbias_f32 : nullptr,
                                                                        &dst_any, strides, padding, padding),
                            "describing a convolution's backward weights pass");
      if (!made(dnnl_primitive_desc_create(&pd, &desc, attr, onednn_engine(), forward_pd), key)) return;
    }
    const onednn_pd_owner owner(pd, &dnnl_primitive_desc_destroy);
    const char* impl = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl), "naming the kernel");
    implementation_ = impl ? impl : "";
    if (!onednn_usable(implementation_)) return;  // never run: the caller keeps its own kernels

    const auto md = [pd](dnnl_query_t what) { return *dnnl_primitive_desc_query_md(pd, what, 0); };
    switch (key.pass) {
      case onednn_conv_pass::forward:
        add(DNNL_ARG_SRC, slot::a, src_plain, md(dnnl_query_src_md), 0.0f);
        add(DNNL_ARG_WEIGHTS, slot::b, weight_plain, md(dnnl_query_weights_md), 0.0f);
        if (key.bias) add(DNNL_ARG_BIAS, slot::c, bias_plain, bias_plain, 0.0f);
        add(DNNL_ARG_DST, slot::out, dst_plain, md(dnnl_query_dst_md), 0.0f);
        break;
      case onednn_conv_pass::backward_data:
        add(DNNL_ARG_DIFF_DST, slot::a, dst_plain, md(dnnl_query_diff_dst_md), 0.0f);
        add(DNNL_ARG_WEIGHTS, slot::b, weight_plain, md(dnnl_query_weights_md), 0.0f);
        add(DNNL_ARG_DIFF_SRC, slot::out, src_plain, md(dnnl_query_diff_src_md), 0.0f);
        break;
      case onednn_conv_pass::backward_weights:
        add(DNNL_ARG_SRC, slot::a, src_plain, md(dnnl_query_src_md), 0.0f);
        add(DNNL_ARG_DIFF_DST, slot::b, dst_plain, md(dnnl_query_diff_dst_md), 0.0f);
        add(DNNL_ARG_DIFF_WEIGHTS, slot::out, weight_plain, md(dnnl_query_diff_weights_md), key.beta);
        if (key.bias) add(DNNL_ARG_DIFF_BIAS, slot::out2, bias_plain, dbias_f32, key.bias_beta);
        break;
    }
    const dnnl_memory_desc_t scratch_md = md(dnnl_query_scratchpad_md);
    const std::size_t scratch_bytes = dnnl_memory_desc_get_size(&scratch_md);
    if (scratch_bytes > 0) {
      scratchpad_ = onednn_memory(scratch_md);
      scratchpad_offset_ = reserve(scratch_bytes);
    }
    dnnl_primitive_t prim = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_create(&prim, pd), "generating the code of a convolution (", implementation_,
                          ")");
    primitive_.reset(prim);
    stream_ = onednn_new_stream();
    warm_up();
    onednn_wait_at_exit();
  }

  onednn_convolution(const onednn_convolution&) = delete;
  onednn_convolution& operator=(const onednn_convolution&) = delete;
  ~onednn_convolution() {
    const std::lock_guard lock(onednn_lifetime_mutex());
    primitive_.reset();
    stream_.reset();
    args_.clear();
    scratchpad_.reset();
  }

  /// oneDNN's name of the kernel ("jit:avx512_core", ...), or "none" when oneDNN has none for the key.
  [[nodiscard]] const std::string& implementation() const noexcept { return implementation_; }
  /// Whether it runs: a kernel exists and is not oneDNN's reference loop.
  [[nodiscard]] bool usable() const noexcept { return primitive_ != nullptr; }
  /// Bytes of workspace a run needs (the blocked copies and the scratchpad), 64-byte aligned.
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }

  /// Whether the pass copies its tensor `from` into another layout (else the primitive reads or writes it plain).
  [[nodiscard]] bool reorders(slot from) const noexcept {
    const argument* x = find(from);
    return x != nullptr && x->reorder != nullptr;
  }
  /// Where a run with `workspace` leaves its copy of input `from` in the primitive's layout, or null when the
  /// primitive reads the plain tensor.
  [[nodiscard]] const std::byte* copy_of(slot from, const std::byte* workspace) const {
    return reorders(from) ? workspace + find(from)->offset : nullptr;
  }
  /// Whether this pass reads its input `mine` in the layout in which `other` copies its input `theirs` (both
  /// reordered, the same memory descriptor): given the same plain tensor, other's copy can stand in for this one's.
  [[nodiscard]] bool reads_like(slot mine, const onednn_convolution& other, slot theirs) const {
    const argument* x = find(mine);
    const argument* y = other.find(theirs);
    if (!reorders(mine) || !other.reorders(theirs) || !x->input() || !y->input()) return false;
    const dnnl_memory_desc_t* mx = nullptr;
    const dnnl_memory_desc_t* my = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_get_memory_desc(x->inner.get(), &mx), "describing a copy");
    LOCKSTEP_ONEDNN_CHECK(dnnl_memory_get_memory_desc(y->inner.get(), &my), "describing a copy");
    return dnnl_memory_desc_equal(mx, my) != 0;
  }

  /// Runs the pass on the calling thread (a stream's worker), with the plain tensors of the class comment and
  /// `workspace` of workspace_bytes(), 64-byte aligned.
  /// `given`: copies, made by a pass that ran before, of inputs this pass reads in their layouts (reads_like);
  /// those are not reordered again.
  void run(const void* a, const void* b, const void* c, void* out, void* out2, std::byte* workspace,
           const given_copies& given = {}) const {
    onednn_one_thread_here();
    execute(a, b, c, out, out2, workspace, given);
    if (!ran_.exchange(true, std::memory_order_relaxed)) onednn_wait_at_exit();
  }

 private:
  // The pass on the calling thread.
  void execute(const void* a, const void* b, const void* c, void* out, void* out2, std::byte* workspace,
               const given_copies& given) const {
    const std::array<void*, max_arguments> plain{const_cast<void*>(a), const_cast<void*>(b), const_cast<void*>(c), out,
                                                 out2};
    // (an array, not a vector: nvcc 12's front end crashes on push_back({...}) of this C struct)
    std::array<dnnl_exec_arg_t, max_arguments + 1> args{};
    int count = 0;
    for (const argument& x : args_) {
      void* user = plain[static_cast<std::size_t>(x.from)];
      if (!x.reorder) {  // the primitive reads or writes the plain tensor itself
        LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(x.inner.get(), user), "binding a tensor");
      } else if (const std::byte* copy = given[static_cast<std::size_t>(x.from)]; copy && x.input()) {
        // (read only: the pass that made it has zeroed its blocked layout's padding, which binding may write again)
        LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(x.inner.get(), const_cast<std::byte*>(copy)),
                              "binding a given copy");
      } else {
        LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(x.inner.get(), workspace + x.offset), "binding a copy");
        LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(x.plain.get(), user), "binding a tensor");
        if (x.input()) run_reorder(x, x.plain.get(), x.inner.get());
      }
      args[static_cast<std::size_t>(count)].arg = x.arg;
      args[static_cast<std::size_t>(count++)].memory = x.inner.get();
    }
    if (scratchpad_) {
      LOCKSTEP_ONEDNN_CHECK(dnnl_memory_set_data_handle(scratchpad_.get(), workspace + scratchpad_offset_),
                            "binding the scratchpad");
      args[static_cast<std::size_t>(count)].arg = DNNL_ARG_SCRATCHPAD;
      args[static_cast<std::size_t>(count++)].memory = scratchpad_.get();
    }
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_execute(primitive_.get(), stream_.get(), count, args.data()),
                          "running a oneDNN convolution (", implementation_, ")");
    for (const argument& x : args_) {
      if (x.reorder && !x.input()) run_reorder(x, x.inner.get(), x.plain.get());
    }
    LOCKSTEP_ONEDNN_CHECK(dnnl_stream_wait(stream_.get()), "waiting for a oneDNN convolution");
  }

  // A first run on zeros, on the creating thread, for the reason onednn_matmul has one (onednn.hpp): the global
  // state oneDNN makes at a primitive's first run then outlives the wait at exit. It takes, for its duration, heap
  // memory of the pass's plain tensors and workspace (outside the device's accounting), once per primitive made.
  void warm_up() const {
    std::array<std::vector<std::byte>, max_arguments> plain;
    for (std::size_t i = 0; i < plain.size(); ++i) plain[i].resize(plain_bytes_[i]);
    std::vector<std::byte> workspace(workspace_bytes_ + 63);
    const auto address = reinterpret_cast<std::uintptr_t>(workspace.data());
    execute(plain[0].data(), plain[1].data(), plain[2].data(), plain[3].data(), plain[4].data(),
            workspace.data() + ((64 - address % 64) % 64), {});
  }

  mutable std::atomic<bool> ran_{false};  // run() ran once
  std::array<std::size_t, max_arguments> plain_bytes_{};  // of run()'s tensors, by slot
  struct argument {
    int arg = 0;
    slot from = slot::a;
    onednn_memory_owner inner;  // what the primitive reads or writes
    onednn_memory_owner plain;  // the user's tensor, when a reorder is needed
    onednn_primitive_owner reorder;
    std::size_t offset = 0;  // of the copy in the workspace
    /// Read by the primitive (reordered before the run), not written (reordered after it).
    [[nodiscard]] bool input() const noexcept { return from != slot::out && from != slot::out2; }
  };

  /// Records the outcome of creating a primitive descriptor: false (implementation "none") when oneDNN has no
  /// kernel for the key; throws on any other failure.
  bool made(dnnl_status_t status, const onednn_conv_key& key) {
    if (status == dnnl_unimplemented) {
      implementation_ = "none";
      return false;
    }
    LOCKSTEP_ONEDNN_CHECK(status, "creating a ", name_of(key.type), " convolution (", key.n, " x ", key.c, " x ", key.h,
                          " x ", key.w, " to ", key.oc, " channels, kernel ", key.k, ")");
    return true;
  }

  /// Room for `bytes` in the workspace; returns its offset.
  std::size_t reserve(std::size_t bytes) {
    const std::size_t at = workspace_bytes_;
    workspace_bytes_ += (bytes + 63) / 64 * 64;
    return at;
  }

  /// An argument of the primitive: the plain tensor bound directly when its layout is the primitive's and nothing
  /// is accumulated, else a copy in the workspace with a reorder from the plain tensor (inputs, before the run) or
  /// into it (outputs, after the run; adding beta times what it held when beta is not 0).
  void add(int arg, slot from, const dnnl_memory_desc_t& plain, const dnnl_memory_desc_t& inner, float beta) {
    argument x;
    x.arg = arg;
    x.from = from;
    plain_bytes_[static_cast<std::size_t>(from)] = dnnl_memory_desc_get_size(&plain);
    x.inner = onednn_memory(inner);
    if (dnnl_memory_desc_equal(&plain, &inner) != 0 && beta == 0.0f) {
      args_.push_back(std::move(x));
      return;
    }
    x.plain = onednn_memory(plain);
    x.offset = reserve(dnnl_memory_desc_get_size(&inner));
    const onednn_attr_owner attr = onednn_attributes(false, beta);
    const dnnl_memory_desc_t& from_md = x.input() ? plain : inner;
    const dnnl_memory_desc_t& to_md = x.input() ? inner : plain;
    dnnl_primitive_desc_t pd = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_reorder_primitive_desc_create(&pd, &from_md, onednn_engine(), &to_md, onednn_engine(),
                                                             attr.get()),
                          "creating a reorder for a convolution");
    const onednn_pd_owner owner(pd, &dnnl_primitive_desc_destroy);
    dnnl_primitive_t prim = nullptr;
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_create(&prim, pd), "generating the code of a reorder");
    x.reorder.reset(prim);
    args_.push_back(std::move(x));
  }

  [[nodiscard]] const argument* find(slot from) const noexcept {
    for (const argument& x : args_) {
      if (x.from == from) return &x;
    }
    return nullptr;
  }

  void run_reorder(const argument& x, dnnl_memory_t from, dnnl_memory_t to) const {
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
    LOCKSTEP_ONEDNN_CHECK(dnnl_primitive_execute(x.reorder.get(), stream_.get(), 2, args),
                          "reordering a convolution's tensor");
  }

  onednn_primitive_owner primitive_;
  onednn_stream_owner stream_{nullptr, &dnnl_stream_destroy};
  std::vector<argument> args_;
  onednn_memory_owner scratchpad_;
  std::size_t scratchpad_offset_ = 0;
  std::size_t workspace_bytes_ = 0;
  std::string implementation_;
};

using onednn_convolutions = onednn_cache<onednn_conv_key, onednn_conv_key_hash, onednn_convolution>;

LOCKSTEP_DETAIL_END

#endif  // LOCKSTEP_HAS_ONEDNN
