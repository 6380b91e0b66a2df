// Crafted malformed inputs for the formats the engine reads from users, beyond the per-format
// suites (test_safetensors.cpp: safetensors headers and shard indexes; test_config.cpp: config
// values; test_recipe.cpp: recipes). Here:
//   - token JSONL lines (data::read_token_jsonl): every refusal names FILE:LINE and the problem;
//   - model directories (train::load_hf_model): missing or non-regular files, FIFOs (which must
//     not block), configs whose sizes overflow or do not match the weights, broken indexes;
//   - path escapes: shard names with '..', absolute paths, backslashes, NUL bytes, and symlinks
//     (single file, shard, chained, looping, dangling, to directories) leading out of the model
//     directory.
// Every case must throw mf::Error (never crash, hang or throw anything else), its message must
// contain the expected phrase and name the file (and line), and no two cases may share a message:
// each input is refused for its own reason.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <set>

#include "core/json.h"
#include "data/token_dataset.h"
#include "io/safetensors.h"
#include "model/arch/architecture.h"
#include "model/causal_lm.h"
#include "test_util.h"
#include "train/hf_checkpoint.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

// Runs fn; returns the mf::Error message, "<no error>", or a description of another exception
// (which fails the comparison that follows, naming what was thrown).
std::string error_of(const std::function<void()>& fn) {
    try {
        fn();
    } catch (const Error& e) {
        return e.what();
    } catch (const std::exception& e) {
        return std::string("<not an mf::Error: ") + e.what() + ">";
    }
    return "<no error>";
}

// --- token JSONL -------------------------------------------------------------------------------

constexpr int64_t kVocab = 50;

struct JsonlCase {
    std::string label;
    std::string bad_line;  // written after two good lines and a blank one: it is line 4
    std::string expect;    // phrase the message must contain
};

