// The parameter store: a model's parameters and gradients as two flat buffers, sliced by the
// ParamTable (model/param_table.h), on one device in the placement's dtypes. This is what the
// optimizer, data parallelism, ZeRO-1 and checkpoints work on; the runner (model/causal_lm.h) reads
// views of it and knows the architecture, the store does not.
//
// Gradients accumulate (+=) across micro-batches until zero_grads(). On the GPU that memset goes to the
// background stream (ops::background), beside the next forward; readers put their work behind it. The
// stacked expert gradients are not cleared but marked per layer: the next backward writes a marked
// layer's instead of adding to them (the runner asks take_expert_mark), which spares the memset and the
// GEMMs' read of the old values (the largest part of the gradients under EP); grad(), grads_tensor()
// and grad_data() zero those of layers whose backward has not run since, so readers always see
// defined values.
//
// Parameters still being written when an optimizer step returns (an update on the background stream, a
// ZeRO-1 broadcast on a side stream, both beside the next forward) are registered per stage: where the
// forward first reads them (kStageEmbedding: the embedding; layer l; kStageHead: the final norm and an
// untied head). The forward settles a stage's waits right before its first op; params_tensor(),
// param() and param_data() settle all of them.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "model/param_table.h"
#include "ops/ops.h"

namespace mf::model {

// Where a model lives and in which dtypes: CPU = f32 everywhere (the reference); CUDA = bf16
// parameters and activations with f32 router/softmax/loss math, gradients bf16 or f32 (the
// precision policy; fp32 master weights, when used, belong to the optimizer).
// `shard`: the experts this rank holds under expert parallelism (param_table.h).
struct ModelPlacement {
    Device device = Device::cpu;
    // bf16 on the GPU is the bf16 policy: bf16 gradients, and the LM head's logits rounded to bf16
    // before the loss, as a bf16 HF model computes them.
    DType grad_dtype = DType::f32;
    ExpertShard shard = {};
};

class ParamStore {
 public:
    ParamStore(ParamTable table, int64_t num_layers, ModelPlacement placement);
    ParamStore(const ParamStore&) = delete;
    ParamStore& operator=(const ParamStore&) = delete;

    const ParamTable& table() const { return table_; }
    const ModelPlacement& placement() const { return placement_; }
    Device device() const { return placement_.device; }
    DType param_dtype() const { return param_dtype_; }
    DType grad_dtype() const { return placement_.grad_dtype; }

    Tensor params_tensor() const;                    // [P], after every pending write
    Tensor grads_tensor() const;                     // [P], defined everywhere
    Tensor grads_tensor_in_backward() const;         // [P] without zeroing marked expert gradients
    Tensor param(std::string_view name) const;       // after every pending write
    Tensor param_view(std::string_view name) const;  // without the wait (the forward settles stages itself)
    Tensor grad(std::string_view name) const;
    Tensor grad_view(std::string_view name) const;  // without settling (the backward's own views)
    float* param_data();                            // CPU only
    float* grad_data();                             // CPU only

    void zero_grads();
    // True (and cleared) when layer l's expert gradients are marked: its backward writes them.
    bool take_expert_mark(int64_t layer);
    bool expert_marked(int64_t layer) const;
    void settle_grads() const;                      // the op stream waits for a pending zero_grads
    void settle_expert_grads(int64_t layer) const;  // zeroes a marked layer's expert gradients (-1: all)

    static constexpr int64_t kStageEmbedding = -2, kStageHead = -1;
    int64_t param_stage(const ParamSpec& spec) const;
    void params_pending(int64_t stage, std::function<void()> wait);
    void settle_stage(int64_t stage) const;
    void settle_params() const;

    void set_params_from_host(const float* src);
    void get_params_to_host(float* dst) const;
    // HF's _init_weights by role: norms 1, biases 0, every other parameter normal(0, std); drawn over the
    // whole model in table order, so every EP shard gets its slice of the same values.
    // `zero_rows`: embedding rows zeroed as well (the padding row, ModelSpec::padding_idx).
    void init_random(uint64_t seed, float std, const std::vector<int64_t>& zero_rows = {});

 private:
    ParamTable table_;
    int64_t num_layers_;
    ModelPlacement placement_;
    DType param_dtype_;
    Buffer params_, grads_;
    mutable ops::BackgroundTicket zeroing_ = 0;
    mutable std::vector<char> expert_marked_;                          // per layer
    mutable std::vector<std::vector<std::function<void()>>> pending_;  // per stage, stage + 2
};

}  // namespace mf::model
