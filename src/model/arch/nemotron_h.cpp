// Nemotron-H (HF model_type "nemotron_h": NVIDIA Nemotron 3 Nano 30B-A3B, Super, Ultra).
//
//   layer l: x += mixer_l(norm(x)), one branch per layer; the mixer by the layer plan:
//     "linear_attention" (M)  Mamba-2: in_proj → [z | xBC | dt], causal conv + SiLU, the SSD scan with
//                              dt = max(softplus(dt + dt_bias), time_step_min), gated RMSNorm, out_proj
//     "full_attention"   (*)  GQA attention without any positional encoding (NoPE), no biases
//     "moe"              (E)  sigmoid router (fp32 logits) + e_score_correction_bias (chooses only),
//                              n_group/topk_group, renormalised, × routed_scaling_factor; non-gated
//                              relu² experts (up, down) and one relu² shared expert
//     "mlp"              (-)  a dense relu² MLP of intermediate_size
//   the plan: layers_block_type (what transformers 5.x writes) or hybrid_override_pattern (M/*/E/-, the
//   Hub's files); both present must agree; num_hidden_layers, where written, must count the layers.
//   disk:  backbone.embeddings.weight, backbone.layers.N.norm.weight, backbone.layers.N.mixer.*
//          (experts per expert: mixer.experts.E.{up,down}_proj.weight), backbone.norm_f.weight, lm_head.weight;
//          in memory (HF v5): model.embeddings, model.layers.N.mixer.experts.{up,down}_proj stacked, model.norm_f.
//   HF 5.17 clamps dt at time_step_min (time_step_limit is read and written, never used), always builds one
//   shared expert (n_shared_experts) and never ties the embeddings; an embedding has no padding row.
//   LatentMoE (moe_latent_size, Nemotron 3 Super/Ultra): the routed experts between fc1_latent_proj and
//   fc2_latent_proj; the router and the shared expert see the full width.
//   refused: tie_word_embeddings, attention_bias, mamba_proj_bias, use_bias, mlp_bias, residual_in_fp32 (HF
//   ignores or we do not implement them), num_nextn_predict_layers, dropout, sliding_window, another
//   activation, n_shared_experts other than 1.
#include <cmath>

#include "model/arch/architecture.h"
#include "model/arch/config_reader.h"

