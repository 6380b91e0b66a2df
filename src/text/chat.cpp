// Chat formats: the ChatML fast path (rendering and tokenisation with a loss mask), the model's own
// template through the interpreter, and the choice between them by rendering probe conversations
// (see chat.h).
#include "text/chat.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "core/check.h"
#include "core/json.h"

namespace mf::text {

namespace {

constexpr int32_t kIgnoreLabel = -100;  // data::kIgnoreIndex (text/ does not include data/)
constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kGenerationPrompt = "<|im_start|>assistant\n";

// --- rendering helpers (the Python str methods the hybrid-thinking layout is defined by) --------------

std::string_view strip_newlines_left(std::string_view s) {
    while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
    return s;
}
std::string_view strip_newlines_right(std::string_view s) {
    while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
    return s;
}
std::string_view before_first(std::string_view s, std::string_view sep) {  // s.split(sep)[0]
    const size_t at = s.find(sep);
    return at == std::string_view::npos ? s : s.substr(0, at);
}
std::string_view after_last(std::string_view s, std::string_view sep) {  // s.split(sep)[-1]
    const size_t at = s.rfind(sep);
    return at == std::string_view::npos ? s : s.substr(at + sep.size());
}

bool is_tool_response(std::string_view s) {
    constexpr std::string_view open = "<tool_response>", close = "</tool_response>";
    return s.size() >= open.size() && s.substr(0, open.size()) == open && s.size() >= close.size() &&
           s.substr(s.size() - close.size()) == close;
}

struct FormatName {
    ChatFormat::Kind kind;
    const char* name;
};
constexpr FormatName kFormatNames[] = {{ChatFormat::Kind::chatml, "chatml"},
                                       {ChatFormat::Kind::chatml_system, "chatml_system"},
                                       {ChatFormat::Kind::chatml_think, "chatml_think"}};
// The names recipes used before the formats were recognised by rendering (still accepted: each meant
// what its new name does, the default system text now read off the model's template).
constexpr FormatName kFormerNames[] = {{ChatFormat::Kind::chatml_system, "chatml_qwen2"},
                                       {ChatFormat::Kind::chatml_system, "chatml_qwen2_5"},
                                       {ChatFormat::Kind::chatml_think, "chatml_qwen3"}};

}  // namespace

// --- names -------------------------------------------------------------------------------------------

ChatFormat::Kind parse_chat_format(std::string_view name) {
    for (const FormatName& f : kFormatNames)
        if (name == f.name) return f.kind;
    for (const FormatName& f : kFormerNames)
        if (name == f.name) return f.kind;
    fail("unknown chat format ", json::quote(name), " (expected auto, jinja, chatml, chatml_system or chatml_think)");
}

const char* chat_format_name(ChatFormat::Kind kind) {
    for (const FormatName& f : kFormatNames)
        if (kind == f.kind) return f.name;
    return "?";
}

LossOn parse_loss_on(std::string_view name) {
    if (name == "assistant") return LossOn::assistant;
    if (name == "all") return LossOn::all;
    fail("unknown loss_on ", json::quote(name), " (expected assistant or all)");
}

const char* loss_on_name(LossOn loss_on) { return loss_on == LossOn::all ? "all" : "assistant"; }

// --- template sources ----------------------------------------------------------------------------------

std::optional<std::string> find_chat_template(const Tokenizer& tokenizer, const std::filesystem::path& tokenizer_dir) {
    if (!tokenizer_dir.empty()) {
        const std::filesystem::path dir =
            std::filesystem::is_directory(tokenizer_dir) ? tokenizer_dir : tokenizer_dir.parent_path();
        const std::filesystem::path file = dir / "chat_template.jinja";
        if (std::filesystem::exists(file)) {
            std::ifstream in(file, std::ios::binary);
            if (!in) fail(file.string(), ": cannot open");
            std::ostringstream ss;
            ss << in.rdbuf();
            return ss.str();
        }
    }
    const json::Value& config = tokenizer.config();
    if (!config.is_object()) return std::nullopt;
    const json::Value* t = config.find("chat_template");
    if (t == nullptr || t->is_null()) return std::nullopt;
    if (t->is_string()) return t->as_string();
    if (t->is_array()) {
        for (const json::Value& e : t->as_array()) {
            const json::Value* name = e.is_object() ? e.find("name") : nullptr;
            const json::Value* body = e.is_object() ? e.find("template") : nullptr;
            if (name != nullptr && name->is_string() && name->as_string() == "default" && body != nullptr &&
                body->is_string())
                return body->as_string();
        }
        fail(
            "tokenizer_config.json: chat_template is a list without a {\"name\": \"default\", \"template\": ...} "
            "entry");
    }
    fail("tokenizer_config.json: chat_template is ", t->dump().substr(0, 40), ", expected a string");
}

// --- rendering ---------------------------------------------------------------------------------------

namespace {

// An assistant turn's body in chatml_think: the think block after the last query, reasoning dropped before it.
std::string think_body(const ChatMessage& m, bool after_last_query, bool is_last) {
    std::string_view content = m.content;
    std::string_view reasoning;
    if (m.reasoning_content) {
        reasoning = *m.reasoning_content;
    } else if (content.find("</think>") != std::string_view::npos) {
        reasoning = strip_newlines_left(after_last(strip_newlines_right(before_first(content, "</think>")), "<think>"));
        content = strip_newlines_left(after_last(content, "</think>"));
    }
    if (!after_last_query || (!is_last && reasoning.empty())) return std::string(content);
    std::string body = "<think>\n";
    body += strip_newlines_right(strip_newlines_left(reasoning));
    body += "\n</think>\n\n";
    body += strip_newlines_left(content);
    return body;
}

}  // namespace

std::vector<RenderedMessage> render_chat(const std::vector<ChatMessage>& messages, const ChatFormat& format,
                                         LossOn loss_on, size_t first_learnable) {
    std::vector<RenderedMessage> out;
    out.reserve(messages.size() + 1);
    const bool all = loss_on == LossOn::all;
    if (format.kind == ChatFormat::Kind::chatml_system && (messages.empty() || messages[0].role != "system"))
        out.push_back({std::string(kImStart) + "system\n", format.default_system + std::string(kImEnd) + "\n", all});
    // chatml_think: the last user message that is not a tool response (the last message when none is).
    size_t last_query = messages.empty() ? 0 : messages.size() - 1;
    for (size_t i = messages.size(); i-- > 0;) {
        if (messages[i].role == "user" && !is_tool_response(messages[i].content)) {
            last_query = i;
            break;
        }
    }
    for (size_t i = 0; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role != "system" && m.role != "user" && m.role != "assistant")
            fail("message ", i, ": role ", json::quote(m.role),
                 " is not supported (expected system, user or assistant)");
        RenderedMessage r;
        r.header = std::string(kImStart) + m.role + "\n";
        if (format.kind == ChatFormat::Kind::chatml_think && m.role == "assistant")
            r.body = think_body(m, i > last_query, i + 1 == messages.size());
        else
            r.body = m.content;
        r.body += kImEnd;
        r.body += "\n";
        r.learned = all || (m.role == "assistant" && i >= first_learnable);
        out.push_back(std::move(r));
    }
    return out;
}

