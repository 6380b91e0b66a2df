// Nemotron-H (model_type nemotron_h) beyond the HF parity fixture (test_hf_parity): the config in both
// layer-plan spellings and its refusals, the checkpoint written back as transformers 5.17 writes it, and
// packing: a row of three documents equals the three documents run alone, through Mamba-2, attention,
// MoE and dense layers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include "config_test_util.h"
#include "core/json.h"
#include "data/batch.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "model/arch/architecture.h"
#include "model/causal_lm.h"
#include "test_util.h"
#include "train/hf_checkpoint.h"
#include "train/optimizer.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

fs::path fixture_dir(const std::string& sub) { return fs::path(test::fixtures_dir()) / "hf" / "nemotron_h" / sub; }

json::Value fixture_config() {
    const fs::path file = fixture_dir("model") / "config.json";
    return json::parse(io::read_text_file(file, 1 << 20), file.string());
}

struct BadField {
    const char* what;
    const char* field;  // named in the error
    std::function<void(json::Value&)> edit;
    const char* expect;
};

TEST(NemotronH, EachBrokenFieldIsRefusedByName) {
    const fs::path dir = test::temp_dir("nemotron_h_refusals");
    const std::string source = (dir / "config.json").string();
    ASSERT_EQ(test::config_error(dir, fixture_config()), "") << "the fixture's own config loads";
    const std::vector<BadField> cases = {
        {"unknown layer type", "layers_block_type",
         [](json::Value& c) {
             json::Value::Array plan = c.find("layers_block_type")->as_array();
             plan[1] = json::Value("sliding_attention");
             c.set("layers_block_type", json::Value(std::move(plan)));
         },
         "\"layers_block_type\" holds \"sliding_attention\""},
        {"unknown pattern character", "hybrid_override_pattern",
         [](json::Value& c) {
             test::erase_key(c, "layers_block_type");
             c.set("hybrid_override_pattern", "M*X");
         },
         "holds 'X' (expected M, *, E or -)"},
        {"the two plans disagree", "hybrid_override_pattern",
         [](json::Value& c) { c.set("hybrid_override_pattern", "M*EM-M"); }, "describe different layers"},
        {"no plan", "layers_block_type", [](json::Value& c) { test::erase_key(c, "layers_block_type"); },
         "missing the layer plan"},
        {"layer count", "num_hidden_layers", [](json::Value& c) { c.set("num_hidden_layers", 5); },
         "\"num_hidden_layers\" is 5, the layer plan has 6 layers"},
        {"tied embeddings", "tie_word_embeddings", [](json::Value& c) { c.set("tie_word_embeddings", true); },
         "\"tie_word_embeddings\" = true is not supported"},
        {"a latent size of 0", "moe_latent_size", [](json::Value& c) { c.set("moe_latent_size", 0); }, "must be >= 1"},
        {"two shared experts", "n_shared_experts", [](json::Value& c) { c.set("n_shared_experts", 2); },
         "\"n_shared_experts\""},
        {"another activation", "mlp_hidden_act", [](json::Value& c) { c.set("mlp_hidden_act", "silu"); },
         "only \"relu2\" is supported"},
        {"Mamba biases", "use_bias", [](json::Value& c) { c.set("use_bias", true); }, "\"use_bias\" = true"},
        {"heads not a multiple of groups", "n_groups", [](json::Value& c) { c.set("n_groups", 3); },
         "mamba_num_heads 4 is not a multiple of n_groups 3"},
        {"groups not dividing the experts", "n_group", [](json::Value& c) { c.set("n_group", 3); },
         "cannot form n_group 3 groups"},
        {"kept groups past the groups", "topk_group", [](json::Value& c) { c.set("topk_group", 3); },
         "topk_group 3 exceeds n_group 2"},
        {"top-k past the kept experts", "num_experts_per_tok", [](json::Value& c) { c.set("num_experts_per_tok", 5); },
         "num_experts_per_tok 5 exceeds the 4 experts of the kept groups"},
        {"an infinite eps", "layer_norm_epsilon",
         [](json::Value& c) {
             json::Value tag = json::Value::object();
             tag.set("__float__", "Infinity");
             c.set("layer_norm_epsilon", tag);
         },
         "\"layer_norm_epsilon\""},
        {"time_step_limit of one number", "time_step_limit", [](json::Value& c) { c.set("time_step_limit", 0.0); },
         "must be a list of two numbers"},
        {"a huge state", "ssm_state_size", [](json::Value& c) { c.set("ssm_state_size", int64_t{1} << 30); },
         "is implausibly large"},
    };
    for (const BadField& c : cases) {
        json::Value cfg = fixture_config();
        c.edit(cfg);
        const std::string msg = test::config_error(dir, cfg);
        ASSERT_FALSE(msg.empty()) << c.what << " was accepted";
        EXPECT_NE(msg.find(source), std::string::npos) << c.what << ": the file is not named: " << msg;
        EXPECT_NE(msg.find(c.field), std::string::npos) << c.what << ": the field is not named: " << msg;
        EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": expected \"" << c.expect << "\" in: " << msg;
    }
    fs::remove_all(dir);
}

