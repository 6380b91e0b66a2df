// Evaluation (train/evaluate.h), the single-pass loader it runs on, and the dataset summary
// (data/dataset_summary.h). The loss over a dataset must be the token-weighted mean of the
// documents' own losses, however they are packed and batched; evaluation must leave the model's
// parameters and gradients as they were; memory must be that of one micro-batch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "core/json.h"
#include "data/dataset_summary.h"
#include "data/loader.h"
#include "model/arch/architecture.h"
#include "model/causal_lm.h"
#include "test_util.h"
#include "train/evaluate.h"

using namespace mf;

namespace {

// Small enough that a 40,000-document evaluation takes a fraction of a second on one core.
const char* kConfig = R"({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
  "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
  "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
  "norm_topk_prob": true, "tie_word_embeddings": false, "output_router_logits": true, "rms_norm_eps": 1e-6,
  "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "max_position_embeddings": 4096, "dtype": "float32"})";

std::unique_ptr<model::CausalLM> tiny_model() {
    auto m = std::make_unique<model::CausalLM>(model::parse_model_config(json::parse(kConfig, "kConfig"), "kConfig"));
    m->init_random(11, 0.2f);
    return m;
}

// Documents of random lengths in [min_len, max_len], some with prompt tokens masked (-100).
data::TokenDataset random_docs(size_t n, int min_len, int max_len, uint32_t seed) {
    std::mt19937 rng(seed);
    data::TokenDataset ds;
    for (size_t i = 0; i < n; ++i) {
        data::Document d;
        const int len = min_len + static_cast<int>(rng() % static_cast<uint32_t>(max_len - min_len + 1));
        for (int t = 0; t < len; ++t) d.input_ids.push_back(static_cast<int32_t>(rng() % 64));
        d.labels = d.input_ids;
        const int masked = i % 3 == 0 ? len / 2 : 0;
        for (int t = 0; t < masked; ++t) d.labels[static_cast<size_t>(t)] = data::kIgnoreIndex;
        ds.docs.push_back(std::move(d));
    }
    return ds;
}

std::vector<float> host_copy(const Tensor& t) {
    std::vector<float> out(t.nbytes() / sizeof(float));
    std::memcpy(out.data(), t.data(), t.nbytes());
    return out;
}

}  // namespace

TEST(Evaluate, DatasetLossIsTheTokenWeightedMeanOfPerDocumentLosses) {
    auto m = tiny_model();
    const data::TokenDataset ds = random_docs(23, 2, 45, 3);  // some longer than seq_len 32: cut alike
    double ce_sum = 0;
    int64_t targets = 0;
    for (const data::Document& d : ds.docs) {
        data::TokenDataset one;
        one.docs.push_back(d);
        try {
            const train::EvalResult r = train::evaluate(*m, one, {1, 32, false});
            ce_sum += r.ce_sum;
            targets += r.targets;
        } catch (const Error&) {  // a document with no target within 32 tokens counts nothing
        }
    }
    ASSERT_GT(targets, 0);
    const double expected = ce_sum / static_cast<double>(targets);
    for (const train::EvalOptions opt : {train::EvalOptions{3, 32, true}, train::EvalOptions{5, 32, false},
                                         train::EvalOptions{1, 32, true}, train::EvalOptions{64, 32, true}}) {
        const train::EvalResult r = train::evaluate(*m, ds, opt);
        EXPECT_EQ(r.targets, targets) << opt.micro_batch << " packing " << opt.packing;
        // Per-token CE is an fp32 computation; its sum is the same terms in another order.
        EXPECT_NEAR(r.ce_loss, expected, 1e-5 * expected) << opt.micro_batch << " packing " << opt.packing;
        EXPECT_EQ(r.documents, 23);
        EXPECT_GT(r.truncated, 0);
        EXPECT_GT(r.aux_loss, 0.0);
        EXPECT_NEAR(r.loss, r.ce_loss + 0.01 * r.aux_loss, 1e-12);
    }
}

