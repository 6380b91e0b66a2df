// SFT dataset and loader tests: every record kind against encodings computed here from the
// tokenizer, auto detection, one error (naming FILE:LINE) per kind of malformed line, skip mode
// counts, setup errors that stop even in skip mode, and data-parallel sharding of the loader
// (the ranks' rows of a step stacked = one rank with micro_batch x world; state restores exactly).
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <set>

#include "core/json.h"
#include "data/line_reader.h"
#include "data/loader.h"
#include "data/sft_dataset.h"
#include "data/token_dataset.h"
#include "test_util.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace fs = std::filesystem;
using mf::data::Batch;
using mf::data::Document;
using mf::data::Loader;
using mf::data::LoaderShard;
using mf::data::LoaderState;
using mf::data::SftFormat;
using mf::data::SftOptions;
using mf::data::TokenDataset;
using mf::text::Tokenizer;

namespace {

constexpr int32_t kIgnore = -100;

fs::path tokenizer_dir() { return fs::path(mf::test::fixtures_dir()) / "tokenizer"; }

const Tokenizer& tok() {
    static const Tokenizer t = Tokenizer::load(tokenizer_dir());
    return t;
}

SftOptions options(SftFormat format = SftFormat::auto_detect) {
    SftOptions o;
    o.format = format;
    o.tokenizer_dir = tokenizer_dir();
    o.vocab_size = static_cast<int64_t>(tok().vocab_size());
    return o;
}

class SftTest : public ::testing::Test {
 protected:
    void SetUp() override { dir_ = mf::test::temp_dir("sft_dataset"); }
    void TearDown() override { fs::remove_all(dir_); }
    fs::path write(const std::string& name, const std::string& content) {
        const fs::path p = dir_ / name;
        mf::test::write_file(p, content);
        return p;
    }
    TokenDataset read(const std::string& content, const SftOptions& o, SftFormat* detected = nullptr) {
        return mf::data::read_sft_jsonl(write("data.jsonl", content), &tok(), o, detected);
    }
    std::string error_of(const std::string& content, const SftOptions& o) {
        try {
            read(content, o);
        } catch (const mf::Error& e) {
            return e.what();
        }
        return "";
    }
    fs::path dir_;
};

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

std::vector<int32_t> learned_ids(const Document& d) {
    std::vector<int32_t> out;
    for (size_t t = 0; t < d.labels.size(); ++t)
        if (d.labels[t] != kIgnore) out.push_back(d.labels[t]);
    return out;
}

}  // namespace

// --- record kinds ------------------------------------------------------------------------------------

TEST_F(SftTest, MessagesUseTheTokenizersTemplate) {
    SftFormat kind;
    const TokenDataset ds =
        read(R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "id": 7})"
             "\n\n"
             R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, )"
             R"({"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}, )"
             R"({"role": "assistant", "content": "Bye!"}]})"
             "\n",
             options(), &kind);
    EXPECT_EQ(kind, SftFormat::messages);
    ASSERT_EQ(ds.docs.size(), 2u);
    EXPECT_EQ(ds.skipped_lines, 0);
    // The fixture tokenizer's template writes a default system message when there is none.
    EXPECT_EQ(
        ds.docs[0].input_ids,
        tok().encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>"
                     "\n<|im_start|>assistant\n4<|im_end|>\n"));
    EXPECT_EQ(tok().decode(learned_ids(ds.docs[0])), "4<|im_end|>\n");
    EXPECT_EQ(tok().decode(learned_ids(ds.docs[1])), "Hello<|im_end|>\nBye!<|im_end|>\n");

    // A named chat format must be the template's own (naming another is an error: test_chat); loss_on: all
    // learns every token.
    SftOptions o = options(SftFormat::messages);
    o.chat_format = "chatml_system";
    o.loss_on = mf::text::LossOn::all;
    const TokenDataset plain =
        read(R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})", o);
    EXPECT_EQ(
        plain.docs[0].input_ids,
        tok().encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>"
                     "\n<|im_start|>assistant\n4<|im_end|>\n"));
    EXPECT_EQ(plain.docs[0].labels, plain.docs[0].input_ids);
}

