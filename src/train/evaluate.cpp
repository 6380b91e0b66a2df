// Evaluation: single-pass loader, forward-only steps, sums over batches (see evaluate.h).
#include "train/evaluate.h"

#include "core/check.h"
#include "data/loader.h"

namespace mf::train {

EvalResult evaluate(model::CausalLM& model, const data::TokenDataset& ds, const EvalOptions& opt) {
    if (opt.micro_batch < 1) fail("evaluation: micro_batch must be >= 1, got ", opt.micro_batch);
    if (opt.seq_len < 2) fail("evaluation: seq_len must be >= 2 (one target needs two tokens), got ", opt.seq_len);
    if (ds.docs.empty()) fail("evaluation: the dataset has no documents");
    EvalResult r;
    r.documents = static_cast<int64_t>(ds.docs.size());
    for (const data::Document& d : ds.docs) r.truncated += static_cast<int64_t>(d.input_ids.size()) > opt.seq_len;
    data::Loader loader(&ds.docs, opt.seq_len, opt.micro_batch, opt.packing, false, 0);
    loader.set_single_pass(true);
    double aux_sum = 0;
    while (!loader.done()) {
        const data::Batch batch = loader.next();
        const model::StepStats s = model.step(batch, nullptr);
        r.ce_sum += s.ce_sum;
        r.targets += s.num_targets;
        r.tokens += batch.num_real_tokens();
        aux_sum += s.aux;
        ++r.batches;
    }
    if (r.targets == 0)
        fail("evaluation: none of the ", r.documents, " documents has a target token within its first ", opt.seq_len,
             " tokens");
    const model::ModelSpec& cfg = model.spec();
    r.ce_loss = r.ce_sum / static_cast<double>(r.targets);
    r.aux_loss = aux_sum / static_cast<double>(r.batches);
    const bool add_aux = cfg.adds_aux_loss();
    r.loss = r.ce_loss + (add_aux ? cfg.router_aux_loss_coef * r.aux_loss : 0.0);
    return r;
}

}  // namespace mf::train
