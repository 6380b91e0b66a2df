// Resumable training checkpoints.
//
// A checkpoint is a directory OUT/checkpoints/step-NNNNNNNN/ holding
//   tensors.safetensors  the fp32 parameters and AdamW's two moments, flat, in parameter-table order
//   state.json           magic, format version, world and EP size, config hash, step, AdamW step,
//                        data-loader state (epoch, cursor), the seed, and the recipe
// Each is written into a temporary sibling directory, fsynced and renamed into place
// (io::AtomicDir), so a directory named step-* is always complete; a crash leaves at most a
// *.tmp-* directory, which is ignored and swept. The newest `keep` checkpoints are kept.
// Everything a step depends on is in here, so a resumed run is bitwise identical to an
// uninterrupted one on the same world size.
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
constexpr int64_t kCheckpointFormatVersion = 1;

// The parallel layout a checkpoint was written under. A checkpoint resumes only at the same world
// and EP size: the data-loader state is a position in the global batch order, and the batch each
// rank reads depends on the world size.
struct CheckpointLayout {
    int64_t world_size = 1;
    int64_t ep_size = 1;
};

struct CheckpointState {
    int64_t step = 0;  // optimizer steps completed
    int64_t adam_step = 0;
    data::LoaderState loader;
    json::Value recipe;
};

// Writes OUT/checkpoints/step-<step> and prunes to the newest `keep`. In a multi-process run only
// rank 0 calls it (with ep_size 1 every rank holds the same parameters and AdamW state).
void save_checkpoint(const std::filesystem::path& root, const CheckpointState& state, model::Qwen3Moe& model,
                     AdamW& adam, int64_t keep, const CheckpointLayout& layout = {});

// The newest complete checkpoint under root, if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

// Validates (magic, version, world/EP size, config hash, the recipe keys a resume must not
// change unless `force`) and restores model parameters and AdamW state; returns the state.
CheckpointState load_checkpoint(const std::filesystem::path& dir, const Recipe& recipe, model::Qwen3Moe& model,
                                AdamW& adam, bool force, const CheckpointLayout& layout = {});

}  // namespace mf::train
