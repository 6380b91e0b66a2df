// Qwen3-MoE (HF model_type "qwen3_moe": Qwen3-30B-A3B, Qwen3-235B-A22B).
//
//   layer: x += attention(input_layernorm(x))          per-head QK RMSNorm, RoPE, no biases
//          x += ffn(post_attention_layernorm(x))       MoE, or a dense MLP on mlp_only_layers and
//                                                     where (i + 1) % decoder_sparse_step != 0
//   MoE:   softmax router over num_experts, top num_experts_per_tok, renormalised iff norm_topk_prob;
//          experts of width moe_intermediate_size; no shared expert.
//   disk:  model.layers.N.mlp.gate.weight, model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
#include <algorithm>

#include "model/arch/architecture.h"
#include "model/arch/config_reader.h"

namespace mf::model::arch {

namespace {

ModelSpec parse(const json::Value& cfg, const std::string& source) {
    const ConfigReader r(cfg, source);
    DecoderConfig d = DecoderConfig::read(r, FamilyDefaults{});
    d.head_dim_written = true;
    d.pad_written = false;  // the config this family has always written (its checkpoints' hash covers it)
    const int64_t intermediate = r.integer("intermediate_size", true, 0, 1);
    const int64_t moe_intermediate = r.integer("moe_intermediate_size", true, 0, 1);
    const int64_t sparse_step = r.integer("decoder_sparse_step", false, 1, 1);
    const std::vector<int64_t> mlp_only = r.layer_list("mlp_only_layers", d.num_hidden_layers);
    const bool norm_topk = r.boolean("norm_topk_prob", false);
    r.require_false("attention_bias", "attention biases");
    r.require_false("use_sliding_window", "sliding-window attention");

    ModelSpec spec = d.base_spec();
    AttentionBranch attention = d.attention();
    attention.qk_norm = QkNorm::per_head;
    MoeBranch moe;
    moe.num_experts = d.num_experts;
    moe.top_k = d.num_experts_per_tok;
    moe.intermediate = moe_intermediate;
    moe.norm_topk_prob = norm_topk;
    for (int64_t l = 0; l < d.num_hidden_layers; ++l) {
        // HF's rule: sparse iff not in mlp_only_layers, experts exist and (l + 1) % step == 0.
        const bool sparse = std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end() && d.num_experts > 0 &&
                            (l + 1) % sparse_step == 0;
        spec.layers.push_back(decoder_layer(attention, d.rms_norm_eps,
                                            sparse ? moe_ffn(moe, d.rms_norm_eps) : dense_ffn(intermediate, d.rms_norm_eps)));
    }

    json::Value::Array only;
    for (int64_t l : mlp_only) only.emplace_back(l);
    json::Value::Object out;
    d.write(out, "num_experts");
    out.emplace_back("architectures", json::Value(json::Value::Array{json::Value("Qwen3MoeForCausalLM")}));
    out.emplace_back("attention_bias", json::Value(false));
    out.emplace_back("decoder_sparse_step", json::Value(sparse_step));
    out.emplace_back("intermediate_size", json::Value(intermediate));
    out.emplace_back("mlp_only_layers", json::Value(std::move(only)));
    out.emplace_back("moe_intermediate_size", json::Value(moe_intermediate));
    out.emplace_back("norm_topk_prob", json::Value(norm_topk));
    out.emplace_back("use_sliding_window", json::Value(false));
    spec.config = sorted_config(std::move(out));
    return spec;
}

json::Value tiny_preset() {
    json::Value c = json::Value::object();
    c.set("model_type", "qwen3_moe");
    c.set("vocab_size", 2048);
    c.set("hidden_size", 64);
    c.set("intermediate_size", 128);
    c.set("moe_intermediate_size", 64);
    c.set("num_hidden_layers", 4);
    c.set("num_attention_heads", 4);
    c.set("num_key_value_heads", 2);
    c.set("head_dim", 16);
    c.set("num_experts", 8);
    c.set("num_experts_per_tok", 2);
    c.set("decoder_sparse_step", 1);
    c.set("mlp_only_layers", json::Value(json::Value::Array{json::Value(0)}));
    c.set("norm_topk_prob", true);
    c.set("tie_word_embeddings", false);
    c.set("output_router_logits", true);
    c.set("rms_norm_eps", json::Value(1e-6));
    c.set("rope_theta", json::Value(10000.0));
    c.set("router_aux_loss_coef", json::Value(0.01));
    c.set("max_position_embeddings", 4096);
    c.set("dtype", "float32");
    return c;
}

}  // namespace

extern const Architecture kQwen3Moe;
const Architecture kQwen3Moe{"qwen3_moe", "Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)", parse, tiny_preset};

}  // namespace mf::model::arch