// A model whose template is not ChatML: chat_format auto runs it through the interpreter, with
// data.chat_template_kwargs among its variables.
TEST_F(SftTest, MessagesThroughTheModelsOwnTemplate) {
    const fs::path tdir = dir_ / "mistral";
    fs::create_directories(tdir);
    fs::copy_file(tokenizer_dir() / "tokenizer.json", tdir / "tokenizer.json");
    mf::test::write_file(tdir / "tokenizer_config.json",
                         R"({"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})");
    mf::test::write_file(tdir / "chat_template.jinja",
                         "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}"
                         "{{ suffix }}[/INST]{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}");
    const Tokenizer t = Tokenizer::load(tdir);
    SftOptions o = options(SftFormat::messages);
    o.tokenizer_dir = tdir;
    o.chat_template_kwargs = mf::json::parse(R"({"suffix": "!"})", "kwargs");
    const TokenDataset ds = mf::data::read_sft_jsonl(
        write("m.jsonl", R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})"
                         "\n"),
        &t, o);
    ASSERT_EQ(ds.docs.size(), 1u);
    EXPECT_EQ(ds.docs[0].input_ids, t.encode("<|endoftext|>[INST] 2+2?![/INST] 4<|im_end|>"));
    EXPECT_EQ(t.decode(learned_ids(ds.docs[0])), " 4<|im_end|>");
}

// Tool calls and tool messages: the fast path does not render them, the model's template does
// (here the fixture tokenizer's template, which prints a tool message as a turn of its own).
TEST_F(SftTest, ToolCallsGoThroughTheModelsTemplate) {
    const std::string rec =
        R"({"messages": [{"role": "user", "content": "Sum?"},)"
        R"( {"role": "assistant", "content": "Calling.", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},)"
        R"( {"role": "tool", "content": "2"}, {"role": "assistant", "content": "It is 2."}]})";
    const TokenDataset ds = read(rec + "\n", options(SftFormat::messages));
    ASSERT_EQ(ds.docs.size(), 1u);
    const std::string text =
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nSum?<|im_end|>\n"
        "<|im_start|>assistant\nCalling.<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\nIt is "
        "2.<|im_end|>\n";
    EXPECT_EQ(ds.docs[0].input_ids, tok().encode(text));
    EXPECT_EQ(tok().decode(learned_ids(ds.docs[0])), "Calling.<|im_end|>\nIt is 2.<|im_end|>\n");
    // The record itself is not changed by a prompt/completion split.
    const TokenDataset pc =
        read(R"({"prompt": [{"role": "user", "content": "Sum?"}], "completion": [{"role": "assistant", "content": "x",)"
             R"( "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {}}}]}]})"
             "\n",
             options(SftFormat::prompt_completion));
    ASSERT_EQ(pc.docs.size(), 1u);
    EXPECT_EQ(tok().decode(learned_ids(pc.docs[0])), "x<|im_end|>\n");
}

