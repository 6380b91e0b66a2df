#include "model/arch/config_reader.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/check.h"

namespace mf::model::arch {

namespace {

// Bounds on what a config may describe, so that sizes derived from it cannot overflow and building
// the parameter table stays cheap: any one size, the layer count and the total parameter count.
constexpr int64_t kMaxDim = int64_t{1} << 40;
constexpr int64_t kMaxLayers = 1024;
constexpr double kMaxParams = 0x1p40;

// A value as error messages show it: non-finite numbers as Python spells them (Infinity), not null.
std::string shown(const json::Value& v) { return v.dump(-1, json::NonFinite::bare); }

}  // namespace

ConfigReader::ConfigReader(const json::Value& cfg, const std::string& source) : cfg_(cfg), source_(source) {
    if (!cfg.is_object()) fail(source, ": expected a JSON object");
}

const json::Value* ConfigReader::find_raw(const char* key) const { return cfg_.find(key); }

const json::Value* ConfigReader::get(const char* key) const {
    const json::Value* v = cfg_.find(key);
    return (v == nullptr || v->is_null()) ? nullptr : v;
}

int64_t ConfigReader::integer(const char* key, bool required, int64_t fallback, int64_t min_value) const {
    const json::Value* v = get(key);
    if (v == nullptr) {
        if (required) fail(source_, ": missing required field \"", key, "\"");
        return fallback;
    }
    if (!v->is_number()) fail(source_, ": field \"", key, "\" must be an integer, got ", json::kind_name(v->kind()));
    if (!v->is_int() && (!std::isfinite(v->as_double()) || std::floor(v->as_double()) != v->as_double()))
        fail(source_, ": field \"", key, "\" must be an integer, got ", shown(*v));
    // Range-check before converting: a number written as 1e30 is a double no int64_t can hold.
    const double d = v->is_int() ? static_cast<double>(v->as_int()) : v->as_double();
    if (d < static_cast<double>(min_value))
        fail(source_, ": field \"", key, "\" must be >= ", min_value, ", got ", shown(*v));
    if (d > static_cast<double>(kMaxDim)) fail(source_, ": field \"", key, "\" is implausibly large: ", shown(*v));
    return v->is_int() ? v->as_int() : static_cast<int64_t>(d);
}

double ConfigReader::number(const json::Value* v, const std::string& key, double fallback, bool allow_nonfinite) const {
    if (v == nullptr) return fallback;
    const std::optional<double> tagged = json::hf_float_tag(*v, source_ + ": field \"" + key + "\"");
    if (!tagged && !v->is_number())
        fail(source_, ": field \"", key, "\" must be a number, got ", json::kind_name(v->kind()));
    const double d = tagged ? *tagged : v->as_double();
    if (!allow_nonfinite && !std::isfinite(d))
        fail(source_, ": field \"", key, "\" must be a finite number, got ", json::nonfinite_spelling(d));
    return d;
}

bool ConfigReader::boolean(const char* key, bool fallback) const {
    const json::Value* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_bool()) fail(source_, ": field \"", key, "\" must be true or false, got ", shown(*v));
    return v->as_bool();
}

std::string ConfigReader::string(const char* key, const std::string& fallback) const {
    const json::Value* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_string()) fail(source_, ": field \"", key, "\" must be a string, got ", json::kind_name(v->kind()));
    return v->as_string();
}

std::vector<int64_t> ConfigReader::layer_list(const char* key, int64_t num_layers) const {
    std::vector<int64_t> out;
    const json::Value* v = get(key);
    if (v == nullptr) return out;
    if (!v->is_array()) fail(source_, ": field \"", key, "\" must be a list of layer indices");
    std::set<int64_t> seen;
    for (const auto& e : v->as_array()) {
        if (!e.is_int() || e.as_int() < 0 || e.as_int() >= num_layers)
            fail(source_, ": field \"", key, "\" holds ", e.dump(), ", expected a layer index in [0, ", num_layers,
                 ")");
        if (!seen.insert(e.as_int()).second) fail(source_, ": field \"", key, "\" repeats layer ", e.as_int());
        out.push_back(e.as_int());
    }
    return out;
}

void ConfigReader::refuse(const char* key, const std::string& why) const {
    const json::Value* v = get(key);
    fail(source_, ": field \"", key, "\" = ", v != nullptr ? shown(*v) : std::string("null"), " is not supported (",
         why, ")");
}

void ConfigReader::require_false(const char* key, const std::string& feature) const {
    if (boolean(key, false)) refuse(key, feature);
}

