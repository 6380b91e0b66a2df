// Resumable training checkpoints.
//
// A checkpoint is a directory OUT/checkpoints/step-NNNNNNNN/ holding
//   shard-RRRRR-of-WWWWW.safetensors   one per rank of the run that wrote it: that rank's part of
//                        the optimizer state of the WHOLE model, f32, as 1-D pieces named
//                        "KIND/NAME@OFFSET" (KIND: param = the master weights, exp_avg, exp_avg_sq;
//                        OFFSET: where the piece starts in the whole tensor NAME, flattened). A rank
//                        writes its ZeRO-1 chunk of the parameters it holds (its experts; the
//                        replicated ones only from EP rank 0's group), so no rank ever gathers the
//                        model, and together the shards tile every tensor exactly once.
//   state.json           magic, format version, world and EP size it was written at, the number of
//                        shards and each one's CRC-32C (computed as it was written), config hash,
//                        step, AdamW step, the learning rate of the next step, data-loader state
//                        (epoch, cursor), the seed, the recipe, and last its own CRC-32C
//                        ("state_checksum", over the text before it)
// Loading indexes every shard's pieces, checks that they tile each tensor of the model exactly (no
// gap, no overlap, nothing unknown, F32), and each rank copies out the parts it holds from the
// memory-mapped files. The loader state is a position in the document order every rank shares. So
// a checkpoint resumes at any world and EP size. All ranks must see OUT (a shared filesystem).
// Rank 0 creates the temporary sibling directory, every rank writes its shard into it, and rank 0
// adds state.json, fsyncs and renames it into place (io::AtomicDir), so a directory named step-*
// is always complete; a crash leaves at most a *.tmp-* directory, which is ignored and swept. The
// newest `keep` checkpoints are kept.
// Everything a step depends on is in here, so a resumed run is bitwise identical to an
// uninterrupted one on the same world size; at another world size the run continues from the same
// document with a global batch of the new size. Every shard's checksum and state.json's own are
// verified on load: a flipped byte is an error naming the file, never a silently different run.
// The learning-rate schedule is defined by train.steps: a resume whose recipe would make the next
// step's learning rate differ from the one the checkpoint recorded (more steps under a cosine or
// linear decay, another lr or warmup) is refused with both rates unless forced.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "core/json.h"
#include "data/loader.h"
#include "model/causal_lm.h"
#include "train/optimizer.h"
#include "train/recipe.h"

namespace mf::train {

constexpr const char* kCheckpointMagic = "moeforge-training-checkpoint";
constexpr int64_t kCheckpointFormatVersion = 3;  // 3: checksums, next_lr; 2 still loads (unverified)

class DistContext;

// The parallel layout a checkpoint was written under (recorded; resuming at another one is fine).
struct CheckpointLayout {
    int64_t world_size = 1;
    int64_t ep_size = 1;
    int64_t rank = 0;  // this process (rank 0 prints the notes)
};

struct CheckpointState {
    int64_t step = 0;  // optimizer steps completed
    int64_t adam_step = 0;
    data::LoaderState loader;
    json::Value recipe;
    double next_lr = -1;       // the learning rate of step `step` + 1 under the writing run's schedule (< 0: unknown)
    int64_t best_step = -1;    // checkpoint.keep_best: the step of the best evaluation (-1: none); never pruned
    double best_val_loss = 0;  // its eval loss
};

// Writes OUT/checkpoints/step-<step> and prunes to the newest `keep` (and state.best_step's). In a multi-process run
// every rank calls it and writes its shard; rank 0 completes the directory.
void save_checkpoint(const std::filesystem::path& root, const CheckpointState& state, model::CausalLM& model,
                     AdamW& adam, int64_t keep, const CheckpointLayout& layout = {}, DistContext* dist = nullptr);

// The newest complete checkpoint under root, if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

// Validates (magic, version, config hash, every tensor's name, dtype and shape, the recipe keys a
// resume must not change unless `force`) and restores this rank's model parameters and AdamW
// state; returns the state. Every rank calls it.
CheckpointState load_checkpoint(const std::filesystem::path& dir, const Recipe& recipe, model::CausalLM& model,
                                AdamW& adam, bool force, const CheckpointLayout& layout = {});

}  // namespace mf::train
