#include "model/qwen3_moe.h"

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"

namespace mf::model {

struct Qwen3Moe::Layer {
    bool is_moe = false;
    float *ln1, *ln2;
    AttentionWeights attn;
    MoeWeights moe{};
    MlpWeights mlp{};
    // Offsets of the same tensors, to point into the gradient buffer.
    float *g_ln1, *g_ln2;
    AttentionWeights g_attn;
    MoeWeights g_moe{};
    MlpWeights g_mlp{};
};

struct Qwen3Moe::Workspace {
    int64_t B = -1, T = -1;
    Arena arena;
    struct LayerActs {
        Tensor ln1, ln1_rstd, x_mid, ln2, ln2_rstd, ffn_out, attn_out;
        AttentionActs attn;
        MoeActs moe;
        MlpActs mlp;
    };
    std::vector<Tensor> resid;  // L + 1: resid[l] is the input of layer l
    std::vector<LayerActs> layers;
    Tensor lnf, lnf_rstd, losses, token_mask;
    // backward
    Tensor d_resid, d_mid, d_ln, dprobs;
    AttentionScratch attn_scratch;
    MoeScratch moe_scratch;
    MlpScratch mlp_scratch;
};

namespace {

float* slice(Buffer& buf, const ParamSpec& spec) { return static_cast<float*>(buf.data()) + spec.offset; }

AttentionDims attention_dims(const Qwen3MoeConfig& c) {
    return {c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            static_cast<float>(c.rms_norm_eps), static_cast<float>(c.rope_theta)};
}

MoeDims moe_dims(const Qwen3MoeConfig& c) {
    return {c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob};
}

}  // namespace

ParamTable qwen3_moe_param_table(const Qwen3MoeConfig& c) {
    ParamTable table;
    const int64_t H = c.hidden_size, D = c.head_dim;
    table.add("model.embed_tokens.weight", {c.vocab_size, H});
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        table.add(p + "self_attn.q_proj.weight", {c.num_attention_heads * D, H});
        table.add(p + "self_attn.k_proj.weight", {c.num_key_value_heads * D, H});
        table.add(p + "self_attn.v_proj.weight", {c.num_key_value_heads * D, H});
        table.add(p + "self_attn.o_proj.weight", {H, c.num_attention_heads * D});
        table.add(p + "self_attn.q_norm.weight", {D});
        table.add(p + "self_attn.k_norm.weight", {D});
        if (c.is_moe_layer(l)) {
            table.add(p + "mlp.gate.weight", {c.num_experts, H});
            table.add(p + "mlp.experts.gate_up_proj", {c.num_experts, 2 * c.moe_intermediate_size, H}, true);
            table.add(p + "mlp.experts.down_proj", {c.num_experts, H, c.moe_intermediate_size}, true);
        } else {
            // gate_proj then up_proj, adjacent: together the fused [2I, H] gate_up matrix.
            table.add(p + "mlp.gate_proj.weight", {c.intermediate_size, H});
            table.add(p + "mlp.up_proj.weight", {c.intermediate_size, H});
            table.add(p + "mlp.down_proj.weight", {H, c.intermediate_size});
        }
        table.add(p + "input_layernorm.weight", {H});
        table.add(p + "post_attention_layernorm.weight", {H});
    }
    table.add("model.norm.weight", {H});
    if (!c.tie_word_embeddings) table.add("lm_head.weight", {c.vocab_size, H});
    return table;
}

Qwen3Moe::Qwen3Moe(Qwen3MoeConfig config)
    : config_(std::move(config)), table_(qwen3_moe_param_table(config_)), ws_(std::make_unique<Workspace>()) {
    params_ = Buffer(static_cast<size_t>(table_.total()) * sizeof(float), Device::cpu);
    grads_ = Buffer(static_cast<size_t>(table_.total()) * sizeof(float), Device::cpu);
    params_.zero();
    grads_.zero();
    build_layers();
}

Qwen3Moe::~Qwen3Moe() = default;

