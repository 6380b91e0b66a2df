// AdamW over the model's flat parameter buffer (torch.optim.AdamW semantics), with parameters
// whose HF name matches an `optim.no_decay` pattern excluded from weight decay, and gradient
// clipping by the global norm (torch.nn.utils.clip_grad_norm_: grads *= min(1, clip/(norm+1e-6))).
//
// State follows the precision policy (DESIGN.md): on the CPU everything is f32 and the model's
// parameters are the master copy; on the GPU `bf16` keeps m and v in bf16 next to the bf16
// parameters (8 bytes per parameter with the gradients), `mixed` keeps an fp32 master copy and
// fp32 m and v (16 bytes per parameter) and writes the rounded master into the bf16 parameters.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/qwen3_moe.h"
#include "train/recipe.h"

namespace mf::train {

class AdamW {
 public:
    // `mixed`: keep fp32 master weights and moments (GPU only; on the CPU everything is fp32 anyway).
    AdamW(model::Qwen3Moe& model, const Recipe::Optim& optim, bool mixed);
    // One update with learning rate `lr`; increments the step count first (bias correction t ≥ 1).
    void step(double lr);
    int64_t step_count() const { return step_; }
    void set_step_count(int64_t s) { step_ = s; }

    // The state as f32 on the host (for checkpoints): the master parameters (the model's own on
    // the CPU and under bf16, the fp32 master under mixed) and the two moments.
    void get_state(std::vector<float>& master, std::vector<float>& m, std::vector<float>& v) const;
    void set_state(const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v);

 private:
    model::Qwen3Moe& model_;
    Recipe::Optim optim_;
    int64_t total_;
    DType state_dtype_;
    Buffer master_, m_, v_;  // master_ empty unless mixed on the GPU
    std::vector<bool> decay_;  // per parameter spec
    int64_t step_ = 0;
};

// Global L2 norm of the model's gradients, then torch's clipping in place when max_norm > 0;
// returns the norm before clipping.
double clip_grad_norm(model::Qwen3Moe& model, double max_norm);

}  // namespace mf::train
