// AdamW over the model's flat parameter buffer (torch.optim.AdamW semantics), with parameters
// whose HF name matches an `optim.no_decay` pattern excluded from weight decay, and gradient
// clipping by the global norm (torch.nn.utils.clip_grad_norm_: grads *= min(1, clip/(norm+1e-6))).
//
// State follows the precision policy (DESIGN.md): on the CPU everything is f32 and the model's
// parameters are the master copy; on the GPU `bf16` keeps m and v in bf16 next to the bf16
// parameters (8 bytes per parameter with the gradients), `mixed` keeps an fp32 master copy and
// fp32 m and v (16 bytes per parameter) and writes the rounded master into the bf16 parameters.
//
// ZeRO-1 (a `zero_group` of D > 1 ranks holding the same parameters, i.e. the DP group): the
// model's flat buffer is cut into D contiguous chunks (rank r owns [r·C, (r+1)·C), C = ⌈P/D⌉
// rounded up to 64 elements, the last one shorter), and each rank keeps m, v (and the master)
// only for its chunk, dividing the optimizer state by D. The gradients are complete on every rank
// (all-reduced before the step); each rank updates its chunk of the parameters, then every chunk
// is broadcast from its owner, in place, so all ranks leave step() with identical parameters. The
// update of an element does not depend on D, so a ZeRO-1 run equals the unsharded one bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/qwen3_moe.h"
#include "parallel/communicator.h"
#include "train/recipe.h"

namespace mf::train {

class DistContext;

class AdamW {
 public:
    // `mixed`: keep fp32 master weights and moments (GPU only; on the CPU everything is fp32 anyway).
    // `zero_group`: shard the state over it (ZeRO-1, above); null or size 1: every rank keeps it all.
    AdamW(model::Qwen3Moe& model, const Recipe::Optim& optim, bool mixed, parallel::Communicator* zero_group = nullptr);
    // One update with learning rate `lr`; increments the step count first (bias correction t ≥ 1).
    // Collective over the ZeRO group.
    void step(double lr);
    int64_t step_count() const { return step_; }
    void set_step_count(int64_t s) { step_ = s; }

    // This rank's chunk [chunk_begin(), chunk_end()) of the flat buffer (all of it without ZeRO) as
    // host f32, for checkpoints: the master parameters (the model's own on the CPU and under bf16,
    // the fp32 master under mixed) and the two moments. Local: no communication.
    void get_chunk(std::vector<float>& master, std::vector<float>& m, std::vector<float>& v) const;
    int64_t chunk_begin() const { return lo_; }
    int64_t chunk_end() const { return hi_; }
    // From whole vectors in the model's table layout; each rank keeps its chunk.
    void set_state(const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v);
    // Bytes of optimizer state this rank holds (m, v and the master when there is one).
    size_t state_bytes() const;

 private:
    int64_t chunk_lo(int r) const;
    int64_t chunk_hi(int r) const;

    model::Qwen3Moe& model_;
    Recipe::Optim optim_;
    parallel::Communicator* zero_ = nullptr;
    int zero_rank_ = 0, zero_size_ = 1;
    int64_t total_, chunk_, lo_, hi_;  // this rank's chunk [lo_, hi_) of the flat buffer
    DType state_dtype_;
    Buffer master_, m_, v_;  // [hi_ - lo_]; master_ empty unless mixed on the GPU
    std::vector<bool> decay_;  // per parameter spec
    int64_t step_ = 0;
};

// Global L2 norm of the model's gradients, then torch's clipping in place when max_norm > 0;
// returns the norm before clipping. Under expert parallelism (`dist` with EP > 1) the norm covers
// every expert: the replicated region counted once, the expert regions summed over the EP group,
// so every rank gets the same norm.
double clip_grad_norm(model::Qwen3Moe& model, double max_norm, DistContext* dist = nullptr);

}  // namespace mf::train
