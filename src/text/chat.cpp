// Chat formats: template recognition, rendering and tokenisation with a loss mask (see chat.h).
//
// Recognition never runs Jinja. It normalises the template the way HF's Jinja environment
// (trim_blocks, lstrip_blocks) would treat its layout, so two templates that render alike compare
// alike whatever their indentation, and then checks for the constructs each format is made of.
#include "text/chat.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include "core/check.h"
#include "core/json.h"

namespace mf::text {

namespace {

constexpr int32_t kIgnoreLabel = -100;  // data::kIgnoreIndex (text/ does not include data/)
constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kQwen2System = "You are a helpful assistant.";
constexpr std::string_view kQwen25System = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string show(std::string_view s, size_t max_len = 60) {
    std::string cut(s.substr(0, max_len));
    return json::quote(cut) + (s.size() > max_len ? "..." : "");
}

// --- template normalisation ------------------------------------------------------------------------

// Copies a tag's inside: whitespace outside string literals dropped, literals kept verbatim but
// always delimited by single quotes, the dashes/pluses of whitespace control removed.
std::string normalize_tag_body(std::string_view body) {
    if (!body.empty() && (body.front() == '-' || body.front() == '+')) body.remove_prefix(1);
    if (!body.empty() && (body.back() == '-' || body.back() == '+')) body.remove_suffix(1);
    std::string out;
    for (size_t i = 0; i < body.size(); ++i) {
        const char c = body[i];
        if (c == '\'' || c == '"') {
            out += '\'';
            for (++i; i < body.size() && body[i] != c; ++i) {
                if (body[i] == '\\' && i + 1 < body.size()) out += body[i++];
                out += body[i];
            }
            out += '\'';
        } else if (!is_space(c)) {
            out += c;
        }
    }
    // x['key'] -> x.key, so both spellings of an attribute compare equal.
    std::string res;
    for (size_t i = 0; i < out.size(); ++i) {
        if (out[i] == '[' && i + 1 < out.size() && out[i + 1] == '\'') {
            size_t j = i + 2;
            while (j < out.size() && (std::isalnum(static_cast<unsigned char>(out[j])) || out[j] == '_')) ++j;
            if (j > i + 2 && j + 1 < out.size() && out[j] == '\'' && out[j + 1] == ']') {
                res += '.';
                res.append(out, i + 2, j - i - 2);
                i = j + 1;
                continue;
            }
        }
        res += out[i];
    }
    return res;
}

// Index of the next "{{", "{%" or "{#" at or after `pos`, or npos.
size_t find_tag_open(std::string_view t, size_t pos) {
    for (size_t at = t.find('{', pos); at != std::string_view::npos; at = t.find('{', at + 1))
        if (at + 1 < t.size() && (t[at + 1] == '{' || t[at + 1] == '%' || t[at + 1] == '#')) return at;
    return std::string_view::npos;
}

// The template as a sequence of normalised tags. Text between tags must be whitespace that the
// Jinja environment HF uses (trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
// does not emit: a template that renders text or whitespace of its own outside tags is not one of
// ours. NOTE: "{%-"/"-%}" strip all whitespace on their side, trim_blocks removes the first
// newline after a block tag, lstrip_blocks the spaces and tabs from a line's start to a block tag.
std::string normalize_template(std::string_view t, const std::string& source) {
    std::string out;
    size_t pos = 0;
    char prev_kind = 0;  // '{', '%' or '#' of the previous tag; 0 before the first
    char prev_mod = 0;   // '-' or '+' right before the previous tag's close, else 0
    for (;;) {
        const size_t open = find_tag_open(t, pos);
        const std::string_view text = t.substr(pos, (open == std::string_view::npos ? t.size() : open) - pos);
        const char kind = open == std::string_view::npos ? 0 : t[open + 1];
        const char mod =
            open != std::string_view::npos && open + 2 < t.size() && (t[open + 2] == '-' || t[open + 2] == '+')
                ? t[open + 2]
                : 0;
        for (size_t i = 0; i < text.size(); ++i)
            if (!is_space(text[i]))
                fail(source, ": chat_template has text outside tags at offset ", pos + i, " (", show(t.substr(pos + i)),
                     "), which no built-in chat format renders");
        // The part [start, end) of this whitespace that Jinja would emit.
        size_t start = 0, end = text.size();
        const bool prev_block = prev_kind == '%' || prev_kind == '#';
        if (prev_mod == '-') {
            start = end;
        } else if (prev_block && prev_mod != '+') {
            if (text.substr(0, 1) == "\n")
                start = 1;
            else if (text.substr(0, 2) == "\r\n")
                start = 2;
        }
        if (mod == '-') {
            end = start;
        } else if ((kind == '%' || kind == '#') && mod != '+') {
            const size_t nl = text.rfind('\n');
            if (nl != std::string_view::npos)
                end = std::max(start, nl + 1);
            else if (pos == 0)
                end = start;  // the template's first line
        }
        std::string_view emitted = start < end ? text.substr(start, end - start) : std::string_view{};
        if (kind == 0 && !emitted.empty() && emitted.back() == '\n') emitted.remove_suffix(1);  // trailing newline
        if (!emitted.empty())
            fail(source, ": chat_template renders the whitespace ", show(emitted), " at offset ", pos + start,
                 ", which no built-in chat format renders");
        if (open == std::string_view::npos) break;

        const std::string_view close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
        size_t close_at = std::string_view::npos;
        for (size_t i = open + 2; i + 1 < t.size();) {
            const char c = t[i];
            if (kind != '#' && (c == '\'' || c == '"')) {  // skip a string literal
                for (++i; i < t.size() && t[i] != c; ++i)
                    if (t[i] == '\\') ++i;
                ++i;
                continue;
            }
            if (t.substr(i, 2) == close) {
                close_at = i;
                break;
            }
            ++i;
        }
        if (close_at == std::string_view::npos)
            fail(source, ": chat_template has an unterminated tag at offset ", open, " (", show(t.substr(open)), ")");
        const std::string_view body = t.substr(open + 2, close_at - open - 2);
        if (kind != '#') {
            const std::string norm = normalize_tag_body(body);
            if (norm != "generation" && norm != "endgeneration") {  // TRL's mask markers render nothing
                out += kind == '{' ? "{{" : "{%";
                out += norm;
                out += kind == '{' ? "}}" : "%}";
            }
        }
        prev_kind = kind;
        prev_mod = !body.empty() && (body.back() == '-' || body.back() == '+') ? body.back() : 0;
        pos = close_at + 2;
    }
    return out;
}

// Qwen3's reasoning handling, as template source; normalised before use so the layout of the
// model's template does not matter.
constexpr std::string_view kQwen3LastQuery =
    R"({%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %})";
constexpr std::string_view kQwen3Assistant = R"({%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}
    {%- set reasoning_content = message.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index %}
    {%- if loop.last or (not loop.last and reasoning_content) %}
        {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content }}
    {%- endif %}
{%- else %}
    {{- '<|im_start|>' + message.role + '\n' + content }}
{%- endif %})";
// Removes `{%if add_generation_prompt%} ... {%endif%}` blocks (nested ifs counted): training never
// renders the generation prompt, so how a template writes it does not matter here.
void erase_generation_prompt(std::string& n) {
    const std::string open = "{%ifadd_generation_prompt%}";
    for (size_t at = n.find(open); at != std::string::npos; at = n.find(open, at)) {
        int depth = 0;
        size_t i = at;
        while (i < n.size()) {
            if (n.compare(i, 4, "{%if") == 0) ++depth;
            if (n.compare(i, 9, "{%endif%}") == 0 && --depth == 0) break;
            i = n.find("{%", i + 1);
            if (i == std::string::npos) i = n.size();
        }
        if (i >= n.size()) return;  // unbalanced: leave it for the checks to refuse
        n.erase(at, i + 9 - at);
    }
}