std::string render_chat_text(const std::vector<ChatMessage>& messages, const ChatFormat& format,
                             bool add_generation_prompt) {
    std::string text;
    for (const RenderedMessage& r : render_chat(messages, format, LossOn::assistant)) text += r.header + r.body;
    if (add_generation_prompt) text += kGenerationPrompt;
    return text;
}

TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                            const ChatFormat& format, LossOn loss_on, size_t first_learnable) {
    TokenizedChat out;
    std::string full;
    for (const RenderedMessage& r : render_chat(messages, format, loss_on, first_learnable)) {
        const std::string text = r.header + r.body;
        full += text;
        const std::vector<int32_t> ids = tokenizer.encode(text, false);
        size_t learned_from = ids.size();
        if (loss_on == LossOn::all) {
            learned_from = 0;
        } else if (r.learned) {
            // Tokens shared with the header's own encoding lie inside the header; the first one that
            // differs holds the first byte of the body (or straddles into it) and is learned.
            const std::vector<int32_t> head = tokenizer.encode(r.header, false);
            learned_from = 0;
            while (learned_from < head.size() && learned_from < ids.size() && head[learned_from] == ids[learned_from])
                ++learned_from;
        }
        for (size_t t = 0; t < ids.size(); ++t) {
            out.input_ids.push_back(ids[t]);
            out.labels.push_back(t >= learned_from ? ids[t] : kIgnoreLabel);
        }
    }
    if (tokenizer.encode(full, false) != out.input_ids)
        fail(
            "the tokenizer encodes this conversation differently as a whole than message by message (do its special "
            "tokens strip neighbouring whitespace?), so the loss mask cannot be placed exactly");
    return out;
}

}  // namespace mf::text

