// The trainer's view of a multi-process run: who this rank is, and the few collectives one
// optimizer step needs, on top of parallel::Communicator.
//
// A run is distributed when the environment says WORLD_SIZE > 1 (moeforge launch, torchrun, SLURM;
// parallel/rendezvous.h). Then the world communicator is TCP on the CPU device and NCCL on cuda
// (the NCCL one is created before the model so that it selects GPU LOCAL_RANK first), and the EP/DP
// process groups come from make_process_groups(world, dist.ep_size). Without WORLD_SIZE > 1 there is
// no communicator and every collective below is the identity, so a single-process run computes
// exactly what it did before distribution existed.
//
// Data: every rank reads its own rows of each global micro-batch (data::LoaderShard{rank, world}):
// the batch one rank with micro_batch × world would see, split in rank order. Every rank holds
// different tokens, so replicated parameters' gradients sum over the whole world (and, under EP,
// expert gradients over the DP group, whose ranks hold the same experts).
//
// Determinism: the scalar sums (sum_f64) gather every rank's values bit for bit and add them in
// rank order in double on every rank, so all ranks get the same bits; the gradient all-reduce is
// the communicator's fixed-order sum (TCP: fp32 in rank order at group rank 0), so a DP run is
// bitwise reproducible from run to run and every rank holds identical gradients.
// The gradient reduction overlapping the backward (begin/finish_grad_sync) sums bf16 in bf16 on
// NCCL (one rounding of the exact sum for 2 ranks; more for larger groups) and fp32 as fp32.
// Seen on 2 H200s over NCCL (tiny model, 10 steps, precision mixed): DP=2 identical to one GPU on the
// same rows; EP=2 within bf16 rounding of it (tests/dist/test_gpu_parallel_train.cpp).
// Failures: on TCP any collective throws mf::Error after dist.timeout_s without progress or at once
// when a peer's connection drops; on NCCL the rank prints the diagnostic and ends (nccl_communicator.h),
// and host waits on the GPU are bounded by the same timeout (core/tensor.h wait_for_stream).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/causal_lm.h"
#include "parallel/communicator.h"
#include "train/hf_checkpoint.h"
#include "train/recipe.h"

namespace mf::train {

// The communicators a collective can run over (communicator.h: EP groups are consecutive ranks,
// DP groups strided by the EP size).
enum class Group { world, ep, dp };

class DistContext {
 public:
    // Reads the process environment; for WORLD_SIZE > 1 runs the rendezvous and builds the world
    // communicator and the process groups (collective: every rank must call it). Errors name the
    // recipe key (dist.ep_size) or the environment variable at fault.
    static std::unique_ptr<DistContext> from_environment(const Recipe& recipe, Device device);
    // A single-process context (no communicator).
    DistContext() = default;
    ~DistContext();
    DistContext(const DistContext&) = delete;
    DistContext& operator=(const DistContext&) = delete;

    int rank() const { return rank_; }
    int world_size() const { return layout_.world_size; }
    int ep_size() const { return layout_.ep_size; }
    bool distributed() const { return layout_.world_size > 1; }
    // Rank 0 writes logs, metrics, checkpoints and the export; the others write nothing.
    bool is_main() const { return rank_ == 0; }
    // "world 2 (dp 2 x ep 1, tcp)" for the start line; "" for a single process.
    std::string describe() const;