void erase_all(std::string& s, const std::string& part) {
    for (size_t at = s.find(part); at != std::string::npos; at = s.find(part, at)) s.erase(at, part.size());
}

std::string unescape_literal(std::string_view s) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '\\' && i + 1 < s.size()) {
            const char c = s[++i];
            out += c == 'n' ? '\n' : c == 't' ? '\t' : c;
        } else {
            out += s[i];
        }
    }
    return out;
}

// --- rendering helpers (Python str methods as Qwen3's template uses them) ------------------------------

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

}  // namespace

// --- names -------------------------------------------------------------------------------------------

ChatFormat parse_chat_format(std::string_view name) {
    if (name == "chatml") return ChatFormat::chatml;
    if (name == "chatml_qwen2") return ChatFormat::chatml_qwen2;
    if (name == "chatml_qwen2_5") return ChatFormat::chatml_qwen2_5;
    if (name == "chatml_qwen3") return ChatFormat::chatml_qwen3;
    fail("unknown chat format ", json::quote(name),
         " (expected auto, chatml, chatml_qwen2, chatml_qwen2_5 or chatml_qwen3)");
}

const char* chat_format_name(ChatFormat format) {
    switch (format) {
        case ChatFormat::chatml:
            return "chatml";
        case ChatFormat::chatml_qwen2:
            return "chatml_qwen2";
        case ChatFormat::chatml_qwen2_5:
            return "chatml_qwen2_5";
        case ChatFormat::chatml_qwen3:
            return "chatml_qwen3";
    }
    return "?";
}

