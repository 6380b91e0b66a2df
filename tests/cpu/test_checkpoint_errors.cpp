// Training checkpoints that are damaged or do not belong to the run are refused with an error that
// names the file and the problem, never a crash or a silent half-restore: a tensor missing, one of
// the wrong shape or dtype, an unknown one, pieces that leave a gap or overlap, a missing or
// truncated shard file, a state.json with a bad magic, a future format version, another model
// config, a negative loader position. The checkpoint is written by a real 2-step run of the binary
// (one shard), then copied and damaged one way per case.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "core/json.h"
#include "io/crc32c.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

std::string repo() { return (fs::path(test::fixtures_dir()) / ".." / "..").lexically_normal().string(); }

const char* const kShard = "shard-00000-of-00001.safetensors";

class CheckpointErrors : public ::testing::Test {
 protected:
    static void SetUpTestSuite() {
        dir_ = test::temp_dir("checkpoint_errors");
        std::string out;
        ASSERT_EQ(test::run_command(test::moeforge_binary() + " init --arch qwen3_moe --preset tiny --seed 1 --out " +
                                        (dir_ / "base").string(),
                                    &out),
                  0)
            << out;
        ASSERT_EQ(test::run_command(finetune_cmd("run", "train.steps=2 checkpoint.every=2"), &out), 0) << out;
        good_ = dir_ / "run" / "checkpoints" / "step-00000002";
        ASSERT_TRUE(fs::exists(good_ / kShard));
    }
    static std::string finetune_cmd(const std::string& out, const std::string& extra) {
        return test::moeforge_binary() + " finetune " + repo() +
               "/demo/tiny_tokens.yaml model=" + (dir_ / "base").string() + " data.train=" + repo() +
               "/demo/data/tokens.jsonl out=" + (dir_ / out).string() +
               " train.seq_len=32 train.micro_batch=2 device=cpu optim.warmup_steps=0 optim.schedule=constant " + extra;
    }
    // A copy of the good checkpoint to damage.
    static fs::path copy(const std::string& name) {
        const fs::path d = dir_ / "bad" / name;
        fs::create_directories(d.parent_path());
        fs::copy(good_, d, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
        return d;
    }
    // Resuming from `ckpt` fails; returns the output.
    static std::string resume_fails(const fs::path& ckpt) {
        std::string out;
        const std::string cmd = finetune_cmd("resumed", "train.steps=4") + " --resume " + ckpt.string();
        EXPECT_NE(test::run_command(cmd, &out), 0) << cmd << "\n" << out;
        EXPECT_EQ(out.find("Segmentation"), std::string::npos) << out;
        return out;
    }
    // Rewrites the checkpoint's tensors through `edit` (which may drop, add or replace entries).
    static void rewrite_tensors(const fs::path& ckpt,
                                const std::function<void(std::vector<io::StWriteTensor>&, std::vector<float>&)>& edit) {
        std::vector<io::StWriteTensor> tensors;
        std::vector<std::vector<uint8_t>> keep;
        {
            const io::SafetensorsFile f = io::SafetensorsFile::open(ckpt / kShard);
            for (const io::StTensor& t : f.tensors()) {
                keep.emplace_back(t.data, t.data + t.nbytes);
                tensors.push_back({t.name, t.dtype, t.shape, nullptr});
            }
        }
        for (size_t i = 0; i < tensors.size(); ++i) tensors[i].data = keep[i].data();
        std::vector<float> extra(64, 1.0f);
        edit(tensors, extra);
        io::write_safetensors(ckpt / kShard, tensors, {{"format", "moeforge"}});
        edit_state(ckpt, "format_version", json::Value(int64_t{3}));  // re-seals the shard's new checksum
    }
    // Sets one field of state.json and re-seals the checkpoint by the format's rule (checkpoint.h):
    // the shard's CRC-32C in "checksums", and last "state_checksum", the CRC of the text before it.
    // So these cases reach the validation behind the checksums.
    static void edit_state(const fs::path& ckpt, const std::string& key, const json::Value& value) {
        json::Value s = json::parse(test::read_file(ckpt / "state.json"), "state.json");
        std::erase_if(s.as_object(), [](const auto& kv) { return kv.first == "state_checksum"; });
        if (fs::exists(ckpt / kShard)) {
            const std::string shard = test::read_file(ckpt / kShard);
            json::Value sums = json::Value::object();
            sums.set(kShard, io::crc32c_string(io::crc32c(0, shard.data(), shard.size())));
            s.set("checksums", sums);
        }
        s.set(key, value);
        const std::string dumped = s.dump(2), body = dumped + "\n";
        test::write_file(ckpt / "state.json", dumped.substr(0, dumped.size() - 2) + ",\n  \"state_checksum\": \"" +
                                                  io::crc32c_string(io::crc32c(0, body.data(), body.size())) +
                                                  "\"\n}\n");
    }
    static fs::path dir_, good_;
};
fs::path CheckpointErrors::dir_, CheckpointErrors::good_;

TEST_F(CheckpointErrors, GoodCheckpointResumes) {
    std::string out;
    const std::string cmd = finetune_cmd("resumed_ok", "train.steps=4") + " --resume " + copy("good").string();
    ASSERT_EQ(test::run_command(cmd, &out), 0) << out;
    EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
}

TEST_F(CheckpointErrors, MissingTensorIsNamed) {
    const fs::path c = copy("missing");
    rewrite_tensors(c, [](auto& t, auto&) {
        std::erase_if(t, [](const io::StWriteTensor& x) { return x.name == "exp_avg/model.norm.weight@0"; });
    });
    std::string out = resume_fails(c);
    EXPECT_NE(out.find("missing tensor \"exp_avg/model.norm.weight\""), std::string::npos) << out;
    EXPECT_NE(out.find(c.string()), std::string::npos) << out;
    // A whole shard file missing is named.
    const fs::path d = copy("missing_shard");
    fs::remove(d / kShard);
    out = resume_fails(d);
    EXPECT_NE(out.find(kShard), std::string::npos) << out;
}

TEST_F(CheckpointErrors, GapsAndOverlapsAreNamed) {
    // model.norm.weight's param piece split in two, the second moved by one element: a gap.
    const fs::path c = copy("gap");
    std::vector<float> norm;
    rewrite_tensors(c, [&](auto& t, auto&) {
        for (auto& x : t) {
            if (x.name != "param/model.norm.weight@0") continue;
            const int64_t n = x.shape[0];
            norm.assign(static_cast<const float*>(x.data), static_cast<const float*>(x.data) + n);
            x.shape = {n / 2};
            t.push_back({"param/model.norm.weight@" + std::to_string(n / 2 + 1),
                         io::StDType::F32,
                         {n - n / 2 - 1},
                         norm.data() + n / 2 + 1});
            break;
        }
    });
    std::string out = resume_fails(c);
    EXPECT_NE(out.find("param/model.norm.weight has a gap at element"), std::string::npos) << out;
    // The same piece twice: an overlap.
    const fs::path d = copy("overlap");
    rewrite_tensors(d, [&](auto& t, auto&) {
        for (auto& x : t)
            if (x.name == "exp_avg/model.norm.weight@0") {
                t.push_back({"exp_avg/model.norm.weight@1", io::StDType::F32, {1}, x.data});
                break;
            }
    });
    out = resume_fails(d);
    EXPECT_NE(out.find("exp_avg/model.norm.weight has overlapping pieces"), std::string::npos) << out;
}

TEST_F(CheckpointErrors, WrongShapeOrDtypeIsNamed) {
    const fs::path c = copy("shape");
    rewrite_tensors(c, [](auto& t, auto&) {
        for (auto& x : t)
            if (x.name == "param/model.norm.weight@0") x.shape = {x.shape[0] / 2, 2};  // same bytes, 2-D
    });
    std::string out = resume_fails(c);
    EXPECT_NE(out.find("tensor \"param/model.norm.weight@0\" has the wrong dtype or shape"), std::string::npos) << out;
    const fs::path d = copy("dtype");
    rewrite_tensors(d, [](auto& t, auto&) {
        for (auto& x : t)
            if (x.name == "exp_avg_sq/model.norm.weight@0") {
                x.dtype = io::StDType::BF16;
                x.shape = {x.shape[0] * 2};
            }
    });
    out = resume_fails(d);
    EXPECT_NE(out.find("tensor \"exp_avg_sq/model.norm.weight@0\" has the wrong dtype or shape"), std::string::npos)
        << out;
}

TEST_F(CheckpointErrors, ExtraTensorIsRefused) {
    const fs::path c = copy("extra");
    rewrite_tensors(c, [](auto& t, auto& extra) {
        t.push_back({"param/not.a.parameter@0", io::StDType::F32, {64}, extra.data()});
    });
    const std::string out = resume_fails(c);
    EXPECT_NE(out.find("tensor \"param/not.a.parameter@0\" is not a piece of this model's state"), std::string::npos)
        << out;
    EXPECT_NE(out.find(kShard), std::string::npos) << out;
}

TEST_F(CheckpointErrors, TruncatedTensorsFileIsNamed) {
    const fs::path c = copy("truncated");
    const fs::path f = c / kShard;
    fs::resize_file(f, fs::file_size(f) / 2);
    const std::string out = resume_fails(c);
    EXPECT_NE(out.find(kShard), std::string::npos) << out;
}

TEST_F(CheckpointErrors, BadStateIsNamed) {
    fs::path c = copy("magic");
    edit_state(c, "magic", json::Value("something-else"));
    std::string out = resume_fails(c);
    EXPECT_NE(out.find("not a moeforge training checkpoint"), std::string::npos) << out;

    c = copy("version");
    edit_state(c, "format_version", json::Value(int64_t{99}));
    out = resume_fails(c);
    EXPECT_NE(out.find("checkpoint format version 99"), std::string::npos) << out;

    c = copy("config");
    edit_state(c, "config_hash", json::Value("0123456789abcdef"));
    out = resume_fails(c);
    EXPECT_NE(out.find("different model config"), std::string::npos) << out;

    // A field of the wrong type is named with the file (was "expected a JSON string, got number").
    c = copy("config_type");
    edit_state(c, "config_hash", json::Value(int64_t{5}));
    out = resume_fails(c);
    EXPECT_NE(out.find("state.json: field \"config_hash\" must be a string, got 5"), std::string::npos) << out;
    c = copy("step_type");
    edit_state(c, "step", json::Value("two"));
    out = resume_fails(c);
    EXPECT_NE(out.find("state.json: field \"step\" must be an integer"), std::string::npos) << out;

    c = copy("loader");
    json::Value loader = json::Value::object();
    loader.set("epoch", int64_t{0});
    loader.set("cursor", int64_t{-5});
    edit_state(c, "loader", loader);
    out = resume_fails(c);
    EXPECT_NE(out.find("negative step or loader position"), std::string::npos) << out;
    EXPECT_NE(out.find("state.json"), std::string::npos) << out;
}

}  // namespace
