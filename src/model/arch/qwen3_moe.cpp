// Qwen3-MoE (HF model_type "qwen3_moe": Qwen3-30B-A3B, Qwen3-235B-A22B).
//
//   layer: x += attention(input_layernorm(x))          per-head QK RMSNorm, RoPE, no biases
//          x += ffn(post_attention_layernorm(x))       MoE, or a dense MLP on mlp_only_layers and
//                                                     where (i + 1) % decoder_sparse_step != 0
//   MoE:   softmax router over num_experts, top num_experts_per_tok, renormalised iff norm_topk_prob;
//          experts of width moe_intermediate_size; no shared expert.
//   disk:  model.layers.N.mlp.gate.weight, model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
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
    const SparseLayers sparse = SparseLayers::read(r, d.num_hidden_layers);
    const bool norm_topk = r.boolean("norm_topk_prob", false);
    r.require_false("attention_bias", "attention biases");
    r.require_false("use_sliding_window", "sliding-window attention");

    ModelSpec spec = d.base_spec();
    AttentionBranch attention = d.attention();
    attention.qk_norm = QkNorm::per_head;
    const MoeBranch moe = routed_experts(d, moe_intermediate, norm_topk);
    for (int64_t l = 0; l < d.num_hidden_layers; ++l)
        spec.layers.push_back(decoder_layer(
            attention, d.rms_norm_eps,
            sparse.sparse(l, d.num_experts) ? moe_ffn(moe, d.rms_norm_eps) : dense_ffn(intermediate, d.rms_norm_eps)));

    json::Value::Object out;
    d.write(out, "num_experts");
    out.emplace_back("architectures", json::Value(json::Value::Array{json::Value("Qwen3MoeForCausalLM")}));
    out.emplace_back("attention_bias", json::Value(false));
    sparse.write(out);
    out.emplace_back("intermediate_size", json::Value(intermediate));
    out.emplace_back("moe_intermediate_size", json::Value(moe_intermediate));
    out.emplace_back("norm_topk_prob", json::Value(norm_topk));
    out.emplace_back("use_sliding_window", json::Value(false));
    spec.config = sorted_config(std::move(out));
    return spec;
}

json::Value tiny_preset() {
    json::Value c = tiny_config("qwen3_moe", "num_experts");
    c.set("intermediate_size", 128);
    c.set("moe_intermediate_size", 64);
    c.set("num_key_value_heads", 2);
    c.set("head_dim", 16);
    c.set("mlp_only_layers", json::Value(json::Value::Array{json::Value(0)}));
    c.set("norm_topk_prob", true);
    c.set("rms_norm_eps", json::Value(1e-6));
    c.set("rope_theta", json::Value(10000.0));
    return c;
}

}  // namespace

extern const Architecture kQwen3Moe;
const Architecture kQwen3Moe{"qwen3_moe", "Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)", parse, tiny_preset};

}  // namespace mf::model::arch
