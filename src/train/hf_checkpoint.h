// HF model directories in and out: config.json + safetensors (single or sharded) + tokenizer
// files, mapped to and from the engine's parameter table.
//
// Nothing here knows an architecture: config.json goes to the architecture table (model/arch/), and
// each parameter of the resulting table says how HF stores it (model::ParamStorage): under its own
// name, under a renamed module's, or (stacked experts, `gate_up [E, 2I, H]`, gate rows first, and
// `down [E, H, I]`) as one tensor per expert and projection, e.g.
// `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` or Mixtral's
// `model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight`. Loading stacks them, saving splits them
// again, so `transformers` and vLLM read what we write. The v5 in-memory spelling (the engine's names,
// `mlp.experts.gate_up_proj`) is accepted on load as well. A tensor the model does not use, or one it
// needs and the directory lacks, is an error naming it. Under expert parallelism (placement.shard)
// every tensor is still checked, but a rank reads only its experts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/json.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"

namespace mf::train {

// Reads DIR/config.json (parsed and validated; `raw` receives the JSON as written).
model::ModelSpec read_hf_config(const std::filesystem::path& dir, json::Value* raw = nullptr);

// Reads config and weights of an HF model directory.
std::unique_ptr<model::CausalLM> load_hf_model(const std::filesystem::path& dir, json::Value* raw_config = nullptr,
                                               model::ModelPlacement placement = {});
// The weights of DIR for a spec already read (its config.json is not read).
std::unique_ptr<model::CausalLM> load_hf_weights(const std::filesystem::path& dir, model::ModelSpec spec,
                                                 model::ModelPlacement placement = {});

// Writes config.json (from `raw_config`, or the model's own when null), the weights in the
// config's dtype (float32, bfloat16 or float16), and the tokenizer files found in `tokenizer_dir`
// (when not empty) into `dir`, which must exist. Callers wanting all-or-nothing pass the
// temporary path of an io::AtomicDir.
// The model must hold every expert (not an EP shard).
void save_hf_model(const std::filesystem::path& dir, model::CausalLM& model, const json::Value* raw_config,
                   const std::filesystem::path& tokenizer_dir, size_t max_shard_bytes = size_t{5} << 30);
// The same from the whole model's parameters as host f32 in the layout of model_param_table(cfg).
void save_hf_model(const std::filesystem::path& dir, const model::ModelSpec& cfg, const std::vector<float>& params,
                   const json::Value* raw_config, const std::filesystem::path& tokenizer_dir,
                   size_t max_shard_bytes = size_t{5} << 30);

// Values [offset, offset + n) of the whole model's table (model_param_table(cfg)) as host f32,
// written to `out`. save_hf_model asks for each HF tensor once, in table order (ranges never cross
// a parameter), and converts and writes it before asking for the next: only one tensor is staged
// at a time (DistContext::export_source gathers the EP ranks' experts this way).
using ParamSource = std::function<void(int64_t offset, int64_t n, float* out)>;
void save_hf_model(const std::filesystem::path& dir, const model::ModelSpec& cfg, const ParamSource& source,
                   const json::Value* raw_config, const std::filesystem::path& tokenizer_dir,
                   size_t max_shard_bytes = size_t{5} << 30);

// The dtype the export writes (the config's torch_dtype: float32, bfloat16 or float16) and the bytes
// of weights that makes, for checking free space before training.
io::StDType export_dtype(const model::ModelSpec& cfg);
uint64_t export_bytes(const model::ModelSpec& cfg);

// An export into a directory writes through io::StagedFiles with this record, so a later export into
// the same directory knows which files it may replace or remove (train/output_dir.h).
constexpr const char* kExportRecord = ".moeforge-export.json";

// model.safetensors, model.safetensors.index.json, model-NNNNN-of-MMMMM.safetensors.
bool is_weight_file_name(const std::string& name);

// Tokenizer and generation files copied along with a model.
const std::vector<std::string>& tokenizer_file_names();

}  // namespace mf::train
