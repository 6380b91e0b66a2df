// The model's parameters as one flat buffer, sliced into named tensors.
//
// Names are the HF Transformers v5 module names (`model.layers.3.self_attn.q_proj.weight`,
// `model.layers.3.mlp.experts.gate_up_proj` stacked [E, 2I, H]), so recipe patterns such as
// `optim.no_decay` and the parity fixtures speak the same language as a user's HF code. The
// gradient buffer has the same layout: grad(name) is the same slice of the gradient buffer.
//
// Layout: specs() keeps the order parameters were added in (layer order), but offsets put every
// replicated (non-expert) parameter first and the stacked expert weights after them, so the
// buffer is two contiguous regions: [0, expert_offset()) replicated on every rank and
// [expert_offset(), total()) the experts. Under expert parallelism (ExpertShard) a rank's table
// holds only its E/S experts: stacked specs have shape [E/S, ...] and say which global experts
// they hold (expert_first); the replicated region is the same on every rank.
//
// Every parameter starts at a multiple of kParamAlign elements (16 bytes of bf16), as the GEMM
// libraries ask of their pointers: a small tensor (Mamba-2's A_log of 4 heads) is followed by zero
// padding, never updated and zero in the gradient. A parameter occupies extent() elements; the
// padding is counted in total() (the buffer's length) but not in count() (the model's parameters).
// The published geometries need no padding (their sizes are multiples of 8), so their layout is the
// plain concatenation it always was.
//
// Each parameter has a role (what initialisation, data parallelism and the optimizer's stages key on,
// never its name) and says how HF checkpoints store it (ParamStorage), which is all the checkpoint
// reader and writer (train/hf_checkpoint.h) know of an architecture.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace mf::model {

inline constexpr int64_t kParamAlign = 8;

// This rank's share of the experts: experts [rank·E/size, (rank+1)·E/size) of every MoE layer.
struct ExpertShard {
    int64_t rank = 0;
    int64_t size = 1;
    bool sharded() const { return size > 1; }
};

// What a parameter is. `expert`: stacked expert weights [E, ...] (split over EP ranks). `buffer`: a
// tensor the checkpoint holds that training never changes (HF's persistent buffers, such as a sigmoid
// router's e_score_correction_bias): it gets no gradient, no update and no weight decay.
enum class ParamRole { embedding, head, norm, bias, weight, expert, buffer };
const char* param_role_name(ParamRole role);

// How init_random fills a parameter (HF's _init_weights): by its role (norms 1, biases and buffers 0,
// the rest normal), or as the Mamba-2 mixer's own: `ones` (D), `a_log` (A_log = log(1..n) over the
// heads), `dt_bias` (softplus⁻¹ of dt drawn log-uniform in [1e-3, 1e-1], floored at 1e-4: HF's
// time_step_min/max/floor defaults).
enum class ParamInit { by_role, ones, a_log, dt_bias };

// How an HF checkpoint stores a parameter. By default one tensor of the same name and shape. A
// renamed module stores it under `disk_name`. Stacked experts are stored one tensor per expert and
// piece: `expert_pieces` names each piece with "{}" where the expert's index goes, and the pieces
// are stacked along the rows in order (gate_up [E, 2I, H] = per expert gate_proj [I, H] then
// up_proj [I, H]). The stacked engine name itself (HF v5's in-memory spelling) is read as well.
//
// Stacked experts stored as one tensor (no pieces) may be laid out differently per expert: `transposed`
// stores each expert's [R, C] slice as [C, R]; `interleaved` stores the two halves of its rows (gate
// rows [0, R/2), up rows [R/2, R)) interleaved, gate row i at 2i and up row i at 2i + 1 (before the
// transpose). gpt-oss's checkpoints are both.
struct ParamStorage {
    std::string disk_name;
    std::vector<std::string> expert_pieces;
    bool transposed = false;
    bool interleaved = false;
    bool reshaped() const { return transposed || interleaved; }
};

struct ParamSpec {
    std::string name;
    ParamRole role = ParamRole::weight;
    ParamInit init = ParamInit::by_role;
    ParamStorage storage;
    Shape shape;         // the local shape (stacked experts: [E/S, ...])
    int64_t offset = 0;  // in elements, into the flat buffer
    int64_t numel = 0;
    // The elements it occupies in the flat buffer: numel, then the padding up to the next parameter.
    int64_t extent() const { return (numel + kParamAlign - 1) / kParamAlign * kParamAlign; }
    bool is_expert = false;     // stacked expert weights (split over EP ranks)
    int64_t expert_first = 0;   // stacked experts: the global index of local expert 0
    int64_t experts_total = 0;  // stacked experts: E over all ranks
    int64_t layer = -1;         // N for "model.layers.N.*", else -1
    // The shape over all ranks (== shape unless the experts are sharded).
    Shape global_shape() const;
    // The name HF checkpoints store it under (storage.disk_name, or name).
    const std::string& disk_name() const { return storage.disk_name.empty() ? name : storage.disk_name; }
};

// "model.layers.N.": the prefix of layer N's parameters.
std::string layer_prefix(int64_t layer);

class ParamTable {
 public:
    // Appends a parameter; offsets keep the two regions above (experts after everything else).
    // For an expert parameter `shape` is the GLOBAL [E, ...] shape, and `shard` picks the local rows.
    const ParamSpec& add(std::string name, Shape shape, ParamRole role, ExpertShard shard = {},
                         ParamStorage storage = {}, ParamInit init = ParamInit::by_role);
    // Every parameter named "model.*" is stored on disk as prefix + "*" (Nemotron-H's "backbone."),
    // its renamed and per-expert disk names included.
    void store_model_prefix_as(const std::string& prefix);
    // The parameter of a role outside the layers (the embedding, the untied head), or null.
    const ParamSpec* find_role(ParamRole role) const;
    const ParamSpec* find(std::string_view name) const;
    const ParamSpec& get(std::string_view name) const;  // throws naming the parameter
    const std::vector<ParamSpec>& specs() const { return specs_; }
    // Elements of the flat buffer, padding included.
    int64_t total() const { return replicated_ + experts_; }
    // The parameters' elements (what a model's size is reported as), padding excluded.
    int64_t count() const;
    // Elements in the replicated region = the offset of the expert region.
    int64_t expert_offset() const { return replicated_; }

 private:
    std::vector<ParamSpec> specs_;
    int64_t replicated_ = 0, experts_ = 0;
};

}  // namespace mf::model
