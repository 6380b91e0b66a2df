// `moeforge tokenize`: encode stdin with an HF tokenizer, or decode a JSON id array from stdin.
//
//   moeforge tokenize --tokenizer DIR [--json] [--special]     all of stdin is one text; prints its ids
//                                                               (a JSON array with --json, else space-separated)
//   moeforge tokenize --tokenizer DIR --decode [--skip-special] stdin is a JSON array of ids; prints the text
//   moeforge tokenize --tokenizer DIR --chat [--json]           stdin is one conversation, {"messages": [...],
//                                                               "tools"?, "documents"?, "add_generation_prompt"?,
//                                                               other keys: template variables}; prints what the
//                                                               tokenizer's chat template renders (as HF's
//                                                               apply_chat_template(tokenize=False)); with --json
//                                                               {"text", "ids", "assistant_mask"} (the mask as
//                                                               return_assistant_tokens_mask, text/chat.h)
//
// stdin (at most 64 MiB) must be valid UTF-8 when encoding; a bad id array or an unknown id is an error naming it.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/check.h"
#include "core/json.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace mf::cli {

namespace {

// One text is held whole (and its ids and their printout): the cap keeps that bounded, checked
// as the input arrives, so an endless stream (/dev/zero) stops at the cap.
constexpr size_t kMaxStdinBytes = size_t{64} << 20;

std::string read_stdin() {
    std::string text;
    char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, stdin)) > 0) {
        if (text.size() + n > kMaxStdinBytes)
            fail("tokenize: standard input is longer than ", kMaxStdinBytes,
                 " bytes; tokenize encodes one text at a time (split the input)");
        text.append(buf, n);
    }
    if (std::ferror(stdin)) fail("tokenize: error reading standard input");
    return text;
}

void write_stdout(const std::string& s) {
    if (std::fwrite(s.data(), 1, s.size(), stdout) != s.size() || std::fflush(stdout) != 0)
        fail("tokenize: error writing standard output");
}

std::string json_ints(const std::vector<int32_t>& v) {
    std::string out = "[";
    for (size_t k = 0; k < v.size(); ++k) {
        if (k > 0) out += ", ";
        out += std::to_string(v[k]);
    }
    return out + "]";
}

// --chat: the conversation on stdin through the tokenizer's own template.
int tokenize_chat(const text::Tokenizer& tok, const std::string& dir, const std::string& input, bool as_json) {
    const json::Value conv = json::parse(input, "<stdin>");
    if (!conv.is_object() || conv.find("messages") == nullptr || !conv.find("messages")->is_array())
        fail(
            "tokenize --chat: <stdin>: expected a JSON object {\"messages\": [...], \"tools\"?: [...], "
            "\"add_generation_prompt\"?: bool}");
    const text::ChatTemplate t = text::ChatTemplate::load(tok, dir);
    const std::string rendered = t.render_text(conv);
    if (!as_json) {
        write_stdout(rendered);
        return 0;
    }
    // The mask is found on the rendering without the generation prompt, which opens the full one.
    json::Value train = conv;
    train.set("add_generation_prompt", false);
    const text::ChatTemplate::Spans spans = t.learned_spans(train);
    if (rendered.compare(0, spans.text.size(), spans.text) != 0)
        fail(
            "tokenize --chat --json: the rendering with the generation prompt does not begin with the rendering "
            "without it, so the assistant mask cannot be placed");
    const std::vector<int32_t> ids = tok.encode(rendered, false);
    const std::vector<int32_t> mask = text::spans_to_token_mask(tok, rendered, ids, spans.learned);
    write_stdout("{\"text\": " + json::quote(rendered) + ", \"ids\": " + json_ints(ids) +
                 ", \"assistant_mask\": " + json_ints(mask) + "}\n");
    return 0;
}

}  // namespace

int cmd_tokenize(const Args& args) {
    return with_path_errors("tokenize", [&] {
        const ParsedArgs a(args, {"tokenizer"}, {"json", "decode", "special", "skip-special", "chat"}, "tokenize");
        if (!a.positional().empty()) fail("tokenize: unexpected argument \"", a.positional()[0], "\"");
        const std::string dir = a.require("tokenizer", "tokenize");
        const text::Tokenizer tok = text::Tokenizer::load(dir);
        const std::string input = read_stdin();

        if (a.has("chat")) {
            if (a.has("decode") || a.has("special") || a.has("skip-special"))
                fail("tokenize: --chat takes only --json (special tokens in the rendering are always parsed)");
            return tokenize_chat(tok, dir, input, a.has("json"));
        }

        if (a.has("decode")) {
            if (a.has("special") || a.has("json")) fail("tokenize: --decode does not take --special or --json");
            const json::Value v = json::parse(input, "<stdin>");
            if (!v.is_array())
                fail("tokenize --decode: <stdin>: expected a JSON array of token ids, got a ",
                     json::kind_name(v.kind()));
            std::vector<int32_t> ids;
            ids.reserve(v.size());
            for (size_t k = 0; k < v.size(); ++k) {
                const json::Value& e = v.as_array()[k];
                if (!e.is_int() || e.as_int() < 0 || e.as_int() > INT32_MAX)
                    fail("tokenize --decode: <stdin>: element ", k, " is not a token id: ", e.dump());
                ids.push_back(static_cast<int32_t>(e.as_int()));
            }
            write_stdout(tok.decode(ids, a.has("skip-special")));
            return 0;
        }
        if (a.has("skip-special")) fail("tokenize: --skip-special only applies with --decode");

        const std::vector<int32_t> ids = tok.encode(input, a.has("special"));
        std::string out;
        out.reserve(ids.size() * 7 + 2);
        const bool as_json = a.has("json");
        if (as_json) out += '[';
        for (size_t k = 0; k < ids.size(); ++k) {
            if (k > 0) out += as_json ? ", " : " ";
            out += std::to_string(ids[k]);
        }
        if (as_json) out += ']';
        out += '\n';
        write_stdout(out);
        return 0;
    });
}

}  // namespace mf::cli