TEST_F(SftTest, PromptCompletionStrings) {
    const int32_t eos = *tok().eos_id;
    const std::string p = "Question: what is 2 + 2?\nAnswer:", c = " 4";
    const TokenDataset ds =
        read(mf::json::Value(mf::json::Value::Object{{"prompt", p}, {"completion", c}}).dump(), options());
    ASSERT_EQ(ds.docs.size(), 1u);
    const Document& d = ds.docs[0];
    EXPECT_EQ(d.input_ids, concat(tok().encode(p + c, true), {eos}));
    const size_t n_prompt = tok().encode(p, true).size();
    ASSERT_LT(n_prompt, d.input_ids.size());
    for (size_t t = 0; t < d.labels.size(); ++t) EXPECT_EQ(d.labels[t], t < n_prompt ? kIgnore : d.input_ids[t]) << t;
    EXPECT_EQ(tok().decode(learned_ids(d)), " 4<|im_end|>");

    // A token straddling the boundary ("\n" + "\n" merge) is learned, as HF's masks do.
    const TokenDataset straddle = read(R"({"prompt": "Say it:\n", "completion": "\nhello"})", options());
    const Document& s = straddle.docs[0];
    EXPECT_EQ(s.input_ids, concat(tok().encode("Say it:\n\nhello", true), {eos}));
    const std::string learned = tok().decode(learned_ids(s));
    EXPECT_EQ(learned.substr(learned.size() - std::string("hello<|im_end|>").size()), "hello<|im_end|>");
    EXPECT_NE(learned.find('\n'), std::string::npos) << "the straddling token is not learned";

    SftOptions all = options();
    all.loss_on = mf::text::LossOn::all;
    EXPECT_EQ(read(R"({"prompt": "a", "completion": "b"})", all).docs[0].labels,
              concat(tok().encode("ab", true), {eos}));
    // eos is not doubled when the completion already ends with it.
    EXPECT_EQ(read(R"({"prompt": "a", "completion": "b<|im_end|>"})", options()).docs[0].input_ids,
              concat(tok().encode("ab", true), {eos}));
}

TEST_F(SftTest, PromptCompletionConversational) {
    // Few-shot prompt: its assistant turn is not learned, the completion's is.
    const std::string line =
        R"({"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}, )"
        R"({"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]})";
    const TokenDataset ds = read(line, options());
    ASSERT_EQ(ds.docs.size(), 1u);
    const TokenDataset as_messages =
        read(R"({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}, )"
             R"({"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})",
             options());
    EXPECT_EQ(ds.docs[0].input_ids, as_messages.docs[0].input_ids);
    EXPECT_EQ(tok().decode(learned_ids(ds.docs[0])), "4<|im_end|>\n");
    EXPECT_EQ(tok().decode(learned_ids(as_messages.docs[0])), "2<|im_end|>\n4<|im_end|>\n");
}

TEST_F(SftTest, TextAndTokens) {
    const int32_t eos = *tok().eos_id;
    SftFormat kind;
    const TokenDataset text =
        read("{\"text\": \"Hello world\"}\n{\"text\": \"Сәлем, әлем!\", \"source\": \"kk\"}\n", options(), &kind);
    EXPECT_EQ(kind, SftFormat::text);
    ASSERT_EQ(text.docs.size(), 2u);
    EXPECT_EQ(text.docs[0].input_ids, concat(tok().encode("Hello world", true), {eos}));
    EXPECT_EQ(text.docs[0].labels, text.docs[0].input_ids);
    EXPECT_EQ(text.docs[1].input_ids, concat(tok().encode("Сәлем, әлем!", true), {eos}));

    const std::string tokens = "{\"input_ids\": [5, 6, 7], \"labels\": [-100, 6, 7]}\n{\"input_ids\": [8, 9]}\r\n";
    const TokenDataset a = read(tokens, options(), &kind);
    EXPECT_EQ(kind, SftFormat::tokens);
    const TokenDataset b = mf::data::read_token_jsonl(write("t.jsonl", tokens), options().vocab_size, false);
    ASSERT_EQ(a.docs.size(), b.docs.size());
    for (size_t i = 0; i < a.docs.size(); ++i) {
        EXPECT_EQ(a.docs[i].input_ids, b.docs[i].input_ids);
        EXPECT_EQ(a.docs[i].labels, b.docs[i].labels);
    }
    // Token data needs no tokenizer.
    const TokenDataset c = mf::data::read_sft_jsonl(write("t2.jsonl", tokens), nullptr, options());
    EXPECT_EQ(c.docs.size(), 2u);
}

