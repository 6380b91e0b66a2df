#include "core/check.h"
#include "model/arch/architecture.h"
#include "model/arch/config_reader.h"

namespace mf::model {

namespace arch {
extern const Architecture kQwen3Moe;
extern const Architecture kMixtral;
extern const Architecture kOlmoe;
extern const Architecture kQwen2Moe;
extern const Architecture kNemotronH;
}  // namespace arch

const std::vector<const Architecture*>& architectures() {
    static const std::vector<const Architecture*> table = {&arch::kQwen3Moe, &arch::kMixtral, &arch::kOlmoe,
                                                           &arch::kQwen2Moe, &arch::kNemotronH};
    return table;
}

std::string supported_model_types_text() {
    std::string list;
    for (const Architecture* a : architectures()) list += (list.empty() ? "" : ", ") + std::string(a->model_type);
    return list;
}

const Architecture& find_architecture(std::string_view model_type, const std::string& source) {
    for (const Architecture* a : architectures())
        if (a->model_type == model_type) return *a;
    fail(source, ": unsupported model_type \"", model_type, "\" (supported: ", supported_model_types_text(), ")");
}

ModelSpec parse_model_config(const json::Value& config, const std::string& source) {
    const arch::ConfigReader r(config, source);
    const Architecture& a = find_architecture(r.string("model_type", ""), source);
    ModelSpec spec = a.parse(config, source);
    spec.validate(source);
    arch::check_model_size(spec, source);
    return spec;
}

namespace arch {

LayerSpec decoder_layer(const AttentionBranch& attention, double eps, const Branch& ffn) {
    Branch attn;
    attn.kind = BranchKind::attention;
    attn.norm = "input_layernorm";
    attn.module = "self_attn";
    attn.norm_eps = eps;
    attn.attention = attention;
    LayerSpec layer;
    layer.branches = {attn, ffn};
    return layer;
}

Branch moe_ffn(const MoeBranch& moe, double eps, std::string module) {
    Branch b;
    b.kind = BranchKind::moe;
    b.norm = "post_attention_layernorm";
    b.module = std::move(module);
    b.norm_eps = eps;
    b.moe = moe;
    return b;
}

Branch dense_ffn(int64_t intermediate, double eps) {
    Branch b;
    b.kind = BranchKind::mlp;
    b.norm = "post_attention_layernorm";
    b.module = "mlp";
    b.norm_eps = eps;
    b.mlp.intermediate = intermediate;
    return b;
}

}  // namespace arch

}  // namespace mf::model
