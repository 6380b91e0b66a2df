// ModelSpec: what the engine runs, independent of any one HF family.
//
//   x = embed(ids)
//   for each layer, for each branch b of the layer:   x += op_b(rmsnorm_b(x))
//   loss = mean CE(lm_head(rmsnorm(x)), targets) + coef · aux     (aux: only when the config adds it)
//
// A branch is an RMSNorm and one op: attention, a dense MLP or a dropless MoE, each with the options
// the families need (QK-norm width, projection biases, partial rotary; router renormalisation, a
// shared expert with an optional sigmoid gate). A decoder layer of Qwen3-MoE, Mixtral, OLMoE and
// Qwen2-MoE is two branches (attention, then MLP or MoE); a Nemotron-H layer is one. New mixers
// (MLA, Mamba-2) arrive as new branch kinds.
//
// Names: every branch says which HF modules hold its parameters (`module`, `norm`), so the parameter
// table speaks HF v5's in-memory names (model/param_table.h), and how its experts are stored on disk
// (MoeBranch::disk_*), so an HF checkpoint is read and written as transformers writes it.
// An architecture file (model/arch/) builds the spec from config.json and keeps the config it read
// (`config`): that is what an export writes back and what the checkpoint hash covers.
#pragma once

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

// The expert (and dense) MLP: gated SwiGLU, y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ.
struct MlpBranch {
    int64_t intermediate = 0;
};

// Router: fp32 softmax over the experts, top-k, optionally renormalised over the k (Qwen3, Mixtral,
// OLMoE, Qwen2-MoE; Mixtral's top-k → softmax is the same numbers).
struct MoeBranch {
    int64_t num_experts = 0, top_k = 0, intermediate = 0;
    bool norm_topk_prob = false;
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

enum class BranchKind { attention, mlp, moe };

struct Branch {
    BranchKind kind = BranchKind::attention;
    std::string norm;    // the branch's RMSNorm module in the layer ("input_layernorm")
    std::string module;  // the op's module in the layer ("self_attn", "mlp")
    double norm_eps = 1e-6;
    AttentionBranch attention;
    MlpBranch mlp;
    MoeBranch moe;
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
