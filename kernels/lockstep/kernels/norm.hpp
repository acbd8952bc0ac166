// lockstep/kernels/norm.hpp — kernel bodies of layer normalization (nn/layer_norm.hpp) and batch normalization
// (nn/batch_norm.hpp).
//
// Layer normalization:
// A row is normalized over its `cols` values with a shifted two-pass algorithm in f32, whatever the storage type T:
// with K the row's first value, the first pass gives delta = mean(x - K), the second var = mean(((x - K) - delta)^2)
// (the biased variance PyTorch's layer_norm uses); rstd = 1 / sqrt(var + eps). x - K is exact for values within a
// factor of two of K, so a row far from zero (values near 1000 that differ by 0.001) keeps its deviations instead
// of losing them to the rounding of a mean near 1000: the kernels keep delta, not the mean, and every deviation
// is (x - K) - delta. Rows run through launch_rows (a warp per row on a GPU, the serial loop on a host stream), so a row's bits
// depend on its values alone, never on how many rows share the launch.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"
#include "lockstep/kernels/activation.hpp"

LOCKSTEP_ABI_BEGIN
namespace kernels {

/// y[r] = (x[r] - mean) * rstd * gamma + beta (gamma and beta null: no affine transform); keeps each row's delta
/// (its mean minus its first value) and rstd (f32) for backward. Run by launch_rows.
template <class T>
struct layer_norm_forward_op {
  const T* x;
  const T* gamma;
  const T* beta;
  T* y;
  float* delta;
  float* rstd;
  std::size_t cols;
  float eps;
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t r, const Lanes& lanes) const {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    const float n = static_cast<float>(cols), k = to_float(xr[0]);
    float s = 0.0f;
    for (std::size_t c = lanes.index; c < cols; c += lanes.count) s += to_float(xr[c]) - k;
    const float m = lanes.sum(s) / n;
    float q = 0.0f;
    for (std::size_t c = lanes.index; c < cols; c += lanes.count) {
      const float d = (to_float(xr[c]) - k) - m;
      q += d * d;
    }
    const float rs = 1.0f / ::sqrtf(lanes.sum(q) / n + eps);
    for (std::size_t c = lanes.index; c < cols; c += lanes.count) {
      float v = ((to_float(xr[c]) - k) - m) * rs;
      if (gamma != nullptr) v = v * to_float(gamma[c]) + to_float(beta[c]);
      yr[c] = convert<T>(v);
    }
    if (lanes.index == 0) {
      delta[r] = m;
      rstd[r] = rs;
    }
  }
};

/// dx[r] = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = gy[r] * gamma (gy[r] without affine) and
/// xhat = ((x[r] - K) - delta) * rstd: the input gradient of layer_norm_forward_op. Run by launch_rows.
template <class T>
struct layer_norm_input_grad_op {
  const T* gy;
  const T* x;
  const T* gamma;
  const float* delta;
  const float* rstd;
  T* dx;
  std::size_t cols;
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t r, const Lanes& lanes) const {
    const T* gr = gy + r * cols;
    const T* xr = x + r * cols;
    T* dr = dx + r * cols;
    const float k = to_float(xr[0]), m = delta[r], rs = rstd[r], n = static_cast<float>(cols);
    float sg = 0.0f, sgx = 0.0f;
    for (std::size_t c = lanes.index; c < cols; c += lanes.count) {
      const float g = gamma != nullptr ? to_float(gr[c]) * to_float(gamma[c]) : to_float(gr[c]);
      sg += g;
      sgx += g * (((to_float(xr[c]) - k) - m) * rs);
    }
    const float a = lanes.sum(sg) / n, b = lanes.sum(sgx) / n;
    for (std::size_t c = lanes.index; c < cols; c += lanes.count) {
      const float g = gamma != nullptr ? to_float(gr[c]) * to_float(gamma[c]) : to_float(gr[c]);
      const float xhat = ((to_float(xr[c]) - k) - m) * rs;
      dr[c] = convert<T>(rs * (g - a - xhat * b));
    }
  }
};

