// HF config.json for qwen3_moe: both spellings load, unsupported or inconsistent values are
// refused naming the field; model directories whose tensors do not fit the config are refused
// naming the tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <set>

#include "core/json.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "model/arch/architecture.h"
#include "model/causal_lm.h"
#include "test_util.h"
#include "train/hf_checkpoint.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

json::Value base_config() {
    return json::parse(R"({
      "model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 8, "intermediate_size": 12,
      "moe_intermediate_size": 6, "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
      "decoder_sparse_step": 1, "mlp_only_layers": [0], "norm_topk_prob": true,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
      "router_aux_loss_coef": 0.01, "max_position_embeddings": 128, "hidden_act": "silu",
      "attention_bias": false, "use_sliding_window": false, "sliding_window": null, "dtype": "float32"})",
                       "base");
}

std::string error_of(const json::Value& cfg) {
    try {
        model::parse_model_config(cfg, "cfg/config.json");
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(Config, BothSpellings) {
    json::Value a = base_config();
    const auto ca = model::parse_model_config(a, "a");
    json::Value b = base_config();
    b.as_object().erase(
        std::remove_if(b.as_object().begin(), b.as_object().end(),
                       [](const auto& kv) { return kv.first == "num_experts" || kv.first == "rope_theta"; }),
        b.as_object().end());
    b.set("num_local_experts", 4);
    json::Value rope = json::Value::object();
    rope.set("rope_theta", json::Value(10000.0));
    rope.set("rope_type", "default");
    b.set("rope_parameters", rope);
    const auto cb = model::parse_model_config(b, "b");
    EXPECT_EQ(ca.num_experts(), cb.num_experts());
    EXPECT_EQ(ca.layers[0].branches[0].attention.rope_theta, cb.layers[0].branches[0].attention.rope_theta);
    EXPECT_EQ(ca.hash(), cb.hash());
    EXPECT_FALSE(ca.is_moe_layer(0));
    EXPECT_TRUE(ca.is_moe_layer(1));
    // The shared benchmark config (Hub spelling) loads and has 30.5B parameters.
    const fs::path shared =
        fs::path(test::fixtures_dir()) / ".." / ".." / ".." / "shared" / "configs" / "qwen3-30b-a3b.json";
    if (fs::exists(shared)) {
        json::Value raw = json::parse(io::read_text_file(shared, 1 << 20), shared.string());
        const auto c = model::parse_model_config(raw, shared.string());
        const auto table = model::model_param_table(c);
        EXPECT_NEAR(static_cast<double>(table.total()), 30.53e9, 0.01e9);
        EXPECT_NEAR(model::model_flops_per_token(c, 4096), 23.1e9, 0.1e9);
        raw.set("num_hidden_layers", 4);
        const auto c4 = model::parse_model_config(raw, shared.string());
        EXPECT_NEAR(model::model_flops_per_token(c4, 4096), 3.64e9, 0.01e9);  // BENCHMARKS.md P1
    }
}

struct BadCase {
    const char* field;
    json::Value value;  // null Value with remove=true removes the field
    bool remove;
    const char* expect;  // a substring of the message
};

TEST(Config, RejectsBadValues) {
    const std::vector<BadCase> cases = {
        {"model_type", json::Value("llama"), false,
         "unsupported model_type \"llama\" (supported: qwen3_moe, mixtral, olmoe, qwen2_moe, nemotron_h)"},
        {"vocab_size", json::Value(), true, "missing required field \"vocab_size\""},
        {"hidden_size", json::Value(-8), false, "\"hidden_size\" must be >= 1"},
        {"hidden_size", json::Value("8"), false, "\"hidden_size\" must be an integer, got string"},
        {"num_key_value_heads", json::Value(3), false, "not a multiple of num_key_value_heads"},
        {"num_experts_per_tok", json::Value(5), false, "num_experts_per_tok 5 exceeds num_experts 4"},
        {"head_dim", json::Value(5), false, "\"head_dim\" must be even"},
        {"intermediate_size", json::Value(12.5), false, "\"intermediate_size\" must be an integer"},
        {"mlp_only_layers", json::Value(7), false, "\"mlp_only_layers\" must be a list"},
        {"mlp_only_layers", json::Value(json::Value::Array{json::Value(5)}), false, "expected a layer index in [0, 2)"},
        {"norm_topk_prob", json::Value("yes"), false, "\"norm_topk_prob\" must be true or false"},
        {"rope_theta", json::Value(-1.0), false, "\"rope_theta\" must be > 0"},
        {"attention_bias", json::Value(true), false, "\"attention_bias\" = true is not supported"},
        {"use_sliding_window", json::Value(true), false, "sliding-window attention"},
        {"hidden_act", json::Value("gelu"), false, "only \"silu\" is supported"},
        {"rope_scaling", json::parse(R"({"rope_type": "yarn", "factor": 4})", "x"), false,
         "rope type \"yarn\" is not supported"},
        {"rope_parameters", json::parse(R"({"rope_theta": 1e6, "rope_type": "default", "factor": 2})", "x"), false,
         "\"rope_parameters.factor\" is not supported"},
        {"num_local_experts", json::Value(8), false, "\"num_experts\" and \"num_local_experts\" disagree"},
        {"dtype", json::Value("float8"), false, "field \"dtype\" is \"float8\""},
        {"rms_norm_eps", json::Value(0.0), false, "\"rms_norm_eps\" must be > 0"},
    };
    std::set<std::string> messages;
    for (const auto& c : cases) {
        json::Value cfg = base_config();
        if (c.remove) {
            auto& o = cfg.as_object();
            o.erase(std::remove_if(o.begin(), o.end(), [&](const auto& kv) { return kv.first == c.field; }), o.end());
        } else {
            cfg.set(c.field, c.value);
        }
        const std::string msg = error_of(cfg);
        EXPECT_NE(msg.find(c.expect), std::string::npos) << c.field << ": got \"" << msg << "\"";
        EXPECT_NE(msg.find("cfg/config.json"), std::string::npos) << msg;
        messages.insert(msg);
    }
    EXPECT_EQ(messages.size(), cases.size()) << "every bad config has its own message";
    EXPECT_NE(error_of(json::Value(json::Value::Array{})).find("expected a JSON object"), std::string::npos);
}

// Model directories whose weights do not fit their config.
class BadModelDir : public ::testing::Test {
 protected:
    void SetUp() override {
        dir_ = test::temp_dir("badmodel");
        cfg_ = model::parse_model_config(base_config(), "base");
        model::CausalLM m(cfg_);
        m.init_random(3, 0.1f);
        train::save_hf_model(dir_, m, nullptr, {});
        names_ = io::ModelWeights::open(dir_).names();
    }
    // Rewrites model.safetensors with `edit` applied to the list of tensors.
    void rewrite(const std::function<void(std::vector<io::StWriteTensor>&, std::vector<std::vector<float>>&)>& edit) {
        const io::ModelWeights w = io::ModelWeights::open(dir_);
        std::vector<std::vector<float>> data;
        std::vector<io::StWriteTensor> tensors;
        for (const auto& name : names_) {
            const io::StTensor* t = w.find(name);
            data.emplace_back(static_cast<size_t>(shape_numel(t->shape)));
            w.read_f32(name, t->shape, data.back().data());
        }
        for (size_t i = 0; i < names_.size(); ++i)
            tensors.push_back({names_[i], io::StDType::F32, w.find(names_[i])->shape, nullptr});
        edit(tensors, data);
        for (size_t i = 0; i < tensors.size(); ++i)
            if (tensors[i].data == nullptr) tensors[i].data = data[i].data();
        io::write_safetensors(dir_ / "model.safetensors", tensors, {});
    }
    std::string load_error() {
        try {
            train::load_hf_model(dir_);
        } catch (const Error& e) {
            return e.what();
        }
        return "";
    }
    fs::path dir_;
    model::ModelSpec cfg_;
    std::vector<std::string> names_;
};

TEST_F(BadModelDir, ValidLoads) { EXPECT_EQ(load_error(), ""); }

TEST_F(BadModelDir, MissingTensor) {
    rewrite([](auto& t, auto& d) {
        for (size_t i = 0; i < t.size(); ++i)
            if (t[i].name == "model.layers.1.mlp.experts.2.up_proj.weight") {
                t.erase(t.begin() + static_cast<long>(i));
                d.erase(d.begin() + static_cast<long>(i));
                break;
            }
    });
    EXPECT_NE(load_error().find("model.layers.1.mlp.experts.2.up_proj.weight"), std::string::npos) << load_error();
}

TEST_F(BadModelDir, ExtraTensor) {
    static std::vector<float> extra(8, 1.0f);
    rewrite([](auto& t, auto&) {
        t.push_back({"model.layers.1.mlp.experts.4.up_proj.weight", io::StDType::F32, {2, 4}, extra.data()});
    });
    const std::string msg = load_error();
    EXPECT_NE(msg.find("\"model.layers.1.mlp.experts.4.up_proj.weight\" is not a parameter"), std::string::npos) << msg;
}

TEST_F(BadModelDir, WrongShape) {
    static std::vector<float> small(8 * 39, 0.5f);
    rewrite([](auto& t, auto&) {
        for (auto& x : t)
            if (x.name == "model.embed_tokens.weight") {
                x.shape = {39, 8};
                x.data = small.data();
            }
    });
    const std::string msg = load_error();
    EXPECT_NE(msg.find("model.embed_tokens.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("shape"), std::string::npos) << msg;
}

TEST_F(BadModelDir, WrongDtype) {
    static std::vector<int32_t> ints(8, 1);
    rewrite([](auto& t, auto&) {
        for (auto& x : t)
            if (x.name == "model.norm.weight") {
                x.dtype = io::StDType::I32;
                x.data = ints.data();
            }
    });
    const std::string msg = load_error();
    EXPECT_NE(msg.find("model.norm.weight"), std::string::npos) << msg;
}

TEST_F(BadModelDir, MissingConfigAndBadJson) {
    fs::remove(dir_ / "config.json");
    EXPECT_NE(load_error().find("config.json"), std::string::npos) << load_error();
    test::write_file(dir_ / "config.json", "{\"model_type\": \"qwen3_moe\",}");
    EXPECT_NE(load_error().find("config.json:1:"), std::string::npos) << load_error();
    EXPECT_NE(load_error().find("invalid JSON"), std::string::npos) << load_error();
}

TEST_F(BadModelDir, SaveLoadRoundTripIsExact) {
    auto m = train::load_hf_model(dir_);
    const fs::path out = dir_.string() + "_copy";
    fs::create_directories(out);
    json::Value raw;
    train::read_hf_config(dir_, &raw);
    train::save_hf_model(out, *m, &raw, {}, 2000);  // small shards: exercises the index
    EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
    auto m2 = train::load_hf_model(out);
    ASSERT_EQ(m->num_params(), m2->num_params());
    EXPECT_EQ(std::memcmp(m->param_data(), m2->param_data(), static_cast<size_t>(m->num_params()) * 4), 0);
    fs::remove_all(out);
}

}  // namespace

// A config.json saved with a UTF-8 byte-order mark (Windows editors) loads as transformers'
// json.load of the text does after utf-8-sig decoding.
TEST_F(BadModelDir, ConfigWithAByteOrderMarkLoads) {
    const std::string text = test::read_file(dir_ / "config.json");
    test::write_file(dir_ / "config.json", "\xEF\xBB\xBF" + text);
    EXPECT_EQ(load_error(), "");
    EXPECT_EQ(train::read_hf_config(dir_).hidden_size, cfg_.hidden_size);
}

// HF config.json holds non-finite numbers: bare Infinity as Python's json writes it (the Hub's files) or
// {"__float__": "Infinity"} as transformers 5.x writes it. Both load; a save writes transformers 5.x's
// spelling (strict JSON), which loads again; a non-finite value where a finite one is needed is refused
// naming the field.
TEST_F(BadModelDir, ConfigWithNonFiniteNumbers) {
    const std::string text = test::read_file(dir_ / "config.json");
    ASSERT_EQ(text.substr(0, 1), "{");
    test::write_file(dir_ / "config.json",
                     "{\n  \"time_step_limit\": [0.0, Infinity],\n  \"lo\": -Infinity," + text.substr(1));
    ASSERT_EQ(load_error(), "");
    json::Value raw;
    train::read_hf_config(dir_, &raw);
    EXPECT_TRUE(std::isinf(raw.find("time_step_limit")->as_array()[1].as_double()));

    auto m = train::load_hf_model(dir_);
    const fs::path out = dir_.string() + "_nonfinite";
    fs::create_directories(out);
    train::save_hf_model(out, *m, &raw, {});
    const std::string written = test::read_file(out / "config.json");
    EXPECT_NE(written.find("{\n      \"__float__\": \"Infinity\"\n    }"), std::string::npos) << written;
    EXPECT_NE(written.find("\"__float__\": \"-Infinity\""), std::string::npos) << written;
    EXPECT_NO_THROW(json::parse(written, "strict"));  // strict JSON
    json::Value again;
    train::read_hf_config(out, &again);
    EXPECT_EQ(*json::hf_float_tag(again.find("time_step_limit")->as_array()[1], "t"),
              std::numeric_limits<double>::infinity());
    EXPECT_NO_THROW(train::load_hf_model(out));
    fs::remove_all(out);

    for (const char* value : {"Infinity", "{\"__float__\": \"NaN\"}"}) {
        json::Value cfg = json::parse(text, "cfg");
        cfg.set("rms_norm_eps", json::parse(value, "v", json::ParseOptions::hf_config()));
        test::write_file(dir_ / "config.json", cfg.dump(2, json::NonFinite::bare));
        const std::string msg = load_error();
        EXPECT_NE(msg.find("field \"rms_norm_eps\" must be a finite number"), std::string::npos) << msg;
    }
    test::write_file(dir_ / "config.json", "{\"time_step_limit\": [0.0, Infinit]," + text.substr(1));
    EXPECT_NE(load_error().find("config.json:1:27: invalid JSON: bad literal"), std::string::npos) << load_error();
}
