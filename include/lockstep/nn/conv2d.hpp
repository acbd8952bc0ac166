// lockstep/nn/conv2d.hpp — 2-D convolution over NCHW images (PyTorch's nn.Conv2d with square kernels, one stride
// and one padding, no dilation or groups).
#pragma once

#include <cmath>
#include <cstdint>

#include "lockstep/blas/convolution.hpp"
#include "lockstep/blas/gemm.hpp"
#include "lockstep/config.hpp"
#include "lockstep/kernels/activation.hpp"
#include "lockstep/kernels/conv.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/deterministic.hpp"
#include "lockstep/nn/init.hpp"
#include "lockstep/nn/layer.hpp"
#include "lockstep/nn/linear.hpp"

LOCKSTEP_ABI_BEGIN

/// What a conv2d is built with besides its channels and kernel size (PyTorch's defaults).
struct conv2d_options {
  std::int64_t stride = 1;
  std::int64_t padding = 0;  ///< zeros on every side
  bool bias = true;          ///< a learned "bias" per output channel
};

/// The output of a window of `kernel` with `stride` and `padding` over `size` input pixels (PyTorch's formula).
[[nodiscard]] constexpr std::int64_t window_output_size(std::int64_t size, std::int64_t kernel, std::int64_t stride,
                                                        std::int64_t padding) noexcept {
  return (size + 2 * padding - kernel) / stride + 1;
}

