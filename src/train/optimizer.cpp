#include "train/optimizer.h"

#include <cmath>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/reduce.h"

namespace mf::train {

AdamW::AdamW(const model::ParamTable& table, const Recipe::Optim& optim)
    : table_(table), optim_(optim), total_(table.total()),
      m_(static_cast<size_t>(table.total()) * sizeof(float), Device::cpu),
      v_(static_cast<size_t>(table.total()) * sizeof(float), Device::cpu) {
    m_.zero();
    v_.zero();
    for (const auto& spec : table.specs()) {
        bool decay = true;
        for (const auto& pattern : optim.no_decay)
            if (matches_pattern(pattern, spec.name)) decay = false;
        decay_.push_back(decay);
    }
}

void AdamW::step(float* params, const float* grads, double lr) {
    ++step_;
    float* m = exp_avg();
    float* v = exp_avg_sq();
    const auto& specs = table_.specs();
    for (size_t i = 0; i < specs.size(); ++i) {
        const auto& s = specs[i];
        const cpu::AdamWParams p{static_cast<float>(lr), static_cast<float>(optim_.beta1),
                                 static_cast<float>(optim_.beta2), static_cast<float>(optim_.eps),
                                 decay_[i] ? static_cast<float>(optim_.weight_decay) : 0.0f, step_};
        cpu::adamw_update(params + s.offset, m + s.offset, v + s.offset, grads + s.offset, s.numel, p);
    }
}

double global_grad_norm(const float* grads, int64_t n) { return std::sqrt(cpu::sum_squares(grads, n)); }

double clip_grad_norm(float* grads, int64_t n, double max_norm) {
    const double norm = global_grad_norm(grads, n);
    if (max_norm > 0) {
        const double coef = max_norm / (norm + 1e-6);
        if (coef < 1.0) cpu::scale_inplace(grads, static_cast<float>(coef), n);
    }
    return norm;
}

}  // namespace mf::train
