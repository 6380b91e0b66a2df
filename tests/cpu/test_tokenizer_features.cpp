// HF parity of the families' tokenizer features, on fixtures made by Hugging Face `tokenizers`
// 0.23 and tiktoken themselves (scripts/make_tokenizer_feature_fixtures.mjs; see its header for
// what each fixture holds): every encoding, with and without special tokens, every decoding, with
// and without skipping special tokens, must equal HF's; every tokenizer.json HF refuses must be
// refused; Kimi-K2's tiktoken directory must encode as tiktoken does. Mismatches are listed and
// counted. Without the fixture directory the test exits 77 (ctest: skipped) and says so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/json.h"
#include "test_util.h"
#include "text/regex.h"
#include "text/tokenizer.h"
#include "token_ids_test_util.h"

namespace fs = std::filesystem;
using mf::json::Value;
using mf::text::Tokenizer;

namespace {

fs::path feature_dir() { return fs::path(mf::test::fixtures_dir()) / "tokenizer_features"; }

void require_fixtures() {
    if (!fs::is_regular_file(feature_dir() / "fixture_info.json")) {
        std::printf(
            "SKIPPED: no HF tokenizer feature fixtures in %s (make them with "
            "scripts/make_tokenizer_feature_fixtures.mjs, see its header)\n",
            feature_dir().string().c_str());
        std::exit(77);
    }
}

Value read_json(const fs::path& p) { return mf::json::parse(mf::test::read_file(p), p.string()); }

using mf::test::ids_of;
using mf::test::show;

// The base tokenizer.json with the fixture's "set" applied ("a.b" sets field b of object a).
std::string fixture_tokenizer_json(const Value& fixture) {
    Value root = read_json(feature_dir() / fixture.find("base")->as_string());
    for (const auto& [key, v] : fixture.find("set")->as_object()) {
        const size_t dot = key.find('.');
        if (dot == std::string::npos) {
            root.set(key, v);
            continue;
        }
        for (auto& [k, child] : root.as_object())
            if (k == key.substr(0, dot)) child.set(key.substr(dot + 1), v);
    }
    return root.dump();
}

struct Tally {
    size_t records = 0, mismatches = 0;
    void check(bool ok, const std::string& what) {
        ++records;
        if (ok) return;
        if (++mismatches <= 40) ADD_FAILURE() << what;
    }
};

std::vector<fs::path> fixture_files() {
    std::vector<fs::path> out;
    for (const auto& e : fs::directory_iterator(feature_dir())) {
        const std::string name = e.path().filename().string();
        if (e.is_regular_file() && e.path().extension() == ".json" && name != "sp_base.json" &&
            name != "refusals.json" && name != "fixture_info.json" && name != "unicode_classes.json")
            out.push_back(e.path());
    }
    std::sort(out.begin(), out.end());
    return out;
}

}  // namespace

TEST(TokenizerFeatures, EncodeAndDecodeAsHf) {
    require_fixtures();
    Tally tally;
    size_t num_fixtures = 0;
    for (const fs::path& file : fixture_files()) {
        const Value fixture = read_json(file);
        if (fixture.find("name") == nullptr || fixture.find("cases") == nullptr ||
            fixture.find("decode_cases") == nullptr || fixture.find("base") == nullptr ||
            fixture.find("set") == nullptr) {
            ADD_FAILURE() << file << " is not a feature fixture (name, base, set, cases, decode_cases)";
            continue;
        }
        const std::string name = fixture.find("name")->as_string();
        Tokenizer tok;
        try {
            tok = Tokenizer::from_json(fixture_tokenizer_json(fixture), name + "/tokenizer.json");
        } catch (const mf::Error& e) {
            tally.check(false, name + ": HF loads it, we refuse it: " + e.what());
            continue;
        }
        ++num_fixtures;
        for (const Value& c : fixture.find("cases")->as_array()) {
            const std::string& text = c.find("text")->as_string();
            const std::string where = name + " text " + mf::json::quote(text);
            const std::vector<int32_t> ids = ids_of(*c.find("ids")), ids_special = ids_of(*c.find("ids_special"));
            const std::vector<int32_t> got = tok.encode(text), got_special = tok.encode(text, true);
            tally.check(got == ids, where + ": ids " + show(got) + ", HF " + show(ids));
            tally.check(got_special == ids_special,
                        where + ": ids with special tokens " + show(got_special) + ", HF " + show(ids_special));
            const std::string decoded = tok.decode(ids), skipped = tok.decode(ids_special, true);
            tally.check(decoded == c.find("decoded")->as_string(),
                        where + ": decoded " + mf::json::quote(decoded) + ", HF " + c.find("decoded")->dump());
            tally.check(skipped == c.find("decoded_skip_special")->as_string(),
                        where + ": decoded skipping special tokens " + mf::json::quote(skipped) + ", HF " +
                            c.find("decoded_skip_special")->dump());
        }
        for (const Value& c : fixture.find("decode_cases")->as_array()) {
            const std::vector<int32_t> ids = ids_of(*c.find("ids"));
            const std::string where = name + " decode " + show(ids);
            const std::string decoded = tok.decode(ids), skipped = tok.decode(ids, true);
            tally.check(decoded == c.find("decoded")->as_string(),
                        where + ": " + mf::json::quote(decoded) + ", HF " + c.find("decoded")->dump());
            tally.check(skipped == c.find("decoded_skip_special")->as_string(),
                        where + " skipping special tokens: " + mf::json::quote(skipped) + ", HF " +
                            c.find("decoded_skip_special")->dump());
        }
    }
    std::printf("tokenizer features: %zu fixtures, %zu checks, %zu mismatches\n", num_fixtures, tally.records,
                tally.mismatches);
    EXPECT_GE(num_fixtures, 30u);
    EXPECT_EQ(tally.mismatches, 0u);
}

