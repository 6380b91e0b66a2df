// Recipe tests: the YAML subset (structure, scalars, types, refusals with FILE:LINE), recipes
// parsed into the struct, command-line overrides, a catalogue of bad recipes each refused with its
// own message, glob matching against a reference matcher, and LR schedules against values
// derived independently (closed forms and identities, not the code's own formula).
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <set>

#include "core/json.h"
#include "test_util.h"
#include "train/lr_schedule.h"
#include "train/recipe.h"
#include "train/yaml.h"

using mf::json::Value;
using mf::train::lr_at;
using mf::train::lr_multiplier;
using mf::train::matches_pattern;
using mf::train::parse_recipe;
using mf::train::parse_yaml;
using mf::train::parse_yaml_document;
using mf::train::parse_yaml_value;
using mf::train::Recipe;

namespace {

// The message of the mf::Error thrown by `fn`, or "<no error>".
template <typename Fn>
std::string error_of(Fn&& fn) {
    try {
        fn();
    } catch (const mf::Error& e) {
        return e.what();
    }
    return "<no error>";
}

std::string yaml_error(const std::string& text) {
    return error_of([&] { parse_yaml(text, "t.yaml"); });
}

const char* kMinimal =
    "model: /models/tiny\n"
    "data:\n"
    "  train: data/train.jsonl\n"
    "train:\n"
    "  steps: 100\n"
    "out: runs/x\n";

}  // namespace

// --- YAML subset -----------------------------------------------------------------------------

TEST(Yaml, NestedMappings) {
    const Value v = parse_yaml(
        "a:\n"
        "  b:\n"
        "    c: 1\n"
        "    d: two\n"
        "  e: 3.5\n"
        "f: last\n",
        "t.yaml");
    ASSERT_TRUE(v.is_object());
    EXPECT_EQ(v.size(), 2u);
    EXPECT_EQ(v.find("a")->find("b")->find("c")->as_int(), 1);
    EXPECT_EQ(v.find("a")->find("b")->find("d")->as_string(), "two");
    EXPECT_EQ(v.find("a")->find("e")->as_double(), 3.5);
    EXPECT_EQ(v.find("f")->as_string(), "last");
    // Key order is kept.
    EXPECT_EQ(v.as_object()[0].first, "a");
    EXPECT_EQ(v.as_object()[1].first, "f");
}

TEST(Yaml, Sequences) {
    const Value v = parse_yaml(
        "plain:\n"
        "  - 1\n"
        "  - two\n"
        "  -   \"three\"\n"
        "compact:\n"
        "- x\n"
        "- y\n"
        "after: 5\n"
        "maps:\n"
        "  - name: a\n"
        "    size: 1\n"
        "  - name: b\n"
        "    inner:\n"
        "      k: v\n"
        "  -\n"
        "    name: c\n"
        "nested:\n"
        "  - - 1\n"
        "    - 2\n"
        "  - - 3\n"
        "empty_item:\n"
        "  -\n"
        "  - 0\n"
        "flow: [a, \"b, c\", 3, [4, 5], {k: v}, ]\n"
        "empty_flow: []\n"
        "fmap: {x: 1, 'y': two, z: }\n",
        "t.yaml");
    const auto& plain = v.find("plain")->as_array();
    ASSERT_EQ(plain.size(), 3u);
    EXPECT_EQ(plain[0].as_int(), 1);
    EXPECT_EQ(plain[1].as_string(), "two");
    EXPECT_EQ(plain[2].as_string(), "three");
    const auto& compact = v.find("compact")->as_array();
    ASSERT_EQ(compact.size(), 2u);
    EXPECT_EQ(compact[1].as_string(), "y");
    EXPECT_EQ(v.find("after")->as_int(), 5);
    const auto& maps = v.find("maps")->as_array();
    ASSERT_EQ(maps.size(), 3u);
    EXPECT_EQ(maps[0].find("name")->as_string(), "a");
    EXPECT_EQ(maps[0].find("size")->as_int(), 1);
    EXPECT_EQ(maps[1].find("inner")->find("k")->as_string(), "v");
    EXPECT_EQ(maps[2].find("name")->as_string(), "c");
    const auto& nested = v.find("nested")->as_array();
    ASSERT_EQ(nested.size(), 2u);
    ASSERT_EQ(nested[0].size(), 2u);
    EXPECT_EQ(nested[0].as_array()[1].as_int(), 2);
    EXPECT_EQ(nested[1].as_array()[0].as_int(), 3);
    const auto& empty_item = v.find("empty_item")->as_array();
    ASSERT_EQ(empty_item.size(), 2u);
    EXPECT_TRUE(empty_item[0].is_null());
    const auto& flow = v.find("flow")->as_array();
    ASSERT_EQ(flow.size(), 5u);
    EXPECT_EQ(flow[0].as_string(), "a");
    EXPECT_EQ(flow[1].as_string(), "b, c");
    EXPECT_EQ(flow[2].as_int(), 3);
    EXPECT_EQ(flow[3].as_array()[1].as_int(), 5);
    EXPECT_EQ(flow[4].find("k")->as_string(), "v");
    EXPECT_EQ(v.find("empty_flow")->size(), 0u);
    const Value* fmap = v.find("fmap");
    EXPECT_EQ(fmap->find("x")->as_int(), 1);
    EXPECT_EQ(fmap->find("y")->as_string(), "two");
    EXPECT_TRUE(fmap->find("z")->is_null());
}

TEST(Yaml, QuotesAndEscapes) {
    const Value v = parse_yaml(
        "d: \"tab\\there \\\"q\\\" back\\\\slash\\nnl \\u00e9 \\ud83d\\ude00\"\n"
        "s: 'it''s # not a comment'\n"
        "h: \"# not a comment\"  # but this is\n"
        "t: \"true\"\n"
        "n: '123'\n"
        "e: \"\"\n"
        "\"quoted key\": 1\n"
        "'single key': 2\n"
        "apostrophe: it's fine\n",
        "t.yaml");
    EXPECT_EQ(v.find("d")->as_string(), "tab\there \"q\" back\\slash\nnl \xc3\xa9 \xf0\x9f\x98\x80");
    EXPECT_EQ(v.find("s")->as_string(), "it's # not a comment");
    EXPECT_EQ(v.find("h")->as_string(), "# not a comment");
    EXPECT_TRUE(v.find("t")->is_string());
    EXPECT_EQ(v.find("t")->as_string(), "true");
    EXPECT_TRUE(v.find("n")->is_string());
    EXPECT_EQ(v.find("e")->as_string(), "");
    EXPECT_EQ(v.find("quoted key")->as_int(), 1);
    EXPECT_EQ(v.find("single key")->as_int(), 2);
    EXPECT_EQ(v.find("apostrophe")->as_string(), "it's fine");
}

TEST(Yaml, CommentsBlankLinesAndMarkers) {
    const Value v = parse_yaml(
        "\xEF\xBB\xBF"  // a BOM
        "--- # document start\n"
        "# a comment\n"
        "\n"
        "a: 1 # trailing\n"
        "   # indented comment\n"
        "\t# a tab-indented comment line is still only a comment\n"
        "b: x#y\n"
        "c: http://host:80/p\n"
        "d:\r\n"
        "  e: 2\r\n"
        "f:    spaced value   \n"
        "\n",
        "t.yaml");
    EXPECT_EQ(v.find("a")->as_int(), 1);
    EXPECT_EQ(v.find("b")->as_string(), "x#y");
    EXPECT_EQ(v.find("c")->as_string(), "http://host:80/p");
    EXPECT_EQ(v.find("d")->find("e")->as_int(), 2);
    EXPECT_EQ(v.find("f")->as_string(), "spaced value");
    EXPECT_EQ(v.size(), 5u);
    EXPECT_EQ(parse_yaml("", "t.yaml").size(), 0u);
    EXPECT_EQ(parse_yaml("# only a comment\n---\n", "t.yaml").size(), 0u);
}

