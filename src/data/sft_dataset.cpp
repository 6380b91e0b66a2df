// SFT dataset reader: record kinds, auto detection, per-line errors (see sft_dataset.h).
#include "data/sft_dataset.h"

#include <optional>

#include "core/check.h"
#include "core/json.h"
#include "data/batch.h"
#include "data/line_reader.h"

namespace mf::data {

namespace {

// An error about the setup (tokenizer, chat template), not the line it showed up on: it stops the
// read even when bad lines are skipped.
struct SetupError : Error {
    using Error::Error;
};

const char* kind_fields(SftFormat f) {
    switch (f) {
        case SftFormat::messages:
            return "\"messages\"";
        case SftFormat::prompt_completion:
            return "\"prompt\"/\"completion\"";
        case SftFormat::text:
            return "\"text\"";
        case SftFormat::tokens:
            return "\"input_ids\"";
        case SftFormat::auto_detect:
            break;
    }
    return "?";
}

// The kind a record's fields say it is; an error when they name none or several.
SftFormat classify(const json::Value& v) {
    if (!v.is_object()) fail("expected a JSON object, got ", json::kind_name(v.kind()));
    std::vector<SftFormat> kinds;
    if (v.find("messages") != nullptr) kinds.push_back(SftFormat::messages);
    if (v.find("prompt") != nullptr || v.find("completion") != nullptr) kinds.push_back(SftFormat::prompt_completion);
    if (v.find("text") != nullptr) kinds.push_back(SftFormat::text);
    if (v.find("input_ids") != nullptr || v.find("labels") != nullptr) kinds.push_back(SftFormat::tokens);
    if (kinds.empty())
        fail("no dataset field: expected \"messages\", \"prompt\" and \"completion\", \"text\", or \"input_ids\"");
    if (kinds.size() > 1)
        fail("fields of two record kinds: ", kind_fields(kinds[0]), " (", sft_format_name(kinds[0]), ") and ",
             kind_fields(kinds[1]), " (", sft_format_name(kinds[1]), ")");
    return kinds[0];
}

const std::string& string_field(const json::Value& obj, const char* field, const std::string& where) {
    const json::Value* v = obj.find(field);
    if (v == nullptr) fail(where, "missing field \"", field, "\"");
    if (!v->is_string()) fail(where, "field \"", field, "\" must be a string, got ", json::kind_name(v->kind()));
    return v->as_string();
}

std::vector<text::ChatMessage> read_messages(const json::Value& v, const char* field) {
    if (!v.is_array()) fail("field \"", field, "\" must be an array of messages, got ", json::kind_name(v.kind()));
    if (v.size() == 0) fail("field \"", field, "\" is empty");
    std::vector<text::ChatMessage> out;
    for (size_t i = 0; i < v.size(); ++i) {
        const json::Value& m = v.as_array()[i];
        const std::string where = std::string(field) + "[" + std::to_string(i) + "]: ";
        if (!m.is_object()) fail(where, "expected an object {\"role\", \"content\"}, got ", json::kind_name(m.kind()));
        text::ChatMessage msg;
        msg.role = string_field(m, "role", where);
        if (msg.role != "system" && msg.role != "user" && msg.role != "assistant")
            fail(where, "role ", json::quote(msg.role), " is not supported (expected system, user or assistant)");
        msg.content = string_field(m, "content", where);
        if (const json::Value* r = m.find("reasoning_content"); r != nullptr && !r->is_null()) {
            if (!r->is_string())
                fail(where, "field \"reasoning_content\" must be a string, got ", json::kind_name(r->kind()));
            msg.reasoning_content = r->as_string();
        }
        if (const json::Value* tc = m.find("tool_calls");
            tc != nullptr && !tc->is_null() && !(tc->is_array() && tc->size() == 0))
            fail(where, "tool calls are not supported");
        out.push_back(std::move(msg));
    }
    return out;
}

bool any_learned(const std::vector<int32_t>& labels) {
    // labels[0] is never a target (the model predicts token t+1 from t).
    for (size_t t = 1; t < labels.size(); ++t)
        if (labels[t] != kIgnoreIndex) return true;
    return false;
}

class Reader {
 public:
    Reader(const text::Tokenizer* tokenizer, const SftOptions& options) : tok_(tokenizer), opt_(options) {}

