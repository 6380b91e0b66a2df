// AdamW over the model's flat parameter buffer (torch.optim.AdamW semantics), with parameters
// whose HF name matches an `optim.no_decay` pattern excluded from weight decay, and gradient
// clipping by the global norm (torch.nn.utils.clip_grad_norm_: grads *= min(1, clip/(norm+1e-6))),
// the clipping factor applied inside the update (step's grad_scale) rather than by a pass over the
// gradients: the gradient buffer itself is left unscaled.
//
// State follows the precision policy (DESIGN.md): on the CPU everything is f32 and the model's
// parameters are the master copy; on the GPU `bf16` keeps m and v in bf16 next to the bf16
// parameters (8 bytes per parameter with the gradients), `mixed` keeps an fp32 master copy and
// fp32 m and v (16 bytes per parameter) and writes the rounded master into the bf16 parameters.
//
// ZeRO-1: the optimizer state of each parameter is sharded over the ranks holding that parameter
// (its replica group): the replicated region of the flat buffer (param_table.h) over
// `replicated_group` (the world), the expert region over `expert_group` (the DP group; without EP
// also the world). A region is cut into segments, one per forward stage (CausalLM::param_stage: the
// embedding, each layer's parameters of that region, the final norm and head), and a segment of P
// elements over a group of D ranks into D contiguous chunks (rank r owns [r·C, (r+1)·C) of it,
// C = ⌈P/D⌉ rounded up to 64 elements, the last one shorter); each rank keeps m, v (and the master)
// for its chunks only. The gradients are complete on every rank (reduced before the step); each
// rank updates its chunk of a segment, then the segment's chunks are broadcast from their owners
// over the region's group, in place, asynchronously: step() returns with the broadcasts running
// and registers each with the model (params_pending), so the next forward's stage waits for its
// own segment and the rest of the broadcasts run beside it. Splitting by stage keeps the first
// stage's wait short (the embedding, updated and sent by all ranks at once) and lets every rank's
// links carry its share. A region no other rank takes part in (one process, EP over the whole
// world, or ZeRO off) needs no broadcast: on the GPU its update goes to the background stream,
// segment by segment, and the forward's stages wait for theirs the same way. An element's update
// does not depend on the sharding, so a ZeRO-1 run equals the unsharded one bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "model/causal_lm.h"
#include "parallel/communicator.h"
#include "train/recipe.h"

namespace mf::train {

class DistContext;

class AdamW {
 public:
    // `mixed`: keep fp32 master weights and moments (GPU only; on the CPU everything is fp32 anyway).
    // The groups: shard the state of each region over it (ZeRO-1, above); null or size 1: this rank
    // keeps that region's state whole.
    AdamW(model::CausalLM& model, const Recipe::Optim& optim, bool mixed,
          parallel::Communicator* replicated_group = nullptr, parallel::Communicator* expert_group = nullptr);
    ~AdamW();  // orders the model's stream after the writes still pending (see step)
    AdamW(const AdamW&) = delete;
    AdamW& operator=(const AdamW&) = delete;
    // One update with learning rate `lr`, every gradient multiplied by `grad_scale` first (fp32; the
    // clipping coefficient, see clip_coefficient); increments the step count first (bias correction
    // t ≥ 1). Collective over the ZeRO groups. It may return before the parameters are written (see
    // above): the model's forward, params_tensor() and param() order themselves after the writes;
    // the groups' wait_async() (DistContext::finish_grad_sync) polls the broadcasts with the timeout.
    void step(double lr, double grad_scale = 1.0);
    int64_t step_count() const { return step_; }
    void set_step_count(int64_t s) { step_ = s; }

    // The ranges of the flat buffer whose state this rank holds (one per segment, ascending; the
    // whole segment without ZeRO; empty ranges are left out).
    struct Range {
        int64_t begin, end;
        int region;    // 0: the replicated region, 1: the experts
        bool sharded;  // ZeRO-1 over the region's group; else every replica owns the whole region
    };
    const std::vector<Range>& owned() const { return owned_; }
    // The state of owned() as host f32, the ranges one after the other, for checkpoints: the master
    // parameters (the model's own on the CPU and under bf16, the fp32 master under mixed) and the
    // two moments. Local: no communication.
    void get_owned(std::vector<float>& master, std::vector<float>& m, std::vector<float>& v) const;
    // From whole vectors in the model's table layout; each rank keeps what it owns.
    void set_state(const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v);
    // Bytes of optimizer state this rank holds (m, v and the master when there is one).
    size_t state_bytes() const;

 private:
    // One region of the flat buffer and the group its state is sharded over.
    struct Region {
        parallel::Communicator* group = nullptr;  // null: not sharded
        int rank = 0, size = 1;
    };
    // A run of the flat buffer first read by one forward stage, inside one region, cut into its
    // group's chunks.
    struct Segment {
        int64_t begin = 0, end = 0;
        int64_t stage = 0;  // CausalLM::param_stage
        int region = 0;
        int64_t chunk = 0;          // elements per rank
        std::vector<size_t> specs;  // the parameters in it (indices into the table's specs)
        int64_t lo(int r) const { return std::min(end, begin + static_cast<int64_t>(r) * chunk); }
        int64_t hi(int r) const { return std::min(end, lo(r) + chunk); }
    };
    // Runs f(range, offset of its state in m_/v_/master_) over the owned ranges.
    template <typename F>
    void for_owned(F&& f) const;

    model::CausalLM& model_;
    Recipe::Optim optim_;
    int64_t total_;
    Region regions_[2];                  // replicated, experts
    std::vector<Segment> segments_;      // in buffer order
    std::vector<Range> owned_;           // this rank's chunk of each segment (none where empty)
    std::vector<size_t> owned_segment_;  // the segment of each owned range
    int64_t owned_elems_ = 0;
    DType state_dtype_;
    Buffer master_, m_, v_;    // [owned_elems_]; master_ empty unless mixed on the GPU
    std::vector<bool> decay_;  // per parameter spec
    int64_t step_ = 0;
};

// Global L2 norm of the model's gradients. Under expert parallelism (`dist` with EP > 1) the norm
// covers every expert: the replicated region counted once, the expert regions summed over the EP
// group, so every rank gets the same norm.
// The sums come per parameter tensor (gradient_square_sums), added in table order in double, so the
// norm does not depend on where each was computed.
double grad_norm(model::CausalLM& model, DistContext* dist = nullptr);

// Σ g² of each parameter's gradient, one double per spec in table order (each the value
// ops::sum_squares gives for that tensor), read back to the host at once. `sums` (f64 [specs] on the
// model's device, or undefined for a scratch of its own) receives them; the specs marked in `done`
// were filled there already (in the background during the backward, DistContext) and are not
// computed again.
std::vector<double> gradient_square_sums(model::CausalLM& model, const Tensor& sums = Tensor(),
                                         const std::vector<bool>& done = {});
// sums[i] = Σ g² of parameter i's gradient for each i in `which` (grads: the model's gradient
// buffer; sums: f64 [specs] on its device), in one ops::sum_squares_to call, left on the device.
void gradient_square_sums_to(const Tensor& sums, const Tensor& grads, const std::vector<model::ParamSpec>& specs,
                             std::span<const size_t> which);

// torch's clipping factor for a global norm: min(1, max_norm / (norm + 1e-6)) when max_norm > 0 and
// the norm is finite, else 1. Passed to AdamW::step as its grad_scale.
double clip_coefficient(double norm, double max_norm);

}  // namespace mf::train