TEST_F(SftTest, FormatNames) {
    for (SftFormat f : {SftFormat::auto_detect, SftFormat::tokens, SftFormat::messages, SftFormat::prompt_completion,
                        SftFormat::text})
        EXPECT_EQ(mf::data::parse_sft_format(mf::data::sft_format_name(f)), f);
    EXPECT_THROW(mf::data::parse_sft_format("chat"), mf::Error);
}

// --- errors ------------------------------------------------------------------------------------------

TEST_F(SftTest, EveryMalformedLineNamesFileLineAndProblem) {
    const std::string good =
        R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})";
    struct Case {
        std::string line, expect;
        SftFormat format = SftFormat::auto_detect;
    };
    const std::vector<Case> cases = {
        {R"({"messages": [{"role": "user", "content": "Hi"})", ": column 48: invalid JSON"},  // invalid JSON
        {R"([1, 2, 3])", "expected a JSON object"},
        {R"({"messages": "Hi"})", "must be an array of messages"},
        {R"({"messages": []})", "is empty"},
        {R"({"messages": ["Hi"]})", "messages[0]: expected an object"},
        {R"({"messages": [{"content": "Hi"}]})", "messages[0]: missing field \"role\""},
        // Tool messages, tool calls and content parts go through the model's template, which decides.
        {R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": 5}]})",
         "unsupported operand type(s) for +: 'str' and 'int'"},
        {R"({"messages": [{"role": "user"}]})", "messages[0]: missing field \"content\""},
        {R"({"messages": [{"role": "user", "content": ["Hi"]}]})",
         "unsupported operand type(s) for +: 'str' and 'list'"},
        {R"({"messages": [{"role": 3, "content": "Hi"}]})", "field \"role\" must be a string"},
        {R"({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 1}]})",
         "\"reasoning_content\" must be a string"},
        {R"({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}]})",
         "cannot find assistant message 0's span"},
        {R"({"messages": [{"role": "user", "content": "no answer"}]})", "nothing to learn"},
        {R"({"text": "Hi"})", "a text record, but the file holds messages records (from line 1)"},
        {R"({"messages": [], "text": "x"})", "fields of two record kinds"},
        {R"({"conversation": []})", "no dataset field"},
        {R"({"prompt": "Hi"})", "missing field \"completion\"", SftFormat::prompt_completion},
        {R"({"prompt": "Hi", "completion": [{"role": "assistant", "content": "Yo"}]})", "must both be strings",
         SftFormat::prompt_completion},
        {R"({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "user", "content": "Yo"}]})",
         "the completion has no assistant message", SftFormat::prompt_completion},
        {R"({"text": 5})", "field \"text\" must be a string", SftFormat::text},
        {R"({"text": ""})", "field \"text\" is empty", SftFormat::text},
        {R"({"input_ids": [1, 99999]})", "outside the vocabulary", SftFormat::tokens},
        {R"({"input_ids": [1, 2], "labels": [1]})", "\"labels\" has 1 entries", SftFormat::tokens},
        {R"({"input_ids": [1, 2], "mask": [1, 1]})", "unknown field \"mask\"", SftFormat::tokens},
        {R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})",
         "a messages record, but data.format is text", SftFormat::text},
    };
    std::set<std::string> messages;
    for (const Case& c : cases) {
        SftOptions o = options(c.format);
        // The bad line comes second, after a good line of the same kind (or first where the format is set).
        const bool lead = c.format == SftFormat::auto_detect;
        const std::string content = (lead ? good + "\n" : std::string()) + c.line + "\n";
        const std::string err = error_of(content, o);
        ASSERT_FALSE(err.empty()) << "accepted: " << c.line;
        const std::string where = (dir_ / "data.jsonl").string() + ":" + (lead ? "2" : "1") + ": ";
        EXPECT_EQ(err.rfind(where, 0), 0u) << err;
        EXPECT_NE(err.find(c.expect), std::string::npos) << c.line << "\n -> " << err;
        messages.insert(err.substr(where.size()));
    }
    EXPECT_EQ(messages.size(), cases.size()) << "two malformed lines got the same message";
}

