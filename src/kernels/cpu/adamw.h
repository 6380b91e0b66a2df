// AdamW with torch.optim.AdamW semantics (decoupled weight decay, bias correction):
//   p ← p · (1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
//   p ← p − (lr / (1−β1^t)) · m / (sqrt(v) / sqrt(1−β2^t) + eps)
// step t starts at 1.
#pragma once

#include <cstdint>

namespace mf::cpu {

struct AdamWParams {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;
};

void adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamWParams& p);

}  // namespace mf::cpu
