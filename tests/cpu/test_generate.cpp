// Generation with a KV cache (model/generate.h) and `moeforge generate`.
//
// (a) Cached decoding gives the logits of one forward over the whole sequence at every position,
//     for both attention paths (cached rows, and the prefix-square path the GPU takes), with
//     prefills of several lengths and multi-token chunks after a prefix.
// (b) Greedy output equals HF transformers' greedy generate() on tiny Qwen3-MoE models
//     (tests/fixtures/generate, made by scripts/make_generate_fixture.py in float64): ids exactly,
//     the per-step logits within fp32 rounding; EOS stopping as HF does it (from
//     generation_config.json); the chat case through the CLI, prompt ids and text included.
// (c) Sampling: a seed reproduces, temperature -> 0 and a tiny top-p equal greedy, top-p keeps the
//     nucleus HF's TopPLogitsWarper keeps, draws follow the probabilities.
// (d) Bad options and inputs are clear errors naming the option.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/json.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "model/arch/architecture.h"
#include "model/causal_lm.h"
#include "model/generate.h"
#include "qwen3_config.h"
#include "test_util.h"
#include "text/tokenizer.h"
#include "train/hf_checkpoint.h"

namespace mf {
namespace {

namespace fs = std::filesystem;

fs::path case_dir(const std::string& name) { return fs::path(test::fixtures_dir()) / "generate" / name; }

json::Value expected_json(const std::string& name) {
    const fs::path f = case_dir(name) / "expected.json";
    return json::parse(io::read_text_file(f, 1 << 20), f.string());
}

std::vector<int32_t> ids_of(const json::Value& v, const char* key) {
    std::vector<int32_t> ids;
    for (const json::Value& e : v.find(key)->as_array()) ids.push_back(static_cast<int32_t>(e.as_int()));
    return ids;
}

// A float32 [rows, cols] tensor of an expected.safetensors, as rows.
std::vector<std::vector<float>> rows_of(const fs::path& file, const char* name) {
    const io::SafetensorsFile st = io::SafetensorsFile::open(file);
    const io::StTensor* t = st.find(name);
    EXPECT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dtype, io::StDType::F32);
    const int64_t R = t->shape[0], C = t->shape[1];
    std::vector<std::vector<float>> out(static_cast<size_t>(R), std::vector<float>(static_cast<size_t>(C)));
    for (int64_t r = 0; r < R; ++r) std::memcpy(out[r].data(), t->data + r * C * sizeof(float), C * sizeof(float));
    return out;
}

float max_abs_diff(const float* a, const float* b, size_t n) {
    float m = 0;
    for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
    return m;
}

float max_abs(const std::vector<float>& a) {
    float m = 0;
    for (float x : a) m = std::max(m, std::fabs(x));
    return m;
}

// fp32 against HF's float64 reference: the logits pass through a few layers of fp32 GEMMs, norms
// and softmaxes, each rounding at ~1e-7 relative; 1e-5 of the logits' scale (about 100 ulps) bounds
// that with room (measured: 3.7e-6 on logits up to 4.1), far below the fixtures' smallest top-1/top-2
// gap (1e-2), so a tie never decides a token.
float hf_tolerance(const std::vector<float>& logits) { return 1e-5f * (1.0f + max_abs(logits)); }

// Logits [T, V] of one forward over `ids` (CausalLM::step, the training path).
std::vector<float> full_forward_logits(model::CausalLM& m, const std::vector<int32_t>& ids) {
    const data::Batch b = data::make_row_batch({ids}, {}, static_cast<int64_t>(ids.size()), 0);
    std::vector<float> logits(ids.size() * static_cast<size_t>(m.spec().vocab_size));
    m.step(b, nullptr, logits.data());
    return logits;
}

// Decodes `ids` in chunks (chunk sizes from `chunks`, then one token at a time) and returns the
// logits of every position, [T, V].
std::vector<float> cached_logits(const model::CausalLM& m, const std::vector<int32_t>& ids,
                                 const std::vector<int64_t>& chunks, model::DecodeAttention attention) {
    const int64_t T = static_cast<int64_t>(ids.size());
    const int64_t largest = std::max<int64_t>(1, chunks.empty() ? 1 : *std::max_element(chunks.begin(), chunks.end()));
    model::KvCacheDecoder dec(m, T, largest, attention);
    std::vector<float> out;
    int64_t pos = 0;
    size_t c = 0;
    while (pos < T) {
        const int64_t n = std::min(T - pos, c < chunks.size() ? chunks[c++] : int64_t{1});
        const std::vector<float> l =
            dec.forward(std::span<const int32_t>(ids.data() + pos, static_cast<size_t>(n)), true);
        out.insert(out.end(), l.begin(), l.end());
        pos += n;
        EXPECT_EQ(dec.length(), pos);
    }
    return out;
}

// --- (a) cached decoding = full forward -----------------------------------------------------------

TEST(GenerateKvCache, CachedLogitsEqualFullForwardOnFixtureModel) {
    auto m = train::load_hf_model(case_dir("ids") / "model");
    const json::Value e = expected_json("ids");
    std::vector<int32_t> seq = ids_of(e, "prompt_ids");
    for (int32_t t : ids_of(e, "output_ids")) seq.push_back(t);
    const std::vector<float> full = full_forward_logits(*m, seq);
    const size_t V = static_cast<size_t>(m->spec().vocab_size);
    // HF's float64 forward over the same sequence: our fp32 forward agrees within fp32 rounding.
    const auto hf = rows_of(case_dir("ids") / "expected.safetensors", "full_logits");
    ASSERT_EQ(hf.size(), seq.size());
    float worst = 0;
    for (size_t t = 0; t < seq.size(); ++t) {
        const float d = max_abs_diff(full.data() + t * V, hf[t].data(), V);
        EXPECT_LT(d, hf_tolerance(full)) << "position " << t;
        worst = std::max(worst, d);
    }
    std::printf("full forward vs HF float64: max |diff| %.3g over logits up to %.3g\n", worst, max_abs(full));
    for (const auto attention : {model::DecodeAttention::cached, model::DecodeAttention::prefix_square}) {
        for (const std::vector<int64_t>& chunks : {std::vector<int64_t>{10}, std::vector<int64_t>{1},
                                                   std::vector<int64_t>{4, 3, 5}, std::vector<int64_t>{30}}) {
            const std::vector<float> cached = cached_logits(*m, seq, chunks, attention);
            ASSERT_EQ(cached.size(), full.size());
            for (size_t t = 0; t < seq.size(); ++t) {
                const float d = max_abs_diff(cached.data() + t * V, full.data() + t * V, V);
                // The CPU kernels compute a row's bits independently of the rows beside it (matmul,
                // grouped matmul, norms) and the cached attention does the full attention's row
                // arithmetic, so the cached path equals the full forward bit for bit.
                EXPECT_EQ(d, 0.0f) << "position " << t << ", first chunk " << chunks[0]
                                   << (attention == model::DecodeAttention::cached ? " (cached)" : " (prefix)");
            }
        }
    }
}

TEST(GenerateKvCache, CachedLogitsEqualFullForwardOnRandomModel) {
    // Tied embeddings, norm_topk_prob off, a dense first layer, GQA 8:2, head_dim 32 (lane_dot's
    // blocks and its tail), random weights from the engine's own init.
    test::Qwen3Config c;
    c.vocab_size = 97;
    c.hidden_size = 48;
    c.intermediate_size = 40;
    c.moe_intermediate_size = 24;
    c.num_hidden_layers = 3;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 2;
    c.head_dim = 12;
    c.num_experts = 6;
    c.num_experts_per_tok = 3;
    c.mlp_only_layers = {0};
    c.norm_topk_prob = false;
    c.tie_word_embeddings = true;
    c.max_position_embeddings = 128;
    model::CausalLM m(c);
    m.init_random(5, 0.2f);
    std::vector<int32_t> seq;
    for (int i = 0; i < 37; ++i) seq.push_back((i * 31 + 7) % 97);
    const std::vector<float> full = full_forward_logits(m, seq);
    for (const auto attention : {model::DecodeAttention::cached, model::DecodeAttention::prefix_square}) {
        const std::vector<float> cached = cached_logits(m, seq, {17, 2, 5}, attention);
        ASSERT_EQ(cached.size(), full.size());
        EXPECT_EQ(max_abs_diff(cached.data(), full.data(), full.size()), 0.0f);
    }
}

TEST(GenerateKvCache, CacheIsAllocatedOnceAndBounded) {
    auto m = train::load_hf_model(case_dir("ids") / "model");
    const auto& c = m->spec();
    const auto& a = c.layers[0].branches[0].attention;
    model::KvCacheDecoder dec(*m, 12, 4);
    EXPECT_EQ(dec.cache_bytes(),
              static_cast<size_t>(c.num_layers() * 2 * 12 * a.num_kv_heads * a.head_dim) * sizeof(float));
    EXPECT_TRUE(dec.uses_cached_attention());
    const std::vector<int32_t> four = {1, 2, 3, 4}, five = {1, 2, 3, 4, 5};
    EXPECT_THROW(dec.forward(five), Error);  // more than max_chunk
    for (int i = 0; i < 3; ++i) dec.forward(four);
    const std::vector<int32_t> one = {9};
    try {
        dec.forward(one);
        FAIL() << "decoding past the cache must fail";
    } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find("KV cache"), std::string::npos) << err.what();
    }
    model::KvCacheDecoder dec2(*m, 4, 4);
    const std::vector<int32_t> bad = {1, 200};
    EXPECT_THROW(dec2.forward(bad), Error);  // id outside the vocabulary
}

