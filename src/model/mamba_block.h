// The Mamba-2 mixer block (Nemotron-H's "M" layers), over the ops of ops.h's Mamba-2 section:
//
//   z = x·Wzᵀ, xbc_raw = x·Wxbcᵀ, dt = x·Wdtᵀ          (in_proj's three row blocks [I | conv_dim | H_m])
//   xbc = silu(conv1d(xbc_raw) + conv_bias)            causal, depthwise, kernel K, per document
//   y = scan(x, B, C of xbc; dt, dt_bias, A_log, D)    the SSD recurrence, per document
//   out = gated_rmsnorm(y, z)·Woutᵀ                    norm(y·silu(z)) over groups of I/G
//
// in_proj is one [I + conv_dim + H_m, H] parameter (HF's), used as three contiguous row blocks, so each
// product's output is a contiguous tensor and its weight gradient a contiguous slice. Forward writes
// the output; backward accumulates into dx and the parameter gradients (+=). Activations in the
// activation dtype; the gated norm's statistics and the scan's chunk states f32.
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "model/ffn_blocks.h"
#include "model/param_table.h"
#include "model/spec.h"
#include "ops/ops.h"

namespace mf::model {

struct MambaWeights {
    Tensor in_z, in_xbc, in_dt;  // the row blocks of in_proj.weight: [I, H], [conv_dim, H], [H_m, H]
    Tensor conv_w, conv_b;       // [conv_dim, 1, K], [conv_dim] (undefined without conv bias)
    Tensor dt_bias, A_log, D;    // [H_m]
    Tensor norm;                 // [I]
    Tensor out;                  // [H, I]
};

// The mixer's parameters under `prefix` ("model.layers.0.mixer."), in HF's names.
void declare_mamba_params(ParamTable& table, const std::string& prefix, const MambaBranch& m, int64_t hidden);
MambaWeights mamba_weights(const ParamLookup& at, const std::string& prefix, const MambaBranch& m, int64_t hidden);

// The scan's geometry for rows of T tokens.
ops::SsdDims ssd_dims(const MambaBranch& m, int64_t T);

struct MambaActs {
    Tensor z, xbc_raw, xbc, dt;  // [N, I], [N, conv_dim] ×2, [N, H_m]
    Tensor y, normed, rstd;      // [N, I] scan output, [N, I] gated-norm output, [N · G] f32
    Tensor states;               // the scan's chunk states (f32)
    void alloc(Arena& arena, const MambaBranch& m, int64_t B, int64_t T, DType act);
};

struct MambaScratch {
    Tensor d_normed, dy, dz, dxbc, dxbc_raw, ddt;
    void alloc(Arena& arena, const MambaBranch& m, int64_t N, DType act);
};

// doc_ids: the batch's document ids ([N] i32), or undefined when every row is one document.
void mamba_block_forward(const Tensor& out, MambaActs& acts, const Tensor& x, const MambaWeights& w,
                         const MambaBranch& m, int64_t T, const Tensor& doc_ids);
void mamba_block_backward(const Tensor& dx, const MambaWeights& grads, MambaScratch& s, const Tensor& dout,
                          const Tensor& x, const MambaActs& acts, const MambaWeights& w, const MambaBranch& m,
                          int64_t T, const Tensor& doc_ids);

}  // namespace mf::model
