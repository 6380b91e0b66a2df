// The Qwen3-MoE architecture's view of an HF config.json (model_type "qwen3_moe").
//
// Both spellings HF writes are accepted: `num_experts` / `num_local_experts`, and `rope_theta` /
// `rope_parameters.rope_theta`. Values the engine does not implement (rope scaling, sliding
// window, attention bias, another activation) are refused with the field named, never ignored.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/json.h"

namespace mf::model {

struct Qwen3MoeConfig {
    int64_t vocab_size = 0;
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;      // dense MLP layers
    int64_t moe_intermediate_size = 0;  // per expert
    int64_t num_hidden_layers = 0;
    int64_t num_attention_heads = 0;
    int64_t num_key_value_heads = 0;
    int64_t head_dim = 0;
    int64_t num_experts = 0;
    int64_t num_experts_per_tok = 0;
    int64_t decoder_sparse_step = 1;
    std::vector<int64_t> mlp_only_layers;
    bool norm_topk_prob = false;
    bool tie_word_embeddings = false;
    bool output_router_logits = false;  // HF adds the aux loss to the loss only when this is set
    double rms_norm_eps = 1e-6;
    double rope_theta = 10000.0;
    double router_aux_loss_coef = 0.001;
    int64_t max_position_embeddings = 0;
    std::string dtype = "float32";  // "dtype" (v5) or "torch_dtype" (v4): the checkpoint's storage dtype

    // HF's rule: layer i is sparse iff i ∉ mlp_only_layers and num_experts > 0 and (i+1) % step == 0.
    bool is_moe_layer(int64_t layer_idx) const;

    // Parses and validates; `source` names the file in errors ("<dir>/config.json").
    static Qwen3MoeConfig from_json(const json::Value& cfg, const std::string& source);
    // The config.json we write: HF v5 spelling, loadable by transformers and vLLM.
    json::Value to_json() const;
    // A stable hash of the architecture-relevant fields (for checkpoints).
    uint64_t hash() const;
};

// Supported HF model_type values, for the error on an unknown one.
const std::vector<std::string>& supported_model_types();

}  // namespace mf::model
