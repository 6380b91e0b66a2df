// Mixtral (HF model_type "mixtral": Mixtral-8x7B, Mixtral-8x22B).
//
//   layer: x += attention(input_layernorm(x))          no QK-norm, no biases, RoPE
//          x += moe(post_attention_layernorm(x))       every layer sparse
//   MoE:   softmax router over num_local_experts, top num_experts_per_tok, always renormalised (HF's
//          softmax → top-k → divide by the sum; the same numbers as top-k → softmax); experts of width
//          intermediate_size; no shared expert.
//   disk:  model.layers.N.block_sparse_moe.gate.weight,
//          model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight (gate, up, down)
//   refused: sliding_window (no released checkpoint sets it), router_jitter_noise != 0.
#include "model/arch/architecture.h"
#include "model/arch/config_reader.h"

namespace mf::model::arch {

namespace {

ModelSpec parse(const json::Value& cfg, const std::string& source) {
    const ConfigReader r(cfg, source);
    FamilyDefaults defaults;
    defaults.experts_key = "num_local_experts";
    defaults.rms_norm_eps = 1e-5;
    defaults.max_position_embeddings = 4096 * 32;
    defaults.rope_theta = 1e6;
    defaults.num_key_value_heads = 8;
    const DecoderConfig d = DecoderConfig::read(r, defaults);
    const int64_t intermediate = r.integer("intermediate_size", true, 0, 1);
    if (d.num_experts == 0) fail(source, ": field \"num_local_experts\" must be >= 1 (every Mixtral layer is sparse)");
    r.require_absent("sliding_window", "sliding-window attention; no released Mixtral checkpoint sets it");
    r.require_zero("router_jitter_noise", "router jitter is a training-time noise HF adds; moeforge routes exactly");
    r.require_false("attention_bias", "attention biases");

    ModelSpec spec = d.base_spec();
    MoeBranch moe = routed_experts(d, intermediate, true);
    moe.disk_module = "block_sparse_moe";
    moe.disk_gate = "w1";
    moe.disk_up = "w3";
    moe.disk_down = "w2";
    for (int64_t l = 0; l < d.num_hidden_layers; ++l)
        spec.layers.push_back(decoder_layer(d.attention(), d.rms_norm_eps, moe_ffn(moe, d.rms_norm_eps)));

    json::Value::Object out;
    d.write(out, "num_local_experts");
    out.emplace_back("architectures", json::Value(json::Value::Array{json::Value("MixtralForCausalLM")}));
    out.emplace_back("intermediate_size", json::Value(intermediate));
    out.emplace_back("router_jitter_noise", json::Value(0.0));
    out.emplace_back("sliding_window", json::Value());
    spec.config = sorted_config(std::move(out));
    return spec;
}

json::Value tiny_preset() {
    json::Value c = tiny_config("mixtral", "num_local_experts");
    c.set("intermediate_size", 64);
    c.set("num_key_value_heads", 2);
    c.set("head_dim", 16);
    return c;
}

}  // namespace

extern const Architecture kMixtral;
const Architecture kMixtral{"mixtral", "Mixtral (Mixtral-8x7B, Mixtral-8x22B)", parse, tiny_preset};

}  // namespace mf::model::arch
