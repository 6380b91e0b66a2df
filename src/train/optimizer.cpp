#include "train/optimizer.h"

#include <cmath>

#include "ops/ops.h"

namespace mf::train {

AdamW::AdamW(model::Qwen3Moe& model, const Recipe::Optim& optim, bool mixed)
    : model_(model), optim_(optim), total_(model.num_params()) {
    const Device dev = model.device();
    const bool master = mixed && dev == Device::cuda;
    state_dtype_ = (dev == Device::cpu || master) ? DType::f32 : DType::bf16;
    const size_t bytes = static_cast<size_t>(total_) * dtype_size(state_dtype_);
    m_ = Buffer(bytes, dev);
    v_ = Buffer(bytes, dev);
    m_.zero();
    v_.zero();
    if (master) {
        master_ = Buffer(static_cast<size_t>(total_) * sizeof(float), dev);
        ops::cast(master_.as(DType::f32, {total_}), model.params_tensor());
    }
    for (const auto& spec : model.params().specs()) {
        bool decay = true;
        for (const auto& pattern : optim.no_decay)
            if (matches_pattern(pattern, spec.name)) decay = false;
        decay_.push_back(decay);
    }
}

void AdamW::step(double lr) {
    ++step_;
    const auto& specs = model_.params().specs();
    const size_t es = dtype_size(state_dtype_);
    for (size_t i = 0; i < specs.size(); ++i) {
        const auto& s = specs[i];
        const size_t off = static_cast<size_t>(s.offset) * es;
        const Tensor m = m_.as(state_dtype_, {s.numel}, off), v = v_.as(state_dtype_, {s.numel}, off);
        const Tensor master = master_.data() != nullptr ? master_.as(DType::f32, {s.numel}, off) : Tensor();
        const ops::AdamWHyper h{static_cast<float>(lr), static_cast<float>(optim_.beta1),
                                static_cast<float>(optim_.beta2), static_cast<float>(optim_.eps),
                                decay_[i] ? static_cast<float>(optim_.weight_decay) : 0.0f, step_};
        ops::adamw_update(model_.param(s.name).view({s.numel}), master, m, v, model_.grad(s.name).view({s.numel}), h);
    }
}

namespace {
void to_host_f32(std::vector<float>& out, const Tensor& t) {
    out.resize(static_cast<size_t>(t.numel()));
    if (t.dtype() == DType::f32) {
        ops::copy_to_host(out.data(), t);
        return;
    }
    Buffer staging(static_cast<size_t>(t.numel()) * sizeof(float), t.device());
    const Tensor f32 = staging.as(DType::f32, {t.numel()});
    ops::cast(f32, t);
    ops::copy_to_host(out.data(), f32);
}
void from_host_f32(const Tensor& t, const std::vector<float>& in) {
    MF_CHECK(static_cast<int64_t>(in.size()) == t.numel(), "optimizer state size mismatch");
    if (t.dtype() == DType::f32) {
        ops::copy_from_host(t, in.data());
        return;
    }
    Buffer staging(static_cast<size_t>(t.numel()) * sizeof(float), t.device());
    const Tensor f32 = staging.as(DType::f32, {t.numel()});
    ops::copy_from_host(f32, in.data());
    ops::cast(t, f32);
    ops::synchronize(t.device());
}
}  // namespace

void AdamW::get_state(std::vector<float>& master, std::vector<float>& m, std::vector<float>& v) const {
    if (master_.data() != nullptr) {
        to_host_f32(master, master_.as(DType::f32, {total_}));
    } else {
        master.resize(static_cast<size_t>(total_));
        model_.get_params_to_host(master.data());
    }
    to_host_f32(m, m_.as(state_dtype_, {total_}));
    to_host_f32(v, v_.as(state_dtype_, {total_}));
}

void AdamW::set_state(const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v) {
    MF_CHECK(static_cast<int64_t>(master.size()) == total_, "optimizer state size mismatch");
    model_.set_params_from_host(master.data());  // the bf16 parameters are the rounded master
    if (master_.data() != nullptr) from_host_f32(master_.as(DType::f32, {total_}), master);
    from_host_f32(m_.as(state_dtype_, {total_}), m);
    from_host_f32(v_.as(state_dtype_, {total_}), v);
}

double clip_grad_norm(model::Qwen3Moe& model, double max_norm) {
    const Tensor g = model.grads_tensor();
    const double norm = std::sqrt(ops::sum_squares(g));
    if (max_norm > 0 && std::isfinite(norm)) {
        const double coef = max_norm / (norm + 1e-6);
        if (coef < 1.0) ops::scale(g, static_cast<float>(coef));
    }
    return norm;
}

}  // namespace mf::train
