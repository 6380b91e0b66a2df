#include "model/qwen3_moe_config.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/check.h"

namespace mf::model {

const std::vector<std::string>& supported_model_types() {
    static const std::vector<std::string> types = {"qwen3_moe"};
    return types;
}

bool Qwen3MoeConfig::is_moe_layer(int64_t layer_idx) const {
    if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer_idx) != mlp_only_layers.end()) return false;
    return num_experts > 0 && (layer_idx + 1) % decoder_sparse_step == 0;
}

namespace {

// Bounds on what a config may describe, so that sizes derived from it cannot overflow and building
// the parameter table stays cheap: any one size, the layer count and the total parameter count.
constexpr int64_t kMaxDim = int64_t{1} << 40;
constexpr int64_t kMaxLayers = 1024;
constexpr double kMaxParams = 0x1p40;

// Field readers that name the file and the field in every error.
class Reader {
 public:
    Reader(const json::Value& cfg, const std::string& source) : cfg_(cfg), source_(source) {}

    const json::Value* get(const char* key) const {
        const json::Value* v = cfg_.find(key);
        return (v == nullptr || v->is_null()) ? nullptr : v;
    }

    int64_t integer(const char* key, bool required, int64_t fallback, int64_t min_value) const {
        const json::Value* v = get(key);
        if (v == nullptr) {
            if (required) fail(source_, ": missing required field \"", key, "\"");
            return fallback;
        }
        if (!v->is_number()) fail(source_, ": field \"", key, "\" must be an integer, got ", json::kind_name(v->kind()));
        if (!v->is_int() && std::floor(v->as_double()) != v->as_double())
            fail(source_, ": field \"", key, "\" must be an integer, got ", v->dump());
        // Range-check before converting: a number written as 1e30 is a double no int64_t can hold.
        const double d = v->is_int() ? static_cast<double>(v->as_int()) : v->as_double();
        if (d < static_cast<double>(min_value))
            fail(source_, ": field \"", key, "\" must be >= ", min_value, ", got ", v->dump());
        if (d > static_cast<double>(kMaxDim)) fail(source_, ": field \"", key, "\" is implausibly large: ", v->dump());
        return v->is_int() ? v->as_int() : static_cast<int64_t>(d);
    }

    double number(const json::Value* v, const std::string& key, double fallback) const {
        if (v == nullptr) return fallback;
        if (!v->is_number()) fail(source_, ": field \"", key, "\" must be a number, got ", json::kind_name(v->kind()));
        return v->as_double();
    }
    double number(const char* key, double fallback) const { return number(get(key), key, fallback); }

    bool boolean(const char* key, bool fallback) const {
        const json::Value* v = get(key);
        if (v == nullptr) return fallback;
        if (!v->is_bool()) fail(source_, ": field \"", key, "\" must be true or false, got ", v->dump());
        return v->as_bool();
    }

    std::string string(const char* key, const std::string& fallback) const {
        const json::Value* v = get(key);
        if (v == nullptr) return fallback;
        if (!v->is_string()) fail(source_, ": field \"", key, "\" must be a string, got ", json::kind_name(v->kind()));
        return v->as_string();
    }

    const std::string& source() const { return source_; }

 private:
    const json::Value& cfg_;
    const std::string& source_;
};

}  // namespace