TEST_F(SftTest, SkipModeCountsBadLines) {
    SftOptions o = options();
    o.skip_bad_lines = true;
    const std::string good =
        R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})";
    const std::string content = "not json\n" + good + "\n" + R"({"messages": []})" + "\n\n" + good + "\n" +
                                R"({"text": "wrong kind"})" + "\n" + good + "\n";
    SftFormat kind;
    const TokenDataset ds = read(content, o, &kind);
    EXPECT_EQ(kind, SftFormat::messages);  // from line 2, the first valid line
    EXPECT_EQ(ds.docs.size(), 3u);
    EXPECT_EQ(ds.skipped_lines, 3);
    EXPECT_EQ(ds.first_skip_reason.rfind((dir_ / "data.jsonl").string() + ":1: ", 0), 0u) << ds.first_skip_reason;
    // Nothing usable: an error that says why.
    const std::string err = error_of("nope\n{\"messages\": []}\n", o);
    EXPECT_NE(err.find("no usable records (2 bad lines skipped"), std::string::npos) << err;
    EXPECT_NE(err.find(":1: "), std::string::npos) << err;
}

TEST_F(SftTest, SetupErrorsStopEvenInSkipMode) {
    SftOptions o = options();
    o.skip_bad_lines = true;
    const std::string msg =
        R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})";
    // A tokenizer whose template does not parse, with chat_format auto.
    const fs::path tdir = dir_ / "tokenizer";
    fs::create_directories(tdir);
    fs::copy_file(tokenizer_dir() / "tokenizer.json", tdir / "tokenizer.json");
    mf::test::write_file(tdir / "tokenizer_config.json",
                         R"({"eos_token": "<|im_end|>", "chat_template": "{{ bos_token }}{% for m in messages %}"})");
    const Tokenizer odd = Tokenizer::load(tdir);
    o.tokenizer_dir = tdir;
    try {
        mf::data::read_sft_jsonl(write("m.jsonl", msg + "\n"), &odd, o);
        FAIL() << "a template that does not parse was accepted";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("data.chat_format"), std::string::npos) << e.what();
    }
    o.chat_format = "chatml_think";  // naming a format the template does not render is an error too
    try {
        mf::data::read_sft_jsonl(write("m.jsonl", msg + "\n"), &odd, o);
        FAIL() << "a chat format unlike the model's template was accepted";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("cannot check the chat template against chatml_think"), std::string::npos)
            << e.what();
    }
    // Text without a tokenizer; text with a tokenizer that has no eos token.
    try {
        mf::data::read_sft_jsonl(write("t.jsonl", "{\"text\": \"a\"}\n"), nullptr, o);
        FAIL();
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("need a tokenizer"), std::string::npos) << e.what();
    }
    mf::test::write_file(tdir / "tokenizer_config.json", "{}");
    const Tokenizer no_eos = Tokenizer::load(tdir);
    try {
        mf::data::read_sft_jsonl(write("t.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n"), &no_eos, o);
        FAIL();
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find(":1: the tokenizer has no eos_token"), std::string::npos) << e.what();
    }
    // Ids the tokenizer makes but the model has no row for.
    try {
        SftOptions small = options();
        small.vocab_size = 50;
        mf::data::read_sft_jsonl(write("t.jsonl", "{\"text\": \"zebra crossing\"}\n"), &tok(), small);
        FAIL();
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("outside the model's vocabulary [0, 50)"), std::string::npos) << e.what();
    }
    EXPECT_THROW(mf::data::read_sft_jsonl(dir_ / "missing.jsonl", &tok(), options()), mf::Error);
}

// --- loader: data-parallel sharding ----------------------------------------------------------------------