// --- the model's own template --------------------------------------------------------------------------

namespace mf::text {

namespace {

constexpr const char* kSpecialTokenKeys[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                             "pad_token", "cls_token", "mask_token"};

// A special token from tokenizer_config.json: a string, or an AddedToken object {"content": ...}.
std::optional<std::string> special_token_text(const json::Value& v, const char* key) {
    if (v.is_string()) return v.as_string();
    if (v.is_object()) {
        const json::Value* c = v.find("content");
        if (c != nullptr && c->is_string()) return c->as_string();
        fail("tokenizer_config.json: ", key, " is an object without a string \"content\"");
    }
    if (v.is_null()) return std::nullopt;
    fail("tokenizer_config.json: ", key, " is ", json::kind_name(v.kind()),
         ", expected a string or {\"content\": ...}");
}

// The named templates of tokenizer_config.json's list form, or the single template.
struct TemplateTexts {
    std::string default_text;
    std::optional<std::string> tool_use;
    std::string where;
};

std::optional<TemplateTexts> find_template_texts(const Tokenizer& tokenizer, const std::filesystem::path& dir) {
    const std::optional<std::string> main = find_chat_template(tokenizer, dir);  // .jinja, string or "default"
    if (!main) return std::nullopt;
    TemplateTexts t;
    t.default_text = *main;
    t.where = dir.empty() ? std::string("tokenizer") : dir.string();
    const json::Value& config = tokenizer.config();
    const json::Value* list = config.is_object() ? config.find("chat_template") : nullptr;
    const bool from_file =
        !dir.empty() &&
        std::filesystem::exists((std::filesystem::is_directory(dir) ? dir : dir.parent_path()) / "chat_template.jinja");
    if (list != nullptr && list->is_array() && !from_file)
        for (const json::Value& e : list->as_array()) {
            const json::Value* name = e.is_object() ? e.find("name") : nullptr;
            const json::Value* body = e.is_object() ? e.find("template") : nullptr;
            if (name != nullptr && name->is_string() && name->as_string() == "tool_use" && body != nullptr &&
                body->is_string())
                t.tool_use = body->as_string();
        }
    return t;
}

// Byte offset -> token index maps for a text cut at `boundaries`: the number of tokens of the
// whole encoding that lie entirely before each boundary, or, for a boundary inside a token, the
// index of that token (flagged). Segments are encoded on their own first (exact when their
// concatenation is the whole encoding, the usual case); otherwise each boundary's prefix is
// encoded and compared with the whole encoding.
struct Boundary {
    size_t tokens_before = 0;
    bool inside_token = false;
};

std::vector<Boundary> locate_boundaries(const Tokenizer& tok, const std::string& text, const std::vector<int32_t>& ids,
                                        const std::vector<size_t>& boundaries) {
    std::vector<size_t> cuts(boundaries);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<size_t> counts;
    std::vector<int32_t> joined;
    size_t prev = 0;
    for (const size_t c : cuts) {
        const std::vector<int32_t> part = tok.encode(std::string_view(text).substr(prev, c - prev), false);
        joined.insert(joined.end(), part.begin(), part.end());
        counts.push_back(joined.size());
        prev = c;
    }
    const std::vector<int32_t> tail = tok.encode(std::string_view(text).substr(prev), false);
    joined.insert(joined.end(), tail.begin(), tail.end());
    std::vector<Boundary> out;
    out.reserve(boundaries.size());
    const bool exact = joined == ids;
    for (const size_t b : boundaries) {
        const size_t k = static_cast<size_t>(std::lower_bound(cuts.begin(), cuts.end(), b) - cuts.begin());
        if (exact) {
            out.push_back({counts[k], false});
            continue;
        }
        const std::vector<int32_t> prefix = tok.encode(std::string_view(text).substr(0, b), false);
        size_t n = 0;
        while (n < prefix.size() && n < ids.size() && prefix[n] == ids[n]) ++n;
        out.push_back({n, n != prefix.size()});
    }
    return out;
}

}  // namespace

ChatTemplate ChatTemplate::from_source(std::string_view source, const json::Value& variables, std::string name) {
    if (!variables.is_null() && !variables.is_object()) fail(name, ": the template variables must be a JSON object");
    ChatTemplate t;
    t.default_ = std::make_shared<const jinja::Template>(jinja::Template::parse(source, std::move(name)));
    t.variables_ = variables.is_null() ? json::Value::object() : variables;
    return t;
}

ChatTemplate ChatTemplate::load(const Tokenizer& tokenizer, const std::filesystem::path& tokenizer_dir,
                                const json::Value& kwargs) {
    if (!kwargs.is_null() && !kwargs.is_object())
        fail("data.chat_template_kwargs must be a mapping of template variables, got ", json::kind_name(kwargs.kind()));
    const std::optional<TemplateTexts> texts = find_template_texts(tokenizer, tokenizer_dir);
    const std::string where = tokenizer_dir.empty() ? std::string("tokenizer") : tokenizer_dir.string();
    if (!texts) fail(where, ": the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)");
    json::Value vars = json::Value::object();
    const json::Value& config = tokenizer.config();
    for (const char* key : kSpecialTokenKeys) {
        std::optional<std::string> text;
        const json::Value* v = config.is_object() ? config.find(key) : nullptr;
        if (v != nullptr) text = special_token_text(*v, key);
        const std::optional<int32_t> id = std::string_view(key) == "bos_token"   ? tokenizer.bos_id
                                          : std::string_view(key) == "eos_token" ? tokenizer.eos_id
                                          : std::string_view(key) == "pad_token" ? tokenizer.pad_id
                                                                                 : std::nullopt;
        if (!text && id) text = tokenizer.id_to_token(*id);
        if (text) vars.set(key, *text);
    }
    if (kwargs.is_object())
        for (const auto& [k, v] : kwargs.as_object()) vars.set(k, v);
    ChatTemplate t = from_source(texts->default_text, vars, where + " chat_template");
    if (texts->tool_use)
        t.tool_use_ = std::make_shared<const jinja::Template>(
            jinja::Template::parse(*texts->tool_use, where + " chat_template (tool_use)"));
    return t;
}

bool ChatTemplate::has_generation_blocks() const { return default_->has_generation_blocks(); }
const std::string& ChatTemplate::name() const { return default_->name(); }

const jinja::Template& ChatTemplate::pick(const json::Value& conversation) const {
    const json::Value* tools = conversation.is_object() ? conversation.find("tools") : nullptr;
    if (tool_use_ && tools != nullptr && !tools->is_null()) return *tool_use_;
    return *default_;
}

json::Value ChatTemplate::context(const json::Value& conversation, const json::Value& messages,
                                  bool add_generation_prompt) const {
    json::Value ctx = variables_;
    ctx.set("tools", nullptr);
    ctx.set("documents", nullptr);
    for (const auto& [k, v] : conversation.as_object())
        if (k != "messages" && k != "add_generation_prompt") ctx.set(k, v);
    ctx.set("messages", messages);
    ctx.set("add_generation_prompt", add_generation_prompt);
    return ctx;
}

jinja::Rendered ChatTemplate::render(const json::Value& conversation) const {
    if (!conversation.is_object()) fail(name(), ": a conversation must be a JSON object with \"messages\"");
    const json::Value* messages = conversation.find("messages");
    if (messages == nullptr || !messages->is_array()) fail(name(), ": the conversation has no \"messages\" array");
    const json::Value* agp = conversation.find("add_generation_prompt");
    if (agp != nullptr && !agp->is_bool()) fail(name(), ": add_generation_prompt must be true or false");
    return pick(conversation).render(context(conversation, *messages, agp != nullptr && agp->as_bool()));
}

ChatTemplate::Spans ChatTemplate::learned_spans(const json::Value& conversation, size_t first_learnable) const {
    if (!conversation.is_object() || conversation.find("messages") == nullptr ||
        !conversation.find("messages")->is_array())
        fail(name(), ": the conversation has no \"messages\" array");
    const json::Value::Array& msgs = conversation.find("messages")->as_array();
    const jinja::Template& t = pick(conversation);
    auto render_prefix = [&](size_t n, bool agp) {
        const json::Value prefix(json::Value::Array(msgs.begin(), msgs.begin() + static_cast<std::ptrdiff_t>(n)));
        return t.render(context(conversation, prefix, agp)).text;
    };
    Spans out;
    jinja::Rendered whole = t.render(context(conversation, *conversation.find("messages"), false));
    out.text = std::move(whole.text);
    auto is_prefix = [&](const std::string& p) { return out.text.compare(0, p.size(), p) == 0; };
    size_t prompt_end = 0;  // text before it belongs to messages[:first_learnable]
    if (first_learnable > 0 && first_learnable <= msgs.size()) {
        const std::string p = render_prefix(first_learnable, false);
        if (!is_prefix(p))
            fail(name(), ": the rendering of the prompt's ", first_learnable,
                 " messages is not a prefix of the whole conversation's, so the prompt cannot be told apart from the "
                 "completion");
        prompt_end = p.size();
    }
    if (t.has_generation_blocks()) {
        for (const auto& span : whole.generation_spans)
            if (span.first >= prompt_end && span.second <= out.text.size()) out.learned.push_back(span);
        return out;
    }
    for (size_t i = first_learnable; i < msgs.size(); ++i) {
        const json::Value* role = msgs[i].is_object() ? msgs[i].find("role") : nullptr;
        if (role == nullptr || !role->is_string() || role->as_string() != "assistant") continue;
        std::string before, through;
        try {
            before = render_prefix(i, true);
            through = render_prefix(i + 1, false);
        } catch (const Error& e) {
            fail(name(), ": cannot find assistant message ", i,
                 "'s span: the template fails on the conversation up to it (", e.what(),
                 "); give the template {% generation %} blocks");
        }
        if (!is_prefix(before) || !is_prefix(through) || through.size() < before.size())
            fail(name(), ": cannot find assistant message ", i,
                 "'s span: the rendering of the messages before it (with the generation prompt) and up to it are not "
                 "both prefixes of the whole conversation's rendering (the template renders a message differently "
                 "once others follow); give the template {% generation %} blocks to mark what is learned");
        out.learned.emplace_back(before.size(), through.size());
    }
    return out;
}

TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                            const json::Value& conversation, LossOn loss_on, size_t first_learnable) {
    TokenizedChat out;
    if (loss_on == LossOn::all) {
        out.input_ids = tokenizer.encode(chat_template.render(conversation).text, false);
        out.labels = out.input_ids;
        return out;
    }
    const ChatTemplate::Spans spans = chat_template.learned_spans(conversation, first_learnable);
    out.input_ids = tokenizer.encode(spans.text, false);
    std::vector<int32_t> mask;
    try {
        mask = spans_to_token_mask(tokenizer, spans.text, out.input_ids, spans.learned);
    } catch (const Error& e) {
        fail(chat_template.name(), ": ", e.what());
    }
    out.labels.resize(out.input_ids.size());
    for (size_t t = 0; t < mask.size(); ++t) out.labels[t] = mask[t] != 0 ? out.input_ids[t] : kIgnoreLabel;
    return out;
}

