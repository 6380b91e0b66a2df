// AdamW over the model's flat parameter buffer (torch.optim.AdamW semantics), with parameters
// whose HF name matches an `optim.no_decay` pattern excluded from weight decay, and gradient
// clipping by the global norm (torch.nn.utils.clip_grad_norm_: grads *= min(1, clip/(norm+1e-6))).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/param_table.h"
#include "train/recipe.h"

namespace mf::train {

class AdamW {
 public:
    AdamW(const model::ParamTable& table, const Recipe::Optim& optim);
    // One update with learning rate `lr`; increments the step count first (bias correction t ≥ 1).
    void step(float* params, const float* grads, double lr);
    int64_t step_count() const { return step_; }
    float* exp_avg() { return m_.as(DType::f32, {total_}).ptr<float>(); }
    float* exp_avg_sq() { return v_.as(DType::f32, {total_}).ptr<float>(); }
    void set_step_count(int64_t s) { step_ = s; }

 private:
    const model::ParamTable& table_;
    Recipe::Optim optim_;
    int64_t total_;
    Buffer m_, v_;
    std::vector<bool> decay_;  // per parameter spec
    int64_t step_ = 0;
};

// Global L2 norm of the gradients (accumulated in double, in buffer order).
double global_grad_norm(const float* grads, int64_t n);
// Scales the gradients so their norm is at most max_norm (torch's rule); returns the norm before.
double clip_grad_norm(float* grads, int64_t n, double max_norm);

}  // namespace mf::train