namespace {

std::vector<Document> random_docs(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<Document> docs(n);
    for (size_t i = 0; i < n; ++i) {
        const size_t len = 1 + rng() % 45;  // some longer than seq_len
        for (size_t t = 0; t < len; ++t) {
            docs[i].input_ids.push_back(static_cast<int32_t>(1 + rng() % 1000));
            docs[i].labels.push_back(rng() % 4 == 0 ? kIgnore : docs[i].input_ids.back());
        }
    }
    return docs;
}

// Rows [r*B, (r+1)*B) of the stacked batch.
void expect_rows_equal(const Batch& whole, const Batch& part, int64_t rank, const std::string& where) {
    const size_t off = static_cast<size_t>(rank * part.B * part.T);
    const size_t n = static_cast<size_t>(part.B * part.T);
    ASSERT_EQ(part.T, whole.T);
    for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(part.input_ids[i], whole.input_ids[off + i]) << where << " i=" << i;
        ASSERT_EQ(part.targets[i], whole.targets[off + i]) << where << " i=" << i;
        ASSERT_EQ(part.positions[i], whole.positions[off + i]) << where << " i=" << i;
        ASSERT_EQ(part.doc_ids[i], whole.doc_ids[off + i]) << where << " i=" << i;
        ASSERT_EQ(part.is_pad[i], whole.is_pad[off + i]) << where << " i=" << i;
    }
}

}  // namespace

TEST(LoaderShardTest, RanksStackToOneRankWithWorldTimesMicroBatch) {
    const std::vector<Document> docs = random_docs(37, 11);
    const int64_t T = 32, B = 2;
    for (bool packing : {true, false}) {
        for (int64_t world : {1, 2, 3, 4}) {
            Loader single(&docs, T, B * world, packing, true, 5);
            std::vector<Loader> ranks;
            for (int64_t r = 0; r < world; ++r)
                ranks.emplace_back(&docs, T, B, packing, true, 5, 0, LoaderShard{r, world});
            int64_t real_tokens = 0;
            for (int step = 0; step < 40; ++step) {  // several epochs
                const Batch whole = single.next();
                ASSERT_EQ(whole.B, B * world);
                for (int64_t r = 0; r < world; ++r) {
                    const Batch part = ranks[static_cast<size_t>(r)].next();
                    ASSERT_EQ(part.B, B);
                    expect_rows_equal(whole, part, r,
                                      "packing " + std::to_string(packing) + " world " + std::to_string(world) +
                                          " step " + std::to_string(step) + " rank " + std::to_string(r));
                    EXPECT_EQ(ranks[static_cast<size_t>(r)].state().epoch, single.state().epoch);
                    EXPECT_EQ(ranks[static_cast<size_t>(r)].state().cursor, single.state().cursor);
                }
                real_tokens += whole.num_real_tokens();
            }
            EXPECT_GT(single.state().epoch, 0) << "the test should cross an epoch";
            EXPECT_GT(real_tokens, 0);
        }
    }
}

TEST(LoaderShardTest, RanksSeeDifferentRowsAndStateRestores) {
    const std::vector<Document> docs = random_docs(50, 3);
    const int64_t T = 24, B = 3, world = 2;
    Loader r0(&docs, T, B, true, true, 9, 0, LoaderShard{0, world});
    Loader r1(&docs, T, B, true, true, 9, 0, LoaderShard{1, world});
    EXPECT_NE(r0.next().input_ids, r1.next().input_ids);
    for (int i = 0; i < 6; ++i) r1.next();
    const LoaderState saved = r1.state();
    std::vector<Batch> after;
    for (int i = 0; i < 30; ++i) after.push_back(r1.next());
    Loader resumed(&docs, T, B, true, true, 9, 0, LoaderShard{1, world});
    resumed.restore(saved);
    for (int i = 0; i < 30; ++i) {
        const Batch b = resumed.next();
        ASSERT_EQ(b.input_ids, after[static_cast<size_t>(i)].input_ids) << i;
        ASSERT_EQ(b.targets, after[static_cast<size_t>(i)].targets) << i;
        ASSERT_EQ(b.positions, after[static_cast<size_t>(i)].positions) << i;
        ASSERT_EQ(b.doc_ids, after[static_cast<size_t>(i)].doc_ids) << i;
    }
}

