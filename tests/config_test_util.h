// Helpers of the config-reading tests (test_architectures, test_nemotron_h): edit a config.json and
// see what reading it as a model directory's config says.
#pragma once

#include <algorithm>
#include <filesystem>
#include <string>

#include "core/check.h"
#include "core/json.h"
#include "test_util.h"
#include "train/hf_checkpoint.h"

namespace mf::test {

inline void erase_key(json::Value& cfg, const std::string& key) {
    auto& o = cfg.as_object();
    o.erase(std::remove_if(o.begin(), o.end(), [&](const auto& kv) { return kv.first == key; }), o.end());
}

// Writes `cfg` as DIR/config.json and reads it as a model directory's config; the error, or "".
inline std::string config_error(const std::filesystem::path& dir, const json::Value& cfg) {
    write_file(dir / "config.json", cfg.dump(2));
    try {
        train::read_hf_config(dir);
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

}  // namespace mf::test