std::vector<int32_t> spans_to_token_mask(const Tokenizer& tokenizer, const std::string& text,
                                         const std::vector<int32_t>& ids,
                                         const std::vector<std::pair<size_t, size_t>>& spans) {
    std::vector<int32_t> mask(ids.size(), 0);
    std::vector<size_t> cuts;
    for (const auto& [b, e] : spans) {
        if (e > text.size() || b > e) fail("an assistant span [", b, ", ", e, ") lies outside the text");
        if (e > b) {
            cuts.push_back(b);
            cuts.push_back(e);
        }
    }
    std::vector<Boundary> where;
    try {
        where = locate_boundaries(tokenizer, text, ids, cuts);
    } catch (const Error& e) {
        fail("an assistant span does not start or end on a character boundary (", e.what(), ")");
    }
    const size_t n = ids.size();
    for (size_t k = 0; k + 1 < where.size(); k += 2) {
        // HF: from the token holding the first byte to the one holding the last (an end token of
        // 0 or none: to the end).
        const size_t first = where[k].tokens_before;
        if (first >= n) break;
        size_t last = where[k + 1].inside_token ? where[k + 1].tokens_before : where[k + 1].tokens_before - 1;
        if (last == 0 || last >= n) last = n - 1;
        for (size_t t = first; t <= last; ++t) mask[t] = 1;
    }
    return mask;
}

