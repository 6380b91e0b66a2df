// OLMoE (HF model_type "olmoe": OLMoE-1B-7B).
//
//   layer: x += attention(input_layernorm(x))          RMSNorm over the whole q and k projections
//                                                     (weights [Hq·D] and [Hkv·D]) before RoPE, no biases
//          x += moe(post_attention_layernorm(x))       every layer sparse
//   MoE:   softmax router over num_experts, top num_experts_per_tok, renormalised iff norm_topk_prob
//          (off in the released model); experts of width intermediate_size; no shared expert.
//   disk:  model.layers.N.mlp.gate.weight, model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
//   refused: clip_qkv (a clamp of q, k, v no released checkpoint sets), attention_bias.
#include "model/arch/architecture.h"
#include "model/arch/config_reader.h"

namespace mf::model::arch {

namespace {

ModelSpec parse(const json::Value& cfg, const std::string& source) {
    const ConfigReader r(cfg, source);
    // HF's OLMoE pads with token 1 when the config names none (its embedding row takes no gradient).
    FamilyDefaults defaults;
    defaults.rms_norm_eps = 1e-5;
    defaults.router_aux_loss_coef = 0.01;
    defaults.max_position_embeddings = 4096;
    defaults.pad_token_id = 1;
    const DecoderConfig d = DecoderConfig::read(r, defaults);
    const int64_t intermediate = r.integer("intermediate_size", true, 0, 1);
    const bool norm_topk = r.boolean("norm_topk_prob", false);
    if (d.num_experts == 0) fail(source, ": field \"num_experts\" must be >= 1 (every OLMoE layer is sparse)");
    r.require_absent("clip_qkv", "clamping q, k and v; no released OLMoE checkpoint sets it");
    r.require_false("attention_bias", "attention biases");

    ModelSpec spec = d.base_spec();
    AttentionBranch attention = d.attention();
    attention.qk_norm = QkNorm::full_width;
    const MoeBranch moe = routed_experts(d, intermediate, norm_topk);
    for (int64_t l = 0; l < d.num_hidden_layers; ++l)
        spec.layers.push_back(decoder_layer(attention, d.rms_norm_eps, moe_ffn(moe, d.rms_norm_eps)));

    json::Value::Object out;
    d.write(out, "num_experts");
    out.emplace_back("architectures", json::Value(json::Value::Array{json::Value("OlmoeForCausalLM")}));
    out.emplace_back("attention_bias", json::Value(false));
    out.emplace_back("clip_qkv", json::Value());
    out.emplace_back("intermediate_size", json::Value(intermediate));
    out.emplace_back("norm_topk_prob", json::Value(norm_topk));
    spec.config = sorted_config(std::move(out));
    return spec;
}

json::Value tiny_preset() {
    json::Value c = tiny_config("olmoe", "num_experts");
    c.set("intermediate_size", 64);
    c.set("num_key_value_heads", 4);
    c.set("norm_topk_prob", false);
    return c;
}

}  // namespace

extern const Architecture kOlmoe;
const Architecture kOlmoe{"olmoe", "OLMoE (OLMoE-1B-7B)", parse, tiny_preset};

}  // namespace mf::model::arch