TEST(Yaml, ScalarTypes) {
    const Value v = parse_yaml(
        "n1: null\nn2: ~\nn3:\nn4: Null\n"
        "b1: true\nb2: false\nb3: True\nb4: FALSE\n"
        "i1: 42\ni2: -7\ni3: +3\ni4: 0x1f\ni5: 0o17\ni6: 0\ni7: -9223372036854775808\n"
        "f1: 1e-4\nf2: 3.0e-5\nf3: .5\nf4: -2.5\nf5: 1.\nf6: 2E+3\nf7: -.25\n"
        "s1: yes\ns2: 1.2.3\ns3: 1e\ns4: 0x\ns6: 1_000\ns7: .\ns8: nulls\ns9: -x\n",
        "t.yaml");
    for (const char* k : {"n1", "n2", "n3", "n4"}) EXPECT_TRUE(v.find(k)->is_null()) << k;
    EXPECT_TRUE(v.find("b1")->as_bool());
    EXPECT_FALSE(v.find("b2")->as_bool());
    EXPECT_TRUE(v.find("b3")->as_bool());
    EXPECT_FALSE(v.find("b4")->as_bool());
    for (const char* k : {"i1", "i2", "i3", "i4", "i5", "i6", "i7"}) EXPECT_TRUE(v.find(k)->is_int()) << k;
    EXPECT_EQ(v.find("i1")->as_int(), 42);
    EXPECT_EQ(v.find("i2")->as_int(), -7);
    EXPECT_EQ(v.find("i3")->as_int(), 3);
    EXPECT_EQ(v.find("i4")->as_int(), 31);
    EXPECT_EQ(v.find("i5")->as_int(), 15);
    EXPECT_EQ(v.find("i7")->as_int(), INT64_MIN);
    for (const char* k : {"f1", "f2", "f3", "f4", "f5", "f6", "f7"}) {
        EXPECT_TRUE(v.find(k)->is_number() && !v.find(k)->is_int()) << k;
    }
    EXPECT_EQ(v.find("f1")->as_double(), 1e-4);
    EXPECT_EQ(v.find("f2")->as_double(), 3.0e-5);
    EXPECT_EQ(v.find("f3")->as_double(), 0.5);
    EXPECT_EQ(v.find("f4")->as_double(), -2.5);
    EXPECT_EQ(v.find("f5")->as_double(), 1.0);
    EXPECT_EQ(v.find("f6")->as_double(), 2000.0);
    EXPECT_EQ(v.find("f7")->as_double(), -0.25);
    EXPECT_EQ(v.find("s1")->as_string(), "yes");  // YAML 1.2: not a bool
    EXPECT_EQ(v.find("s2")->as_string(), "1.2.3");
    EXPECT_EQ(v.find("s3")->as_string(), "1e");
    EXPECT_EQ(v.find("s4")->as_string(), "0x");
    EXPECT_EQ(v.find("s6")->as_string(), "1_000");
    EXPECT_EQ(v.find("s7")->as_string(), ".");
    EXPECT_EQ(v.find("s8")->as_string(), "nulls");
    EXPECT_EQ(v.find("s9")->as_string(), "-x");
    const Value inf = parse_yaml("a: .inf\nb: -.Inf\nc: .nan\n", "t.yaml");
    EXPECT_TRUE(std::isinf(inf.find("a")->as_double()) && inf.find("a")->as_double() > 0);
    EXPECT_TRUE(std::isinf(inf.find("b")->as_double()) && inf.find("b")->as_double() < 0);
    EXPECT_TRUE(std::isnan(inf.find("c")->as_double()));
}

TEST(Yaml, LineMap) {
    const auto doc = parse_yaml_document(
        "# header\n"
        "a: 1\n"
        "\n"
        "b:\n"
        "  c: [x, y]\n"
        "  d:\n"
        "    - p\n"
        "    - q: 1\n",
        "t.yaml");
    EXPECT_EQ(doc.line_of("a"), 2);
    EXPECT_EQ(doc.line_of("b"), 4);
    EXPECT_EQ(doc.line_of("b.c"), 5);
    EXPECT_EQ(doc.line_of("b.c[1]"), 5);
    EXPECT_EQ(doc.line_of("b.d"), 6);
    EXPECT_EQ(doc.line_of("b.d[0]"), 7);
    EXPECT_EQ(doc.line_of("b.d[1].q"), 8);
    EXPECT_EQ(doc.line_of("nope"), 0);
}

TEST(Yaml, SingleValues) {
    EXPECT_EQ(parse_yaml_value("3e-4", "cl").as_double(), 3e-4);
    EXPECT_EQ(parse_yaml_value("12", "cl").as_int(), 12);
    EXPECT_TRUE(parse_yaml_value("", "cl").is_null());
    const Value list = parse_yaml_value("[*norm*,*bias, a#b]", "cl", true);
    ASSERT_EQ(list.size(), 3u);
    EXPECT_EQ(list.as_array()[0].as_string(), "*norm*");
    EXPECT_EQ(list.as_array()[1].as_string(), "*bias");
    EXPECT_EQ(list.as_array()[2].as_string(), "a#b");
    EXPECT_EQ(parse_yaml_value("dir # x", "cl", true).as_string(), "dir # x");
    EXPECT_EQ(parse_yaml_value("dir # x", "cl", false).as_string(), "dir");
    EXPECT_NE(error_of([] { parse_yaml_value("*alias", "cl", false); }).find("cl: aliases"), std::string::npos);
}

// Every refusal names the file and the line of the problem.
TEST(Yaml, Refusals) {
    struct Case {
        const char* text;
        const char* expect;  // substring of the message
    };
    const Case cases[] = {
        {"a:\n\tb: 1\n", "t.yaml:2: tab character in indentation"},
        {"a:\n  b:\n  \tc: 1\n", "t.yaml:3: tab character in indentation"},
        {"a: 1\nb: 2\na: 3\n", "t.yaml:3: duplicate key 'a' (first defined on line 1)"},
        {"f: {a: 1, a: 2}\n", "t.yaml:1: duplicate key 'a'"},
        {"a: &x 1\n", "t.yaml:1: anchors"},
        {"a: 1\nb: *x\n", "t.yaml:2: aliases"},
        {"a: [\"*ok\", *bad]\n", "t.yaml:1: aliases"},
        {"a: !!str 1\n", "t.yaml:1: tags"},
        {"a: |\n  text\n", "t.yaml:1: block scalars"},
        {"x: 1\na: >\n  text\n", "t.yaml:2: block scalars"},
        {"a: 1\n---\nb: 2\n", "t.yaml:2: a second document"},
        {"a: 1\n...\n", "t.yaml:2: the document end marker"},
        {"%YAML 1.2\na: 1\n", "t.yaml:1: YAML directives"},
        {"a: \"open\n", "t.yaml:1: unterminated double-quoted"},
        {"a: 'open\n", "t.yaml:1: unterminated single-quoted"},
        {"a: \"bad \\q escape\"\n", "t.yaml:1: unsupported escape '\\q'"},
        {"a: \"\\ud800\"\n", "t.yaml:1: unpaired surrogate"},
        {"a: first line\n  continued\n", "t.yaml:2: unexpected indentation"},
        {"a:\n  b: 1\n   c: 2\n", "t.yaml:3: unexpected indentation"},
        {"a: [1, 2\n", "t.yaml:1: unterminated flow collection"},
        {"z: 0\na: [1, 2 # comment]\n", "t.yaml:2: unterminated flow collection"},
        {"a: {b:1}\n", "t.yaml:1: expected ': ' after key 'b:1'"},
        {"a: [1,, 2]\n", "t.yaml:1: unexpected ','"},
        {"a: b: c\n", "t.yaml:1: ': ' inside a plain value"},
        {"- a\n- b\n", "t.yaml:1: the top level of a recipe must be a mapping"},
        {"just text\n", "t.yaml:1: expected 'key: value'"},
        {"a:\n  - x\n  y: 1\n", "t.yaml:3: expected a sequence item"},
        {"a:\n  b: 1\n  - x\n", "t.yaml:3: a sequence item ('- ...') where"},
        {"? complex\n", "t.yaml:1: complex keys"},
        {"a: 99999999999999999999\n", "t.yaml:1: integer 99999999999999999999 is out of range"},
        {"a: 1e999\n", "t.yaml:1: number 1e999 is out of range"},
        {"a: 1\nb: \x01\n", "t.yaml:2: control character"},
        {"a: \xff\n", "t.yaml:1: invalid UTF-8"},
        {"a: \"x\"y\n", "t.yaml:1: unexpected text 'y'"},
        {"a:b\n", "t.yaml:1: expected 'key: value', found 'a:b' (a space is needed after the ':' of a key)"},
        {"  a: 1\nb: 2\n", "t.yaml:2: this line is indented less than the first line"},
        {"a:\n  plain on its own line\n", "t.yaml:2: expected 'key: value' or '- item' here"},
    };
    std::set<std::string> messages;
    for (const Case& c : cases) {
        const std::string msg = yaml_error(c.text);
        EXPECT_NE(msg.find(c.expect), std::string::npos) << "input: " << c.text << "\nmessage: " << msg;
        EXPECT_TRUE(messages.insert(msg).second) << "another input gave the same message: " << msg;
    }
}

