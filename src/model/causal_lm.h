// The generic causal LM runner: executes a ModelSpec (model/spec.h) with hand-written backward.
//
//   x = embed(ids)
//   L × [ for each branch of the layer: x += op(rmsnorm(x)) ]   op = attention | dense MLP | dropless MoE
//   loss = mean CE(lm_head(rmsnorm(x)), targets) + coef · aux    (aux only when HF would add it:
//                                                                  config.output_router_logits)
// The aux loss is HF's load_balancing_loss_func: with counts C_e of top-k assignments and sums
// P_e of router probabilities over the (non-padding) rows of ALL MoE layers together, R rows,
//   aux = E · Σ_e (C_e / R) · (P_e / R).
//
// Memory: the parameters and gradients live in a ParamStore (model/param_store.h); the activations
// in an arena whose capacity is planned by replaying the step's allocation sequence on a measuring
// arena. Parameter gradients accumulate (+=) across micro-batches; the trainer zeroes them after each
// optimizer step. Nothing here knows an architecture: the spec says which blocks run, with which
// options, under which HF names.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "data/batch.h"
#include "model/attention_block.h"
#include "model/ffn_blocks.h"
#include "model/param_store.h"
#include "model/param_table.h"
#include "model/spec.h"
#include "ops/ops.h"
#include "parallel/communicator.h"

namespace mf::model {

struct StepStats {
    double ce_sum = 0;        // Σ of per-token CE over counted targets
    int64_t num_targets = 0;  // targets that count in the CE
    double aux = 0;           // the aux (load-balancing) loss of this batch, unscaled
};

// Loss weights for backward: d(ce_scale · ce_sum + aux_scale · aux).
struct LossScales {
    double ce = 0;
    double aux = 0;
};

// The parameter layout (HF v5 names, roles, shapes, offsets, on-disk storage) of a spec, without
// allocating anything; with a shard, the table of one EP rank (its E/S experts of every MoE layer).
ParamTable model_param_table(const ModelSpec& spec, ExpertShard shard = {});
// Parameters a single token touches (top-k of the experts).
int64_t model_active_params(const ModelSpec& spec, const ParamTable& table);
// Model FLOPs per token for training at sequence length T (BENCHMARKS.md formula).
double model_flops_per_token(const ModelSpec& spec, int64_t T);

// Activation recomputation (train.recompute): `none` keeps every layer's activations for the
// backward; `moe` keeps one set of MoE expert activations (the largest: N·K rows) and recomputes
// each MoE block's forward inside its backward; `full` keeps only the layer inputs and recomputes
// each whole layer. The kernels are deterministic, so recomputed values equal the originals.
enum class Recompute { none, moe, full };
Recompute parse_recompute(std::string_view name);

class CausalLM {
 public:
    explicit CausalLM(ModelSpec spec, ModelPlacement placement = {});
    ~CausalLM();
    CausalLM(const CausalLM&) = delete;
    CausalLM& operator=(const CausalLM&) = delete;

    const ModelSpec& spec() const { return spec_; }
    ParamStore& store() { return store_; }
    const ParamStore& store() const { return store_; }
    // The store's accessors (model/param_store.h), for the trainer's convenience.
    const ParamTable& params() const { return store_.table(); }
    Device device() const { return store_.device(); }
    DType param_dtype() const { return store_.param_dtype(); }
    DType grad_dtype() const { return store_.grad_dtype(); }
    const ExpertShard& expert_shard() const { return store_.placement().shard; }
    Tensor params_tensor() const { return store_.params_tensor(); }
    Tensor grads_tensor() const { return store_.grads_tensor(); }
    // grads_tensor() for the gradient hook (set_grad_hook) while a backward runs: the expert
    // gradients of layers whose backward has not run since zero_grads() are left as they are
    // (undefined; see ParamStore), so the hook may read only gradients already finished.
    Tensor grads_tensor_in_backward() const { return store_.grads_tensor_in_backward(); }
    float* param_data() { return store_.param_data(); }
    float* grad_data() { return store_.grad_data(); }
    Tensor param(std::string_view name) const { return store_.param(name); }
    Tensor grad(std::string_view name) const { return store_.grad(name); }
    void zero_grads() { store_.zero_grads(); }
    static constexpr int64_t kStageEmbedding = ParamStore::kStageEmbedding, kStageHead = ParamStore::kStageHead;
    int64_t param_stage(const ParamSpec& spec) const { return store_.param_stage(spec); }
    void params_pending(int64_t stage, std::function<void()> wait) { store_.params_pending(stage, std::move(wait)); }
    void set_params_from_host(const float* src) { store_.set_params_from_host(src); }
    void get_params_to_host(float* dst) const { store_.get_params_to_host(dst); }
    // HF's init by role (ParamStore::init_random), the padding row of the embedding zeroed.
    void init_random(uint64_t seed, float std) {
        store_.init_random(seed, std,
                           spec_.padding_idx >= 0 ? std::vector<int64_t>{spec_.padding_idx} : std::vector<int64_t>{});
    }

    // Expert parallelism over `ep_group`: the model holds experts [rank·E/S, (rank+1)·E/S) of every
    // MoE layer (its placement's shard, which must match the group's rank and size) and computes
    // them for the tokens the group's ranks route to them (model/ep_exchange.h). Its expert
    // gradients are this rank's contributions; summing them over the ranks holding the same shard
    // (the DP group) and the replicated region over the world gives the full gradient
    // (train/distributed.h). Every rank of the group must call step() in lockstep. The group must
    // outlive the model's use. A sharded model must have its group set before step().
    // chunks: the EP pipeline's chunk count (MoeDims::ep_chunks, model/ep_exchange.h).
    void set_expert_parallel(parallel::Communicator* ep_group, int64_t chunks = 2);