TEST(LoaderShardTest, DefaultConstructorIsOneRankAndBadShardsAreRefused) {
    const std::vector<Document> docs = random_docs(10, 1);
    Loader plain(&docs, 16, 2, true, false, 0);
    Loader one(&docs, 16, 2, true, false, 0, 0, LoaderShard{0, 1});
    for (int i = 0; i < 8; ++i) EXPECT_EQ(plain.next().input_ids, one.next().input_ids);
    EXPECT_THROW(Loader(&docs, 16, 2, true, false, 0, 0, LoaderShard{2, 2}), mf::Error);
    EXPECT_THROW(Loader(&docs, 16, 2, true, false, 0, 0, LoaderShard{0, 0}), mf::Error);
    EXPECT_THROW(Loader(&docs, 16, 2, true, false, 0, 0, LoaderShard{-1, 2}), mf::Error);
}

// --- issue 20: what is not a dataset file, bounded lines, BOM --------------------------------

TEST_F(SftTest, ByteOrderMarkOnTheFirstLineIsSkipped) {
    const std::string line = "{\"input_ids\": [1, 2, 3]}\n";
    const TokenDataset a = read("\xEF\xBB\xBF" + line + line, options());
    ASSERT_EQ(a.docs.size(), 2u);
    EXPECT_EQ(a.docs[0].input_ids, (std::vector<int32_t>{1, 2, 3}));
    const TokenDataset b = mf::data::read_token_jsonl(write("t.jsonl", "\xEF\xBB\xBF" + line), 100, false);
    EXPECT_EQ(b.docs.size(), 1u);
    // Only the file's start is a byte-order mark (as Python's utf-8-sig); later it is a malformed line.
    EXPECT_NE(error_of(line + "\xEF\xBB\xBF" + line, options()).find("data.jsonl:2:"), std::string::npos);
}

TEST_F(SftTest, DirectoriesAndDevicesAreNamedNotRead) {
    fs::create_directories(dir_ / "sub");
    for (const auto& [path, want] : std::vector<std::pair<fs::path, std::string>>{
             {dir_ / "sub", "sub: is a directory, expected a JSONL file"},
             {"/dev/zero", "/dev/zero: is a character device, expected a regular JSONL file"},
             {dir_ / "absent.jsonl", "absent.jsonl: cannot open dataset: No such file or directory"}}) {
        for (const bool tokens : {false, true}) {
            std::string msg;
            try {
                if (tokens)
                    mf::data::read_token_jsonl(path, 100, false);
                else
                    mf::data::read_sft_jsonl(path, &tok(), options());
            } catch (const mf::Error& e) {
                msg = e.what();
            }
            EXPECT_NE(msg.find(want), std::string::npos) << path << ": " << msg;
        }
    }
}

TEST_F(SftTest, AnOverlongLineStopsAtTheCap) {
    // A line one byte over a small cap, then a good one: the reader refuses it by line number.
    mf::data::LineReader reader(write("long.jsonl", std::string(33, 'x') + "\nok\n"), 32);
    std::string line;
    try {
        reader.next(line);
        ADD_FAILURE() << "no error for a 33-byte line under a 32-byte cap";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("long.jsonl:1: line longer than 32 bytes"), std::string::npos) << e.what();
    }
    EXPECT_LE(line.size(), 33u);  // never more than the cap (+1 for a "\r\n" end) held
    mf::data::LineReader exact(write("exact.jsonl", std::string(32, 'y') + "\r\nlast"), 32);
    ASSERT_TRUE(exact.next(line));
    EXPECT_EQ(line, std::string(32, 'y'));
    ASSERT_TRUE(exact.next(line));
    EXPECT_EQ(line, "last");
    EXPECT_FALSE(exact.next(line));
    EXPECT_EQ(exact.line_no(), 2);
}
