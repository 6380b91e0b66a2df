// The transformers-made chat fixtures of tests/fixtures/chat (scripts/make_chat_fixtures.py) for the
// tests that compare with them (test_chat, test_jinja): whether expected.jsonl was made from the
// templates.json beside it, by the FNV-1a 64 hashes of both files that the script records in
// fixture_info.json.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "core/json.h"
#include "test_util.h"

namespace mf::test {

// FNV-1a 64 of bytes, as 16 hex digits (the script's fnv1a64).
inline std::string fnv1a64_hex(const std::string& bytes) {
    uint64_t h = 0xCBF29CE484222325ull;
    for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
    return buf;
}

// Empty when `dir`'s expected.jsonl and templates.json are the ones fixture_info.json was written
// with, else why not and what to do.
inline std::string stale_chat_fixtures(const std::filesystem::path& dir) {
    const std::string hint = ": regenerate with scripts/make_chat_fixtures.py on the GPU machine";
    for (const char* f : {"expected.jsonl", "fixture_info.json", "templates.json"})
        if (!std::filesystem::exists(dir / f)) return (dir / f).string() + " is absent" + hint;
    const json::Value info = json::parse(read_file(dir / "fixture_info.json"), "fixture_info.json");
    for (const auto& [file, key] :
         {std::pair{"templates.json", "templates_fnv1a64"}, std::pair{"expected.jsonl", "expected_fnv1a64"}}) {
        const json::Value* h = info.is_object() ? info.find(key) : nullptr;
        if (h == nullptr || !h->is_string() || h->as_string() != fnv1a64_hex(read_file(dir / file)))
            return (dir / file).string() + " is not the one fixture_info.json was made with (" + key + ")" + hint;
    }
    return "";
}

}  // namespace mf::test
