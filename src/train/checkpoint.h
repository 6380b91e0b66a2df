// Resumable training checkpoints.
//
// A checkpoint is a directory OUT/checkpoints/step-NNNNNNNN/ holding
//   tensors.safetensors  per parameter of the WHOLE model (every expert, whatever the EP size),
//                        f32: "param/NAME" (the master weights), "exp_avg/NAME", "exp_avg_sq/NAME"
//   state.json           magic, format version, world and EP size it was written at, config hash,
//                        step, AdamW step, data-loader state (epoch, cursor), the seed, the recipe
// The tensors do not depend on the parallel layout (the EP shards and ZeRO-1 chunks are gathered
// before writing; on load every rank reads its slice), and the loader state is a position in the
// document order every rank shares, so a checkpoint resumes at any world and EP size.
// Each is written into a temporary sibling directory, fsynced and renamed into place
// (io::AtomicDir), so a directory named step-* is always complete; a crash leaves at most a
// *.tmp-* directory, which is ignored and swept. The newest `keep` checkpoints are kept.
// Everything a step depends on is in here, so a resumed run is bitwise identical to an
// uninterrupted one on the same world size; at another world size the run continues from the same
// document with a global batch of the new size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "core/json.h"
#include "data/loader.h"
#include "model/qwen3_moe.h"
#include "train/optimizer.h"
#include "train/recipe.h"

namespace mf::train {

constexpr const char* kCheckpointMagic = "moeforge-training-checkpoint";
constexpr int64_t kCheckpointFormatVersion = 2;

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
};

// Writes OUT/checkpoints/step-<step> and prunes to the newest `keep`. In a multi-process run every
// rank calls it (the EP shards and ZeRO chunks are gathered) and rank 0 writes.
void save_checkpoint(const std::filesystem::path& root, const CheckpointState& state, model::Qwen3Moe& model,
                     AdamW& adam, int64_t keep, const CheckpointLayout& layout = {}, DistContext* dist = nullptr);

// The newest complete checkpoint under root, if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

// Validates (magic, version, config hash, every tensor's name, dtype and shape, the recipe keys a
// resume must not change unless `force`) and restores this rank's model parameters and AdamW
// state; returns the state. Every rank calls it.
CheckpointState load_checkpoint(const std::filesystem::path& dir, const Recipe& recipe, model::Qwen3Moe& model,
                                AdamW& adam, bool force, const CheckpointLayout& layout = {});

}  // namespace mf::train
