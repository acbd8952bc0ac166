// lockstep/nn/pool.hpp — pooling over NCHW images: max_pool2d, avg_pool2d (PyTorch's nn.MaxPool2d and nn.AvgPool2d
// with square windows, count_include_pad) and global_avg_pool2d (nn.AdaptiveAvgPool2d(1)).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "lockstep/config.hpp"
#include "lockstep/kernels/conv.hpp"
#include "lockstep/kernels/launch.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/conv2d.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

/// Which pooling a pool2d layer does.
enum class pooling : std::uint8_t { max, average };

/// Max or average pooling of `kernel` x `kernel` windows every `stride` pixels (default: the kernel) with `padding`
/// (at most half the kernel, as PyTorch requires). Max pooling keeps each window's first maximum (a NaN wins) and
/// sends its gradient there; average pooling divides by the whole window, padding included. Both backward passes
/// sum what the windows over each input pixel send back in a fixed order (on a GPU a gather; max pooling on a host
/// stream a scatter to the maxima, window by window): no atomics, the same bits every run, and nothing summed over
/// rows, so deterministic mode needs nothing more.
template <pooling Kind>
class pool2d {
 public:
  /// Throws precondition_error for a kernel below 1, a negative stride or padding, or a padding above half the
  /// kernel.
  explicit pool2d(std::int64_t kernel, std::int64_t stride = 0, std::int64_t padding = 0)
      : k_(kernel), stride_(stride == 0 ? kernel : stride), padding_(padding) {
    LOCKSTEP_EXPECTS(kernel >= 1 && stride >= 0 && padding >= 0 && 2 * padding <= kernel, name(),
                     ": the kernel must be >= 1, the stride >= 0 (0: the kernel) and the padding in [0, kernel / 2]");
  }

  tensor_view forward(const tensor_view& x, context& ctx) {
    LOCKSTEP_EXPECTS(x.dims().rank() == 4, name(), ": input of shape ", x.dims().str(),
                     " is not [rows, channels, height, width]");
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), name(), ": input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()),
                     " (cast the input, or load it in that type)");
    const shape& d = x.dims();
    const shape out = output_shape(shape{d[1], d[2], d[3]});
    g_ = {static_cast<std::size_t>(d[0]), static_cast<std::size_t>(d[1]), static_cast<std::size_t>(d[2]),
          static_cast<std::size_t>(d[3]), static_cast<std::size_t>(k_), static_cast<std::size_t>(k_),
          static_cast<std::size_t>(stride_), static_cast<std::size_t>(padding_), static_cast<std::size_t>(out[1]),
          static_cast<std::size_t>(out[2])};
    in_ = d;
    forwarded_ = true;
    const stream_ref s = ctx.stream();
    y_.ensure(shape{d[0], d[1], out[1], out[2]}, x.type(), s);
    if constexpr (Kind == pooling::max) argmax_.ensure(y_.dims(), dtype::i32, s);
    dispatch_floating(x.type(), "pool2d", [&]<class T>() {
      if constexpr (Kind == pooling::max) {
        launch_2d(g_.n * g_.c, g_.pixels(), kernels::max_pool_forward_op<T>{x.as<T>(), y_.as<T>(), argmax_.as<std::int32_t>(), g_},
                  s, "max_pool2d forward");
      } else {
        launch_2d(g_.n * g_.c, g_.pixels(), kernels::avg_pool_forward_op<T>{x.as<T>(), y_.as<T>(), g_}, s,
                  "avg_pool2d forward");
      }
    });
    return y_.view();
  }

  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    LOCKSTEP_EXPECTS(forwarded_, name(), "::backward without a forward");
    LOCKSTEP_EXPECTS(gy.dims() == y_.dims() && gy.type() == y_.type(), name(), "::backward: gradient of shape ",
                     gy.dims().str(), " for an output of shape ", y_.dims().str());
    if (need == input_grad::not_required) return {};
    const stream_ref s = ctx.stream();
    gx_.ensure(in_, gy.type(), s);
    dispatch_floating(gy.type(), "pool2d", [&]<class T>() {
      if constexpr (Kind == pooling::max) {
        launch_2d(g_.n * g_.c, g_.h * g_.w,
                  kernels::max_pool_backward_op<T>{gy.as<T>(), argmax_.as<std::int32_t>(), gx_.as<T>(), g_}, s,
                  "max_pool2d backward");
      } else {
        launch_2d(g_.n * g_.c, g_.h * g_.w, kernels::avg_pool_backward_op<T>{gy.as<T>(), gx_.as<T>(), g_}, s,
                  "avg_pool2d backward");
      }
    });
    return gx_.view();
  }

  void parameters(parameter_list&) {}
  [[nodiscard]] pool2d clone(context&) const { return pool2d(k_, stride_, padding_); }

  [[nodiscard]] shape output_shape(const shape& sample) const {
    LOCKSTEP_EXPECTS(sample.rank() == 3, name(), " expects samples of shape [channels, height, width], got ",
                     sample.str());
    LOCKSTEP_EXPECTS(sample[1] + 2 * padding_ >= k_ && sample[2] + 2 * padding_ >= k_, name(), ": images of ",
                     sample[1], "x", sample[2], " are smaller than the window");
    if constexpr (Kind == pooling::max) {
      constexpr std::int64_t most = std::numeric_limits<std::int32_t>::max();
      LOCKSTEP_EXPECTS(sample[2] == 0 || sample[1] <= most / sample[2], name(), ": images of ", sample[1], "x",
                       sample[2], " pixels; max pooling records each window's maximum as a 32-bit pixel index, so an "
                       "image may have at most 2^31 - 1 pixels (split the image into tiles)");
    }
    return shape{sample[0], window_output_size(sample[1], k_, stride_, padding_),
                 window_output_size(sample[2], k_, stride_, padding_)};
  }

 private:
  [[nodiscard]] std::string name() const {
    return detail::concat(Kind == pooling::max ? "max_pool2d(" : "avg_pool2d(", k_, ", stride ", stride_, ", padding ",
                          padding_, ")");
  }

  std::int64_t k_, stride_, padding_;
  kernels::conv_geometry g_{};
  shape in_;
  tensor y_;
  tensor gx_;
  tensor argmax_;  // max pooling: each output's input pixel (y * W + x)
  bool forwarded_ = false;
};