void ConfigReader::require_zero(const char* key, const std::string& feature) const {
    if (number(key, 0.0) != 0.0) refuse(key, feature);
}

void ConfigReader::require_absent(const char* key, const std::string& feature) const {
    if (get(key) != nullptr) refuse(key, feature);
}

namespace {

// RoPE: rope_theta (v4) or rope_parameters {rope_theta, rope_type} (v5); only the default type. Where
// more than one names the base they must agree (HF would take rope_parameters' and drop the other).
double read_rope_theta(const ConfigReader& r, double default_theta) {
    const std::string& source = r.source();
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
            fail(source, ": field \"", rp == rope_params ? "rope_parameters." : "rope_scaling.",
                 rp->find("rope_type") != nullptr ? "rope_type" : "type", "\": rope type ", type->dump(),
                 " is not supported (only \"default\" RoPE)");
        for (const auto& [key, value] : rp->as_object())
            if (key != "rope_type" && key != "type" && key != "rope_theta" && key != "partial_rotary_factor")
                fail(source, ": field \"", rp == rope_params ? "rope_parameters." : "rope_scaling.", key,
                     "\" is not supported");
        if (const json::Value* prf = rp->find("partial_rotary_factor");
            prf != nullptr && !(prf->is_number() && prf->as_double() == 1.0))
            fail(source, ": partial_rotary_factor ", prf->dump(), " is not supported (only 1.0)");
    }
    const json::Value* theta_v = nullptr;
    std::string theta_field;
    const std::pair<const json::Value*, const char*> places[] = {
        {r.get("rope_theta"), "rope_theta"},
        {rope_params != nullptr ? rope_params->find("rope_theta") : nullptr, "rope_parameters.rope_theta"},
        {rope_scaling != nullptr ? rope_scaling->find("rope_theta") : nullptr, "rope_scaling.rope_theta"}};
    for (const auto& [v, field] : places) {
        if (v == nullptr || v->is_null()) continue;
        r.number(v, field, 0.0);  // a number, or an error naming the field
        if (theta_v == nullptr) {
            theta_v = v;
            theta_field = field;
        } else if (v->as_double() != theta_v->as_double()) {
            fail(source, ": fields \"", theta_field, "\" (", theta_v->dump(), ") and \"", field, "\" (", v->dump(),
                 ") disagree on the RoPE base");
        }
    }
    const double theta = r.number(theta_v, "rope_theta", default_theta);
    if (!(theta > 0)) fail(source, ": field \"rope_theta\" must be > 0, got ", theta);
    return theta;
}

}  // namespace

