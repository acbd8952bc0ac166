// lockstep/kernels/conv.hpp — kernel bodies of 2-D convolution (nn/conv2d.hpp, im2col) and pooling (nn/pool.hpp).
//
// Images are NCHW. A convolution runs as one GEMM over the batch: im2col lays the input out as rows of patches, col
// [N * P, K] (P = OH * OW output pixels per image, K = C * KH * KW), so that the output in rows, yt [N * P, OC], is
// col times the weight [OC, K] transposed; rows_to_nchw puts it (plus the bias) back into [N, OC, OH, OW]. Backward
// goes the other way, and col2im adds each patch gradient back into the input gradient as a gather (every input
// pixel sums the patch elements that read it, in a fixed order): no atomics, the same bits on every run.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/transpose.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// The geometry of a 2-D convolution or pooling window over NCHW images.
struct conv_geometry {
  std::size_t n, c, h, w;       // input
  std::size_t kh, kw;           // window
  std::size_t stride, padding;  // the same in both directions
  std::size_t oh, ow;           // output
  [[nodiscard]] LOCKSTEP_HD std::size_t pixels() const { return oh * ow; }
  [[nodiscard]] LOCKSTEP_HD std::size_t patch() const { return c * kh * kw; }
};

/// f(i, j, index) for each offset (i, j) of output pixel (oy, ox)'s window that falls on the image (not the
/// padding), index = y * W + x in the image plane; window rows, then columns, in order.
template <class F>
LOCKSTEP_HD void for_each_in_window(const conv_geometry& g, std::size_t oy, std::size_t ox, F&& f) {
  for (std::size_t i = 0; i < g.kh; ++i) {
    const std::size_t y = oy * g.stride + i;  // padded coordinates
    if (y < g.padding || y - g.padding >= g.h) continue;
    for (std::size_t j = 0; j < g.kw; ++j) {
      const std::size_t x = ox * g.stride + j;
      if (x < g.padding || x - g.padding >= g.w) continue;
      f(i, j, (y - g.padding) * g.w + (x - g.padding));
    }
  }
}

/// f(i, j, oy, ox) for each output pixel (oy, ox) whose window covers input pixel `pixel` (y * W + x of the image
/// plane), at offset (i, j) of that window; offsets' rows, then columns, in order. The gathers of the backward passes.
template <class F>
LOCKSTEP_HD void for_each_window_over(const conv_geometry& g, std::size_t pixel, F&& f) {
  const std::size_t y = pixel / g.w + g.padding, x = pixel % g.w + g.padding;  // padded coordinates
  for (std::size_t i = 0; i < g.kh; ++i) {
    if (y < i || (y - i) % g.stride != 0) continue;
    const std::size_t oy = (y - i) / g.stride;
    if (oy >= g.oh) continue;
    for (std::size_t j = 0; j < g.kw; ++j) {
      if (x < j || (x - j) % g.stride != 0) continue;
      const std::size_t ox = (x - j) / g.stride;
      if (ox >= g.ow) continue;
      f(i, j, oy, ox);
    }
  }
}

