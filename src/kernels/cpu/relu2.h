// Squared ReLU (HF ACT2FN["relu2"], Nemotron-H's expert and MLP activation), elementwise on n values:
//   out = relu(x)² = max(x, 0)²,   dinp = dout · 2 · max(x, 0)   (0 for x <= 0)
#pragma once

#include <cstdint>

namespace mf::cpu {

// out[n] (written; may alias inp).
void relu2_forward(float* out, const float* inp, int64_t n);
// dinp[n] (written, not accumulated; may alias dout or inp).
void relu2_backward(float* dinp, const float* dout, const float* inp, int64_t n);

}  // namespace mf::cpu
