// Token-id helpers of the tokenizer tests (test_tokenizer, test_tokenizer_features): ids from a JSON
// array, and ids shown as "[1,2,3]" in failure messages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/json.h"

namespace mf::test {

inline std::vector<int32_t> ids_of(const json::Value& v) {
    std::vector<int32_t> ids;
    for (const json::Value& e : v.as_array()) ids.push_back(static_cast<int32_t>(e.as_int()));
    return ids;
}

inline std::string show(const std::vector<int32_t>& ids) {
    std::string s = "[";
    for (size_t k = 0; k < ids.size(); ++k) {
        if (k > 0) s += ',';
        s += std::to_string(ids[k]);
    }
    s += ']';
    return s;
}

}  // namespace mf::test