/// The affine parameters' gradients over `rows` rows: dgamma[c] = gamma_beta * dgamma[c] + sum_r gy[r, c] *
/// xhat[r, c] (xhat as in layer_norm_input_grad_op) and dbeta[c] = beta_beta * dbeta[c] + sum_r gy[r, c] (either output may be null), rows summed in
/// order in f32. One index per column (coalesced on a GPU); on a host stream `for_all` runs the same sums a block
/// of columns at a time over contiguous row segments.
template <class T>
struct layer_norm_param_grad_op {
  const T* gy;
  const T* x;
  const float* delta;
  const float* rstd;
  T* dgamma;
  T* dbeta;
  std::size_t rows;
  std::size_t cols;
  float gamma_beta;  // the factor of the old contents (parameter::begin_accumulate)
  float beta_beta;
  LOCKSTEP_HD void finish(std::size_t c, float ag, float ab) const {
    if (dgamma != nullptr) dgamma[c] = convert<T>(gamma_beta == 0.0f ? ag : gamma_beta * to_float(dgamma[c]) + ag);
    if (dbeta != nullptr) dbeta[c] = convert<T>(beta_beta == 0.0f ? ab : beta_beta * to_float(dbeta[c]) + ab);
  }
  LOCKSTEP_HD void operator()(std::size_t c) const {
    float ag = 0.0f, ab = 0.0f;
    for (std::size_t r = 0; r < rows; ++r) {
      const float g = to_float(gy[r * cols + c]);
      ag += g * (((to_float(x[r * cols + c]) - to_float(x[r * cols])) - delta[r]) * rstd[r]);
      ab += g;
    }
    finish(c, ag, ab);
  }
  void for_all(std::size_t n) const {
    constexpr std::size_t block = 64;
    float ag[block], ab[block], g[block], xv[block];
    for (std::size_t c0 = 0; c0 < n; c0 += block) {
      const std::size_t m = n - c0 < block ? n - c0 : block;
      for (std::size_t j = 0; j < m; ++j) ag[j] = ab[j] = 0.0f;
      for (std::size_t r = 0; r < rows; ++r) {
        const T* gr = gy + r * cols + c0;
        const T* xr = x + r * cols + c0;
        if constexpr (std::is_same_v<T, float>) {
          for (std::size_t j = 0; j < m; ++j) g[j] = gr[j], xv[j] = xr[j];
        } else {
          detail::widen_run(gr, g, static_cast<std::int64_t>(m));
          detail::widen_run(xr, xv, static_cast<std::int64_t>(m));
        }
        const float k = to_float(x[r * cols]), mr = delta[r], rs = rstd[r];
        for (std::size_t j = 0; j < m; ++j) {
          ag[j] += g[j] * (((xv[j] - k) - mr) * rs);
          ab[j] += g[j];
        }
      }
      for (std::size_t j = 0; j < m; ++j) finish(c0 + j, ag[j], ab[j]);
    }
  }
};

// ---- batch normalization -----------------------------------------------------------------------------------------
//
// The input is seen as [n, channels, inner] (inner = 1 for [n, features], H * W for [n, C, H, W]); channel c's
// statistics run over its n * inner values. Every kernel below is run by launch_rows with one row per channel: a warp
// per channel on a GPU (its lanes take the channel's values lane, lane + 32, ...), the serial loop over (n, inner) on
// a host stream. Statistics in f32 whatever T, by two compensated passes (channel_sum: Kahan's compensation over
// the lanes' values on a GPU, over contiguous runs summed eight-wide on a host): the mean, then the sum of squared
// deviations from it. The sums are written to memory between the passes so that a synchronized batch norm can add
// them over the replicas before the next pass reads them.

/// A float sum with Kahan's compensation (no multiplication inside: a GPU compiler cannot contract it).
struct compensated_sum {
  float sum = 0.0f;
  float carry = 0.0f;
  LOCKSTEP_HD void add(float v) {
    const float y = v - carry;
    const float t = sum + y;
    carry = (t - sum) - y;
    sum = t;
  }
  [[nodiscard]] LOCKSTEP_HD float value() const { return sum - carry; }
};

