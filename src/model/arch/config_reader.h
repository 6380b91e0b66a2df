// Reading and writing HF config.json for the architecture files (model/arch/<model_type>.cpp).
//
// ConfigReader: typed field readers that name the file and the field in every error, bounded so that
// no size derived from a config can overflow. DecoderConfig: the fields every decoder-only MoE family
// spells alike (sizes, heads, RMSNorm eps, RoPE in both HF spellings, experts in both spellings, the
// aux-loss switch, dtype), read once here. An architecture file reads its own fields on top, builds
// the ModelSpec, and writes its config with `sorted_config` (HF writes keys in alphabetical order).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/json.h"
#include "model/spec.h"

namespace mf::model::arch {

class ConfigReader {
 public:
    ConfigReader(const json::Value& cfg, const std::string& source);

    const json::Value* get(const char* key) const;       // null when absent or JSON null
    const json::Value* find_raw(const char* key) const;  // null only when absent
    int64_t integer(const char* key, bool required, int64_t fallback, int64_t min_value) const;
    // A number, or an HF float tag ({"__float__": "Infinity"}, json::hf_float_tag) standing for one.
    // Non-finite values (bare Infinity / NaN as read with ParseOptions::hf_config(), or a tag) are an
    // error naming the field unless `allow_nonfinite` (time_step_limit's upper end is Infinity).
    double number(const json::Value* v, const std::string& key, double fallback, bool allow_nonfinite = false) const;
    double number(const char* key, double fallback, bool allow_nonfinite = false) const {
        return number(get(key), key, fallback, allow_nonfinite);
    }
    bool boolean(const char* key, bool fallback) const;
    std::string string(const char* key, const std::string& fallback) const;
    // A list of distinct layer indices in [0, num_layers) (mlp_only_layers).
    std::vector<int64_t> layer_list(const char* key, int64_t num_layers) const;
    // Refusals, naming the field.
    [[noreturn]] void refuse(const char* key, const std::string& why) const;
    void require_false(const char* key, const std::string& feature) const;   // refuse when set true
    void require_zero(const char* key, const std::string& feature) const;    // refuse when set non-zero
    void require_absent(const char* key, const std::string& feature) const;  // refuse when set (not null)

    const std::string& source() const { return source_; }

 private:
    const json::Value& cfg_;
    std::string source_;
};

// What a family's HF config class assumes for a field config.json leaves out.
struct FamilyDefaults {
    std::string experts_key = "num_experts";  // the spelling the family writes ("num_local_experts")
    double rms_norm_eps = 1e-6;
    double router_aux_loss_coef = 0.001;
    int64_t max_position_embeddings = 32768;
    double rope_theta = 10000.0;
    int64_t num_key_value_heads = 0;  // 0: num_attention_heads
    int64_t pad_token_id = -1;        // -1: none
};

// The shared fields of a decoder-only (MoE) config.
struct DecoderConfig {
    std::string model_type;
    int64_t vocab_size = 0, hidden_size = 0, num_hidden_layers = 0;
    int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
    bool head_dim_written = false;  // config.json has "head_dim" (else hidden_size / num_attention_heads)
    int64_t num_experts = 0, num_experts_per_tok = 0;
    bool tie_word_embeddings = false, output_router_logits = false;
    int64_t pad_token_id = -1;  // -1: none (null; or absent where the family has no default)
    bool pad_written = true;    // write() writes pad_token_id when there is one
    double rms_norm_eps = 1e-6, rope_theta = 10000.0, router_aux_loss_coef = 0.001;
    int64_t max_position_embeddings = 0;
    std::string dtype = "float32";

    // Both expert spellings are read (they must agree); absent fields take the family's defaults.
    // Refuses an unknown activation, dropout, rope scaling, RoPE bases that disagree and inconsistent sizes.
    static DecoderConfig read(const ConfigReader& r, const FamilyDefaults& defaults);
    // The fields above in HF v5 spelling (rope_parameters), for sorted_config.
    void write(json::Value::Object& out, const std::string& experts_key) const;
    // The spec's global fields and an attention branch from these fields.
    ModelSpec base_spec() const;
    AttentionBranch attention() const;
};

// Which layers are sparse, the Qwen2-MoE / Qwen3-MoE way: decoder_sparse_step and mlp_only_layers.
struct SparseLayers {
    int64_t step = 1;
    std::vector<int64_t> mlp_only;
    static SparseLayers read(const ConfigReader& r, int64_t num_layers);
    // HF's rule: sparse iff l is not in mlp_only_layers, experts exist and (l + 1) % step == 0.
    bool sparse(int64_t l, int64_t num_experts) const;
    void write(json::Value::Object& out) const;
};

// The routed experts every family here has: softmax top-k over the config's experts.
MoeBranch routed_experts(const DecoderConfig& d, int64_t intermediate, bool norm_topk_prob);

// The fields the tiny presets share (vocab 2048, hidden 64, 4 layers of 4 heads, 8 experts top-2, the aux
// loss on, untied, float32); each preset sets its own widths and family-specific fields on top.
json::Value tiny_config(const std::string& model_type, const std::string& experts_key);

// An object with its keys in alphabetical order (the order HF's to_json_string writes).
json::Value sorted_config(json::Value::Object fields);

// Refuses a spec describing more parameters than the engine supports (before anything is allocated).
void check_model_size(const ModelSpec& spec, const std::string& source);

}  // namespace mf::model::arch
