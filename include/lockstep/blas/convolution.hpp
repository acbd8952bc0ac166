// lockstep/blas/convolution.hpp — convolution passes a blas_handle runs as library kernels: on a host device, oneDNN's
// convolutions (onednn_conv.hpp) when the handle's GEMM plan names oneDNN for the type. nn/conv2d.hpp asks here
// first and keeps its im2col + GEMM otherwise (GPUs, deterministic mode, f16, OpenBLAS plans, a build without
// oneDNN).
#pragma once

#include <algorithm>
#include <memory>
#include <utility>

#include "lockstep/blas/blas_handle.hpp"
#include "lockstep/blas/onednn_conv.hpp"
#include "lockstep/config.hpp"
#include "lockstep/runtime/copy.hpp"
#include "lockstep/runtime/memory.hpp"

#if LOCKSTEP_HAS_ONEDNN
LOCKSTEP_DETAIL_BEGIN

/// The layouts of pass `key` on oneDNN code for `isa` (the tables of docs/blas.md, "Host convolutions"; pure: the
/// same on every machine with that instruction set). Plain for one input channel below AVX-512, every pass: oneDNN
/// 2.6's blocked AVX2 kernels for it run at 4-8 GFLOP/s in the backward passes, where its gemm:jit on the plain
/// tensors reaches 12-17 (and the forward, 34 against 53, saves the reorder of the layer's output). Plain for one
/// input channel's backward data on AVX-512 too (3.3 ms against 10.5 blocked on Zen 4; a first layer never runs
/// it). oneDNN's choice otherwise.
constexpr onednn_conv_layouts onednn_conv_layouts_for(host_isa isa, const onednn_conv_key& key) noexcept {
  const bool plain = key.c == 1 && (isa < host_isa::avx512 || key.pass == onednn_conv_pass::backward_data);
  return plain ? onednn_conv_layouts::plain : onednn_conv_layouts::chosen_by_onednn;
}

/// The pass `key` (its layouts chosen here) as a oneDNN convolution on `h`'s host device, or null when it does not
/// run there (a GPU, a plan that does not name oneDNN for the type, no kernel or only oneDNN's reference loop for the
/// shape).
inline std::shared_ptr<const onednn_convolution> host_convolution(blas_handle& h, onednn_conv_key key) {
  if (!h.get_device().is_host() || h.host_plan().for_dtype(key.type) != host_gemm_kernel::onednn) return nullptr;
  key.layouts = onednn_conv_layouts_for(h.host_plan().isa, key);
  std::shared_ptr<const onednn_convolution> conv = h.onednn_conv_cache().get(key);
  return conv->usable() ? conv : nullptr;
}

/// The plain tensors of a pass (onednn_convolution::run's a, b, c, out, out2), all of the handle's device.
template <class T>
struct host_convolution_tensors {
  const T* a;
  const T* b;
  const T* c;
  T* out;
  T* out2;
};

/// Queues `conv` on `h`'s stream with `t`, its workspace taken from the handle's scratch memory.
template <class T>
void queue_host_convolution(blas_handle& h, std::shared_ptr<const onednn_convolution> conv,
                            const host_convolution_tensors<T>& t) {
  strict_check_functor(t, h.get_device(), "conv2d (oneDNN)");  // every tensor is memory of the handle's device
  auto* workspace = conv->workspace_bytes() == 0
                        ? nullptr
                        : reinterpret_cast<std::byte*>(h.scratch((conv->workspace_bytes() + 3) / 4));
  enqueue_host(h.stream(), [conv, t, workspace] { conv->run(t.a, t.b, t.c, t.out, t.out2, workspace); },
               "conv2d (oneDNN)");
}

/// A convolution's backward on `h`'s stream as one task: backward weights (`weights`, tensors `w`: x, gy -> dW,
/// dbias), then backward data (`data`, tensors `d`: gy, W -> gx; the same gy). When both read the output gradient
/// in the same layout, the data pass takes the weights pass's copy instead of reordering gy again (a pass over the
/// layer's output gradient saved); the workspace then holds both passes' side by side, so that the copy outlives
/// the first pass (else the second pass reuses the first's).
template <class T>
void queue_host_convolution_backward(blas_handle& h, std::shared_ptr<const onednn_convolution> weights,
                                     const host_convolution_tensors<T>& w,
                                     std::shared_ptr<const onednn_convolution> data,
                                     const host_convolution_tensors<T>& d) {
  using slot = onednn_convolution::slot;
  LOCKSTEP_EXPECTS(w.b == d.a && w.c == nullptr && d.c == nullptr,
                   "queue_host_convolution_backward: both passes read one output gradient and no bias");
  strict_check_functor(w, h.get_device(), "conv2d backward weights (oneDNN)");
  strict_check_functor(d, h.get_device(), "conv2d backward data (oneDNN)");
  const bool shared = data->reads_like(slot::a, *weights, slot::b);
  const std::size_t first = weights->workspace_bytes(), second = data->workspace_bytes();
  const std::size_t bytes = shared ? first + second : std::max(first, second);
  auto* workspace = bytes == 0 ? nullptr : reinterpret_cast<std::byte*>(h.scratch((bytes + 3) / 4));
  std::byte* data_workspace = shared ? workspace + first : workspace;
  const std::byte* gy_copy = shared ? weights->copy_of(slot::b, workspace) : nullptr;
  auto task = [weights, data, x = w.a, gy = w.b, dw = w.out, dbias = w.out2, weight = d.b, gx = d.out, workspace,
               data_workspace, gy_copy] {
    weights->run(x, gy, nullptr, dw, dbias, workspace);
    onednn_convolution::given_copies given{};
    given[static_cast<std::size_t>(slot::a)] = gy_copy;
    data->run(gy, weight, nullptr, gx, nullptr, data_workspace, given);
  };
  static_assert(sizeof(task) <= host_backend::task_body::inline_bytes, "no allocation per backward");
  enqueue_host(h.stream(), std::move(task), "conv2d backward (oneDNN)");
}

LOCKSTEP_DETAIL_END
#endif  // LOCKSTEP_HAS_ONEDNN