/// f(i) for the flat index i of every value of channel `c` this lane takes.
template <class Lanes, class F>
LOCKSTEP_HD void for_channel_values(std::size_t n, std::size_t channels, std::size_t inner, std::size_t c,
                                    const Lanes& lanes, F&& f) {
  if (lanes.count == 1) {  // the host's serial loop: contiguous runs of `inner` values
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t base = (i * channels + c) * inner;
      for (std::size_t s = 0; s < inner; ++s) f(base + s);
    }
    return;
  }
  const std::size_t m = n * inner;
  for (std::size_t j = lanes.index; j < m; j += lanes.count) {
    const std::size_t i = j / inner, s = j - i * inner;
    f((i * channels + c) * inner + s);
  }
}

/// The sum of f(i) over the contiguous run [base, base + inner) in a fixed order: eight interleaved partial sums
/// (independent chains a compiler can vectorize), added pairwise.
template <class F>
LOCKSTEP_HD float run_sum(std::size_t base, std::size_t inner, F&& f) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  std::size_t s = 0;
  for (; s + 8 <= inner; s += 8) {
    for (std::size_t q = 0; q < 8; ++q) part[q] += f(base + s + q);
  }
  for (; s < inner; ++s) part[0] += f(base + s);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/// The sum of f(i) over channel c's values for a single lane (a host stream), in a fixed order: each contiguous run
/// of `inner` values summed by run_sum, the runs' totals added with compensation in the order of the rows. (The
/// lanes of a GPU warp add theirs with compensation element by element.)
template <class F>
LOCKSTEP_HD float channel_sum_serial(std::size_t n, std::size_t channels, std::size_t inner, std::size_t c, F&& f) {
  compensated_sum total;
  for (std::size_t i = 0; i < n; ++i) total.add(run_sum((i * channels + c) * inner, inner, f));
  return total.value();
}

/// The host loops of the batch-norm kernels (their for_all_rows): f(c, base) for every run [base, base + inner) of
/// channel c, in memory order (row by row, each row's channels in order). Each channel's runs come in the order of
/// the rows, as channel_sum_serial takes them, so sums kept per channel are the same bits as channel by channel;
/// memory is read once, front to back, instead of a strided walk per channel (2-5x faster for [128, 32, 28, 28]).
/// (Their lambdas copy the tensors' pointers: a loop that reads them through the functor's `this` does not vectorize.)
template <class F>
void for_each_channel_run(std::size_t n, std::size_t channels, std::size_t inner, F&& f) {
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t c = 0; c < channels; ++c) f(c, (i * channels + c) * inner);
  }
}

/// The sum of f(i) over channel c's values, from the lanes that share the channel (launch_rows).
template <class Lanes, class F>
LOCKSTEP_HD float channel_sum(std::size_t n, std::size_t channels, std::size_t inner, std::size_t c, const Lanes& lanes,
                              F&& f) {
  if (lanes.count == 1) return channel_sum_serial(n, channels, inner, c, f);
  compensated_sum acc;
  for_channel_values(n, channels, inner, c, lanes, [&](std::size_t i) { acc.add(f(i)); });
  return lanes.sum(acc.value());
}

/// Pass 1: sums[c] = the sum of channel c's values; sums[channels] = their count (n * inner), so that the sums of
/// several replicas added element-wise hold the global sums and count.
template <class T>
struct batch_norm_sum_op {
  const T* x;
  float* sums;  // [channels + 1]
  std::size_t n, channels, inner;
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t c, const Lanes& lanes) const {
    const float total = channel_sum(n, channels, inner, c, lanes, [&](std::size_t i) { return to_float(x[i]); });
    if (lanes.index == 0) {
      sums[c] = total;
      if (c == 0) sums[channels] = static_cast<float>(n * inner);
    }
  }
  /// The host loop: every channel's sum in one pass over x in memory order (the same bits).
  void for_all_rows(std::size_t) const {
    std::vector<compensated_sum> total(channels);
    const T* xs = x;
    for_each_channel_run(n, channels, inner, [&](std::size_t c, std::size_t base) {
      total[c].add(run_sum(base, inner, [xs](std::size_t i) { return to_float(xs[i]); }));
    });
    for (std::size_t c = 0; c < channels; ++c) sums[c] = total[c].value();
    sums[channels] = static_cast<float>(n * inner);
  }
};

