#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "core/json.h"
#include "model/arch/config_reader.h"

using mf::json::parse;

TEST(Json, RoundTrip) {
    auto v = parse(R"({"a": 1, "b": [true, null, 2.5, "x\ny\u00e9\ud83d\ude00"], "c": {"d": -3e2}})", "t");
    EXPECT_EQ(v.find("a")->as_int(), 1);
    EXPECT_TRUE(v.find("a")->is_int());
    EXPECT_FALSE(v.find("c")->find("d")->is_int());
    EXPECT_EQ(v.find("c")->find("d")->as_double(), -300.0);
    EXPECT_EQ(v.find("b")->as_array()[3].as_string(), "x\ny\xc3\xa9\xf0\x9f\x98\x80");
    auto w = parse(v.dump(2), "t2");
    EXPECT_EQ(w.dump(), v.dump());
}

TEST(Json, RejectsMalformed) {
    const char* bad[] = {"",   "{",     "[1,]",    "{\"a\":1,}",        "{\"a\" 1}", "nul",         "01",
                         "1.", "\"abc", "\"\\x\"", "{\"a\":1,\"a\":2}", "[1] 2",     "\"\\ud800\"", "-",
                         "1e"};
    for (const char* text : bad) {
        EXPECT_THROW(parse(text, "bad.json"), mf::Error) << text;
    }
    try {
        parse("{\n  \"a\": tru\n}", "cfg.json");
        FAIL();
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("cfg.json:2:8"), std::string::npos) << e.what();
    }
}

TEST(Json, DepthLimit) {
    std::string deep(1000, '[');
    EXPECT_THROW(parse(deep, "deep.json"), mf::Error);
}

TEST(Json, KindErrors) {
    auto v = parse(R"({"a": "x", "b": 1.5})", "t");
    EXPECT_THROW(v.find("a")->as_int(), mf::Error);
    EXPECT_THROW(v.find("b")->as_int(), mf::Error);
}

TEST(Json, DuplicateKeysInLargeObjects) {
    std::string big = "{";
    for (int i = 0; i < 20000; ++i) big += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":" + std::to_string(i);
    EXPECT_EQ(parse(big + "}", "big.json").size(), 20000u);
    EXPECT_THROW(parse(big + ",\"k17\":1}", "dup.json"), mf::Error);
    EXPECT_THROW(parse(big + ",\"k19999\":1}", "dup.json"), mf::Error);
    EXPECT_THROW(parse("{\"a\":1,\"b\":2,\"a\":3}", "dup.json"), mf::Error);
}

TEST(Json, SkipsAUtf8ByteOrderMark) {
    // As Python's json.load(open(f, encoding="utf-8-sig")): a config saved by a Windows editor.
    const auto v = parse("\xEF\xBB\xBF{\"hidden_size\": 64}", "config.json");
    EXPECT_EQ(v.find("hidden_size")->as_int(), 64);
    EXPECT_EQ(parse("\xEF\xBB\xBF[1]", "t").size(), 1u);
    // A record (no source: a JSONL line, whose reader handles the file's start) does not skip one.
    EXPECT_THROW(parse("\xEF\xBB\xBF[1]", ""), mf::Error);
    // Only at the start: a BOM anywhere else is not JSON.
    EXPECT_THROW(parse("{\"a\": \xEF\xBB\xBF 1}", "t"), mf::Error);
}

// --- non-finite numbers in HF config.json -------------------------------------------------------

namespace {

std::string error_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const mf::Error& e) {
        return e.what();
    }
    return "";
}

const mf::json::ParseOptions kHf = mf::json::ParseOptions::hf_config();

}  // namespace

