#include <gtest/gtest.h>

#include "core/json.h"

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