TEST(MalformedTokenJsonl, EachBadLineIsRefusedNamingFileAndLine) {
    const std::string good = "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4], \"labels\": [-100]}\n\n";
    const std::string deep = "{\"input_ids\": " + std::string(200, '[') + std::string(200, ']') + "}";
    const std::vector<JsonlCase> cases = {
        {"truncated object", "{\"input_ids\": [1, 2", "expected ',' or ']' in array"},
        {"truncated after the key", "{\"input_ids\": ", "unexpected end of input"},
        {"unterminated string key", "{\"input_ids", "unterminated string"},
        {"trailing comma", "{\"input_ids\": [1, 2,]}", "unexpected character ']'"},
        {"single quotes", "{'input_ids': [1]}", "expected a string key"},
        {"bare word", "input_ids=1,2,3", "unexpected character 'i'"},
        {"text after the object", "{\"input_ids\": [1]} extra", "unexpected text after the JSON value"},
        {"two objects on one line", "{\"input_ids\": [1]}{\"input_ids\": [2]}", "unexpected text after the JSON value"},
        {"top level array", "[1, 2, 3]", "expected a JSON object"},
        {"missing input_ids", "{\"labels\": [1, 2]}", "missing field \"input_ids\""},
        {"unknown field", "{\"input_ids\": [1], \"attention_mask\": [1]}", "unknown field \"attention_mask\""},
        {"misspelt field", "{\"input_id\": [1]}", "unknown field \"input_id\""},
        {"input_ids a string", "{\"input_ids\": \"1 2 3\"}", "field \"input_ids\" must be an array of integers"},
        {"input_ids empty", "{\"input_ids\": []}", "field \"input_ids\" is empty"},
        {"fractional id", "{\"input_ids\": [1, 2.5]}", "field \"input_ids\"[1] is 2.5, expected an integer"},
        {"id written as a string", "{\"input_ids\": [\"7\"]}", "field \"input_ids\"[0] is \"7\", expected an integer"},
        {"id a boolean", "{\"input_ids\": [1, 2, true]}", "field \"input_ids\"[2] is true, expected an integer"},
        {"nested id list", "{\"input_ids\": [[1, 2]]}", "field \"input_ids\"[0] is [1,2], expected an integer"},
        {"negative id", "{\"input_ids\": [3, -1]}", "field \"input_ids\"[1] = -1 is outside the vocabulary [0, 50)"},
        {"id equal to the vocabulary size", "{\"input_ids\": [50]}",
         "field \"input_ids\"[0] = 50 is outside the vocabulary [0, 50)"},
        {"id beyond int32", "{\"input_ids\": [1, 2, 4294967296]}", "field \"input_ids\"[2] = 4294967296 is outside"},
        {"-100 in input_ids", "{\"input_ids\": [-100, 1]}", "field \"input_ids\"[0] = -100 is outside the vocabulary"},
        {"id beyond int64", "{\"input_ids\": [99999999999999999999]}", "expected an integer"},
        {"id out of double range", "{\"input_ids\": [1e999]}", "number out of range"},
        {"labels shorter", "{\"input_ids\": [1, 2, 3], \"labels\": [1, 2]}",
         "\"labels\" has 2 entries but \"input_ids\" has 3"},
        {"labels longer", "{\"input_ids\": [1], \"labels\": [1, -100]}",
         "\"labels\" has 2 entries but \"input_ids\" has 1"},
        {"label out of vocabulary", "{\"input_ids\": [1, 2], \"labels\": [1, 77]}",
         "field \"labels\"[1] = 77 is outside the vocabulary [0, 50) and is not -100"},
        {"label -101", "{\"input_ids\": [1], \"labels\": [-101]}", "field \"labels\"[0] = -101 is outside"},
        {"labels a number", "{\"input_ids\": [1], \"labels\": 1}", "field \"labels\" must be an array of integers"},
        {"duplicate input_ids", "{\"input_ids\": [1], \"input_ids\": [2]}", "duplicate key \"input_ids\""},
        {"control character in a key", "{\"input\x01_ids\": [1]}", "control character in string"},
        {"NUL byte in the line", std::string("{\"input_ids\": [1,\0 2]}", 22), "unexpected character '\\x00'"},
        {"invalid byte outside strings", "{\"input_ids\": \xff}", "unexpected character '\\xff'"},
        {"missing colon", "{\"input_ids\" [1]}", "expected ':' after key \"input_ids\""},
        {"bad escape in a key", "{\"input\\q_ids\": [1]}", "bad escape '\\q'"},
        {"nesting too deep", deep, "nesting deeper than"},
        {"UTF-8 byte order mark (files concatenated from an editor)", "\xef\xbb\xbf{\"input_ids\": [1]}",
         "unexpected character '\\xef'"},
        {"comment inside the object", "{\"input_ids\": [1] /* first */}", "expected ',' or '}' in object"},
        {"NaN literal", "{\"input_ids\": [NaN]}", "NaN is not JSON"},
        {"lone surrogate in a key", "{\"\\ud800\": [1]}", "unpaired surrogate"},
    };
    const fs::path dir = test::temp_dir("malformed_jsonl");
    const fs::path file = dir / "tokens.jsonl";
    std::set<std::string> messages;
    for (const JsonlCase& c : cases) {
        test::write_file(file, good + c.bad_line + "\n{\"input_ids\": [9]}\n");
        const std::string e = error_of([&] { data::read_token_jsonl(file, kVocab, false); });
        EXPECT_NE(e.find(file.string() + ":4: "), std::string::npos) << c.label << ": should name line 4: " << e;
        EXPECT_NE(e.find(c.expect), std::string::npos) << c.label << ": " << e;
        EXPECT_TRUE(messages.insert(e).second) << c.label << ": message not distinct: " << e;
        // With skip, the same line is counted and reported, and the good lines survive.
        data::TokenDataset ds;
        ASSERT_EQ(error_of([&] { ds = data::read_token_jsonl(file, kVocab, true); }), "<no error>") << c.label;
        EXPECT_EQ(ds.docs.size(), 3u) << c.label;
        EXPECT_EQ(ds.skipped_lines, 1) << c.label;
        EXPECT_EQ(ds.first_skip_reason, e) << c.label;
    }
    EXPECT_GE(cases.size(), 30u);
}

