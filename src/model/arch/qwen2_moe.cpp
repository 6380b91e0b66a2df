// Qwen2-MoE (HF model_type "qwen2_moe": Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).
//
//   layer: x += attention(input_layernorm(x))          q/k/v biases, no QK-norm, RoPE
//          x += ffn(post_attention_layernorm(x))       MoE, or a dense MLP on mlp_only_layers and
//                                                     where (i + 1) % decoder_sparse_step != 0
//   MoE:   softmax router over num_experts, top num_experts_per_tok, renormalised iff norm_topk_prob
//          (off by default); experts of width moe_intermediate_size; plus a shared expert of width
//          shared_expert_intermediate_size gated by sigmoid(x·shared_expert_gateᵀ).
//   disk:  model.layers.N.mlp.gate.weight, model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight,
//          model.layers.N.mlp.shared_expert.{gate,up,down}_proj.weight, model.layers.N.mlp.shared_expert_gate.weight
//   options: qkv_bias (default true).
//   refused: use_sliding_window, a layer_types entry other than "full_attention".
#include "model/arch/architecture.h"
#include "model/arch/config_reader.h"

namespace mf::model::arch {

namespace {

ModelSpec parse(const json::Value& cfg, const std::string& source) {
    const ConfigReader r(cfg, source);
    FamilyDefaults defaults;
    defaults.num_key_value_heads = 16;
    const DecoderConfig d = DecoderConfig::read(r, defaults);
    const int64_t intermediate = r.integer("intermediate_size", true, 0, 1);
    const int64_t moe_intermediate = r.integer("moe_intermediate_size", true, 0, 1);
    const int64_t shared_intermediate = r.integer("shared_expert_intermediate_size", true, 0, 1);
    const SparseLayers sparse = SparseLayers::read(r, d.num_hidden_layers);
    const bool norm_topk = r.boolean("norm_topk_prob", false);
    const bool qkv_bias = r.boolean("qkv_bias", true);
    r.require_false("use_sliding_window", "sliding-window attention");
    if (const json::Value* types = r.get("layer_types")) {
        if (!types->is_array() || static_cast<int64_t>(types->size()) != d.num_hidden_layers)
            fail(source, ": field \"layer_types\" must list one type per layer (", d.num_hidden_layers, ")");
        for (const json::Value& t : types->as_array())
            if (!t.is_string() || t.as_string() != "full_attention")
                fail(source, ": field \"layer_types\" holds ", t.dump(),
                     ", only \"full_attention\" is supported (sliding-window attention is not)");
    }

    ModelSpec spec = d.base_spec();
    AttentionBranch attention = d.attention();
    attention.qkv_bias = qkv_bias;
    MoeBranch moe = routed_experts(d, moe_intermediate, norm_topk);
    moe.shared_intermediate = shared_intermediate;
    moe.shared_gate = true;
    for (int64_t l = 0; l < d.num_hidden_layers; ++l)
        spec.layers.push_back(decoder_layer(
            attention, d.rms_norm_eps,
            sparse.sparse(l, d.num_experts) ? moe_ffn(moe, d.rms_norm_eps) : dense_ffn(intermediate, d.rms_norm_eps)));

    json::Value::Object out;
    d.write(out, "num_experts");
    out.emplace_back("architectures", json::Value(json::Value::Array{json::Value("Qwen2MoeForCausalLM")}));
    sparse.write(out);
    out.emplace_back("intermediate_size", json::Value(intermediate));
    out.emplace_back("moe_intermediate_size", json::Value(moe_intermediate));
    out.emplace_back("norm_topk_prob", json::Value(norm_topk));
    out.emplace_back("qkv_bias", json::Value(qkv_bias));
    out.emplace_back("shared_expert_intermediate_size", json::Value(shared_intermediate));
    out.emplace_back("use_sliding_window", json::Value(false));
    spec.config = sorted_config(std::move(out));
    return spec;
}

json::Value tiny_preset() {
    json::Value c = tiny_config("qwen2_moe", "num_experts");
    c.set("intermediate_size", 128);
    c.set("moe_intermediate_size", 32);
    c.set("shared_expert_intermediate_size", 96);
    c.set("num_key_value_heads", 4);
    c.set("mlp_only_layers", json::Value(json::Value::Array{json::Value(0)}));
    c.set("norm_topk_prob", false);
    return c;
}

}  // namespace

extern const Architecture kQwen2Moe;
const Architecture kQwen2Moe{"qwen2_moe", "Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B)", parse, tiny_preset};

}  // namespace mf::model::arch
