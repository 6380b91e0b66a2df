// The fine-tuning loop: recipe -> model + data -> steps -> metrics -> HF directory.
//
// One optimizer step = grad_accum micro-batches. The step's loss is HF's loss over the union of
// its micro-batches: Σ CE / Σ counted targets (+ router_aux_loss_coef × mean aux when the config
// asks HF to add it, output_router_logits), so grad_accum × micro_batch behaves like one big
// batch. Then: clip by the global norm, AdamW at the scheduled lr, zero the gradients.
// Metrics go to OUT/metrics.jsonl (one object per step, flushed as written) and a log line per
// train.log_every steps (on a terminal, a status line with elapsed time and ETA between them).
//
// Nothing a user has is ever lost (train/output_dir.h): OUT is checked before step 1 (not the
// model, the data, `.`, nothing unwritable or too small, no foreign weights) and locked for the
// whole run (io::DirLock: a second run on it refuses at once, naming the holder). At the end the
// model, config and tokenizer files are written into OUT through io::StagedFiles: only the export's
// own files change, each atomically, and nothing else in OUT is touched. With checkpoint.every, a
// resumable training checkpoint is written under OUT/checkpoints (train/checkpoint.h); `--resume`
// continues from one and is an error when there is none.
// Before step 1 the dataset summary (records, truncated, dropped, packing) is printed; a step with
// no target token at all stops the run (data.on_empty: stop) or warns. With eval.data and
// eval.every, the held-out loss (train/evaluate.h) is computed every eval.every steps and at the
// end, logged and written as val_loss; checkpoint.keep_best keeps the best one's checkpoint.
// log.tensorboard writes the step scalars as TensorBoard event files under OUT/tensorboard.
// Interruption (core/interrupt.h): after a SIGINT/SIGTERM the current step finishes, a checkpoint
// is written (whatever checkpoint.every says), the run returns `interrupted_by` (the CLI exits with
// 128 + signal) and a resume continues bitwise as if never stopped. Every rank of a multi-process
// run stops after the same step: each step's sums carry every rank's request.
// A NaN/Inf loss or gradient is caught in its step: train.on_nonfinite = stop ends the run with
// the step and the first layer or tensor where it appeared; skip drops that update.
//
// Multi-process (WORLD_SIZE > 1, train/distributed.h): each rank reads its rows of every global
// micro-batch (rank r of w: rows [r·micro_batch, (r+1)·micro_batch) of a w·micro_batch batch), the
// counted targets are summed over the world before the backward so every rank scales its CE by
// 1 / global targets, the aux loss is averaged over all grad_accum × world micro-batches, and after
// the backward the gradients are summed over the world; the loss is then HF's over the union of all
// ranks' micro-batches, and clipping and AdamW run identically everywhere. Rank 0 alone writes
// metrics, logs and the export (dist.log_ranks: all lets every rank print); every rank writes its
// checkpoint shard (train/checkpoint.h) and waits at a barrier for the export before returning.
// With dist.ep_size > 1 each rank holds E/EP experts of every MoE layer and computes them for the
// tokens its EP group routes there (model/ep_exchange.h); the replicated gradients are summed over
// the world and the expert gradients over the DP group, during the backward (train/distributed.h).
// With dist.shard_optimizer the AdamW state is sharded over each parameter's replica group
// (train/optimizer.h). The export gathers the whole model onto rank 0, one tensor at a time.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "core/json.h"
#include "data/token_dataset.h"
#include "train/recipe.h"

namespace mf::model {
class CausalLM;
}

namespace mf::train {

struct StepMetrics {
    int64_t step = 0;  // 1-based
    double loss = 0, ce_loss = 0, aux_loss = 0, grad_norm = 0, lr = 0;
    int64_t tokens = 0;  // non-padding tokens processed in the step
    double tokens_per_s = 0;
    double peak_mem_gib = 0;
    double step_seconds = 0;  // wall time of the step (not in metrics.jsonl: tokens_per_s carries it)
    bool skipped = false;     // a non-finite step whose update was dropped (train.on_nonfinite: skip)
    double val_loss = -1;     // the held-out loss when an evaluation ran after this step, else -1
    // metrics.jsonl's line: the fields above but step_seconds; skipped and val_loss only when set.
    json::Value to_json() const;
};

struct TrainSummary {
    int64_t steps = 0;
    double first_loss = 0, last_loss = 0;
    double seconds = 0;
    std::string out_dir;
    int interrupted_by = 0;  // the signal that stopped the run after `steps` (0: it finished and exported)
};

struct ResumeOptions {
    std::string from;    // "" = fresh run; "auto" = newest checkpoint under OUT/checkpoints (there must be one);
                         // else a checkpoint directory
    bool force = false;  // resume even if the recipe changed in a way that matters
};

struct RunState;

// One fine-tuning job, step by step: what `moeforge finetune` runs (finetune() below drives it to the
// end) and what the C API's engine (capi/) drives one call at a time, so both run one code path.
//   construction  setup: OUT checked and locked, model, data and optimizer loaded, a checkpoint
//                 restored when `resume` names one; the run's opening lines printed
//   step()        one optimizer step and all the loop records after it: metrics.jsonl, the log
//                 line, evaluation, TensorBoard, a checkpoint when checkpoint.every or keep_best
//                 asks; after a SIGINT/SIGTERM on any rank, a checkpoint, and interrupted_by() says so
//   export_model  the HF directory into OUT (every rank calls it; rank 0 writes)
// Destroying a trainer releases OUT's lock.
class Trainer {
 public:
    explicit Trainer(Recipe recipe, const ResumeOptions& resume = {});
    ~Trainer();
    Trainer(const Trainer&) = delete;
    Trainer& operator=(const Trainer&) = delete;

    const Recipe& recipe() const;
    int64_t steps_done() const;  // optimizer steps done (a resumed run starts at its checkpoint's)
    bool finished() const;       // steps_done() == train.steps, or the run was interrupted
    // The signal that stopped the run after the last step (0: none).
    int interrupted_by() const;
    StepMetrics step();  // refused when finished()
    // A resumable checkpoint of the steps done (none when the newest one already holds them).
    void save_checkpoint();
    // Writes the HF directory into OUT; returns OUT.
    std::string export_model();
    model::CausalLM& model();
    const std::filesystem::path& out_dir() const;

 private:
    std::unique_ptr<RunState> run_;
};

// The whole job: a Trainer stepped to train.steps (or an interruption), then the export.
TrainSummary finetune(const Recipe& recipe, const ResumeOptions& resume = {});

// The recipe's training data (or `file`, e.g. eval.data, in the same format) as documents: JSONL of
// messages, prompt/completion, text or token ids (data.format), tokenised with the tokenizer in
// `model_dir` when there is one.
data::TokenDataset read_dataset(const Recipe& recipe, const std::filesystem::path& model_dir, int64_t vocab_size,
                                const std::string& file = "");

}  // namespace mf::train
