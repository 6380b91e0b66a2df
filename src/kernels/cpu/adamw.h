// AdamW with torch.optim.AdamW semantics (decoupled weight decay, bias correction):
//   p ← p · (1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
//   p ← p − (lr / (1−β1^t)) · m / (sqrt(v) / sqrt(1−β2^t) + eps)
// step t starts at 1. grad_scale multiplies every gradient first (g ← g · s, fp32): the clipping
// coefficient, fused into the update instead of a separate pass over the gradients (1: unchanged).
#pragma once

#include <cstdint>

namespace mf::cpu {

struct AdamWParams {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;
    float grad_scale = 1.0f;
};

void adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamWParams& p);

}  // namespace mf::cpu