    // Checks that `kind` can be read with this tokenizer and options; not a line error.
    void prepare(SftFormat kind, const std::string& file) {
        if (kind == SftFormat::tokens) return;
        if (tok_ == nullptr) fail(file, ": ", sft_format_name(kind), " records need a tokenizer, and none was given");
        if (kind == SftFormat::text || kind == SftFormat::prompt_completion) {
            if (!tok_->eos_id)
                eos_missing_ = true;  // only an error if a record needs it (conversational prompt/completion does not)
        }
        if (kind == SftFormat::messages || kind == SftFormat::prompt_completion) {
            try {
                chat_ =
                    text::resolve_chat_renderer(opt_.chat_format, *tok_, opt_.tokenizer_dir, opt_.chat_template_kwargs);
            } catch (const Error& e) {
                if (kind == SftFormat::messages) throw;
                chat_error_ = e.what();  // only an error if a conversational record shows up
            }
        }
    }

    Document convert(SftFormat kind, const json::Value& v) {
        Document d;
        switch (kind) {
            case SftFormat::tokens:
                return tokens(v);
            case SftFormat::messages: {
                const json::Value& m = *v.find("messages");
                if (needs_template(v, m)) {
                    d = template_chat(v, m, 0);
                    break;
                }
                const std::vector<text::ChatMessage> msgs = read_messages(m, "messages");
                d = chat(msgs, 0);
                break;
            }
            case SftFormat::prompt_completion:
                d = prompt_completion(v);
                break;
            case SftFormat::text: {
                const std::string s = string_field(v, "text", "");
                if (s.empty()) fail("field \"text\" is empty");
                d.input_ids = tok_->encode(s, true);
                append_eos(d.input_ids);
                d.labels = d.input_ids;
                break;
            }
            case SftFormat::auto_detect:
                MF_FAIL("unreachable");
        }
        check_vocab(d);
        return d;
    }

    std::optional<text::ChatFormat> chat_format() const { return chat_ ? chat_->format : std::nullopt; }

 private:
    Document tokens(const json::Value& v) const {
        for (const auto& [key, _] : v.as_object())
            if (key != "input_ids" && key != "labels")
                fail("unknown field \"", key, "\" in a token record (expected input_ids, labels)");
        const json::Value* ids = v.find("input_ids");
        if (ids == nullptr) fail("missing field \"input_ids\"");
        Document d;
        d.input_ids = read_token_ids(*ids, "input_ids", opt_.vocab_size, false);
        if (d.input_ids.empty()) fail("field \"input_ids\" is empty");
        if (const json::Value* labels = v.find("labels"); labels != nullptr && !labels->is_null()) {
            d.labels = read_token_ids(*labels, "labels", opt_.vocab_size, true);
            if (d.labels.size() != d.input_ids.size())
                fail("\"labels\" has ", d.labels.size(), " entries but \"input_ids\" has ", d.input_ids.size());
        } else {
            d.labels = d.input_ids;
        }
        return d;
    }

    // A record the ChatML fast path does not render (tools, tool calls, tool messages, content
    // parts) goes through the model's template as it is; without a fast path every record does.
    bool needs_template(const json::Value& record, const json::Value& messages) const {
        if (!chat_ || !chat_->format) return chat_.has_value();
        if (const json::Value* t = record.find("tools"); t != nullptr && !t->is_null()) return true;
        if (!messages.is_array()) return false;
        for (const json::Value& m : messages.as_array()) {
            if (!m.is_object()) return false;
            const json::Value* role = m.find("role");
            const json::Value* content = m.find("content");
            const json::Value* tc = m.find("tool_calls");
            if (role != nullptr && role->is_string() && role->as_string() != "system" && role->as_string() != "user" &&
                role->as_string() != "assistant")
                return true;
            if (content != nullptr && !content->is_string()) return true;
            if (tc != nullptr && !tc->is_null() && !(tc->is_array() && tc->size() == 0)) return true;
        }
        return false;
    }

