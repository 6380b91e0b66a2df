// Chat template rendering speed on one core: conversations per second through the Jinja
// interpreter (text/jinja.h) with the family-style templates of tests/fixtures/chat/families,
// and through the whole training path (render, learned spans, tokenisation with the fixture
// tokenizer) for comparison with the ChatML fast path.
//
// The conversations are built deterministically (64-bit LCG): 2-8 messages alternating user and
// assistant after an optional system message, 20-400 characters each, every fourth assistant turn
// with a tool call and a tool response. Reported: the median of --reps passes, in wall time and in
// this thread's CPU time. Output: one JSON line per template.
//
// A conversation the template refuses (Mistral's alternation check on tool turns) counts in
// render_raised; one whose learned spans the prefix rule cannot find in train_refused.
//
// Then the ChatML fast path (one JSON line per tokenizer template: the fixture tokenizer's, the
// family chatml template and each of tests/fixtures/chat/templates.json): data.chat_format auto is
// resolved (resolve_ms: reading the template and deciding its renderer), and the same
// system/user/assistant conversations (every third answer with inline <think> reasoning) are
// tokenised with their masks by what auto chose and by the interpreter (chat_format jinja).
//
//   bench_chat [--conversations N] [--reps N] [--templates a,b,...]
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/json.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace {

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) mf::fail(path, ": cannot open");
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

struct Lcg {
    uint64_t s = 0x9E3779B97F4A7C15ull;
    uint64_t next() {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return s >> 33;
    }
    size_t below(size_t n) { return static_cast<size_t>(next() % n); }
};

std::string words(Lcg& r, size_t chars) {
    static const char* kWords[] = {"the",    "model", "answer", "is",   "42",    "token", "expert",
                                   "route",  "cat",   "é",      "数据", "Қазақ", "loss",  "grad",
                                   "думать", "\n",    "tool",   "call", "(x)",   "ok."};
    std::string s;
    while (s.size() < chars) {
        if (!s.empty()) s += ' ';
        s += kWords[r.below(sizeof kWords / sizeof kWords[0])];
    }
    return s;
}

mf::json::Value make_conversation(Lcg& r) {
    using mf::json::Value;
    Value msgs = Value::array();
    if (r.below(2) == 0) msgs.push_back(Value(Value::Object{{"role", "system"}, {"content", words(r, 60)}}));
    const size_t turns = 1 + r.below(4);
    for (size_t t = 0; t < turns; ++t) {
        msgs.push_back(Value(Value::Object{{"role", "user"}, {"content", words(r, 20 + r.below(200))}}));
        if (r.below(4) == 0) {
            Value call(Value::Object{
                {"type", "function"},
                {"function",
                 Value(Value::Object{{"name", "search"}, {"arguments", Value(Value::Object{{"q", words(r, 12)}})}})}});
            msgs.push_back(Value(
                Value::Object{{"role", "assistant"}, {"content", ""}, {"tool_calls", Value(Value::Array{call})}}));
            msgs.push_back(Value(Value::Object{{"role", "tool"}, {"name", "search"}, {"content", words(r, 80)}}));
        }
        msgs.push_back(Value(Value::Object{{"role", "assistant"}, {"content", words(r, 20 + r.below(380))}}));
    }
    Value c = Value::object();
    c.set("messages", std::move(msgs));
    return c;
}

std::vector<mf::text::ChatMessage> make_messages(Lcg& r) {
    std::vector<mf::text::ChatMessage> msgs;
    if (r.below(2) == 0) msgs.push_back({"system", words(r, 60), std::nullopt});
    const size_t turns = 1 + r.below(4);
    for (size_t t = 0; t < turns; ++t) {
        msgs.push_back({"user", words(r, 20 + r.below(200)), std::nullopt});
        std::string answer = words(r, 20 + r.below(380));
        if (r.below(3) == 0) answer = "<think>" + words(r, 40) + "</think>" + answer;
        msgs.push_back({"assistant", answer, std::nullopt});
    }
    return msgs;
}