// --- (b) greedy = HF's greedy generate --------------------------------------------------------------

void expect_hf_greedy(const std::string& name, model::DecodeAttention attention) {
    auto m = train::load_hf_model(case_dir(name) / "model");
    const json::Value e = expected_json(name);
    const std::vector<int32_t> prompt = ids_of(e, "prompt_ids");
    model::GenerateOptions o;
    o.max_new_tokens = e.find("max_new_tokens")->as_int();
    o.keep_logits = true;
    o.attention = attention;
    const model::GenerateResult r = model::generate(*m, prompt, o);
    EXPECT_EQ(r.tokens, ids_of(e, "output_ids")) << name;
    EXPECT_FALSE(r.stopped_at_eos);
    const auto hf = rows_of(case_dir(name) / "expected.safetensors", "step_logits");
    ASSERT_EQ(r.step_logits.size(), hf.size());
    float worst = 0;
    for (size_t s = 0; s < hf.size(); ++s) {
        const float d = max_abs_diff(r.step_logits[s].data(), hf[s].data(), hf[s].size());
        EXPECT_LT(d, hf_tolerance(r.step_logits[s])) << name << " step " << s;
        worst = std::max(worst, d);
    }
    std::printf("%s: %zu greedy tokens equal HF's; step logits vs HF float64: max |diff| %.3g\n", name.c_str(),
                r.tokens.size(), worst);
    // With HF's EOS ids: it stops after producing one, and keeps it.
    o.eos_ids = ids_of(e, "eos_token_id");
    o.keep_logits = false;
    const model::GenerateResult with_eos = model::generate(*m, prompt, o);
    EXPECT_EQ(with_eos.tokens, ids_of(e, "output_ids_with_eos")) << name;
    EXPECT_TRUE(with_eos.stopped_at_eos);
}