DecoderConfig DecoderConfig::read(const ConfigReader& r, const FamilyDefaults& defaults) {
    const std::string& experts_key = defaults.experts_key;
    const std::string& source = r.source();
    DecoderConfig c;
    c.model_type = r.string("model_type", "");
    c.vocab_size = r.integer("vocab_size", true, 0, 1);
    c.hidden_size = r.integer("hidden_size", true, 0, 1);
    c.num_hidden_layers = r.integer("num_hidden_layers", true, 0, 1);
    c.num_attention_heads = r.integer("num_attention_heads", true, 0, 1);
    c.num_key_value_heads =
        r.integer("num_key_value_heads", false,
                  defaults.num_key_value_heads > 0 ? defaults.num_key_value_heads : c.num_attention_heads, 1);
    c.head_dim = r.integer("head_dim", false, 0, 2);
    c.head_dim_written = c.head_dim != 0;
    if (c.head_dim == 0) {
        if (c.hidden_size % c.num_attention_heads != 0)
            fail(source, ": no \"head_dim\" and hidden_size ", c.hidden_size,
                 " is not a multiple of num_attention_heads ", c.num_attention_heads);
        c.head_dim = c.hidden_size / c.num_attention_heads;
    }
    if (c.head_dim % 2 != 0) fail(source, ": field \"head_dim\" must be even for RoPE, got ", c.head_dim);

    // Experts in either spelling; both present must agree.
    const bool has_num_experts = r.get("num_experts") != nullptr;
    const bool has_local = r.get("num_local_experts") != nullptr;
    if (has_num_experts && has_local &&
        r.integer("num_experts", true, 0, 0) != r.integer("num_local_experts", true, 0, 0))
        fail(source, ": fields \"num_experts\" and \"num_local_experts\" disagree");
    if (!has_num_experts && !has_local) fail(source, ": missing required field \"", experts_key, "\"");
    c.num_experts = has_num_experts ? r.integer("num_experts", true, 0, 0) : r.integer("num_local_experts", true, 0, 0);
    c.num_experts_per_tok = r.integer("num_experts_per_tok", c.num_experts > 0, 0, 1);
    c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
    // Absent: the family's default; JSON null: none.
    const json::Value* pad = r.get("pad_token_id");
    c.pad_token_id = pad != nullptr ? r.integer("pad_token_id", true, -1, 0)
                                    : (r.find_raw("pad_token_id") != nullptr ? -1 : defaults.pad_token_id);
    if (c.pad_token_id >= c.vocab_size)
        fail(source, ": field \"pad_token_id\" is ", c.pad_token_id, ", outside the vocabulary [0, ", c.vocab_size,
             ")");
    c.output_router_logits = r.boolean("output_router_logits", false);
    c.rms_norm_eps = r.number("rms_norm_eps", defaults.rms_norm_eps);
    c.router_aux_loss_coef = r.number("router_aux_loss_coef", defaults.router_aux_loss_coef);
    c.max_position_embeddings = r.integer("max_position_embeddings", false, defaults.max_position_embeddings, 1);
    c.dtype = r.string("dtype", r.string("torch_dtype", "float32"));
    if (c.dtype != "float32" && c.dtype != "bfloat16" && c.dtype != "float16")
        fail(source, ": field \"dtype\" is \"", c.dtype, "\", expected float32, bfloat16 or float16");
    c.rope_theta = read_rope_theta(r, defaults.rope_theta);
    if (!(c.rms_norm_eps > 0)) fail(source, ": field \"rms_norm_eps\" must be > 0, got ", c.rms_norm_eps);
    if (!(c.router_aux_loss_coef >= 0))
        fail(source, ": field \"router_aux_loss_coef\" must be >= 0, got ", c.router_aux_loss_coef);

    const std::string act = r.string("hidden_act", "silu");
    if (act != "silu") fail(source, ": field \"hidden_act\" is \"", act, "\", only \"silu\" is supported");
    if (r.number("attention_dropout", 0.0) != 0.0) fail(source, ": field \"attention_dropout\" must be 0");

    if (c.num_attention_heads % c.num_key_value_heads != 0)
        fail(source, ": num_attention_heads ", c.num_attention_heads, " is not a multiple of num_key_value_heads ",
             c.num_key_value_heads);
    if (c.num_experts > 0 && c.num_experts_per_tok > c.num_experts)
        fail(source, ": num_experts_per_tok ", c.num_experts_per_tok, " exceeds num_experts ", c.num_experts);
    if (c.vocab_size > (int64_t{1} << 31) - 1) fail(source, ": vocab_size ", c.vocab_size, " exceeds int32 ids");
    if (c.num_hidden_layers > kMaxLayers)
        fail(source, ": field \"num_hidden_layers\" is ", c.num_hidden_layers, ", more than the ", kMaxLayers,
             " supported");
    return c;
}

void DecoderConfig::write(json::Value::Object& out, const std::string& experts_key) const {
    json::Value rope = json::Value::object();
    rope.set("rope_theta", json::Value(rope_theta));
    rope.set("rope_type", json::Value("default"));
    out.emplace_back("attention_dropout", json::Value(0.0));
    out.emplace_back("dtype", json::Value(dtype));
    if (head_dim_written) out.emplace_back("head_dim", json::Value(head_dim));
    out.emplace_back("hidden_act", json::Value("silu"));
    out.emplace_back("hidden_size", json::Value(hidden_size));
    out.emplace_back("max_position_embeddings", json::Value(max_position_embeddings));
    out.emplace_back("model_type", json::Value(model_type));
    out.emplace_back("num_attention_heads", json::Value(num_attention_heads));
    out.emplace_back(experts_key, json::Value(num_experts));
    out.emplace_back("num_experts_per_tok", json::Value(num_experts_per_tok));
    out.emplace_back("num_hidden_layers", json::Value(num_hidden_layers));
    out.emplace_back("num_key_value_heads", json::Value(num_key_value_heads));
    out.emplace_back("output_router_logits", json::Value(output_router_logits));
    if (pad_written) out.emplace_back("pad_token_id", pad_token_id >= 0 ? json::Value(pad_token_id) : json::Value());
    out.emplace_back("rms_norm_eps", json::Value(rms_norm_eps));
    out.emplace_back("rope_parameters", std::move(rope));
    out.emplace_back("router_aux_loss_coef", json::Value(router_aux_loss_coef));
    out.emplace_back("tie_word_embeddings", json::Value(tie_word_embeddings));
    out.emplace_back("vocab_size", json::Value(vocab_size));
}

