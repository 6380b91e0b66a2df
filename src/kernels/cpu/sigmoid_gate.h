// A row gated by the sigmoid of one logit (Qwen2-MoE's shared_expert_gate: Linear(hidden, 1) on the
// token, σ of it scaling the shared expert's output row): y[n, :] += σ(g[n]) · value[n, :].
#pragma once

#include <cstdint>

namespace mf::cpu {

// y[N, H] += σ(gate_logits[n]) · value[N, H]; gate_logits [N].
void sigmoid_gate_forward(float* y, const float* value, const float* gate_logits, int64_t N, int64_t H);
// With s = σ(gate_logits[n]) and dy the gradient at y, both written (=):
//   dvalue[n, :] = s · dy[n, :]   (may alias dy)
//   dgate_logits[n] = s · (1 − s) · Σ_h dy[n, h] · value[n, h]
void sigmoid_gate_backward(float* dvalue, float* dgate_logits, const float* dy, const float* value,
                           const float* gate_logits, int64_t N, int64_t H);

}  // namespace mf::cpu