TEST(GenerateHfParity, GreedyIdsAndStepLogits) {
    for (const char* name : {"ids", "chat"}) {
        expect_hf_greedy(name, model::DecodeAttention::cached);
        expect_hf_greedy(name, model::DecodeAttention::prefix_square);
    }
}

// A model directory for the CLI: the chat case's model plus the tokenizer fixture's files.
fs::path chat_model_dir(const std::string& tag) {
    const fs::path dir = test::temp_dir("generate_" + tag);
    for (const char* f : {"config.json", "generation_config.json", "model.safetensors"})
        fs::copy_file(case_dir("chat") / "model" / f, dir / f);
    const fs::path tok = fs::path(test::fixtures_dir()) / "tokenizer";
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})
        fs::copy_file(tok / f, dir / f);
    return dir;
}

std::string shell_quote(const std::string& s) {
    std::string q = "'";
    for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    return q + "'";
}

int run_generate(const std::string& args, std::string* out) {
    return test::run_command(test::moeforge_binary() + " generate " + args, out);
}

json::Value last_json_line(const std::string& out) {
    const size_t start = out.rfind("\n{");
    return json::parse(out.substr(start == std::string::npos ? 0 : start + 1), "generate --json output");
}

// A template that is not ChatML is rendered by the interpreter, with its own generation prompt: the
// prompt ids are the encoding of "[INST] <prompt> [/INST]ANSWER:" (worked out from the template below).
TEST(GenerateCli, ChatPromptThroughANonChatmlTemplate) {
    const fs::path dir = chat_model_dir("chat_jinja");
    json::Value cfg = json::parse(io::read_text_file(dir / "tokenizer_config.json", 1 << 20), "tokenizer_config.json");
    cfg.set("chat_template",
            "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
            "{% if add_generation_prompt %}ANSWER:{% endif %}");
    test::write_file(dir / "tokenizer_config.json", cfg.dump(2));
    std::string out;
    ASSERT_EQ(run_generate("--model " + dir.string() +
                               " --chat --prompt 'two words' --max-new-tokens 1 --device cpu "
                               "--json",
                           &out),
              0)
        << out;
    const std::vector<int32_t> ids = ids_of(last_json_line(out), "prompt_ids");
    const text::Tokenizer tok = text::Tokenizer::load(dir);
    EXPECT_EQ(ids, tok.encode("[INST] two words [/INST]ANSWER:", false));
    fs::remove_all(dir);
}

