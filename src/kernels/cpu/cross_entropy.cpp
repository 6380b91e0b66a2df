// Fused LM head + cross-entropy, fp32 CPU reference.
// Tokens are processed in chunks of at most kChunkTokens (fewer when V is large, so a chunk's
// logits stay under kChunkFloats floats). Per chunk:
//   logits[n, :] = h[n] · wᵀ                                 (matmul_forward)
//   m = max logits[n],  s = Σ_v exp(logits[n, v] − m),  loss[n] = m + log(s) − logits[n, target]
//   dlogits[n, v] = grad_scale · (exp(logits[n, v] − m) / s − [v == target])   (in the logits buffer)
//   dh[chunk] += dlogits · w,   dw += dlogitsᵀ · h[chunk]      (matmul_backward, chunks in order)
// Rows whose target is kIgnoreIndex get loss 0 and a zero dlogits row (no gradient). The sum s runs
// over v in ascending order in double (one exp per logit, in fp32), so the loss is deterministic
// and does not lose precision over a large vocabulary. A target outside [0, V) that is not
// kIgnoreIndex is an error. With bf16_logits the logits are rounded to bf16 right after the matmul.
#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "core/bf16.h"
#include "core/check.h"
#include "kernels/cpu/matmul.h"

namespace mf::cpu {

namespace {

constexpr int64_t kChunkTokens = 64;
constexpr int64_t kChunkFloats = int64_t{1} << 22;  // 16 MiB of logits at most

}  // namespace

void lm_head_cross_entropy(float* losses, float* dh, float* dw, const float* h, const float* w, const int32_t* targets,
                           int64_t N, int64_t C, int64_t V, float grad_scale, bool bf16_logits) {
    MF_CHECK(N >= 0 && C >= 0 && V > 0, "cross_entropy: bad shape N=", N, " C=", C, " V=", V);
    for (int64_t n = 0; n < N; ++n) {
        MF_CHECK(targets[n] == kIgnoreIndex || (targets[n] >= 0 && targets[n] < V), "cross_entropy: target[", n,
                 "] = ", targets[n], " is neither in [0, ", V, ") nor the ignore index ", kIgnoreIndex);
    }
    const bool want_grad = dh != nullptr || dw != nullptr;
    const int64_t chunk = std::clamp<int64_t>(kChunkFloats / V, 1, kChunkTokens);
    std::vector<float> logits(static_cast<size_t>(std::min(chunk, N) * V));
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t rows = std::min(chunk, N - n0);
        matmul_forward(logits.data(), h + n0 * C, w, rows, C, V);
        if (bf16_logits)
            for (float& x : std::span<float>(logits.data(), static_cast<size_t>(rows * V)))
                x = bf16_to_f32(f32_to_bf16(x));
        for (int64_t r = 0; r < rows; ++r) {
            float* x = logits.data() + r * V;
            const int32_t target = targets[n0 + r];
            if (target == kIgnoreIndex) {
                losses[n0 + r] = 0.0f;
                if (want_grad) std::fill(x, x + V, 0.0f);
                continue;
            }
            float m = x[0];
            for (int64_t v = 1; v < V; ++v) m = std::max(m, x[v]);
            const float target_logit = x[target];
            double sum = 0.0;
            for (int64_t v = 0; v < V; ++v) {
                const float e = std::exp(x[v] - m);
                if (want_grad) x[v] = e;
                sum += e;
            }
            losses[n0 + r] = static_cast<float>(static_cast<double>(m) + std::log(sum) - target_logit);
            if (want_grad) {
                const float scale = static_cast<float>(grad_scale / sum);
                for (int64_t v = 0; v < V; ++v) x[v] *= scale;
                x[target] -= grad_scale;
            }
        }
        if (want_grad) {
            matmul_backward(dh != nullptr ? dh + n0 * C : nullptr, dw, logits.data(), h + n0 * C, w, rows, C, V);
        }
    }
}

}  // namespace mf::cpu