double thread_cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// tokenize_chat of every conversation with `renderer`, median CPU seconds of `reps` passes; -1 when
// the renderer refuses one.
double tokenize_all(const mf::text::Tokenizer& tok, const mf::text::ChatRenderer& renderer,
                    const std::vector<std::vector<mf::text::ChatMessage>>& convs, int reps, size_t* tokens) {
    std::vector<double> cpu;
    for (int rep = 0; rep < reps; ++rep) {
        const double c0 = thread_cpu_seconds();
        *tokens = 0;
        for (const auto& m : convs) {
            try {
                *tokens += mf::text::tokenize_chat(tok, renderer, m, mf::text::LossOn::assistant).input_ids.size();
            } catch (const mf::Error&) {
                return -1;
            }
        }
        cpu.push_back(thread_cpu_seconds() - c0);
    }
    return median(cpu);
}

void bench_fast_path(const std::string& label, const std::filesystem::path& dir,
                     const std::vector<std::vector<mf::text::ChatMessage>>& convs, int reps) {
    const mf::text::Tokenizer tok = mf::text::Tokenizer::load(dir);
    std::vector<double> resolve;
    mf::text::ChatRenderer chosen;
    for (int rep = 0; rep < reps; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        chosen = mf::text::resolve_chat_renderer("auto", tok, dir);
        resolve.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const mf::text::ChatRenderer jinja = mf::text::resolve_chat_renderer("jinja", tok, dir);
    size_t tokens = 0, jinja_tokens = 0;
    const double auto_cpu = tokenize_all(tok, chosen, convs, reps, &tokens);
    const double jinja_cpu = tokenize_all(tok, jinja, convs, 1, &jinja_tokens);
    std::printf(
        "{\"bench\": \"chat_fast_path\", \"template\": \"%s\", \"auto\": \"%s\", \"conversations\": %zu, "
        "\"resolve_ms\": %.2f, \"auto_cpu_s\": %.4f, \"auto_conversations_per_s\": %.0f, \"tokens\": %zu, "
        "\"jinja_cpu_s\": %.4f}\n",
        label.c_str(), chosen.describe().c_str(), convs.size(), 1e3 * median(resolve), auto_cpu,
        auto_cpu > 0 ? static_cast<double>(convs.size()) / auto_cpu : 0.0, tokens, jinja_cpu);
    std::fflush(stdout);
}

// A tokenizer directory holding the fixture tokenizer and `chat_template`.
std::filesystem::path template_dir(const std::string& fixtures, const std::string& name,
                                   const std::string& chat_template) {
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("moeforge_bench_chat_" + name);
    std::filesystem::create_directories(dir);
    std::filesystem::copy_file(fixtures + "/tokenizer/tokenizer.json", dir / "tokenizer.json",
                               std::filesystem::copy_options::overwrite_existing);
    std::ofstream(dir / "tokenizer_config.json") << "{\"eos_token\": \"<|im_end|>\"}";
    std::ofstream(dir / "chat_template.jinja", std::ios::binary) << chat_template;
    return dir;
}

void bench_fast_paths(const std::string& fixtures, size_t num, int reps) {
    Lcg r;
    std::vector<std::vector<mf::text::ChatMessage>> convs;
    for (size_t k = 0; k < num; ++k) convs.push_back(make_messages(r));
    bench_fast_path("fixture tokenizer", fixtures + "/tokenizer", convs, reps);
    const std::filesystem::path chatml =
        template_dir(fixtures, "chatml", read_file(fixtures + "/chat/families/chatml.jinja"));
    bench_fast_path("families/chatml", chatml, convs, reps);
    std::filesystem::remove_all(chatml);
    const mf::json::Value all = mf::json::parse(read_file(fixtures + "/chat/templates.json"), "templates.json");
    const mf::json::Value* listed = all.find("templates");
    for (const auto& [name, t] : (listed != nullptr ? *listed : all).as_object()) {
        const std::filesystem::path dir = template_dir(fixtures, name, t.find("template")->as_string());
        bench_fast_path("templates.json " + name, dir, convs, reps);
        std::filesystem::remove_all(dir);
    }
}

}  // namespace