/// col[r, k] = the input value patch element k of output pixel r reads (0 in the padding); r = n * P + p, k = (ic *
/// KH + i) * KW + j. A launch_2d functor over [N * P, K].
template <class T>
struct im2col_op {
  const T* x;
  T* col;
  conv_geometry g;
  LOCKSTEP_HD void operator()(std::size_t r, std::size_t k) const {
    const std::size_t p = r % g.pixels(), n = r / g.pixels();
    const std::size_t oy = p / g.ow, ox = p % g.ow;
    const std::size_t ic = k / (g.kh * g.kw), i = (k / g.kw) % g.kh, j = k % g.kw;
    const std::size_t y = oy * g.stride + i, xx = ox * g.stride + j;  // in padded coordinates
    T v = convert<T>(0.0f);
    if (y >= g.padding && xx >= g.padding && y - g.padding < g.h && xx - g.padding < g.w) {
      v = x[((n * g.c + ic) * g.h + (y - g.padding)) * g.w + (xx - g.padding)];
    }
    col[r * g.patch() + k] = v;
  }
  /// The host loop: the same values, written image by image and pixel by pixel without a division per element;
  /// a window wholly inside the image is copied without a test per row, a window row wholly inside it without a
  /// test per element.
  void for_rows(std::size_t, std::size_t) const {
    if (g.kw == 3) {
      host_loop<3>();
    } else {
      host_loop<0>();
    }
  }
  // KW: the window's width when fixed at compile time (the common 3: twice as fast), 0 for g.kw. The geometry and
  // the pointers in locals: loops that read them through `this` reload them on every element.
  template <std::size_t KW>
  void host_loop() const {
    const std::size_t c = g.c, h = g.h, w = g.w, kh = g.kh, kw = KW != 0 ? KW : g.kw, stride = g.stride;
    const std::size_t pad = g.padding;
    T* out = col;
    const T zero = convert<T>(0.0f);
    for (std::size_t n = 0; n < g.n; ++n) {
      const T* image = x + n * c * h * w;
      for (std::size_t oy = 0; oy < g.oh; ++oy) {
        const std::size_t y0 = oy * stride;  // the window's first row, in padded coordinates
        const bool rows_in = y0 >= pad && y0 - pad + kh <= h;
        for (std::size_t ox = 0; ox < g.ow; ++ox) {
          const std::size_t x0 = ox * stride;  // the window's first column, in padded coordinates
          const bool columns_in = x0 >= pad && x0 - pad + kw <= w;
          if (rows_in && columns_in) {  // the window wholly inside the image (most of them): no test per row
            const T* in = image + (y0 - pad) * w + (x0 - pad);
            for (std::size_t ic = 0; ic < c; ++ic, in += h * w) {
              for (std::size_t i = 0; i < kh; ++i) {
                for (std::size_t j = 0; j < kw; ++j) *out++ = in[i * w + j];
              }
            }
            continue;
          }
          const T* plane = image;
          for (std::size_t ic = 0; ic < c; ++ic, plane += h * w) {
            for (std::size_t i = 0; i < kh; ++i) {
              const std::size_t y = y0 + i;
              if (y < pad || y - pad >= h) {
                for (std::size_t j = 0; j < kw; ++j) *out++ = zero;
              } else if (columns_in) {
                const T* in = plane + (y - pad) * w + (x0 - pad);
                for (std::size_t j = 0; j < kw; ++j) *out++ = in[j];
              } else {
                for (std::size_t j = 0; j < kw; ++j) {
                  const std::size_t xx = x0 + j;
                  *out++ = xx >= pad && xx - pad < w ? plane[(y - pad) * w + (xx - pad)] : zero;
                }
              }
            }
          }
        }
      }
    }
  }
};

/// dx[n, ic, y, x] = the sum of dcol[r, k] over the patch elements (r, k) that read input pixel (y, x) of channel ic
/// of image n, kernel rows and columns in order. A launch_2d functor over [N * C, H * W].
template <class T>
struct col2im_op {
  const T* dcol;
  T* dx;
  conv_geometry g;
  LOCKSTEP_HD void operator()(std::size_t row, std::size_t pixel) const {
    const std::size_t n = row / g.c, ic = row % g.c;
    float acc = 0.0f;
    for_each_window_over(g, pixel, [&](std::size_t i, std::size_t j, std::size_t oy, std::size_t ox) {
      const std::size_t r = n * g.pixels() + oy * g.ow + ox, k = (ic * g.kh + i) * g.kw + j;
      acc += to_float(dcol[r * g.patch() + k]);
    });
    dx[row * g.h * g.w + pixel] = convert<T>(acc);
  }
  /// The host loop: the patches added into the pixels in patch order, in f32 (one image's planes at a time), then
  /// rounded once: a fixed order (the same bits every run), without a division per element.
  void for_rows(std::size_t, std::size_t) const {
    if (g.kw == 3) {
      host_loop<3>();
    } else {
      host_loop<0>();
    }
  }
  template <std::size_t KW>  // as in im2col_op
  void host_loop() const {
    const std::size_t c = g.c, h = g.h, w = g.w, kh = g.kh, kw = KW != 0 ? KW : g.kw, stride = g.stride;
    const std::size_t pad = g.padding, plane = h * w;
    std::vector<float> buffer(c * plane);
    float* acc = buffer.data();
    for (std::size_t n = 0; n < g.n; ++n) {
      for (std::size_t e = 0; e < c * plane; ++e) acc[e] = 0.0f;
      const T* in = dcol + n * g.pixels() * g.patch();
      for (std::size_t oy = 0; oy < g.oh; ++oy) {
        for (std::size_t ox = 0; ox < g.ow; ++ox) {
          const std::size_t x0 = ox * stride;  // as in im2col_op::host_loop
          const bool columns_in = x0 >= pad && x0 - pad + kw <= w;
          float* a = acc;
          for (std::size_t ic = 0; ic < c; ++ic, a += plane) {
            for (std::size_t i = 0; i < kh; ++i, in += kw) {
              const std::size_t y = oy * stride + i;
              if (y < pad || y - pad >= h) continue;
              float* row = a + (y - pad) * w;
              if (columns_in) {
                for (std::size_t j = 0; j < kw; ++j) row[x0 - pad + j] += to_float(in[j]);
              } else {
                for (std::size_t j = 0; j < kw; ++j) {
                  const std::size_t xx = x0 + j;
                  if (xx >= pad && xx - pad < w) row[xx - pad] += to_float(in[j]);
                }
              }
            }
          }
        }
      }
      T* out = dx + n * c * plane;
      for (std::size_t e = 0; e < c * plane; ++e) out[e] = convert<T>(acc[e]);
    }
  }
};

