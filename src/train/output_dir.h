// The output directory of a run (recipe `out`, `init --out`), checked before anything is trained
// or written, so that a run never ends in an export that fails or destroys what it should not.
//
// What the export writes into OUT: its own files only (config.json, the safetensors weights and
// index, the tokenizer and generation files, through io::StagedFiles with the record kExportRecord)
// and, from the trainer, metrics.jsonl, recipe.json, checkpoints/ and the lock. Everything else in
// OUT is left alone. Refused, with the reason named:
//   - OUT that is the current directory (`.`), the model directory, inside it or a parent of it,
//     or a parent of a data file: by the real paths, so a path through a symlink that resolves to
//     one of these is refused just the same;
//   - OUT that exists and is not a directory, or that cannot be created or written;
//   - OUT holding model weights (model*.safetensors, the index) that no earlier moeforge export
//     wrote: the new export would mix with them (a reader might load the old ones);
//   - too little free space for the export's weights (a shortfall for checkpoints is a warning).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mf::train {

struct OutputCheck {
    std::string field = "out";                  // how the user named OUT, for messages ("out", "init: --out")
    std::filesystem::path model_dir;            // the model read (empty: none)
    std::vector<std::filesystem::path> inputs;  // data files and other inputs OUT must not contain
    uint64_t export_bytes = 0;                  // bytes the export will write
    uint64_t checkpoint_bytes = 0;              // bytes the checkpoints kept at once may take (warning only)
};

// Returns OUT's real path (symlinks resolved; the directory need not exist yet). Throws naming the
// problem; prints a warning when checkpoints may not fit.
std::filesystem::path check_output_dir(const std::filesystem::path& out, const OutputCheck& check);

}  // namespace mf::train