LossOn parse_loss_on(std::string_view name) {
    if (name == "assistant") return LossOn::assistant;
    if (name == "all") return LossOn::all;
    fail("unknown loss_on ", json::quote(name), " (expected assistant or all)");
}

const char* loss_on_name(LossOn loss_on) { return loss_on == LossOn::all ? "all" : "assistant"; }

// --- recognition -------------------------------------------------------------------------------------

ChatFormat detect_chat_format(std::string_view chat_template, const std::string& source) {
    const std::string hint =
        " (set data.chat_format to chatml, chatml_qwen2, chatml_qwen2_5 or chatml_qwen3 if the "
        "model's template renders system/user/assistant messages like one of them)";
    if (chat_template.empty()) fail(source, ": chat_template is empty", hint);
    std::string n;
    try {
        n = normalize_template(chat_template, source);
    } catch (const Error& e) {
        throw Error(e.what() + hint);
    }
    erase_generation_prompt(n);
    if (n.find(kImStart) == std::string::npos || n.find(kImEnd) == std::string::npos)
        fail(source, ": chat_template is not a ChatML template (no <|im_start|>/<|im_end|>)", hint);
    if (n.find("'<|im_start|>'+message.role+'\\n'+") == std::string::npos)
        fail(source, ": chat_template does not render messages as '<|im_start|>' + role + '\\n' + content", hint);

    // A default system message: a literal '<|im_start|>system\n...<|im_end|>\n' with text inside.
    std::optional<std::string> default_system;
    const std::string sys_open = "'<|im_start|>system\\n";
    for (size_t at = n.find(sys_open); at != std::string::npos; at = n.find(sys_open, at + 1)) {
        const size_t start = at + sys_open.size();
        const size_t end = n.find('\'', start);
        if (end == std::string::npos || end == start) continue;
        std::string_view lit(n.data() + start, end - start);
        const std::string_view tail = "<|im_end|>\\n";
        if (lit.size() < tail.size() || lit.substr(lit.size() - tail.size()) != tail)
            fail(source, ": chat_template opens a system message with a literal we cannot read: ", show(lit), hint);
        const std::string text = unescape_literal(lit.substr(0, lit.size() - tail.size()));
        if (default_system && *default_system != text)
            fail(source, ": chat_template names two default system messages", hint);
        default_system = text;
    }

    const std::string last_query = normalize_template(kQwen3LastQuery, "kQwen3LastQuery");
    const std::string assistant = normalize_template(kQwen3Assistant, "kQwen3Assistant");
    const bool has_think = n.find("think>") != std::string::npos || n.find("reasoning") != std::string::npos;
    if (has_think) {
        if (n.find(last_query) == std::string::npos || n.find(assistant) == std::string::npos)
            fail(source, ": chat_template handles <think>/reasoning_content, but not as Qwen3's template does", hint);
        erase_all(n, last_query);
        erase_all(n, assistant);
    }
    // Constructs none of our formats render.
    for (const char* bad : {"think>", "reasoning", "last_query", "strip", "trim", "bos_token", "eos_token", "|upper",
                            "|lower", "|replace", "|indent", "|truncate"})
        if (n.find(bad) != std::string::npos)
            fail(source, ": chat_template uses ", json::quote(bad), " in a way no built-in chat format renders", hint);

    if (default_system) {
        if (has_think) fail(source, ": chat_template has both a default system message and <think> handling", hint);
        if (*default_system == kQwen2System) return ChatFormat::chatml_qwen2;
        if (*default_system == kQwen25System) return ChatFormat::chatml_qwen2_5;
        fail(source, ": chat_template inserts the default system message ", show(*default_system, 80),
             ", which no built-in chat format knows", hint);
    }
    return has_think ? ChatFormat::chatml_qwen3 : ChatFormat::chatml;
}

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

