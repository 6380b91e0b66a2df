// `moeforge generate`: text from an HF model directory, to sanity-check a (fine-tuned) model.
//
//   moeforge generate --model DIR --prompt TEXT [--chat [--chat-format auto|jinja|chatml|...]]
//                     [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S]
//                     [--device auto|cpu|cuda] [--json]
//
// The prompt is encoded with DIR's tokenizer as `tokenizer(TEXT)` does (its post-processor's special
// tokens included); with --chat it is one user message rendered by the directory's chat template
// (text/chat.h: a ChatML fast path, or the model's own template through the interpreter) with its
// generation prompt, encoded without special tokens, as apply_chat_template(...,
// add_generation_prompt=True, tokenize=True) does.
// Generation (model/generate.h) stops after max-new-tokens or an EOS id, which HF's rule takes from
// DIR/generation_config.json when that file exists, else from config.json. The new text, decoded
// without special tokens, streams to stdout; a summary goes to stderr. --json prints one object
// instead: the prompt and output ids, the text, why it stopped, and the timings.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/check.h"
#include "core/device_choice.h"
#include "core/json.h"
#include "core/tensor.h"
#include "io/file.h"
#include "model/generate.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "train/hf_checkpoint.h"

namespace mf::cli {

namespace fs = std::filesystem;

namespace {

struct GenerateArgs {
    fs::path model_dir;
    std::string prompt;
    bool chat = false, json = false;
    std::string chat_format = "auto";
    model::GenerateOptions options;
    Device device = Device::cpu;
};

double parse_number_option(const std::string& value, const char* option) {
    char* end = nullptr;
    const double v = value.empty() ? NAN : std::strtod(value.c_str(), &end);
    if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(v))
        fail("generate: option --", option, ": expected a number, got \"", value, "\"");
    return v;
}

GenerateArgs parse_generate_args(const Args& args) {
    const ParsedArgs a(args,
                       {"model", "prompt", "chat-format", "max-new-tokens", "temperature", "top-p", "seed", "device"},
                       {"chat", "json"}, "generate");
    if (!a.positional().empty()) fail("generate: unexpected argument \"", a.positional()[0], "\"");
    GenerateArgs g;
    g.model_dir = a.require("model", "generate");
    if (!fs::exists(g.model_dir)) fail("generate: --model ", g.model_dir.string(), ": no such directory");
    if (!fs::is_directory(g.model_dir))
        fail("generate: --model ", g.model_dir.string(), ": not a directory (expected an HF model directory)");
    g.prompt = a.require("prompt", "generate");
    if (g.prompt.empty()) fail("generate: --prompt is empty (give the text to continue)");
    g.chat = a.has("chat");
    g.json = a.has("json");
    if (a.has("chat-format")) {
        if (!g.chat) fail("generate: --chat-format only applies with --chat");
        g.chat_format = a.get("chat-format");
        if (g.chat_format != "auto" && g.chat_format != "jinja")
            text::parse_chat_format(g.chat_format);  // names the choices
    }
    g.options.max_new_tokens = parse_int_option(a.get("max-new-tokens", "64"), "max-new-tokens");
    g.options.sampling.temperature = parse_number_option(a.get("temperature", "0"), "temperature");
    if (g.options.sampling.temperature < 0)
        fail("generate: option --temperature: expected a number >= 0 (0 = greedy), got ", a.get("temperature"));
    g.options.sampling.top_p = parse_number_option(a.get("top-p", "1"), "top-p");
    if (!(g.options.sampling.top_p > 0 && g.options.sampling.top_p <= 1))
        fail("generate: option --top-p: expected a number in (0, 1], got ", a.get("top-p"));
    g.options.sampling.seed = static_cast<uint64_t>(parse_int_option(a.get("seed", "0"), "seed"));
    g.device = pick_device(a.get("device", "auto"), "generate: --device");
    return g;
}

// HF's EOS rule: generation_config.json's eos_token_id when that file exists, else config.json's;
// an id or a list of ids, null or absent for none.
std::vector<int32_t> read_eos_ids(const fs::path& dir, const json::Value& config, int64_t vocab_size) {
    const fs::path gen_file = dir / "generation_config.json";
    json::Value gen;
    std::string source = (dir / "config.json").string();
    const json::Value* v = config.find("eos_token_id");
    if (fs::exists(gen_file)) {
        source = gen_file.string();
        gen = json::parse(io::read_text_file(gen_file, 1u << 20), source);
        if (!gen.is_object()) fail(source, ": expected a JSON object, got a ", json::kind_name(gen.kind()));
        v = gen.find("eos_token_id");
    }
    std::vector<int32_t> ids;
    if (v == nullptr || v->is_null()) return ids;
    auto take = [&](const json::Value& e) {
        if (!e.is_int() || e.as_int() < 0 || e.as_int() >= vocab_size)
            fail(source, ": eos_token_id: expected token ids in [0, ", vocab_size, "), got ", e.dump());
        ids.push_back(static_cast<int32_t>(e.as_int()));
    };
    if (v->is_array())
        for (const json::Value& e : v->as_array()) take(e);
    else
        take(*v);
    return ids;
}

std::vector<int32_t> encode_prompt(const GenerateArgs& g, const text::Tokenizer& tok) {
    if (!g.chat) return tok.encode(g.prompt, true);
    const std::vector<text::ChatMessage> messages{text::ChatMessage{"user", g.prompt, std::nullopt}};
    const text::ChatRenderer renderer = text::resolve_chat_renderer(g.chat_format, tok, g.model_dir);
    if (renderer.format)  // a ChatML fast path: the generation prompt opens the assistant's turn
        return tok.encode(text::render_chat_text(messages, *renderer.format, true), false);
    // The model's own template, with its generation prompt (apply_chat_template's add_generation_prompt).
    json::Value conversation = text::conversation_json(messages);
    conversation.set("add_generation_prompt", true);
    return tok.encode(renderer.model_template->render_text(conversation), false);
}

// The new tokens' text, decoded as tokenizer.decode(ids, skip_special_tokens=True) does; ids the
// tokenizer has no token for (embedding rows past its vocabulary) are left out and counted.
class TextStream {
 public:
    TextStream(const text::Tokenizer& tok, bool echo) : tok_(tok), echo_(echo) {}
    void push(int32_t id) {
        if (static_cast<size_t>(id) >= tok_.vocab_size() || !has_token(id)) {
            ++unknown_;
            return;
        }
        ids_.push_back(id);
        if (!echo_) return;
        // Print once the text ends in a whole character (byte-level tokens may split one).
        const std::string t = tok_.decode(ids_, true);
        if (t.size() >= 3 && t.compare(t.size() - 3, 3, "\xEF\xBF\xBD") == 0) return;
        if (t.compare(0, printed_.size(), printed_) != 0) return;
        write(t.substr(printed_.size()));
        printed_ = t;
    }
    std::string finish() {
        const std::string t = tok_.decode(ids_, true);
        if (echo_) {
            write(t.compare(0, printed_.size(), printed_) == 0 ? t.substr(printed_.size()) : "\n" + t);
            write("\n");
        }
        return t;
    }
    int64_t unknown() const { return unknown_; }