TEST(MalformedTokenJsonl, FileLevelProblems) {
    const fs::path dir = test::temp_dir("malformed_jsonl_files");
    struct FileCase {
        std::string label;
        std::function<fs::path()> make;
        bool skip_bad_lines;
        std::string expect;
    };
    const std::vector<FileCase> cases = {
        {"missing file", [&] { return dir / "absent.jsonl"; }, false, "absent.jsonl: cannot open dataset"},
        {"empty file",
         [&] {
             test::write_file(dir / "empty.jsonl", "");
             return dir / "empty.jsonl";
         },
         false, "empty.jsonl: no usable documents (0 bad lines skipped)"},
        {"only blank lines",
         [&] {
             test::write_file(dir / "blank.jsonl", "\n   \n\t\r\n");
             return dir / "blank.jsonl";
         },
         false, "blank.jsonl: no usable documents (0 bad lines skipped)"},
        {"every line bad, skipping",
         [&] {
             test::write_file(dir / "allbad.jsonl", "{\"input_ids\": []}\nnope\n{\"input_ids\": [99]}\n");
             return dir / "allbad.jsonl";
         },
         true, "allbad.jsonl: no usable documents (3 bad lines skipped)"},
        {"bad line after CRLF lines counts lines right",
         [&] {
             test::write_file(dir / "crlf.jsonl",
                              "{\"input_ids\": [1]}\r\n\r\n{\"input_ids\": [1]}\r\n{\"input_ids\": [1\r\n");
             return dir / "crlf.jsonl";
         },
         false, "crlf.jsonl:4: "},
        {"last line without newline",
         [&] {
             test::write_file(dir / "nonl.jsonl", "{\"input_ids\": [1]}\n{\"input_ids\": [2, -5]}");
             return dir / "nonl.jsonl";
         },
         false, "nonl.jsonl:2: "},
    };
    std::set<std::string> messages;
    for (const FileCase& c : cases) {
        const fs::path file = c.make();
        const std::string e = error_of([&] { data::read_token_jsonl(file, kVocab, c.skip_bad_lines); });
        EXPECT_NE(e.find(c.expect), std::string::npos) << c.label << ": " << e;
        EXPECT_TRUE(messages.insert(e).second) << c.label << ": message not distinct: " << e;
    }
}

// --- model directories and path escapes --------------------------------------------------------

const char* kConfig = R"({
  "model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 8, "intermediate_size": 12,
  "moe_intermediate_size": 6, "num_hidden_layers": 2, "num_attention_heads": 2,
  "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
  "decoder_sparse_step": 1, "mlp_only_layers": [0], "norm_topk_prob": true,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
  "max_position_embeddings": 128, "hidden_act": "silu", "dtype": "float32"})";

std::string le64(uint64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFF);
    return s;
}

// The config with `key` set to the JSON text `value`.
std::string config_with(const std::string& key, const std::string& value) {
    json::Value v = json::parse(kConfig, "kConfig");
    v.set(key, json::parse(value, "value"));
    return v.dump(2);
}

class MalformedModelDir : public ::testing::Test {
 protected:
    static void SetUpTestSuite() {
        root_ = new fs::path(test::temp_dir("malformed_model"));
        // A valid model directory, single file and sharded, to copy and break.
        const model::ModelSpec cfg = model::parse_model_config(json::parse(kConfig, "kConfig"), "kConfig");
        model::CausalLM m(cfg);
        m.init_random(5, 0.1f);
        const json::Value raw = json::parse(kConfig, "kConfig");
        fs::create_directories(*root_ / "good_single");
        train::save_hf_model(*root_ / "good_single", m, &raw, {});
        fs::create_directories(*root_ / "good_sharded");
        train::save_hf_model(*root_ / "good_sharded", m, &raw, {}, 1500);
    }
    static void TearDownTestSuite() {
        fs::remove_all(*root_);
        delete root_;
    }
    // A fresh copy of a good directory, named after the case.
    static fs::path copy_of(const std::string& which, const std::string& name) {
        const fs::path dst = *root_ / name;
        fs::remove_all(dst);
        fs::copy(*root_ / which, dst, fs::copy_options::recursive);
        return dst;
    }
    static std::string load_error(const fs::path& dir) {
        return error_of([&] { train::load_hf_model(dir); });
    }
    // The shard file names of good_sharded, in order.
    static std::vector<std::string> shards(const fs::path& dir) {
        std::vector<std::string> out;
        for (const auto& e : fs::directory_iterator(dir))
            if (e.path().extension() == ".safetensors") out.push_back(e.path().filename().string());
        std::sort(out.begin(), out.end());
        return out;
    }
    // Rewrites the index of `dir` so that the first shard's tensors map to `name` instead.
    static void redirect_first_shard(const fs::path& dir, const std::string& name) {
        const fs::path index = dir / "model.safetensors.index.json";
        json::Value v = json::parse(test::read_file(index), index.string());
        const std::string first = shards(dir).front();
        json::Value map = json::Value::object();
        for (const auto& [tensor, file] : v.find("weight_map")->as_object())
            map.set(tensor, file.as_string() == first ? json::Value(name) : file);
        v.set("weight_map", map);
        test::write_file(index, v.dump(2));
    }
    static fs::path* root_;
};
fs::path* MalformedModelDir::root_ = nullptr;