ModelSpec DecoderConfig::base_spec() const {
    ModelSpec s;
    s.model_type = model_type;
    s.vocab_size = vocab_size;
    s.hidden_size = hidden_size;
    s.tie_word_embeddings = tie_word_embeddings;
    s.padding_idx = pad_token_id;
    s.final_norm_eps = rms_norm_eps;
    s.output_router_logits = output_router_logits;
    s.router_aux_loss_coef = router_aux_loss_coef;
    s.max_position_embeddings = max_position_embeddings;
    s.dtype = dtype;
    return s;
}

AttentionBranch DecoderConfig::attention() const {
    AttentionBranch a;
    a.num_heads = num_attention_heads;
    a.num_kv_heads = num_key_value_heads;
    a.head_dim = head_dim;
    a.qk_norm_eps = rms_norm_eps;
    a.rotary_dim = head_dim;
    a.rope_theta = rope_theta;
    return a;
}

SparseLayers SparseLayers::read(const ConfigReader& r, int64_t num_layers) {
    SparseLayers s;
    s.step = r.integer("decoder_sparse_step", false, 1, 1);
    s.mlp_only = r.layer_list("mlp_only_layers", num_layers);
    return s;
}

bool SparseLayers::sparse(int64_t l, int64_t num_experts) const {
    return std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end() && num_experts > 0 && (l + 1) % step == 0;
}

void SparseLayers::write(json::Value::Object& out) const {
    json::Value::Array only;
    for (int64_t l : mlp_only) only.emplace_back(l);
    out.emplace_back("decoder_sparse_step", json::Value(step));
    out.emplace_back("mlp_only_layers", json::Value(std::move(only)));
}

MoeBranch routed_experts(const DecoderConfig& d, int64_t intermediate, bool norm_topk_prob) {
    MoeBranch m;
    m.num_experts = d.num_experts;
    m.top_k = d.num_experts_per_tok;
    m.intermediate = intermediate;
    m.norm_topk_prob = norm_topk_prob;
    return m;
}

json::Value tiny_config(const std::string& model_type, const std::string& experts_key) {
    json::Value c = json::Value::object();
    c.set("model_type", model_type);
    c.set("vocab_size", 2048);
    c.set("hidden_size", 64);
    c.set("num_hidden_layers", 4);
    c.set("num_attention_heads", 4);
    c.set(experts_key, 8);
    c.set("num_experts_per_tok", 2);
    c.set("tie_word_embeddings", false);
    c.set("output_router_logits", true);
    c.set("router_aux_loss_coef", json::Value(0.01));
    c.set("max_position_embeddings", 4096);
    c.set("dtype", "float32");
    return c;
}

json::Value sorted_config(json::Value::Object fields) {
    std::stable_sort(fields.begin(), fields.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 1; i < fields.size(); ++i)
        MF_CHECK(fields[i].first != fields[i - 1].first, "sorted_config: key ", fields[i].first, " written twice");
    return json::Value(std::move(fields));
}

void check_model_size(const ModelSpec& spec, const std::string& source) {
    // The parameter count, in double (no overflow; exact enough for a bound).
    const double H = static_cast<double>(spec.hidden_size);
    double params = (spec.tie_word_embeddings ? 1 : 2) * static_cast<double>(spec.vocab_size) * H + H;
    for (const LayerSpec& layer : spec.layers)
        for (const Branch& b : layer.branches) {
            params += H;
            if (b.kind == BranchKind::attention) {
                const AttentionBranch& a = b.attention;
                params += 2.0 * static_cast<double>(a.num_heads + a.num_kv_heads) * static_cast<double>(a.head_dim) * H;
            } else if (b.kind == BranchKind::mlp) {
                params += 3.0 * static_cast<double>(b.mlp.intermediate) * H;
            } else if (b.kind == BranchKind::mamba) {
                const MambaBranch& m = b.mamba;
                params += H * static_cast<double>(2 * m.inner() + m.conv_dim() + m.num_heads) +
                          static_cast<double>(m.conv_dim()) * static_cast<double>(m.conv_kernel + 1);
            } else {
                const MoeBranch& m = b.moe;
                params += static_cast<double>(m.num_experts) * H * (1 + 3 * static_cast<double>(m.intermediate)) +
                          3.0 * static_cast<double>(m.shared_intermediate) * H;
            }
        }
    if (params > kMaxParams)
        fail(source, ": the sizes describe about ", params, " parameters, more than the ", kMaxParams,
             " supported (check hidden_size, vocab_size, num_experts and the intermediate sizes)");
}

}  // namespace mf::model::arch