/// Pass 2: squares[c] = the sum of (x - mean_c)^2 over channel c, mean_c = sums[c] / sums[channels].
template <class T>
struct batch_norm_square_op {
  const T* x;
  const float* sums;
  float* squares;  // [channels]
  std::size_t n, channels, inner;
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t c, const Lanes& lanes) const {
    const float mean = sums[c] / sums[channels];
    const float total = channel_sum(n, channels, inner, c, lanes, [&](std::size_t i) {
      const float d = to_float(x[i]) - mean;
      return d * d;
    });
    if (lanes.index == 0) squares[c] = total;
  }
  /// The host loop: every channel's sum in one pass over x in memory order (the same bits).
  void for_all_rows(std::size_t) const {
    std::vector<compensated_sum> total(channels);
    std::vector<float> mean(channels);
    for (std::size_t c = 0; c < channels; ++c) mean[c] = sums[c] / sums[channels];
    const T* xs = x;
    for_each_channel_run(n, channels, inner, [&](std::size_t c, std::size_t base) {
      const float m = mean[c];
      total[c].add(run_sum(base, inner, [xs, m](std::size_t i) {
        const float d = to_float(xs[i]) - m;
        return d * d;
      }));
    });
    for (std::size_t c = 0; c < channels; ++c) squares[c] = total[c].value();
  }
};

/// What normalizes channel c: y = (x - mean[c]) * rstd[c] * gamma[c] + beta[c] (gamma, beta null: no affine).
///   - batch statistics (sums non-null): mean = sums[c] / count, var = squares[c] / count (count = sums[channels]),
///     rstd = 1 / sqrt(var + eps), kept in mean[c] and rstd[c] for backward; with running statistics (non-null)
///     running_mean = (1 - momentum) running_mean + momentum mean and running_var likewise with the unbiased
///     variance var * count / (count - 1); *tracked += 1 (channel 0); all three left alone for a count of 1 or 0
///     (a synchronized batch whose global count the layer could not check);
///   - running statistics (sums null): mean = running_mean[c], rstd = 1 / sqrt(running_var[c] + eps), kept too.
template <class T>
struct batch_norm_normalize_op {
  const T* x;
  const T* gamma;
  const T* beta;
  T* y;
  const float* sums;     // [channels + 1], or null: normalize with the running statistics
  const float* squares;  // [channels]
  float* mean;           // [channels]
  float* rstd;
  float* running_mean;   // [channels], or null
  float* running_var;
  std::int64_t* tracked;  // num_batches_tracked, or null
  std::size_t n, channels, inner;
  float eps;
  float momentum;
  bool relu = false;  // y = relu(the normalized x): the bits of a relu layer after the normalization
  struct transform {
    float m, rs, g, b;
    bool relu;
    [[nodiscard]] LOCKSTEP_HD float operator()(float value) const {
      const float v = (value - m) * rs * g + b;
      return relu ? relu_fn::forward(v) : v;  // (rounding to T after relu or before it: the same bits)
    }
  };
  // Channel c's transform; the first lane also updates the running statistics.
  LOCKSTEP_HD transform channel(std::size_t c, bool first_lane) const {
    float m = 0.0f, rs = 0.0f;
    if (sums != nullptr) {
      const float count = sums[channels];
      m = sums[c] / count;
      const float var = squares[c] / count;
      rs = 1.0f / ::sqrtf(var + eps);
      if (first_lane && running_mean != nullptr && count > 1.0f) {  // (a global count of 1 has no variance)
        running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * m;
        running_var[c] = (1.0f - momentum) * running_var[c] + momentum * (var * (count / (count - 1.0f)));
        if (c == 0 && tracked != nullptr) ++*tracked;
      }
    } else {
      m = running_mean[c];
      rs = 1.0f / ::sqrtf(running_var[c] + eps);
    }
    return {m, rs, gamma != nullptr ? to_float(gamma[c]) : 1.0f, gamma != nullptr ? to_float(beta[c]) : 0.0f, relu};
  }
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t c, const Lanes& lanes) const {
    const transform t = channel(c, lanes.index == 0);
    for_channel_values(n, channels, inner, c, lanes, [&](std::size_t i) { y[i] = convert<T>(t(to_float(x[i]))); });
    if (lanes.index == 0) {
      mean[c] = t.m;
      rstd[c] = t.rs;
    }
  }
  /// The host loop: the channels' transforms, then one pass over x in memory order (the same bits).
  void for_all_rows(std::size_t) const {
    std::vector<transform> t(channels);
    for (std::size_t c = 0; c < channels; ++c) {
      t[c] = channel(c, true);
      mean[c] = t[c].m;
      rstd[c] = t[c].rs;
    }
    const T* xs = x;
    T* ys = y;
    for_each_channel_run(n, channels, inner, [&](std::size_t c, std::size_t base) {
      const transform k = t[c];
      for (std::size_t i = base; i < base + inner; ++i) ys[i] = convert<T>(k(to_float(xs[i])));
    });
  }
};