namespace {

// Conversations on which a named format and the model's template must render alike.
std::vector<std::vector<ChatMessage>> probe_conversations() {
    return {
        {{"system", "You are terse.", std::nullopt},
         {"user", "Hi", std::nullopt},
         {"assistant", "Hello.", std::nullopt}},
        {{"user", "2+2?", std::nullopt},
         {"assistant", "4", std::nullopt},
         {"user", "3+3?", std::nullopt},
         {"assistant", "6", std::nullopt}},
        {{"user", "Think.", std::nullopt}, {"assistant", "<think>\nsum\n</think>\n\nDone.", std::nullopt}},
    };
}

// An mf::Error unless the model's template renders the probe conversations as `format` does.
void check_forced_format(ChatFormat format, const Tokenizer& tokenizer, const std::filesystem::path& dir,
                         const std::string& where) {
    const std::string hint = std::string(" (data.chat_format: ") + chat_format_name(format) +
                             " was set; use auto to train the model's own format)";
    std::optional<ChatTemplate> t;
    try {
        t = ChatTemplate::load(tokenizer, dir);
    } catch (const Error& e) {
        fail(where, ": cannot check the chat template against ", chat_format_name(format), ": ", e.what(), hint);
    }
    for (const std::vector<ChatMessage>& conv : probe_conversations()) {
        const std::string expected = render_chat_text(conv, format);
        std::string got;
        try {
            got = t->render_text(conversation_json(conv));
        } catch (const Error& e) {
            fail(where, ": the model's chat template does not render like ", chat_format_name(format), ": ", e.what(),
                 hint);
        }
        if (got != expected) {
            size_t at = 0;
            while (at < got.size() && at < expected.size() && got[at] == expected[at]) ++at;
            const size_t from = at > 30 ? at - 30 : 0;
            fail(where, ": the model's chat template renders conversations differently from ", chat_format_name(format),
                 ": at byte ", at, " it renders ", show(std::string_view(got).substr(from), 80), " where ",
                 chat_format_name(format), " renders ", show(std::string_view(expected).substr(from), 80), hint);
        }
    }
}

}  // namespace

ChatFormat resolve_chat_format(std::string_view setting, const Tokenizer& tokenizer,
                               const std::filesystem::path& tokenizer_dir) {
    const std::optional<std::string> t = find_chat_template(tokenizer, tokenizer_dir);
    const std::string where = tokenizer_dir.empty() ? std::string("tokenizer") : tokenizer_dir.string();
    if (setting != "auto") {
        const ChatFormat format = parse_chat_format(setting);
        if (t) check_forced_format(format, tokenizer, tokenizer_dir, where);
        return format;
    }
    if (!t)
        fail(where,
             ": the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); set "
             "data.chat_format to chatml, chatml_qwen2, chatml_qwen2_5 or chatml_qwen3");
    return detect_chat_format(*t, where + " chat_template");
}

// --- rendering ---------------------------------------------------------------------------------------