/// The host transposes' walk between rows ([image][pixel][channel]) and planes ([image][channel][pixel]): image by
/// image, in tiles of 16 pixels, channel by channel, f(image, channel, first pixel, end pixel) for each tile, so
/// that both sides of a tile stay in the cache (rows_to_nchw_op, nchw_to_rows_op).
template <class F>
void for_each_pixel_tile(std::size_t images, std::size_t channels, std::size_t pixels, const F& f) {
  constexpr std::size_t tile = 16;
  for (std::size_t n = 0; n < images; ++n) {
    for (std::size_t p0 = 0; p0 < pixels; p0 += tile) {
      const std::size_t p1 = p0 + tile < pixels ? p0 + tile : pixels;
      for (std::size_t c = 0; c < channels; ++c) f(n, c, p0, p1);
    }
  }
}

/// y[n, oc, p] = yt[n * P + p, oc] + bias[oc] (bias null: none). A launch_2d functor over [N * OC, P].
template <class T>
struct rows_to_nchw_op {
  const T* yt;
  const T* bias;
  T* y;
  std::size_t channels, pixels;
  LOCKSTEP_HD void operator()(std::size_t row, std::size_t p) const {
    const std::size_t n = row / channels, oc = row % channels;
    const T v = yt[(n * pixels + p) * channels + oc];
    y[row * pixels + p] = bias != nullptr ? convert<T>(to_float(v) + to_float(bias[oc])) : v;
  }
  /// The host loop: floats image by image through detail::transpose_floats (8 x 8 blocks in AVX2 registers, 3x
  /// faster), the bias added to each plane after; other types in tiles of pixels (for_each_pixel_tile).
  void for_rows(std::size_t rows, std::size_t) const {
    if constexpr (std::is_same_v<T, float>) {
      for (std::size_t n = 0; n < rows / channels; ++n) {
        float* out = y + n * channels * pixels;
        detail::transpose_floats(yt + n * pixels * channels, pixels, channels, out);
        if (bias == nullptr) continue;
        for (std::size_t oc = 0; oc < channels; ++oc, out += pixels) {
          const float b = bias[oc];
          for (std::size_t p = 0; p < pixels; ++p) out[p] += b;
        }
      }
    } else {
      for_each_pixel_tile(rows / channels, channels, pixels, [&](std::size_t n, std::size_t oc, std::size_t p0,
                                                                  std::size_t p1) {
        const T* in = yt + n * pixels * channels;
        T* o = y + (n * channels + oc) * pixels;
        if (bias != nullptr) {
          const float b = to_float(bias[oc]);
          for (std::size_t p = p0; p < p1; ++p) o[p] = convert<T>(to_float(in[p * channels + oc]) + b);
        } else {
          for (std::size_t p = p0; p < p1; ++p) o[p] = in[p * channels + oc];
        }
      });
    }
  }
};

