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
// Expert parallelism (MoeDims::ep set, CPU only for now): the S ranks of an EP group split the
// experts, rank p owning [p·E/S, (p+1)·E/S). After the router and the sort by expert, dispatch
// sends each owner its rows (all_to_all_v over the EP group: per-expert counts first, then the
// rows), the owner reorders what it received from source-major to expert-major and runs its
// experts on it, and combine sends the outputs back the reverse way into the sorted order, where
// the top-k weighted sum proceeds as without EP. Backward: output gradients travel the dispatch
// way, input gradients the combine way. Under EP the stacked weights (and their gradients) hold
// only this rank's E/S experts ([E/S, ...]); the router holds all E.
#pragma once

#include <cstdint>
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
    int64_t ep_size() const { return ep != nullptr ? ep->size() : 1; }
};

// Who sends which rows where in one MoE block's dispatch (host bookkeeping; see the header comment).
struct EpRouting {
    int64_t num_local = 0;  // rows received = rows of the local expert computation
    std::vector<int64_t> send_counts, send_offsets;  // [S] rows to each peer, in the expert-sorted order
    std::vector<int64_t> recv_counts, recv_offsets;  // [S] rows from each peer, source-major
    std::vector<int64_t> local_order;                // [num_local] source-major row of expert-major row i
    std::vector<int32_t> local_offsets;              // [E/S + 1] expert-major row offsets
};

struct MoeWeights {
    Tensor router, gate_up, down;  // [E, H], [E', 2I, H], [E', H, I]; E' = E / EP size (E without EP)
};

// The dispatch/combine steps on their own (CPU tensors; collective over d.ep, every rank calls
// them in the same order). ep_plan exchanges the per-expert row counts of this rank's expert-sorted
// rows (expert_offsets [E+1] i32) and plans both directions. ep_dispatch: sorted [P, H] -> local
// [num_local, H], expert-major over the local experts and, within an expert, by source rank and
// then source order; ep_combine is its exact inverse (local -> sorted). `exchange` is a
// source-major staging buffer of at least num_local rows; rows are copied, never summed, so a
// round trip returns every row bit for bit.
EpRouting ep_plan(const MoeDims& d, const Tensor& expert_offsets);
void ep_dispatch(const MoeDims& d, const EpRouting& r, const Tensor& sorted, const Tensor& exchange,
                 const Tensor& local);
void ep_combine(const MoeDims& d, const EpRouting& r, const Tensor& local, const Tensor& exchange,
                const Tensor& sorted);

struct MoeActs {
    Tensor logits, probs;          // [N, E]
    Tensor topk_idx, topk_weight;  // [N, K]
    Tensor expert_offsets;         // [E + 1]
    Tensor sorted_pair, pair_row;  // [N·K]
    Tensor x_perm, h_perm, a_perm, y_perm;  // [N·K, H], [N·K, 2I], [N·K, I], [N·K, H]
    // EP only (capacity N·K·S rows, of which routing.num_local are used): the local experts' input
    // and activations (expert-major), the exchange buffer (source-major) and the local offsets.
    Tensor x_local, h_local, a_local, y_local, exchange, local_offsets;
    EpRouting routing;
    void alloc(Arena& arena, const MoeDims& d, int64_t N, DType act);
};

struct MoeScratch {
    Tensor dy_perm, da_perm, dh_perm, dx_perm, dtopk_weight, dlogits;
    Tensor dy_local, da_local, dh_local, dx_local, exchange;  // EP only, N·K·S rows each
    void alloc(Arena& arena, const MoeDims& d, int64_t N, DType act);
};

void moe_block_forward(const Tensor& y, MoeActs& acts, const Tensor& x, const MoeWeights& w, const MoeDims& d);
// dprobs[N, E] f32 (may be undefined): gradient of the loss with respect to the router probabilities.
void moe_block_backward(const Tensor& dx, const MoeWeights& grads, MoeScratch& s, const Tensor& dy,
                        const Tensor& dprobs, const Tensor& x, const MoeActs& acts, const MoeWeights& w,
                        const MoeDims& d);

}  // namespace mf::model
