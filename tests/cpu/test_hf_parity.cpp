// HF parity: our CPU engine against numbers produced by transformers 5.17 itself
// (scripts/make_hf_fixtures.py, float64 reference; HF upcasts logits to fp32 for the loss and
// accumulates aux statistics in fp32, so the reference carries fp32 rounding there).
//
// Tolerance rule (measured errors are ~1e-7 relative, fp32 rounding): scalars (losses, grad
// norm) agree to 1e-6 relative; logits to 2e-5 absolute (magnitude ~1); each parameter gradient
// to a relative L2 error of 2e-5; the losses of 5 AdamW steps to 1e-5 relative (Adam normalises the
// update, so small gradient differences on near-zero entries are amplified step by step).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/json.h"
#include "data/batch.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "ops/ops.h"
#include "test_util.h"
#include "train/hf_checkpoint.h"
#include "train/optimizer.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

struct Fixture {
    json::Value expected;
    data::Batch batch;
};

Fixture load_fixture(const fs::path& dir) {
    Fixture f;
    f.expected = json::parse(io::read_text_file(dir / "expected.json", 1 << 20), "expected.json");
    f.batch = test::load_fixture_batch(dir);
    return f;
}

// Reads an F32 tensor of the fixture file, checking its shape.
void read_expected(const io::SafetensorsFile& file, const std::string& name, const Shape& shape, float* dst) {
    const io::StTensor* t = file.find(name);
    ASSERT_NE(t, nullptr) << name;
    ASSERT_EQ(t->dtype, io::StDType::F32) << name;
    ASSERT_EQ(t->shape, shape) << name;
    std::memcpy(dst, t->data, t->nbytes);
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(1e-12, std::fabs(b)); }

class HfParity : public ::testing::TestWithParam<std::string> {};

TEST_P(HfParity, LossLogitsGradients) {
    const fs::path dir = fs::path(test::fixtures_dir()) / "hf" / GetParam();
    Fixture f = load_fixture(dir);
    auto m = train::load_hf_model(dir / "model");
    const auto& cfg = m->spec();
    // The fixtures of the families with a load-balancing loss were made with it on; Nemotron-H has none.
    const bool fixture_aux = f.expected.find("loss")->as_double() != f.expected.find("ce_loss")->as_double();
    ASSERT_EQ(cfg.adds_aux_loss(), fixture_aux);
    if (const json::Value* type = f.expected.find("model_type")) {
        EXPECT_EQ(cfg.model_type, type->as_string());
    }

    const int64_t N = f.batch.num_tokens();
    std::vector<float> logits(static_cast<size_t>(N * cfg.vocab_size));
    const int64_t targets = f.batch.num_targets();
    EXPECT_EQ(targets, f.expected.find("tokens")->as_int());
    model::LossScales scales{1.0 / static_cast<double>(targets), cfg.router_aux_loss_coef};
    const model::StepStats s = m->step(f.batch, &scales, logits.data());
    const double ce = s.ce_sum / static_cast<double>(targets);
    const double loss = ce + cfg.router_aux_loss_coef * s.aux;
    EXPECT_LT(rel(ce, f.expected.find("ce_loss")->as_double()), 2e-5) << ce;
    EXPECT_LT(rel(s.aux, f.expected.find("aux_loss")->as_double()), 2e-5) << s.aux;
    EXPECT_LT(rel(loss, f.expected.find("loss")->as_double()), 2e-5) << loss;

    const io::SafetensorsFile exp = io::SafetensorsFile::open(dir / "expected.safetensors");
    std::vector<float> ref(logits.size());
    read_expected(exp, "logits", {f.batch.B, f.batch.T, cfg.vocab_size}, ref.data());
    double max_diff = 0;
    for (size_t i = 0; i < ref.size(); ++i) max_diff = std::max(max_diff, std::fabs(double(ref[i]) - logits[i]));
    EXPECT_LT(max_diff, 2e-5);

    const double norm = std::sqrt(ops::sum_squares(m->grads_tensor()));
    EXPECT_LT(rel(norm, f.expected.find("grad_norm")->as_double()), 2e-5) << norm;
    for (const auto& spec : m->params().specs()) {
        if (spec.role == model::ParamRole::buffer) {  // HF's buffers have no gradient; ours stays zero
            const float* ours = m->grad_data() + spec.offset;
            EXPECT_TRUE(std::all_of(ours, ours + spec.numel, [](float v) { return v == 0.0f; })) << spec.name;
            continue;
        }
        std::vector<float> g(static_cast<size_t>(spec.numel));
        read_expected(exp, "grad." + spec.name, spec.shape, g.data());
        const float* ours = m->grad_data() + spec.offset;
        double num = 0, den = 0;
        for (int64_t i = 0; i < spec.numel; ++i) {
            num += (double(ours[i]) - g[i]) * (double(ours[i]) - g[i]);
            den += double(g[i]) * g[i];
        }
        EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 2e-5) << spec.name;
    }
}

TEST_P(HfParity, AdamWSteps) {
    const fs::path dir = fs::path(test::fixtures_dir()) / "hf" / GetParam();
    Fixture f = load_fixture(dir);
    auto m = train::load_hf_model(dir / "model");
    const json::Value& opt = *f.expected.find("adamw");
    train::Recipe::Optim o;
    o.lr = opt.find("lr")->as_double();
    o.beta1 = opt.find("betas")->as_array()[0].as_double();
    o.beta2 = opt.find("betas")->as_array()[1].as_double();
    o.eps = opt.find("eps")->as_double();
    o.weight_decay = opt.find("weight_decay")->as_double();
    train::AdamW adamw(*m, o, false);
    const auto& losses = f.expected.find("step_losses")->as_array();
    const double coef = m->spec().router_aux_loss_coef;
    const int64_t targets = f.batch.num_targets();
    for (size_t step = 0; step < losses.size(); ++step) {
        m->zero_grads();
        model::LossScales scales{1.0 / static_cast<double>(targets), coef};
        const model::StepStats s = m->step(f.batch, &scales);
        const double loss = s.ce_sum / static_cast<double>(targets) + coef * s.aux;
        EXPECT_LT(rel(loss, losses[step].as_double()), 1e-5) << "step " << step << ": " << loss;
        adamw.step(o.lr, train::clip_coefficient(train::grad_norm(*m), opt.find("grad_clip")->as_double()));
    }
}

// qwen3_moe (norm_topk, no_norm_topk), mixtral, olmoe (its pad_token_id 1 keeps embedding row 1 out of
// the gradient), qwen2_moe (shared expert with gate, q/k/v biases, a dense layer), qwen2_moe_tied,
// nemotron_h (every layer kind: Mamba-2 over several chunks, NoPE attention, the sigmoid router with
// groups and a correction bias that changes the routing, relu² experts and MLP), nemotron_h_latent
// (LatentMoE, and a dt clamp that is hit).
INSTANTIATE_TEST_SUITE_P(Cases, HfParity,
                         ::testing::Values("norm_topk", "no_norm_topk", "mixtral", "olmoe", "qwen2_moe",
                                           "qwen2_moe_tied", "nemotron_h", "nemotron_h_latent"));

}  // namespace
