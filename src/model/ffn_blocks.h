// The two feed-forward blocks of Qwen3-MoE.
//
// Dense MLP (mlp_only_layers / decoder_sparse_step):  y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ, with Wg and Wu
// adjacent in the parameter buffer so they act as one fused [2I, H] matrix.
//
// Dropless MoE:  router logits = x·Wrᵀ; fp32 softmax; top-k (optionally renormalised); the N·K
// token-expert pairs are grouped by expert (every token kept, no capacity); per expert
// h = x·W_gate_up[e]ᵀ, a = silu(h_gate) ⊙ h_up, y_e = a·W_down[e]ᵀ; y[t] = Σ_k w[t,k]·y_e(t,k).
// The aux loss needs the full router probabilities of every MoE layer, so they are kept in the
// activations and its gradient comes back in as `dprobs`.
// Forward writes y; backward accumulates into dx and the parameter gradients (+=). Activations
// are in the activation dtype; router logits, probabilities and weights are always f32.
//
// Expert parallelism (MoeDims::ep set): the S ranks of an EP group split the experts, rank p owning
// [p·E/S, (p+1)·E/S). After the router and the sort by expert, dispatch sends each owner its rows
// over the EP group (the per-expert row offsets first, then the rows: one block per peer with
// all_to_all_v into a staging buffer, while the rows for the rank's own experts never leave it), the
// owner puts them expert-major (by source within an expert) with row-range copies and runs its
// experts on them, and combine sends the outputs back the reverse way into the sorted order, where
// the top-k weighted sum proceeds as without EP.
// Backward: output gradients travel the dispatch way, input gradients the combine way. Under EP the
// stacked weights (and their gradients) hold only this rank's E/S experts ([E/S, ...]); the router
// holds all E. Both backends: CPU tensors over the TCP communicator, CUDA tensors over NCCL, whose
// collectives are ordered with the ops:: kernels on the legacy default stream. Planning needs the
// row counts on the host, so each forward's plan costs one wait for the device and the peers (with
// the communicator's timeout); dispatch, expert compute and combine then run without host waits.
// Pipelining (MoeDims::ep_chunks = C > 1): the local experts are split into C chunks, each with its
// own exchange; on NCCL every chunk's dispatch is started on a side stream at once (it waits for the
// default stream's work so far, then runs while the default stream goes on), chunk c's expert GEMMs
// wait only for chunk c's rows, and chunk c's combine starts as soon as its outputs are computed,
// overlapping chunk c+1's GEMMs. Every row is computed by the same kernels from the same inputs in
// the same within-expert order as with C = 1 (tests/dist/test_nccl_ep compares the two).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "parallel/communicator.h"

namespace mf::model {

struct MlpWeights {
    Tensor gate_up, down;  // [2I, H] (gate rows then up rows), [H, I]
};

struct MlpActs {
    Tensor h, a;  // [N, 2I], [N, I]
    void alloc(Arena& arena, int64_t N, int64_t I, DType act);
};

struct MlpScratch {
    Tensor dh, da;
    void alloc(Arena& arena, int64_t N, int64_t I, DType act);
};

void mlp_block_forward(const Tensor& y, MlpActs& acts, const Tensor& x, const MlpWeights& w);
void mlp_block_backward(const Tensor& dx, const MlpWeights& grads, MlpScratch& s, const Tensor& dy, const Tensor& x,
                        const MlpActs& acts, const MlpWeights& w);

struct MoeDims {
    int64_t hidden, intermediate, num_experts, top_k;
    bool norm_topk_prob;
    parallel::Communicator* ep = nullptr;  // the EP group (ep->size() divides num_experts); null: no EP
    // EP pipelining: the local experts are split into this many chunks (clamped to [1, E/S]); on the
    // NCCL backend with more than one, a chunk's dispatch and combine run on a side stream while
    // another chunk's expert GEMMs run (see the header comment). 1: dispatch, compute, combine.
    // 2 measured best on 2 H200 at the Qwen3-30B-A3B shape (16384 tokens/rank, H 2048, 128 experts,
    // top-8, I 768): MoE forward+backward 21.7 ms -> 19.9 ms; 4: 20.1 ms; 8: 21.7 ms.
    int64_t ep_chunks = 2;
    int64_t ep_size() const { return ep != nullptr ? ep->size() : 1; }
};

// One chunk of the local experts and the rows that travel for it. Its rows are one contiguous block
// of the local buffers (expert-major), chunks in order.
struct EpChunk {
    int64_t first_expert = 0, num_experts = 0;  // local experts [first, first + num)
    int64_t first_row = 0, num_rows = 0;        // their rows in the local buffers
    // The exchange of the remote rows, [S] each (this rank's own entry 0): rows to each peer (for its
    // experts of this chunk, contiguous in this rank's expert-sorted rows) and from each peer, at
    // these staging rows (chunk after chunk, source-major within a chunk).
    std::vector<int64_t> send_counts, send_offsets, recv_counts, recv_offsets;
    // Row-range copies, (src, dst, rows) triples (ops::copy_row_pieces), per (source, expert): the
    // received rows staging -> local, and this rank's own rows expert-sorted -> local. The combine
    // runs them reversed.
    std::vector<int64_t> staging_pieces, self_pieces;
};

// Who sends which rows where in one MoE block's dispatch (host bookkeeping; see the header comment),
// plus the device copy of the local expert offsets that the local grouped GEMMs read.
struct EpRouting {
    int64_t num_local = 0;               // rows received = rows of the local expert computation
    int64_t num_staged = 0;              // of them from the peers (the staging buffer's rows)
    std::vector<EpChunk> chunks;         // MoeDims::ep_chunks of them (clamped), covering all local experts
    std::vector<int32_t> local_offsets;  // [E/S + 1] expert-major row offsets
    // local_offsets as i32 on the tensors' device (a view of EpPlanBuffers::index); undefined (null)
    // when planned without an index buffer on the CPU.
    Tensor group_offsets;
};

// Buffers ep_plan writes, on expert_offsets' device, both i32 (MoeActs holds them):
//   peer_offsets [S·(E/S + 1)]: every peer's expert offsets of this rank's experts, as received
//                (needed on the GPU, where NCCL moves device memory; on the CPU a host vector stands
//                in when it is undefined);
//   index        [E/S + 1]: local_offsets, which the routing's group_offsets views (needed on the GPU).
// Rows for the EP-local buffers, sized by the routing actually met rather than by the N·K·S-row
// worst case a dropless all-to-all allows (every rank sending everything to one rank): the store
// grows to the largest request seen, with 1/8 headroom, and never shrinks. A growth frees the old
// memory (which synchronises the device), so views from an earlier carve() are valid only until a
// carve() that grows; each store serves one user at a time (a layer's kept activations, or the
// shared scratch).
class EpRowStore {
 public:
    // Consecutive [rows, cols[i]] views of `dt` on `dev`.
    std::vector<Tensor> carve(int64_t rows, const std::vector<int64_t>& cols, DType dt, Device dev);
    size_t bytes() const { return buf_.nbytes(); }