Qwen3MoeConfig Qwen3MoeConfig::from_json(const json::Value& cfg, const std::string& source) {
    if (!cfg.is_object()) fail(source, ": expected a JSON object");
    Reader r(cfg, source);

    const std::string model_type = r.string("model_type", "");
    const auto& types = supported_model_types();
    if (std::find(types.begin(), types.end(), model_type) == types.end()) {
        std::string list;
        for (const auto& t : types) list += (list.empty() ? "" : ", ") + t;
        fail(source, ": unsupported model_type \"", model_type, "\" (supported: ", list, ")");
    }

    Qwen3MoeConfig c;
    c.vocab_size = r.integer("vocab_size", true, 0, 1);
    c.hidden_size = r.integer("hidden_size", true, 0, 1);
    c.intermediate_size = r.integer("intermediate_size", true, 0, 1);
    c.moe_intermediate_size = r.integer("moe_intermediate_size", true, 0, 1);
    c.num_hidden_layers = r.integer("num_hidden_layers", true, 0, 1);
    c.num_attention_heads = r.integer("num_attention_heads", true, 0, 1);
    c.num_key_value_heads = r.integer("num_key_value_heads", false, c.num_attention_heads, 1);
    c.head_dim = r.integer("head_dim", false, 0, 2);
    if (c.head_dim == 0) {
        if (c.hidden_size % c.num_attention_heads != 0)
            fail(source, ": no \"head_dim\" and hidden_size ", c.hidden_size, " is not a multiple of num_attention_heads ",
                 c.num_attention_heads);
        c.head_dim = c.hidden_size / c.num_attention_heads;
    }
    if (c.head_dim % 2 != 0) fail(source, ": field \"head_dim\" must be even for RoPE, got ", c.head_dim);

    const bool has_num_experts = r.get("num_experts") != nullptr;
    const bool has_local = r.get("num_local_experts") != nullptr;
    if (has_num_experts && has_local && r.integer("num_experts", true, 0, 0) != r.integer("num_local_experts", true, 0, 0))
        fail(source, ": fields \"num_experts\" and \"num_local_experts\" disagree");
    c.num_experts = has_num_experts ? r.integer("num_experts", true, 0, 0) : r.integer("num_local_experts", true, 0, 0);
    c.num_experts_per_tok = r.integer("num_experts_per_tok", c.num_experts > 0, 0, 1);
    c.decoder_sparse_step = r.integer("decoder_sparse_step", false, 1, 1);
    if (const json::Value* v = r.get("mlp_only_layers")) {
        if (!v->is_array()) fail(source, ": field \"mlp_only_layers\" must be a list of layer indices");
        std::set<int64_t> seen;
        for (const auto& e : v->as_array()) {
            if (!e.is_int() || e.as_int() < 0 || e.as_int() >= c.num_hidden_layers)
                fail(source, ": field \"mlp_only_layers\" holds ", e.dump(), ", expected a layer index in [0, ",
                     c.num_hidden_layers, ")");
            if (!seen.insert(e.as_int()).second) fail(source, ": field \"mlp_only_layers\" repeats layer ", e.as_int());
            c.mlp_only_layers.push_back(e.as_int());
        }
    }
    c.norm_topk_prob = r.boolean("norm_topk_prob", false);
    c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
    c.output_router_logits = r.boolean("output_router_logits", false);
    c.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
    c.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.001);
    c.max_position_embeddings = r.integer("max_position_embeddings", false, 32768, 1);
    c.dtype = r.string("dtype", r.string("torch_dtype", "float32"));
    if (c.dtype != "float32" && c.dtype != "bfloat16" && c.dtype != "float16")
        fail(source, ": field \"dtype\" is \"", c.dtype, "\", expected float32, bfloat16 or float16");

    // RoPE: rope_theta (v4) or rope_parameters {rope_theta, rope_type} (v5); only the default type.
    const json::Value* rope_params = r.get("rope_parameters");
    const json::Value* rope_scaling = r.get("rope_scaling");
    if (rope_params != nullptr && !rope_params->is_object())
        fail(source, ": field \"rope_parameters\" must be an object");
    if (rope_scaling != nullptr && !rope_scaling->is_object())
        fail(source, ": field \"rope_scaling\" must be an object or null");
    for (const json::Value* rp : {rope_params, rope_scaling}) {
        if (rp == nullptr) continue;
        const json::Value* type = rp->find("rope_type");
        if (type == nullptr) type = rp->find("type");
        if (type != nullptr && !(type->is_string() && type->as_string() == "default"))
            fail(source, ": rope type ", type->dump(), " is not supported (only \"default\" RoPE)");
        for (const auto& [key, value] : rp->as_object())
            if (key != "rope_type" && key != "type" && key != "rope_theta" && key != "partial_rotary_factor")
                fail(source, ": field \"", rp == rope_params ? "rope_parameters." : "rope_scaling.", key,
                     "\" is not supported");
        if (const json::Value* prf = rp->find("partial_rotary_factor"); prf != nullptr && !(prf->is_number() && prf->as_double() == 1.0))
            fail(source, ": partial_rotary_factor ", prf->dump(), " is not supported (only 1.0)");
    }
    const json::Value* theta_v = r.get("rope_theta");
    if (theta_v == nullptr && rope_params != nullptr) theta_v = rope_params->find("rope_theta");
    if (theta_v == nullptr && rope_scaling != nullptr) theta_v = rope_scaling->find("rope_theta");
    c.rope_theta = r.number(theta_v, "rope_theta", 10000.0);
    if (!(c.rope_theta > 0)) fail(source, ": field \"rope_theta\" must be > 0, got ", c.rope_theta);
    if (!(c.rms_norm_eps > 0)) fail(source, ": field \"rms_norm_eps\" must be > 0, got ", c.rms_norm_eps);
    if (!(c.router_aux_loss_coef >= 0))
        fail(source, ": field \"router_aux_loss_coef\" must be >= 0, got ", c.router_aux_loss_coef);

    // Features the engine does not implement: refuse rather than train a different model.
    if (r.boolean("attention_bias", false)) fail(source, ": field \"attention_bias\" = true is not supported");
    if (r.boolean("use_sliding_window", false))
        fail(source, ": field \"use_sliding_window\" = true is not supported (sliding-window attention)");
    const std::string act = r.string("hidden_act", "silu");
    if (act != "silu") fail(source, ": field \"hidden_act\" is \"", act, "\", only \"silu\" is supported");
    if (r.number("attention_dropout", 0.0) != 0.0) fail(source, ": field \"attention_dropout\" must be 0");

    // Consistency.
    if (c.num_attention_heads % c.num_key_value_heads != 0)
        fail(source, ": num_attention_heads ", c.num_attention_heads, " is not a multiple of num_key_value_heads ",
             c.num_key_value_heads);
    if (c.num_experts > 0 && c.num_experts_per_tok > c.num_experts)
        fail(source, ": num_experts_per_tok ", c.num_experts_per_tok, " exceeds num_experts ", c.num_experts);
    if (c.vocab_size > (int64_t{1} << 31) - 1) fail(source, ": vocab_size ", c.vocab_size, " exceeds int32 ids");
    if (c.num_hidden_layers > kMaxLayers)
        fail(source, ": field \"num_hidden_layers\" is ", c.num_hidden_layers, ", more than the ", kMaxLayers,
             " supported");
    // The parameter count of qwen3_moe_param_table, in double (no overflow; exact enough for a bound).
    const auto f = [](int64_t x) { return static_cast<double>(x); };
    const double H = f(c.hidden_size), D = f(c.head_dim);
    const double attn = 2 * (f(c.num_attention_heads) + f(c.num_key_value_heads)) * D * H + 2 * D;
    const double moe = f(c.num_experts) * H * (1 + 3 * f(c.moe_intermediate_size));
    const double dense = 3 * f(c.intermediate_size) * H;
    const double params = (c.tie_word_embeddings ? 1 : 2) * f(c.vocab_size) * H + H +
                          f(c.num_hidden_layers) * (attn + std::max(moe, dense) + 2 * H);
    if (params > kMaxParams)
        fail(source, ": the sizes describe about ", params, " parameters, more than the ", kMaxParams,
             " supported (check hidden_size, vocab_size, num_experts and the intermediate sizes)");
    return c;
}