int main(int argc, char** argv) {
    try {
        size_t num = 10000;
        int reps = 5;
        std::string list = "chatml,deepseek_like,glm_like,harmony_like,kimi_like,mistral_like,nemotron_like";
        for (int i = 1; i + 1 < argc; i += 2) {
            if (std::strcmp(argv[i], "--conversations") == 0)
                num = std::stoul(argv[i + 1]);
            else if (std::strcmp(argv[i], "--reps") == 0)
                reps = std::stoi(argv[i + 1]);
            else if (std::strcmp(argv[i], "--templates") == 0)
                list = argv[i + 1];
            else
                mf::fail("bench_chat: unknown option ", argv[i]);
        }
        const std::string fixtures = std::string(MF_SOURCE_DIR) + "/tests/fixtures";
        const mf::text::Tokenizer tok = mf::text::Tokenizer::load(fixtures + "/tokenizer");
        Lcg r;
        std::vector<mf::json::Value> convs;
        size_t bytes = 0;
        for (size_t k = 0; k < num; ++k) {
            convs.push_back(make_conversation(r));
            bytes += convs.back().dump().size();
        }
        mf::json::Value vars = mf::json::Value::object();
        vars.set("bos_token", "<s>");
        vars.set("eos_token", "</s>");
        std::stringstream names(list);
        std::string name;
        while (std::getline(names, name, ',')) {
            const mf::text::ChatTemplate t = mf::text::ChatTemplate::from_source(
                read_file(fixtures + "/chat/families/" + name + ".jinja"), vars, name);
            std::vector<double> wall, cpu;
            size_t out_bytes = 0, raised = 0;
            for (int rep = 0; rep < reps; ++rep) {
                const auto t0 = std::chrono::steady_clock::now();
                const double c0 = thread_cpu_seconds();
                out_bytes = 0;
                raised = 0;
                for (const mf::json::Value& c : convs) {
                    try {
                        out_bytes += t.render(c).text.size();
                    } catch (const mf::Error&) {
                        ++raised;  // the template refuses the conversation (raise_exception)
                    }
                }
                cpu.push_back(thread_cpu_seconds() - c0);
                wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            }
            // The training path once: spans (prefix renders or generation blocks) and tokens.
            const double c0 = thread_cpu_seconds();
            size_t tokens = 0, refused = 0;
            for (const mf::json::Value& c : convs) {
                try {
                    tokens += mf::text::tokenize_chat(tok, t, c, mf::text::LossOn::assistant).input_ids.size();
                } catch (const mf::Error&) {
                    ++refused;  // a template whose spans the prefix rule cannot find
                }
            }
            const double train_cpu = thread_cpu_seconds() - c0;
            std::printf(
                "{\"bench\": \"chat_render\", \"template\": \"%s\", \"conversations\": %zu, \"input_mb\": %.2f, "
                "\"output_mb\": %.2f, \"render_raised\": %zu, \"render_s\": %.4f, \"render_cpu_s\": %.4f, "
                "\"conversations_per_s\": %.0f, "
                "\"train_path_cpu_s\": %.4f, \"train_tokens\": %zu, \"train_refused\": %zu}\n",
                name.c_str(), num, static_cast<double>(bytes) / 1e6, static_cast<double>(out_bytes) / 1e6, raised,
                median(wall), median(cpu), static_cast<double>(num) / median(cpu), train_cpu, tokens, refused);
            std::fflush(stdout);
        }
        bench_fast_paths(fixtures, num, reps);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_chat: %s\n", e.what());
        return 1;
    }
}