    Document template_chat(const json::Value& record, const json::Value& messages, size_t first_learnable) const {
        if (!chat_) throw SetupError(chat_error_);
        if (!chat_->model_template)
            fail(
                "this record has tools, tool calls, tool messages or content parts, which only the model's own chat "
                "template renders, and the tokenizer has none");
        check_message_shapes(messages, "messages");
        json::Value conv = json::Value::object();
        conv.set("messages", messages);
        if (const json::Value* t = record.find("tools"); t != nullptr && !t->is_null()) {
            if (!t->is_array())
                fail("field \"tools\" must be a list of tool schemas, got ", json::kind_name(t->kind()));
            conv.set("tools", *t);
        }
        text::TokenizedChat tc =
            text::tokenize_chat(*tok_, *chat_->model_template, conv, opt_.loss_on, first_learnable);
        if (!any_learned(tc.labels))
            fail(first_learnable > 0 ? "the completion has no assistant message" : "no assistant message",
                 ": nothing to learn with loss_on: assistant");
        return {std::move(tc.input_ids), std::move(tc.labels)};
    }

    static void check_message_shapes(const json::Value& v, const char* field) {
        if (!v.is_array()) fail("field \"", field, "\" must be an array of messages, got ", json::kind_name(v.kind()));
        if (v.size() == 0) fail("field \"", field, "\" is empty");
        for (size_t i = 0; i < v.size(); ++i) {
            const json::Value& m = v.as_array()[i];
            const std::string where = std::string(field) + "[" + std::to_string(i) + "]: ";
            if (!m.is_object())
                fail(where, "expected an object {\"role\", \"content\"}, got ", json::kind_name(m.kind()));
            string_field(m, "role", where);
        }
    }

    Document chat(const std::vector<text::ChatMessage>& msgs, size_t first_learnable) const {
        if (!chat_) throw SetupError(chat_error_);
        text::TokenizedChat tc = text::tokenize_chat(*tok_, *chat_, msgs, opt_.loss_on, first_learnable);
        if (!any_learned(tc.labels))
            fail(first_learnable > 0 ? "the completion has no assistant message" : "no assistant message",
                 ": nothing to learn with loss_on: assistant");
        return {std::move(tc.input_ids), std::move(tc.labels)};
    }

    Document prompt_completion(const json::Value& v) const {
        const json::Value* p = v.find("prompt");
        const json::Value* c = v.find("completion");
        if (p == nullptr) fail("missing field \"prompt\" (a prompt/completion record needs both)");
        if (c == nullptr) fail("missing field \"completion\" (a prompt/completion record needs both)");
        if (p->is_array() && c->is_array()) {
            json::Value all(json::Value::Array(p->as_array()));  // a copy: Value shares its array
            for (const json::Value& m : c->as_array()) all.push_back(m);
            if (needs_template(v, all)) {
                check_message_shapes(*p, "prompt");
                check_message_shapes(*c, "completion");
                return template_chat(v, all, p->size());
            }
            std::vector<text::ChatMessage> msgs = read_messages(*p, "prompt");
            const std::vector<text::ChatMessage> completion = read_messages(*c, "completion");
            const size_t first = msgs.size();
            msgs.insert(msgs.end(), completion.begin(), completion.end());
            return chat(msgs, first);
        }
        if (!p->is_string() || !c->is_string())
            fail("\"prompt\" and \"completion\" must both be strings or both be lists of messages, got ",
                 json::kind_name(p->kind()), " and ", json::kind_name(c->kind()));
        Document d;
        const std::vector<int32_t> prompt_ids = tok_->encode(p->as_string(), true);
        d.input_ids = tok_->encode(p->as_string() + c->as_string(), true);
        append_eos(d.input_ids);
        size_t first = 0;
        while (first < prompt_ids.size() && first < d.input_ids.size() && prompt_ids[first] == d.input_ids[first])
            ++first;
        d.labels = d.input_ids;
        if (opt_.loss_on == text::LossOn::assistant)
            for (size_t t = 0; t < first; ++t) d.labels[t] = kIgnoreIndex;
        return d;
    }

    void append_eos(std::vector<int32_t>& ids) const {
        if (eos_missing_)
            throw SetupError(
                "the tokenizer has no eos_token (tokenizer_config.json), which text and prompt/completion "
                "records end with");
        if (ids.empty() || ids.back() != *tok_->eos_id) ids.push_back(*tok_->eos_id);
    }