TEST(Evaluate, LeavesParametersAndGradientsUntouched) {
    auto m = tiny_model();
    data::TokenDataset ds = random_docs(9, 3, 20, 5);
    // Some gradient in the buffer, as between the micro-batches of a training step.
    data::Loader loader(&ds.docs, 16, 2, true, false, 0);
    const data::Batch b = loader.next();
    const model::LossScales scales{1.0 / static_cast<double>(b.num_targets()), 0.01};
    m->step(b, &scales);
    const std::vector<float> params = host_copy(m->params_tensor());
    const std::vector<float> grads = host_copy(m->grads_tensor());
    const train::EvalResult first = train::evaluate(*m, ds, {2, 16, true});
    EXPECT_EQ(host_copy(m->params_tensor()), params);
    EXPECT_EQ(host_copy(m->grads_tensor()), grads);
    const train::EvalResult again = train::evaluate(*m, ds, {2, 16, true});
    EXPECT_EQ(first.ce_sum, again.ce_sum);  // deterministic, and nothing it changed feeds the next
}

TEST(Evaluate, ManyDocumentsRunInTheMemoryOfOneMicroBatch) {
    auto m = tiny_model();
    data::TokenDataset many = random_docs(40000, 2, 4, 7);
    data::Document long_doc;  // one long document among short ones: cut at seq_len, not a wide batch
    for (int t = 0; t < 5000; ++t) long_doc.input_ids.push_back(t % 64);
    long_doc.labels = long_doc.input_ids;
    many.docs.push_back(long_doc);
    const train::EvalResult r = train::evaluate(*m, many, {16, 64, true});
    const size_t bytes_many = m->activation_bytes();
    EXPECT_EQ(r.documents, 40001);
    EXPECT_EQ(r.truncated, 1);
    EXPECT_GT(r.batches, 100);
    // The arena depends on the routing (tokens per expert), not only on B x T: a dataset of one
    // full micro-batch of the same shape sets the scale. One batch of the whole dataset (the old
    // eval) would be 40,001 x 5,000 tokens: thousands of times more.
    auto fresh = tiny_model();
    data::TokenDataset one = random_docs(16, 64, 64, 8);
    (void)train::evaluate(*fresh, one, {16, 64, false});
    EXPECT_LE(bytes_many, 2 * fresh->activation_bytes());
}

TEST(Evaluate, RefusesWhatItCannotEvaluate) {
    auto m = tiny_model();
    data::TokenDataset empty;
    EXPECT_THROW(train::evaluate(*m, empty, {}), Error);
    data::TokenDataset ds = random_docs(3, 4, 8, 1);
    EXPECT_THROW(train::evaluate(*m, ds, {1, 1, true}), Error);
    EXPECT_THROW(train::evaluate(*m, ds, {0, 16, true}), Error);
    for (auto& d : ds.docs) std::fill(d.labels.begin(), d.labels.end(), data::kIgnoreIndex);
    try {
        train::evaluate(*m, ds, {1, 16, true});
        ADD_FAILURE() << "no error for a dataset without targets";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("has a target token"), std::string::npos) << e.what();
    }
}

TEST(Loader, SinglePassUsesEveryDocumentOnceAndStops) {
    const data::TokenDataset ds = random_docs(37, 1, 12, 9);
    for (const bool packing : {true, false}) {
        data::Loader loader(&ds.docs, 16, 4, packing, false, 0);
        loader.set_single_pass(true);
        const data::PackingStats epoch = loader.measure_epoch();
        int64_t tokens = 0, rows = 0, batches = 0;
        while (!loader.done()) {
            const data::Batch b = loader.next();
            ASSERT_GE(b.B, 1);
            ASSERT_LE(b.B, 4);
            ASSERT_EQ(b.input_ids.size(), static_cast<size_t>(b.B * 16));
            tokens += b.num_real_tokens();
            rows += b.B;
            ++batches;
            for (int64_t r = 0; r < b.B; ++r) EXPECT_EQ(b.is_pad[static_cast<size_t>(r * 16)], 0) << "an empty row";
        }
        int64_t expected_tokens = 0;
        for (const auto& d : ds.docs)
            expected_tokens += std::min<int64_t>(static_cast<int64_t>(d.input_ids.size()), 16);
        EXPECT_EQ(tokens, expected_tokens);
        EXPECT_EQ(loader.stats().real_tokens, expected_tokens);
        EXPECT_EQ(loader.stats().rows, rows);
        EXPECT_EQ(epoch.rows, rows);
        EXPECT_EQ(epoch.real_tokens, expected_tokens);
        if (packing) {
            EXPECT_LT(rows, 37);
        } else {
            EXPECT_EQ(rows, 37);
        }
        EXPECT_THROW(loader.next(), Error);
        EXPECT_GT(batches, 0);
    }
}