TEST(Yaml, Limits) {
    std::string deep;
    for (int i = 0; i < 100; ++i)
        deep += std::string(static_cast<size_t>(2 * i), ' ') + "k" + std::to_string(i) + ":\n";
    EXPECT_NE(yaml_error(deep).find("nesting deeper than"), std::string::npos);
    std::string deep_flow = "a: " + std::string(100, '[') + std::string(100, ']') + "\n";
    EXPECT_NE(yaml_error(deep_flow).find("t.yaml:1: nesting deeper than"), std::string::npos);
    std::string big = "a: \"" + std::string(mf::train::kMaxYamlBytes, 'x') + "\"\n";
    EXPECT_NE(yaml_error(big).find("t.yaml:1:"), std::string::npos);
    EXPECT_NE(yaml_error(big).find("limited to"), std::string::npos);
    // Just under the limits is fine.
    std::string ok;
    for (int i = 0; i < 40; ++i) ok += std::string(static_cast<size_t>(2 * i), ' ') + "k" + std::to_string(i) + ":\n";
    EXPECT_NO_THROW(parse_yaml(ok, "t.yaml"));
}

// --- recipes ---------------------------------------------------------------------------------

TEST(Recipe, FullRecipe) {
    const char* text =
        "# a complete recipe\n"
        "model: /models/qwen3-moe-tiny\n"
        "data:\n"
        "  train: \"data/sft #1.jsonl\"\n"
        "  format: messages\n"
        "  shuffle: false\n"
        "  packing: false\n"
        "  on_error: skip\n"
        "train:\n"
        "  steps: 1000\n"
        "  micro_batch: 4\n"
        "  seq_len: 4096\n"
        "  grad_accum: 8\n"
        "  grad_clip: 0.5\n"
        "  log_every: 10\n"
        "  recompute: moe\n"
        "optim:\n"
        "  lr: 2.0e-5\n"
        "  betas: [0.9, 0.95]\n"
        "  eps: 1e-6\n"
        "  weight_decay: 0.1\n"
        "  no_decay:\n"
        "    - \"*norm*\"\n"
        "    - '*bias'\n"
        "  schedule: cosine\n"
        "  warmup_steps: 50\n"
        "  min_lr_ratio: 0.1\n"
        "seed: 1234\n"
        "device: cuda\n"
        "precision: mixed\n"
        "out: runs/sft\n";
    const Recipe r = parse_recipe(text, "full.yaml", {});
    EXPECT_EQ(r.source, "full.yaml");
    EXPECT_EQ(r.model, "/models/qwen3-moe-tiny");
    EXPECT_EQ(r.data.train, "data/sft #1.jsonl");
    EXPECT_EQ(r.data.format, "messages");
    EXPECT_FALSE(r.data.shuffle);
    EXPECT_FALSE(r.data.packing);
    EXPECT_EQ(r.data.on_error, "skip");
    EXPECT_EQ(r.train.steps, 1000);
    EXPECT_EQ(r.train.micro_batch, 4);
    EXPECT_EQ(r.train.seq_len, 4096);
    EXPECT_EQ(r.train.grad_accum, 8);
    EXPECT_EQ(r.train.grad_clip, 0.5);
    EXPECT_EQ(r.train.log_every, 10);
    EXPECT_EQ(r.train.recompute, "moe");
    EXPECT_EQ(r.optim.lr, 2.0e-5);
    EXPECT_EQ(r.optim.beta1, 0.9);
    EXPECT_EQ(r.optim.beta2, 0.95);
    EXPECT_EQ(r.optim.eps, 1e-6);
    EXPECT_EQ(r.optim.weight_decay, 0.1);
    EXPECT_EQ(r.optim.no_decay, (std::vector<std::string>{"*norm*", "*bias"}));
    EXPECT_EQ(r.optim.schedule, "cosine");
    EXPECT_EQ(r.optim.warmup_steps, 50);
    EXPECT_EQ(r.optim.min_lr_ratio, 0.1);
    EXPECT_EQ(r.seed, 1234);
    EXPECT_EQ(r.device, "cuda");
    EXPECT_EQ(r.precision, "mixed");
    EXPECT_EQ(r.out, "runs/sft");

    // Flow-style sections give the same recipe.
    const char* flow =
        "model: /models/qwen3-moe-tiny\n"
        "data: {train: \"data/sft #1.jsonl\", format: messages, shuffle: false, packing: false, on_error: skip}\n"
        "train: {steps: 1000, micro_batch: 4, seq_len: 4096, grad_accum: 8, grad_clip: 0.5, log_every: 10, "
        "recompute: moe}\n"
        "optim:\n"
        "  {lr: 2.0e-5, eps: 1e-6, weight_decay: 0.1, schedule: cosine, warmup_steps: 50, min_lr_ratio: 0.1}\n";
    // (a flow mapping on its own line is not in the subset: the error says so)
    EXPECT_NE(error_of([&] { parse_recipe(flow, "flow.yaml", {}); }).find("flow.yaml:5:"), std::string::npos);
    const char* flow_ok =
        "model: /models/qwen3-moe-tiny\n"
        "data: {train: \"data/sft #1.jsonl\", format: messages, shuffle: false, packing: false, on_error: skip}\n"
        "train: {steps: 1000, micro_batch: 4, seq_len: 4096, grad_accum: 8, grad_clip: 0.5, log_every: 10, "
        "recompute: moe}\n"
        "optim: {lr: 2.0e-5, eps: 1e-6, weight_decay: 0.1, schedule: cosine, warmup_steps: 50, min_lr_ratio: 0.1}\n"
        "seed: 1234\n"
        "device: cuda\n"
        "precision: mixed\n"
        "out: runs/sft\n";
    const Recipe f = parse_recipe(flow_ok, "flow.yaml", {"optim.betas=[0.9, 0.95]", "optim.no_decay=[*norm*,*bias]"});
    EXPECT_EQ(f.to_json().dump(), r.to_json().dump());
}