/// y[n, oc] = bias[oc] + the sum over input channels ic and kernel offsets of weight[oc, ic, i, j] * x[n, ic, y *
/// stride - padding + i, x * stride - padding + j]; weight [out, in, k, k], bias [out], initialized as PyTorch's
/// (U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in * k * k), named "weight" and "bias".
///
/// How it runs: on a host device whose GEMMs run on oneDNN (f32, bf16), outside deterministic mode, as oneDNN's
/// convolutions (blas/convolution.hpp; their workspace, in the handle's scratch memory, is the pass's tensors in
/// oneDNN's layouts, or only oneDNN's scratchpad where a pass runs on the plain tensors). Otherwise: im2col, then
/// one GEMM over the whole batch (kernels/conv.hpp): the input as rows of patches col [N * OH * OW, in * k * k]
/// times the weight transposed; backward, the weight gradient is the output gradient in rows (transposed) times
/// col, and the input gradient the output gradient times the weight, added back from patches into pixels by a
/// gather (no atomics). Workspace: col (N * OH * OW * in * k * k values of the compute type, reused
/// for the patches' gradient) and the output in rows (N * OH * OW * out), both grown to the largest batch seen.
///
/// Deterministic mode follows nn/deterministic.hpp: outputs and input gradients are per-row products (each output
/// pixel's bits its own), the parameters' gradients exact sums of per-chunk partials over the chunks' images.
class conv2d {
 public:
  /// A layer on ctx's device. Throws precondition_error for non-positive channels or kernel size, a stride below
  /// 1 or a negative padding.
  conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size, context& ctx,
         initializer& init, conv2d_options o = {})
      : in_(in_channels), out_(out_channels), k_(kernel_size), options_(o) {
    LOCKSTEP_EXPECTS(in_channels > 0 && out_channels > 0 && kernel_size > 0, "conv2d(", in_channels, ", ",
                     out_channels, ", ", kernel_size, "): channels and kernel size must be positive");
    LOCKSTEP_EXPECTS(o.stride >= 1 && o.padding >= 0, "conv2d: stride must be >= 1 and padding >= 0, got stride ",
                     o.stride, ", padding ", o.padding);
    weight_ = parameter("weight", shape{out_, in_, k_, k_}, ctx.stream(), ctx.compute_type());
    const float bound = 1.0f / std::sqrt(static_cast<float>(patch()));
    init.uniform(weight_, bound, ctx.stream());
    if (o.bias) {
      bias_ = parameter("bias", shape{out_}, ctx.stream(), ctx.compute_type());
      init.uniform(bias_, bound, ctx.stream());
    }
  }

  [[nodiscard]] parameter& weight() noexcept { return weight_; }
  [[nodiscard]] parameter& bias_parameter() noexcept { return bias_; }
  [[nodiscard]] const conv2d_options& options() const noexcept { return options_; }

  tensor_view forward(const tensor_view& x, context& ctx) {
    check_input(x, ctx);
    x_ = x;
    forwarded_ = true;
    g_ = geometry_of(x.dims());
    const std::int64_t n = x.dims()[0], rows = n * pixels();
    const stream_ref s = ctx.stream();
    y_.ensure(shape{n, out_, static_cast<std::int64_t>(g_.oh), static_cast<std::int64_t>(g_.ow)}, x.type(), s);
    onednn_ = false;
    if (rows == 0) return y_.view();
    dispatch_floating(x.type(), "conv2d", [&]<class T>() {
      const T* w = weight_.compute_value().as<T>();
#if LOCKSTEP_HAS_ONEDNN
      // a host device whose GEMMs run on oneDNN: its convolution, outside deterministic mode (blas/convolution.hpp)
      if (!ctx.deterministic()) {
        if (auto conv = detail::host_convolution(ctx.blas(), onednn_key(detail::onednn_conv_pass::forward, x.type()))) {
          detail::queue_host_convolution<T>(
              ctx.blas(), conv, {x.as<T>(), w, has_bias() ? bias_.compute_value().as<T>() : nullptr, y_.as<T>(), nullptr});
          onednn_ = true;
          return;
        }
      }
#endif
      make_patches<T>(x, rows, s);
      if (ctx.deterministic()) {
        row_products<T>(ctx, "conv2d", transpose::yes, rows, out_, patch(), col_.as<T>(), patch(), w, patch(),
                        rows_.as<T>(), out_, scratch_, pixels());
      } else {
        gemm<T>(ctx.blas(), transpose::no, transpose::yes, rows, out_, patch(), 1.0f, col_.as<T>(), patch(), w,
                patch(), 0.0f, rows_.as<T>(), out_);
      }
      launch_2d(static_cast<std::size_t>(n * out_), g_.pixels(),
                kernels::rows_to_nchw_op<T>{rows_.as<T>(), has_bias() ? bias_.compute_value().as<T>() : nullptr,
                                            y_.as<T>(), static_cast<std::size_t>(out_), g_.pixels()},
                s, "conv2d output");
    });
    return y_.view();
  }

  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    LOCKSTEP_EXPECTS(forwarded_, "conv2d::backward without a forward");
    LOCKSTEP_EXPECTS(gy.dims() == y_.dims() && gy.type() == x_.type(), "conv2d::backward: gradient of shape ",
                     gy.dims().str(), " (", name_of(gy.type()), ") for an output of shape ", y_.dims().str(), " (",
                     name_of(x_.type()), ")");
    const std::int64_t n = gy.dims()[0], rows = n * pixels();
    const stream_ref s = ctx.stream();
    if (need == input_grad::required) gx_.ensure(x_.dims(), x_.type(), s);
    dispatch_floating(gy.type(), "conv2d", [&]<class T>() {
#if LOCKSTEP_HAS_ONEDNN
      if (onednn_ && backward_onednn<T>(gy, ctx, need)) return;
#endif
      if (onednn_) make_patches<T>(x_, rows, s);  // the forward ran on oneDNN and backward cannot: the GEMMs' patches
      // the output gradient in rows, where the forward's output rows were
      T* gt = rows == 0 ? nullptr : rows_.as<T>();
      if (rows > 0) {
        launch_2d(static_cast<std::size_t>(rows), static_cast<std::size_t>(out_),
                  kernels::nchw_to_rows_op<T>{gy.as<T>(), gt, static_cast<std::size_t>(out_), g_.pixels()}, s,
                  "conv2d output gradient");
      }
      const T* col = rows == 0 ? nullptr : col_.as<T>();
      if (ctx.deterministic()) {
        exact_.accumulate_products<T>(weight_, n, ctx, gt, out_, col, patch(), pixels());  // dW = G^T col
        if (has_bias()) {
          exact_.accumulate<T>(bias_, n, ctx, [&](std::int64_t b, std::int64_t r, T* db) {
            launch_columns(static_cast<std::size_t>(r * pixels()), static_cast<std::size_t>(out_),
                           kernels::column_sum_op<T>{gt + b * pixels() * out_, db,
                                                     static_cast<std::size_t>(r * pixels()),
                                                     static_cast<std::size_t>(out_), 0.0f},
                           s, "conv2d bias gradient");
          });
        }
      } else {
        const float wbeta = weight_.begin_accumulate();
        gemm<T>(ctx.blas(), transpose::yes, transpose::no, out_, patch(), rows, 1.0f, gt, out_, col, patch(), wbeta,
                weight_.grad().as<T>(), patch());
        if (has_bias()) {
          const float bbeta = bias_.begin_accumulate();
          launch_columns(static_cast<std::size_t>(rows), static_cast<std::size_t>(out_),
                         kernels::column_sum_op<T>{gt, bias_.grad().as<T>(), static_cast<std::size_t>(rows),
                                                   static_cast<std::size_t>(out_), bbeta},
                         s, "conv2d bias gradient");
        }
      }
      if (need == input_grad::not_required || rows == 0) return;
      // the patches' gradient, into col (read above, in stream order), then added back into pixels
      const T* w = weight_.compute_value().as<T>();
      if (ctx.deterministic()) {
        row_products<T>(ctx, "conv2d", transpose::no, rows, patch(), out_, gt, out_, w, patch(), col_.as<T>(),
                        patch(), scratch_, pixels());
      } else {
        gemm<T>(ctx.blas(), transpose::no, transpose::no, rows, patch(), out_, 1.0f, gt, out_, w, patch(), 0.0f,
                col_.as<T>(), patch());
      }
      launch_2d(static_cast<std::size_t>(n * in_), g_.h * g_.w, kernels::col2im_op<T>{col_.as<T>(), gx_.as<T>(), g_},
                s, "conv2d input gradient");
    });
    return need == input_grad::required ? gx_.view() : tensor_view();
  }

  void parameters(parameter_list& out) {
    out.add(weight_);
    if (has_bias()) out.add(bias_);
  }

  [[nodiscard]] conv2d clone(context& ctx) const {
    conv2d c(in_, out_, k_, options_);
    c.weight_ = weight_.clone(ctx.stream());
    if (has_bias()) c.bias_ = bias_.clone(ctx.stream());
    return c;
  }

  [[nodiscard]] shape output_shape(const shape& sample) const {
    LOCKSTEP_EXPECTS(sample.rank() == 3 && sample[0] == in_, name(), " expects samples of shape [", in_,
                     ", height, width], got ", sample.str());
    const std::int64_t oh = window_output_size(sample[1], k_, options_.stride, options_.padding);
    const std::int64_t ow = window_output_size(sample[2], k_, options_.stride, options_.padding);
    LOCKSTEP_EXPECTS(sample[1] + 2 * options_.padding >= k_ && sample[2] + 2 * options_.padding >= k_, name(),
                     ": images of ", sample[1], "x", sample[2], " with padding ", options_.padding,
                     " are smaller than the kernel");
    return shape{out_, oh, ow};
  }

 private:
  conv2d(std::int64_t in, std::int64_t out, std::int64_t k, conv2d_options o) : in_(in), out_(out), k_(k), options_(o) {}

  [[nodiscard]] std::int64_t patch() const noexcept { return in_ * k_ * k_; }
  [[nodiscard]] std::int64_t pixels() const noexcept { return static_cast<std::int64_t>(g_.pixels()); }
  [[nodiscard]] bool has_bias() const noexcept { return options_.bias; }
  [[nodiscard]] std::string name() const {
    return detail::concat("conv2d(", in_, ", ", out_, ", ", k_, ", stride ", options_.stride, ", padding ",
                          options_.padding, ")");
  }

