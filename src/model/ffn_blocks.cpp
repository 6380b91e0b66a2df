#include "model/ffn_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>

#include "core/check.h"
#include "ops/ops.h"

namespace mf::model {

// --- dense MLP ------------------------------------------------------------------------------------

void expert_act_forward(Activation act, const Tensor& a, const Tensor& h) {
    if (act == Activation::swiglu)
        ops::swiglu_forward(a, h);
    else
        ops::relu2_forward(a, h);
}

void expert_act_backward(Activation act, const Tensor& dh, const Tensor& da, const Tensor& h) {
    if (act == Activation::swiglu)
        ops::swiglu_backward(dh, da, h);
    else
        ops::relu2_backward(dh, da, h);
}

void MlpActs::alloc(Arena& arena, int64_t N, int64_t I, DType act, Activation activation) {
    h = arena.alloc(act, {N, first_width(activation, I)});
    a = arena.alloc(act, {N, I});
}

void MlpScratch::alloc(Arena& arena, int64_t N, int64_t I, DType act, Activation activation) {
    dh = arena.alloc(act, {N, first_width(activation, I)});
    da = arena.alloc(act, {N, I});
}

void declare_mlp_params(ParamTable& table, const std::string& p, int64_t H, int64_t I, Activation act) {
    // gate_proj then up_proj, adjacent: together the fused [2I, H] gate_up matrix.
    if (act == Activation::swiglu) table.add(p + "gate_proj.weight", {I, H}, ParamRole::weight);
    table.add(p + "up_proj.weight", {I, H}, ParamRole::weight);
    table.add(p + "down_proj.weight", {H, I}, ParamRole::weight);
}

MlpWeights mlp_weights(const ParamLookup& at, const std::string& p, int64_t H, int64_t I, Activation act) {
    const Tensor up = at(p + "up_proj.weight");
    if (act == Activation::relu2) return MlpWeights{up, at(p + "down_proj.weight"), act};
    const Tensor gate = at(p + "gate_proj.weight");
    MF_CHECK(static_cast<const char*>(up.data()) ==
                 static_cast<const char*>(gate.data()) + gate.numel() * static_cast<int64_t>(dtype_size(gate.dtype())),
             p, "gate_proj and up_proj are not adjacent");
    return MlpWeights{Tensor(gate.data(), gate.dtype(), {2 * I, H}, gate.device()), at(p + "down_proj.weight"), act};
}

void mlp_block_forward(const Tensor& y, MlpActs& acts, const Tensor& x, const MlpWeights& w) {
    ops::matmul_forward(acts.h, x, w.gate_up);
    expert_act_forward(w.act, acts.a, acts.h);
    ops::matmul_forward(y, acts.a, w.down);
}

void mlp_block_backward(const Tensor& dx, const MlpWeights& g, MlpScratch& s, const Tensor& dy, const Tensor& x,
                        const MlpActs& acts, const MlpWeights& w) {
    ops::zero(s.da);
    ops::matmul_backward(s.da, g.down, dy, acts.a, w.down);
    expert_act_backward(w.act, s.dh, s.da, acts.h);
    ops::matmul_backward(dx, g.gate_up, s.dh, x, w.gate_up);
}

// --- shared expert -------------------------------------------------------------------------------

SharedExpertWeights shared_expert_weights(const ParamLookup& at, const std::string& p, const MoeBranch& moe,
                                          int64_t H) {
    SharedExpertWeights w;
    w.mlp = mlp_weights(at, p + moe.shared_module + ".", H, moe.shared_intermediate, moe.act);
    if (moe.shared_gate) w.gate = at(p + "shared_expert_gate.weight");
    return w;
}

void SharedExpertActs::alloc(Arena& arena, int64_t N, int64_t H, const MoeBranch& moe, DType act) {
    mlp.alloc(arena, N, moe.shared_intermediate, act, moe.act);
    out = arena.alloc(act, {N, H});
    gate_logits = arena.alloc(act, {N, 1});
}

void SharedExpertScratch::alloc(Arena& arena, int64_t N, int64_t H, const MoeBranch& moe, DType act) {
    mlp.alloc(arena, N, moe.shared_intermediate, act, moe.act);
    dout = arena.alloc(act, {N, H});
    dgate_logits = arena.alloc(act, {N, 1});
}

void shared_expert_forward(const Tensor& y, SharedExpertActs& a, const Tensor& x, const SharedExpertWeights& w) {
    mlp_block_forward(a.out, a.mlp, x, w.mlp);
    if (w.gate.data() == nullptr) {
        ops::add(y, y, a.out);
        return;
    }
    ops::matmul_forward(a.gate_logits, x, w.gate);
    ops::sigmoid_gate_forward(y, a.out, a.gate_logits);
}

void shared_expert_backward(const Tensor& dx, const SharedExpertWeights& g, SharedExpertScratch& s, const Tensor& dy,
                            const Tensor& x, const SharedExpertActs& a, const SharedExpertWeights& w) {
    const bool gated = w.gate.data() != nullptr;
    if (gated) {
        ops::sigmoid_gate_backward(s.dout, s.dgate_logits, dy, a.out, a.gate_logits);
        ops::matmul_backward(dx, g.gate, s.dgate_logits, x, w.gate);
    }
    mlp_block_backward(dx, g.mlp, s.mlp, gated ? s.dout : dy, x, a.mlp, w.mlp);
}

// --- dropless MoE ---------------------------------------------------------------------------------

void declare_moe_params(ParamTable& table, const std::string& lp, const std::string& module, const MoeBranch& m,
                        int64_t H, ExpertShard shard) {
    const std::string p = lp + module + ".";
    const std::string disk = lp + (m.disk_module.empty() ? module : m.disk_module) + ".";
    const int64_t E = m.num_experts, I = m.intermediate;
    ParamStorage router;
    if (disk != p) router.disk_name = disk + "gate.weight";
    table.add(p + "gate.weight", {E, H}, ParamRole::weight, {}, router);
    if (m.router == RouterKind::sigmoid) {
        ParamStorage bias;
        if (disk != p) bias.disk_name = disk + "gate.e_score_correction_bias";
        table.add(p + "gate.e_score_correction_bias", {E}, ParamRole::buffer, {}, bias);
    }
    const bool gated = m.act == Activation::swiglu;
    const std::string experts = disk + "experts.{}.";
    ParamStorage first{"", {experts + m.disk_up + ".weight"}};
    if (gated) first.expert_pieces.insert(first.expert_pieces.begin(), experts + m.disk_gate + ".weight");
    ParamStorage down{"", {experts + m.disk_down + ".weight"}};
    if (m.disk_stacked) {
        first = ParamStorage{disk + experts_first_name(m), {}, m.disk_transposed, gated && m.disk_interleaved};
        down = ParamStorage{disk + "experts.down_proj", {}, m.disk_transposed, false};
    }
    const int64_t Din = m.latent > 0 ? m.latent : H;  // the experts' width
    table.add(p + experts_first_name(m), {E, first_width(m.act, I), Din}, ParamRole::expert, shard, first);
    table.add(p + "experts.down_proj", {E, Din, I}, ParamRole::expert, shard, down);
    if (m.latent > 0) {
        table.add(p + "fc1_latent_proj.weight", {m.latent, H}, ParamRole::weight);
        table.add(p + "fc2_latent_proj.weight", {H, m.latent}, ParamRole::weight);
    }
    if (m.shared_intermediate > 0) {
        declare_mlp_params(table, p + m.shared_module + ".", H, m.shared_intermediate, m.act);
        if (m.shared_gate) table.add(p + "shared_expert_gate.weight", {1, H}, ParamRole::weight);
    }
}

MoeDims moe_block_dims(const MoeBranch& m, int64_t H) {
    MoeDims d{m.latent > 0 ? m.latent : H, m.intermediate, m.num_experts, m.top_k, m.norm_topk_prob};
    d.act = m.act;
    d.router = m.router;
    d.n_group = m.n_group;
    d.topk_group = m.topk_group;
    d.routed_scaling = static_cast<float>(m.routed_scaling);
    d.masked_score = static_cast<float>(m.masked_score);
    return d;
}

void LatentActs::alloc(Arena& arena, int64_t N, int64_t L, DType act) {
    x = arena.alloc(act, {N, L});
    y = arena.alloc(act, {N, L});
}

void routed_moe_forward(const Tensor& y, MoeActs& acts, LatentActs& latent, const Tensor& x, const MoeWeights& w,
                        const MoeDims& d) {
    if (w.fc1.data() == nullptr) return moe_block_forward(y, acts, x, w, d);
    ops::matmul_forward(latent.x, x, w.fc1);
    moe_block_forward(latent.y, acts, x, w, d, latent.x);
    ops::matmul_forward(y, latent.y, w.fc2);
}

std::string experts_first_name(const MoeBranch& m) {
    return m.act == Activation::swiglu ? "experts.gate_up_proj" : "experts.up_proj";
}

MoeWeights moe_weights(const ParamLookup& at, const std::string& p, const MoeBranch& m) {
    MoeWeights w{at(p + "gate.weight"), at(p + experts_first_name(m)), at(p + "experts.down_proj"), Tensor()};
    if (m.router == RouterKind::sigmoid) w.correction = at(p + "gate.e_score_correction_bias");
    if (m.latent > 0) {
        w.fc1 = at(p + "fc1_latent_proj.weight");
        w.fc2 = at(p + "fc2_latent_proj.weight");
    }
    return w;
}

void MoeActs::alloc(Arena& arena, const MoeDims& d, int64_t N, DType act, std::shared_ptr<EpRowStore> local,
                    std::shared_ptr<EpRowStore> output) {
    const int64_t P = N * d.top_k;
    logits = arena.alloc(DType::f32, {N, d.num_experts});
    probs = arena.alloc(DType::f32, {N, d.num_experts});
    topk_idx = arena.alloc(DType::i32, {N, d.top_k});
    topk_weight = arena.alloc(DType::f32, {N, d.top_k});
    sorted_pair = arena.alloc(DType::i32, {P});
    pair_row = arena.alloc(DType::i32, {P});
    expert_dest_ready = false;
    if (d.ep != nullptr) {
        // The row buffers are carved per step from the stores (sized by the real routing).
        local_store = local ? std::move(local) : std::make_shared<EpRowStore>();
        output_store = output ? std::move(output) : std::make_shared<EpRowStore>();
        plan_buffers.alloc(arena, d, N);
        expert_offsets = plan_buffers.expert_offsets();
        return;
    }
    expert_offsets = arena.alloc(DType::i32, {d.num_experts + 1});
    x_perm = arena.alloc(act, {P, d.hidden});
    h_perm = arena.alloc(act, {P, d.first_width()});
    a_perm = arena.alloc(act, {P, d.intermediate});
    y_perm = arena.alloc(act, {P, d.hidden});
}

void MoeScratch::alloc(Arena& arena, const MoeDims& d, int64_t N, DType act, std::shared_ptr<EpRowStore> rows) {
    const int64_t P = N * d.top_k;
    dtopk_weight = arena.alloc(DType::f32, {N, d.top_k});
    dlogits = arena.alloc(DType::f32, {N, d.num_experts});
    if (d.ep != nullptr) {
        store = rows ? std::move(rows) : std::make_shared<EpRowStore>();
        return;
    }
    dy_perm = arena.alloc(act, {P, d.hidden});
    da_perm = arena.alloc(act, {P, d.intermediate});
    dh_perm = arena.alloc(act, {P, d.first_width()});
    dx_perm = arena.alloc(act, {P, d.hidden});
}

// The experts of `replay` in place of the router's choice, weighted as the router weights its own: the
// probability (softmax) or score (sigmoid, without the correction bias) of each, divided by their sum
// (norm_topk_prob; the sigmoid router's guard added), times the routed scaling (sigmoid). The sums run
// over k ascending, as in the CPU router kernels.
void replay_routing(MoeActs& a, const std::vector<int32_t>& replay, const MoeDims& d) {
    const int64_t N = a.topk_idx.shape()[0], K = d.top_k, E = d.num_experts;
    MF_CHECK(a.topk_idx.device() == Device::cpu, "routing replay runs on the CPU only");
    MF_CHECK(static_cast<int64_t>(replay.size()) == N * K, "routing replay: ", replay.size(), " experts for ", N,
             " tokens of top-", K);
    const bool sigmoid = d.router == RouterKind::sigmoid;
    const float* p = a.probs.ptr<float>();
    int32_t* idx = a.topk_idx.ptr<int32_t>();
    float* w = a.topk_weight.ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
        float total = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            const int32_t e = replay[static_cast<size_t>(n * K + k)];
            MF_CHECK(e >= 0 && e < E, "routing replay: expert ", e, " of token ", n, " is not in [0, ", E, ")");
            idx[n * K + k] = e;
            w[n * K + k] = p[n * E + e];
            total += w[n * K + k];
        }
        const float denom = sigmoid ? total + 1e-20f : total;
        for (int64_t k = 0; k < K; ++k) {
            if (d.norm_topk_prob) w[n * K + k] = w[n * K + k] / denom;
            if (sigmoid) w[n * K + k] = w[n * K + k] * d.routed_scaling;
        }
    }
}