 private:
    bool has_token(int32_t id) const {
        try {
            tok_.id_to_token(id);
            return true;
        } catch (const Error&) {
            return false;
        }
    }
    static void write(const std::string& s) {
        if (std::fwrite(s.data(), 1, s.size(), stdout) != s.size() || std::fflush(stdout) != 0)
            fail("generate: error writing standard output");
    }
    const text::Tokenizer& tok_;
    bool echo_;
    std::vector<int32_t> ids_;
    std::string printed_;
    int64_t unknown_ = 0;
};

json::Value id_array(const std::vector<int32_t>& ids) {
    json::Value a = json::Value::array();
    for (int32_t id : ids) a.push_back(json::Value(static_cast<int64_t>(id)));
    return a;
}

}  // namespace

int cmd_generate(const Args& args) {
    const GenerateArgs g = parse_generate_args(args);
    json::Value raw_config;
    const model::ModelSpec cfg = train::read_hf_config(g.model_dir, &raw_config);
    if (!text::Tokenizer::found_in(g.model_dir))
        fail("generate: --model ", g.model_dir.string(),
             " has no tokenizer.json or tiktoken.model (generate needs the model's tokenizer in its directory)");
    const text::Tokenizer tok = text::Tokenizer::load(g.model_dir);
    const std::vector<int32_t> prompt = encode_prompt(g, tok);
    if (prompt.empty()) fail("generate: --prompt encodes to no tokens");
    const int64_t total = static_cast<int64_t>(prompt.size()) + g.options.max_new_tokens;
    if (cfg.max_position_embeddings > 0 && total > cfg.max_position_embeddings)
        fail("generate: the prompt's ", prompt.size(), " tokens + --max-new-tokens ", g.options.max_new_tokens, " = ",
             total, " positions, more than the model's max_position_embeddings (", cfg.max_position_embeddings,
             "); lower --max-new-tokens or shorten --prompt");
    for (int32_t id : prompt)
        if (id >= cfg.vocab_size)
            fail("generate: the tokenizer gives id ", id, ", outside the model's vocab_size ", cfg.vocab_size);
    model::GenerateOptions options = g.options;
    options.eos_ids = read_eos_ids(g.model_dir, raw_config, cfg.vocab_size);
    if (options.eos_ids.empty() && !g.json)
        std::fprintf(stderr, "generate: %s names no eos_token_id; generating %lld tokens\n",
                     g.model_dir.string().c_str(), static_cast<long long>(options.max_new_tokens));

    model::ModelPlacement placement;
    placement.device = g.device;
    // The model keeps a gradient buffer; on the GPU bf16 keeps it at the parameters' size.
    if (g.device == Device::cuda) placement.grad_dtype = DType::bf16;
    const auto m = train::load_hf_model(g.model_dir, nullptr, placement);

    TextStream stream(tok, !g.json);
    const model::GenerateResult r = model::generate(*m, prompt, options, [&](int32_t id) { stream.push(id); });
    const std::string text = stream.finish();
    const int64_t decoded = static_cast<int64_t>(r.tokens.size()) - 1;
    const double decode_rate =
        decoded > 0 && r.decode_seconds > 0 ? static_cast<double>(decoded) / r.decode_seconds : 0;
    if (g.json) {
        json::Value v = json::Value::object();
        v.set("model", g.model_dir.string());
        v.set("device", device_name(g.device));
        v.set("chat", g.chat);
        v.set("prompt_ids", id_array(prompt));
        v.set("output_ids", id_array(r.tokens));
        v.set("text", text);
        v.set("stop", r.stopped_at_eos ? "eos" : "length");
        v.set("prompt_tokens", static_cast<int64_t>(prompt.size()));
        v.set("new_tokens", static_cast<int64_t>(r.tokens.size()));
        v.set("ids_without_token", stream.unknown());
        v.set("prefill_seconds", json::Value(r.prefill_seconds));
        v.set("decode_seconds", json::Value(r.decode_seconds));
        v.set("decode_tokens_per_second", json::Value(decode_rate));
        std::printf("%s\n", v.dump().c_str());
        return 0;
    }
    std::fprintf(stderr,
                 "generate: %zu new tokens (stopped at %s) after a %zu-token prompt on %s; prefill %.3f s, "
                 "decode %.1f tokens/s\n",
                 r.tokens.size(), r.stopped_at_eos ? "EOS" : "--max-new-tokens", prompt.size(), device_name(g.device),
                 r.prefill_seconds, decode_rate);
    if (stream.unknown() > 0)
        std::fprintf(stderr, "generate: %lld generated ids have no token in the tokenizer (left out of the text)\n",
                     static_cast<long long>(stream.unknown()));
    return 0;
}

}  // namespace mf::cli