// Defaults: those of torch.optim.AdamW (betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2) with a
// fine-tuning lr of 1e-5, and the documented defaults of the other sections.
TEST(Recipe, Defaults) {
    const Recipe r = parse_recipe(kMinimal, "min.yaml", {});
    EXPECT_EQ(r.model, "/models/tiny");
    EXPECT_EQ(r.data.train, "data/train.jsonl");
    EXPECT_EQ(r.data.format, "auto");
    EXPECT_TRUE(r.data.shuffle);
    EXPECT_TRUE(r.data.packing);
    EXPECT_EQ(r.data.on_error, "stop");
    EXPECT_EQ(r.train.steps, 100);
    EXPECT_EQ(r.train.micro_batch, 1);
    EXPECT_EQ(r.train.seq_len, 2048);
    EXPECT_EQ(r.train.grad_accum, 1);
    EXPECT_EQ(r.train.grad_clip, 1.0);
    EXPECT_EQ(r.train.log_every, 1);
    EXPECT_EQ(r.train.recompute, "none");
    EXPECT_EQ(r.optim.lr, 1e-5);
    EXPECT_EQ(r.optim.beta1, 0.9);
    EXPECT_EQ(r.optim.beta2, 0.999);
    EXPECT_EQ(r.optim.eps, 1e-8);
    EXPECT_EQ(r.optim.weight_decay, 0.01);
    EXPECT_TRUE(r.optim.no_decay.empty());
    EXPECT_EQ(r.optim.schedule, "constant");
    EXPECT_EQ(r.optim.warmup_steps, 0);
    EXPECT_EQ(r.optim.min_lr_ratio, 0.0);
    EXPECT_EQ(r.seed, 0);
    EXPECT_EQ(r.device, "auto");
    EXPECT_EQ(r.precision, "bf16");
    EXPECT_EQ(r.out, "runs/x");
    // An empty section is allowed (everything in it commented out).
    EXPECT_NO_THROW(parse_recipe(std::string(kMinimal) + "optim:\n  # lr: 1\n", "min.yaml", {}));
}

TEST(Recipe, NumericConversions) {
    // Float fields accept integers; integer fields accept integral floats but not 1.5.
    const Recipe r = parse_recipe(std::string(kMinimal) + "optim:\n  lr: 1\n  weight_decay: 0\n  betas: [0, 0.5]\n",
                                  "m.yaml", {"train.seq_len=1e3", "train.grad_clip=2"});
    EXPECT_EQ(r.optim.lr, 1.0);
    EXPECT_EQ(r.optim.weight_decay, 0.0);
    EXPECT_EQ(r.optim.beta1, 0.0);
    EXPECT_EQ(r.train.seq_len, 1000);
    EXPECT_EQ(r.train.grad_clip, 2.0);
}

TEST(Recipe, Overrides) {
    const Recipe r = parse_recipe(kMinimal, "min.yaml",
                                  {
                                      "optim.lr=3e-4",                  // new section, float
                                      "train.steps=20",                 // replaces the file's value
                                      "optim.betas=[0.9,0.95]",         // flow list
                                      "optim.no_decay=[*norm*,*bias]",  // unquoted globs on the command line
                                      "data.shuffle=false",             // bool
                                      "out=runs/with # hash",           // '#' is literal on the command line
                                      "optim.schedule=linear", "optim.warmup_steps=5", "seed=7",
                                      "seed=8",  // later overrides win
                                      "model=\"quoted dir\"",
                                      "  device = cpu",  // blanks around the key are ignored
                                  });
    EXPECT_EQ(r.optim.lr, 3e-4);
    EXPECT_EQ(r.train.steps, 20);
    EXPECT_EQ(r.optim.beta1, 0.9);
    EXPECT_EQ(r.optim.beta2, 0.95);
    EXPECT_EQ(r.optim.no_decay, (std::vector<std::string>{"*norm*", "*bias"}));
    EXPECT_FALSE(r.data.shuffle);
    EXPECT_EQ(r.out, "runs/with # hash");
    EXPECT_EQ(r.optim.schedule, "linear");
    EXPECT_EQ(r.optim.warmup_steps, 5);
    EXPECT_EQ(r.seed, 8);
    EXPECT_EQ(r.model, "quoted dir");
    EXPECT_EQ(r.device, "cpu");
    EXPECT_EQ(r.data.train, "data/train.jsonl");  // untouched keys keep the file's value
    // Required keys may come from the command line alone.
    const Recipe c = parse_recipe("", "empty.yaml", {"model=m", "data.train=d", "train.steps=1", "out=o"});
    EXPECT_EQ(c.model, "m");
    EXPECT_EQ(c.train.steps, 1);
}

// to_json holds every key: rebuilding a recipe from its to_json leaves alone (as overrides on an
// empty file) gives the same recipe, for a recipe where no value is a default.
TEST(Recipe, ToJsonHasEveryKey) {
    const Recipe r = parse_recipe(
        "model: m\n"
        "data: {train: d, format: text, shuffle: false, packing: false, on_error: skip, chat_format: chatml_think, "
        "loss_on: all, chat_template_kwargs: {enable_thinking: false, effort: high}}\n"
        "train: {steps: 9, micro_batch: 2, seq_len: 16, grad_accum: 3, grad_clip: 0.25, log_every: 4, recompute: "
        "full, on_nonfinite: skip}\n"
        "checkpoint: {every: 3, keep: 5}\n"
        "dist: {ep_size: 2, timeout_s: 7.5}\n"
        "optim:\n"
        "  lr: 0.125\n"
        "  betas: [0.5, 0.75]\n"
        "  eps: 0.001\n"
        "  weight_decay: 0.5\n"
        "  no_decay: ['*.bias', 'lm_head?']\n"
        "  schedule: linear\n"
        "  warmup_steps: 2\n"
        "  min_lr_ratio: 0.25\n"
        "seed: 5\ndevice: cpu\nprecision: mixed\nout: o\n",
        "x.yaml", {});
    const Value j = r.to_json();
    std::vector<std::string> overrides;
    size_t num_leaves = 0;
    for (const auto& [key, value] : j.as_object()) {
        if (value.is_object()) {
            for (const auto& [sub, sub_value] : value.as_object()) {
                overrides.push_back(key + "." + sub + "=" + sub_value.dump());
                ++num_leaves;
            }
        } else {
            overrides.push_back(key + "=" + value.dump());
            ++num_leaves;
        }
    }
    EXPECT_EQ(num_leaves, mf::train::recipe_key_docs().size());
    const Recipe back = parse_recipe("", "back", overrides);
    EXPECT_EQ(back.to_json().dump(), j.dump());
    EXPECT_EQ(back.optim.no_decay, r.optim.no_decay);
    EXPECT_EQ(back.optim.beta2, 0.75);
    EXPECT_EQ(back.train.recompute, "full");
    EXPECT_EQ(back.dist.ep_size, 2);
    EXPECT_EQ(back.dist.timeout_s, 7.5);
    EXPECT_EQ(j.find("optim")->find("betas")->as_array()[0].as_double(), 0.5);
}

TEST(Recipe, ChatTemplateKwargs) {
    const Recipe r = parse_recipe(kMinimal, "x.yaml", {"data.chat_template_kwargs={enable_thinking: false}"});
    ASSERT_TRUE(r.data.chat_template_kwargs.is_object());
    ASSERT_NE(r.data.chat_template_kwargs.find("enable_thinking"), nullptr);
    EXPECT_FALSE(r.data.chat_template_kwargs.find("enable_thinking")->as_bool());
    EXPECT_EQ(parse_recipe(kMinimal, "x.yaml", {}).data.chat_template_kwargs.size(), 0u);
    EXPECT_EQ(parse_recipe(kMinimal, "x.yaml", {"data.chat_format=jinja"}).data.chat_format, "jinja");
    try {
        parse_recipe(kMinimal, "x.yaml", {"data.chat_template_kwargs=3"});
        FAIL() << "a number was taken as template variables";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("a mapping of template variables"), std::string::npos) << e.what();
    }
}