// Python's json.dumps spelling (the Hub's Nemotron-H configs: "time_step_limit": [0.0, Infinity]) is
// read where the caller opts in, as the three values Python's json.loads gives.
TEST(JsonNonFinite, BareLiteralsWhereOptedIn) {
    const auto v = parse(R"({"time_step_limit": [0.0, Infinity], "lo": -Infinity, "x": [NaN]})", "config.json", kHf);
    const auto& lim = v.find("time_step_limit")->as_array();
    EXPECT_EQ(lim[0].as_double(), 0.0);
    EXPECT_TRUE(std::isinf(lim[1].as_double()) && lim[1].as_double() > 0);
    EXPECT_FALSE(lim[1].is_int());
    EXPECT_TRUE(std::isinf(v.find("lo")->as_double()) && v.find("lo")->as_double() < 0);
    EXPECT_TRUE(std::isnan(v.find("x")->as_array()[0].as_double()));
    // Everything else stays strict under the option.
    for (const char* bad : {"[Infinit]", "[Infinityy]", "[-Inf]", "[NaNa]", "[nan]", "[inf]", "[+Infinity]", "[-NaN]",
                            "[Nope]", "{\"a\": 1,}"}) {
        const std::string msg = error_of([&] { parse(bad, "config.json", kHf); });
        EXPECT_NE(msg.find("config.json:1:"), std::string::npos) << bad << ": " << msg;
    }
    EXPECT_NE(error_of([] { parse("[Infinit]", "config.json", kHf); }).find("expected Infinity, -Infinity or NaN"),
              std::string::npos);
}

// Without the option (every JSON file but an HF config.json) the literals are an error at their line and column.
TEST(JsonNonFinite, StrictRefusesBareLiterals) {
    const struct {
        const char* text;
        const char* where;
        const char* literal;
    } cases[] = {{"{\n  \"a\": [0.0, Infinity]\n}", "recipe.json:2:14", "Infinity"},
                 {"{\"a\": -Infinity}", "recipe.json:1:7", "-Infinity"},
                 {"[1,\n NaN]", "recipe.json:2:2", "NaN"}};
    for (const auto& c : cases) {
        const std::string msg = error_of([&] { parse(c.text, "recipe.json"); });
        EXPECT_NE(msg.find(c.where), std::string::npos) << msg;
        EXPECT_NE(msg.find(std::string(c.literal) + " is not JSON"), std::string::npos) << msg;
    }
    EXPECT_NE(error_of([] { parse("Infinity", ""); }).find("column 1: invalid JSON"), std::string::npos);
    EXPECT_THROW(parse("[Infinit]", "t"), mf::Error);
}

// transformers 5.x writes {"__float__": "Infinity"}; hf_float_tag reads exactly its three spellings and
// refuses any other tag, naming the field (transformers would keep such a dict silently).
TEST(JsonNonFinite, FloatTags) {
    using mf::json::hf_float_tag;
    const auto v = parse(R"([{"__float__": "Infinity"}, {"__float__": "-Infinity"}, {"__float__": "NaN"},
                             {"a": 1}, 2.5, "Infinity"])",
                         "t");
    const auto& a = v.as_array();
    EXPECT_EQ(*hf_float_tag(a[0], "f"), std::numeric_limits<double>::infinity());
    EXPECT_EQ(*hf_float_tag(a[1], "f"), -std::numeric_limits<double>::infinity());
    EXPECT_TRUE(std::isnan(*hf_float_tag(a[2], "f")));
    for (size_t i = 3; i < a.size(); ++i) EXPECT_FALSE(hf_float_tag(a[i], "f").has_value()) << a[i].dump();
    for (const char* bad : {R"({"__float__": "x"})", R"({"__float__": "inf"})", R"({"__float__": 1.5})",
                            R"({"__float__": null})", R"({"__float__": "Infinity", "b": 1})"}) {
        std::string text = bad;
        const std::string msg = error_of([&] { hf_float_tag(parse(text, "t", kHf), "config.json: field \"x\""); });
        EXPECT_NE(msg.find("config.json: field \"x\""), std::string::npos) << bad << ": " << msg;
    }
}