TEST(GenerateCli, ChatPromptMatchesHfApplyChatTemplateAndGreedyGenerate) {
    const fs::path dir = chat_model_dir("chat");
    const json::Value e = expected_json("chat");
    const std::string prompt = e.find("prompt_text")->as_string();
    std::string out;
    ASSERT_EQ(run_generate("--model " + dir.string() + " --chat --prompt " + shell_quote(prompt) +
                               " --max-new-tokens 16 --device cpu --json",
                           &out),
              0)
        << out;
    const json::Value v = last_json_line(out);
    EXPECT_EQ(ids_of(v, "prompt_ids"), ids_of(e, "prompt_ids"));
    // EOS from generation_config.json, as HF takes it.
    EXPECT_EQ(ids_of(v, "output_ids"), ids_of(e, "output_ids_with_eos"));
    EXPECT_EQ(v.find("stop")->as_string(), "eos");
    EXPECT_EQ(v.find("text")->as_string(), e.find("output_text_with_eos")->as_string());

    // The same text as a plain prompt: tokenizer(text), no EOS met within 16 tokens.
    out.clear();
    ASSERT_EQ(run_generate("--model " + dir.string() + " --prompt " + shell_quote(prompt) +
                               " --max-new-tokens 16 --device cpu --json",
                           &out),
              0)
        << out;
    const json::Value p = last_json_line(out);
    EXPECT_EQ(ids_of(p, "prompt_ids"), ids_of(e, "plain_prompt_ids"));
    EXPECT_EQ(ids_of(p, "output_ids"), ids_of(e, "plain_output_ids"));
    EXPECT_EQ(p.find("stop")->as_string(), "length");

    // Text mode prints the continuation on stdout and a summary on stderr.
    out.clear();
    ASSERT_EQ(
        run_generate("--model " + dir.string() + " --chat --prompt " + shell_quote(prompt) + " --device cpu", &out), 0)
        << out;
    EXPECT_NE(out.find(e.find("output_text_with_eos")->as_string()), std::string::npos) << out;
    EXPECT_NE(out.find("stopped at EOS"), std::string::npos) << out;

    // Sampling through the CLI is reproducible from the seed.
    std::string a, b;
    const std::string sample = "--model " + dir.string() +
                               " --prompt hi --max-new-tokens 12 --temperature 1.5 "
                               "--top-p 0.9 --seed 11 --device cpu --json";
    ASSERT_EQ(run_generate(sample, &a), 0) << a;
    ASSERT_EQ(run_generate(sample, &b), 0) << b;
    EXPECT_EQ(ids_of(last_json_line(a), "output_ids"), ids_of(last_json_line(b), "output_ids"));
    fs::remove_all(dir);
}

// --- (c) sampling -------------------------------------------------------------------------------------

TEST(GenerateSampling, GreedyIsArgmaxWithLowestIdOnTies) {
    const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
    EXPECT_EQ(model::greedy_token(l), 1);
    model::TokenSampler greedy({0.0, 1.0, 3});
    EXPECT_EQ(greedy.next(l), 1);
    const std::vector<float> bad = {0.0f, NAN};
    EXPECT_THROW(model::greedy_token(bad), Error);
}