json::Value conversation_json(const std::vector<ChatMessage>& messages) {
    json::Value msgs = json::Value::array();
    for (const ChatMessage& m : messages) {
        json::Value o = json::Value::object();
        o.set("role", m.role);
        o.set("content", m.content);
        if (m.reasoning_content) o.set("reasoning_content", *m.reasoning_content);
        msgs.push_back(std::move(o));
    }
    json::Value c = json::Value::object();
    c.set("messages", std::move(msgs));
    return c;
}

// --- recognition by probing ------------------------------------------------------------------------

namespace {

// The probe conversations: together they take each branch where the fast-path formats differ from
// one another (a default system message, think blocks before and after the last query, reasoning
// from the content or the field, an empty field, tool-response-looking user turns) and the places
// where other templates tend to differ from all of them (system messages later on, an assistant
// turn first, empty content, the generation prompt). chatml_system reads its default system
// message off the first.
struct Probe {
    const char* what;
    std::vector<ChatMessage> messages;
    bool add_generation_prompt = false;
};

ChatMessage msg(const char* role, const char* content) { return {role, content, std::nullopt}; }
ChatMessage answer(const char* content, const char* reasoning) { return {"assistant", content, reasoning}; }

const std::vector<Probe>& probes() {
    static const std::vector<Probe> kProbes = {
        {"a question and its answer, no system message", {msg("user", "Hi"), msg("assistant", "Hello.")}},
        {"a system message first", {msg("system", "You are terse."), msg("user", "Hi"), msg("assistant", "Hello.")}},
        {"three turns",
         {msg("user", "2+2?"), msg("assistant", "4"), msg("user", "3+3?"), msg("assistant", "6"), msg("user", "4+4?"),
          msg("assistant", "8")}},
        {"a system message after the first turn",
         {msg("user", "Hi"), msg("assistant", "Hello."), msg("system", "Be formal."), msg("user", "How are you?"),
          msg("assistant", "Well, thank you.")}},
        {"the assistant first", {msg("assistant", "I speak first.")}},
        {"ending on a user turn", {msg("system", "Be brief."), msg("user", "Why?")}},
        {"the generation prompt", {msg("user", "Why?")}, true},
        {"the generation prompt after turns",
         {msg("system", "Be brief."), msg("user", "Q1"), msg("assistant", "A1"), msg("user", "Q2")},
         true},
        {"<think> in the last answer", {msg("user", "Think."), msg("assistant", "<think>\nsum\n</think>\n\nDone.")}},
        {"<think> in an earlier answer",
         {msg("user", "Q1"), msg("assistant", "<think>r1</think>A1"), msg("user", "Q2"),
          msg("assistant", "\n<think>\nr2\n\n</think>A2")}},
        {"reasoning_content", {msg("user", "Q"), answer("\nA </think> B", "\nR\n")}},
        {"an empty reasoning_content", {msg("user", "Q"), answer("<think>x</think>Answer.", "")}},
        {"reasoning_content in an earlier answer",
         {msg("user", "Q1"), answer("A1", "R1"), msg("user", "Q2"), msg("assistant", "A2")}},
        {"two answers after the last question",
         {msg("user", "Q"), msg("assistant", "A"), msg("assistant", "<think>m</think>B")}},
        {"two answers after the last question, the first with reasoning",
         {msg("user", "Q"), msg("assistant", "<think>x</think>A"), msg("assistant", "B")}},
        {"answers after a tool-response-looking user turn",
         {msg("user", "Look it up."), msg("assistant", "<think>need a tool</think>Calling."),
          msg("user", "<tool_response>\n42\n</tool_response>"), msg("assistant", "The answer is 42.")}},
        {"empty and newline-only content",
         {msg("user", ""), msg("assistant", ""), msg("user", "\n"), msg("assistant", "\n")}},
    };
    return kProbes;
}

// The template's rendering of one probe, or the error it raised.
struct ProbeRendering {
    std::string text;
    std::optional<std::string> error;
};

std::vector<ProbeRendering> render_probes(const ChatTemplate& t) {
    std::vector<ProbeRendering> out;
    for (const Probe& p : probes()) {
        json::Value conv = conversation_json(p.messages);
        conv.set("add_generation_prompt", p.add_generation_prompt);
        try {
            out.push_back({t.render_text(conv), std::nullopt});
        } catch (const Error& e) {
            out.push_back({"", std::string(e.what())});
        }
    }
    return out;
}

// At most `max_len` bytes of `s` from `from`, widened to whole UTF-8 characters, quoted.
std::string excerpt(std::string_view s, size_t from, size_t max_len = 60) {
    auto continuation = [&](size_t i) { return i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80; };
    from = std::min(from, s.size());
    while (from > 0 && continuation(from)) --from;
    size_t end = std::min(s.size(), from + max_len);
    while (continuation(end)) ++end;
    return std::string(from > 0 ? "..." : "") + json::quote(s.substr(from, end - from)) + (end < s.size() ? "..." : "");
}

std::string difference(const Probe& p, const std::string& got, const std::string& written, const char* format) {
    size_t at = 0;
    while (at < got.size() && at < written.size() && got[at] == written[at]) ++at;
    const size_t from = at > 24 ? at - 24 : 0;
    std::ostringstream os;
    os << "on the probe conversation '" << p.what << "' at byte " << at << " the template renders "
       << excerpt(got, from) << " where " << format << " writes " << excerpt(written, from);
    return os.str();
}

// chatml_system's default system message: what the template writes before the rest of the first
// probe, when that is one system message.
std::optional<std::string> read_default_system(const std::string& got, const std::string& rest) {
    const std::string open = std::string(kImStart) + "system\n", close = std::string(kImEnd) + "\n";
    if (got.size() < open.size() + close.size() + rest.size()) return std::nullopt;
    if (got.compare(0, open.size(), open) != 0 || got.compare(got.size() - rest.size(), rest.size(), rest) != 0)
        return std::nullopt;
    const size_t end = got.size() - rest.size() - close.size();
    if (got.compare(end, close.size(), close) != 0) return std::nullopt;
    return got.substr(open.size(), end - open.size());
}

std::optional<ChatFormat> match_renderings(const std::vector<ProbeRendering>& renderings, ChatFormat::Kind kind,
                                           std::string* why) {
    const std::vector<Probe>& ps = probes();
    const char* name = chat_format_name(kind);
    ChatFormat format{kind, ""};
    if (kind == ChatFormat::Kind::chatml_system && !renderings[0].error) {
        const std::string rest = render_chat_text(ps[0].messages, ChatFormat{});
        const std::optional<std::string> text = read_default_system(renderings[0].text, rest);
        if (!text) {
            if (why != nullptr)
                *why = "on the probe conversation '" + std::string(ps[0].what) + "' the template renders " +
                       excerpt(renderings[0].text, 0) + ", not a system message followed by " + excerpt(rest, 0) +
                       " as chatml_system writes it";
            return std::nullopt;
        }
        format.default_system = *text;
    }
    for (size_t k = 0; k < ps.size(); ++k) {
        if (renderings[k].error) {
            if (why != nullptr)
                *why = "the template fails on the probe conversation '" + std::string(ps[k].what) +
                       "': " + *renderings[k].error;
            return std::nullopt;
        }
        const std::string written = render_chat_text(ps[k].messages, format, ps[k].add_generation_prompt);
        if (renderings[k].text != written) {
            if (why != nullptr) *why = difference(ps[k], renderings[k].text, written, name);
            return std::nullopt;
        }
    }
    return format;
}

// The file the tokenizer's template comes from (for errors).
std::string template_file(const std::filesystem::path& tokenizer_dir) {
    if (tokenizer_dir.empty()) return "tokenizer_config.json";
    const std::filesystem::path dir =
        std::filesystem::is_directory(tokenizer_dir) ? tokenizer_dir : tokenizer_dir.parent_path();
    const std::filesystem::path jinja = dir / "chat_template.jinja";
    return (std::filesystem::exists(jinja) ? jinja : dir / "tokenizer_config.json").string();
}

}  // namespace

