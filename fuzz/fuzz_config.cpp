// libFuzzer target: the HF config parser of every architecture (model::parse_model_config over
// json::parse), and train::load_hf_model with that config.json over fixed weights.
// Any input is accepted or refused with mf::Error. An accepted config must write a config.json
// (to_json) that reads back to the same architecture (equal hash()), and the parameter table the
// model would allocate must be computable without overflow (checked by building it). Then the
// input becomes the config.json of a scratch model directory whose weights are those of the small
// config in fuzz/corpus/config/small_v4 (vocab 40, hidden 8, 2 layers, 4 experts): loading must
// load or refuse quickly, whatever sizes the config claims (libFuzzer's -timeout and
// -malloc_limit_mb catch a load that allocates or loops by the config's word).
#include "core/json.h"
#include "fuzz_util.h"
#include "model/arch/architecture.h"
#include "model/causal_lm.h"
#include "train/hf_checkpoint.h"

namespace {

const std::filesystem::path& model_dir() {
    static const std::filesystem::path dir = [] {
        const std::filesystem::path d = mf::fuzz::ScratchDir::get() / "model";
        std::filesystem::create_directories(d);
        const char* config = R"({"model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 8,
            "intermediate_size": 12, "moe_intermediate_size": 6, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
            "mlp_only_layers": [0], "norm_topk_prob": true, "max_position_embeddings": 128})";
        mf::model::CausalLM m(mf::model::parse_model_config(mf::json::parse(config, "seed"), "seed"));
        m.init_random(1, 0.1f);
        mf::train::save_hf_model(d, m, nullptr, {});
        return d;
    }();
    return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::filesystem::path& dir = model_dir();
    const std::string_view text = mf::fuzz::as_text(data, size);
    bool accepted = false;
    mf::fuzz::run_one([&] {
        const mf::json::Value v = mf::json::parse(text, "fuzz/config.json");
        const auto cfg = mf::model::parse_model_config(v, "fuzz/config.json");
        const auto again = mf::model::parse_model_config(cfg.to_json(), "fuzz/config.json (written)");
        MF_FUZZ_REQUIRE(again.hash() == cfg.hash(), "to_json/parse changed the architecture");
        for (int64_t l = 0; l < cfg.num_layers() && l < 4096; ++l) (void)cfg.is_moe_layer(l);
        const mf::model::ParamTable table = mf::model::model_param_table(cfg);
        MF_FUZZ_REQUIRE(table.total() > 0, "an accepted config has no parameters");
        accepted = true;
    });
    if (!accepted) return 0;  // the loader would refuse it the same way; spare the file write
    mf::fuzz::write_bytes(dir / "config.json", text);
    mf::fuzz::run_one([&] {
        const auto m = mf::train::load_hf_model(dir);
        MF_FUZZ_REQUIRE(m->num_params() > 0, "a loaded model has no parameters");
    });
    return 0;
}