TEST(Recipe, LoadFromFile) {
    const auto dir = mf::test::temp_dir("recipe");
    const auto path = dir / "recipe.yaml";
    mf::test::write_file(path, kMinimal);
    const Recipe r = mf::train::load_recipe(path, {"train.steps=3"});
    EXPECT_EQ(r.source, path.string());
    EXPECT_EQ(r.train.steps, 3);
    const std::string missing = error_of([&] { mf::train::load_recipe(dir / "nope.yaml", {}); });
    EXPECT_NE(missing.find("nope.yaml: recipe file not found"), std::string::npos) << missing;
    const std::string is_dir = error_of([&] { mf::train::load_recipe(dir, {}); });
    EXPECT_NE(is_dir.find("not a regular file"), std::string::npos) << is_dir;
    mf::test::write_file(dir / "bad.yaml", std::string(kMinimal) + "optim:\n  lr: -1\n");
    const std::string bad = error_of([&] { mf::train::load_recipe(dir / "bad.yaml", {}); });
    EXPECT_NE(bad.find((dir / "bad.yaml").string() + ":8: optim.lr"), std::string::npos) << bad;
    std::filesystem::remove_all(dir);
}

// Each bad recipe is refused with its own message naming the source, the line (for the file) and
// the key.
TEST(Recipe, BadRecipes) {
    const std::string base = kMinimal;  // 6 lines; appended text starts on line 7
    struct Case {
        std::string text;
        std::vector<std::string> overrides;
        std::vector<std::string> expect;  // substrings of the message
    };
    const std::vector<Case> cases = {
        // unknown keys, with suggestions
        {base + "optim:\n  lr_rate: 1\n",
         {},
         {"r.yaml:8:", "unknown key 'optim.lr_rate'", "did you mean 'optim.lr'", "keys of optim:"}},
        {base + "learning_rate: 1e-4\n", {}, {"r.yaml:7:", "unknown key 'learning_rate'", "did you mean 'optim.lr'"}},
        {base + "train2:\n  x: 1\n", {}, {"r.yaml:7:", "unknown key 'train2'", "did you mean 'train'"}},
        {base + "optim:\n  warmup: 10\n", {}, {"r.yaml:8:", "'optim.warmup'", "did you mean 'optim.warmup_steps'"}},
        {base,
         {"optim.betass=[0.9,0.9]"},
         {"command line", "unknown key 'optim.betass'", "did you mean 'optim.betas'"}},
        {base, {"train.lr=1"}, {"command line", "unknown key 'train.lr'", "did you mean 'optim.lr'"}},
        // wrong types
        {"model: m\ndata: {train: d}\ntrain:\n  steps: abc\nout: o\n",
         {},
         {"r.yaml:4:", "train.steps", "expected an integer >= 1", "the string \"abc\""}},
        {base + "train:\n  micro_batch: 2\n", {}, {"r.yaml:7:", "duplicate key 'train' (first defined on line 4)"}},
        {"model: m\ndata: {train: d}\ntrain: {steps: 10, micro_batch: 1.5}\nout: o\n",
         {},
         {"r.yaml:3:", "train.micro_batch", "expected an integer", "the number 1.5"}},
        {base + "optim: 3\n", {}, {"r.yaml:7:", "optim: expected a mapping"}},
        {base + "seed: [1]\n", {}, {"r.yaml:7:", "seed: expected an integer >= 0", "a list"}},
        {base + "data2: 1\n", {}, {"r.yaml:7:", "unknown key 'data2'", "did you mean 'data'"}},
        {base + "optim.lr: 1\n", {}, {"r.yaml:7:", "'optim.lr': in a recipe file write nested keys"}},
        {"model: 123\ndata: {train: d}\ntrain: {steps: 1}\nout: o\n",
         {},
         {"r.yaml:1:", "model: expected a string (quote it: \"123\")"}},
        {base + "device: yes\n", {}, {"r.yaml:7:", "device: expected one of auto, cpu, cuda", "\"yes\""}},
        {base + "optim:\n  no_decay: [\"*norm*\", 3]\n",
         {},
         {"r.yaml:8:", "optim.no_decay: expected a list of non-empty strings", "the integer 3"}},
        {base + "optim:\n  no_decay: \"*norm*\"\n", {}, {"r.yaml:8:", "optim.no_decay: expected a list"}},
        {base, {"data.packing=yes"}, {"command line ('data.packing=yes')", "data.packing: expected true or false"}},
        {base,
         {"optim.lr=fast"},
         {"command line ('optim.lr=fast')", "optim.lr: expected a finite number >= 0", "\"fast\""}},
        // YAML-level problems inside a recipe
        {"model: m\ndata:\n\ttrain: d\n", {}, {"r.yaml:3:", "tab character in indentation"}},
        {base + "optim:\n  lr: 1\n  eps: 1e-9\n  lr: 2\n",
         {},
         {"r.yaml:10:", "duplicate key 'lr' (first defined on line 8)"}},
        {base + "optim:\n  schedule: \"cosine\n", {}, {"r.yaml:8:", "unterminated double-quoted"}},
        {base + "optim:\n  no_decay: [*norm*]\n", {}, {"r.yaml:8:", "aliases", "must be quoted"}},
        {base + "device: &dev cpu\n", {}, {"r.yaml:7:", "anchors"}},
        {base + "out2: |\n  x\n", {}, {"r.yaml:7:", "block scalars"}},
        // ranges
        {base + "optim:\n  betas: [0.9]\n", {}, {"r.yaml:8:", "optim.betas: expected a list of two numbers", "a list"}},
        {base + "optim:\n  betas: [0.9, 1.0]\n",
         {},
         {"r.yaml:8:", "optim.betas", "each in [0, 1)", "the number 1.0 in the list"}},
        {base + "optim:\n  betas: [-0.1, 0.9]\n", {}, {"r.yaml:8:", "optim.betas", "the number -0.1 in the list"}},
        {"data: {train: d}\ntrain: {steps: 1}\nout: o\n", {}, {"r.yaml: missing required key 'model'"}},
        {"model: m\ntrain: {steps: 1}\nout: o\n", {}, {"r.yaml: missing required key 'data.train'"}},
        {"model: m\ndata: {train: d}\nout: o\n", {}, {"r.yaml: missing required key 'train.steps'"}},
        {"model: m\ndata: {train: d}\ntrain: {steps: 1}\n", {}, {"r.yaml: missing required key 'out'"}},
        {"model: m\ndata: {train: d}\ntrain:\n  steps: -5\nout: o\n",
         {},
         {"r.yaml:4:", "train.steps: expected an integer >= 1", "-5"}},
        {base, {"train.steps=0"}, {"command line ('train.steps=0')", "train.steps: expected an integer >= 1"}},
        {base + "optim:\n  schedule: exponential\n",
         {},
         {"r.yaml:8:", "optim.schedule: expected one of constant, cosine, linear", "\"exponential\""}},
        {base + "precision: fp8\n", {}, {"r.yaml:7:", "precision: expected one of bf16, mixed"}},
        {base,
         {"data.format=parquet"},
         {"command line", "data.format: expected one of tokens, auto, messages, prompt_completion, text"}},
        {base, {"data.on_error=ignore"}, {"command line", "data.on_error: expected one of stop, skip"}},
        {base, {"train.recompute=some"}, {"command line", "train.recompute: expected one of none, moe, full"}},
        {base + "optim:\n  lr: -1e-4\n", {}, {"r.yaml:8:", "optim.lr: expected a finite number >= 0"}},
        {base + "optim:\n  eps: 0\n", {}, {"r.yaml:8:", "optim.eps: expected a finite number > 0", "the integer 0"}},
        {base + "optim:\n  eps: .inf\n", {}, {"r.yaml:8:", "optim.eps: expected a finite number > 0"}},
        {base + "optim:\n  weight_decay: -0.1\n", {}, {"r.yaml:8:", "optim.weight_decay"}},
        {base + "optim:\n  min_lr_ratio: 1.5\n", {}, {"r.yaml:8:", "optim.min_lr_ratio: expected a number in [0, 1]"}},
        {base,
         {"train.micro_batch=0"},
         {"command line ('train.micro_batch=0')", "train.micro_batch: expected an integer in [1, 1048576]"}},
        {base, {"train.seq_len=100000000"}, {"command line", "train.seq_len: expected an integer in [2, 16777216]"}},
        {base, {"train.log_every=0"}, {"command line", "train.log_every"}},
        {base, {"train.grad_clip=-1"}, {"command line", "train.grad_clip: expected a finite number >= 0"}},
        {base + "optim:\n  warmup_steps: 101\n",
         {},
         {"r.yaml:8:", "optim.warmup_steps: expected at most train.steps (100), got 101"}},
        {base + "optim:\n  warmup_steps: 50\n",
         {"train.steps=10"},
         {"r.yaml:8:", "optim.warmup_steps: expected at most train.steps (10), got 50"}},
        {base, {"seed=-1"}, {"command line", "seed: expected an integer >= 0"}},
        // override syntax
        {base, {"optim.lr"}, {"command line ('optim.lr')", "needs '='", "key=value"}},
        {base, {"=5"}, {"command line ('=5')", "missing key before '='"}},
        {base, {"optim=[1]"}, {"command line ('optim=[1]')", "'optim' is a section"}},
        {base, {"optim.betas=[0.9, 0.95"}, {"command line ('optim.betas=[0.9, 0.95')", "unterminated flow collection"}},
        {base, {"model="}, {"command line ('model=')", "model: expected a string", "null"}},
    };
    std::set<std::string> messages;
    for (const Case& c : cases) {
        const std::string msg = error_of([&] { parse_recipe(c.text, "r.yaml", c.overrides); });
        for (const std::string& want : c.expect)
            EXPECT_NE(msg.find(want), std::string::npos) << "recipe:\n"
                                                         << c.text << "\nwant: " << want << "\nmessage: " << msg;
        EXPECT_TRUE(messages.insert(msg).second) << "another bad recipe gave the same message: " << msg;
    }
}