bool experts_use_host_offsets(const MoeWeights& w, Device device) {
    const auto uses = [&](const Tensor& weight) {  // [E, OC, C]
        return ops::grouped_matmul_uses_host_offsets(device, weight.dim(0), weight.dim(2), weight.dim(1));
    };
    return uses(w.gate_up) || uses(w.down);
}

void moe_block_forward(const Tensor& y, MoeActs& a, const Tensor& x_router, const MoeWeights& w, const MoeDims& d,
                       const Tensor& x_experts) {
    const Tensor& x = x_experts.data() != nullptr ? x_experts : x_router;
    ops::matmul_forward(a.logits, x_router, w.router);
    if (d.router == RouterKind::sigmoid)
        ops::router_sigmoid_forward(a.probs, a.topk_idx, a.topk_weight, a.logits, w.correction, d.n_group, d.topk_group,
                                    d.norm_topk_prob, d.routed_scaling, d.masked_score);
    else
        ops::router_forward(a.probs, a.topk_idx, a.topk_weight, a.logits, d.norm_topk_prob);
    if (d.replay != nullptr) replay_routing(a, *d.replay, d);
    ops::moe_permute_indices(a.expert_offsets, a.sorted_pair, a.pair_row, a.topk_idx, d.num_experts);
    if (d.ep != nullptr) return ep_moe_forward(y, a, x, w, d);
    ops::moe_gather_forward(a.x_perm, x, a.sorted_pair, d.top_k);
    a.host_offsets.clear();
    if (experts_use_host_offsets(w, x.device())) {
        a.host_offsets.resize(static_cast<size_t>(d.num_experts + 1));
        ops::copy_to_host(a.host_offsets.data(), a.expert_offsets);
    }
    ops::grouped_matmul_forward(a.h_perm, a.x_perm, w.gate_up, a.expert_offsets, a.host_offsets);
    expert_act_forward(d.act, a.a_perm, a.h_perm);
    ops::grouped_matmul_forward(a.y_perm, a.a_perm, w.down, a.expert_offsets, a.host_offsets);
    ops::moe_unpermute_forward(y, a.y_perm, a.topk_weight, a.pair_row);
}