json::Value Qwen3MoeConfig::to_json() const {
    json::Value::Array only;
    for (int64_t l : mlp_only_layers) only.emplace_back(l);
    json::Value rope = json::Value::object();
    rope.set("rope_theta", json::Value(rope_theta));
    rope.set("rope_type", json::Value("default"));
    json::Value c = json::Value::object();
    c.set("architectures", json::Value(json::Value::Array{json::Value("Qwen3MoeForCausalLM")}));
    c.set("attention_bias", false);
    c.set("attention_dropout", json::Value(0.0));
    c.set("decoder_sparse_step", decoder_sparse_step);
    c.set("dtype", dtype);
    c.set("head_dim", head_dim);
    c.set("hidden_act", "silu");
    c.set("hidden_size", hidden_size);
    c.set("intermediate_size", intermediate_size);
    c.set("max_position_embeddings", max_position_embeddings);
    c.set("mlp_only_layers", json::Value(std::move(only)));
    c.set("model_type", "qwen3_moe");
    c.set("moe_intermediate_size", moe_intermediate_size);
    c.set("norm_topk_prob", norm_topk_prob);
    c.set("num_attention_heads", num_attention_heads);
    c.set("num_experts", num_experts);
    c.set("num_experts_per_tok", num_experts_per_tok);
    c.set("num_hidden_layers", num_hidden_layers);
    c.set("num_key_value_heads", num_key_value_heads);
    c.set("output_router_logits", output_router_logits);
    c.set("rms_norm_eps", json::Value(rms_norm_eps));
    c.set("rope_parameters", std::move(rope));
    c.set("router_aux_loss_coef", json::Value(router_aux_loss_coef));
    c.set("tie_word_embeddings", tie_word_embeddings);
    c.set("use_sliding_window", false);
    c.set("vocab_size", vocab_size);
    return c;
}

uint64_t Qwen3MoeConfig::hash() const {
    // FNV-1a over the canonical JSON of the architecture (dtype excluded: storage, not shape).
    Qwen3MoeConfig copy = *this;
    copy.dtype = "";
    const std::string s = copy.to_json().dump();
    uint64_t h = 1469598103934665603ull;
    for (unsigned char ch : s) { h ^= ch; h *= 1099511628211ull; }
    return h;
}

}  // namespace mf::model