    // Called during the backward of step() as gradients become final for this micro-batch: with
    // kGradsHead once the final norm's and the untied LM head's are (right after the loss), with l
    // after layer l's (l = L-1 down to 0), and last with kGradsEmbedding (or
    // kGradsEmbeddingAndHead for tied embeddings, whose head gradient is the embedding's). The
    // calls come while the device may still be computing them: a stream-ordered consumer (an NCCL
    // reduction behind an event) is what it is for. An empty function turns it off.
    static constexpr int64_t kGradsHead = -1, kGradsEmbedding = -2, kGradsEmbeddingAndHead = -3;
    void set_grad_hook(std::function<void(int64_t)> hook) { grad_hook_ = std::move(hook); }
    // Square sums formed by the backward itself, for the clipping norm: while set (`slots`: f64, one
    // per spec of params().specs(), on the model's device; `wanted`: a flag per spec), each MoE
    // layer's backward writes Σ g² of its stacked expert gradients whose flag is set into their
    // slots as its weight-gradient GEMMs store them (moe_block_backward's squares), so no later
    // pass reads those gradients again. Returns the flags of the specs it will fill (the flagged
    // stacked expert specs); the caller reads their slots after the backward. Empty tensor: off.
    std::vector<bool> set_grad_square_sums(const Tensor& slots, const std::vector<bool>& wanted);

    // The embedding gradient under data parallelism, sparse: instead of the dense [V, H] gradient being
    // reduced, every rank gathers every rank's token ids and their output-gradient rows
    // (gather(all, mine): all = the `ranks` ranks' `mine` one after the other, in rank order, on every
    // rank; a stream-ordered all-gather) and adds all of them into its embedding gradient. The
    // gradient then comes out the same on every rank, each id's rows summed in fp32 in (rank, token)
    // order, as one process holding all the rows would sum them; a step moves N·H values per rank
    // instead of V·H. Every rank must call step() with the same B·T. Not for tied embeddings (the
    // head's dense gradient shares the tensor). An empty function turns it off.
    using RowGather = std::function<void(const Tensor& all, const Tensor& mine)>;
    void set_embedding_row_gather(RowGather gather, int ranks);

    void set_recompute(Recompute r);
    Recompute recompute() const { return recompute_; }

    // Forward over the batch; with `scales` also the backward (gradients accumulate). When
    // `logits` is given it receives [N, V] f32 logits on the host (tests and small evaluations).
    StepStats step(const data::Batch& batch, const LossScales* scales, float* logits = nullptr);

    // Where a non-finite value first appears: the first layer whose activations hold a NaN/Inf
    // in the last forward, and the first parameter (in layer order) whose gradient does.
    std::string locate_nonfinite_activation() const;
    std::string locate_nonfinite_gradient() const;

    // The top-k experts [N·K] of MoE layer l in the last forward (host copy), e.g. to see whether a
    // perturbation changed the routing. Needs recompute none (otherwise the layers share one set).
    std::vector<int32_t> routing(int64_t layer) const;
    // Routing replay (CPU models): from the next forward on, MoE layer l's tokens go to `experts`
    // ([N·K], what routing() of another run returned) instead of their own top-k, weighted by this
    // model's router; empty: the router chooses again. A reference run follows a bf16 run's choice
    // at near-ties this way, so the two compare the same computation (tests/gpu/test_gpu_step.cpp).
    void set_routing_replay(int64_t layer, std::vector<int32_t> experts);

    // Bytes of activation memory the last step used (the arena's high-water mark, plus the EP row
    // stores, which grow to the largest routing met).
    size_t activation_bytes() const;

    // Parameter counts: the elements of this rank's flat buffer (padding included, see param_table.h),
    // the parameters of the whole model, and those a single token touches (top-k experts only).
    int64_t num_params() const { return params().total(); }
    int64_t num_params_total() const { return total_params_; }
    int64_t num_active_params() const { return model_active_params(spec_, params()); }
    double flops_per_token(int64_t T) const { return model_flops_per_token(spec_, T); }

 private:
    struct BranchState;
    struct Layer;
    struct Workspace;
    void build_layers();
    void plan(int64_t B, int64_t T);           // sizes the arena (once per shape) and allocates the step
    void allocate_step(int64_t B, int64_t T);  // the step's allocation sequence
    void validate(const data::Batch& batch) const;
    void layer_forward(int64_t l, int64_t B, int64_t T);  // layer l's forward from resid[l] into its activations
    void branch_forward(int64_t l, size_t b, int64_t B, int64_t T);
    // Branch b of layer l backward: dy (the gradient of its output) -> dx (its input's), both full.
    void branch_backward(int64_t l, size_t b, int64_t B, int64_t T, const Tensor& dx, const Tensor& dy, bool aux_grad);
    MoeDims moe_dims(const MoeBranch& m) const;  // with this model's EP group
    void zero_padding_rows(const data::Batch& batch, const Tensor& d_embed) const;

    ModelSpec spec_;
    DType act_dtype_;
    ParamStore store_;
    int64_t total_params_ = 0;
    std::vector<Layer> layers_;
    std::unique_ptr<Workspace> ws_;
    Recompute recompute_ = Recompute::none;
    parallel::Communicator* ep_ = nullptr;
    int64_t ep_chunks_ = 1;
    std::function<void(int64_t)> grad_hook_;
    Tensor grad_square_slots_;  // set_grad_square_sums
    std::vector<bool> grad_square_wanted_;
    RowGather row_gather_;
    int row_gather_ranks_ = 1;
    Buffer gathered_rows_;  // [ranks · N] ids (i32), then [ranks · N, H] output-gradient rows
};

}  // namespace mf::model
