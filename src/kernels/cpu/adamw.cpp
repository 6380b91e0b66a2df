// AdamW, fp32 CPU reference, following torch.optim.AdamW (the default foreach path,
// amsgrad=False, maximize=False) operation by operation:
//   p ← p · (1 − lr·wd)                              decay factor computed in double, cast to fp32
//   m ← lerp(m, g, 1 − β1)                           torch.lerp: m + w·(g − m) for w < 0.5,
//                                                     g − (g − m)·(1 − w) otherwise
//   v ← v·β2 + ((1 − β2)·g)·g                         mul_ then addcmul_
//   p ← p + (−step_size) · (m / (sqrt(v) / bc2_sqrt + eps))
// with bc1 = 1 − β1^t, bc2_sqrt = sqrt(1 − β2^t), step_size = lr / bc1 computed in double (as
// Python floats) and cast to fp32 once; everything per element is fp32. Step t starts at 1.
// Each gradient is first multiplied by p.grad_scale in fp32 (exact when it is 1). Each element is independent, so the
// update is deterministic.
#include "kernels/cpu/adamw.h"

#include <cmath>

#include "core/check.h"

namespace mf::cpu {

void adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamWParams& p) {
    MF_CHECK(n >= 0, "adamw: negative element count ", n);
    MF_CHECK(p.step >= 1, "adamw: step must start at 1, got ", p.step);
    const double lr = p.lr;
    const double beta1 = p.beta1;
    const double beta2 = p.beta2;
    const float decay = static_cast<float>(1.0 - lr * static_cast<double>(p.weight_decay));
    const float lerp_weight = static_cast<float>(1.0 - beta1);
    const float beta2_f = static_cast<float>(beta2);
    const float one_minus_beta2 = static_cast<float>(1.0 - beta2);
    const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(p.step));
    const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(p.step));
    const float neg_step_size = static_cast<float>(-(lr / bias_correction1));
    const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    const float eps = p.eps;
    const bool lerp_from_start = lerp_weight < 0.5f;
    for (int64_t i = 0; i < n; ++i) {
        const float g = grad[i] * p.grad_scale;
        const float p_i = param[i] * decay;
        const float m_i = lerp_from_start ? m[i] + lerp_weight * (g - m[i]) : g - (g - m[i]) * (1.0f - lerp_weight);
        const float v_i = v[i] * beta2_f + one_minus_beta2 * g * g;
        const float denom = std::sqrt(v_i) / bias_correction2_sqrt + eps;
        param[i] = p_i + neg_step_size * (m_i / denom);
        m[i] = m_i;
        v[i] = v_i;
    }
}

}  // namespace mf::cpu