TEST(GenerateSampling, TopPKeepsTheNucleusAndDrawsFollowProbabilities) {
    // probabilities 0.5, 0.3, 0.2 (token 2, 0, 1 after softmax of log p)
    const std::vector<float> l = {std::log(0.3f), std::log(0.2f), std::log(0.5f)};
    auto frequencies = [&](double top_p, uint64_t seed) {
        model::TokenSampler s({1.0, top_p, seed});
        std::vector<int> counts(3, 0);
        for (int i = 0; i < 20000; ++i) ++counts[static_cast<size_t>(s.next(l))];
        return counts;
    };
    // top_p 0.5: the most likely token alone already holds 0.5, so it alone is kept (HF removes
    // tokens whose ascending cumulative probability is <= 1 - top_p).
    EXPECT_EQ(frequencies(0.5, 1), (std::vector<int>{0, 0, 20000}));
    // top_p 0.6: tokens 2 and 0, renormalised to 0.625 / 0.375.
    const std::vector<int> c = frequencies(0.6, 2);
    EXPECT_EQ(c[1], 0);
    EXPECT_NEAR(c[2] / 20000.0, 0.625, 0.015);
    EXPECT_NEAR(c[0] / 20000.0, 0.375, 0.015);
    // top_p 1: all three.
    const std::vector<int> all = frequencies(1.0, 3);
    EXPECT_NEAR(all[2] / 20000.0, 0.5, 0.015);
    EXPECT_NEAR(all[0] / 20000.0, 0.3, 0.015);
    EXPECT_NEAR(all[1] / 20000.0, 0.2, 0.015);
}

TEST(GenerateSampling, SeedReproducesAndLimitsEqualGreedy) {
    auto m = train::load_hf_model(case_dir("ids") / "model");
    const json::Value e = expected_json("ids");
    const std::vector<int32_t> prompt = ids_of(e, "prompt_ids"), greedy = ids_of(e, "output_ids");
    auto run = [&](double temperature, double top_p, uint64_t seed) {
        model::GenerateOptions o;
        o.max_new_tokens = 20;
        o.sampling = {temperature, top_p, seed};
        return model::generate(*m, prompt, o).tokens;
    };
    const auto a = run(1.0, 1.0, 42), b = run(1.0, 1.0, 42);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a.size(), 20u);
    // A different seed gives a different sequence (20 draws over a 128-token vocabulary at T = 1).
    EXPECT_NE(run(1.0, 1.0, 43), a);
    EXPECT_EQ(run(1e-6, 1.0, 42), greedy);  // temperature -> 0
    EXPECT_EQ(run(1.0, 1e-9, 42), greedy);  // the nucleus is the argmax alone
    EXPECT_EQ(run(0.7, 1e-9, 99), greedy);
    EXPECT_EQ(run(0.0, 0.5, 7), greedy);  // temperature 0 is greedy whatever top_p
    EXPECT_THROW(model::TokenSampler({-1.0, 1.0, 0}), Error);
    EXPECT_THROW(model::TokenSampler({1.0, 0.0, 0}), Error);
    EXPECT_THROW(model::TokenSampler({1.0, 1.5, 0}), Error);
}

// --- (d) errors -------------------------------------------------------------------------------------

TEST(GenerateErrors, GenerateRefusesBadArguments) {
    auto m = train::load_hf_model(case_dir("ids") / "model");
    model::GenerateOptions o;
    EXPECT_THROW(model::generate(*m, std::vector<int32_t>{}, o), Error);
    o.max_new_tokens = 60;  // 10 + 60 > max_position_embeddings 64
    try {
        model::generate(*m, std::vector<int32_t>(10, 1), o);
        FAIL() << "expected an error";
    } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find("max_position_embeddings"), std::string::npos) << err.what();
    }
    o.max_new_tokens = -1;
    EXPECT_THROW(model::generate(*m, std::vector<int32_t>(3, 1), o), Error);
}

struct BadCase {
    std::string args, expected;
};

