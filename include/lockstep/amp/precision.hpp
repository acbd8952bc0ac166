// lockstep/amp/precision.hpp — the precision policy of a model: f32 (the default), f16 or bf16.
//
// Under f16 or bf16 every parameter keeps fp32 master values (what the optimizer updates; optimizer state is
// fp32 too) and a working copy in the low precision that forward and backward read, refreshed by the fused
// optimizer step; activations and gradients are stored in the low precision; GEMMs take low-precision inputs
// and accumulate in fp32 (cublasGemmEx with a 32-bit compute type; on host devices the same arithmetic through
// fp32 blocks); losses and reductions compute in fp32. Pair f16 with a loss_scaler.
#pragma once

#include "lockstep/config.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/nn/context.hpp"
#include "lockstep/nn/layer.hpp"

LOCKSTEP_ABI_BEGIN

/// Makes `model` compute in `type` (f32, f16 or bf16) on ctx's device: working copies and gradients in that
/// type, allocated in stream order on ctx.stream(), and the context's compute type set to it. Gradients start
/// zero. Call it once, after building the model and before creating its optimizer.
template <layer Model>
void set_precision(Model& model, context& ctx, dtype type) {
  LOCKSTEP_EXPECTS(is_floating(type), "set_precision: expected f32, f16 or bf16, got ", name_of(type));
  for (const auto& p : parameters_of(model)) {
    LOCKSTEP_EXPECTS(p.param->get_device() == ctx.get_device(), "set_precision: parameter ", p.name, " is on ",
                     p.param->get_device().str(), " but the context is on ", ctx.get_device().str());
    p.param->set_compute_type(type, ctx.stream());
  }
  ctx.set_compute_type(type);
}

LOCKSTEP_ABI_END