namespace mf::model::arch {

namespace {

constexpr int64_t kMaxMambaDim = int64_t{1} << 20;  // each Mamba size (so no product of them overflows)

// HF's layer-type names, and the pattern characters of the Hub's spelling.
struct LayerType {
    const char* name;
    char symbol;
    BranchKind kind;
};
constexpr LayerType kLayerTypes[] = {{"linear_attention", 'M', BranchKind::mamba},
                                     {"full_attention", '*', BranchKind::attention},
                                     {"moe", 'E', BranchKind::moe},
                                     {"mlp", '-', BranchKind::mlp}};

const LayerType* layer_type(std::string_view name) {
    if (name == "mamba") name = "linear_attention";  // the names HF remaps on read
    if (name == "attention") name = "full_attention";
    for (const LayerType& t : kLayerTypes)
        if (name == t.name) return &t;
    return nullptr;
}

std::vector<const LayerType*> read_layer_plan(const ConfigReader& r) {
    const std::string& source = r.source();
    std::vector<const LayerType*> from_list, from_pattern;
    if (const json::Value* list = r.get("layers_block_type")) {
        if (!list->is_array() || list->size() == 0) r.refuse("layers_block_type", "must be a non-empty list");
        for (const json::Value& t : list->as_array()) {
            const LayerType* type = t.is_string() ? layer_type(t.as_string()) : nullptr;
            if (type == nullptr)
                fail(source, ": field \"layers_block_type\" holds ", t.dump(),
                     " (expected linear_attention, full_attention, moe or mlp)");
            from_list.push_back(type);
        }
    }
    if (const json::Value* pattern = r.get("hybrid_override_pattern")) {
        if (!pattern->is_string() || pattern->as_string().empty())
            r.refuse("hybrid_override_pattern", "must be a non-empty string of M, *, E and -");
        for (const char c : pattern->as_string()) {
            const LayerType* type = nullptr;
            for (const LayerType& t : kLayerTypes)
                if (t.symbol == c) type = &t;
            if (type == nullptr)
                fail(source, ": field \"hybrid_override_pattern\" holds '", std::string(1, c),
                     "' (expected M, *, E or -)");
            from_pattern.push_back(type);
        }
    }
    if (from_list.empty() && from_pattern.empty())
        fail(source, ": missing the layer plan (\"layers_block_type\" or \"hybrid_override_pattern\")");
    if (!from_list.empty() && !from_pattern.empty() && from_list != from_pattern)
        fail(source, ": fields \"layers_block_type\" and \"hybrid_override_pattern\" describe different layers");
    std::vector<const LayerType*> plan = from_list.empty() ? from_pattern : from_list;
    if (plan.size() > 1024) fail(source, ": ", plan.size(), " layers, more than the 1024 supported");
    if (r.get("num_hidden_layers") != nullptr &&
        r.integer("num_hidden_layers", true, 0, 1) != static_cast<int64_t>(plan.size()))
        fail(source, ": field \"num_hidden_layers\" is ", r.integer("num_hidden_layers", true, 0, 1),
             ", the layer plan has ", plan.size(), " layers");
    return plan;
}

// The key a field is read under: `key`, or the older `legacy` NemotronHConfig's __post_init__ still
// accepts when only that one is written.
const char* spelled(const ConfigReader& r, const char* key, const char* legacy) {
    return r.get(key) == nullptr && r.get(legacy) != nullptr ? legacy : key;
}

// Each mixer kind's options, read once; a layer's branch takes those of its kind.
struct Mixers {
    AttentionBranch attention;
    MambaBranch mamba;
    MoeBranch moe;
    MlpBranch mlp;
};

void refuse_unsupported(const ConfigReader& r) {
    r.require_false("tie_word_embeddings", "tied embeddings (transformers' Nemotron-H never ties them)");
    r.require_false("attention_bias", "attention biases (transformers' Nemotron-H builds none)");
    r.require_false("mamba_proj_bias", "Mamba projection biases");
    r.require_false("use_bias", "Mamba in_proj/out_proj biases");
    r.require_false("mlp_bias", "MLP biases");
    r.require_false("residual_in_fp32", "an fp32 residual stream");
    r.require_absent("sliding_window", "sliding-window attention");
    r.require_zero("num_nextn_predict_layers", "multi-token prediction layers");
    r.require_zero("attention_dropout", "attention dropout");
    r.require_zero("hidden_dropout", "hidden dropout");
    if (r.integer("n_shared_experts", false, 1, 0) != 1)
        r.refuse("n_shared_experts", "must be 1 (transformers' Nemotron-H always builds one shared expert)");
    if (r.string("mlp_hidden_act", "relu2") != "relu2") r.refuse("mlp_hidden_act", "only \"relu2\" is supported");
    const std::string mamba_act = r.string("mamba_hidden_act", "silu");
    if (mamba_act != "silu" && mamba_act != "swish") r.refuse("mamba_hidden_act", "only \"silu\" is supported");
    if (const json::Value* limit = r.get("time_step_limit")) {  // read and written back, as HF does
        if (!limit->is_array() || limit->size() != 2) r.refuse("time_step_limit", "must be a list of two numbers");
        for (const json::Value& v : limit->as_array()) r.number(&v, "time_step_limit", 0.0, true);
    }
}

MambaBranch read_mamba(const ConfigReader& r, double eps) {
    MambaBranch m;
    m.num_heads = r.integer("mamba_num_heads", false, 128, 1);
    m.head_dim = r.integer("mamba_head_dim", false, 64, 1);
    m.num_groups = r.integer(spelled(r, "n_groups", "mamba_n_groups"), false, 8, 1);
    m.state_size = r.integer("ssm_state_size", false, 128, 1);
    m.conv_kernel = r.integer(spelled(r, "conv_kernel", "mamba_d_conv"), false, 4, 1);
    m.chunk_size = r.integer(spelled(r, "chunk_size", "mamba_chunk_size"), false, 128, 1);
    m.conv_bias = r.boolean(spelled(r, "use_conv_bias", "mamba_conv_bias"), true);
    const char* dt_key = spelled(r, "time_step_min", "mamba_dt_min");
    m.dt_min = r.number(dt_key, 0.001);
    m.dt_max = INFINITY;
    m.norm_eps = eps;
    for (const auto& [key, v] : {std::pair{"mamba_num_heads", m.num_heads}, std::pair{"mamba_head_dim", m.head_dim},
                                 std::pair{"n_groups", m.num_groups}, std::pair{"ssm_state_size", m.state_size},
                                 std::pair{"conv_kernel", m.conv_kernel}, std::pair{"chunk_size", m.chunk_size}})
        if (v > kMaxMambaDim) r.refuse(key, "is implausibly large");
    if (m.num_heads % m.num_groups != 0)
        fail(r.source(), ": mamba_num_heads ", m.num_heads, " is not a multiple of n_groups ", m.num_groups);
    if (!(m.dt_min >= 0)) r.refuse(dt_key, "must be >= 0");
    return m;
}

MoeBranch read_moe(const ConfigReader& r) {
    MoeBranch m;
    m.num_experts = r.integer("n_routed_experts", false, r.integer("num_local_experts", false, 8, 1), 1);
    m.top_k = r.integer("num_experts_per_tok", false, 2, 1);
    m.intermediate = r.integer("moe_intermediate_size", false, 7688, 1);
    m.norm_topk_prob = r.boolean("norm_topk_prob", true);
    m.router = RouterKind::sigmoid;
    m.n_group = r.integer("n_group", false, 1, 1);
    m.topk_group = r.integer("topk_group", false, 1, 1);
    m.routed_scaling = r.number("routed_scaling_factor", 1.0);
    m.masked_score = -INFINITY;  // HF's Nemotron-H masks dropped groups with −inf
    m.act = Activation::relu2;
    m.shared_intermediate = r.integer("moe_shared_expert_intermediate_size", false, 7688, 1);
    m.shared_module = "shared_experts";
    m.latent = r.get("moe_latent_size") != nullptr ? r.integer("moe_latent_size", true, 0, 1) : 0;  // null: none
    const std::string& source = r.source();
    if (m.num_experts % m.n_group != 0 || (m.n_group > 1 && m.num_experts / m.n_group < 2))
        fail(source, ": n_routed_experts ", m.num_experts, " cannot form n_group ", m.n_group,
             " groups of at least two experts");
    if (m.topk_group > m.n_group) fail(source, ": topk_group ", m.topk_group, " exceeds n_group ", m.n_group);
    if (m.top_k > m.topk_group * (m.num_experts / m.n_group))
        fail(source, ": num_experts_per_tok ", m.top_k, " exceeds the ", m.topk_group * (m.num_experts / m.n_group),
             " experts of the kept groups");
    if (!(m.routed_scaling > 0)) r.refuse("routed_scaling_factor", "must be > 0");
    if (m.latent > kMaxMambaDim) r.refuse("moe_latent_size", "is implausibly large");
    return m;
}

// The config as transformers 5.17 writes it: every NemotronHConfig field, the plan as layers_block_type
// (no hybrid_override_pattern, no num_hidden_layers), the fields the engine does not use as read.
json::Value write_config(const ConfigReader& r, const json::Value& cfg, const ModelSpec& spec,
                         const std::vector<const LayerType*>& plan, const Mixers& mixers) {
    const AttentionBranch& a = mixers.attention;
    const MambaBranch& m = mixers.mamba;
    const MoeBranch& e = mixers.moe;
    json::Value::Object out;
    auto put = [&](const char* key, json::Value v) { out.emplace_back(key, std::move(v)); };
    // A field the engine only carries: the file's value, or HF's default.
    auto keep = [&](const char* key, json::Value fallback) {
        const json::Value* v = cfg.find(key);
        put(key, v != nullptr ? *v : std::move(fallback));
    };
    json::Value::Array types;
    for (const LayerType* t : plan) types.emplace_back(t->name);
    const json::Value::Array mtp{json::Value("full_attention"), json::Value("moe")};
    json::Value::Array limit{json::Value(0.0), json::Value(INFINITY)};  // as numbers, however the file spelled them
    if (const json::Value* v = r.get("time_step_limit"))
        for (size_t i = 0; i < 2; ++i)
            limit[i] = json::Value(r.number(&v->as_array()[i], "time_step_limit", 0.0, true));
    put("architectures", json::Value(json::Value::Array{json::Value("NemotronHForCausalLM")}));
    put("attention_bias", json::Value(false));
    put("attention_dropout", json::Value(0.0));
    keep("bos_token_id", json::Value(1));
    put("chunk_size", json::Value(m.chunk_size));
    put("conv_kernel", json::Value(m.conv_kernel));
    put("dtype", json::Value(spec.dtype));
    keep("eos_token_id", json::Value(2));
    keep("expand", json::Value(2));
    put("head_dim", json::Value(a.head_dim));
    put("hidden_dropout", json::Value(0.0));
    put("hidden_size", json::Value(spec.hidden_size));
    keep("initializer_range", json::Value(0.02));
    put("intermediate_size", json::Value(mixers.mlp.intermediate));
    put("layer_norm_epsilon", json::Value(spec.final_norm_eps));
    put("layers_block_type", json::Value(std::move(types)));
    put("mamba_head_dim", json::Value(m.head_dim));
    put("mamba_hidden_act", json::Value("silu"));
    put("mamba_num_heads", json::Value(m.num_heads));
    put("mamba_proj_bias", json::Value(false));
    keep("mamba_ssm_cache_dtype", json::Value("float32"));
    put("max_position_embeddings", json::Value(spec.max_position_embeddings));
    put("mlp_bias", json::Value(false));
    put("mlp_hidden_act", json::Value("relu2"));
    put("model_type", json::Value("nemotron_h"));
    put("moe_intermediate_size", json::Value(e.intermediate));
    put("moe_latent_size", e.latent > 0 ? json::Value(e.latent) : json::Value());
    put("moe_shared_expert_intermediate_size", json::Value(e.shared_intermediate));
    keep("moe_shared_expert_overlap", json::Value(true));
    keep("mtp_layers_block_type", json::Value(mtp));
    put("n_group", json::Value(e.n_group));
    put("n_groups", json::Value(m.num_groups));
    put("n_routed_experts", json::Value(e.num_experts));
    put("n_shared_experts", json::Value(1));
    put("norm_topk_prob", json::Value(e.norm_topk_prob));
    put("num_attention_heads", json::Value(a.num_heads));
    put("num_experts_per_tok", json::Value(e.top_k));
    put("num_key_value_heads", json::Value(a.num_kv_heads));
    keep("num_logits_to_keep", json::Value(1));
    put("num_nextn_predict_layers", json::Value(0));
    keep("pad_token_id", json::Value(0));
    keep("rescale_prenorm_residual", json::Value(true));
    put("residual_in_fp32", json::Value(false));
    put("routed_scaling_factor", json::Value(e.routed_scaling));
    put("sliding_window", json::Value());
    put("ssm_state_size", json::Value(m.state_size));
    put("tie_word_embeddings", json::Value(false));
    keep("time_step_floor", json::Value(1e-4));
    put("time_step_limit", json::Value(std::move(limit)));
    keep("time_step_max", json::Value(0.1));
    put("time_step_min", json::Value(m.dt_min));
    put("topk_group", json::Value(e.topk_group));
    put("use_bias", json::Value(false));
    keep("use_cache", json::Value(true));
    put("use_conv_bias", json::Value(m.conv_bias));
    keep("use_mamba_kernels", json::Value(true));
    put("vocab_size", json::Value(spec.vocab_size));
    return sorted_config(std::move(out));
}

// Layer l's one branch: x += mixer(norm(x)) with the options of its kind.
Branch mixer(BranchKind kind, double eps, const Mixers& mixers) {
    Branch b;
    b.kind = kind;
    b.norm = "norm";
    b.module = "mixer";
    b.norm_eps = eps;
    switch (kind) {
        case BranchKind::attention:
            b.attention = mixers.attention;
            break;
        case BranchKind::mamba:
            b.mamba = mixers.mamba;
            break;
        case BranchKind::moe:
            b.moe = mixers.moe;
            break;
        case BranchKind::mlp:
            b.mlp = mixers.mlp;
            break;
    }
    return b;
}

ModelSpec parse(const json::Value& cfg, const std::string& source) {
    const ConfigReader r(cfg, source);
    refuse_unsupported(r);
    const std::vector<const LayerType*> plan = read_layer_plan(r);
    const double eps = r.number("layer_norm_epsilon", 1e-5);
    if (!(eps > 0)) r.refuse("layer_norm_epsilon", "must be > 0");

    ModelSpec spec;
    spec.model_type = "nemotron_h";
    spec.vocab_size = r.integer("vocab_size", false, 131072, 1);
    spec.hidden_size = r.integer("hidden_size", false, 4096, 1);
    if (spec.vocab_size > (int64_t{1} << 31) - 1) r.refuse("vocab_size", "exceeds int32 token ids");
    spec.final_norm_eps = eps;
    spec.max_position_embeddings = r.integer("max_position_embeddings", false, 4096, 1);
    spec.dtype = r.string("dtype", r.string("torch_dtype", "float32"));
    if (spec.dtype != "float32" && spec.dtype != "bfloat16" && spec.dtype != "float16")
        r.refuse("dtype", "expected float32, bfloat16 or float16");
    spec.embedding_module = "model.embeddings";
    spec.final_norm_module = "model.norm_f";
    spec.disk_model_prefix = "backbone.";

    Mixers mixers;
    AttentionBranch& attention = mixers.attention;
    attention.num_heads = r.integer("num_attention_heads", false, 32, 1);
    attention.num_kv_heads = r.get("num_key_value_heads") == nullptr && r.find_raw("num_key_value_heads") != nullptr
                                 ? attention.num_heads  // null: as many as the query heads
                                 : r.integer("num_key_value_heads", false, 8, 1);
    attention.head_dim = r.integer("head_dim", false, 128, 1);
    attention.rotary_dim = 0;  // NoPE
    if (attention.num_heads % attention.num_kv_heads != 0)
        fail(source, ": num_attention_heads ", attention.num_heads, " is not a multiple of num_key_value_heads ",
             attention.num_kv_heads);
    mixers.mamba = read_mamba(r, eps);
    mixers.moe = read_moe(r);
    mixers.mlp.intermediate = r.integer("intermediate_size", false, 21504, 1);
    mixers.mlp.act = Activation::relu2;

    for (const LayerType* type : plan) spec.layers.push_back(LayerSpec{{mixer(type->kind, eps, mixers)}});
    spec.config = write_config(r, cfg, spec, plan, mixers);
    return spec;
}

json::Value tiny_preset() {
    json::Value c = json::Value::object();
    c.set("model_type", "nemotron_h");
    c.set("vocab_size", 2048);
    c.set("hidden_size", 64);
    c.set("hybrid_override_pattern", "M*EM-E");
    c.set("num_attention_heads", 4);
    c.set("num_key_value_heads", 2);
    c.set("head_dim", 16);
    c.set("mamba_num_heads", 4);
    c.set("mamba_head_dim", 16);
    c.set("n_groups", 2);
    c.set("ssm_state_size", 16);
    c.set("conv_kernel", 4);
    c.set("chunk_size", 16);
    c.set("n_routed_experts", 8);
    c.set("num_experts_per_tok", 2);
    c.set("n_group", 2);
    c.set("topk_group", 1);
    c.set("moe_intermediate_size", 32);
    c.set("moe_shared_expert_intermediate_size", 48);
    c.set("intermediate_size", 96);
    c.set("routed_scaling_factor", json::Value(2.5));
    c.set("max_position_embeddings", 4096);
    c.set("dtype", "float32");
    return c;
}

}  // namespace

extern const Architecture kNemotronH;
const Architecture kNemotronH{"nemotron_h", "Nemotron-H (NVIDIA Nemotron 3 Nano; Mamba-2 + MoE + attention)", parse,
                              tiny_preset};

}  // namespace mf::model::arch
