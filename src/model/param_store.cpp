#include "model/param_store.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace mf::model {

ParamStore::ParamStore(ParamTable table, int64_t num_layers, ModelPlacement placement)
    : table_(std::move(table)),
      num_layers_(num_layers),
      placement_(placement),
      param_dtype_(placement.device == Device::cpu ? DType::f32 : DType::bf16) {
    MF_CHECK(placement.device == Device::cuda || placement.grad_dtype == DType::f32, "CPU models keep f32 gradients");
    MF_CHECK(placement.grad_dtype == DType::f32 || placement.grad_dtype == DType::bf16, "gradients are f32 or bf16");
    const size_t P = static_cast<size_t>(table_.total());
    params_ = Buffer(P * dtype_size(param_dtype_), placement.device);
    grads_ = Buffer(P * dtype_size(placement.grad_dtype), placement.device);
    params_.zero();
    grads_.zero();
}

Tensor ParamStore::params_tensor() const {
    settle_params();
    return params_.as(param_dtype_, {table_.total()});
}

Tensor ParamStore::grads_tensor() const {
    settle_grads();
    settle_expert_grads(-1);
    return grads_.as(placement_.grad_dtype, {table_.total()});
}

Tensor ParamStore::grads_tensor_in_backward() const {
    settle_grads();
    return grads_.as(placement_.grad_dtype, {table_.total()});
}

Tensor ParamStore::param(std::string_view name) const {
    settle_params();
    return param_view(name);
}

Tensor ParamStore::param_view(std::string_view name) const {
    const ParamSpec& s = table_.get(name);
    return params_.as(param_dtype_, s.shape, static_cast<size_t>(s.offset) * dtype_size(param_dtype_));
}

Tensor ParamStore::grad_view(std::string_view name) const {
    const ParamSpec& s = table_.get(name);
    const DType g = placement_.grad_dtype;
    return grads_.as(g, s.shape, static_cast<size_t>(s.offset) * dtype_size(g));
}

Tensor ParamStore::grad(std::string_view name) const {
    settle_grads();
    const ParamSpec& s = table_.get(name);
    if (s.is_expert) settle_expert_grads(s.layer);
    return grad_view(name);
}

float* ParamStore::param_data() {
    MF_CHECK(placement_.device == Device::cpu, "param_data() is for CPU models");
    return params_tensor().ptr<float>();
}

float* ParamStore::grad_data() {
    MF_CHECK(placement_.device == Device::cpu, "grad_data() is for CPU models");
    return grads_tensor().ptr<float>();
}

void ParamStore::zero_grads() {
    settle_grads();
    const Tensor g = grads_.as(placement_.grad_dtype, {table_.expert_offset()});  // the replicated region
    zeroing_ = ops::background(placement_.device, [&g] { ops::zero(g); });
    expert_marked_.assign(static_cast<size_t>(num_layers_), 0);
    for (const ParamSpec& s : table_.specs())
        if (s.is_expert && s.layer >= 0) expert_marked_[static_cast<size_t>(s.layer)] = 1;
}

bool ParamStore::expert_marked(int64_t layer) const {
    return static_cast<size_t>(layer) < expert_marked_.size() && expert_marked_[static_cast<size_t>(layer)] != 0;
}

bool ParamStore::take_expert_mark(int64_t layer) {
    if (!expert_marked(layer)) return false;
    expert_marked_[static_cast<size_t>(layer)] = 0;
    return true;
}

void ParamStore::settle_expert_grads(int64_t layer) const {
    for (size_t l = 0; l < expert_marked_.size(); ++l) {
        if (!expert_marked_[l] || (layer >= 0 && static_cast<int64_t>(l) != layer)) continue;
        for (const ParamSpec& s : table_.specs())
            if (s.is_expert && s.layer == static_cast<int64_t>(l)) ops::zero(grad_view(s.name));
        expert_marked_[l] = 0;
    }
}

void ParamStore::settle_grads() const {
    if (zeroing_ == 0) return;
    ops::wait_background(placement_.device, zeroing_);
    zeroing_ = 0;
}