using max_pool2d = pool2d<pooling::max>;
using avg_pool2d = pool2d<pooling::average>;
static_assert(layer<max_pool2d> && layer<avg_pool2d>);

/// The mean of each channel's image: [N, C, H, W] to [N, C, 1, 1] (PyTorch's nn.AdaptiveAvgPool2d(1); follow it
/// with flatten for [N, C]). Average pooling with the whole image as its window.
class global_avg_pool2d {
 public:
  tensor_view forward(const tensor_view& x, context& ctx) {
    LOCKSTEP_EXPECTS(x.dims().rank() == 4, "global_avg_pool2d: input of shape ", x.dims().str(),
                     " is not [rows, channels, height, width]");
    LOCKSTEP_EXPECTS(x.type() == ctx.compute_type(), "global_avg_pool2d: input is ", name_of(x.type()),
                     " but the context computes in ", name_of(ctx.compute_type()),
                     " (cast the input, or load it in that type)");
    const shape& d = x.dims();
    auto u = [](std::int64_t v) { return static_cast<std::size_t>(v); };
    g_ = {u(d[0]), u(d[1]), u(d[2]), u(d[3]), u(d[2]), u(d[3]), 1, 0, 1, 1};
    in_ = d;
    forwarded_ = true;
    y_.ensure(shape{d[0], d[1], 1, 1}, x.type(), ctx.stream());
    dispatch_floating(x.type(), "global_avg_pool2d", [&]<class T>() {
      launch_2d(g_.n * g_.c, 1, kernels::avg_pool_forward_op<T>{x.as<T>(), y_.as<T>(), g_}, ctx.stream(),
                "global_avg_pool2d forward");
    });
    return y_.view();
  }
  tensor_view backward(const tensor_view& gy, context& ctx, input_grad need) {
    LOCKSTEP_EXPECTS(forwarded_, "global_avg_pool2d::backward without a forward");
    LOCKSTEP_EXPECTS(gy.dims() == y_.dims() && gy.type() == y_.type(), "global_avg_pool2d::backward: gradient of shape ",
                     gy.dims().str(), " for an output of shape ", y_.dims().str());
    if (need == input_grad::not_required) return {};
    gx_.ensure(in_, gy.type(), ctx.stream());
    dispatch_floating(gy.type(), "global_avg_pool2d", [&]<class T>() {
      launch_2d(g_.n * g_.c, g_.h * g_.w, kernels::avg_pool_backward_op<T>{gy.as<T>(), gx_.as<T>(), g_}, ctx.stream(),
                "global_avg_pool2d backward");
    });
    return gx_.view();
  }
  void parameters(parameter_list&) {}
  [[nodiscard]] global_avg_pool2d clone(context&) const { return {}; }
  [[nodiscard]] shape output_shape(const shape& sample) const {
    LOCKSTEP_EXPECTS(sample.rank() == 3, "global_avg_pool2d expects samples of shape [channels, height, width], got ",
                     sample.str());
    return shape{sample[0], 1, 1};
  }

 private:
  kernels::conv_geometry g_{};
  shape in_;
  tensor y_;
  tensor gx_;
  bool forwarded_ = false;
};
static_assert(layer<global_avg_pool2d>);

LOCKSTEP_ABI_END
