// The feed-forward blocks: the dense MLP, the dropless MoE and the shared expert.
//
// Dense MLP (a dense layer, and the shared expert):  y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ, with Wg and Wu
// adjacent in the parameter buffer so they act as one fused [2I, H] matrix; or non-gated,
// y = relu(x·Wuᵀ)²·Wdᵀ (Activation::relu2, Nemotron-H), whose first product is Wu alone [I, H].
//
// Shared expert (Qwen2-MoE): every token also passes through one MLP of its own width, added to the
// routed output, gated per token by sigmoid(x·w_gateᵀ) (w_gate [1, H]) when the branch has the gate:
//   y += sigmoid(x·w_gateᵀ) ⊙ mlp_shared(x)
//
// Dropless MoE:  router logits = x·Wrᵀ; fp32 softmax, or the sigmoid router (spec.h RouterKind);
// top-k (optionally renormalised); the N·K
// token-expert pairs are grouped by expert (every token kept, no capacity); per expert
// h = x·W_gate_up[e]ᵀ, a = silu(h_gate) ⊙ h_up, y_e = a·W_down[e]ᵀ; y[t] = Σ_k w[t,k]·y_e(t,k).
// The aux loss needs the full router probabilities of every MoE layer, so they are kept in the
// activations and its gradient comes back in as `dprobs`.
// Forward writes y; backward accumulates into dx and the parameter gradients (+=). Activations
// are in the activation dtype; router logits, probabilities and weights are always f32.
//
// Expert parallelism: model/ep_exchange.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/ep_exchange.h"
#include "model/param_table.h"
#include "model/spec.h"
#include "parallel/communicator.h"

