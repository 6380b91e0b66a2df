// A Qwen3-MoE config.json built from named fields (the tests' tiny models), and its ModelSpec.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/json.h"
#include "model/arch/architecture.h"
#include "model/spec.h"

namespace mf::test {

struct Qwen3Config {
    int64_t vocab_size = 0;
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;
    int64_t moe_intermediate_size = 0;
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
    bool output_router_logits = false;
    double rms_norm_eps = 1e-6;
    double rope_theta = 10000.0;
    double router_aux_loss_coef = 0.001;
    int64_t max_position_embeddings = 0;
    std::string dtype = "float32";

    // HF's rule: layer l is sparse iff l is not in mlp_only_layers, experts exist and (l + 1) % step == 0.
    bool is_moe_layer(int64_t l) const {
        for (int64_t d : mlp_only_layers)
            if (d == l) return false;
        return num_experts > 0 && (l + 1) % decoder_sparse_step == 0;
    }

    json::Value json() const {
        json::Value::Array only;
        for (int64_t l : mlp_only_layers) only.emplace_back(l);
        json::Value c = json::Value::object();
        c.set("model_type", "qwen3_moe");
        c.set("vocab_size", vocab_size);
        c.set("hidden_size", hidden_size);
        c.set("intermediate_size", intermediate_size);
        c.set("moe_intermediate_size", moe_intermediate_size);
        c.set("num_hidden_layers", num_hidden_layers);
        c.set("num_attention_heads", num_attention_heads);
        c.set("num_key_value_heads", num_key_value_heads);
        if (head_dim > 0) c.set("head_dim", head_dim);
        c.set("num_experts", num_experts);
        c.set("num_experts_per_tok", num_experts_per_tok);
        c.set("decoder_sparse_step", decoder_sparse_step);
        c.set("mlp_only_layers", json::Value(std::move(only)));
        c.set("norm_topk_prob", norm_topk_prob);
        c.set("tie_word_embeddings", tie_word_embeddings);
        c.set("output_router_logits", output_router_logits);
        c.set("rms_norm_eps", json::Value(rms_norm_eps));
        c.set("rope_theta", json::Value(rope_theta));
        c.set("router_aux_loss_coef", json::Value(router_aux_loss_coef));
        if (max_position_embeddings > 0) c.set("max_position_embeddings", max_position_embeddings);
        c.set("dtype", dtype);
        return c;
    }
    model::ModelSpec spec() const { return model::parse_model_config(json(), "test qwen3_moe config"); }
    operator model::ModelSpec() const { return spec(); }  // NOLINT: tests pass it where a spec is wanted
};

}  // namespace mf::test