// The Hub's spelling (hybrid_override_pattern, num_hidden_layers, a bare Infinity) is the same model.
TEST(NemotronH, HubSpellingIsTheSameModel) {
    // model_hub/model.safetensors links to model/'s (the same bytes); a model directory's files must be
    // its own, so the hub directory is assembled from copies.
    const fs::path hub_dir = test::temp_dir("nemotron_h_hub");
    fs::copy_file(fixture_dir("model_hub") / "config.json", hub_dir / "config.json");
    fs::copy_file(fixture_dir("model") / "model.safetensors", hub_dir / "model.safetensors");
    auto ours = train::load_hf_model(fixture_dir("model"));
    auto hub = train::load_hf_model(hub_dir);
    fs::remove_all(hub_dir);
    EXPECT_EQ(ours->spec().hash(), hub->spec().hash());
    EXPECT_EQ(ours->spec().to_json().dump(), hub->spec().to_json().dump());
    ASSERT_EQ(ours->num_params(), hub->num_params());
    EXPECT_EQ(std::memcmp(ours->param_data(), hub->param_data(), static_cast<size_t>(ours->num_params()) * 4), 0);
    // The layer plan: M * E M - E.
    const std::vector<model::BranchKind> kinds = {model::BranchKind::mamba, model::BranchKind::attention,
                                                  model::BranchKind::moe,   model::BranchKind::mamba,
                                                  model::BranchKind::mlp,   model::BranchKind::moe};
    ASSERT_EQ(ours->spec().num_layers(), 6);
    for (size_t l = 0; l < kinds.size(); ++l) EXPECT_EQ(ours->spec().layers[l].branches.at(0).kind, kinds[l]) << l;
}

// What an export writes is what transformers 5.17 wrote: the same tensor names (backbone., per-expert
// experts, the correction-bias buffer), shapes and bytes, and the same config.json.
TEST(NemotronH, ExportWritesWhatTransformersWrites) {
    auto m = train::load_hf_model(fixture_dir("model"));
    const fs::path out = test::temp_dir("nemotron_h_export");
    train::save_hf_model(out, *m, nullptr, fs::path());
    const io::SafetensorsFile theirs = io::SafetensorsFile::open(fixture_dir("model") / "model.safetensors");
    const io::SafetensorsFile mine = io::SafetensorsFile::open(out / "model.safetensors");
    std::map<std::string, const io::StTensor*> expected;
    for (const io::StTensor& t : theirs.tensors()) expected[t.name] = &t;
    size_t seen = 0;
    for (const io::StTensor& t : mine.tensors()) {
        auto it = expected.find(t.name);
        ASSERT_NE(it, expected.end()) << "an export tensor transformers does not write: " << t.name;
        EXPECT_EQ(t.shape, it->second->shape) << t.name;
        EXPECT_EQ(t.dtype, it->second->dtype) << t.name;
        ASSERT_EQ(t.nbytes, it->second->nbytes) << t.name;
        EXPECT_EQ(std::memcmp(t.data, it->second->data, t.nbytes), 0) << t.name;
        ++seen;
    }
    EXPECT_EQ(seen, expected.size()) << "every tensor transformers writes is written";
    EXPECT_NE(expected.find("backbone.layers.2.mixer.gate.e_score_correction_bias"), expected.end());
    json::Value want = fixture_config();
    test::erase_key(want, "transformers_version");
    const json::Value got = json::parse(io::read_text_file(out / "config.json", 1 << 20), "config.json");
    EXPECT_EQ(got.dump(2), want.dump(2));
    fs::remove_all(out);
}

