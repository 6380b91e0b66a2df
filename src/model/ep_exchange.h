// The EP exchange of the dropless MoE block (model/ffn_blocks.h), in its own file pair.
//
// Expert parallelism (MoeDims::ep set): the S ranks of an EP group split the experts, rank p owning
// [p·E/S, (p+1)·E/S). The exchange moves tokens, not (token, expert) pairs: dispatch sends each
// token once to every destination that owns at least one of its top-k experts (with, per slot, the
// row it takes there and its routing weight), the owner expands it into the expert-major rows of
// its experts (by source rank, then source order, within an expert: the rows and the order of the
// one-rank computation), runs its experts, and on the way back sums its slots' weighted outputs per
// token, so each source adds one row per destination (fp32 sums in rank order; the partial sums
// travel in fp32, so the one rounding to the activation dtype happens at the source as in the
// one-rank block, and EP changes only the order of fp32 additions). An owner's rows from its own
// tokens need no transfer (they are copied locally), so they fill the time the others' travel: the
// first piece of them is computed while the other ranks' tokens arrive, then the others' rows, whose
// results are sent back while the second piece computes (EpChunk's parts and own pieces); the
// weight gradients take both parts' rows of an expert in one pass. While the own pieces compute
// beside an exchange the grouped GEMMs can leave MoeDims::ep_comm_sms SMs to the exchange (ops::
// set_grouped_matmul_reserved_sms; wanted only when SM kernels copy, 0 by default as the copy
// engines do). At top-8 over 128 experts and EP=2 this sends ~2.7× fewer bytes than one bf16 row
// per (token, expert) pair both ways.
// Backward: output gradients travel the dispatch way (the owner scales them by the weights and
// takes the weight gradients against its kept outputs), input gradients and weight gradients come
// back the combine way. Under EP the stacked weights (and their gradients) hold only this rank's
// E/S experts ([E/S, ...]); the router holds all E. Both backends: CPU tensors over the TCP
// communicator, CUDA tensors over NCCL, whose collectives (on the legacy default stream) are ordered
// with the ops:: kernels on the engine's blocking stream. Planning needs the token and row counts on the host, so each
// forward's plan costs one wait for the device and the peers (with the communicator's timeout); dispatch, expert
// compute and combine then run without host waits.
// Pipelining (MoeDims::ep_chunks = C > 1): the local experts are split into C chunks, and a
// destination is one chunk of one rank (V = S·C of them; a token is sent once per destination it
// needs); on NCCL every chunk's dispatch is started on a side stream at once, chunk c's expert GEMMs
// wait only for chunk c's tokens, and chunk c's combine starts as soon as its outputs are reduced,
// overlapping chunk c+1's GEMMs. Every row is computed by the same kernels from the same inputs in
// the same order as with C = 1 (tests/dist/test_nccl_ep compares the two).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "model/spec.h"
#include "parallel/communicator.h"