// --- glob patterns ---------------------------------------------------------------------------

namespace {

// A reference matcher, written the obvious recursive way.
bool reference_match(std::string_view p, std::string_view n) {
    if (p.empty()) return n.empty();
    if (p[0] == '*') return reference_match(p.substr(1), n) || (!n.empty() && reference_match(p, n.substr(1)));
    if (n.empty()) return false;
    return (p[0] == '?' || p[0] == n[0]) && reference_match(p.substr(1), n.substr(1));
}

}  // namespace

TEST(Recipe, GlobPatterns) {
    EXPECT_TRUE(matches_pattern("*norm*", "model.layers.0.input_layernorm.weight"));
    EXPECT_TRUE(matches_pattern("*norm*", "model.norm.weight"));
    EXPECT_FALSE(matches_pattern("*norm*", "model.layers.0.mlp.gate.weight"));
    EXPECT_TRUE(matches_pattern("*bias", "model.layers.0.self_attn.q_proj.bias"));
    EXPECT_FALSE(matches_pattern("*bias", "model.layers.0.self_attn.q_proj.bias.extra"));
    EXPECT_TRUE(matches_pattern("model.layers.?.mlp.*", "model.layers.3.mlp.experts.0.up_proj.weight"));
    EXPECT_FALSE(matches_pattern("model.layers.?.mlp.*", "model.layers.12.mlp.experts.0.up_proj.weight"));
    EXPECT_TRUE(matches_pattern("lm_head.weight", "lm_head.weight"));
    EXPECT_FALSE(matches_pattern("lm_head.weight", "lm_head.weights"));
    EXPECT_TRUE(matches_pattern("*", ""));
    EXPECT_TRUE(matches_pattern("", ""));
    EXPECT_FALSE(matches_pattern("", "a"));
    EXPECT_FALSE(matches_pattern("?", ""));
    EXPECT_TRUE(matches_pattern("a*b*c", "aXbYbZc"));
    EXPECT_FALSE(matches_pattern("a*b*c", "aXbYbZ"));
    EXPECT_TRUE(matches_pattern("**", "anything"));
    // Against the reference on every pattern over {a, *, ?} up to length 5 and names over {a, b}
    // up to length 6.
    std::vector<std::string> patterns{""}, names{""};
    for (size_t len = 0, begin = 0; len < 5; ++len) {
        const size_t end = patterns.size();
        for (size_t i = begin; i < end; ++i)
            for (const char c : {'a', '*', '?'}) patterns.push_back(patterns[i] + c);
        begin = end;
    }
    for (size_t len = 0, begin = 0; len < 6; ++len) {
        const size_t end = names.size();
        for (size_t i = begin; i < end; ++i)
            for (const char c : {'a', 'b'}) names.push_back(names[i] + c);
        begin = end;
    }
    size_t num_matches = 0;
    for (const auto& p : patterns)
        for (const auto& n : names) {
            const bool want = reference_match(p, n);
            num_matches += want ? 1 : 0;
            ASSERT_EQ(matches_pattern(p, n), want) << "pattern '" << p << "' name '" << n << "'";
        }
    EXPECT_GT(num_matches, 0u);
}

// --- learning-rate schedules ------------------------------------------------------------------

namespace {

Recipe::Optim schedule(const std::string& kind, int64_t warmup, double min_lr_ratio = 0.0, double lr = 1e-3) {
    Recipe::Optim o;
    o.lr = lr;
    o.schedule = kind;
    o.warmup_steps = warmup;
    o.min_lr_ratio = min_lr_ratio;
    return o;
}

}  // namespace

// Expected values written out by hand from HF's definitions (warm-up s/W; cosine
// 0.5 * (1 + cos(pi * (s - W) / (T - W))); linear (T - s) / (T - W)), using closed forms such as
// cos(pi/4) = sqrt(2)/2 and 0.5 * (1 - cos(x)) = sin(x/2)^2 rather than the code's expression.
TEST(LrSchedule, Cosine) {
    const double lr = 1e-3;
    const int64_t total = 110, warmup = 10;  // 100 decay steps
    const auto o = schedule("cosine", warmup);
    EXPECT_EQ(lr_at(o, 0, total), 0.0);                // HF: the first step of a warm-up runs at 0
    EXPECT_NEAR(lr_at(o, 5, total), lr * 0.5, 1e-18);  // half-way through warm-up
    EXPECT_NEAR(lr_at(o, 9, total), lr * 0.9, 1e-18);  // last warm-up step
    EXPECT_NEAR(lr_at(o, 10, total), lr, 1e-18);       // warm-up end: the peak
    EXPECT_NEAR(lr_at(o, 35, total), lr * (0.5 + std::sqrt(2.0) / 4.0), 1e-15);  // a quarter of the decay
    EXPECT_NEAR(lr_at(o, 60, total), lr * 0.5, 1e-15);                           // half of the decay
    const double last = std::pow(std::sin(std::numbers::pi * 0.005), 2.0);       // p = 99/100
    EXPECT_NEAR(lr_at(o, 109, total), lr * last, 1e-15);
    EXPECT_NEAR(lr_at(o, 109, total), 2.467198171342e-7, 1e-17);
    // With a floor: r + (1 - r) * d.
    const auto f = schedule("cosine", warmup, 0.1);
    EXPECT_NEAR(lr_at(f, 5, total), lr * 0.5, 1e-18);  // warm-up is not floored
    EXPECT_NEAR(lr_at(f, 10, total), lr, 1e-18);
    EXPECT_NEAR(lr_at(f, 60, total), lr * 0.55, 1e-15);
    EXPECT_NEAR(lr_at(f, 109, total), lr * (0.1 + 0.9 * last), 1e-15);
    // No warm-up: step 0 is the peak.
    EXPECT_NEAR(lr_at(schedule("cosine", 0), 0, 4), lr, 1e-18);
    EXPECT_NEAR(lr_at(schedule("cosine", 0), 2, 4), lr * 0.5, 1e-15);
    EXPECT_NEAR(lr_at(schedule("cosine", 0), 1, 4), lr * (0.5 + std::sqrt(2.0) / 4.0), 1e-15);
}