#if LOCKSTEP_HAS_ONEDNN
  /// The oneDNN convolution pass of the last forward's shape.
  [[nodiscard]] detail::onednn_conv_key onednn_key(detail::onednn_conv_pass pass, dtype type, float beta = 0.0f,
                                                   float bias_beta = 0.0f) const {
    auto i = [](std::size_t v) { return static_cast<std::int64_t>(v); };
    return {i(g_.n), in_, i(g_.h), i(g_.w), out_, k_, options_.stride, options_.padding, type, has_bias(), pass, beta,
            bias_beta};
  }

  /// Backward as oneDNN's backward weights (and backward data when the input gradient is required) after a
  /// forward on oneDNN; false, queuing nothing and leaving the gradients' accumulation state alone, when oneDNN
  /// has no kernel for one of them.
  template <class T>
  bool backward_onednn(const tensor_view& gy, context& ctx, input_grad need) {
    using detail::onednn_conv_pass;
    blas_handle& h = ctx.blas();
    const dtype t = dtype_of_v<T>;
    std::shared_ptr<const detail::onednn_convolution> data;
    if (need == input_grad::required) {
      data = detail::host_convolution(h, onednn_key(onednn_conv_pass::backward_data, t));
      if (!data) return false;
    }
    // the gradients are overwritten (beta 0) or added to (1), as begin_accumulate() will say
    const float wbeta = weight_.grad_is_zero() ? 0.0f : 1.0f;
    const float bbeta = has_bias() && !bias_.grad_is_zero() ? 1.0f : 0.0f;
    auto weights = detail::host_convolution(h, onednn_key(onednn_conv_pass::backward_weights, t, wbeta, bbeta));
    if (!weights) return false;
    (void)weight_.begin_accumulate();
    if (has_bias()) (void)bias_.begin_accumulate();
    const detail::host_convolution_tensors<T> w{x_.as<T>(), gy.as<T>(), nullptr, weight_.grad().as<T>(),
                                                has_bias() ? bias_.grad().as<T>() : nullptr};
    if (data) {  // one task: the output gradient reordered once for both passes when they read one layout
      detail::queue_host_convolution_backward<T>(
          h, weights, w, data, {gy.as<T>(), weight_.compute_value().as<T>(), nullptr, gx_.as<T>(), nullptr});
    } else {
      detail::queue_host_convolution<T>(h, weights, w);
    }
    return true;
  }
