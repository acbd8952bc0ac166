// lockstep/kernels/norm.hpp — kernel bodies of layer normalization (nn/layer_norm.hpp).
//
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

#include "lockstep/config.hpp"
#include "lockstep/core/half.hpp"
#include "lockstep/core/half_runs.hpp"

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

}  // namespace kernels
LOCKSTEP_ABI_END