 private:
    Buffer buf_;
};

struct EpPlanBuffers {
    Tensor peer_offsets, index;
};

struct MoeWeights {
    Tensor router, gate_up, down;  // [E, H], [E', 2I, H], [E', H, I]; E' = E / EP size (E without EP)
};

// The dispatch/combine steps on their own (collective over d.ep, every rank calls them in the same
// order; CPU tensors with a TCP group, CUDA tensors with an NCCL group). ep_plan exchanges the
// per-expert row offsets of this rank's expert-sorted rows (expert_offsets [E+1] i32) and plans both
// directions. ep_dispatch: sorted [P, H] -> local [num_local, H], expert-major over the local experts
// and, within an expert, by source rank and then source order; ep_combine is its exact inverse
// (local -> sorted). Rows are copied, never summed, so a round trip returns every row bit for bit.
// `staging` holds the rows to and from the peers (at least num_staged rows).
EpRouting ep_plan(const MoeDims& d, const Tensor& expert_offsets, const EpPlanBuffers& buffers = {});
void ep_dispatch(const MoeDims& d, const EpRouting& r, const Tensor& sorted, const Tensor& staging,
                 const Tensor& local);
void ep_combine(const MoeDims& d, const EpRouting& r, const Tensor& local, const Tensor& staging,
                const Tensor& sorted);

struct MoeActs {
    Tensor logits, probs;          // [N, E]
    Tensor topk_idx, topk_weight;  // [N, K]
    Tensor expert_offsets;         // [E + 1]
    // expert_offsets read back once per forward when ops::grouped_matmul_uses_host_offsets (else
    // empty), for every grouped matmul of the block, forward and backward (not under EP: the plan's
    // local_offsets serve there).
    std::vector<int32_t> host_offsets;
    Tensor sorted_pair, pair_row;  // [N·K]
    Tensor x_perm, h_perm, a_perm, y_perm;  // [N·K, H], [N·K, 2I], [N·K, I], [N·K, H]; h, a: not under EP
    // EP only: the local experts' input and activations (expert-major) and expert outputs,
    // routing.num_local rows each, carved by moe_block_forward: x, h, a from `local_store` (kept for
    // the backward), y_local and the exchange's staging rows from `output_store` (free again once
    // the forward returns: the combine has moved y_local into y_perm; the model shares it with the
    // MoeScratch), and ep_plan's buffers (arena).
    Tensor x_local, h_local, a_local, y_local, staging;
    std::shared_ptr<EpRowStore> local_store, output_store;
    EpPlanBuffers plan_buffers;
    EpRouting routing;
    // Stores not given are made fresh (EP only). Under EP x_perm is only the dispatch's source (the
    // backward reads x_local), so layers may share one: `shared_x_perm` ([N·K, H]) when given.
    void alloc(Arena& arena, const MoeDims& d, int64_t N, DType act, std::shared_ptr<EpRowStore> local = {},
               std::shared_ptr<EpRowStore> output = {}, const Tensor* shared_x_perm = nullptr);
};

struct MoeScratch {
    Tensor dy_perm, da_perm, dh_perm, dx_perm, dtopk_weight, dlogits;  // da, dh: not under EP
    Tensor dy_local, da_local, dh_local, dx_local, staging;  // EP only, carved from `store` by the backward
    std::shared_ptr<EpRowStore> store;
    void alloc(Arena& arena, const MoeDims& d, int64_t N, DType act, std::shared_ptr<EpRowStore> rows = {});
};

void moe_block_forward(const Tensor& y, MoeActs& acts, const Tensor& x, const MoeWeights& w, const MoeDims& d);
// dprobs[N, E] f32 (may be undefined): gradient of the loss with respect to the router probabilities.
void moe_block_backward(const Tensor& dx, const MoeWeights& grads, MoeScratch& s, const Tensor& dy,
                        const Tensor& dprobs, const Tensor& x, const MoeActs& acts, const MoeWeights& w,
                        const MoeDims& d);

}  // namespace mf::model