struct DirCase {
    std::string label;
    std::function<fs::path(const std::string& name)> make;  // returns the directory to load
    std::string expect;
};

TEST_F(MalformedModelDir, GoodDirectoriesLoad) {
    EXPECT_EQ(load_error(*root_ / "good_single"), "<no error>");
    EXPECT_EQ(load_error(*root_ / "good_sharded"), "<no error>");
    EXPECT_GE(shards(*root_ / "good_sharded").size(), 3u);
    // A symlinked model directory, and a symlink to a weights file inside the directory, are fine.
    fs::create_directory_symlink(*root_ / "good_single", *root_ / "linked_dir");
    EXPECT_EQ(load_error(*root_ / "linked_dir"), "<no error>");
    const fs::path d = copy_of("good_single", "inner_link");
    fs::rename(d / "model.safetensors", d / "weights.bin");
    fs::create_symlink("weights.bin", d / "model.safetensors");
    EXPECT_EQ(load_error(d), "<no error>");
    // A Hugging Face hub cache snapshot: REPO/snapshots/REV/* are links to REPO/blobs/HASH.
    const fs::path repo = *root_ / "hub" / "models--org--tiny";
    const fs::path snap = repo / "snapshots" / "0123abc";
    fs::create_directories(repo / "blobs");
    fs::create_directories(snap);
    for (const char* f : {"model.safetensors", "config.json"}) {
        const std::string blob = std::string("blob-") + f;
        fs::copy_file(*root_ / "good_single" / f, repo / "blobs" / blob);
        fs::create_symlink(fs::path("../../blobs") / blob, snap / f);
    }
    EXPECT_EQ(load_error(snap), "<no error>");
    // ... but a link from a snapshot to anywhere else is still refused.
    const fs::path elsewhere = repo / "elsewhere";
    fs::create_directories(elsewhere);
    fs::rename(repo / "blobs" / "blob-model.safetensors", elsewhere / "blob-model.safetensors");
    fs::remove(snap / "model.safetensors");
    fs::create_symlink("../../elsewhere/blob-model.safetensors", snap / "model.safetensors");
    EXPECT_NE(load_error(snap).find("outside the model directory"), std::string::npos) << load_error(snap);
}

