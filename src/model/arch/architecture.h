// The architecture table: one entry per supported HF `model_type`, each defined in its own file
// (model/arch/<model_type>.cpp) and listed explicitly in architectures.cpp.
//
// An architecture reads config.json in every spelling HF writes, refuses values the engine does not
// implement (naming the field), and builds the ModelSpec: the layer plan, the branch options, the
// HF module names and the on-disk weight names (model/spec.h). Everything it describes is run by the
// generic blocks; it holds no computation.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/json.h"
#include "model/spec.h"

namespace mf::model {

struct Architecture {
    std::string_view model_type;
    std::string_view family;  // the checkpoints it reads, for help and errors
    // config.json -> spec (spec.config: the config as the family writes it). `source` names the file.
    ModelSpec (*parse)(const json::Value& config, const std::string& source);
    // The config.json of the tiny preset (`moeforge init --preset tiny`): every feature of the family,
    // small enough to train on a laptop CPU.
    json::Value (*tiny_preset)();
};

const std::vector<const Architecture*>& architectures();
// The architecture of a model_type; an unknown one is an error naming `source` and the supported list.
const Architecture& find_architecture(std::string_view model_type, const std::string& source);
// config.json (any supported model_type) -> spec, validated.
ModelSpec parse_model_config(const json::Value& config, const std::string& source);
// "qwen3_moe, mixtral, ..." for messages.
std::string supported_model_types_text();

namespace arch {
// The layer of every family here: x += attention(input_layernorm(x)); x += ffn(post_attention_layernorm(x)).
LayerSpec decoder_layer(const AttentionBranch& attention, double eps, const Branch& ffn);
Branch moe_ffn(const MoeBranch& moe, double eps, std::string module = "mlp");
Branch dense_ffn(int64_t intermediate, double eps);
}  // namespace arch

}  // namespace mf::model
