// Qwen3-MoE (HF model_type "qwen3_moe"), built from blocks, with a hand-written backward.
//
//   x = embed(ids)
//   L × [ x += attention(rmsnorm(x));  x += ffn(rmsnorm(x)) ]     ffn = dropless MoE or dense MLP
//   loss = mean CE(lm_head(rmsnorm(x)), targets) + coef · aux    (aux only when HF would add it:
//                                                                  config.output_router_logits)
// The aux loss is HF's load_balancing_loss_func: with counts C_e of top-k assignments and sums
// P_e of router probabilities over the (non-padding) rows of ALL MoE layers together, R rows,
//   aux = E · Σ_e (C_e / R) · (P_e / R).
//
// Memory: one flat fp32 parameter buffer, one gradient buffer of the same layout, and an
// activation arena whose capacity is planned by replaying the step's allocation sequence on a
// measuring arena. Parameter gradients accumulate (+=) across micro-batches; the trainer zeroes
// them after each optimizer step.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "data/batch.h"
#include "model/attention_block.h"
#include "model/ffn_blocks.h"
#include "model/param_table.h"
#include "model/qwen3_moe_config.h"
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

// The parameter layout (HF v5 names, shapes, offsets) of a config, without allocating anything;
// with a shard, the table of one EP rank (its E/S experts of every MoE layer).
ParamTable qwen3_moe_param_table(const Qwen3MoeConfig& c, ExpertShard shard = {});
// Parameters a single token touches (top-k of the experts).
int64_t qwen3_moe_active_params(const Qwen3MoeConfig& c, const ParamTable& table);
// Model FLOPs per token for training at sequence length T (BENCHMARKS.md formula).
double qwen3_moe_flops_per_token(const Qwen3MoeConfig& c, int64_t T);

// Where the model lives and in which dtypes: CPU = f32 everywhere (the reference); CUDA = bf16
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

// Activation recomputation (train.recompute): `none` keeps every layer's activations for the
// backward; `moe` keeps one set of MoE expert activations (the largest: N·K rows) and recomputes
// each MoE block's forward inside its backward; `full` keeps only the layer inputs and recomputes
// each whole layer. The kernels are deterministic, so recomputed values equal the originals.
enum class Recompute { none, moe, full };
Recompute parse_recompute(std::string_view name);

class Qwen3Moe {
 public:
    explicit Qwen3Moe(Qwen3MoeConfig config, ModelPlacement placement = {});
    ~Qwen3Moe();
    Qwen3Moe(const Qwen3Moe&) = delete;
    Qwen3Moe& operator=(const Qwen3Moe&) = delete;

    const Qwen3MoeConfig& config() const { return config_; }
    const ParamTable& params() const { return table_; }
    Device device() const { return placement_.device; }
    DType param_dtype() const { return param_dtype_; }
    DType grad_dtype() const { return placement_.grad_dtype; }
    const ExpertShard& expert_shard() const { return placement_.shard; }
    // The flat buffers as tensors [P] (device and dtype as placed).
    Tensor params_tensor() const {
        settle_params();
        return params_.as(param_dtype_, {table_.total()});
    }
    Tensor grads_tensor() const {
        settle_grads();
        settle_expert_grads(-1);
        return grads_.as(placement_.grad_dtype, {table_.total()});
    }
    // grads_tensor() for the gradient hook (set_grad_hook) while a backward runs: the expert
    // gradients of layers whose backward has not run since zero_grads() are left as they are
    // (undefined; see zero_grads), so the hook may read only gradients already finished.
    Tensor grads_tensor_in_backward() const {
        settle_grads();
        return grads_.as(placement_.grad_dtype, {table_.total()});
    }
    // CPU models only: the flat f32 buffers.
    float* param_data();
    float* grad_data();
    Tensor param(std::string_view name) const;
    Tensor grad(std::string_view name) const;
    // Zeroes the gradients. On the GPU the memset goes to the background stream (ops::background), so
    // that it runs beside the next step's forward; step(), grad() and grads_tensor() put their work
    // behind it. The stacked expert gradients are not cleared but marked: the next backward writes
    // each MoE layer's instead of adding to them (moe_block_backward, accumulate_expert_grads false),
    // which spares the memset and the GEMMs' read of the old values (the largest part of the
    // gradients under EP); grad(), grads_tensor() and grad_data() zero those of layers whose backward
    // has not run since (e.g. zero_grads() then a read), so readers always see defined values.
    void zero_grads();
    // Parameters still being written when the optimizer step returns (train::AdamW: an update on the
    // background stream, a ZeRO-1 broadcast on a communicator's side stream, both running beside the
    // next forward). A parameter's stage is where the forward first reads it: kStageEmbedding (the
    // embedding), layer l (0..L-1: layer l's own), kStageHead (the final norm and an untied head).
    // params_pending(stage, wait) registers `wait`, which orders the op stream after that write;
    // the forward calls a stage's waits (once) right before the stage's first op, and
    // params_tensor(), param() and param_data() call every pending one.
    static constexpr int64_t kStageEmbedding = -2, kStageHead = -1;
    int64_t param_stage(const ParamSpec& spec) const;
    void params_pending(int64_t stage, std::function<void()> wait);
    // Parameters to and from host f32 (converted as the placement needs).
    void set_params_from_host(const float* src);
    void get_params_to_host(float* dst) const;