TEST_F(MalformedModelDir, EachIsRefusedWithItsOwnMessage) {
    const fs::path outside = *root_ / "outside";
    fs::create_directories(outside);
    fs::copy_file(*root_ / "good_single" / "model.safetensors", outside / "model.safetensors");
    fs::copy_file(*root_ / "good_single" / "config.json", outside / "config.json");

    const std::vector<DirCase> cases = {
        // --- the directory and config.json ---
        {"directory missing", [&](const std::string& n) { return *root_ / n; }, "not a model directory"},
        {"a file instead of a directory",
         [&](const std::string& n) {
             test::write_file(*root_ / n, kConfig);
             return *root_ / n;
         },
         "not a model directory"},
        {"config.json missing",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "config.json");
             return d;
         },
         "config.json: No such file or directory"},
        {"config.json a directory",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "config.json");
             fs::create_directory(d / "config.json");
             return d;
         },
         "config.json is not a regular file"},
        {"config.json a FIFO (must not block)",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "config.json");
             EXPECT_EQ(::mkfifo((d / "config.json").c_str(), 0600), 0);
             return d;
         },
         "config.json is not a regular file"},
        {"config.json empty",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             test::write_file(d / "config.json", "");
             return d;
         },
         "config.json:1:1: invalid JSON: unexpected end of input"},
        {"config.json over the size limit",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             test::write_file(d / "config.json", std::string(kConfig) + std::string((4u << 20), ' '));
             return d;
         },
         "larger than the limit of 4194304 bytes"},
        {"config.json a dangling symlink",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "config.json");
             fs::create_symlink("nowhere.json", d / "config.json");
             return d;
         },
         "cannot open"},
        {"config layer count beyond reason",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             test::write_file(d / "config.json", config_with("num_hidden_layers", "1000000000"));
             return d;
         },
         "num_hidden_layers"},
        {"config size written beyond int64",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             test::write_file(d / "config.json", config_with("num_experts", "4.2e23"));
             return d;
         },
         "field \"num_experts\" is implausibly large: 4.2e+23"},
        {"config size written far below int64",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             test::write_file(d / "config.json", config_with("hidden_size", "-1e30"));
             return d;
         },
         "field \"hidden_size\" must be >= 1, got -1e+30"},
        {"config sizes whose product overflows",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             json::Value v = json::parse(kConfig, "kConfig");
             v.set("vocab_size", json::Value(int64_t{1} << 30));
             v.set("hidden_size", json::Value(int64_t{1} << 40));
             v.set("head_dim", json::Value(int64_t{1} << 38));
             test::write_file(d / "config.json", v.dump());
             return d;
         },
         "parameters"},
        {"config larger than its weights",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             test::write_file(d / "config.json", config_with("vocab_size", "1000000000"));
             return d;
         },
         "\"model.embed_tokens.weight\" has shape [40, 8]"},
        {"config with millions of experts over a small file (must be quick)",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             test::write_file(d / "config.json", config_with("num_experts", "4000000"));
             return d;
         },
         // 1 MoE layer (mlp_only_layers = [0]) x 3 tensors x 4e6 experts + 23 other tensors
         "describes 12000023 tensors (4000000 experts in 2 layers) but the weights hold only"},
        // --- the weights ---
        {"no weights at all",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "model.safetensors");
             return d;
         },
         "no safetensors weights in"},
        {"model.safetensors a directory",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "model.safetensors");
             fs::create_directory(d / "model.safetensors");
             return d;
         },
         "model.safetensors is not a regular file"},
        {"model.safetensors a FIFO (must not block)",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "model.safetensors");
             EXPECT_EQ(::mkfifo((d / "model.safetensors").c_str(), 0600), 0);
             return d;
         },
         "is not a regular file"},
        {"model.safetensors truncated",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             const std::string bytes = test::read_file(d / "model.safetensors");
             test::write_file(d / "model.safetensors", bytes.substr(0, bytes.size() - 100));
             return d;
         },
         "beyond the data section"},
        {"model.safetensors header length past the end",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             std::string bytes = test::read_file(d / "model.safetensors");
             bytes.replace(0, 8, le64(bytes.size()));
             test::write_file(d / "model.safetensors", bytes);
             return d;
         },
         "runs past the end of the file"},
        {"index not UTF-8",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             test::write_file(d / "model.safetensors.index.json", "{\"weight_map\": {\"a\xff\": \"x\"}}");
             return d;
         },
         "model.safetensors.index.json: not valid UTF-8 at byte 18"},
        {"index top level an array",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             test::write_file(d / "model.safetensors.index.json", "[]");
             return d;
         },
         "top level is a JSON array"},
        {"index metadata a string",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             test::write_file(d / "model.safetensors.index.json", R"({"metadata": "x", "weight_map": {}})");
             return d;
         },
         "metadata is a JSON string"},
        {"index weight_map empty",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             test::write_file(d / "model.safetensors.index.json", R"({"weight_map": {}})");
             return d;
         },
         "weight_map is empty"},
        {"index a directory",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             fs::remove(d / "model.safetensors.index.json");
             fs::create_directory(d / "model.safetensors.index.json");
             return d;
         },
         "model.safetensors.index.json is not a regular file"},
        {"index names itself as a shard",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, "model.safetensors.index.json");
             return d;
         },
         "header length"},
        {"shard missing from disk",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             fs::remove(d / shards(d).back());
             return d;
         },
         "does not exist in"},
        {"index omits a tensor of the model",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             const fs::path index = d / "model.safetensors.index.json";
             json::Value v = json::parse(test::read_file(index), "index");
             json::Value map = json::Value::object();
             for (const auto& [tensor, file] : v.find("weight_map")->as_object())
                 if (tensor != "model.norm.weight") map.set(tensor, file);
             v.set("weight_map", map);
             test::write_file(index, v.dump());
             return d;
         },
         "tensor 'model.norm.weight' is not listed in the index"},
        // --- path escapes ---
        {"shard '..'",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, "..");
             return d;
         },
         "'..' contains '..'"},
        {"shard '.'",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, ".");
             return d;
         },
         "'.' is not a plain file name"},
        {"shard through '..' back into the directory",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, "../" + n + "/" + shards(d).front());
             return d;
         },
         "contains '..'; expected a file name inside"},
        {"shard with '..' in the middle",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, "sub/../" + shards(d).front());
             return d;
         },
         "'sub/../model-"},
        {"shard with a backslash '..'",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, "..\\outside\\model.safetensors");
             return d;
         },
         "'..\\outside\\model.safetensors' contains '..'"},
        {"shard in a subdirectory via backslash",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, "sub\\x.safetensors");
             return d;
         },
         "'sub\\x.safetensors' is not a plain file name"},
        {"absolute shard path to a real model",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, (outside / "model.safetensors").string());
             return d;
         },
         "is an absolute path; expected a file name inside"},
        {"shard '//' path",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, "//etc/passwd");
             return d;
         },
         "'//etc/passwd' is an absolute path"},
        {"shard name with a NUL byte",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, shards(d).front() + std::string(1, '\0') + "../x");
             return d;
         },
         "contains a NUL byte"},
        {"shard name empty",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             redirect_first_shard(d, "");
             return d;
         },
         "empty file name"},
        {"single file a symlink out of the directory",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "model.safetensors");
             fs::create_symlink(outside / "model.safetensors", d / "model.safetensors");
             return d;
         },
         "outside the model directory"},
        {"single file a relative symlink out of the directory",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_single", n);
             fs::remove(d / "model.safetensors");
             fs::create_symlink("../outside/model.safetensors", d / "model.safetensors");
             return d;
         },
         "resolves to " + fs::canonical(outside / "model.safetensors").string()},
        {"shard symlink chain leaving the directory",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             const std::string first = shards(d).front();
             fs::remove(d / first);
             fs::create_symlink("hop.safetensors", d / first);  // inside -> inside -> outside
             fs::create_symlink(outside / "model.safetensors", d / "hop.safetensors");
             return d;
         },
         "' resolves to " + fs::canonical(outside / "model.safetensors").string() + ", outside"},
        {"shard symlink into a subdirectory",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             const std::string first = shards(d).front();
             fs::create_directory(d / "sub");
             fs::rename(d / first, d / "sub" / first);
             fs::create_symlink("sub/" + first, d / first);
             return d;
         },
         "/sub/model-"},
        {"shard symlink loop",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             const std::string first = shards(d).front();
             fs::remove(d / first);
             fs::create_symlink(first, d / first);
             return d;
         },
         "cannot resolve"},
        {"shard dangling symlink",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             const std::string first = shards(d).front();
             fs::remove(d / first);
             fs::create_symlink("gone.safetensors", d / first);
             return d;
         },
         "No such file or directory"},
        {"shard symlink to the directory itself",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             const std::string first = shards(d).front();
             fs::remove(d / first);
             fs::create_symlink(".", d / first);
             return d;
         },
         "outside the model directory"},
        {"shard symlink to a device",
         [&](const std::string& n) {
             const fs::path d = copy_of("good_sharded", n);
             const std::string first = shards(d).front();
             fs::remove(d / first);
             fs::create_symlink("/dev/zero", d / first);
             return d;
         },
         "resolves to /dev/zero"},
    };
    std::set<std::string> messages;
    for (size_t i = 0; i < cases.size(); ++i) {
        const DirCase& c = cases[i];
        const std::string name = "case" + std::to_string(i);
        const fs::path dir = c.make(name);
        const std::string e = load_error(dir);
        EXPECT_NE(e.find(c.expect), std::string::npos) << c.label << ": " << e;
        EXPECT_NE(e.find(name), std::string::npos) << c.label << ": should name the directory " << name << ": " << e;
        EXPECT_TRUE(messages.insert(e).second) << c.label << ": message not distinct: " << e;
    }
    EXPECT_GE(cases.size(), 35u);
}

}  // namespace