std::vector<RenderedMessage> render_chat(const std::vector<ChatMessage>& messages, ChatFormat format, LossOn loss_on,
                                         size_t first_learnable) {
    std::vector<RenderedMessage> out;
    out.reserve(messages.size() + 1);
    const bool all = loss_on == LossOn::all;
    if ((format == ChatFormat::chatml_qwen2 || format == ChatFormat::chatml_qwen2_5) &&
        (messages.empty() || messages[0].role != "system")) {
        const std::string_view text = format == ChatFormat::chatml_qwen2 ? kQwen2System : kQwen25System;
        out.push_back({"<|im_start|>system\n", std::string(text) + "<|im_end|>\n", all});
    }
    // Qwen3: the last user message that is not a tool response (the template's last_query_index).
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
        if (format == ChatFormat::chatml_qwen3 && m.role == "assistant") {
            std::string_view content = m.content;
            std::string_view reasoning;
            if (m.reasoning_content) {
                reasoning = *m.reasoning_content;
            } else if (content.find("</think>") != std::string_view::npos) {
                reasoning =
                    strip_newlines_left(after_last(strip_newlines_right(before_first(content, "</think>")), "<think>"));
                content = strip_newlines_left(after_last(content, "</think>"));
            }
            const bool is_last = i + 1 == messages.size();
            if (i > last_query && (is_last || !reasoning.empty())) {
                r.body = "<think>\n";
                r.body += strip_newlines_right(strip_newlines_left(reasoning));
                r.body += "\n</think>\n\n";
                r.body += strip_newlines_left(content);
            } else {
                r.body = content;
            }
        } else {
            r.body = m.content;
        }
        r.body += kImEnd;
        r.body += "\n";
        r.learned = all || (m.role == "assistant" && i >= first_learnable);
        out.push_back(std::move(r));
    }
    return out;
}

std::string render_chat_text(const std::vector<ChatMessage>& messages, ChatFormat format) {
    std::string text;
    for (const RenderedMessage& r : render_chat(messages, format, LossOn::assistant)) text += r.header + r.body;
    return text;
}

TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages, ChatFormat format,
                            LossOn loss_on, size_t first_learnable) {
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

std::string ChatRenderer::describe() const {
    return format ? std::string(chat_format_name(*format)) : "the model's chat template (jinja)";
}

ChatRenderer resolve_chat_renderer(std::string_view setting, const Tokenizer& tokenizer,
                                   const std::filesystem::path& tokenizer_dir, const json::Value& kwargs) {
    ChatRenderer r;
    if (setting == "jinja") {
        r.model_template = ChatTemplate::load(tokenizer, tokenizer_dir, kwargs);
        return r;
    }
    if (setting != "auto") {
        r.format = resolve_chat_format(setting, tokenizer, tokenizer_dir);
        if (find_chat_template(tokenizer, tokenizer_dir))  // for what the fast path does not render
            r.model_template = ChatTemplate::load(tokenizer, tokenizer_dir, kwargs);
        return r;
    }
    const std::optional<std::string> t = find_chat_template(tokenizer, tokenizer_dir);
    const std::string where = tokenizer_dir.empty() ? std::string("tokenizer") : tokenizer_dir.string();
    if (!t)
        fail(where,
             ": the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); set "
             "data.chat_format to chatml, chatml_qwen2, chatml_qwen2_5 or chatml_qwen3");
    const bool has_kwargs = kwargs.is_object() && kwargs.size() > 0;
    if (!has_kwargs) {
        try {
            // Recognised, and rendering the probes as the interpreter does (a safety net for the
            // recogniser): the fast path.
            const ChatFormat format = detect_chat_format(*t, where + " chat_template");
            check_forced_format(format, tokenizer, tokenizer_dir, where);
            r.format = format;
            r.model_template = ChatTemplate::load(tokenizer, tokenizer_dir, kwargs);
            return r;
        } catch (const Error&) {
            // not one of the ChatML formats: the interpreter renders it
        }
    }
    try {
        r.model_template = ChatTemplate::load(tokenizer, tokenizer_dir, kwargs);
    } catch (const Error& e) {
        fail(e.what(),
             " (data.chat_format: auto runs the model's chat template through the Jinja interpreter, since it is not "
             "one of the ChatML formats; name one of them if the model renders as it does)");
    }
    return r;
}

TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const ChatRenderer& renderer,
                            const std::vector<ChatMessage>& messages, LossOn loss_on, size_t first_learnable) {
    if (renderer.format) return tokenize_chat(tokenizer, messages, *renderer.format, loss_on, first_learnable);
    MF_CHECK(renderer.model_template.has_value(), "a ChatRenderer with neither a format nor a template");
    return tokenize_chat(tokenizer, *renderer.model_template, conversation_json(messages), loss_on, first_learnable);
}

}  // namespace mf::text
