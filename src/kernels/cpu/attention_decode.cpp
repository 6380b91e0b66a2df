// Cached-KV attention, fp32 CPU reference. For query i (position t = first + i) and head h with KV
// head h / (Hq / Hkv):  z_s = scale · q_i·k_s (s <= t),  m = max z,  l = Σ exp(z_s − m),
// out_i = Σ exp(z_s − m) · v_s / l. Dot products are lane_dot and the weighted sum runs over s in
// ascending order, exactly as attention_forward computes row t (no lse: generation has no backward).
#include "kernels/cpu/attention_decode.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/lane_dot.h"

namespace mf::cpu {

void attention_decode_forward(float* out, const float* q, const float* k, const float* v,
                              const AttentionDecodeShape& s) {
    MF_CHECK(s.n >= 0 && s.first >= 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0 && s.Hq % s.Hkv == 0,
             "attention_decode: bad shape n=", s.n, " first=", s.first, " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D);
    const int64_t group = s.Hq / s.Hkv, q_stride = s.Hq * s.D, kv_stride = s.Hkv * s.D;
    // 1/sqrt(D) rounded to fp32 once, as attention_forward (and torch) do.
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.D)));
    std::vector<float> scores(static_cast<size_t>(s.first + s.n));
    std::vector<float> acc(static_cast<size_t>(s.D));
    for (int64_t h = 0; h < s.Hq; ++h) {
        const int64_t kv_off = (h / group) * s.D;
        for (int64_t i = 0; i < s.n; ++i) {
            const int64_t t = s.first + i;
            const float* q_t = q + i * q_stride + h * s.D;
            float m = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j <= t; ++j) {
                scores[j] = scale * lane_dot(q_t, k + kv_off + j * kv_stride, s.D);
                m = std::max(m, scores[j]);
            }
            float l = 0.0f;
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t j = 0; j <= t; ++j) {
                const float p = std::exp(scores[j] - m);
                l += p;
                const float* v_j = v + kv_off + j * kv_stride;
                for (int64_t d = 0; d < s.D; ++d) acc[d] += p * v_j[d];
            }
            float* o = out + i * q_stride + h * s.D;
            for (int64_t d = 0; d < s.D; ++d) o[d] = acc[d] / l;
        }
    }
}

}  // namespace mf::cpu
