#include "model/param_table.h"

#include <string_view>

namespace mf::model {

Shape ParamSpec::global_shape() const {
    Shape s = shape;
    if (is_expert) s[0] = experts_total;
    return s;
}

std::string layer_prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + "."; }

const char* param_role_name(ParamRole role) {
    switch (role) {
        case ParamRole::embedding:
            return "embedding";
        case ParamRole::head:
            return "head";
        case ParamRole::norm:
            return "norm";
        case ParamRole::bias:
            return "bias";
        case ParamRole::weight:
            return "weight";
        case ParamRole::expert:
            return "expert";
        case ParamRole::buffer:
            return "buffer";
    }
    return "?";
}

const ParamSpec& ParamTable::add(std::string name, Shape shape, ParamRole role, ExpertShard shard, ParamStorage storage,
                                 ParamInit init) {
    MF_CHECK(find(name) == nullptr, "duplicate parameter ", name);
    const bool is_expert = role == ParamRole::expert;
    MF_CHECK(is_expert || (storage.expert_pieces.empty() && !storage.reshaped()), "per-expert storage for ", name,
             ", which is not stacked");
    MF_CHECK(!storage.reshaped() ||
                 (storage.expert_pieces.empty() && shape.size() == 3 && (!storage.interleaved || shape[1] % 2 == 0)),
             "reshaped storage for ", name, " needs one stacked [E, R, C] tensor (R even when interleaved)");
    ParamSpec spec;
    spec.name = std::move(name);
    spec.role = role;
    spec.init = init;
    spec.storage = std::move(storage);
    spec.is_expert = is_expert;
    constexpr std::string_view kLayers = "model.layers.";
    if (spec.name.starts_with(kLayers)) {
        int64_t l = 0;
        size_t i = kLayers.size();
        for (; i < spec.name.size() && spec.name[i] >= '0' && spec.name[i] <= '9'; ++i)
            l = l * 10 + (spec.name[i] - '0');
        if (i > kLayers.size() && i < spec.name.size() && spec.name[i] == '.') spec.layer = l;
    }
    if (is_expert) {
        MF_CHECK(!shape.empty() && shard.size >= 1 && shard.rank >= 0 && shard.rank < shard.size &&
                     shape[0] % shard.size == 0,
                 "expert shard ", shard.rank, "/", shard.size, " of ", spec.name);
        spec.experts_total = shape[0];
        shape[0] /= shard.size;
        spec.expert_first = shard.rank * shape[0];
    }
    spec.numel = shape_numel(shape);
    spec.shape = std::move(shape);
    // Replicated parameters are packed first: shift every expert parameter up by the newcomer.
    if (is_expert) {
        spec.offset = replicated_ + experts_;
        experts_ += spec.extent();
    } else {
        spec.offset = replicated_;
        for (auto& s : specs_)
            if (s.is_expert) s.offset += spec.extent();
        replicated_ += spec.extent();
    }
    specs_.push_back(std::move(spec));
    return specs_.back();
}

int64_t ParamTable::count() const {
    int64_t n = 0;
    for (const auto& s : specs_) n += s.numel;
    return n;
}

void ParamTable::store_model_prefix_as(const std::string& prefix) {
    constexpr std::string_view kModel = "model.";
    auto renamed = [&](const std::string& name) {
        return name.starts_with(kModel) ? prefix + name.substr(kModel.size()) : name;
    };
    for (auto& s : specs_) {
        if (s.storage.disk_name.empty() && s.storage.expert_pieces.empty()) {
            if (s.name.starts_with(kModel)) s.storage.disk_name = renamed(s.name);
        } else if (!s.storage.disk_name.empty()) {
            s.storage.disk_name = renamed(s.storage.disk_name);
        }
        for (auto& piece : s.storage.expert_pieces) piece = renamed(piece);
    }
}

const ParamSpec* ParamTable::find_role(ParamRole role) const {
    for (const auto& s : specs_)
        if (s.role == role && s.layer < 0) return &s;
    return nullptr;
}

const ParamSpec* ParamTable::find(std::string_view name) const {
    for (const auto& s : specs_)
        if (s.name == name) return &s;
    return nullptr;
}

const ParamSpec& ParamTable::get(std::string_view name) const {
    const ParamSpec* s = find(name);
    if (s == nullptr) fail("unknown parameter \"", name, "\"");
    return *s;
}

}  // namespace mf::model