int64_t ParamStore::param_stage(const ParamSpec& spec) const {
    if (spec.layer >= 0) return spec.layer;
    return spec.role == ParamRole::embedding ? kStageEmbedding : kStageHead;
}

void ParamStore::params_pending(int64_t stage, std::function<void()> wait) {
    MF_CHECK(stage >= kStageEmbedding && stage < num_layers_, "params_pending: stage ", stage, " of ", num_layers_,
             " layers");
    pending_.resize(static_cast<size_t>(num_layers_ + 2));
    pending_[static_cast<size_t>(stage + 2)].push_back(std::move(wait));
}

void ParamStore::settle_stage(int64_t stage) const {
    if (static_cast<size_t>(stage + 2) >= pending_.size()) return;
    std::vector<std::function<void()>> waits;
    waits.swap(pending_[static_cast<size_t>(stage + 2)]);
    for (const auto& wait : waits) wait();
}

void ParamStore::settle_params() const {
    for (int64_t stage = kStageEmbedding; stage < static_cast<int64_t>(pending_.size()) - 2; ++stage)
        settle_stage(stage);
}

void ParamStore::set_params_from_host(const float* src) {
    const Tensor dst = params_tensor();
    if (dst.device() == Device::cpu) {
        ops::copy_from_host(dst, src);
        return;
    }
    Buffer staging(dst.numel() * sizeof(float), Device::cuda);
    const Tensor f32 = staging.as(DType::f32, {dst.numel()});
    ops::copy_from_host(f32, src);
    ops::cast(dst, f32);
    ops::synchronize(Device::cuda);
}

void ParamStore::get_params_to_host(float* dst) const {
    const Tensor src = params_tensor();
    if (src.device() == Device::cpu) {
        ops::copy_to_host(dst, src);
        return;
    }
    Buffer staging(src.numel() * sizeof(float), Device::cuda);
    const Tensor f32 = staging.as(DType::f32, {src.numel()});
    ops::cast(f32, src);
    ops::copy_to_host(dst, f32);
}

namespace {
// Element i of parameter s under HF's _init_weights (ParamInit); draws from `rng` only where HF draws.
float initial_value(const ParamSpec& s, int64_t i, std::mt19937_64& rng, std::normal_distribution<float>& normal) {
    switch (s.init) {
        case ParamInit::ones:
            return 1.0f;
        case ParamInit::a_log:
            return std::log(static_cast<float>(i + 1));
        case ParamInit::dt_bias: {
            constexpr double kMin = 1e-3, kMax = 1e-1, kFloor = 1e-4;
            const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
            const double dt = std::max(std::exp(u * (std::log(kMax) - std::log(kMin)) + std::log(kMin)), kFloor);
            return static_cast<float>(dt + std::log(-std::expm1(-dt)));  // softplus⁻¹(dt)
        }
        case ParamInit::by_role:
            break;
    }
    switch (s.role) {
        case ParamRole::norm:
            return 1.0f;
        case ParamRole::bias:
        case ParamRole::buffer:
            return 0.0f;
        default:
            return normal(rng);
    }
}
}  // namespace

void ParamStore::init_random(uint64_t seed, float std, const std::vector<int64_t>& zero_rows) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, std);
    std::vector<float> host(static_cast<size_t>(table_.total()));
    for (const auto& s : table_.specs()) {
        const int64_t per_row = s.is_expert ? s.numel / s.shape[0] : s.numel;
        const int64_t first = s.is_expert ? s.expert_first * per_row : 0;
        const int64_t total = s.is_expert ? s.experts_total * per_row : s.numel;
        for (int64_t i = 0; i < total; ++i) {
            const float x = initial_value(s, i, rng, normal);
            if (i >= first && i < first + s.numel) host[static_cast<size_t>(s.offset + i - first)] = x;
        }
    }
    if (const ParamSpec* embedding = table_.find_role(ParamRole::embedding))
        for (const int64_t row : zero_rows) {
            const int64_t width = embedding->shape[1];
            std::fill_n(host.begin() + embedding->offset + row * width, width, 0.0f);
        }
    set_params_from_host(host.data());
}

}  // namespace mf::model
