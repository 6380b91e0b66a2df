// libFuzzer target: the strict JSON parser (core/json.h).
// Any input parses or throws mf::Error. An accepted document must survive a round trip: dump()
// (compact and indented) parses again to a value with the same compact dump.
#include "core/json.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    mf::fuzz::run_one([&] {
        const mf::json::Value v = mf::json::parse(mf::fuzz::as_text(data, size), "fuzz.json");
        const std::string compact = v.dump();
        const mf::json::Value again = mf::json::parse(compact, "fuzz.json (dumped)");
        MF_FUZZ_REQUIRE(again.dump() == compact, "compact dump does not round-trip: " + compact.substr(0, 200));
        const mf::json::Value indented = mf::json::parse(v.dump(2), "fuzz.json (dumped, indented)");
        MF_FUZZ_REQUIRE(indented.dump() == compact, "indented dump does not round-trip: " + compact.substr(0, 200));
    });
    return 0;
}
