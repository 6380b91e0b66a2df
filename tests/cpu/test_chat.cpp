// Chat formatting tests: HF parity (ids and assistant masks made by transformers'
// apply_chat_template, scripts/make_chat_fixtures.py), template recognition on the real Qwen
// templates, reformatted copies of them and templates we must refuse, Qwen3 reasoning rendering,
// loss_on, and a tokenizer whose special tokens break message-by-message encoding.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "core/json.h"
#include "test_util.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace fs = std::filesystem;
using mf::json::Value;
using mf::text::ChatFormat;
using mf::text::ChatMessage;
using mf::text::LossOn;
using mf::text::Tokenizer;

namespace {

fs::path tokenizer_dir() { return fs::path(mf::test::fixtures_dir()) / "tokenizer"; }
fs::path chat_dir() { return fs::path(mf::test::fixtures_dir()) / "chat"; }

const Tokenizer& fixture_tokenizer() {
    static const Tokenizer tok = Tokenizer::load(tokenizer_dir());
    return tok;
}

std::vector<Value> records() {
    std::vector<Value> out;
    std::istringstream in(mf::test::read_file(chat_dir() / "expected.jsonl"));
    std::string line;
    int n = 0;
    while (std::getline(in, line))
        if (!line.empty()) out.push_back(mf::json::parse(line, "expected.jsonl:" + std::to_string(++n)));
    return out;
}

std::map<std::string, std::string> templates() {
    const Value v = mf::json::parse(mf::test::read_file(chat_dir() / "templates.json"), "templates.json");
    std::map<std::string, std::string> out;
    for (const auto& [name, t] : v.as_object()) out[name] = t.find("template")->as_string();
    return out;
}

std::vector<int32_t> ints(const Value& v) {
    std::vector<int32_t> out;
    for (const Value& e : v.as_array()) out.push_back(static_cast<int32_t>(e.as_int()));
    return out;
}

std::vector<ChatMessage> messages_of(const Value& v) {
    std::vector<ChatMessage> out;
    for (const Value& m : v.as_array()) {
        ChatMessage cm{m.find("role")->as_string(), m.find("content")->as_string(), std::nullopt};
        if (const Value* r = m.find("reasoning_content")) cm.reasoning_content = r->as_string();
        out.push_back(std::move(cm));
    }
    return out;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
    for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
        s.replace(at, from.size(), to);
    return s;
}

// Every newline and its indentation collapsed to one space (as some re-uploads of Qwen3 ship it).
std::string collapse_layout(const std::string& t) {
    std::string out;
    for (size_t i = 0; i < t.size(); ++i) {
        if (t[i] == '\n') {
            while (i + 1 < t.size() && t[i + 1] == ' ') ++i;
            out += ' ';
        } else {
            out += t[i];
        }
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out;
}

std::string detect_error(const std::string& t) {
    try {
        mf::text::detect_chat_format(t, "model/tokenizer_config.json");
    } catch (const mf::Error& e) {
        return e.what();
    }
    return "";
}

}  // namespace

// --- HF parity ---------------------------------------------------------------------------------------

TEST(ChatParity, IdsAndAssistantMasksMatchTransformers) {
    const Tokenizer& tok = fixture_tokenizer();
    const std::map<std::string, std::string> tmpl = templates();
    const std::vector<Value> recs = records();
    ASSERT_GE(recs.size(), 100u);
    std::set<std::string> formats;
    int learned_total = 0, straddling = 0;
    for (size_t i = 0; i < recs.size(); ++i) {
        const Value& r = recs[i];
        const std::string where = "record " + std::to_string(i) + " (" + r.find("template")->as_string() + ")";
        const ChatFormat format = mf::text::parse_chat_format(r.find("format")->as_string());
        formats.insert(r.find("format")->as_string());
        // The model's template is recognised as the format the record was made with.
        ASSERT_EQ(mf::text::detect_chat_format(tmpl.at(r.find("template")->as_string()), where), format) << where;
        const std::vector<ChatMessage> msgs = messages_of(*r.find("messages"));
        const std::string& text = r.find("text")->as_string();
        EXPECT_EQ(mf::text::render_chat_text(msgs, format), text) << where;

        const std::vector<int32_t> ids = ints(*r.find("input_ids"));
        const std::vector<int32_t> mask = ints(*r.find("assistant_masks"));
        ASSERT_EQ(tok.encode(text, false), ids) << where << ": the tokenizer itself differs from HF";
        const mf::text::TokenizedChat tc = mf::text::tokenize_chat(tok, msgs, format, LossOn::assistant);
        ASSERT_EQ(tc.input_ids, ids) << where;
        ASSERT_EQ(tc.labels.size(), ids.size()) << where;
        for (size_t t = 0; t < ids.size(); ++t) {
            EXPECT_EQ(tc.labels[t] != -100, mask[t] == 1) << where << " token " << t;
            if (tc.labels[t] != -100) {
                EXPECT_EQ(tc.labels[t], ids[t]);
            }
            learned_total += mask[t];
        }
        // Content opening with a newline: HF's mask starts at a token that holds the header's "\n".
        for (const ChatMessage& m : msgs)
            if (m.role == "assistant" && !m.content.empty() && m.content[0] == '\n') ++straddling;

        const mf::text::TokenizedChat all = mf::text::tokenize_chat(tok, msgs, format, LossOn::all);
        EXPECT_EQ(all.input_ids, ids) << where;
        EXPECT_EQ(all.labels, ids) << where;
    }
    EXPECT_EQ(formats.size(), 4u);
    EXPECT_GT(learned_total, 500);
    EXPECT_GT(straddling, 0);
}

TEST(ChatParity, LearnedTokensAreTheAssistantTurnAfterItsHeader) {
    // Independent of the fixture: the learned ids decode to the content, <|im_end|> and "\n".
    const Tokenizer& tok = fixture_tokenizer();
    const std::vector<ChatMessage> msgs = {{"user", "Capital of Kazakhstan?", {}},
                                           {"assistant", "Astana.", {}},
                                           {"user", "And of France?", {}},
                                           {"assistant", "Paris.", {}}};
    for (ChatFormat f : {ChatFormat::chatml, ChatFormat::chatml_qwen2, ChatFormat::chatml_qwen2_5}) {
        const mf::text::TokenizedChat tc = mf::text::tokenize_chat(tok, msgs, f, LossOn::assistant);
        std::vector<std::vector<int32_t>> runs;
        bool in_run = false;
        for (size_t t = 0; t < tc.labels.size(); ++t) {
            if (tc.labels[t] != -100) {
                if (!in_run) runs.emplace_back();
                runs.back().push_back(tc.labels[t]);
            }
            in_run = tc.labels[t] != -100;
        }
        ASSERT_EQ(runs.size(), 2u) << mf::text::chat_format_name(f);
        EXPECT_EQ(tok.decode(runs[0]), "Astana.<|im_end|>\n");
        EXPECT_EQ(tok.decode(runs[1]), "Paris.<|im_end|>\n");
    }
}

// --- rendering -----------------------------------------------------------------------------------------

TEST(ChatRender, DefaultSystemMessages) {
    const std::vector<ChatMessage> msgs = {{"user", "Hi", {}}, {"assistant", "Hello", {}}};
    const std::string turns = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n";
    EXPECT_EQ(mf::text::render_chat_text(msgs, ChatFormat::chatml), turns);
    EXPECT_EQ(mf::text::render_chat_text(msgs, ChatFormat::chatml_qwen2),
              "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + turns);
    EXPECT_EQ(
        mf::text::render_chat_text(msgs, ChatFormat::chatml_qwen2_5),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n" + turns);
    // Qwen3: no default system message, and the last assistant turn gets an empty think block.
    EXPECT_EQ(mf::text::render_chat_text(msgs, ChatFormat::chatml_qwen3),
              "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n");
    // A system message of its own replaces the default.
    const std::vector<ChatMessage> with_sys = {{"system", "Be brief.", {}}, {"user", "Hi", {}}};
    EXPECT_EQ(mf::text::render_chat_text(with_sys, ChatFormat::chatml_qwen2_5),
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatRender, Qwen3Reasoning) {
    // Earlier turns lose their reasoning; the last keeps it; reasoning_content wins over the content.
    const std::vector<ChatMessage> msgs = {{"user", "Q1", {}},
                                           {"assistant", "<think>\nr1\n</think>\n\nA1", {}},
                                           {"user", "Q2", {}},
                                           {"assistant", "\n<think>r2</think>A2", {}}};
    EXPECT_EQ(mf::text::render_chat_text(msgs, ChatFormat::chatml_qwen3),
              "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
              "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n");
    const std::vector<ChatMessage> field = {{"user", "Q", {}}, {"assistant", "A </think> B", std::string("\nR\n")}};
    EXPECT_EQ(mf::text::render_chat_text(field, ChatFormat::chatml_qwen3),
              "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR\n</think>\n\nA </think> B<|im_end|>\n");
    // Two assistant turns after the last query: the first only gets a block if it has reasoning.
    const std::vector<ChatMessage> two = {{"user", "Q", {}}, {"assistant", "A", {}}, {"assistant", "B", {}}};
    EXPECT_EQ(mf::text::render_chat_text(two, ChatFormat::chatml_qwen3),
              "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n");
    // Other formats leave <think> text alone.
    EXPECT_EQ(mf::text::render_chat_text({{"assistant", "<think>x</think>y", {}}}, ChatFormat::chatml),
              "<|im_start|>assistant\n<think>x</think>y<|im_end|>\n");
}

TEST(ChatRender, Qwen3ThinkBlockIsLearned) {
    const Tokenizer& tok = fixture_tokenizer();
    const std::vector<ChatMessage> msgs = {{"user", "Q", {}}, {"assistant", "<think>why</think>A", {}}};
    const mf::text::TokenizedChat tc = mf::text::tokenize_chat(tok, msgs, ChatFormat::chatml_qwen3, LossOn::assistant);
    std::vector<int32_t> learned;
    for (int32_t l : tc.labels)
        if (l != -100) learned.push_back(l);
    EXPECT_EQ(tok.decode(learned), "<think>\nwhy\n</think>\n\nA<|im_end|>\n");
}

TEST(ChatRender, FirstLearnableAndLossOnAll) {
    const Tokenizer& tok = fixture_tokenizer();
    const std::vector<ChatMessage> msgs = {
        {"user", "2+2?", {}}, {"assistant", "4", {}}, {"user", "3+3?", {}}, {"assistant", "6", {}}};
    const auto all_turns = mf::text::tokenize_chat(tok, msgs, ChatFormat::chatml, LossOn::assistant, 0);
    const auto last_turn = mf::text::tokenize_chat(tok, msgs, ChatFormat::chatml, LossOn::assistant, 2);
    EXPECT_EQ(all_turns.input_ids, last_turn.input_ids);
    std::vector<int32_t> learned;
    for (int32_t l : last_turn.labels)
        if (l != -100) learned.push_back(l);
    EXPECT_EQ(tok.decode(learned), "6<|im_end|>\n");
    const auto all = mf::text::tokenize_chat(tok, msgs, ChatFormat::chatml, LossOn::all, 2);
    EXPECT_EQ(all.labels, all.input_ids);
}

TEST(ChatRender, UnknownRoleAndNames) {
    EXPECT_THROW(mf::text::render_chat({{"tool", "x", {}}}, ChatFormat::chatml, LossOn::assistant), mf::Error);
    EXPECT_EQ(mf::text::parse_chat_format("chatml_qwen2_5"), ChatFormat::chatml_qwen2_5);
    for (ChatFormat f :
         {ChatFormat::chatml, ChatFormat::chatml_qwen2, ChatFormat::chatml_qwen2_5, ChatFormat::chatml_qwen3})
        EXPECT_EQ(mf::text::parse_chat_format(mf::text::chat_format_name(f)), f);
    try {
        mf::text::parse_chat_format("chatml_qwen4");
        FAIL() << "accepted an unknown format";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("chatml_qwen3"), std::string::npos) << e.what();
    }
    EXPECT_EQ(mf::text::parse_loss_on("all"), LossOn::all);
    EXPECT_THROW(mf::text::parse_loss_on("assistant_only"), mf::Error);
}

TEST(ChatRender, TokenizerThatBreaksPerMessageEncodingIsRefused) {
    // <|im_start|> with lstrip swallows the "\n" before it in the whole text, but not message by message.
    Value tj = mf::json::parse(mf::test::read_file(tokenizer_dir() / "tokenizer.json"), "tokenizer.json");
    for (auto& [key, value] : tj.as_object())
        if (key == "added_tokens")
            for (Value& t : value.as_array())
                if (t.find("content")->as_string() == "<|im_start|>") t.set("lstrip", true);
    const Tokenizer tok = Tokenizer::from_json(tj.dump(), "lstrip-tokenizer.json");
    const std::vector<ChatMessage> msgs = {{"user", "Hi", {}}, {"assistant", "Hello", {}}};
    try {
        mf::text::tokenize_chat(tok, msgs, ChatFormat::chatml, LossOn::assistant);
        FAIL() << "accepted a tokenizer whose whole-text encoding differs";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("message by message"), std::string::npos) << e.what();
    }
}

// --- template recognition ------------------------------------------------------------------------------

TEST(ChatDetect, RealTemplatesAndHarmlessRewrites) {
    const std::map<std::string, std::string> t = templates();
    const std::map<std::string, ChatFormat> expect = {{"qwen2", ChatFormat::chatml_qwen2},
                                                      {"qwen2_5", ChatFormat::chatml_qwen2_5},
                                                      {"qwen3", ChatFormat::chatml_qwen3},
                                                      {"qwen3_instruct_2507", ChatFormat::chatml}};
    ASSERT_EQ(t.size(), expect.size());
    for (const auto& [name, format] : expect) {
        const std::string& s = t.at(name);
        EXPECT_EQ(mf::text::detect_chat_format(s, name), format) << name;
        // Layout, quoting and subscript style do not change what renders.
        EXPECT_EQ(mf::text::detect_chat_format(collapse_layout(s), name), format) << name << " collapsed";
        EXPECT_EQ(mf::text::detect_chat_format(replace_all(s, "message.role", "message['role']"), name), format)
            << name;
        EXPECT_EQ(mf::text::detect_chat_format(s + "\n", name), format) << name << " trailing newline";
        // A different generation prompt: training never renders it.
        const std::string gen =
            replace_all(s, "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}");
        EXPECT_EQ(mf::text::detect_chat_format(gen, name), format) << name << " generation prompt";
    }
    // TRL-style {% generation %} markers render nothing.
    EXPECT_EQ(mf::text::detect_chat_format(replace_all(t.at("qwen2"), "{{'<|im_start|>' + message['role']",
                                                       "{% generation %}{{'<|im_start|>' + message['role']"),
                                           "x"),
              ChatFormat::chatml_qwen2);
    // The fixture tokenizer's own template, found through the tokenizer.
    EXPECT_EQ(mf::text::resolve_chat_format("auto", fixture_tokenizer(), tokenizer_dir()), ChatFormat::chatml_qwen2);
    EXPECT_EQ(mf::text::resolve_chat_format("chatml_qwen2", fixture_tokenizer(), tokenizer_dir()),
              ChatFormat::chatml_qwen2);
    // Forcing a format the model's template does not render is an error naming the difference.
    for (const char* forced : {"chatml", "chatml_qwen2_5", "chatml_qwen3"}) {
        try {
            mf::text::resolve_chat_format(forced, fixture_tokenizer(), tokenizer_dir());
            ADD_FAILURE() << forced << " was accepted for the Qwen2 template";
        } catch (const mf::Error& e) {
            EXPECT_NE(std::string(e.what()).find(std::string("renders conversations differently from ") + forced),
                      std::string::npos)
                << e.what();
        }
    }
}

TEST(ChatDetect, RefusesTemplatesWeDoNotRender) {
    const std::map<std::string, std::string> t = templates();
    const std::string qwen2 = t.at("qwen2"), qwen3 = t.at("qwen3");
    struct Case {
        std::string name, tmpl, expect;
    };
    const std::vector<Case> cases = {
        {"empty", "", "empty"},
        {"llama3",
         "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + "
         "'<|eot_id|>' }}{% endfor %}",
         "not a ChatML template"},
        {"other default system", replace_all(qwen2, "You are a helpful assistant.", "You are a pirate."),
         "You are a pirate."},
        {"trimmed content", replace_all(qwen3, "'\\n' + content + '<|im_end|>'", "'\\n' + content|trim + '<|im_end|>'"),
         "trim"},
        {"bos token", "{{ bos_token }}" + qwen2, "bos_token"},
        {"text outside tags", "Hello " + qwen2, "text outside tags"},
        {"newline after an expression", replace_all(qwen2, "}}{% endfor %}", "}}\n{% endfor %}"), "whitespace"},
        {"unterminated tag", qwen2 + "{% if x ", "unterminated"},
        {"always-think (TRL training style)",
         replace_all(qwen3, "{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}"), "Qwen3"},
        {"roles rendered another way",
         replace_all(qwen2, "'<|im_start|>' + message['role'] + '\\n'", "'<|im_start|>' + message['role'] + ': '"),
         "does not render messages"},
    };
    for (const Case& c : cases) {
        const std::string err = detect_error(c.tmpl);
        ASSERT_FALSE(err.empty()) << c.name << " was accepted";
        EXPECT_NE(err.find("model/tokenizer_config.json"), std::string::npos) << c.name << ": " << err;
        EXPECT_NE(err.find(c.expect), std::string::npos) << c.name << ": " << err;
        EXPECT_NE(err.find("data.chat_format"), std::string::npos) << c.name << ": " << err;
    }
}

TEST(ChatDetect, TemplateSources) {
    const fs::path dir = mf::test::temp_dir("chat_sources");
    fs::copy_file(tokenizer_dir() / "tokenizer.json", dir / "tokenizer.json");
    const std::string qwen3 = templates().at("qwen3");
    // No template anywhere: auto is an error, a named format is fine.
    mf::test::write_file(dir / "tokenizer_config.json", R"({"eos_token": "<|im_end|>"})");
    Tokenizer tok = Tokenizer::load(dir);
    EXPECT_FALSE(mf::text::find_chat_template(tok, dir).has_value());
    try {
        mf::text::resolve_chat_format("auto", tok, dir);
        FAIL() << "auto without a template";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("no chat_template"), std::string::npos) << e.what();
    }
    EXPECT_EQ(mf::text::resolve_chat_format("chatml", tok, dir), ChatFormat::chatml);
    // A list of named templates: "default" is taken.
    Value cfg = Value::object();
    Value list = Value::array();
    Value tool = Value::object();
    tool.set("name", "tool_use");
    tool.set("template", "{{ bos_token }}");
    Value def = Value::object();
    def.set("name", "default");
    def.set("template", qwen3);
    list.push_back(tool);
    list.push_back(def);
    cfg.set("chat_template", list);
    mf::test::write_file(dir / "tokenizer_config.json", cfg.dump());
    tok = Tokenizer::load(dir);
    EXPECT_EQ(mf::text::resolve_chat_format("auto", tok, dir), ChatFormat::chatml_qwen3);
    // chat_template.jinja (what transformers v5 writes) wins over tokenizer_config.json.
    mf::test::write_file(dir / "chat_template.jinja", templates().at("qwen2_5"));
    EXPECT_EQ(mf::text::resolve_chat_format("auto", tok, dir), ChatFormat::chatml_qwen2_5);
    fs::remove_all(dir);
}

// --- the model's own template through the interpreter ------------------------------------------------

namespace {

fs::path families_dir() { return chat_dir() / "families"; }

mf::text::ChatTemplate family_template(const std::string& name, const Value& variables) {
    return mf::text::ChatTemplate::from_source(mf::test::read_file(families_dir() / (name + ".jinja")), variables,
                                               name + ".jinja");
}

Value conversation_of(const Value& c, bool with_generation_prompt) {
    Value conv = Value::object();
    conv.set("messages", *c.find("messages"));
    if (const Value* t = c.find("tools")) conv.set("tools", *t);
    if (with_generation_prompt && c.find("add_generation_prompt") != nullptr)
        conv.set("add_generation_prompt", *c.find("add_generation_prompt"));
    return conv;
}

std::string error_text(const std::function<void()>& f) {
    try {
        f();
    } catch (const mf::Error& e) {
        return e.what();
    }
    return "";
}

// The learned runs of a tokenisation, decoded.
std::vector<std::string> learned_runs(const Tokenizer& tok, const mf::text::TokenizedChat& tc) {
    std::vector<std::string> out;
    std::vector<int32_t> run;
    for (size_t t = 0; t <= tc.labels.size(); ++t) {
        if (t < tc.labels.size() && tc.labels[t] != -100) {
            run.push_back(tc.labels[t]);
        } else if (!run.empty()) {
            out.push_back(tok.decode(run));
            run.clear();
        }
    }
    return out;
}

}  // namespace

// Templates in the style of each family, with renderings and learned spans worked out by hand
// (tests/fixtures/chat/families/cases.json).
TEST(ChatTemplate, FamilyTemplatesRenderAsWorkedOutByHand) {
    const Value cases = mf::json::parse(mf::test::read_file(families_dir() / "cases.json"), "cases.json");
    const Tokenizer& tok = fixture_tokenizer();
    int rendered = 0, masked = 0, refused = 0;
    for (const Value& c : cases.find("cases")->as_array()) {
        const std::string name = c.find("name")->as_string();
        const Value vars = c.find("variables") != nullptr ? *c.find("variables") : Value::object();
        const mf::text::ChatTemplate t = family_template(c.find("template")->as_string(), vars);
        const Value conv = conversation_of(c, true);
        if (const Value* err = c.find("render_error")) {
            const std::string msg = error_text([&] { t.render_text(conv); });
            EXPECT_NE(msg.find(err->as_string()), std::string::npos) << name << ": " << msg;
            continue;
        }
        EXPECT_EQ(t.render_text(conv), c.find("text")->as_string()) << name;
        ++rendered;
        const Value train = conversation_of(c, false);
        if (const Value* err = c.find("mask_error")) {
            const std::string msg = error_text([&] { t.learned_spans(train); });
            EXPECT_NE(msg.find(err->as_string()), std::string::npos) << name << ": " << msg;
            EXPECT_NE(msg.find("{% generation %}"), std::string::npos) << name << ": " << msg;
            ++refused;
            continue;
        }
        const mf::text::ChatTemplate::Spans spans = t.learned_spans(train);
        std::vector<std::string> got;
        for (const auto& [b, e] : spans.learned) got.push_back(spans.text.substr(b, e - b));
        std::vector<std::string> expected;
        for (const Value& l : c.find("learned")->as_array()) expected.push_back(l.as_string());
        EXPECT_EQ(got, expected) << name;
        // Tokenised: the ids are the text's encoding, and every learned span's text is inside the
        // decoded learned tokens (whole tokens, so a run may start or end a little wider).
        const mf::text::TokenizedChat tc = mf::text::tokenize_chat(tok, t, train, LossOn::assistant);
        EXPECT_EQ(tc.input_ids, tok.encode(spans.text, false)) << name;
        const std::vector<std::string> runs = learned_runs(tok, tc);
        for (const std::string& e : expected) {
            bool inside = false;
            for (const std::string& r : runs) inside = inside || r.find(e) != std::string::npos;
            EXPECT_TRUE(inside) << name << ": learned " << e << " not among the learned tokens";
        }
        EXPECT_EQ(mf::text::tokenize_chat(tok, t, train, LossOn::all).labels, tc.input_ids) << name;
        ++masked;
    }
    EXPECT_EQ(rendered, 17);
    EXPECT_EQ(masked, 14);
    EXPECT_EQ(refused, 3);
}

// The interpreter renders a ChatML template exactly as the fast path does, masks included, on the
// 25 conversations of the transformers fixtures (with prefix spans and with generation blocks).
TEST(ChatTemplate, ChatMLTemplateMatchesTheFastPath) {
    const Tokenizer& tok = fixture_tokenizer();
    const std::vector<Value> recs = records();
    std::set<std::string> seen;
    int compared = 0;
    for (const std::string name : {"chatml", "chatml_generation"}) {
        const mf::text::ChatTemplate t = family_template(name, Value::object());
        EXPECT_EQ(t.has_generation_blocks(), name == "chatml_generation");
        for (const Value& r : recs) {
            const std::string key = r.find("messages")->dump();
            const std::vector<ChatMessage> msgs = messages_of(*r.find("messages"));
            const Value conv = mf::text::conversation_json(msgs);
            EXPECT_EQ(t.render_text(conv), mf::text::render_chat_text(msgs, ChatFormat::chatml)) << name << " " << key;
            const mf::text::TokenizedChat fast =
                mf::text::tokenize_chat(tok, msgs, ChatFormat::chatml, LossOn::assistant);
            const mf::text::TokenizedChat slow = mf::text::tokenize_chat(tok, t, conv, LossOn::assistant);
            EXPECT_EQ(slow.input_ids, fast.input_ids) << name << " " << key;
            EXPECT_EQ(slow.labels, fast.labels) << name << " " << key;
            // A prompt/completion split: the prompt's assistant turns are not learned.
            if (msgs.size() >= 3) {
                const auto fast_p = mf::text::tokenize_chat(tok, msgs, ChatFormat::chatml, LossOn::assistant, 2);
                const auto slow_p = mf::text::tokenize_chat(tok, t, conv, LossOn::assistant, 2);
                EXPECT_EQ(slow_p.labels, fast_p.labels) << name << " prompt/completion " << key;
            }
            ++compared;
        }
    }
    EXPECT_EQ(compared, 200);
}

// The Qwen templates of the transformers fixtures run through the interpreter: the same ids and
// assistant masks as HF's, wherever the prefix rule finds the spans; Qwen3's template renders an
// earlier turn differently once a later one follows, so it is refused there (never mis-masked).
TEST(ChatTemplate, QwenTemplatesThroughTheInterpreterMatchTransformersMasks) {
    const Tokenizer& tok = fixture_tokenizer();
    const std::map<std::string, std::string> tmpl = templates();
    int matched = 0, refused_qwen3 = 0, refused_first = 0;
    for (const Value& r : records()) {
        const std::string& name = r.find("template")->as_string();
        const mf::text::ChatTemplate t = mf::text::ChatTemplate::from_source(tmpl.at(name), Value::object(), name);
        Value conv = Value::object();
        conv.set("messages", *r.find("messages"));
        EXPECT_EQ(t.render_text(conv), r.find("text")->as_string()) << name;
        mf::text::TokenizedChat tc;
        try {
            tc = mf::text::tokenize_chat(tok, t, conv, LossOn::assistant);
        } catch (const mf::Error& e) {
            // Refused: Qwen3's think handling, or a conversation that opens with the assistant
            // (nothing renders before it to find its start by).
            const std::string msg = e.what();
            const bool first = msg.find("cannot find assistant message 0's span") != std::string::npos;
            EXPECT_TRUE(name == "qwen3" || first) << msg;
            EXPECT_NE(msg.find("cannot find assistant message"), std::string::npos) << msg;
            ++(first ? refused_first : refused_qwen3);
            continue;
        }
        const std::vector<int32_t> mask = ints(*r.find("assistant_masks"));
        ASSERT_EQ(tc.input_ids, ints(*r.find("input_ids"))) << name;
        for (size_t k = 0; k < mask.size(); ++k)
            EXPECT_EQ(tc.labels[k] != -100, mask[k] == 1) << name << " token " << k;
        ++matched;
    }
    std::printf(
        "Qwen fixture records through the interpreter: %d masks equal to HF's; refused: %d qwen3 (think blocks), %d "
        "opening with the assistant\n",
        matched, refused_qwen3, refused_first);
    EXPECT_EQ(matched + refused_qwen3 + refused_first, 100);
    EXPECT_LE(refused_first, 4);  // one conversation of 25, per template
    EXPECT_GE(matched, 85);
}

TEST(ChatTemplate, LoadingAndContext) {
    const fs::path dir = fs::path(::testing::TempDir()) / "moeforge_chat_template_load";
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy_file(tokenizer_dir() / "tokenizer.json", dir / "tokenizer.json");
    // Special tokens as strings and as AddedToken objects; a list of named templates.
    Value config = Value::object();
    config.set("bos_token", Value(Value::Object{{"content", "<|endoftext|>"}, {"lstrip", false}}));
    config.set("eos_token", "<|im_end|>");
    Value list = Value::array();
    list.push_back(Value(Value::Object{
        {"name", "default"}, {"template", "D{{ bos_token }}{{ eos_token }}{{ tools }}{{ documents }}{{ x }}"}}));
    list.push_back(Value(Value::Object{{"name", "tool_use"}, {"template", "T{{ tools | length }}{{ x }}"}}));
    config.set("chat_template", list);
    mf::test::write_file(dir / "tokenizer_config.json", config.dump());
    const Tokenizer tok = Tokenizer::load(dir);
    Value kwargs = Value::object();
    kwargs.set("x", "!");
    const mf::text::ChatTemplate t = mf::text::ChatTemplate::load(tok, dir, kwargs);
    Value conv = Value::object();
    conv.set("messages", Value::array());
    EXPECT_EQ(t.render_text(conv), "D<|endoftext|><|im_end|>NoneNone!");  // absent tools/documents are None
    conv.set("tools", Value(Value::Array{Value::object(), Value::object()}));
    EXPECT_EQ(t.render_text(conv), "T2!");  // tools pick the tool_use template, as HF does
    // chat_template.jinja wins over tokenizer_config.json.
    mf::test::write_file(dir / "chat_template.jinja", "J{{ messages | length }}\n");
    EXPECT_EQ(mf::text::ChatTemplate::load(tok, dir).render_text(conv), "J0");
    // Errors: kwargs that are not a mapping, a template that does not parse, a bad conversation.
    EXPECT_NE(error_text([&] { mf::text::ChatTemplate::load(tok, dir, Value(3)); }).find("data.chat_template_kwargs"),
              std::string::npos);
    mf::test::write_file(dir / "chat_template.jinja", "line 1\n{% for m in messages %}");
    EXPECT_NE(error_text([&] {
                  mf::text::ChatTemplate::load(tok, dir);
              }).find("chat_template:2:24: expected 'else' or 'endfor'"),
              std::string::npos)
        << error_text([&] { mf::text::ChatTemplate::load(tok, dir); });
    EXPECT_NE(error_text([&] { t.render_text(Value::object()); }).find("no \"messages\" array"), std::string::npos);
    fs::remove_all(dir);
}

TEST(ChatTemplate, RendererResolution) {
    const fs::path dir = fs::path(::testing::TempDir()) / "moeforge_chat_renderer";
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy_file(tokenizer_dir() / "tokenizer.json", dir / "tokenizer.json");
    mf::test::write_file(dir / "tokenizer_config.json", R"({"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})");
    // The fixture tokenizer's Qwen2 template: the fast path; jinja forces the interpreter.
    const mf::text::ChatRenderer fast = mf::text::resolve_chat_renderer("auto", fixture_tokenizer(), tokenizer_dir());
    ASSERT_TRUE(fast.format.has_value());
    EXPECT_EQ(*fast.format, ChatFormat::chatml_qwen2);
    const mf::text::ChatRenderer slow = mf::text::resolve_chat_renderer("jinja", fixture_tokenizer(), tokenizer_dir());
    ASSERT_TRUE(slow.model_template.has_value());
    const std::vector<ChatMessage> msgs = {{"user", "Hi", {}}, {"assistant", "Hello", {}}};
    const auto a = mf::text::tokenize_chat(fixture_tokenizer(), fast, msgs, LossOn::assistant);
    const auto b = mf::text::tokenize_chat(fixture_tokenizer(), slow, msgs, LossOn::assistant);
    EXPECT_EQ(a.input_ids, b.input_ids);
    EXPECT_EQ(a.labels, b.labels);
    // A template that is not ChatML: auto runs it; forcing ChatML on it is an error.
    fs::copy_file(families_dir() / "mistral_like.jinja", dir / "chat_template.jinja");
    const Tokenizer tok = Tokenizer::load(dir);
    const mf::text::ChatRenderer m = mf::text::resolve_chat_renderer("auto", tok, dir);
    ASSERT_TRUE(m.model_template.has_value());
    EXPECT_EQ(m.describe(), "the model's chat template (jinja)");
    const auto tc = mf::text::tokenize_chat(tok, m, msgs, LossOn::assistant);
    EXPECT_EQ(tc.input_ids, tok.encode("<|endoftext|>[INST] Hi[/INST] Hello<|im_end|>", false));
    EXPECT_EQ(learned_runs(tok, tc), std::vector<std::string>{" Hello<|im_end|>"});
    const std::string err = error_text([&] { mf::text::resolve_chat_renderer("chatml", tok, dir); });
    EXPECT_NE(err.find("renders conversations differently from chatml"), std::string::npos) << err;
    EXPECT_NE(err.find("at byte 2"), std::string::npos) << err;  // after "<|"
    // data.chat_template_kwargs reach the template (and always take the interpreter).
    mf::test::write_file(dir / "chat_template.jinja",
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{{ '/think' if enable_thinking is defined and enable_thinking else '' }}");
    const Tokenizer tok2 = Tokenizer::load(dir);
    Value kwargs = Value::object();
    kwargs.set("enable_thinking", true);
    const mf::text::ChatRenderer q =
        mf::text::resolve_chat_renderer("auto", fixture_tokenizer(), tokenizer_dir(), kwargs);
    ASSERT_TRUE(q.model_template.has_value());
    EXPECT_EQ(mf::text::tokenize_chat(fixture_tokenizer(), q, msgs, LossOn::assistant).labels, a.labels);
    const mf::text::ChatRenderer k = mf::text::resolve_chat_renderer("auto", tok2, dir, kwargs);
    ASSERT_TRUE(k.model_template.has_value());
    EXPECT_EQ(k.model_template->render_text(mf::text::conversation_json(msgs)),
              "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n/think");
    fs::remove_all(dir);
}

// HF-made renderings of the family templates (scripts/make_chat_fixtures.py --families on the GPU
// machine). Absent until that script has been run: the test says so and skips.
TEST(ChatTemplate, FamilyTemplatesMatchTransformersFixtures) {
    const fs::path file = chat_dir() / "families_hf.jsonl";
    if (!fs::exists(file))
        GTEST_SKIP() << file
                     << " is absent: run scripts/make_chat_fixtures.py --families on a machine with transformers";
    const Tokenizer& tok = fixture_tokenizer();
    const Value cases = mf::json::parse(mf::test::read_file(families_dir() / "cases.json"), "cases.json");
    std::map<std::string, Value> by_name;
    for (const Value& c : cases.find("cases")->as_array()) by_name[c.find("name")->as_string()] = c;
    std::istringstream in(mf::test::read_file(file));
    std::string line;
    int n = 0;
    while (std::getline(in, line)) {
        if (line.empty()) continue;
        const Value r = mf::json::parse(line, file.string());
        const std::string name = r.find("name")->as_string();
        const Value& c = by_name.at(name);
        const Value vars = c.find("variables") != nullptr ? *c.find("variables") : Value::object();
        const mf::text::ChatTemplate t = family_template(c.find("template")->as_string(), vars);
        if (const Value* err = r.find("error")) {  // HF refused to render it too
            EXPECT_NE(c.find("render_error"), nullptr) << name << ": HF: " << err->as_string();
            continue;
        }
        EXPECT_EQ(t.render_text(conversation_of(c, true)), r.find("text")->as_string()) << name;
        if (const Value* ids = r.find("train_input_ids")) {
            const Value train = conversation_of(c, false);
            // The prefix rule fails where a later message rewrites an earlier one (HF's renderings of
            // the prefixes are not prefixes of the whole): moeforge refuses exactly those.
            EXPECT_EQ(c.find("mask_error") != nullptr, r.find("prefix_refused") != nullptr) << name;
            if (c.find("mask_error") != nullptr) continue;
            const mf::text::TokenizedChat tc = mf::text::tokenize_chat(tok, t, train, LossOn::assistant);
            EXPECT_EQ(tc.input_ids, ints(*ids)) << name;
            const Value* mask = r.find("train_assistant_masks");
            if (mask == nullptr) mask = r.find("train_prefix_masks");  // TRL's prefix rule on HF's renderings
            if (mask != nullptr) {
                const std::vector<int32_t> m = ints(*mask);
                ASSERT_EQ(m.size(), tc.labels.size()) << name;
                for (size_t k = 0; k < m.size(); ++k)
                    EXPECT_EQ(tc.labels[k] != -100, m[k] == 1) << name << " token " << k;
            }
        }
        ++n;
    }
    EXPECT_GT(n, 0);
}

TEST(ChatTemplate, TokenizeChatCommand) {
    const fs::path dir = mf::test::temp_dir("chat_cli");
    const fs::path in = dir / "conv.json";
    mf::test::write_file(
        in, R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})");
    const std::string cmd =
        mf::test::moeforge_binary() + " tokenize --tokenizer " + tokenizer_dir().string() + " --chat";
    std::string out;
    out.clear();
    ASSERT_EQ(mf::test::run_command(cmd + " < " + in.string(), &out), 0) << out;
    const std::string expected =
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n";
    EXPECT_EQ(out, expected);
    out.clear();
    ASSERT_EQ(mf::test::run_command(cmd + " --json < " + in.string(), &out), 0) << out;
    const Value v = mf::json::parse(out, "tokenize --chat --json");
    EXPECT_EQ(v.find("text")->as_string(), expected);
    const std::vector<int32_t> ids = ints(*v.find("ids"));
    EXPECT_EQ(ids, fixture_tokenizer().encode(expected, false));
    const std::vector<int32_t> mask = ints(*v.find("assistant_mask"));
    ASSERT_EQ(mask.size(), ids.size());
    std::vector<int32_t> learned;
    for (size_t k = 0; k < ids.size(); ++k)
        if (mask[k] == 1) learned.push_back(ids[k]);
    EXPECT_EQ(fixture_tokenizer().decode(learned), "Hello<|im_end|>\n");
    // A generation prompt; a malformed conversation is an error naming what was expected.
    mf::test::write_file(in, R"({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": true})");
    out.clear();
    ASSERT_EQ(mf::test::run_command(cmd + " < " + in.string(), &out), 0) << out;
    EXPECT_EQ(out,
              "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\n");
    mf::test::write_file(in, R"([1, 2])");
    out.clear();
    EXPECT_NE(mf::test::run_command(cmd + " < " + in.string(), &out), 0);
    EXPECT_NE(out.find("expected a JSON object {\"messages\""), std::string::npos) << out;
    fs::remove_all(dir);
}
