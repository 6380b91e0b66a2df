// The training recipe: one YAML file (the subset of train/yaml.h) plus `key.sub=value` overrides
// from the command line, validated into a plain struct.
//
//   model: /models/Qwen3-30B-A3B          # HF model directory (required)
//   data:  {train: data/sft.jsonl, format: messages}
//   train: {steps: 1000, micro_batch: 4, seq_len: 4096}
//   optim:
//     lr: 2.0e-5
//     betas: [0.9, 0.95]
//     no_decay: ["*norm*", "*bias"]       # quoted: a leading '*' would read as a YAML alias
//     schedule: cosine
//     warmup_steps: 50
//   out: runs/qwen3-sft                    # output directory (required)
//
// Invariants after parsing: every key is known (an unknown one is an error suggesting the closest
// known key), required keys are present, every value has its type and lies in its range. Errors
// name the source ("FILE:LINE" or "command line"), the key and what was expected. Integer fields
// accept integral floats (1e3) but refuse 1.5; float fields accept integers; NaN and infinities
// are refused by name. Optimizer defaults are those of torch.optim.AdamW except the learning rate
// (1e-5, a fine-tuning rate).
//
// Every key is declared once, in recipe.cpp's key table (path, type and range, default, meaning,
// how it is read and written); the known-key list, the parser, Recipe::to_json and
// `moeforge recipe --explain` (recipe_key_docs()) are all derived from it.
//
// Paths (model, data.train, eval.data, out): a relative path written in the recipe file resolves
// from the directory of the recipe file (load_recipe), so a recipe and its data move together; a
// relative path given as a command-line override resolves from the current directory, as any
// command-line path does. Absolute paths are kept as written.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/json.h"

namespace mf::train {

struct Recipe {
    std::string source;  // path of the recipe file (for messages)
    std::string model;   // HF model directory (required)

    struct Data {
        std::string train;            // dataset path (required)
        std::string format = "auto";  // auto | tokens | messages | prompt_completion | text
        bool shuffle = true;
        bool packing = true;
        std::string on_error = "stop";     // stop | skip: what a malformed record does
        std::string chat_format = "auto";  // auto (from the tokenizer's chat template) | jinja | chatml |
                                           // chatml_system | chatml_think
        json::Value chat_template_kwargs = json::Value::object();  // extra chat template variables
        std::string loss_on = "assistant";  // assistant | all: which chat tokens count in the loss
        std::string on_empty = "stop";      // stop | warn: an optimizer step with no target token at all
    } data;

    struct Train {
        int64_t steps = 0;                  // optimizer steps (required, >= 1)
        int64_t micro_batch = 1;            // sequences per forward pass, 1 .. 2^20
        int64_t seq_len = 2048;             // tokens per sequence, 2 .. 2^24 (micro_batch x seq_len <= 2^22)
        int64_t grad_accum = 1;             // micro-batches per optimizer step, 1 .. 2^20
        double grad_clip = 1.0;             // max global grad norm; 0 disables clipping
        int64_t log_every = 1;              // steps between log lines, >= 1
        std::string recompute = "none";     // none | moe | full
        std::string on_nonfinite = "stop";  // stop | skip: a NaN/Inf loss or gradient stops the run or skips the update
    } train;

    struct Optim {
        double lr = 1e-5;                   // peak learning rate, >= 0
        double beta1 = 0.9, beta2 = 0.999;  // written as `betas: [b1, b2]`, each in [0, 1)
        double eps = 1e-8;                  // > 0
        double weight_decay = 0.01;         // >= 0, decoupled (AdamW)
        std::vector<std::string> no_decay;  // globs (* and ?) over HF parameter names: no weight decay
        std::string schedule = "constant";  // constant | cosine | linear (see lr_schedule.h)
        int64_t warmup_steps = 0;           // 0 .. train.steps
        double min_lr_ratio = 0.0;          // floor of the decay, as a fraction of lr, in [0, 1]
    } optim;

    // Evaluation on held-out data during training (train/evaluate.h).
    struct Eval {
        std::string data;         // held-out dataset path; "" = none
        int64_t every = 0;        // optimizer steps between evaluations; 0 = never (needs data when > 0)
        int64_t micro_batch = 0;  // rows per forward pass; 0 in the file = train.micro_batch (resolved)
        int64_t seq_len = 0;      // tokens per row; 0 in the file = train.seq_len (resolved)
    } eval;

    struct Checkpoint {
        int64_t every = 0;       // optimizer steps between training checkpoints; 0 = none
        int64_t keep = 2;        // newest checkpoints kept, >= 1
        bool keep_best = false;  // also keep the checkpoint of the best eval loss (needs eval.data, eval.every)
    } checkpoint;

    struct Log {
        bool tensorboard = false;  // event files under OUT/tensorboard
        int64_t every = 0;         // steps between TensorBoard scalars; 0 in the file = train.log_every (resolved)
    } log;

    // Multi-process runs (WORLD_SIZE > 1 in the environment; see train/distributed.h).
    struct Dist {
        int64_t ep_size = 1;             // expert-parallel group size: divides the world size and the expert count
        int64_t ep_chunks = 1;           // EP pipeline: the local experts in this many chunks whose all-to-alls
                                         // overlap the other chunks' GEMMs (model/ep_exchange.h), 1 .. 64; 1 is
                                         // the fastest on 2 H200s since the exchange moves tokens (ep_exchange.h)
        double timeout_s = 300.0;        // longest any single collective wait may last before the run fails, > 0
        bool shard_optimizer = true;     // ZeRO-1: AdamW state sharded over each replica group (train/optimizer.h)
        std::string log_ranks = "main";  // main: rank 0 alone logs; all: every rank prints its lines, "[rank R] "
    } dist;

    int64_t seed = 0;                // >= 0
    std::string device = "auto";     // auto | cpu | cuda
    std::string precision = "bf16";  // bf16 | mixed (see DESIGN.md, Precision)
    std::string out;                 // output directory (required)

    // Every recipe key with its value, nested as in the file (`source` is not a key, so it is left
    // out), for writing next to the outputs.
    json::Value to_json() const;
};

// Reads and parses `file`, then applies `overrides` ("key.sub=value", value parsed as a YAML
// scalar or flow collection, '#' and a leading '*' taken literally) in order. Relative paths of
// the file resolve from file's directory, those of overrides from the current directory.
Recipe load_recipe(const std::filesystem::path& file, const std::vector<std::string>& overrides);
// As load_recipe on text; relative paths in the text resolve from `base_dir` (empty: kept as written).
Recipe parse_recipe(std::string_view yaml_text, const std::string& source, const std::vector<std::string>& overrides,
                    const std::filesystem::path& base_dir = {});

// The most tokens one micro-batch (micro_batch x seq_len, train or eval) may hold on one rank.
inline constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 22;

// One recipe key as documented: derived from the key table, in the table's order.
struct RecipeKeyDoc {
    std::string path;           // "train.seq_len"
    std::string type;           // "integer in [2, 16777216]"
    std::string default_value;  // as YAML would write it, "(required)" or the key it follows
    std::string meaning;
};
std::vector<RecipeKeyDoc> recipe_key_docs();

// Glob match of the whole `name`: '*' matches any run of characters (dots included), '?' exactly
// one character, everything else itself. Used for optim.no_decay against HF parameter names.
bool matches_pattern(std::string_view pattern, std::string_view name);

}  // namespace mf::train
