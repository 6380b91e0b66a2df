// The model's parameters as one flat fp32 buffer, sliced into named tensors.
//
// Names are the HF Transformers v5 module names (`model.layers.3.self_attn.q_proj.weight`,
// `model.layers.3.mlp.experts.gate_up_proj` stacked [E, 2I, H]), so recipe patterns such as
// `optim.no_decay` and the parity fixtures speak the same language as a user's HF code. The
// gradient buffer has the same layout: grad(name) is the same slice of the gradient buffer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace mf::model {

struct ParamSpec {
    std::string name;
    Shape shape;
    int64_t offset = 0;  // in elements, into the flat buffer
    int64_t numel = 0;
    bool is_expert = false;  // stacked expert weights (split over EP ranks later)
};

class ParamTable {
 public:
    // Appends a parameter right after the previous one (so consecutive specs are contiguous).
    const ParamSpec& add(std::string name, Shape shape, bool is_expert = false);
    const ParamSpec* find(std::string_view name) const;
    const ParamSpec& get(std::string_view name) const;  // throws naming the parameter
    const std::vector<ParamSpec>& specs() const { return specs_; }
    int64_t total() const { return total_; }

 private:
    std::vector<ParamSpec> specs_;
    int64_t total_ = 0;
};

}  // namespace mf::model