void Qwen3Moe::build_layers() {
    layers_.clear();
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        Layer L;
        L.is_moe = config_.is_moe_layer(l);
        for (int pass = 0; pass < 2; ++pass) {
            Buffer& buf = pass == 0 ? params_ : grads_;
            auto at = [&](const std::string& name) { return slice(buf, table_.get(p + name)); };
            AttentionWeights a{at("self_attn.q_proj.weight"), at("self_attn.k_proj.weight"),
                               at("self_attn.v_proj.weight"), at("self_attn.o_proj.weight"),
                               at("self_attn.q_norm.weight"), at("self_attn.k_norm.weight")};
            (pass == 0 ? L.attn : L.g_attn) = a;
            (pass == 0 ? L.ln1 : L.g_ln1) = at("input_layernorm.weight");
            (pass == 0 ? L.ln2 : L.g_ln2) = at("post_attention_layernorm.weight");
            if (L.is_moe) {
                (pass == 0 ? L.moe : L.g_moe) =
                    MoeWeights{at("mlp.gate.weight"), at("mlp.experts.gate_up_proj"), at("mlp.experts.down_proj")};
            } else {
                (pass == 0 ? L.mlp : L.g_mlp) = MlpWeights{at("mlp.gate_proj.weight"), at("mlp.down_proj.weight")};
            }
        }
        layers_.push_back(L);
    }
}

Tensor Qwen3Moe::param(std::string_view name) {
    const ParamSpec& s = table_.get(name);
    return params_.as(DType::f32, s.shape, static_cast<size_t>(s.offset) * sizeof(float));
}

Tensor Qwen3Moe::grad(std::string_view name) {
    const ParamSpec& s = table_.get(name);
    return grads_.as(DType::f32, s.shape, static_cast<size_t>(s.offset) * sizeof(float));
}

void Qwen3Moe::init_random(uint64_t seed, float std) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, std);
    float* p = param_data();
    for (const auto& s : table_.specs()) {
        const bool is_norm = s.shape.size() == 1;
        for (int64_t i = 0; i < s.numel; ++i) p[s.offset + i] = is_norm ? 1.0f : normal(rng);
    }
}

int64_t qwen3_moe_active_params(const Qwen3MoeConfig& c, const ParamTable& table) {
    int64_t n = 0;
    for (const auto& s : table.specs()) {
        if (s.is_expert) n += s.numel / c.num_experts * c.num_experts_per_tok;
        else n += s.numel;
    }
    return n;
}

double qwen3_moe_flops_per_token(const Qwen3MoeConfig& c, int64_t T) {
    // 6 × matmul parameters touched per token + 3 × causal attention forward (BENCHMARKS.md).
    double matmul = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        matmul += static_cast<double>(c.hidden_size) * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads);
        if (c.is_moe_layer(l))
            matmul += static_cast<double>(c.hidden_size) * (c.num_experts + 3.0 * c.moe_intermediate_size * c.num_experts_per_tok);
        else
            matmul += 3.0 * c.hidden_size * c.intermediate_size;
    }
    matmul += static_cast<double>(c.hidden_size) * c.vocab_size;
    const double attention = static_cast<double>(c.num_hidden_layers) * 4.0 * T * c.num_attention_heads * c.head_dim / 2.0;
    return 6.0 * matmul + 3.0 * attention;
}

namespace {
bool finite(const Tensor& t) {
    const float* p = static_cast<const float*>(t.data());
    for (int64_t i = 0; i < t.numel(); ++i)
        if (!std::isfinite(p[i])) return false;
    return true;
}
}  // namespace

std::string Qwen3Moe::locate_nonfinite_activation() const {
    const Workspace& ws = *ws_;
    if (ws.resid.empty()) return "(no forward pass yet)";
    if (!finite(ws.resid[0])) return "the token embeddings";
    for (size_t l = 0; l < ws.layers.size(); ++l) {
        if (!finite(ws.layers[l].x_mid)) return "layer " + std::to_string(l) + " (self-attention output)";
        if (!finite(ws.resid[l + 1]))
            return "layer " + std::to_string(l) + (layers_[l].is_moe ? " (MoE output)" : " (MLP output)");
    }
    if (!finite(ws.lnf)) return "the final norm";
    return "the loss head (logits / cross-entropy)";
}