    // Element-wise sums over a group, identical bits on every rank of it ([in] this rank's values,
    // returns the sums in the same order).
    std::vector<double> sum_f64(std::span<const double> values, Group group = Group::world);
    int64_t sum_i64(int64_t value);
    // The model's gradients reduced in place: the replicated region (param_table.h) summed over the
    // world, the expert region over the DP group (the ranks holding the same experts; the EP ranks'
    // expert regions hold different experts). On return every rank of a DP group holds the same
    // gradient buffer, and the replicated region is the same everywhere. The reduction overlaps the
    // backward: begin_grad_sync installs the model's grad
    // hook (CausalLM::set_grad_hook) so that the next step() starts each layer's reductions as soon
    // as its backward is enqueued (all_reduce_sum_async: on NCCL a side stream overlapping the
    // backward of the layers below); finish_grad_sync reduces whatever was not started, waits for
    // all, and removes the hook. Call them around the LAST micro-batch of an optimizer step (the
    // gradients must be complete sums over the micro-batches before they are reduced). In a single
    // process there is nothing to reduce, and the hook only starts the square sums (below).
    void begin_grad_sync(model::CausalLM& model);
    void finish_grad_sync(model::CausalLM& model);
    // For a distributed run with untied embeddings: the model gathers every rank's embedding-gradient
    // rows over the world (CausalLM::set_embedding_row_gather), so each micro-batch's embedding gradient
    // is complete and the same on every rank, and the grad sync leaves it out (N·H values per rank
    // and micro-batch move instead of the dense V·H all-reduce at the end of the backward). Call once
    // on every rank after the model is built; the model must not outlive this context. A no-op for a
    // single process or tied embeddings.
    void gather_embedding_grads(model::CausalLM& model);
    // train::gradient_square_sums for this rank's gradients after finish_grad_sync: the tensors that
    // need no reduction (all of them in a single process; the expert ones under EP over the whole
    // world, where the DP group is this rank alone) had theirs computed in the background as their
    // block's backward finished (ops::background, beside the backward of the blocks below); the rest
    // are computed now.
    std::vector<double> gradient_square_sums(model::CausalLM& model);
    // This rank's expert shard (ep_rank of ep_size) for model::ModelPlacement.
    model::ExpertShard expert_shard() const;
    // The HF export of a run (save_hf_model from a ParamSource, on world rank 0), from every rank's
    // own parameters (`local`: host f32 in the model's table layout, kept alive until the export is
    // done). Without EP, export_source simply reads `local`. Under EP the stacked expert tensors are
    // gathered over world rank 0's EP group one at a time, as the writer reaches them (no rank ever
    // holds the whole model): world rank 0 exports through export_source, the other ranks of its EP
    // group call serve_export, which takes part in each of those gathers in the same (table) order
    // and returns after the last; ranks of other DP groups call neither. A failure on rank 0 leaves
    // its peers waiting in a gather until dist.timeout_s ends them.
    train::ParamSource export_source(const model::CausalLM& model, const std::vector<float>& local);
    void serve_export(const model::CausalLM& model, const std::vector<float>& local);
    bool serves_export() const;  // this rank must call serve_export (EP > 1, DP rank 0, not world rank 0)
    // The EP group for CausalLM::set_expert_parallel, and the DP group (ranks holding the same
    // experts; ZeRO-1 shards optimizer state over it). Null for a single process.
    parallel::Communicator* ep_group() const;
    parallel::Communicator* dp_group() const;
    parallel::Communicator* group(Group g) const;
    // Returns when every rank has reached it (the identity for a single process).
    void barrier();

 private:
    int rank_ = 0;
    Device device_ = Device::cpu;
    parallel::ParallelLayout layout_;
    // Gradient ranges reduced so far in the current sync (per parameter spec).
    std::vector<bool> reduced_;
    bool embedding_gathered_ = false;
    Buffer square_sums_;              // f64 per parameter spec, on the model's device
    std::vector<bool> squares_done_;  // per spec: its square sum is in square_sums_ (or on its way)
    ops::BackgroundTicket squares_ticket_ = 0;
    void start_square_sums(model::CausalLM& model, const std::vector<size_t>& specs);
    void ensure_square_sums(const model::CausalLM& model);
    // Whether the gradient is final as the backward stores it (no reduction will change it).
    bool final_in_backward(const model::ParamSpec& spec) const;
    void reduce_specs(model::CausalLM& model, const std::vector<size_t>& specs);
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace mf::train