    // Expert parallelism over `ep_group`: the model holds experts [rank·E/S, (rank+1)·E/S) of every
    // MoE layer (its placement's shard, which must match the group's rank and size) and computes
    // them for the tokens the group's ranks route to them (model/ffn_blocks.h). Its expert
    // gradients are this rank's contributions; summing them over the ranks holding the same shard
    // (the DP group) and the replicated region over the world gives the full gradient
    // (train/distributed.h). Every rank of the group must call step() in lockstep. The group must
    // outlive the model's use. A sharded model must have its group set before step().
    // chunks: the EP pipeline's chunk count (MoeDims::ep_chunks, model/ffn_blocks.h).
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

    // HF-style init: normal(0, std) for every matrix, ones for norms; deterministic in `seed`.
    void init_random(uint64_t seed, float std);

    // Forward over the batch; with `scales` also the backward (gradients accumulate). When
    // `logits` is given it receives [N, V] f32 logits on the host (tests and small evaluations).
    StepStats step(const data::Batch& batch, const LossScales* scales, float* logits = nullptr);

    // Where a non-finite value first appears: the first layer whose activations hold a NaN/Inf
    // in the last forward, and the first parameter (in layer order) whose gradient does.
    std::string locate_nonfinite_activation() const;
    std::string locate_nonfinite_gradient() const;

    // Bytes of activation memory the last step used (the arena's high-water mark, plus the EP row
    // stores, which grow to the largest routing met).
    size_t activation_bytes() const;

    // Parameter counts: held by this rank (its buffer), of the whole model, and those a single token
    // touches (top-k experts only).
    int64_t num_params() const { return table_.total(); }
    int64_t num_params_total() const { return total_params_; }
    int64_t num_active_params() const { return qwen3_moe_active_params(config_, table_); }
    double flops_per_token(int64_t T) const { return qwen3_moe_flops_per_token(config_, T); }

 private:
    struct Layer;
    struct Workspace;
    void build_layers();
    void plan(int64_t B, int64_t T);           // sizes the arena (once per shape) and allocates the step
    void allocate_step(int64_t B, int64_t T);  // the step's allocation sequence
    void validate(const data::Batch& batch) const;
    void settle_grads() const;   // the op stream waits for a pending background zero_grads
    void settle_expert_grads(int64_t layer) const;  // zeroes a marked layer's expert gradients (-1: all)
    void settle_params() const;  // ... and for every pending parameter write (params_pending)
    void settle_stage(int64_t stage) const;  // ... for the writes pending on one stage
    Tensor param_view(std::string_view name) const;  // param() without the wait
    // A parameter outside every layer (embedding, final norm, head), without the wait (the forward
    // settles its stage before the first use).
    Tensor outer_param(std::string_view name) const;
    void layer_forward(int64_t l, int64_t B, int64_t T);  // layer l's forward from resid[l] into its activations

    Qwen3MoeConfig config_;
    ModelPlacement placement_;
    DType param_dtype_, act_dtype_;
    ParamTable table_;
    int64_t total_params_ = 0;
    Buffer params_, grads_;
    std::vector<Layer> layers_;
    std::unique_ptr<Workspace> ws_;
    Recompute recompute_ = Recompute::none;
    parallel::Communicator* ep_ = nullptr;
    int64_t ep_chunks_ = 1;
    std::function<void(int64_t)> grad_hook_;
    Tensor grad_square_slots_;                 // set_grad_square_sums
    std::vector<bool> grad_square_wanted_;
    mutable ops::BackgroundTicket zeroing_ = 0;
    mutable std::vector<char> expert_grads_marked_;  // per layer: expert gradients undefined until written
    mutable std::vector<std::vector<std::function<void()>>> params_pending_;  // per stage, stage + 2
    RowGather row_gather_;
    int row_gather_ranks_ = 1;
    Buffer gathered_rows_;  // [ranks · N] ids (i32), then [ranks · N, H] output-gradient rows
};

}  // namespace mf::model