std::string Qwen3Moe::locate_nonfinite_gradient() {
    const float* g = grad_data();
    for (const auto& s : table_.specs())
        for (int64_t i = 0; i < s.numel; ++i)
            if (!std::isfinite(g[s.offset + i])) return s.name;
    return "(none)";
}

size_t Qwen3Moe::activation_bytes() const { return ws_->arena.high_water(); }

void Qwen3Moe::plan(int64_t B, int64_t T) {
    Workspace& ws = *ws_;
    if (ws.B != B || ws.T != T) {
        // Replay the allocation sequence on a measuring arena, then allocate exactly that much.
        ws.arena = Arena::measuring(Device::cpu);
        allocate_step(B, T);
        ws.arena = Arena(ws.arena.high_water(), Device::cpu);
        ws.B = B;
        ws.T = T;
    }
    ws.arena.reset();
    allocate_step(B, T);
}

void Qwen3Moe::allocate_step(int64_t B, int64_t T) {
    Workspace& ws = *ws_;
    const auto& c = config_;
    const int64_t N = B * T, H = c.hidden_size;
    const AttentionDims ad = attention_dims(c);
    const MoeDims md = moe_dims(c);
    Arena& A = ws.arena;
    ws.resid.assign(static_cast<size_t>(c.num_hidden_layers + 1), Tensor());
    ws.layers.assign(static_cast<size_t>(c.num_hidden_layers), Workspace::LayerActs());
    ws.resid[0] = A.alloc(DType::f32, {N, H});
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        auto& la = ws.layers[static_cast<size_t>(l)];
        la.ln1 = A.alloc(DType::f32, {N, H});
        la.ln1_rstd = A.alloc(DType::f32, {N});
        la.attn.alloc(A, ad, B, T);
        la.attn_out = A.alloc(DType::f32, {N, H});
        la.x_mid = A.alloc(DType::f32, {N, H});
        la.ln2 = A.alloc(DType::f32, {N, H});
        la.ln2_rstd = A.alloc(DType::f32, {N});
        if (c.is_moe_layer(l)) la.moe.alloc(A, md, N);
        else la.mlp.alloc(A, N, c.intermediate_size);
        la.ffn_out = A.alloc(DType::f32, {N, H});
        ws.resid[static_cast<size_t>(l + 1)] = A.alloc(DType::f32, {N, H});
    }
    ws.lnf = A.alloc(DType::f32, {N, H});
    ws.lnf_rstd = A.alloc(DType::f32, {N});
    ws.losses = A.alloc(DType::f32, {N});
    ws.token_mask = A.alloc(DType::f32, {N});
    ws.d_resid = A.alloc(DType::f32, {N, H});
    ws.d_mid = A.alloc(DType::f32, {N, H});
    ws.d_ln = A.alloc(DType::f32, {N, H});
    ws.attn_scratch.alloc(A, ad, B, T);
    if (c.num_experts > 0) {
        ws.dprobs = A.alloc(DType::f32, {N, c.num_experts});
        ws.moe_scratch.alloc(A, md, N);
    }
    ws.mlp_scratch.alloc(A, N, c.intermediate_size);
}

void Qwen3Moe::validate(const data::Batch& b) const {
    const size_t n = static_cast<size_t>(b.B * b.T);
    MF_CHECK(b.B > 0 && b.T > 0, "empty batch");
    MF_CHECK(b.input_ids.size() == n && b.targets.size() == n && b.positions.size() == n && b.doc_ids.size() == n &&
                 b.is_pad.size() == n,
             "batch arrays do not match B·T = ", n);
    for (size_t i = 0; i < n; ++i) {
        if (b.input_ids[i] < 0 || b.input_ids[i] >= config_.vocab_size)
            fail("token id ", b.input_ids[i], " at position ", i, " is outside the vocabulary [0, ", config_.vocab_size, ")");
        if (b.targets[i] != data::kIgnoreIndex && (b.targets[i] < 0 || b.targets[i] >= config_.vocab_size))
            fail("label ", b.targets[i], " at position ", i, " is outside the vocabulary [0, ", config_.vocab_size,
                 ") and is not -100");
        if (b.positions[i] < 0) fail("negative position at ", i);
    }
}