#endif

  /// col_ = the patches of `x` (im2col), rows_ sized for the output in rows: the GEMM path's operands.
  template <class T>
  void make_patches(const tensor_view& x, std::int64_t rows, stream_ref s) {
    col_.ensure(shape{rows, patch()}, x.type(), s);
    rows_.ensure(shape{rows, out_}, x.type(), s);
    launch_2d(static_cast<std::size_t>(rows), static_cast<std::size_t>(patch()),
              kernels::im2col_op<T>{x.as<T>(), col_.as<T>(), g_}, s, "conv2d im2col");
  }

  [[nodiscard]] kernels::conv_geometry geometry_of(const shape& d) const {
    const shape out = output_shape(shape{d[1], d[2], d[3]});
    auto u = [](std::int64_t v) { return static_cast<std::size_t>(v); };
    return {u(d[0]), u(d[1]), u(d[2]), u(d[3]), u(k_), u(k_), u(options_.stride), u(options_.padding), u(out[1]), u(out[2])};
  }

  void check_input(const tensor_view& x, const context& ctx) const {
    LOCKSTEP_EXPECTS(x.dims().rank() == 4, name(), ": input of shape ", x.dims().str(), " is not [rows, ", in_,
                     ", height, width]");
    (void)output_shape(shape{x.dims()[1], x.dims()[2], x.dims()[3]});
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), "conv2d: input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()),
                     " (cast the input, or load it in that type)");
    LOCKSTEP_EXPECTS(x.get_device() == ctx.get_device(), "conv2d: input on ", x.get_device().str(),
                     " but the layer runs on ", ctx.get_device().str());
    LOCKSTEP_EXPECTS(weight_.get_device() == ctx.get_device(), "conv2d: parameters on ", weight_.get_device().str(),
                     " but the context is on ", ctx.get_device().str());
    LOCKSTEP_EXPECTS(weight_.compute_type() == ctx.compute_type(), "conv2d: parameters are set up for ",
                     name_of(weight_.compute_type()), " but the context computes in ", name_of(ctx.compute_type()));
  }

  std::int64_t in_, out_, k_;
  conv2d_options options_;
  parameter weight_;
  parameter bias_;
  kernels::conv_geometry g_{};
  tensor_view x_;
  tensor y_;
  tensor gx_;
  tensor col_;      // [N * P, in * k * k]: the patches, then their gradient
  tensor rows_;     // [N * P, out]: the output in rows, then its gradient
  tensor scratch_;  // deterministic mode on a host device: row_products' packed operands
  exact_gradient exact_;
  bool forwarded_ = false;
  bool onednn_ = false;  // the last forward ran as a oneDNN convolution (blas/convolution.hpp), without col_ and rows_
};
static_assert(layer<conv2d>);

LOCKSTEP_ABI_END