/// The gradient of batch norm's output at i: gy, or with a fused relu (relu_y its output, the layer's) gy where
/// relu_y > 0 and 0 elsewhere, the bits a relu layer's backward passes on.
template <bool Relu, class T>
LOCKSTEP_HD float batch_norm_output_grad(const T* gy, const T* relu_y, std::size_t i) {
  if constexpr (Relu) {
    return relu_fn::backward(to_float(gy[i]), 0.0f, to_float(relu_y[i]));
  } else {
    return to_float(gy[i]);
  }
}

/// f(std::true_type) with a fused relu's output (relu_y non-null), f(std::false_type) without: the mask chosen
/// once per launch, not per element.
template <class T, class F>
LOCKSTEP_HD void with_relu_mask(const T* relu_y, F&& f) {
  if (relu_y != nullptr) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

/// Backward's sums over channel c: sg[c] = the sum of gy and sgx[c] = the sum of gy * xhat, xhat = (x - mean[c]) *
/// rstd[c]. With relu_y, gy is masked by the fused relu's output (batch_norm_output_grad).
template <class T>
struct batch_norm_grad_sums_op {
  const T* gy;
  const T* x;
  const float* mean;
  const float* rstd;
  float* sg;
  float* sgx;
  std::size_t n, channels, inner;
  const T* relu_y = nullptr;  // the fused relu's output, or null
  // gy * xhat
  [[nodiscard]] LOCKSTEP_HD static float scaled(float grad, float value, float m, float rs) {
    return grad * ((value - m) * rs);
  }
  LOCKSTEP_HD void finish(std::size_t c, float sum_g, float sum_gx) const {
    sg[c] = sum_g;
    sgx[c] = sum_gx;
  }
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t c, const Lanes& lanes) const {
    with_relu_mask(relu_y, [&](auto relu) {
      const float m = mean[c], rs = rstd[c];
      const auto g = [&](std::size_t i) { return batch_norm_output_grad<decltype(relu)::value>(gy, relu_y, i); };
      const float sum_g = channel_sum(n, channels, inner, c, lanes, g);
      const float sum_gx = channel_sum(n, channels, inner, c, lanes,
                                       [&](std::size_t i) { return scaled(g(i), to_float(x[i]), m, rs); });
      if (lanes.index == 0) finish(c, sum_g, sum_gx);
    });
  }
  /// The host loop: both sums of every channel in one pass over gy and x in memory order (the same bits).
  void for_all_rows(std::size_t) const {
    with_relu_mask(relu_y, [&](auto relu) {
      constexpr bool masked = decltype(relu)::value;
      std::vector<compensated_sum> total(2 * channels);
      const T* gs = gy;
      const T* ys = relu_y;
      const T* xs = x;
      for_each_channel_run(n, channels, inner, [&](std::size_t c, std::size_t base) {
        const float m = mean[c], rs = rstd[c];
        total[c].add(
            run_sum(base, inner, [gs, ys](std::size_t i) { return batch_norm_output_grad<masked>(gs, ys, i); }));
        total[channels + c].add(run_sum(base, inner, [gs, ys, xs, m, rs](std::size_t i) {
          return scaled(batch_norm_output_grad<masked>(gs, ys, i), to_float(xs[i]), m, rs);
        }));
      });
      for (std::size_t c = 0; c < channels; ++c) finish(c, total[c].value(), total[channels + c].value());
    });
  }
};

