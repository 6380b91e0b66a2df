// gpt-oss's expert activation (transformers GptOssExperts), a SwiGLU variant with clamped inputs and
// gate/up interleaved by column: row n of inp [N, 2I] holds gate_i at column 2i and up_i at 2i + 1.
//   g = min(gate, limit),  u = clamp(up, −limit, limit),  s = σ(alpha · g)
//   out[n, i] = (u + 1) · g · s
// Backward (the clamps pass the gradient where their input lies within them, as torch's clamp does):
//   dgate = dout · (u + 1) · s · (1 + alpha · g · (1 − s)) · [gate <= limit]
//   dup   = dout · g · s · [−limit <= up <= limit]
// gpt-oss uses alpha = 1.702 and limit = 7.0. NaN inputs propagate through the clamps, as in torch.
#pragma once

#include <cstdint>

namespace mf::cpu {

// out [N, I] (written) from inp [N, 2I].
void clamped_swiglu_forward(float* out, const float* inp, int64_t N, int64_t I, float alpha, float limit);
// dinp [N, 2I] (written, interleaved like inp; may alias inp) from dout [N, I] and inp [N, 2I].
void clamped_swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int64_t I, float alpha,
                             float limit);

}  // namespace mf::cpu