namespace mf::model {

using ParamLookup = std::function<Tensor(const std::string&)>;  // a parameter (or its gradient) by name

// The activation between an MLP's two products: a[N, I] from h[N, 2I] (SwiGLU) or h[N, I] (relu²),
// and its backward (dh written).
void expert_act_forward(Activation act, const Tensor& a, const Tensor& h);
void expert_act_backward(Activation act, const Tensor& dh, const Tensor& da, const Tensor& h);
// The width of the first product: 2I (SwiGLU) or I (relu²).
inline int64_t first_width(Activation act, int64_t I) { return act == Activation::swiglu ? 2 * I : I; }

struct MlpWeights {
    Tensor gate_up, down;  // [2I, H] (gate rows then up rows; relu²: up_proj [I, H]), [H, I]
    Activation act = Activation::swiglu;
};
// gate_proj (SwiGLU only), up_proj, down_proj under `prefix` ("model.layers.0.mlp."), and the fused
// view of them.
void declare_mlp_params(ParamTable& table, const std::string& prefix, int64_t hidden, int64_t intermediate,
                        Activation act = Activation::swiglu);
MlpWeights mlp_weights(const ParamLookup& at, const std::string& prefix, int64_t hidden, int64_t intermediate,
                       Activation act = Activation::swiglu);

struct MlpActs {
    Tensor h, a;  // [N, 2I] (relu²: [N, I]), [N, I]
    void alloc(Arena& arena, int64_t N, int64_t I, DType act, Activation activation = Activation::swiglu);
};

struct MlpScratch {
    Tensor dh, da;
    void alloc(Arena& arena, int64_t N, int64_t I, DType act, Activation activation = Activation::swiglu);
};

void mlp_block_forward(const Tensor& y, MlpActs& acts, const Tensor& x, const MlpWeights& w);
void mlp_block_backward(const Tensor& dx, const MlpWeights& grads, MlpScratch& s, const Tensor& dy, const Tensor& x,
                        const MlpActs& acts, const MlpWeights& w);

struct MoeWeights {
    Tensor router, gate_up, down;  // [E, H], [E', 2I, H] (relu²: [E', I, H]), [E', H, I]; E' = E / EP size
    Tensor correction{};           // the sigmoid router's e_score_correction_bias [E] (a buffer), or undefined
    Tensor fc1{}, fc2{};           // LatentMoE: fc1_latent_proj [L, H], fc2_latent_proj [H, L], or undefined
};
// The MoE branch's parameters in module `module` of the layer (`layer_prefix` "model.layers.3."):
// the router `gate.weight` (and the sigmoid router's `gate.e_score_correction_bias`), the stacked
// experts `experts.gate_up_proj` (relu²: `experts.up_proj`) and `experts.down_proj` (stored per
// expert as the branch's disk names say), and the shared expert (`<shared_module>.*`,
// `shared_expert_gate.weight`) where it has one.
void declare_moe_params(ParamTable& table, const std::string& layer_prefix, const std::string& module,
                        const MoeBranch& moe, int64_t hidden, ExpertShard shard);
MoeWeights moe_weights(const ParamLookup& at, const std::string& prefix, const MoeBranch& moe);
// The stacked first-product experts' name in the module: experts.gate_up_proj or experts.up_proj.
std::string experts_first_name(const MoeBranch& moe);

struct SharedExpertWeights {
    MlpWeights mlp;
    Tensor gate;  // [1, H], or undefined (no gate)
};
SharedExpertWeights shared_expert_weights(const ParamLookup& at, const std::string& prefix, const MoeBranch& moe,
                                          int64_t hidden);

struct SharedExpertActs {
    MlpActs mlp;
    Tensor out;          // [N, H] the shared expert's output, before the gate
    Tensor gate_logits;  // [N, 1]
    void alloc(Arena& arena, int64_t N, int64_t hidden, const MoeBranch& moe, DType act);
};
struct SharedExpertScratch {
    MlpScratch mlp;
    Tensor dout, dgate_logits;
    void alloc(Arena& arena, int64_t N, int64_t hidden, const MoeBranch& moe, DType act);
};
// y += [sigmoid(x·w_gateᵀ) ⊙] mlp_shared(x)
void shared_expert_forward(const Tensor& y, SharedExpertActs& acts, const Tensor& x, const SharedExpertWeights& w);
// dx and the parameter gradients +=.
void shared_expert_backward(const Tensor& dx, const SharedExpertWeights& grads, SharedExpertScratch& s,
                            const Tensor& dy, const Tensor& x, const SharedExpertActs& acts,
                            const SharedExpertWeights& w);

// The block dims of a spec's MoE branch in a model of width `hidden` (no EP).
MoeDims moe_block_dims(const MoeBranch& moe, int64_t hidden);

struct MoeActs {
    Tensor logits, probs;          // [N, E] (the sigmoid router: probs holds the scores σ(logits))
    Tensor topk_idx, topk_weight;  // [N, K]
    Tensor expert_offsets;         // [E + 1] (under EP a view of plan_buffers.plan)
    // expert_offsets read back once per forward when experts_use_host_offsets (else
    // empty), for every grouped matmul of the block, forward and backward (not under EP: the plan's
    // local_offsets serve there).
    std::vector<int32_t> host_offsets;
    Tensor sorted_pair, pair_row;           // [N·K]
    Tensor x_perm, h_perm, a_perm, y_perm;  // [N·K, H], [N·K, 2I], [N·K, I], [N·K, H]; not under EP
    // EP only: the local experts' rows (expert-major), routing.num_local each, and the received
    // tokens' meta rows (ops::ep_pack_meta, [num_received, 2K] i32), carved by the forward from
    // `local_store` and kept for the backward; the send and receive buffers of the exchange
    // (num_sent / num_received token rows) from `output_store`, free again once the forward returns
    // (the model shares it with the MoeScratch); the plan's buffers (arena).
    Tensor x_local, h_local, a_local, y_local, recv_meta;
    Tensor send_rows, send_meta, recv_rows;
    Tensor recv_back, send_back;  // f32: each destination's partial sums, reduced and sent back unrounded
    std::shared_ptr<EpRowStore> local_store, output_store;
    EpPlanBuffers plan_buffers;
    bool expert_dest_ready = false;  // plan_buffers.expert_dest uploaded
    EpRouting routing;
    // Stores not given are made fresh (EP only).
    void alloc(Arena& arena, const MoeDims& d, int64_t N, DType act, std::shared_ptr<EpRowStore> local = {},
               std::shared_ptr<EpRowStore> output = {});
};

struct MoeScratch {
    Tensor dy_perm, da_perm, dh_perm, dx_perm;  // not under EP
    Tensor dtopk_weight, dlogits;
    // EP only, carved from `store` by the backward: the local rows' gradients, the weight gradients
    // of the received slots ([num_received, K] f32) and the exchange's buffers.
    Tensor dy_local, da_local, dh_local, dx_local, dw_recv, dw_sent, send_rows, recv_rows, recv_back, send_back;
    std::shared_ptr<EpRowStore> store;
    void alloc(Arena& arena, const MoeDims& d, int64_t N, DType act, std::shared_ptr<EpRowStore> rows = {});
};

// Whether the experts' grouped products (gate_up's and down's) want host offsets on `device`
// (ops::grouped_matmul_uses_host_offsets for each weight).
bool experts_use_host_offsets(const MoeWeights& w, Device device);

// x_router [N, H]: the router's input and, unless x_experts [N, d.hidden] is given (LatentMoE: the
// latent projection of x), the experts'; y [N, d.hidden].
void moe_block_forward(const Tensor& y, MoeActs& acts, const Tensor& x_router, const MoeWeights& w, const MoeDims& d,
                       const Tensor& x_experts = {});
// dprobs[N, E] f32 (may be undefined): gradient of the loss with respect to the router probabilities.
// The expert weight gradients (grads.gate_up, grads.down) are accumulated, or with
// accumulate_expert_grads false written (every expert's, an expert without rows getting zeros), so
// the caller need not zero them first; the router's is always accumulated.
// squares (optional, one f64 each on the gradients' device): += Σ g² of the stacked expert
// gradients as stored (ops::grouped_matmul_backward_weight's square_sum), for the clipping norm.
struct ExpertGradSquares {
    Tensor gate_up, down;
};
// With x_experts (LatentMoE), the experts' input gradient goes to dx_experts (+=) and the router's to
// dx_router (+=); otherwise both to dx_router.
void moe_block_backward(const Tensor& dx_router, const MoeWeights& grads, MoeScratch& s, const Tensor& dy,
                        const Tensor& dprobs, const Tensor& x_router, const MoeActs& acts, const MoeWeights& w,
                        const MoeDims& d, bool accumulate_expert_grads = true, const ExpertGradSquares& squares = {},
                        const Tensor& x_experts = {}, const Tensor& dx_experts = {});

// LatentMoE's activations of one branch: the experts' input (x·fc1ᵀ) and output before fc2, and the
// backward's gradients of both.
struct LatentActs {
    Tensor x, y;  // [N, L]
    void alloc(Arena& arena, int64_t N, int64_t latent, DType act);
};

// A MoE branch's routed part, y [N, H] written: moe(x), or with LatentMoE (w.fc1 defined; `latent`
// its activations) fc2(moe(fc1·x)) with the router on x.
void routed_moe_forward(const Tensor& y, MoeActs& acts, LatentActs& latent, const Tensor& x, const MoeWeights& w,
                        const MoeDims& d);

}  // namespace mf::model
