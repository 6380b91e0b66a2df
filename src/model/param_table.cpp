#include "model/param_table.h"

namespace mf::model {

const ParamSpec& ParamTable::add(std::string name, Shape shape, bool is_expert) {
    MF_CHECK(find(name) == nullptr, "duplicate parameter ", name);
    ParamSpec spec;
    spec.name = std::move(name);
    spec.numel = shape_numel(shape);
    spec.shape = std::move(shape);
    spec.offset = total_;
    spec.is_expert = is_expert;
    total_ += spec.numel;
    specs_.push_back(std::move(spec));
    return specs_.back();
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
