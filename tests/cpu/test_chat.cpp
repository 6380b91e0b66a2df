// Chat formatting tests: HF parity (texts, ids and assistant masks made by transformers'
// apply_chat_template from our own ChatML-family templates, scripts/make_chat_fixtures.py),
// recognition of the fast-path formats by probing (harmless rewrites, templates that render
// otherwise, forced formats), think-block rendering, loss_on, and a tokenizer whose special tokens
// break message-by-message encoding.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "chat_fixture_test_util.h"
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
using Kind = mf::text::ChatFormat::Kind;

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

const Value& templates_json() {
    static const Value v = mf::json::parse(mf::test::read_file(chat_dir() / "templates.json"), "templates.json");
    return v;
}

std::map<std::string, std::string> templates() {
    std::map<std::string, std::string> out;
    for (const auto& [name, t] : templates_json().find("templates")->as_object())
        out[name] = t.find("template")->as_string();
    return out;
}

// The fast-path format templates.json says a template renders as.
ChatFormat listed_format(const std::string& name) {
    const Value& t = *templates_json().find("templates")->find(name);
    ChatFormat f{mf::text::parse_chat_format(t.find("format")->as_string()), ""};
    if (const Value* d = t.find("default_system")) f.default_system = d->as_string();
    return f;
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

// The training conversations of the fixtures (system/user/assistant only).
std::vector<std::vector<ChatMessage>> conversations() {
    std::vector<std::vector<ChatMessage>> out;
    for (const Value& c : templates_json().find("conversations")->as_array()) out.push_back(messages_of(c));
    return out;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
    for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
        s.replace(at, from.size(), to);
    return s;
}

// Every newline and its indentation collapsed to one space (as some re-uploads of templates ship them).
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

// With the fixture tokenizer's special tokens, as ChatTemplate::load gives them.
std::optional<ChatFormat> detect(const std::string& source) {
    const Value vars(Value::Object{{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}});
    return mf::text::detect_chat_format(mf::text::ChatTemplate::from_source(source, vars, "t"));
}

std::string error_text(const std::function<void()>& f) {
    try {
        f();
    } catch (const mf::Error& e) {
        return e.what();
    }
    return "";
}

// A tokenizer directory with the fixture tokenizer and `chat_template` as chat_template.jinja.
fs::path template_dir(const std::string& name, const std::string& chat_template) {
    const fs::path dir = mf::test::temp_dir(name);
    fs::copy_file(tokenizer_dir() / "tokenizer.json", dir / "tokenizer.json", fs::copy_options::overwrite_existing);
    mf::test::write_file(dir / "tokenizer_config.json", R"({"eos_token": "<|im_end|>"})");
    mf::test::write_file(dir / "chat_template.jinja", chat_template);
    return dir;
}

}  // namespace

// --- HF parity ---------------------------------------------------------------------------------------