void moe_block_backward(const Tensor& dx_router, const MoeWeights& g, MoeScratch& s, const Tensor& dy,
                        const Tensor& dprobs, const Tensor& x_router, const MoeActs& a, const MoeWeights& w,
                        const MoeDims& d, bool accumulate_expert_grads, const ExpertGradSquares& squares,
                        const Tensor& x_experts, const Tensor& dx_experts) {
    const bool acc = accumulate_expert_grads;
    const bool latent = x_experts.data() != nullptr;
    const Tensor& x = latent ? x_experts : x_router;
    const Tensor& dx = latent ? dx_experts : dx_router;
    if (d.ep != nullptr) {
        ep_moe_backward(dx, g, s, dy, x, a, w, d, acc, squares);
    } else {
        ops::moe_unpermute_backward(s.dy_perm, s.dtopk_weight, dy, a.y_perm, a.topk_weight, a.pair_row);
        // Every pair row belongs to a group (offsets run from 0 to N·K), so the input gradients are
        // written rather than zeroed and accumulated.
        const std::span<const int32_t> host[1] = {a.host_offsets};
        const std::span<const std::span<const int32_t>> hosts =
            a.host_offsets.empty() ? std::span<const std::span<const int32_t>>() : host;
        ops::grouped_matmul_backward(s.da_perm, Tensor(), s.dy_perm, a.a_perm, w.down, a.expert_offsets, a.host_offsets,
                                     false);
        ops::grouped_matmul_backward_weight(g.down, s.dy_perm, a.a_perm, {&a.expert_offsets, 1}, hosts, acc,
                                            squares.down);
        expert_act_backward(d.act, s.dh_perm, s.da_perm, a.h_perm);
        ops::grouped_matmul_backward(s.dx_perm, Tensor(), s.dh_perm, a.x_perm, w.gate_up, a.expert_offsets,
                                     a.host_offsets, false);
        ops::grouped_matmul_backward_weight(g.gate_up, s.dh_perm, a.x_perm, {&a.expert_offsets, 1}, hosts, acc,
                                            squares.gate_up);
        ops::moe_gather_backward(dx, s.dx_perm, a.pair_row, d.top_k);
    }
    if (d.router == RouterKind::sigmoid)  // no aux loss reaches the scores
        ops::router_sigmoid_backward(s.dlogits, s.dtopk_weight, a.probs, a.topk_idx, d.norm_topk_prob,
                                     d.routed_scaling);
    else
        ops::router_backward(s.dlogits, s.dtopk_weight, dprobs, a.probs, a.topk_idx, d.norm_topk_prob);
    ops::matmul_backward(dx_router, g.router, s.dlogits, x_router, w.router);
}

}  // namespace mf::model