    void check_vocab(const Document& d) const {
        for (size_t t = 0; t < d.input_ids.size(); ++t)
            if (d.input_ids[t] < 0 || d.input_ids[t] >= opt_.vocab_size)
                fail("token ", t, " has id ", d.input_ids[t], ", outside the model's vocabulary [0, ", opt_.vocab_size,
                     ")");
        if (d.input_ids.empty()) fail("the record has no tokens");
    }

    const text::Tokenizer* tok_;
    const SftOptions& opt_;
    std::optional<text::ChatRenderer> chat_;
    std::string chat_error_ = "no chat format";
    bool eos_missing_ = false;
};

}  // namespace

SftFormat parse_sft_format(std::string_view name) {
    if (name == "auto") return SftFormat::auto_detect;
    if (name == "tokens") return SftFormat::tokens;
    if (name == "messages") return SftFormat::messages;
    if (name == "prompt_completion") return SftFormat::prompt_completion;
    if (name == "text") return SftFormat::text;
    fail("unknown data format ", json::quote(name), " (expected auto, tokens, messages, prompt_completion or text)");
}

const char* sft_format_name(SftFormat format) {
    switch (format) {
        case SftFormat::auto_detect:
            return "auto";
        case SftFormat::tokens:
            return "tokens";
        case SftFormat::messages:
            return "messages";
        case SftFormat::prompt_completion:
            return "prompt_completion";
        case SftFormat::text:
            return "text";
    }
    return "?";
}

TokenDataset read_sft_jsonl(const std::filesystem::path& file, const text::Tokenizer* tokenizer,
                            const SftOptions& options, SftFormat* detected, text::ChatFormat* chat_format) {
    if (options.vocab_size <= 0) fail(file.string(), ": vocab_size must be positive (got ", options.vocab_size, ")");
    LineReader in(file);
    const std::string& name = in.name();
    Reader reader(tokenizer, options);
    SftFormat kind = options.format;
    int64_t kind_line = 0;  // the line that decided the kind (0: set by the options)
    if (kind != SftFormat::auto_detect) reader.prepare(kind, name);

    TokenDataset ds;
    std::string line;
    auto bad_line = [&](const Error& e) {
        const std::string msg = name + ":" + std::to_string(in.line_no()) + ": " + e.what();
        if (!options.skip_bad_lines) throw Error(msg);
        if (ds.skipped_lines++ == 0) ds.first_skip_reason = msg;
    };
    while (in.next(line)) {
        const int64_t line_no = in.line_no();
        if (line.find_first_not_of(" \t") == std::string::npos) continue;
        json::Value v;
        SftFormat line_kind;
        try {
            v = json::parse(line, "");  // errors get "FILE:LINE: " below
            line_kind = classify(v);
            if (kind != SftFormat::auto_detect && line_kind != kind) {
                if (kind_line > 0)
                    fail("a ", sft_format_name(line_kind), " record, but the file holds ", sft_format_name(kind),
                         " records (from line ", kind_line, "); every line must be of one kind");
                fail("a ", sft_format_name(line_kind), " record, but data.format is ", sft_format_name(kind));
            }
        } catch (const Error& e) {
            bad_line(e);
            continue;
        }
        if (kind == SftFormat::auto_detect) {
            kind = line_kind;
            kind_line = line_no;
            reader.prepare(kind, name);  // a tokenizer/template problem stops, even in skip mode
        }
        try {
            ds.docs.push_back(reader.convert(kind, v));
        } catch (const SetupError& e) {
            throw Error(name + ":" + std::to_string(line_no) + ": " + e.what());
        } catch (const Error& e) {
            bad_line(e);
        }
    }
    if (ds.docs.empty())
        fail(name, ": no usable records (", ds.skipped_lines, " bad lines skipped",
             ds.skipped_lines > 0 ? "; first: " + ds.first_skip_reason : std::string(), ")");
    if (detected != nullptr) *detected = kind;
    if (chat_format != nullptr && reader.chat_format()) *chat_format = *reader.chat_format();
    return ds;
}

}  // namespace mf::data