// Every record of expected.jsonl: the template is recognised by probing as the format
// templates.json lists; conversations without tools render on that fast path, with ids and masks
// equal to HF's; the others render through the interpreter with HF's text and ids.
TEST(ChatParity, IdsAndAssistantMasksMatchTransformers) {
    const std::string stale = mf::test::stale_chat_fixtures(chat_dir());
    ASSERT_TRUE(stale.empty()) << stale;
    const Tokenizer& tok = fixture_tokenizer();
    const std::map<std::string, std::string> tmpl = templates();
    const std::vector<Value> recs = records();
    ASSERT_GE(recs.size(), 100u);
    std::set<std::string> formats;
    int learned_total = 0, straddling = 0, fast = 0, interpreted = 0;
    for (size_t i = 0; i < recs.size(); ++i) {
        const Value& r = recs[i];
        const std::string& name = r.find("template")->as_string();
        const std::string where = "record " + std::to_string(i) + " (" + name + ")";
        const ChatFormat format = listed_format(name);
        EXPECT_EQ(r.find("format")->as_string(), mf::text::chat_format_name(format.kind)) << where;
        formats.insert(r.find("format")->as_string());
        const Value* variables = r.find("variables");
        const mf::text::ChatTemplate t = mf::text::ChatTemplate::from_source(
            tmpl.at(name), variables != nullptr ? *variables : Value::object(), name);
        const std::optional<ChatFormat> detected = mf::text::detect_chat_format(t);
        const bool agp = r.find("add_generation_prompt") != nullptr && r.find("add_generation_prompt")->as_bool();
        const bool has_variables = variables != nullptr && variables->size() > 0;
        if (!has_variables) {
            ASSERT_TRUE(detected.has_value()) << where << ": not recognised by probing";
            EXPECT_EQ(*detected, format) << where;
        }
        const std::string& text = r.find("text")->as_string();
        const std::vector<int32_t> ids = ints(*r.find("input_ids"));
        ASSERT_EQ(tok.encode(text, false), ids) << where << ": the tokenizer itself differs from HF";

        Value conv = Value::object();
        conv.set("messages", *r.find("messages"));
        if (const Value* tools = r.find("tools")) conv.set("tools", *tools);
        conv.set("add_generation_prompt", agp);
        EXPECT_EQ(t.render_text(conv), text) << where << ": the interpreter";
        if (r.find("tools") != nullptr || has_variables) {  // only the model's template renders these
            ++interpreted;
            continue;
        }
        const std::vector<ChatMessage> msgs = messages_of(*r.find("messages"));
        EXPECT_EQ(mf::text::render_chat_text(msgs, format, agp), text) << where;
        ++fast;
        if (agp) continue;
        const std::vector<int32_t> mask = ints(*r.find("assistant_masks"));
        const mf::text::TokenizedChat tc = mf::text::tokenize_chat(tok, msgs, format, LossOn::assistant);
        ASSERT_EQ(tc.input_ids, ids) << where;
        ASSERT_EQ(tc.labels.size(), ids.size()) << where;
        for (size_t k = 0; k < ids.size(); ++k) {
            EXPECT_EQ(tc.labels[k] != -100, mask[k] == 1) << where << " token " << k;
            if (tc.labels[k] != -100) {
                EXPECT_EQ(tc.labels[k], ids[k]);
            }
            learned_total += mask[k];
        }
        // Content opening with a newline: HF's mask starts at a token that holds the header's "\n".
        for (const ChatMessage& m : msgs)
            if (m.role == "assistant" && !m.content.empty() && m.content[0] == '\n') ++straddling;
        const mf::text::TokenizedChat all = mf::text::tokenize_chat(tok, msgs, format, LossOn::all);
        EXPECT_EQ(all.input_ids, ids) << where;
        EXPECT_EQ(all.labels, ids) << where;
    }
    EXPECT_EQ(formats, (std::set<std::string>{"chatml", "chatml_system", "chatml_think"}));
    EXPECT_GT(learned_total, 500);
    EXPECT_GT(straddling, 0);
    EXPECT_GE(fast, 100);
    EXPECT_GT(interpreted, 0);
}

TEST(ChatParity, LearnedTokensAreTheAssistantTurnAfterItsHeader) {
    // Independent of the fixture: the learned ids decode to the content, <|im_end|> and "\n".
    const Tokenizer& tok = fixture_tokenizer();
    const std::vector<ChatMessage> msgs = {{"user", "Capital of Kazakhstan?", {}},
                                           {"assistant", "Astana.", {}},
                                           {"user", "And of France?", {}},
                                           {"assistant", "Paris.", {}}};
    for (const ChatFormat& f : {ChatFormat{}, ChatFormat{Kind::chatml_system, "Be kind."}}) {
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
        ASSERT_EQ(runs.size(), 2u) << mf::text::chat_format_name(f.kind);
        EXPECT_EQ(tok.decode(runs[0]), "Astana.<|im_end|>\n");
        EXPECT_EQ(tok.decode(runs[1]), "Paris.<|im_end|>\n");
    }
}

// --- rendering -----------------------------------------------------------------------------------------

