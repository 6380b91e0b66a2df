// Chat formatting tests: HF parity (ids and assistant masks made by transformers'
// apply_chat_template, scripts/make_chat_fixtures.py), template recognition on the real Qwen
// templates, reformatted copies of them and templates we must refuse, Qwen3 reasoning rendering,
// loss_on, and a tokenizer whose special tokens break message-by-message encoding.
#include <gtest/gtest.h>

#include <filesystem>
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
