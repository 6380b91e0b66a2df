// Scaled dot-product attention (GQA, causal, packed documents), fp32 CPU reference.
// For each (batch row b, query head h, query t), with KV head h / (Hq / Hkv) and
// allowed(t) = { s <= t : doc[b, s] == doc[b, t] } (never empty: t itself is allowed):
//   forward   z_s = scale · q_t·k_s (s allowed),  m = max z,  l = Σ exp(z_s − m)
//             out_t = Σ exp(z_s − m) · v_s / l,   lse_t = m + log(l)
//   backward  p_s = exp(z_s − lse_t),  dp_s = dout_t·v_s,  δ_t = dout_t·out_t,  ds_s = p_s·(dp_s − δ_t)
//             dq_t += scale · Σ_s ds_s · k_s,  dk_s += scale · ds_s · q_t,  dv_s += p_s · dout_t
// Scores are computed for the allowed keys only. Loops run b, h, t, s in ascending order on one
// thread, so every += happens in a fixed order (deterministic, no atomics). Dot products are
// lane_dot (kernels/cpu/lane_dot.h: interleaved fp32 partial sums combined by a fixed tree);
// weighted sums of rows run over s in order. scale = 1/sqrt(D) is rounded to fp32 once, as torch
// does with HF's head_dim**-0.5.
// doc_ids may be null: then every row is one document (plain causal attention).
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/lane_dot.h"

namespace mf::cpu {

namespace {

void check_shape(const AttentionShape& s) {
    MF_CHECK(s.B >= 0 && s.T >= 0 && s.Hq > 0 && s.Hkv > 0 && s.D > 0, "attention: bad shape B=", s.B, " T=", s.T,
             " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D);
    MF_CHECK(s.Hq % s.Hkv == 0, "attention: Hq=", s.Hq, " is not a multiple of Hkv=", s.Hkv);
}

float attention_scale(int64_t D) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))); }

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, const int32_t* doc_ids,
                       const AttentionShape& s) {
    check_shape(s);
    const int64_t group = s.Hq / s.Hkv;
    const int64_t q_stride = s.Hq * s.D;
    const int64_t kv_stride = s.Hkv * s.D;
    const float scale = attention_scale(s.D);
    std::vector<float> scores(static_cast<size_t>(s.T));
    std::vector<float> acc(static_cast<size_t>(s.D));
    for (int64_t b = 0; b < s.B; ++b) {
        const int32_t* doc = doc_ids != nullptr ? doc_ids + b * s.T : nullptr;
        for (int64_t h = 0; h < s.Hq; ++h) {
            const int64_t hk = h / group;
            const int64_t q_off = b * s.T * q_stride + h * s.D;
            const int64_t kv_off = b * s.T * kv_stride + hk * s.D;
            for (int64_t t = 0; t < s.T; ++t) {
                const float* q_t = q + q_off + t * q_stride;
                float m = -std::numeric_limits<float>::infinity();
                for (int64_t j = 0; j <= t; ++j) {
                    if (doc != nullptr && doc[j] != doc[t]) continue;
                    scores[j] = scale * lane_dot(q_t, k + kv_off + j * kv_stride, s.D);
                    m = std::max(m, scores[j]);
                }
                float l = 0.0f;
                std::fill(acc.begin(), acc.end(), 0.0f);
                for (int64_t j = 0; j <= t; ++j) {
                    if (doc != nullptr && doc[j] != doc[t]) continue;
                    const float p = std::exp(scores[j] - m);
                    l += p;
                    const float* v_j = v + kv_off + j * kv_stride;
                    for (int64_t d = 0; d < s.D; ++d) acc[d] += p * v_j[d];
                }
                float* o = out + q_off + t * q_stride;
                for (int64_t d = 0; d < s.D; ++d) o[d] = acc[d] / l;
                lse[(b * s.Hq + h) * s.T + t] = m + std::log(l);
            }
        }
    }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const int32_t* doc_ids,
                        const AttentionShape& s) {
    check_shape(s);
    const int64_t group = s.Hq / s.Hkv;
    const int64_t q_stride = s.Hq * s.D;
    const int64_t kv_stride = s.Hkv * s.D;
    const float scale = attention_scale(s.D);
    std::vector<float> dq_acc(static_cast<size_t>(s.D));
    for (int64_t b = 0; b < s.B; ++b) {
        const int32_t* doc = doc_ids != nullptr ? doc_ids + b * s.T : nullptr;
        for (int64_t h = 0; h < s.Hq; ++h) {
            const int64_t hk = h / group;
            const int64_t q_off = b * s.T * q_stride + h * s.D;
            const int64_t kv_off = b * s.T * kv_stride + hk * s.D;
            for (int64_t t = 0; t < s.T; ++t) {
                const float* q_t = q + q_off + t * q_stride;
                const float* dout_t = dout + q_off + t * q_stride;
                const float delta = lane_dot(dout_t, out + q_off + t * q_stride, s.D);
                const float lse_t = lse[(b * s.Hq + h) * s.T + t];
                std::fill(dq_acc.begin(), dq_acc.end(), 0.0f);
                for (int64_t j = 0; j <= t; ++j) {
                    if (doc != nullptr && doc[j] != doc[t]) continue;
                    const float* k_j = k + kv_off + j * kv_stride;
                    const float* v_j = v + kv_off + j * kv_stride;
                    const float p = std::exp(scale * lane_dot(q_t, k_j, s.D) - lse_t);
                    const float ds = p * (lane_dot(dout_t, v_j, s.D) - delta);
                    const float ds_scaled = scale * ds;
                    float* dk_j = dk + kv_off + j * kv_stride;
                    float* dv_j = dv + kv_off + j * kv_stride;
                    for (int64_t d = 0; d < s.D; ++d) {
                        dq_acc[d] += ds * k_j[d];
                        dk_j[d] += ds_scaled * q_t[d];
                        dv_j[d] += p * dout_t[d];
                    }
                }
                float* dq_t = dq + q_off + t * q_stride;
                for (int64_t d = 0; d < s.D; ++d) dq_t[d] += scale * dq_acc[d];
            }
        }
    }
}

}  // namespace mf::cpu