// A tiny model of every layer kind, chunk 4 (documents start inside and across chunks).
model::ModelSpec tiny_spec() {
    const json::Value cfg = json::parse(R"({"model_type": "nemotron_h", "vocab_size": 40, "hidden_size": 16,
        "hybrid_override_pattern": "M*EM-E", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "mamba_num_heads": 4, "mamba_head_dim": 4, "n_groups": 2, "ssm_state_size": 3, "conv_kernel": 3,
        "chunk_size": 4, "n_routed_experts": 6, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
        "moe_intermediate_size": 5, "moe_shared_expert_intermediate_size": 7, "intermediate_size": 9,
        "routed_scaling_factor": 2.5})",
                                        "tiny");
    return model::parse_model_config(cfg, "tiny");
}

// Documents of 5, 1 and 7 tokens: packed into one row, or one per row (padded to 7).
const std::vector<std::vector<int32_t>> kDocs = {{3, 17, 9, 28, 4}, {11}, {6, 33, 2, 19, 25, 8, 14}};

data::Batch packed_row(bool one_document) {
    data::Batch b;
    b.B = 1;
    for (size_t d = 0; d < kDocs.size(); ++d)
        for (size_t i = 0; i < kDocs[d].size(); ++i) {
            b.input_ids.push_back(kDocs[d][i]);
            b.targets.push_back(i + 1 < kDocs[d].size() ? kDocs[d][i + 1] : data::kIgnoreIndex);
            b.positions.push_back(static_cast<int32_t>(i));
            b.doc_ids.push_back(one_document ? 0 : static_cast<int32_t>(d));
            b.is_pad.push_back(0);
        }
    b.T = static_cast<int64_t>(b.input_ids.size());
    return b;
}

struct Result {
    double ce = 0;
    std::vector<float> grads;
};

Result run(const model::ModelSpec& spec, const data::Batch& batch) {
    model::CausalLM m(spec);
    m.init_random(5, 0.3f);
    // A correction bias that matters (the buffer's init is zero).
    for (const auto& s : m.params().specs())
        if (s.role == model::ParamRole::buffer)
            for (int64_t i = 0; i < s.numel; ++i) m.param_data()[s.offset + i] = 0.05f * static_cast<float>(i % 5);
    m.zero_grads();
    const model::LossScales scales{1.0, 0.0};
    const model::StepStats st = m.step(batch, &scales);
    return {st.ce_sum, std::vector<float>(m.grad_data(), m.grad_data() + m.num_params())};
}

// The fixture's Mamba-2 layers hold 4-element tensors (A_log, D, dt_bias): every parameter still starts
// 16-byte aligned in bf16 (the GEMM libraries refuse anything else), and the padding after the small
// ones stays zero through a step and an AdamW update, in the parameters and the gradients.
TEST(NemotronH, ParametersAreAlignedAndThePaddingStaysZero) {
    auto m = train::load_hf_model(fixture_dir("model"));
    const auto& specs = m->params().specs();
    std::vector<char> used(static_cast<size_t>(m->num_params()), 0);
    int64_t padded = 0, stored = 0;
    for (const auto& s : specs) {
        EXPECT_EQ(s.offset % model::kParamAlign, 0) << s.name;
        std::fill(used.begin() + s.offset, used.begin() + s.offset + s.numel, 1);
        padded += s.extent() - s.numel;
    }
    EXPECT_GT(padded, 0) << "the fixture has a tensor that needs padding (the test can fail)";
    EXPECT_EQ(m->num_params_total() + padded, m->num_params());
    const io::SafetensorsFile file = io::SafetensorsFile::open(fixture_dir("model") / "model.safetensors");
    for (const auto& t : file.tensors()) stored += shape_numel(t.shape);
    EXPECT_EQ(m->num_params_total(), stored) << "the parameter count leaves the padding out";
    train::Recipe::Optim optim;
    train::AdamW adam(*m, optim, false, nullptr, nullptr);
    m->zero_grads();
    const model::LossScales scales{1.0, 0.1};
    m->step(test::load_fixture_batch(fixture_dir("")), &scales);
    adam.step(1e-2);
    for (size_t i = 0; i < used.size(); ++i)
        if (!used[i]) {
            ASSERT_EQ(m->param_data()[i], 0.0f) << "padding element " << i;
            ASSERT_EQ(m->grad_data()[i], 0.0f) << "padding element " << i;
        }
}