/// gt[n * P + p, oc] = g[n, oc, p]: the output gradient in rows. A launch_2d functor over [N * P, OC].
template <class T>
struct nchw_to_rows_op {
  const T* g;
  T* gt;
  std::size_t channels, pixels;
  LOCKSTEP_HD void operator()(std::size_t r, std::size_t oc) const {
    const std::size_t n = r / pixels, p = r % pixels;
    gt[r * channels + oc] = g[(n * channels + oc) * pixels + p];
  }
  /// The host loop: floats image by image through detail::transpose_floats, other types in tiles of pixels
  /// (for_each_pixel_tile).
  void for_rows(std::size_t rows, std::size_t) const {
    if constexpr (std::is_same_v<T, float>) {
      for (std::size_t n = 0; n < rows / pixels; ++n) {
        detail::transpose_floats(g + n * channels * pixels, channels, pixels, gt + n * pixels * channels);
      }
    } else {
      for_each_pixel_tile(rows / pixels, channels, pixels, [&](std::size_t n, std::size_t oc, std::size_t p0,
                                                                std::size_t p1) {
        const T* i = g + (n * channels + oc) * pixels;
        T* out = gt + n * pixels * channels;
        for (std::size_t p = p0; p < p1; ++p) out[p * channels + oc] = i[p];
      });
    }
  }
};

/// Max pooling: y[nc, p] = the largest input of output pixel p's window (padding never wins; a NaN wins, the last
/// one of a window, as in PyTorch), argmax[nc, p] its index in the image plane (y * W + x). A launch_2d functor over [N * C, OH * OW].
template <class T>
struct max_pool_forward_op {
  const T* x;
  T* y;
  std::int32_t* argmax;
  conv_geometry g;
  LOCKSTEP_HD void operator()(std::size_t row, std::size_t p) const {
    window(row, p / g.ow, p % g.ow, row * g.pixels() + p);
  }
  // Output pixel (oy, ox) of plane `row`, at index o of y and argmax.
  LOCKSTEP_HD void window(std::size_t row, std::size_t oy, std::size_t ox, std::size_t o) const {
    const T* plane = x + row * g.h * g.w;
    float best = 0.0f;
    std::int32_t at = -1;
    for_each_in_window(g, oy, ox, [&](std::size_t, std::size_t, std::size_t idx) {
      const float v = to_float(plane[idx]);
      if (at < 0 || v > best || v != v) {  // the first maximum; a NaN wins (the last one, as in PyTorch)
        best = v;
        at = static_cast<std::int32_t>(idx);
      }
    });
    y[o] = convert<T>(best);
    argmax[o] = at;
  }
  /// The host loop: the same windows, output pixel by output pixel without a division; 2x2 windows of stride 2
  /// without padding (the usual pooling) read their four values directly, in window order (floats on an AVX2 CPU:
  /// eight windows at a time, detail::max_pool_2x2_row_avx2).
  void for_rows(std::size_t rows, std::size_t) const {
    if (g.kh == 2 && g.kw == 2 && g.stride == 2 && g.padding == 0) {
#if LOCKSTEP_TRANSPOSE_X86
      if constexpr (std::is_same_v<T, float>) {
        if (detail::max_pool_2x2_row_available(g.ow)) {  // eight windows at a time
          for (std::size_t row = 0; row < rows; ++row) {
            const float* plane = x + row * g.h * g.w;
            for (std::size_t oy = 0; oy < g.oh; ++oy) {
              const std::size_t top = 2 * oy * g.w, o = row * g.pixels() + oy * g.ow;
              detail::max_pool_2x2_row_avx2(plane + top, plane + top + g.w, g.ow, static_cast<std::int32_t>(top),
                                            static_cast<std::int32_t>(g.w), y + o, argmax + o);
            }
          }
          return;
        }
      }
#endif
      for (std::size_t row = 0; row < rows; ++row) {
        const T* plane = x + row * g.h * g.w;
        std::size_t o = row * g.pixels();
        for (std::size_t oy = 0; oy < g.oh; ++oy) {
          const std::size_t top = 2 * oy * g.w;
          const T* r0 = plane + top;
          const T* r1 = r0 + g.w;
          for (std::size_t ox = 0; ox < g.ow; ++ox, ++o) {
            float best = to_float(r0[2 * ox]);
            auto at = static_cast<std::int32_t>(top + 2 * ox);
            const auto consider = [&](float v, std::size_t idx) {
              if (v > best || v != v) {  // as in window(): the first maximum; a NaN wins (the last one)
                best = v;
                at = static_cast<std::int32_t>(idx);
              }
            };
            consider(to_float(r0[2 * ox + 1]), top + 2 * ox + 1);
            consider(to_float(r1[2 * ox]), top + g.w + 2 * ox);
            consider(to_float(r1[2 * ox + 1]), top + g.w + 2 * ox + 1);
            y[o] = convert<T>(best);
            argmax[o] = at;
          }
        }
      }
      return;
    }
    for (std::size_t row = 0; row < rows; ++row) {
      std::size_t o = row * g.pixels();
      for (std::size_t oy = 0; oy < g.oh; ++oy)
        for (std::size_t ox = 0; ox < g.ow; ++ox) window(row, oy, ox, o++);
    }
  }
};