TEST(ChatRender, DefaultSystemMessages) {
    const std::vector<ChatMessage> msgs = {{"user", "Hi", {}}, {"assistant", "Hello", {}}};
    const std::string turns = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n";
    const ChatFormat system{Kind::chatml_system, "Sé breve."};
    EXPECT_EQ(mf::text::render_chat_text(msgs, ChatFormat{}), turns);
    EXPECT_EQ(mf::text::render_chat_text(msgs, system), "<|im_start|>system\nSé breve.<|im_end|>\n" + turns);
    // chatml_think: no default system message, and the last assistant turn gets an empty think block.
    EXPECT_EQ(mf::text::render_chat_text(msgs, ChatFormat{Kind::chatml_think, ""}),
              "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n");
    // A system message of its own replaces the default; the generation prompt opens an assistant turn.
    const std::vector<ChatMessage> with_sys = {{"system", "Be brief.", {}}, {"user", "Hi", {}}};
    EXPECT_EQ(mf::text::render_chat_text(with_sys, system, true),
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatRender, ThinkBlocks) {
    const ChatFormat think{Kind::chatml_think, ""};
    // Earlier turns lose their reasoning; the last keeps it; reasoning_content wins over the content.
    const std::vector<ChatMessage> msgs = {{"user", "Q1", {}},
                                           {"assistant", "<think>\nr1\n</think>\n\nA1", {}},
                                           {"user", "Q2", {}},
                                           {"assistant", "\n<think>r2</think>A2", {}}};
    EXPECT_EQ(mf::text::render_chat_text(msgs, think),
              "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
              "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n");
    const std::vector<ChatMessage> field = {{"user", "Q", {}}, {"assistant", "A </think> B", std::string("\nR\n")}};
    EXPECT_EQ(mf::text::render_chat_text(field, think),
              "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR\n</think>\n\nA </think> B<|im_end|>\n");
    // Two assistant turns after the last query: the first only gets a block if it has reasoning.
    const std::vector<ChatMessage> two = {{"user", "Q", {}}, {"assistant", "A", {}}, {"assistant", "B", {}}};
    EXPECT_EQ(mf::text::render_chat_text(two, think),
              "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n");
    // Other formats leave <think> text alone.
    EXPECT_EQ(mf::text::render_chat_text({{"assistant", "<think>x</think>y", {}}}, ChatFormat{}),
              "<|im_start|>assistant\n<think>x</think>y<|im_end|>\n");
}

TEST(ChatRender, ThinkBlockIsLearned) {
    const Tokenizer& tok = fixture_tokenizer();
    const std::vector<ChatMessage> msgs = {{"user", "Q", {}}, {"assistant", "<think>why</think>A", {}}};
    const mf::text::TokenizedChat tc =
        mf::text::tokenize_chat(tok, msgs, ChatFormat{Kind::chatml_think, ""}, LossOn::assistant);
    std::vector<int32_t> learned;
    for (int32_t l : tc.labels)
        if (l != -100) learned.push_back(l);
    EXPECT_EQ(tok.decode(learned), "<think>\nwhy\n</think>\n\nA<|im_end|>\n");
}

TEST(ChatRender, FirstLearnableAndLossOnAll) {
    const Tokenizer& tok = fixture_tokenizer();
    const std::vector<ChatMessage> msgs = {
        {"user", "2+2?", {}}, {"assistant", "4", {}}, {"user", "3+3?", {}}, {"assistant", "6", {}}};
    const auto all_turns = mf::text::tokenize_chat(tok, msgs, ChatFormat{}, LossOn::assistant, 0);
    const auto last_turn = mf::text::tokenize_chat(tok, msgs, ChatFormat{}, LossOn::assistant, 2);
    EXPECT_EQ(all_turns.input_ids, last_turn.input_ids);
    std::vector<int32_t> learned;
    for (int32_t l : last_turn.labels)
        if (l != -100) learned.push_back(l);
    EXPECT_EQ(tok.decode(learned), "6<|im_end|>\n");
    const auto all = mf::text::tokenize_chat(tok, msgs, ChatFormat{}, LossOn::all, 2);
    EXPECT_EQ(all.labels, all.input_ids);
}

TEST(ChatRender, UnknownRoleAndNames) {
    EXPECT_THROW(mf::text::render_chat({{"tool", "x", {}}}, ChatFormat{}, LossOn::assistant), mf::Error);
    EXPECT_EQ(mf::text::parse_chat_format("chatml_system"), Kind::chatml_system);
    for (Kind k : {Kind::chatml, Kind::chatml_system, Kind::chatml_think})
        EXPECT_EQ(mf::text::parse_chat_format(mf::text::chat_format_name(k)), k);
    // The former names still parse, to what they meant.
    EXPECT_EQ(mf::text::parse_chat_format("chatml_qwen2"), Kind::chatml_system);
    EXPECT_EQ(mf::text::parse_chat_format("chatml_qwen2_5"), Kind::chatml_system);
    EXPECT_EQ(mf::text::parse_chat_format("chatml_qwen3"), Kind::chatml_think);
    const std::string err = error_text([] { mf::text::parse_chat_format("chatml_qwen4"); });
    EXPECT_NE(err.find("chatml_think"), std::string::npos) << err;
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
    const std::string err = error_text([&] { mf::text::tokenize_chat(tok, msgs, ChatFormat{}, LossOn::assistant); });
    EXPECT_NE(err.find("message by message"), std::string::npos) << err;
}

// --- recognition by probing ------------------------------------------------------------------------------

TEST(ChatDetect, OurTemplatesAndHarmlessRewrites) {
    const std::map<std::string, std::string> t = templates();
    ASSERT_EQ(t.size(), 4u);
    for (const auto& [name, s] : t) {
        const ChatFormat format = listed_format(name);
        EXPECT_EQ(detect(s), format) << name;
        // Layout, quoting and subscript style do not change what renders.
        EXPECT_EQ(detect(collapse_layout(s)), format) << name << " collapsed";
        EXPECT_EQ(detect(replace_all(s, "m.role", "m['role']")), format) << name;
        EXPECT_EQ(detect(s + "\n"), format) << name << " trailing newline";
        // TRL-style {% generation %} markers render nothing.
        EXPECT_EQ(detect(replace_all(s, "'<|im_end|>\\n' }}", "'<|im_end|>\\n' }}{% generation %}{% endgeneration %}")),
                  format)
            << name << " generation blocks";
        // A generation prompt of its own (an always-open think block, say) is not the fast path's.
        EXPECT_EQ(detect(replace_all(s, "{%- if add_generation_prompt %}",
                                     "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
                                     "{%- elif false %}")),
                  std::nullopt)
            << name << " generation prompt";
    }
    // Beyond the probes: the interpreter renders every training conversation of the fixtures as the
    // fast path does.
    for (const auto& [name, s] : t) {
        const mf::text::ChatTemplate tmpl = mf::text::ChatTemplate::from_source(s, Value::object(), name);
        for (const std::vector<ChatMessage>& msgs : conversations())
            EXPECT_EQ(tmpl.render_text(mf::text::conversation_json(msgs)),
                      mf::text::render_chat_text(msgs, listed_format(name)))
                << name << " " << mf::text::conversation_json(msgs).dump();
    }
    // The default system message is read off the rendering, whatever its text.
    const std::string oneliner = t.at("tokenizer_default");
    EXPECT_EQ(detect(replace_all(oneliner, "You are a helpful assistant.", "Ты — пират. 🏴‍☠️")),
              (ChatFormat{Kind::chatml_system, "Ты — пират. 🏴‍☠️"}));
    EXPECT_EQ(detect(replace_all(oneliner, "You are a helpful assistant.", "")), (ChatFormat{Kind::chatml_system, ""}));
}

// Templates that render a probe otherwise are not the fast path's (auto runs them through the
// interpreter), and forcing a format on them names the file, the format and the probe.
TEST(ChatDetect, TemplatesThatRenderOtherwise) {
    const std::map<std::string, std::string> t = templates();
    const std::string plain = t.at("chatml_tools"), think = t.at("hybrid_think"), oneliner = t.at("tokenizer_default");
    struct Case {
        std::string name, tmpl, forced, probe;
    };
    const std::vector<Case> cases = {
        {"llama3",
         "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + "
         "'<|eot_id|>' }}{% endfor %}",
         "chatml", "a question and its answer, no system message"},
        {"trimmed content",
         replace_all(plain, "'\\n' ~ text ~ '<|im_end|>\\n'", "'\\n' ~ text | trim ~ '<|im_end|>\\n'"), "chatml",
         "empty and newline-only content"},
        {"eos token", plain + "{{ eos_token }}", "chatml", "a question and its answer, no system message"},
        {"text outside tags", "Hello " + oneliner, "chatml_system", "a question and its answer, no system message"},
        {"a newline after each message", replace_all(oneliner, "{%- endfor %}", "\n{% endfor %}"), "chatml_system",
         "a question and its answer, no system message"},
        {"always-think", replace_all(think, "loop.index0 > seen.query and ", ""), "chatml_think",
         "the assistant first"},
        {"no tool-response rule", replace_all(think, "and not is_result", ""), "chatml_think",
         "answers after a tool-response-looking user turn"},
        {"roles rendered another way", replace_all(plain, "'<|im_start|>' ~ m.role ~ '\\n'", "m.role ~ ': '"), "chatml",
         "a question and its answer, no system message"},
        {"a system message refused later on",
         replace_all(plain, "{%- elif not (loop.first and m.role == 'system') %}",
                     "{%- elif m.role == 'system' and not loop.first %}{{ raise_exception('system later') }}"
                     "{%- elif not (loop.first and m.role == 'system') %}"),
         "chatml", "fails on the probe conversation 'a system message after the first turn'"},
    };
    for (const Case& c : cases) {
        EXPECT_EQ(detect(c.tmpl), std::nullopt) << c.name << " was taken for a fast-path format";
        const fs::path dir = template_dir("chat_detect_otherwise", c.tmpl);
        const Tokenizer tok = Tokenizer::load(dir);
        const std::string err = error_text([&] { mf::text::resolve_chat_renderer(c.forced, tok, dir); });
        EXPECT_NE(err.find((dir / "chat_template.jinja").string()), std::string::npos) << c.name << ": " << err;
        EXPECT_NE(err.find("differently from " + c.forced), std::string::npos) << c.name << ": " << err;
        EXPECT_NE(err.find(c.probe), std::string::npos) << c.name << ": " << err;
        EXPECT_NE(err.find("use auto"), std::string::npos) << c.name << ": " << err;
        const mf::text::ChatRenderer r = mf::text::resolve_chat_renderer("auto", tok, dir);
        EXPECT_FALSE(r.format.has_value()) << c.name;
        EXPECT_TRUE(r.model_template.has_value()) << c.name;
        fs::remove_all(dir);
    }
    // The error shows both renderings from where they part.
    const fs::path dir = template_dir("chat_detect_excerpt", oneliner);
    const Tokenizer tok = Tokenizer::load(dir);
    const std::string err = error_text([&] { mf::text::resolve_chat_renderer("chatml_think", tok, dir); });
    EXPECT_NE(err.find("the template renders \"<|im_start|>system\\nYou are a helpful assistant."), std::string::npos)
        << err;
    EXPECT_NE(err.find("where chatml_think writes \"<|im_start|>user\\nHi<|im_end|>"), std::string::npos) << err;
    fs::remove_all(dir);
}

TEST(ChatDetect, FixtureTokenizerAndForcedFormats) {
    // The fixture tokenizer's own template: chatml_system with its default system message.
    const mf::text::ChatRenderer r = mf::text::resolve_chat_renderer("auto", fixture_tokenizer(), tokenizer_dir());
    ASSERT_TRUE(r.format.has_value());
    EXPECT_EQ(*r.format, (ChatFormat{Kind::chatml_system, "You are a helpful assistant."}));
    EXPECT_EQ(r.describe(), "chatml_system");
    const mf::text::ChatRenderer forced =
        mf::text::resolve_chat_renderer("chatml_system", fixture_tokenizer(), tokenizer_dir());
    EXPECT_EQ(forced.format, r.format);
    for (const char* other : {"chatml", "chatml_think"}) {
        const std::string err =
            error_text([&] { mf::text::resolve_chat_renderer(other, fixture_tokenizer(), tokenizer_dir()); });
        EXPECT_NE(err.find((tokenizer_dir() / "tokenizer_config.json").string()), std::string::npos) << err;
        EXPECT_NE(err.find(std::string("renders conversations differently from ") + other), std::string::npos) << err;
    }
}

TEST(ChatDetect, TemplateSources) {
    const fs::path dir = mf::test::temp_dir("chat_sources");
    fs::copy_file(tokenizer_dir() / "tokenizer.json", dir / "tokenizer.json");
    // No template anywhere: auto is an error, chatml and chatml_think are fine, chatml_system has
    // no default system message to write.
    mf::test::write_file(dir / "tokenizer_config.json", R"({"eos_token": "<|im_end|>"})");
    Tokenizer tok = Tokenizer::load(dir);
    EXPECT_FALSE(mf::text::find_chat_template(tok, dir).has_value());
    EXPECT_NE(error_text([&] { mf::text::resolve_chat_renderer("auto", tok, dir); }).find("no chat_template"),
              std::string::npos);
    EXPECT_EQ(mf::text::resolve_chat_renderer("chatml", tok, dir).format, ChatFormat{});
    EXPECT_EQ(mf::text::resolve_chat_renderer("chatml_think", tok, dir).format, (ChatFormat{Kind::chatml_think, ""}));
    EXPECT_NE(error_text([&] {
                  mf::text::resolve_chat_renderer("chatml_system", tok, dir);
              }).find("chatml_system writes the default system message of the model's chat template"),
              std::string::npos);
    // A list of named templates: "default" is taken.
    Value cfg = Value::object();
    Value list = Value::array();
    list.push_back(Value(Value::Object{{"name", "tool_use"}, {"template", "{{ bos_token }}"}}));
    list.push_back(Value(Value::Object{{"name", "default"}, {"template", templates().at("hybrid_think")}}));
    cfg.set("chat_template", list);
    mf::test::write_file(dir / "tokenizer_config.json", cfg.dump());
    tok = Tokenizer::load(dir);
    EXPECT_EQ(mf::text::resolve_chat_renderer("auto", tok, dir).format, (ChatFormat{Kind::chatml_think, ""}));
    // chat_template.jinja (what transformers v5 writes) wins over tokenizer_config.json.
    mf::test::write_file(dir / "chat_template.jinja", templates().at("system_default"));
    EXPECT_EQ(mf::text::resolve_chat_renderer("auto", tok, dir).format, listed_format("system_default"));
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
// 25 training conversations of the fixtures (with prefix spans and with generation blocks).
TEST(ChatTemplate, ChatMLTemplateMatchesTheFastPath) {
    const Tokenizer& tok = fixture_tokenizer();
    int compared = 0;
    for (const std::string name : {"chatml", "chatml_generation"}) {
        const mf::text::ChatTemplate t = family_template(name, Value::object());
        EXPECT_EQ(t.has_generation_blocks(), name == "chatml_generation");
        EXPECT_EQ(mf::text::detect_chat_format(t), ChatFormat{}) << name;
        for (const std::vector<ChatMessage>& msgs : conversations()) {
            const Value conv = mf::text::conversation_json(msgs);
            const std::string key = conv.dump();
            EXPECT_EQ(t.render_text(conv), mf::text::render_chat_text(msgs, ChatFormat{})) << name << " " << key;
            const mf::text::TokenizedChat fast = mf::text::tokenize_chat(tok, msgs, ChatFormat{}, LossOn::assistant);
            const mf::text::TokenizedChat slow = mf::text::tokenize_chat(tok, t, conv, LossOn::assistant);
            EXPECT_EQ(slow.input_ids, fast.input_ids) << name << " " << key;
            EXPECT_EQ(slow.labels, fast.labels) << name << " " << key;
            // A prompt/completion split: the prompt's assistant turns are not learned.
            if (msgs.size() >= 3) {
                const auto fast_p = mf::text::tokenize_chat(tok, msgs, ChatFormat{}, LossOn::assistant, 2);
                const auto slow_p = mf::text::tokenize_chat(tok, t, conv, LossOn::assistant, 2);
                EXPECT_EQ(slow_p.labels, fast_p.labels) << name << " prompt/completion " << key;
            }
            ++compared;
        }
    }
    EXPECT_EQ(compared, 50);
}

// Our templates of the transformers fixtures through the interpreter: the same ids and assistant
// masks as HF's wherever the prefix rule finds the spans; hybrid_think renders an earlier turn
// differently once a later one follows, so it is refused there (never mis-masked), and so is a
// conversation that opens with the assistant (nothing renders before it to find its start by).
TEST(ChatTemplate, OurTemplatesThroughTheInterpreterMatchTransformersMasks) {
    const std::string stale = mf::test::stale_chat_fixtures(chat_dir());
    ASSERT_TRUE(stale.empty()) << stale;
    const Tokenizer& tok = fixture_tokenizer();
    const std::map<std::string, std::string> tmpl = templates();
    int matched = 0, refused_think = 0, refused_first = 0;
    for (const Value& r : records()) {
        if (r.find("assistant_masks") == nullptr) continue;  // a generation prompt
        const std::string& name = r.find("template")->as_string();
        const mf::text::ChatTemplate t = mf::text::ChatTemplate::from_source(tmpl.at(name), Value::object(), name);
        Value conv = Value::object();
        conv.set("messages", *r.find("messages"));
        if (const Value* tools = r.find("tools")) conv.set("tools", *tools);
        EXPECT_EQ(t.render_text(conv), r.find("text")->as_string()) << name;
        mf::text::TokenizedChat tc;
        try {
            tc = mf::text::tokenize_chat(tok, t, conv, LossOn::assistant);
        } catch (const mf::Error& e) {
            const std::string msg = e.what();
            const bool first = msg.find("cannot find assistant message 0's span") != std::string::npos;
            EXPECT_TRUE(name == "hybrid_think" || first) << msg;
            EXPECT_NE(msg.find("cannot find assistant message"), std::string::npos) << msg;
            ++(first ? refused_first : refused_think);
            continue;
        }
        const std::vector<int32_t> mask = ints(*r.find("assistant_masks"));
        ASSERT_EQ(tc.input_ids, ints(*r.find("input_ids"))) << name;
        for (size_t k = 0; k < mask.size(); ++k)
            EXPECT_EQ(tc.labels[k] != -100, mask[k] == 1) << name << " token " << k;
        ++matched;
    }
    std::printf(
        "fixture records through the interpreter: %d masks equal to HF's; refused: %d hybrid_think (think blocks), %d "
        "opening with the assistant\n",
        matched, refused_think, refused_first);
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
    // The fixture tokenizer's template: the fast path; jinja forces the interpreter.
    const mf::text::ChatRenderer fast = mf::text::resolve_chat_renderer("auto", fixture_tokenizer(), tokenizer_dir());
    ASSERT_TRUE(fast.format.has_value());
    EXPECT_EQ(fast.format->kind, Kind::chatml_system);
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
    // data.chat_template_kwargs reach the template: the probes render with them, so a template they
    // change takes the interpreter, and one they do not change keeps the fast path.
    mf::test::write_file(dir / "chat_template.jinja",
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{{ '/think' if enable_thinking is defined and enable_thinking else '' }}");
    const Tokenizer tok2 = Tokenizer::load(dir);
    Value kwargs = Value::object();
    kwargs.set("enable_thinking", true);
    const mf::text::ChatRenderer q =
        mf::text::resolve_chat_renderer("auto", fixture_tokenizer(), tokenizer_dir(), kwargs);
    ASSERT_TRUE(q.model_template.has_value());
    EXPECT_TRUE(q.format.has_value());
    EXPECT_EQ(mf::text::tokenize_chat(fixture_tokenizer(), q, msgs, LossOn::assistant).labels, a.labels);
    const mf::text::ChatRenderer k = mf::text::resolve_chat_renderer("auto", tok2, dir, kwargs);
    ASSERT_TRUE(k.model_template.has_value());
    EXPECT_FALSE(k.format.has_value());
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