// Routing replay (what the GPU step test uses at near-ties): replaying a model's own routing is the same
// step bit for bit, its top-k in another order the same within fp32 rounding, other experts another step;
// for the sigmoid router (here) and the softmax one (qwen2_moe's fixture).
TEST(NemotronH, RoutingReplayOfItsOwnChoiceIsTheSameStep) {
    for (const char* fixture : {"nemotron_h", "qwen2_moe"}) {
        SCOPED_TRACE(fixture);
        const fs::path dir = fs::path(test::fixtures_dir()) / "hf" / fixture;
        const data::Batch batch = test::load_fixture_batch(dir);
        auto m = train::load_hf_model(dir / "model");
        const model::LossScales scales{1.0, 0.01};
        auto run = [&] {
            m->zero_grads();
            const model::StepStats st = m->step(batch, &scales);
            return std::make_pair(st.ce_sum + st.aux,
                                  std::vector<float>(m->grad_data(), m->grad_data() + m->num_params()));
        };
        const auto own = run();
        int64_t layer = -1;
        for (int64_t l = 0; l < m->spec().num_layers() && layer < 0; ++l)
            if (m->spec().is_moe_layer(l)) layer = l;
        ASSERT_GE(layer, 0);
        const std::vector<int32_t> chosen = m->routing(layer);
        const size_t K = static_cast<size_t>(m->spec().moe(layer)->top_k);
        m->set_routing_replay(layer, chosen);
        const auto replayed = run();
        EXPECT_EQ(replayed.first, own.first);
        EXPECT_EQ(replayed.second, own.second);
        std::vector<int32_t> reversed = chosen, other = chosen;
        for (size_t t = 0; t < chosen.size(); t += K) std::reverse(reversed.begin() + t, reversed.begin() + t + K);
        const int32_t E = static_cast<int32_t>(m->spec().num_experts());
        for (size_t t = 0; t < chosen.size(); t += K) {  // each token: its first expert swapped for one it did not take
            int32_t e = 0;
            while (std::find(chosen.begin() + t, chosen.begin() + t + K, e) != chosen.begin() + t + K) ++e;
            ASSERT_LT(e, E);
            other[t] = e;
        }
        m->set_routing_replay(layer, reversed);
        EXPECT_NEAR(run().first, own.first, 1e-5 * std::fabs(own.first));
        m->set_routing_replay(layer, other);
        const auto moved = run();
        double num = 0, den = 0;  // the layer's expert gradients change well past rounding
        for (const auto& s : m->params().specs()) {
            if (!s.is_expert || s.layer != layer) continue;
            for (int64_t i = s.offset; i < s.offset + s.numel; ++i) {
                const double a = moved.second[static_cast<size_t>(i)], b = own.second[static_cast<size_t>(i)];
                num += (a - b) * (a - b);
                den += b * b;
            }
        }
        EXPECT_GT(std::sqrt(num / den), 1e-3) << "another expert, another step";
        EXPECT_NE(moved.first, own.first);
        EXPECT_EQ(m->routing(layer), other);
        EXPECT_THROW(m->set_routing_replay(layer, std::vector<int32_t>(K + 1, 0)), Error);
        m->set_routing_replay(layer, {});
        EXPECT_EQ(run().first, own.first);
    }
}

TEST(NemotronH, PackedDocumentsEqualTheDocumentsAlone) {
    const model::ModelSpec spec = tiny_spec();
    const Result packed = run(spec, packed_row(false));
    const Result alone = run(spec, data::make_row_batch(kDocs, {}, 7, 0));
    const Result leaked = run(spec, packed_row(true));
    EXPECT_NEAR(packed.ce, alone.ce, 1e-5 * std::fabs(alone.ce));
    EXPECT_GT(std::fabs(leaked.ce - alone.ce), 1e-3) << "one document over the row differs (the test can fail)";
    double num = 0, den = 0;
    for (size_t i = 0; i < packed.grads.size(); ++i) {
        const double d = double(packed.grads[i]) - alone.grads[i];
        num += d * d;
        den += double(alone.grads[i]) * alone.grads[i];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-5) << "gradients of the packed row and of the documents alone";
}

}  // namespace