TEST(LrSchedule, Linear) {
    const double lr = 2e-5;
    const int64_t total = 110, warmup = 10;
    const auto o = schedule("linear", warmup, 0.0, lr);
    EXPECT_EQ(lr_at(o, 0, total), 0.0);
    EXPECT_NEAR(lr_at(o, 4, total), lr * 0.4, 1e-20);
    EXPECT_NEAR(lr_at(o, 10, total), lr, 1e-20);
    EXPECT_NEAR(lr_at(o, 35, total), lr * 0.75, 1e-20);
    EXPECT_NEAR(lr_at(o, 60, total), lr * 0.5, 1e-20);
    EXPECT_NEAR(lr_at(o, 109, total), lr * 0.01, 1e-20);  // HF: 1 / (T - W) at the last step, not 0
    const auto f = schedule("linear", warmup, 0.2, lr);
    EXPECT_NEAR(lr_at(f, 60, total), lr * 0.6, 1e-20);
    EXPECT_NEAR(lr_at(f, 109, total), lr * (0.2 + 0.8 * 0.01), 1e-20);
    // Decreasing after warm-up, never below the floor.
    for (int64_t s = warmup + 1; s < total; ++s) {
        EXPECT_LT(lr_at(f, s, total), lr_at(f, s - 1, total));
        EXPECT_GE(lr_at(f, s, total), 0.2 * lr);
    }
}

TEST(LrSchedule, ConstantAndEdges) {
    const double lr = 1e-3;
    const auto o = schedule("constant", 4);
    EXPECT_EQ(lr_at(o, 0, 10), 0.0);
    EXPECT_NEAR(lr_at(o, 1, 10), lr * 0.25, 1e-18);
    EXPECT_NEAR(lr_at(o, 2, 10), lr * 0.5, 1e-18);
    EXPECT_EQ(lr_at(o, 4, 10), lr);
    EXPECT_EQ(lr_at(o, 9, 10), lr);
    EXPECT_EQ(lr_at(schedule("constant", 0, 0.5), 0, 1), lr);  // the floor does not lower a constant
    // One step, no warm-up: every schedule runs it at the peak.
    for (const char* kind : {"constant", "cosine", "linear"}) EXPECT_EQ(lr_at(schedule(kind, 0), 0, 1), lr) << kind;
    // Warm-up as long as training: all steps are warm-up steps s / T.
    for (int64_t s = 0; s < 8; ++s) EXPECT_NEAR(lr_multiplier(schedule("linear", 8), s, 8), s / 8.0, 1e-15);
    // Out-of-range steps are a programming error, reported as such.
    EXPECT_THROW(lr_at(o, 11, 10), mf::Error);  // step T itself is where the schedule ends (lr_schedule.h)
    EXPECT_THROW(lr_at(o, -1, 10), mf::Error);
    EXPECT_THROW(lr_at(o, 0, 0), mf::Error);
    EXPECT_THROW(lr_at(schedule("step", 0), 0, 10), mf::Error);
}

// A recipe's schedule drives lr_at end to end.
TEST(LrSchedule, FromRecipe) {
    const Recipe r =
        parse_recipe(kMinimal, "min.yaml", {"optim.schedule=cosine", "optim.warmup_steps=20", "optim.lr=1e-4"});
    EXPECT_EQ(lr_at(r.optim, 0, r.train.steps), 0.0);
    EXPECT_NEAR(lr_at(r.optim, 20, r.train.steps), 1e-4, 1e-19);
    EXPECT_NEAR(lr_at(r.optim, 60, r.train.steps), 0.5e-4, 1e-18);  // (60 - 20) / 80 = 0.5
}

TEST(Recipe, DistKeys) {
    const Recipe d = parse_recipe(kMinimal, "x.yaml", {});
    EXPECT_EQ(d.dist.ep_size, 1);
    EXPECT_EQ(d.dist.timeout_s, 300.0);
    const Recipe r = parse_recipe(kMinimal, "x.yaml", {"dist.ep_size=4", "dist.timeout_s=12"});
    EXPECT_EQ(r.dist.ep_size, 4);
    EXPECT_EQ(r.dist.timeout_s, 12.0);
    const std::string zero = error_of([] { parse_recipe(kMinimal, "x.yaml", {"dist.ep_size=0"}); });
    EXPECT_NE(zero.find("dist.ep_size"), std::string::npos) << zero;
    const std::string timeout = error_of([] { parse_recipe(kMinimal, "x.yaml", {"dist.timeout_s=0"}); });
    EXPECT_NE(timeout.find("dist.timeout_s"), std::string::npos) << timeout;
    const std::string typo = error_of([] { parse_recipe(kMinimal, "x.yaml", {"dist.ep=2"}); });
    EXPECT_NE(typo.find("dist.ep_size"), std::string::npos) << typo;
}

// --- issue 20: keys declared once, new keys, paths, clear errors ------------------------------

TEST(Yaml, FlowCollectionsNestInsideFlowMappings) {
    const Value v = parse_yaml("optim: {betas: [0.9, 0.95], sub: {c: 1, d: [x, {e: 2}]}}\n", "t.yaml");
    const Value* optim = v.find("optim");
    ASSERT_NE(optim, nullptr);
    ASSERT_TRUE(optim->find("betas")->is_array());
    EXPECT_EQ(optim->find("betas")->as_array()[1].as_double(), 0.95);
    EXPECT_EQ(optim->find("sub")->find("c")->as_int(), 1);
    EXPECT_EQ(optim->find("sub")->find("d")->as_array()[1].find("e")->as_int(), 2);
    const Recipe r = parse_recipe(std::string(kMinimal) + "optim: {lr: 1e-4, betas: [0.8, 0.9]}\n", "r.yaml", {});
    EXPECT_EQ(r.optim.beta1, 0.8);
    EXPECT_EQ(r.optim.beta2, 0.9);
    EXPECT_EQ(r.optim.lr, 1e-4);
}

TEST(Recipe, ByteOrderMarkIsSkipped) {
    const Recipe r = parse_recipe(std::string("\xEF\xBB\xBF") + kMinimal, "bom.yaml", {});
    EXPECT_EQ(r.model, "/models/tiny");
}

TEST(Recipe, SeqLenOfOneIsRefusedWithAReason) {
    const std::string msg = error_of(
        [] { parse_recipe("model: m\ndata: {train: d}\ntrain: {steps: 1, seq_len: 1}\nout: o\n", "r.yaml", {}); });
    EXPECT_NE(msg.find("r.yaml:3: train.seq_len: expected an integer in [2, "), std::string::npos) << msg;
    const std::string eval = error_of([] { parse_recipe(kMinimal, "r.yaml", {"eval.seq_len=1"}); });
    EXPECT_NE(eval.find("eval.seq_len: expected an integer in [2, "), std::string::npos) << eval;
}

TEST(Recipe, NonFiniteNumbersAreNamed) {
    for (const char* o :
         {"optim.lr=.nan", "optim.lr=.inf", "optim.lr=-.inf", "train.grad_clip=.nan", "dist.timeout_s=.inf"}) {
        const std::string msg = error_of([&] { parse_recipe(kMinimal, "r.yaml", {o}); });
        EXPECT_EQ(msg.find("null"), std::string::npos) << o << ": " << msg;
        const bool named = msg.find("NaN is not allowed") != std::string::npos ||
                           msg.find("infinities are not allowed") != std::string::npos;
        EXPECT_TRUE(named) << o << ": " << msg;
    }
    const std::string file =
        error_of([] { parse_recipe(std::string(kMinimal) + "optim:\n  lr: .nan\n", "r.yaml", {}); });
    EXPECT_NE(file.find("r.yaml:8: optim.lr: expected a finite number >= 0, got NaN"), std::string::npos) << file;
}