TEST(GenerateErrors, CliNamesTheOption) {
    const fs::path dir = chat_model_dir("errors");
    const fs::path no_tok = test::temp_dir("generate_no_tokenizer");
    for (const char* f : {"config.json", "generation_config.json", "model.safetensors"})
        fs::copy_file(case_dir("chat") / "model" / f, no_tok / f);
    const std::string md = "--model " + dir.string() + " ";
    const std::vector<BadCase> cases = {
        {"--prompt hi", "missing required option --model"},
        {"--model /nonexistent/model/dir --prompt hi", "no such directory"},
        {"--model " + (dir / "config.json").string() + " --prompt hi", "not a directory"},
        {"--model " + no_tok.string() + " --prompt hi", "no tokenizer.json"},
        {md, "missing required option --prompt"},
        {md + "--prompt ''", "--prompt is empty"},
        {md + "--prompt hi --max-new-tokens -3", "--max-new-tokens"},
        {md + "--prompt hi --max-new-tokens ten", "--max-new-tokens"},
        {md + "--prompt hi --temperature -0.5", "--temperature"},
        {md + "--prompt hi --temperature nan", "--temperature"},
        {md + "--prompt hi --top-p 0", "--top-p"},
        {md + "--prompt hi --top-p 1.5", "--top-p"},
        {md + "--prompt hi --top-p x", "--top-p"},
        {md + "--prompt hi --seed -1", "--seed"},
        {md + "--prompt hi --device tpu", "--device"},
        {md + "--prompt hi --chat-format chatml", "--chat-format only applies with --chat"},
        {md + "--prompt hi --chat --chat-format bogus", "chatml"},
        {md + "--prompt hi --max-new-tokens 200", "max_position_embeddings"},
        {md + "--prompt hi --bogus 1", "unknown option --bogus"},
        {md + "--prompt", "needs a value"},
    };
    for (const BadCase& c : cases) {
        std::string out;
        EXPECT_EQ(run_generate(c.args, &out), 1) << c.args << "\n" << out;
        EXPECT_NE(out.find(c.expected), std::string::npos) << c.args << "\n" << out;
        EXPECT_EQ(out.find("internal error"), std::string::npos) << c.args << "\n" << out;
    }
    // A malformed generation_config.json names the file and the field.
    test::write_file(dir / "generation_config.json", "{\"eos_token_id\": \"<|im_end|>\"}");
    std::string out;
    EXPECT_EQ(run_generate(md + "--prompt hi --max-new-tokens 2", &out), 1) << out;
    EXPECT_NE(out.find("generation_config.json: eos_token_id"), std::string::npos) << out;
    fs::remove_all(dir);
    fs::remove_all(no_tok);
}

// Every family's branches through the KV-cache decoder: no QK-norm (mixtral), full-width QK-norm
// (olmoe), q/k/v biases and a gated shared expert (qwen2_moe), each row bit for bit the full forward's.
TEST(GenerateKvCache, CachedLogitsEqualFullForwardForEveryFamily) {
    for (const char* arch : {"mixtral", "olmoe", "qwen2_moe"}) {
        SCOPED_TRACE(arch);
        json::Value config = model::find_architecture(arch, "test").tiny_preset();
        config.set("vocab_size", 97);
        model::CausalLM m(model::parse_model_config(config, arch));
        m.init_random(7, 0.2f);
        // Biases away from zero, so that they count.
        std::vector<float> host(static_cast<size_t>(m.num_params()));
        m.get_params_to_host(host.data());
        for (const model::ParamSpec& s : m.params().specs())
            if (s.role == model::ParamRole::bias)
                for (int64_t i = 0; i < s.numel; ++i)
                    host[static_cast<size_t>(s.offset + i)] = 0.05f * static_cast<float>(i % 7) - 0.15f;
        m.set_params_from_host(host.data());
        std::vector<int32_t> seq;
        for (int i = 0; i < 29; ++i) seq.push_back((i * 37 + 11) % 97);
        const std::vector<float> full = full_forward_logits(m, seq);
        for (const auto attention : {model::DecodeAttention::cached, model::DecodeAttention::prefix_square}) {
            const std::vector<float> cached = cached_logits(m, seq, {13, 1, 4}, attention);
            ASSERT_EQ(cached.size(), full.size());
            EXPECT_EQ(max_abs_diff(cached.data(), full.data(), full.size()), 0.0f);
        }
    }
}

}  // namespace
}  // namespace mf