StepStats Qwen3Moe::step(const data::Batch& batch, const LossScales* scales, float* logits) {
    validate(batch);
    const auto& c = config_;
    const int64_t B = batch.B, T = batch.T, N = B * T, H = c.hidden_size, V = c.vocab_size;
    plan(B, T);
    Workspace& ws = *ws_;
    const AttentionDims ad = attention_dims(c);
    const MoeDims md = moe_dims(c);
    const int32_t* pos = batch.positions.data();
    const int32_t* docs = batch.doc_ids.data();
    const float eps = static_cast<float>(c.rms_norm_eps);
    float* P = param_data();
    float* G = grad_data();
    const float* wte = P + table_.get("model.embed_tokens.weight").offset;
    const ParamSpec& head_spec = table_.get(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
    const ParamSpec& normf_spec = table_.get("model.norm.weight");

    // --- forward -----------------------------------------------------------------------------------
    cpu::embedding_forward(ws.resid[0].ptr<float>(), batch.input_ids.data(), wte, N, H);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        const Layer& L = layers_[static_cast<size_t>(l)];
        auto& la = ws.layers[static_cast<size_t>(l)];
        const float* x = ws.resid[static_cast<size_t>(l)].ptr<float>();
        float* x_mid = la.x_mid.ptr<float>();
        float* x_out = ws.resid[static_cast<size_t>(l + 1)].ptr<float>();
        cpu::rmsnorm_forward(la.ln1.ptr<float>(), la.ln1_rstd.ptr<float>(), x, L.ln1, N, H, eps);
        attention_block_forward(la.attn_out.ptr<float>(), la.attn, la.ln1.ptr<float>(), L.attn, ad, B, T, pos, docs);
        const float* ao = la.attn_out.ptr<float>();
        for (int64_t i = 0; i < N * H; ++i) x_mid[i] = x[i] + ao[i];
        cpu::rmsnorm_forward(la.ln2.ptr<float>(), la.ln2_rstd.ptr<float>(), x_mid, L.ln2, N, H, eps);
        if (L.is_moe) moe_block_forward(la.ffn_out.ptr<float>(), la.moe, la.ln2.ptr<float>(), L.moe, md, N);
        else mlp_block_forward(la.ffn_out.ptr<float>(), la.mlp, la.ln2.ptr<float>(), L.mlp, N, H, c.intermediate_size);
        const float* fo = la.ffn_out.ptr<float>();
        for (int64_t i = 0; i < N * H; ++i) x_out[i] = x_mid[i] + fo[i];
    }
    const float* x_final = ws.resid.back().ptr<float>();
    cpu::rmsnorm_forward(ws.lnf.ptr<float>(), ws.lnf_rstd.ptr<float>(), x_final, P + normf_spec.offset, N, H, eps);
    if (logits != nullptr) cpu::matmul_forward(logits, ws.lnf.ptr<float>(), P + head_spec.offset, N, H, V);

    // Loss head: CE over counted targets (and, with scales, dL/d lnf and the head's weight grad).
    float* d_ln = ws.d_ln.ptr<float>();
    if (scales != nullptr) std::memset(d_ln, 0, static_cast<size_t>(N * H) * sizeof(float));
    cpu::lm_head_cross_entropy(ws.losses.ptr<float>(), scales ? d_ln : nullptr, scales ? G + head_spec.offset : nullptr,
                               ws.lnf.ptr<float>(), P + head_spec.offset, batch.targets.data(), N, H, V,
                               scales ? static_cast<float>(scales->ce) : 0.0f);
    StepStats stats;
    for (int64_t i = 0; i < N; ++i) stats.ce_sum += ws.losses.ptr<float>()[i];
    stats.num_targets = batch.num_targets();

    // Aux loss over all MoE layers together (HF's load_balancing_loss_func, padding excluded).
    float* mask = ws.token_mask.ptr<float>();
    double rows_per_layer = 0;
    for (int64_t i = 0; i < N; ++i) {
        mask[i] = batch.is_pad[static_cast<size_t>(i)] ? 0.0f : 1.0f;
        rows_per_layer += mask[i];
    }
    const int64_t E = c.num_experts, K = c.num_experts_per_tok;
    std::vector<double> counts(static_cast<size_t>(E), 0.0), prob_sums(static_cast<size_t>(E), 0.0);
    double rows = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        if (!layers_[static_cast<size_t>(l)].is_moe) continue;
        const auto& m = ws.layers[static_cast<size_t>(l)].moe;
        const int32_t* idx = m.topk_idx.ptr<int32_t>();
        const float* probs = m.probs.ptr<float>();
        for (int64_t t = 0; t < N; ++t) {
            if (mask[t] == 0.0f) continue;
            for (int64_t k = 0; k < K; ++k) counts[static_cast<size_t>(idx[t * K + k])] += 1.0;
            for (int64_t e = 0; e < E; ++e) prob_sums[static_cast<size_t>(e)] += probs[t * E + e];
        }
        rows += rows_per_layer;
    }
    if (rows > 0) {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += counts[static_cast<size_t>(e)] * prob_sums[static_cast<size_t>(e)];
        stats.aux = static_cast<double>(E) * s / (rows * rows);
    }
    if (scales == nullptr) return stats;

    // --- backward ----------------------------------------------------------------------------------
    // d aux / d probs[t, e] = E · C_e / R² for every counted row t of every MoE layer.
    if (E > 0 && rows > 0) {
        float* dp = ws.dprobs.ptr<float>();
        for (int64_t t = 0; t < N; ++t)
            for (int64_t e = 0; e < E; ++e)
                dp[t * E + e] = static_cast<float>(scales->aux * static_cast<double>(E) * counts[static_cast<size_t>(e)] /
                                                   (rows * rows)) * mask[t];
    }
    float* d_resid = ws.d_resid.ptr<float>();
    float* d_mid = ws.d_mid.ptr<float>();
    const size_t act_bytes = static_cast<size_t>(N * H) * sizeof(float);
    std::memset(d_resid, 0, act_bytes);
    cpu::rmsnorm_backward(d_resid, G + normf_spec.offset, d_ln, x_final, P + normf_spec.offset, ws.lnf_rstd.ptr<float>(),
                          N, H);
    for (int64_t l = c.num_hidden_layers - 1; l >= 0; --l) {
        const Layer& L = layers_[static_cast<size_t>(l)];
        auto& la = ws.layers[static_cast<size_t>(l)];
        // x_out = x_mid + ffn(rmsnorm(x_mid))
        std::memcpy(d_mid, d_resid, act_bytes);
        std::memset(d_ln, 0, act_bytes);
        if (L.is_moe)
            moe_block_backward(d_ln, L.g_moe, ws.moe_scratch, d_resid, rows > 0 ? ws.dprobs.ptr<float>() : nullptr,
                               la.ln2.ptr<float>(), la.moe, L.moe, md, N);
        else
            mlp_block_backward(d_ln, L.g_mlp, ws.mlp_scratch, d_resid, la.ln2.ptr<float>(), la.mlp, L.mlp, N, H,
                               c.intermediate_size);
        cpu::rmsnorm_backward(d_mid, L.g_ln2, d_ln, la.x_mid.ptr<float>(), L.ln2, la.ln2_rstd.ptr<float>(), N, H);
        // x_mid = x + attention(rmsnorm(x))
        std::memcpy(d_resid, d_mid, act_bytes);
        std::memset(d_ln, 0, act_bytes);
        attention_block_backward(d_ln, L.g_attn, ws.attn_scratch, d_mid, la.ln1.ptr<float>(), la.attn, L.attn, ad, B, T,
                                 pos, docs);
        cpu::rmsnorm_backward(d_resid, L.g_ln1, d_ln, ws.resid[static_cast<size_t>(l)].ptr<float>(), L.ln1,
                              la.ln1_rstd.ptr<float>(), N, H);
    }
    cpu::embedding_backward(G + table_.get("model.embed_tokens.weight").offset, d_resid, batch.input_ids.data(), N, H);
    return stats;
}

}  // namespace mf::model