// The writer: null by default (strict JSON), Python's bare spelling, or transformers 5.x's tag (laid out
// as HF's json.dumps(indent=2) lays it out); what each writes reads back as the same values.
TEST(JsonNonFinite, WriterSpellings) {
    using mf::json::NonFinite;
    const double inf = std::numeric_limits<double>::infinity();
    mf::json::Value v = mf::json::Value::object();
    v.set("time_step_limit", mf::json::Value(mf::json::Value::Array{mf::json::Value(0.0), mf::json::Value(inf)}));
    v.set("lo", mf::json::Value(-inf));
    v.set("n", mf::json::Value(std::numeric_limits<double>::quiet_NaN()));
    EXPECT_EQ(v.dump(), R"({"time_step_limit":[0.0,null],"lo":null,"n":null})");
    EXPECT_EQ(v.dump(-1, NonFinite::bare), R"({"time_step_limit":[0.0,Infinity],"lo":-Infinity,"n":NaN})");
    EXPECT_EQ(v.dump(-1, NonFinite::hf_tagged),
              R"({"time_step_limit":[0.0,{"__float__":"Infinity"}],"lo":{"__float__":"-Infinity"},)"
              R"("n":{"__float__":"NaN"}})");
    EXPECT_EQ(v.dump(2, NonFinite::hf_tagged),
              "{\n  \"time_step_limit\": [\n    0.0,\n    {\n      \"__float__\": \"Infinity\"\n    }\n  ],\n"
              "  \"lo\": {\n    \"__float__\": \"-Infinity\"\n  },\n  \"n\": {\n    \"__float__\": \"NaN\"\n  }\n}");
    // Read back: bare with the option, the tags strictly.
    const auto bare = parse(v.dump(2, NonFinite::bare), "config.json", kHf);
    EXPECT_EQ(bare.find("time_step_limit")->as_array()[1].as_double(), inf);
    const auto tagged = parse(v.dump(2, NonFinite::hf_tagged), "config.json");
    EXPECT_EQ(*mf::json::hf_float_tag(tagged.find("time_step_limit")->as_array()[1], "time_step_limit"), inf);
    EXPECT_EQ(*mf::json::hf_float_tag(*tagged.find("lo"), "lo"), -inf);
    EXPECT_THROW(parse(v.dump(2, NonFinite::bare), "config.json"), mf::Error);
}

// Numbers read through the config reader: the tag stands for its float; non-finite values are refused
// naming the field unless the field allows them; malformed tags are refused naming the field.
TEST(JsonNonFinite, ConfigReaderNumbers) {
    const auto cfg = parse(R"({"time_step_limit": [0.0, Infinity], "tagged": {"__float__": "Infinity"},
                               "eps": Infinity, "bad_tag": {"__float__": "x"}, "n": NaN, "layers": Infinity,
                               "tag_int": {"__float__": "Infinity"}, "ok": 1e-5})",
                           "cfg/config.json", kHf);
    const mf::model::arch::ConfigReader r(cfg, "cfg/config.json");
    const auto& lim = cfg.find("time_step_limit")->as_array();
    EXPECT_EQ(r.number(&lim[1], "time_step_limit", 0.0, true), std::numeric_limits<double>::infinity());
    EXPECT_EQ(r.number("tagged", 0.0, true), std::numeric_limits<double>::infinity());
    EXPECT_EQ(r.number("ok", 0.0), 1e-5);
    const struct {
        std::function<void()> read;
        const char* message;
    } refused[] = {
        {[&] { r.number("eps", 0.0); }, "cfg/config.json: field \"eps\" must be a finite number, got Infinity"},
        {[&] { r.number("tagged", 0.0); }, "cfg/config.json: field \"tagged\" must be a finite number, got Infinity"},
        {[&] { r.number("n", 0.0); }, "cfg/config.json: field \"n\" must be a finite number, got NaN"},
        {[&] { r.number("bad_tag", 0.0, true); }, "cfg/config.json: field \"bad_tag\": bad {\"__float__\": ...} tag"},
        {[&] { r.integer("layers", true, 0, 1); },
         "cfg/config.json: field \"layers\" must be an integer, got Infinity"},
        {[&] { r.integer("tag_int", true, 0, 1); },
         "cfg/config.json: field \"tag_int\" must be an integer, got object"},
    };
    for (const auto& c : refused) {
        const std::string msg = error_of(c.read);
        EXPECT_NE(msg.find(c.message), std::string::npos) << msg;
    }
}