TEST(Loader, MeasureEpochDoesNotMoveTheLoader) {
    const data::TokenDataset ds = random_docs(20, 3, 30, 4);
    data::Loader a(&ds.docs, 24, 2, true, true, 5);
    data::Loader b(&ds.docs, 24, 2, true, true, 5);
    (void)a.next();
    (void)b.next();
    const data::PackingStats p = a.measure_epoch();
    EXPECT_GT(p.efficiency(24), 0.0);
    EXPECT_LE(p.efficiency(24), 1.0);
    EXPECT_EQ(a.next().input_ids, b.next().input_ids);
    EXPECT_EQ(a.state().cursor, b.state().cursor);
}

TEST(DatasetSummary, CountsTruncatedAndDropsDocumentsWithoutTargets) {
    data::TokenDataset ds;
    ds.skipped_lines = 2;
    auto doc = [](std::vector<int32_t> ids, int masked) {
        data::Document d{ids, ids};
        for (int t = 0; t < masked; ++t) d.labels[static_cast<size_t>(t)] = data::kIgnoreIndex;
        return d;
    };
    ds.docs.push_back(doc({1, 2, 3}, 0));                 // 2 targets
    ds.docs.push_back(doc({1, 2, 3, 4, 5, 6, 7, 8}, 0));  // truncated at 4: 3 targets left
    ds.docs.push_back(doc({1, 2, 3, 4, 5, 6}, 5));        // truncated, its target past the cut: dropped
    ds.docs.push_back(doc({9}, 0));                       // one token: nothing to predict, dropped
    data::DatasetSummary s = data::prepare_documents(ds, 4, "d.jsonl");
    EXPECT_EQ(s.records_read, 6);
    EXPECT_EQ(s.records_skipped, 2);
    EXPECT_EQ(s.records_truncated, 2);
    EXPECT_EQ(s.records_dropped, 2);
    EXPECT_EQ(s.tokens, 3 + 4);
    EXPECT_EQ(s.target_tokens, 2 + 3);
    ASSERT_EQ(ds.docs.size(), 2u);
    data::Loader loader(&ds.docs, 4, 1, true, false, 0);
    s.packing = loader.measure_epoch();
    EXPECT_EQ(s.packing.rows, 2);  // 3 + 4 tokens do not share a row of 4
    EXPECT_DOUBLE_EQ(s.packing.efficiency(4), 7.0 / 8.0);
    const std::string line = s.describe();
    for (const char* part :
         {"data d.jsonl: 6 records (2 skipped as bad)", "2 truncated at seq_len 4",
          "2 dropped with no target token left", "7 tokens, 5 targets", "packing 87.5% (2 rows x 4)"})
        EXPECT_NE(line.find(part), std::string::npos) << part << "\n" << line;
    EXPECT_EQ(line.find('\n'), std::string::npos);

    data::TokenDataset none;
    none.docs.push_back(doc({1, 2, 3, 4, 5}, 4));
    try {
        data::prepare_documents(none, 3, "n.jsonl");
        ADD_FAILURE() << "no error when every document is dropped";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("n.jsonl: none of the 1 records has a target token within its first 3"),
                  std::string::npos)
            << e.what();
    }
}