std::optional<ChatFormat> match_chat_format(const ChatTemplate& chat_template, ChatFormat::Kind kind,
                                            std::string* why) {
    return match_renderings(render_probes(chat_template), kind, why);
}

std::optional<ChatFormat> detect_chat_format(const ChatTemplate& chat_template) {
    const std::vector<ProbeRendering> renderings = render_probes(chat_template);
    for (const FormatName& f : kFormatNames)
        if (std::optional<ChatFormat> format = match_renderings(renderings, f.kind, nullptr)) return format;
    return std::nullopt;
}

// --- resolution --------------------------------------------------------------------------------------

std::string ChatRenderer::describe() const {
    return format ? std::string(chat_format_name(format->kind)) : "the model's chat template (jinja)";
}

ChatRenderer resolve_chat_renderer(std::string_view setting, const Tokenizer& tokenizer,
                                   const std::filesystem::path& tokenizer_dir, const json::Value& kwargs) {
    ChatRenderer r;
    const std::string where = tokenizer_dir.empty() ? std::string("tokenizer") : tokenizer_dir.string();
    const bool has_template = find_chat_template(tokenizer, tokenizer_dir).has_value();
    if (setting == "jinja") {
        r.model_template = ChatTemplate::load(tokenizer, tokenizer_dir, kwargs);
        return r;
    }
    if (setting == "auto") {
        if (!has_template)
            fail(where,
                 ": the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); set "
                 "data.chat_format to chatml or chatml_think");
        try {
            r.model_template = ChatTemplate::load(tokenizer, tokenizer_dir, kwargs);
        } catch (const Error& e) {
            fail(e.what(),
                 " (data.chat_format: auto renders conversations with the model's chat template, on the ChatML fast "
                 "path where the template renders like it)");
        }
        r.format = detect_chat_format(*r.model_template);  // else the interpreter renders it
        return r;
    }
    const ChatFormat::Kind kind = parse_chat_format(setting);
    const char* name = chat_format_name(kind);
    const std::string hint =
        std::string(" (data.chat_format: ") + name + " was set; use auto to train the model's own format)";
    if (!has_template) {
        if (kind == ChatFormat::Kind::chatml_system)
            fail(where,
                 ": data.chat_format chatml_system writes the default system message of the model's chat "
                 "template, and the tokenizer has none (tokenizer_config.json or chat_template.jinja)");
        r.format = ChatFormat{kind, ""};
        return r;
    }
    const std::string file = template_file(tokenizer_dir);
    try {
        r.model_template = ChatTemplate::load(tokenizer, tokenizer_dir, kwargs);
    } catch (const Error& e) {
        fail(file, ": cannot check the chat template against ", name, ": ", e.what(), hint);
    }
    std::string why;
    r.format = match_chat_format(*r.model_template, kind, &why);
    if (!r.format)
        fail(file, ": the model's chat template renders conversations differently from ", name, ": ", why, hint);
    return r;
}

TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const ChatRenderer& renderer,
                            const std::vector<ChatMessage>& messages, LossOn loss_on, size_t first_learnable) {
    if (renderer.format) return tokenize_chat(tokenizer, messages, *renderer.format, loss_on, first_learnable);
    MF_CHECK(renderer.model_template.has_value(), "a ChatRenderer with neither a format nor a template");
    return tokenize_chat(tokenizer, *renderer.model_template, conversation_json(messages), loss_on, first_learnable);
}

}  // namespace mf::text