TEST(TokenizerFeatures, RefusesWhatHfRefuses) {
    require_fixtures();
    const Value refusals = read_json(feature_dir() / "refusals.json");
    const Value base = read_json(feature_dir() / refusals.find("base")->as_string());
    size_t n = 0;
    for (const Value& r : refusals.find("refusals")->as_array()) {
        Value root = base;
        for (const auto& [key, v] : r.find("set")->as_object()) {
            const size_t dot = key.find('.');
            if (dot == std::string::npos)
                root.set(key, v);
            else
                for (auto& [k, child] : root.as_object())
                    if (k == key.substr(0, dot)) child.set(key.substr(dot + 1), v);
        }
        ++n;
        try {
            Tokenizer::from_json(root.dump(), "refused/tokenizer.json");
            ADD_FAILURE() << r.find("what")->as_string() << ": loaded; HF says " << r.find("hf_error")->as_string();
        } catch (const mf::Error& e) {
            std::printf("refused as HF: %s: %s\n", r.find("what")->as_string().c_str(), e.what());
        }
    }
    EXPECT_GE(n, 5u);
}

TEST(TokenizerFeatures, KimiTiktokenAsTiktoken) {
    require_fixtures();
    const fs::path dir = feature_dir() / "kimi_tiktoken";
    const Tokenizer tok = Tokenizer::load(dir);
    const Value expected = read_json(dir / "expected.json");
    EXPECT_EQ(tok.vocab_size(), static_cast<size_t>(expected.find("num_ranks")->as_int() + 256));
    Tally tally;
    for (const Value& c : expected.find("cases")->as_array()) {
        const std::string& text = c.find("text")->as_string();
        const std::vector<int32_t> ids = ids_of(*c.find("ids")), got = tok.encode(text);
        const std::string where = "kimi_tiktoken text " + mf::json::quote(text);
        tally.check(got == ids, where + ": ids " + show(got) + ", tiktoken " + show(ids));
        const std::string decoded = tok.decode(ids);
        tally.check(decoded == c.find("decoded")->as_string(),
                    where + ": decoded " + mf::json::quote(decoded) + ", tiktoken " + c.find("decoded")->dump());
    }
    std::printf("kimi tiktoken: %zu checks, %zu mismatches\n", tally.records, tally.mismatches);
    EXPECT_EQ(tally.mismatches, 0u);
}

// Every scalar value (but the surrogates) in each regex class the families' patterns use, against
// the set HF's Oniguruma gives: the Unicode 16 categories, White_Space, \w, \d, Script=Han.
TEST(TokenizerFeatures, RegexClassesAsOnigurumaOverAllCodePoints) {
    require_fixtures();
    const Value fixture = read_json(feature_dir() / "unicode_classes.json");
    size_t num_classes = 0, mismatches = 0;
    for (const auto& [pattern, ranges] : fixture.find("classes")->as_object()) {
        const mf::text::Regex re(pattern);
        std::vector<uint8_t> in_hf(0x110000, 0);
        for (const Value& r : ranges.as_array())
            for (int64_t cp = r.as_array()[0].as_int(); cp <= r.as_array()[1].as_int(); ++cp) in_hf[cp] = 1;
        size_t class_mismatches = 0;
        for (char32_t cp = 0; cp <= 0x10FFFF; ++cp) {
            if (cp >= 0xD800 && cp <= 0xDFFF) continue;
            size_t end = 0;
            const bool ours = re.match_at(std::u32string_view(&cp, 1), 0, &end);
            if (ours == (in_hf[cp] != 0)) continue;
            if (++class_mismatches <= 5)
                ADD_FAILURE() << pattern << ": U+" << std::hex << uint32_t(cp)
                              << (ours ? " matches here only" : " matches in HF only");
        }
        mismatches += class_mismatches;
        ++num_classes;
    }
    std::printf("regex classes: %zu classes over 1,112,064 code points, %zu mismatches\n", num_classes, mismatches);
    EXPECT_GE(num_classes, 30u);
    EXPECT_EQ(mismatches, 0u);
}