/// Max pooling's input gradient as a gather: dx[nc, y, x] = the sum of gy over the windows whose maximum was (y, x).
/// A launch_2d functor over [N * C, H * W].
template <class T>
struct max_pool_backward_op {
  const T* gy;
  const std::int32_t* argmax;
  T* dx;
  conv_geometry g;
  LOCKSTEP_HD void operator()(std::size_t row, std::size_t pixel) const {
    float acc = 0.0f;
    for_each_window_over(g, pixel, [&](std::size_t, std::size_t, std::size_t oy, std::size_t ox) {
      const std::size_t o = row * g.pixels() + oy * g.ow + ox;
      if (argmax[o] == static_cast<std::int32_t>(pixel)) acc += to_float(gy[o]);
    });
    dx[row * g.h * g.w + pixel] = convert<T>(acc);
  }
  /// The host loop: each window's gradient sent to its maximum, plane by plane, in window order, added in f32 and
  /// rounded once (a fixed order: the same bits every run; without overlapping windows, the gather's bits).
  /// Windows that do not overlap (stride >= kernel, the usual pooling) send at most one gradient to a pixel: it is
  /// written straight into the zeroed plane, as 0 + g (a -0 gradient gives +0, as the sum does).
  void for_rows(std::size_t rows, std::size_t) const {
    const std::size_t plane = g.h * g.w;
    if (g.stride >= g.kh && g.stride >= g.kw) {
      for (std::size_t row = 0; row < rows; ++row) {
        T* out = dx + row * plane;
        std::fill(out, out + plane, convert<T>(0.0f));
        const std::size_t o0 = row * g.pixels();
        for (std::size_t o = 0; o < g.pixels(); ++o) {
          const std::int32_t at = argmax[o0 + o];
          if (at >= 0) out[at] = convert<T>(0.0f + to_float(gy[o0 + o]));
        }
      }
      return;
    }
    std::vector<float> buffer(plane);
    float* acc = buffer.data();
    for (std::size_t row = 0; row < rows; ++row) {
      for (std::size_t e = 0; e < plane; ++e) acc[e] = 0.0f;
      const std::size_t o0 = row * g.pixels();
      for (std::size_t o = 0; o < g.pixels(); ++o) {
        const std::int32_t at = argmax[o0 + o];
        if (at >= 0) acc[at] += to_float(gy[o0 + o]);
      }
      T* out = dx + row * plane;
      for (std::size_t e = 0; e < plane; ++e) out[e] = convert<T>(acc[e]);
    }
  }
};

/// Average pooling: y[nc, p] = the sum of output pixel p's window divided by KH * KW (padding counts as zeros,
/// PyTorch's count_include_pad). A launch_2d functor over [N * C, OH * OW].
template <class T>
struct avg_pool_forward_op {
  const T* x;
  T* y;
  conv_geometry g;
  LOCKSTEP_HD void operator()(std::size_t row, std::size_t p) const {
    const T* plane = x + row * g.h * g.w;
    float acc = 0.0f;
    for_each_in_window(g, p / g.ow, p % g.ow, [&](std::size_t, std::size_t, std::size_t idx) {
      acc += to_float(plane[idx]);
    });
    y[row * g.pixels() + p] = convert<T>(acc / static_cast<float>(g.kh * g.kw));
  }
};

/// Average pooling's input gradient as a gather: dx[nc, y, x] = the sum of gy / (KH * KW) over the windows that
/// contain (y, x). A launch_2d functor over [N * C, H * W].
template <class T>
struct avg_pool_backward_op {
  const T* gy;
  T* dx;
  conv_geometry g;
  LOCKSTEP_HD void operator()(std::size_t row, std::size_t pixel) const {
    float acc = 0.0f;
    for_each_window_over(g, pixel, [&](std::size_t, std::size_t, std::size_t oy, std::size_t ox) {
      acc += to_float(gy[row * g.pixels() + oy * g.ow + ox]);
    });
    dx[row * g.h * g.w + pixel] = convert<T>(acc / static_cast<float>(g.kh * g.kw));
  }
};

}  // namespace kernels
LOCKSTEP_ABI_END