TEST(Recipe, HugeMicroBatchTimesSeqLenIsRefusedNamingBoth) {
    // Each is in its own range; the product (2^30 tokens) is what would ask for ~800 GB.
    const std::string msg = error_of([] {
        parse_recipe(kMinimal, "r.yaml", {"train.micro_batch=65536", "train.seq_len=16384"});
    });
    EXPECT_NE(msg.find("train.micro_batch x train.seq_len = 65536 x 16384 = 1073741824 tokens"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("at most 4194304"), std::string::npos) << msg;
    const std::string eval = error_of([] {
        parse_recipe(kMinimal, "r.yaml", {"eval.micro_batch=4096", "eval.seq_len=4096"});
    });
    EXPECT_NE(eval.find("eval.micro_batch x eval.seq_len"), std::string::npos) << eval;
    EXPECT_NO_THROW(parse_recipe(kMinimal, "r.yaml", {"train.micro_batch=1024", "train.seq_len=4096"}));
}

TEST(Recipe, EvalCheckpointLogAndDataKeys) {
    const Recipe d = parse_recipe(kMinimal, "r.yaml", {"train.micro_batch=3", "train.seq_len=96", "train.log_every=7"});
    EXPECT_EQ(d.eval.data, "");
    EXPECT_EQ(d.eval.every, 0);
    EXPECT_EQ(d.eval.micro_batch, 3);  // follows train.*
    EXPECT_EQ(d.eval.seq_len, 96);
    EXPECT_EQ(d.log.every, 7);
    EXPECT_FALSE(d.log.tensorboard);
    EXPECT_FALSE(d.checkpoint.keep_best);
    EXPECT_EQ(d.data.on_empty, "stop");
    const Recipe r = parse_recipe(std::string(kMinimal) +
                                      "eval: {data: /d/held.jsonl, every: 5, micro_batch: 2, seq_len: 64}\n"
                                      "checkpoint: {keep_best: true}\nlog: {tensorboard: true, every: 2}\n",
                                  "r.yaml", {"data.on_empty=warn"});
    EXPECT_EQ(r.eval.data, "/d/held.jsonl");
    EXPECT_EQ(r.eval.every, 5);
    EXPECT_EQ(r.eval.micro_batch, 2);
    EXPECT_EQ(r.eval.seq_len, 64);
    EXPECT_TRUE(r.checkpoint.keep_best);
    EXPECT_TRUE(r.log.tensorboard);
    EXPECT_EQ(r.log.every, 2);
    EXPECT_EQ(r.data.on_empty, "warn");
    const Value j = r.to_json();
    EXPECT_EQ(j.find("eval")->find("data")->as_string(), "/d/held.jsonl");
    EXPECT_EQ(j.find("eval")->find("micro_batch")->as_int(), 2);
    EXPECT_EQ(j.find("checkpoint")->find("keep_best")->as_bool(), true);
    EXPECT_EQ(j.find("log")->find("tensorboard")->as_bool(), true);
    EXPECT_EQ(j.find("data")->find("on_empty")->as_string(), "warn");

    const std::string bad_empty = error_of([] { parse_recipe(kMinimal, "r.yaml", {"data.on_empty=skip"}); });
    EXPECT_NE(bad_empty.find("data.on_empty: expected one of stop, warn"), std::string::npos) << bad_empty;
    const std::string no_data = error_of([] { parse_recipe(kMinimal, "r.yaml", {"eval.every=10"}); });
    EXPECT_NE(no_data.find("eval.every: 10 needs eval.data"), std::string::npos) << no_data;
    const std::string best = error_of([] { parse_recipe(kMinimal, "r.yaml", {"checkpoint.keep_best=true"}); });
    EXPECT_NE(best.find("checkpoint.keep_best: true needs evaluation during training"), std::string::npos) << best;
    const std::string best2 = error_of([] {
        parse_recipe(kMinimal, "r.yaml", {"eval.data=h.jsonl", "checkpoint.keep_best=true"});
    });
    EXPECT_NE(best2.find("eval.every > 0"), std::string::npos) << best2;
    const std::string stdin_data = error_of([] { parse_recipe(kMinimal, "r.yaml", {"data.train='-'"}); });
    EXPECT_NE(stdin_data.find("data.train: expected a file"), std::string::npos) << stdin_data;
    const std::string stdin_eval = error_of([] { parse_recipe(kMinimal, "r.yaml", {"eval.data='-'"}); });
    EXPECT_NE(stdin_eval.find("eval.data: expected a file"), std::string::npos) << stdin_eval;
    const std::string tb = error_of([] { parse_recipe(kMinimal, "r.yaml", {"log.tensorboard=1"}); });
    EXPECT_NE(tb.find("log.tensorboard: expected true or false"), std::string::npos) << tb;
}

TEST(Recipe, RelativePathsResolveFromTheRecipeDirectory) {
    const auto dir = mf::test::temp_dir("recipe_paths");
    std::filesystem::create_directories(dir / "sub");
    mf::test::write_file(dir / "sub" / "r.yaml",
                         "model: base\ndata: {train: data/t.jsonl}\neval: {data: ../held.jsonl}\n"
                         "train: {steps: 1}\nout: /abs/out\n");
    const Recipe r = mf::train::load_recipe(dir / "sub" / "r.yaml", {});
    const std::filesystem::path base = dir / "sub";
    EXPECT_EQ(r.model, (base / "base").string());
    EXPECT_EQ(r.data.train, (base / "data/t.jsonl").string());
    EXPECT_EQ(r.eval.data, (base / "../held.jsonl").string());
    EXPECT_EQ(r.out, "/abs/out");  // absolute: as written
    // Overrides are command-line paths: from the current directory, as written.
    const Recipe o = mf::train::load_recipe(dir / "sub" / "r.yaml", {"model=m2", "out=o2"});
    EXPECT_EQ(o.model, "m2");
    EXPECT_EQ(o.out, "o2");
    EXPECT_EQ(o.data.train, (base / "data/t.jsonl").string());
    std::filesystem::remove_all(dir);
}

TEST(Recipe, KeyDocsCoverEveryKeyOnce) {
    const auto docs = mf::train::recipe_key_docs();
    const Recipe r = parse_recipe(kMinimal, "r.yaml", {});
    const Value j = r.to_json();
    std::set<std::string> seen;
    for (const auto& d : docs) {
        EXPECT_TRUE(seen.insert(d.path).second) << "declared twice: " << d.path;
        EXPECT_FALSE(d.type.empty()) << d.path;
        EXPECT_FALSE(d.default_value.empty()) << d.path;
        EXPECT_FALSE(d.meaning.empty()) << d.path;
        // Every documented key is accepted as an override and appears in to_json.
        const size_t dot = d.path.find('.');
        const Value* v =
            dot == std::string::npos ? j.find(d.path) : j.find(d.path.substr(0, dot))->find(d.path.substr(dot + 1));
        EXPECT_NE(v, nullptr) << d.path;
    }
    for (const char* key : {"eval.data", "eval.every", "eval.micro_batch", "eval.seq_len", "checkpoint.keep_best",
                            "log.tensorboard", "log.every", "data.on_empty", "train.log_every"})
        EXPECT_TRUE(seen.count(key)) << key;
    for (const auto& d : docs) {
        if (d.path == "train.seq_len") {
            EXPECT_EQ(d.default_value, "2048");
        }
        if (d.path == "model") {
            EXPECT_EQ(d.default_value, "(required)");
        }
        if (d.path == "eval.micro_batch") {
            EXPECT_EQ(d.default_value, "train.micro_batch");
        }
        if (d.path == "data.on_empty") {
            EXPECT_EQ(d.type, "one of stop, warn");
        }
    }
}
