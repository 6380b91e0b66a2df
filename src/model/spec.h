// ModelSpec: what the engine runs, independent of any one HF family.
//
//   x = embed(ids)
//   for each layer, for each branch b of the layer:   x += op_b(rmsnorm_b(x))
//   loss = mean CE(lm_head(rmsnorm(x)), targets) + coef · aux     (aux: only when the config adds it)
//
// A branch is an RMSNorm and one op: attention, a dense MLP or a dropless MoE, each with the options
// the families need (QK-norm width, projection biases, partial rotary; router renormalisation, a
// shared expert with an optional sigmoid gate, sigmoid routers with groups) or a Mamba-2 mixer. A
// decoder layer of Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE is two branches (attention, then MLP or
// MoE); a Nemotron-H layer is one. New mixers (MLA, linear attention) arrive as new branch kinds.
//
// Names: every branch says which HF modules hold its parameters (`module`, `norm`), so the parameter
// table speaks HF v5's in-memory names (model/param_table.h), and how its experts are stored on disk
// (MoeBranch::disk_*), so an HF checkpoint is read and written as transformers writes it.
// An architecture file (model/arch/) builds the spec from config.json and keeps the config it read
// (`config`): that is what an export writes back and what the checkpoint hash covers.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/json.h"

namespace mf::model {

// RMSNorm on q and k before RoPE: none, per head (weight [D], Qwen3) or over the whole projection
// (weight [Hq·D] and [Hkv·D], OLMoE).
enum class QkNorm { none, per_head, full_width };

struct AttentionBranch {
    int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
    QkNorm qk_norm = QkNorm::none;
    double qk_norm_eps = 1e-6;
    bool qkv_bias = false;   // q_proj, k_proj, v_proj biases
    bool o_bias = false;     // o_proj bias
    int64_t rotary_dim = 0;  // leading dims of each head that rotate (head_dim: all; partial_rotary_factor)
    double rope_theta = 10000.0;
};

// The activation of an MLP (dense, shared or expert): gated SwiGLU, y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ
// (gate_proj, up_proj, down_proj), or non-gated squared ReLU, y = relu(x·Wuᵀ)²·Wdᵀ (up_proj,
// down_proj; Nemotron-H).
enum class Activation { swiglu, relu2 };
const char* activation_name(Activation act);

struct MlpBranch {
    int64_t intermediate = 0;
    Activation act = Activation::swiglu;
};

// Router kinds. softmax: fp32 softmax over the experts, top-k, optionally renormalised over the k
// (Qwen3, Mixtral, OLMoE, Qwen2-MoE; Mixtral's top-k → softmax is the same numbers). sigmoid:
// scores σ(logits); the choice adds a correction bias (a buffer, `gate.e_score_correction_bias`,
// never trained) and keeps the topk_group best of n_group expert groups (a group's score: its two
// best); weights are the chosen scores, optionally renormalised, × routed_scaling (Nemotron-H,
// DeepSeek-V3; `masked_score` is what a dropped group's experts compete with: −inf or 0).
enum class RouterKind { softmax, sigmoid };

struct MoeBranch {
    int64_t num_experts = 0, top_k = 0, intermediate = 0;
    bool norm_topk_prob = false;
    RouterKind router = RouterKind::softmax;
    int64_t n_group = 1, topk_group = 1;
    double routed_scaling = 1.0;
    double masked_score = -INFINITY;
    Activation act = Activation::swiglu;  // the experts' and the shared expert's
    // LatentMoE (Nemotron 3 Super/Ultra): the routed experts work in a width of their own, between
    // fc1_latent_proj [latent, H] and fc2_latent_proj [H, latent]; the router and the shared expert see
    // x itself. 0: none.
    int64_t latent = 0;
    std::string shared_module = "shared_expert";
    // A shared expert every token passes through (Qwen2-MoE), of its own width, added to the routed
    // output, times sigmoid(x·w_gateᵀ) when `shared_gate` (w_gate [1, H]).
    int64_t shared_intermediate = 0;
    bool shared_gate = false;
    // On disk: the module holding the router and experts when HF's checkpoints name it differently from
    // its v5 in-memory module (Mixtral: block_sparse_moe), and each expert's three projections
    // (gate, up, down; Mixtral: w1, w3, w2), stored one tensor per expert and projection.
    std::string disk_module;
    std::string disk_gate = "gate_proj", disk_up = "up_proj", disk_down = "down_proj";
    // Or stored stacked, as `experts.gate_up_proj` and `experts.down_proj`, optionally transposed per
    // expert and with gate/up rows interleaved (ParamStorage; gpt-oss).
    bool disk_stacked = false, disk_transposed = false, disk_interleaved = false;
};

// The Mamba-2 mixer (Nemotron-H): in_proj → [z | xBC | dt]; xBC = silu(causal depthwise conv(xBC));
// the SSD scan over x, B, C with dt = clamp(softplus(dt + dt_bias), dt_min, dt_max), A = −exp(A_log)
// and the D skip; the gated RMSNorm norm(y·silu(z)) over groups of I/G; out_proj. I = num_heads ·
// head_dim; the conv and the scan restart at every document of a packed row (ops.h, Mamba-2).
struct MambaBranch {
    int64_t num_heads = 0, head_dim = 0, num_groups = 1, state_size = 0, conv_kernel = 4;
    int64_t chunk_size = 128;  // the GPU scan's blocking (the numbers do not depend on it)
    bool conv_bias = true;
    double dt_min = 0.0, dt_max = INFINITY;
    double norm_eps = 1e-5;  // the gated norm's
    int64_t inner() const { return num_heads * head_dim; }
    int64_t conv_dim() const { return inner() + 2 * num_groups * state_size; }
};

enum class BranchKind { attention, mlp, moe, mamba };

struct Branch {
    BranchKind kind = BranchKind::attention;
    std::string norm;    // the branch's RMSNorm module in the layer ("input_layernorm")
    std::string module;  // the op's module in the layer ("self_attn", "mlp")
    double norm_eps = 1e-6;
    AttentionBranch attention;
    MlpBranch mlp;
    MoeBranch moe;
    MambaBranch mamba;
};

struct LayerSpec {
    std::vector<Branch> branches;
    const Branch* find(BranchKind kind) const;
};

// One line on a branch, for `moeforge info`: "attention (32 q heads, 4 kv heads, dim 128, qk-norm, rope)".
std::string describe_branch(const Branch& b);

struct ModelSpec {
    std::string model_type;
    int64_t vocab_size = 0, hidden_size = 0;
    // HF v5's in-memory names of the modules outside the layers, and the prefix the checkpoints store
    // "model." under (Nemotron-H: "backbone."; empty: "model." itself).
    std::string embedding_module = "model.embed_tokens", final_norm_module = "model.norm";
    std::string disk_model_prefix;
    bool tie_word_embeddings = false;
    // config.pad_token_id: HF's nn.Embedding(padding_idx=...) keeps that row's gradient zero (the tied
    // head's gradient still reaches it) and _init_weights zeroes it. -1: none.
    int64_t padding_idx = -1;
    double final_norm_eps = 1e-6;
    std::vector<LayerSpec> layers;
    // HF adds coef · aux to the loss only when config.output_router_logits is set.
    bool output_router_logits = false;
    double router_aux_loss_coef = 0.0;
    int64_t max_position_embeddings = 0;
    std::string dtype = "float32";  // the checkpoint's storage dtype: float32, bfloat16 or float16
    json::Value config;             // config.json as the architecture writes it (dtype included)

    int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
    // The MoE branch of layer l, or null.
    const MoeBranch* moe(int64_t l) const;
    bool is_moe_layer(int64_t l) const { return moe(l) != nullptr; }
    // The experts of the MoE layers (every MoE layer has the same number), 0 without any.
    int64_t num_experts() const;
    bool adds_aux_loss() const { return output_router_logits && num_experts() > 0; }
    // The config to write: `config` with the current dtype.
    json::Value to_json() const;
    // A stable hash of the architecture (config.json without its dtype), for checkpoints.
    uint64_t hash() const;
    // Checks the invariants the blocks rely on; `source` names the config in errors.
    void validate(const std::string& source) const;
};

}  // namespace mf::model