namespace mf::model {

struct MoeActs;
struct MoeScratch;
struct MoeWeights;
struct ExpertGradSquares;

struct MoeDims {
    int64_t hidden, intermediate, num_experts, top_k;
    bool norm_topk_prob;
    parallel::Communicator* ep = nullptr;  // the EP group (ep->size() divides num_experts); null: no EP
    // EP pipelining: the local experts are split into this many chunks (clamped to [1, E/S]); on the
    // NCCL backend with more than one, a chunk's dispatch and combine run on a side stream while
    // another chunk's expert GEMMs run (see the header comment). 1: dispatch, compute, combine.
    // Since the exchange moves tokens rather than pairs, 1 is the fastest on 2 H200s at the
    // Qwen3-30B-A3B shape (16384 tokens/rank, H 2048, 128 experts, top-8, I 768; MF_BENCH=1
    // test_nccl_ep): MoE forward+backward 10.15 ms; 2 chunks 10.95; 4: 12.78; 8: 15.32 (more
    // destinations send a token more often, and each chunk's GEMMs get fewer rows).
    int64_t ep_chunks = 1;
    // The share of a chunk's own-token rows computed before the other ranks' rows (while those
    // arrive); the rest is computed after them (while their results go back). In [0, 1];
    // MOEFORGE_EP_OWN_SPLIT overrides it.
    double ep_own_split = 0.5;
    // SMs the grouped GEMMs leave to the exchange's copy kernels while they compute beside an
    // exchange, for the SM-kernel copies (MOEFORGE_PEER_COPY=sm; parallel/peer_exchange.h): the
    // GPU's grouped GEMMs are persistent and would otherwise hold every SM until they end (on one
    // H200 a copy queued beside one waited for its end; with 16 SMs left free a 134 MB copy ran
    // beside it and the GEMM took 11% longer). The default copy engines need none, so 0;
    // MOEFORGE_EP_COMM_SMS overrides it (16 with MOEFORGE_PEER_COPY=sm). No effect on the CPU.
    int ep_comm_sms = 0;
    int64_t ep_size() const { return ep != nullptr ? ep->size() : 1; }
    // The experts' activation and the router (spec.h MoeBranch; moe_block_dims fills them).
    Activation act = Activation::swiglu;
    RouterKind router = RouterKind::softmax;  // the sigmoid router's options (spec.h MoeBranch):
    int64_t n_group = 1, topk_group = 1;
    float routed_scaling = 1.0f, masked_score = -INFINITY;
    // The experts' first product's width: gate and up rows (2I) for SwiGLU, up rows (I) for relu².
    int64_t first_width() const { return act == Activation::swiglu ? 2 * intermediate : intermediate; }
    // Routing replay (CPU only): when set, every token takes these experts ([N·K], as routing() returns
    // them) instead of its own top-k; the weights are the router's for those experts, formed as the
    // router forms them (CausalLM::replay_routing).
    const std::vector<int32_t>* replay = nullptr;
};

// One chunk of the local experts and the tokens that travel for it.
struct EpChunk {
    int64_t first_expert = 0, num_experts = 0;  // local experts [first, first + num)
    int64_t first_row = 0, num_rows = 0;        // their rows in the local buffers (both parts)
    // The chunk's rows in two parts: 0, those of this rank's own tokens (they need no transfer), then
    // 1, those of the other ranks' tokens; each part expert-major (part 1 by source rank within an
    // expert). A part's group offsets are num_experts + 1 absolute row numbers at `offsets` in
    // EpRouting::local_offsets (and group_offsets).
    struct Part {
        int64_t first_row = 0, num_rows = 0;
        int64_t offsets = 0;
    };
    Part parts[2];
    // Part 0 cut at a row (MoeDims::ep_own_split) into the piece computed before part 1 and the
    // piece computed after it; their group offsets are part 0's clamped to either side of the cut
    // (a group may straddle it), so together they compute exactly part 0's rows.
    Part own_pieces[2];
    // Tokens to each rank's chunk (rows of this rank's send buffer) and from each rank for this
    // chunk (rows of the receive buffer), [S] each, this rank included. A chunk's received tokens
    // are rows [first_recv, first_recv + num_recv) of the receive buffer, this rank's own first
    // (num_self of them), then the other ranks' in rank order.
    std::vector<int64_t> send_counts, send_offsets, recv_counts, recv_offsets;
    int64_t first_recv = 0, num_recv = 0, num_self = 0;
};

// Who sends which tokens where in one MoE block (host bookkeeping; see the header comment), plus
// views of the device index ep_plan uploads.
struct EpRouting {
    int64_t num_local = 0;               // expert rows computed here (the local buffers' rows)
    int64_t num_sent = 0;                // token rows this rank sends, to every destination (itself included)
    int64_t num_received = 0;            // token rows it receives, from every source (itself included)
    std::vector<EpChunk> chunks;         // MoeDims::ep_chunks of them (clamped), covering all local experts
    std::vector<int32_t> local_offsets;  // every chunk's parts' and own pieces' group offsets (EpChunk::Part::offsets)
    Tensor group_offsets;                // local_offsets on the tokens' device (view of EpPlanBuffers::index)
    Tensor row_base;                     // [E]: where each expert's owner puts this rank's rows of it
};

// The plan's buffers, on the tokens' device, all i32 (MoeActs holds them; V = S·C destinations):
struct EpPlanBuffers {
    Tensor expert_dest;  // [E]: each expert's destination (chunk·S + owner rank); constant
    Tensor plan;         // [E + 1 + V]: this rank's expert offsets, then its tokens per destination
    Tensor plan_all;     // [S·(E + 1 + V)]: every rank's plan (all_gather)
    Tensor send_pos;     // [V, N]: each token's row in a destination's block, or -1 (ops::ep_token_positions)
    Tensor index;        // [E + 4·(E/S + C)]: row_base, then local_offsets
    Tensor expert_offsets() const;  // plan's first E + 1 entries (moe_permute_indices writes them)
    Tensor counts() const;          // plan's last V entries
    void alloc(Arena& arena, const MoeDims& d, int64_t N);
};

// Rows for the EP-local buffers, sized by the routing actually met rather than by the N·K·S-row
// worst case a dropless exchange allows (every rank sending everything to one rank): the store
// grows to the largest request seen, with 1/8 headroom, and never shrinks. A growth frees the old
// memory (which synchronises the device), so views from an earlier carve() are valid only until a
// carve() that grows; each store serves one user at a time (a layer's kept activations, or the
// shared scratch).
class EpRowStore {
 public:
    struct Part {
        int64_t rows, cols;
        DType dtype;
    };
    // Consecutive [rows, cols] views, one per part (each 256-byte aligned) on `dev`.
    std::vector<Tensor> carve(const std::vector<Part>& parts, Device dev);
    size_t bytes() const { return buf_.nbytes(); }

 private:
    Buffer buf_;
};

// The EP steps on their own (collective over d.ep, every rank calls them in the same order; CPU
// tensors with a TCP group, CUDA tensors with an NCCL group), as moe_block_forward runs them with one
// chunk. They read a.topk_idx, a.topk_weight, a.pair_row and a.expert_offsets (the router and
// ops::moe_permute_indices have run).
//   ep_plan:     counts the tokens per destination, exchanges every rank's counts and plans
//                (a.routing, the device index);
//   ep_dispatch: x [N, H] -> a.x_local [num_local, H] (carves the local rows and the exchange's
//                buffers) in the layout of EpChunk (per chunk: this rank's tokens expert-major,
//                then the other ranks' expert-major, by source rank within an expert, each source
//                in token order);
//   ep_combine:  a.y_local [num_local, H] -> y [N, H], y[t] = Σ_k topk_weight[t, k] · (the local
//                row of slot k at its owner) (written).
void ep_plan(const MoeDims& d, MoeActs& a);
void ep_dispatch(const MoeDims& d, MoeActs& a, const Tensor& x);
void ep_combine(const MoeDims& d, MoeActs& a, const Tensor& y);

// moe_block_forward / moe_block_backward under EP (d.ep set): routing already in `a`, as those describe.
void ep_moe_forward(const Tensor& y, MoeActs& a, const Tensor& x, const MoeWeights& w, const MoeDims& d);
void ep_moe_backward(const Tensor& dx, const MoeWeights& g, MoeScratch& s, const Tensor& dy, const Tensor& x,
                     const MoeActs& a, const MoeWeights& w, const MoeDims& d, bool accumulate_expert_grads,
                     const ExpertGradSquares& squares);

}  // namespace mf::model
