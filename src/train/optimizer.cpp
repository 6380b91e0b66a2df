#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"
#include "train/distributed.h"

namespace mf::train {

namespace {

constexpr int64_t kChunkAlign = 64;  // elements; keeps every chunk boundary 128-byte aligned in bf16

// Elements [first, first + n) of a flat tensor's storage, as a 1-D tensor.
Tensor flat_range(const Tensor& flat, int64_t first, int64_t n) {
    char* base = static_cast<char*>(flat.data()) + static_cast<size_t>(first) * dtype_size(flat.dtype());
    return Tensor(base, flat.dtype(), {n}, flat.device());
}

void to_host_f32(float* out, const Tensor& t) {
    if (t.numel() == 0) return;
    if (t.dtype() == DType::f32) {
        ops::copy_to_host(out, t);
        return;
    }
    Buffer staging(static_cast<size_t>(t.numel()) * sizeof(float), t.device());
    const Tensor f32 = staging.as(DType::f32, {t.numel()});
    ops::cast(f32, t);
    ops::copy_to_host(out, f32);
}

void from_host_f32(const Tensor& t, const float* in) {
    if (t.numel() == 0) return;
    if (t.dtype() == DType::f32) {
        ops::copy_from_host(t, in);
        return;
    }
    Buffer staging(static_cast<size_t>(t.numel()) * sizeof(float), t.device());
    const Tensor f32 = staging.as(DType::f32, {t.numel()});
    ops::copy_from_host(f32, in);
    ops::cast(t, f32);
    ops::synchronize(t.device());
}

}  // namespace

AdamW::AdamW(model::Qwen3Moe& model, const Recipe::Optim& optim, bool mixed, parallel::Communicator* zero_group)
    : model_(model), optim_(optim), total_(model.num_params()) {
    if (zero_group != nullptr && zero_group->size() > 1) {
        zero_ = zero_group;
        zero_rank_ = zero_group->rank();
        zero_size_ = zero_group->size();
    }
    const int64_t per = (total_ + zero_size_ - 1) / zero_size_;
    chunk_ = (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    lo_ = chunk_lo(zero_rank_);
    hi_ = chunk_hi(zero_rank_);
    const int64_t n = hi_ - lo_;
    const Device dev = model.device();
    const bool master = mixed && dev == Device::cuda;
    state_dtype_ = (dev == Device::cpu || master) ? DType::f32 : DType::bf16;
    const size_t bytes = static_cast<size_t>(n) * dtype_size(state_dtype_);
    m_ = Buffer(bytes, dev);
    v_ = Buffer(bytes, dev);
    m_.zero();
    v_.zero();
    if (master) {
        master_ = Buffer(static_cast<size_t>(n) * sizeof(float), dev);
        if (n > 0) ops::cast(master_.as(DType::f32, {n}), flat_range(model.params_tensor(), lo_, n));
    }
    for (const auto& spec : model.params().specs()) {
        bool decay = true;
        for (const auto& pattern : optim.no_decay)
            if (matches_pattern(pattern, spec.name)) decay = false;
        decay_.push_back(decay);
    }
}

int64_t AdamW::chunk_lo(int r) const { return std::min<int64_t>(total_, static_cast<int64_t>(r) * chunk_); }
int64_t AdamW::chunk_hi(int r) const { return std::min<int64_t>(total_, chunk_lo(r) + chunk_); }

size_t AdamW::state_bytes() const { return m_.nbytes() + v_.nbytes() + master_.nbytes(); }

void AdamW::step(double lr) {
    ++step_;
    const auto& specs = model_.params().specs();
    const Tensor params = model_.params_tensor(), grads = model_.grads_tensor();
    for (size_t i = 0; i < specs.size(); ++i) {
        // The part of this parameter inside this rank's chunk.
        const int64_t a = std::max(lo_, specs[i].offset), b = std::min(hi_, specs[i].offset + specs[i].numel);
        if (a >= b) continue;
        const int64_t n = b - a;
        const size_t off = static_cast<size_t>(a - lo_);
        const Tensor m = m_.as(state_dtype_, {n}, off * dtype_size(state_dtype_));
        const Tensor v = v_.as(state_dtype_, {n}, off * dtype_size(state_dtype_));
        const Tensor master = master_.data() != nullptr ? master_.as(DType::f32, {n}, off * sizeof(float)) : Tensor();
        const ops::AdamWHyper h{static_cast<float>(lr), static_cast<float>(optim_.beta1),
                                static_cast<float>(optim_.beta2), static_cast<float>(optim_.eps),
                                decay_[i] ? static_cast<float>(optim_.weight_decay) : 0.0f, step_};
        ops::adamw_update(flat_range(params, a, n), master, m, v, flat_range(grads, a, n), h);
    }
    if (zero_ == nullptr) return;
    // Every chunk from its owner, in place: afterwards all ranks hold the same parameters.
    for (int r = 0; r < zero_size_; ++r) {
        const int64_t a = chunk_lo(r), b = chunk_hi(r);
        if (a < b) zero_->broadcast(flat_range(params, a, b - a).data(), b - a, model_.param_dtype(), r);
    }
    zero_->synchronize();
}

void AdamW::get_chunk(std::vector<float>& master, std::vector<float>& m, std::vector<float>& v) const {
    const int64_t n = hi_ - lo_;
    master.assign(static_cast<size_t>(n), 0.0f);
    m.assign(static_cast<size_t>(n), 0.0f);
    v.assign(static_cast<size_t>(n), 0.0f);
    if (master_.data() != nullptr) to_host_f32(master.data(), master_.as(DType::f32, {n}));
    else to_host_f32(master.data(), flat_range(model_.params_tensor(), lo_, n));
    to_host_f32(m.data(), m_.as(state_dtype_, {n}));
    to_host_f32(v.data(), v_.as(state_dtype_, {n}));
}

void AdamW::set_state(const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v) {
    MF_CHECK(static_cast<int64_t>(master.size()) == total_ && static_cast<int64_t>(m.size()) == total_ &&
                 static_cast<int64_t>(v.size()) == total_,
             "optimizer state size mismatch");
    const int64_t n = hi_ - lo_;
    model_.set_params_from_host(master.data());  // the bf16 parameters are the rounded master
    if (master_.data() != nullptr) from_host_f32(master_.as(DType::f32, {n}), master.data() + lo_);
    from_host_f32(m_.as(state_dtype_, {n}), m.data() + lo_);
    from_host_f32(v_.as(state_dtype_, {n}), v.data() + lo_);
}

double clip_grad_norm(model::Qwen3Moe& model, double max_norm, DistContext* dist) {
    const Tensor g = model.grads_tensor();
    double ss = 0;
    if (dist != nullptr && dist->ep_size() > 1) {
        // Replicated region: the same on every rank, counted once; experts: summed over the EP group.
        const int64_t rep = model.params().expert_offset();
        const double experts = ops::sum_squares(flat_range(g, rep, g.numel() - rep));
        const double one[1] = {experts};
        ss = ops::sum_squares(flat_range(g, 0, rep)) + dist->sum_f64(one, Group::ep)[0];
    } else {
        ss = ops::sum_squares(g);
    }
    const double norm = std::sqrt(ss);
    if (max_norm > 0 && std::isfinite(norm)) {
        const double coef = max_norm / (norm + 1e-6);
        if (coef < 1.0) ops::scale(g, static_cast<float>(coef));
    }
    return norm;
}

}  // namespace mf::train
