// libFuzzer target: the HF config parser, model::Qwen3MoeConfig::from_json over json::parse.
// Any input is accepted or refused with mf::Error. An accepted config must write a config.json
// (to_json) that reads back to the same architecture (equal hash()), and the parameter table the
// model would allocate must be computable without overflow (checked by building it).
#include "core/json.h"
#include "fuzz_util.h"
#include "model/qwen3_moe.h"
#include "model/qwen3_moe_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    mf::fuzz::run_one([&] {
        const mf::json::Value v = mf::json::parse(mf::fuzz::as_text(data, size), "fuzz/config.json");
        const auto cfg = mf::model::Qwen3MoeConfig::from_json(v, "fuzz/config.json");
        const auto again = mf::model::Qwen3MoeConfig::from_json(cfg.to_json(), "fuzz/config.json (written)");
        MF_FUZZ_REQUIRE(again.hash() == cfg.hash(), "to_json/from_json changed the architecture");
        for (int64_t l = 0; l < cfg.num_hidden_layers && l < 4096; ++l) (void)cfg.is_moe_layer(l);
        const mf::model::ParamTable table = mf::model::qwen3_moe_param_table(cfg);
        MF_FUZZ_REQUIRE(table.total() > 0, "an accepted config has no parameters");
    });
    return 0;
}
