// Evaluation of a model on a dataset: the loss over every target token, in bounded memory.
//
// The documents go once, in file order, through a single-pass data::Loader with the training
// packing (data/loader.h): rows of seq_len tokens, micro_batch rows per forward pass, documents
// longer than seq_len cut there. Each batch is a forward only (CausalLM::step with null scales):
// parameters, gradients and the optimizer are untouched, so the trainer may call this between
// steps. Memory is that of one micro-batch, whatever the dataset's size.
//
//   ce_loss  = Σ CE / Σ targets over all batches (every target token weighs the same)
//   aux_loss = the mean of the batches' aux losses (as the trainer averages micro-batches)
//   loss     = ce_loss + router_aux_loss_coef x aux_loss when the config adds it
//              (output_router_logits and experts), else ce_loss: the trainer's step loss
#pragma once

#include <cstdint>

#include "data/token_dataset.h"
#include "model/causal_lm.h"

namespace mf::train {

struct EvalOptions {
    int64_t micro_batch = 1;  // rows per forward pass, >= 1
    int64_t seq_len = 2048;   // tokens per row, >= 2
    bool packing = true;      // several documents per row, as in training
};

struct EvalResult {
    double loss = 0, ce_loss = 0, aux_loss = 0;
    double ce_sum = 0;      // Σ CE over the targets
    int64_t targets = 0;    // target tokens counted
    int64_t tokens = 0;     // real (non-padding) tokens run
    int64_t batches = 0;    // forward passes
    int64_t documents = 0;  // documents of the dataset
    int64_t truncated = 0;  // documents longer than seq_len (cut)
};

// An mf::Error when the dataset is empty, the options are out of range, or no document has a
// target token within seq_len.
EvalResult evaluate(model::CausalLM& model, const data::TokenDataset& ds, const EvalOptions& opt);

}  // namespace mf::train