/// dgamma[c] = gamma_beta * dgamma[c] + sgx[c] and dbeta[c] = beta_beta * dbeta[c] + sg[c]: the affine parameters'
/// gradients from backward's sums. One index per channel.
template <class T>
struct batch_norm_param_grad_op {
  const float* sg;
  const float* sgx;
  T* dgamma;
  T* dbeta;
  float gamma_beta;
  float beta_beta;
  LOCKSTEP_HD void operator()(std::size_t c) const {
    dgamma[c] = convert<T>(gamma_beta == 0.0f ? sgx[c] : gamma_beta * to_float(dgamma[c]) + sgx[c]);
    dbeta[c] = convert<T>(beta_beta == 0.0f ? sg[c] : beta_beta * to_float(dbeta[c]) + sg[c]);
  }
};

/// dx = gamma rstd (gy - sg / count - xhat sgx / count) with batch statistics (sg non-null; count = sums[channels],
/// the sums as the forward's, over every replica of a synchronized batch norm), or gamma rstd gy with running ones;
/// with relu_y, gy masked by the fused relu's output (batch_norm_output_grad).
template <class T>
struct batch_norm_input_grad_op {
  const T* gy;
  const T* x;
  const T* gamma;
  const float* mean;
  const float* rstd;
  const float* sg;    // null: the statistics were the running ones (constants)
  const float* sgx;
  const float* sums;  // the forward's: its count
  T* dx;
  std::size_t n, channels, inner;
  const T* relu_y = nullptr;  // the fused relu's output, or null
  struct coefficients {
    float m, rs, g, a, b;
    bool batch;  // batch statistics: the terms of a and b
    [[nodiscard]] LOCKSTEP_HD float operator()(float grad, float value) const {  // of the output, of the input
      if (!batch) return grad * (g * rs);
      const float xhat = (value - m) * rs;
      return g * rs * (grad - a - xhat * b);
    }
  };
  LOCKSTEP_HD coefficients channel(std::size_t c) const {
    coefficients k{mean[c], rstd[c], gamma != nullptr ? to_float(gamma[c]) : 1.0f, 0.0f, 0.0f, sg != nullptr};
    if (k.batch) {
      const float count = sums[channels];
      k.a = sg[c] / count;
      k.b = sgx[c] / count;
    }
    return k;
  }
  template <class Lanes>
  LOCKSTEP_HD void row(std::size_t c, const Lanes& lanes) const {
    with_relu_mask(relu_y, [&](auto relu) {
      const coefficients k = channel(c);
      for_channel_values(n, channels, inner, c, lanes, [&](std::size_t i) {
        dx[i] = convert<T>(k(batch_norm_output_grad<decltype(relu)::value>(gy, relu_y, i), to_float(x[i])));
      });
    });
  }
  /// The host loop: the channels' coefficients, then one pass over gy and x in memory order (the same bits).
  void for_all_rows(std::size_t) const {
    with_relu_mask(relu_y, [&](auto relu) {
      constexpr bool masked = decltype(relu)::value;
      std::vector<coefficients> k(channels);
      for (std::size_t c = 0; c < channels; ++c) k[c] = channel(c);
      const T* gs = gy;
      const T* ys = relu_y;
      const T* xs = x;
      T* ds = dx;
      for_each_channel_run(n, channels, inner, [&](std::size_t c, std::size_t base) {
        const coefficients kc = k[c];
        for (std::size_t i = base; i < base + inner; ++i) {
          ds[i] = convert<T>(kc(batch_norm_output_grad<masked>(gs, ys, i), to_float(xs[i])));
        }
      });
    });
  }
};

}  // namespace kernels
LOCKSTEP_ABI_END
