// Causal depthwise conv1d + SiLU, fp32 CPU reference. With first(n) the first token of n's segment
// (doc_segments.h) and the taps m = n − (K−1) + j, j = 0..K−1, restricted to m >= first(n):
//   forward   pre[n, c] = bias[c] + Σ_j weight[c, j] · inp[m, c]   (j ascending),  out = silu(pre)
//   backward  dpre = dout · silu'(pre),  silu'(p) = σ(p) · (1 + p · (1 − σ(p)))
//             dinp[m, c]  = Σ_j dpre[m + (K−1) − j, c] · weight[c, j]   over the outputs in m's segment (written)
//             dweight[c, j] += Σ_n dpre[n, c] · inp[m, c],   dbias[c] += Σ_n dpre[n, c]
// The sums over tokens of the parameter gradients run in double, n ascending, and are added once.
#include "kernels/cpu/conv1d.h"

#include <cmath>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/doc_segments.h"

namespace mf::cpu {

namespace {

void check_shape(const Conv1dShape& s) {
    MF_CHECK(s.N >= 0 && s.T >= 1 && s.C >= 1 && s.K >= 1 && s.N % s.T == 0, "conv1d_silu: bad shape N=", s.N,
             " T=", s.T, " C=", s.C, " K=", s.K);
}

// first[n] = the first token of n's segment.
std::vector<int64_t> segment_firsts(const int32_t* doc_ids, const Conv1dShape& s) {
    std::vector<int64_t> first(static_cast<size_t>(s.N));
    for (int64_t n = 0; n < s.N; ++n) first[n] = starts_segment(doc_ids, n, s.T) ? n : first[n - 1];
    return first;
}

float sigmoid(float p) { return 1.0f / (1.0f + std::exp(-p)); }

// pre[n, c] for one token (all channels).
void pre_activation(float* pre, const float* inp, const float* weight, const float* bias, int64_t n, int64_t first,
                    const Conv1dShape& s) {
    for (int64_t c = 0; c < s.C; ++c) {
        float acc = bias != nullptr ? bias[c] : 0.0f;
        for (int64_t j = 0; j < s.K; ++j) {
            const int64_t m = n - (s.K - 1) + j;
            if (m >= first) acc += weight[c * s.K + j] * inp[m * s.C + c];
        }
        pre[c] = acc;
    }
}

}  // namespace

void conv1d_silu_forward(float* out, const float* inp, const float* weight, const float* bias, const int32_t* doc_ids,
                         const Conv1dShape& s) {
    check_shape(s);
    const std::vector<int64_t> first = segment_firsts(doc_ids, s);
    for (int64_t n = 0; n < s.N; ++n) {
        float* o = out + n * s.C;
        pre_activation(o, inp, weight, bias, n, first[n], s);
        for (int64_t c = 0; c < s.C; ++c) o[c] = o[c] * sigmoid(o[c]);
    }
}

void conv1d_silu_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* bias, const int32_t* doc_ids, const Conv1dShape& s) {
    check_shape(s);
    const std::vector<int64_t> first = segment_firsts(doc_ids, s);
    std::vector<float> dpre(static_cast<size_t>(s.N * s.C));
    for (int64_t n = 0; n < s.N; ++n) {
        float* d = dpre.data() + n * s.C;
        pre_activation(d, inp, weight, bias, n, first[n], s);
        for (int64_t c = 0; c < s.C; ++c) {
            const float p = d[c], sig = sigmoid(p);
            d[c] = dout[n * s.C + c] * sig * (1.0f + p * (1.0f - sig));
        }
    }
    // dinp: token m feeds outputs n = m .. m + K − 1 of its own segment (first[n] <= m).
    for (int64_t m = 0; m < s.N; ++m) {
        for (int64_t c = 0; c < s.C; ++c) {
            float acc = 0.0f;
            for (int64_t j = s.K - 1; j >= 0; --j) {
                const int64_t n = m + (s.K - 1) - j;
                if (n >= s.N || first[n] > m) break;
                acc += dpre[n * s.C + c] * weight[c * s.K + j];
            }
            dinp[m * s.C + c] = acc;
        }
    }
    std::vector<double> dw(static_cast<size_t>(s.C * s.K), 0.0), db(static_cast<size_t>(s.C), 0.0);
    for (int64_t n = 0; n < s.N; ++n) {
        for (int64_t c = 0; c < s.C; ++c) {
            const double d = dpre[n * s.C + c];
            db[c] += d;
            for (int64_t j = 0; j < s.K; ++j) {
                const int64_t m = n - (s.K - 1) + j;
                if (m >= first[n]) dw[c * s.K + j] += d * inp[m * s.C + c];
            }
        }
    }
    for (int64_t i = 0; i < s.C * s.K; ++i) dweight[i] += static_cast<float>(dw[i]);
    if (dbias != nullptr)
        for (int64_t c = 0; c < s.C; ++c) dbias[c] += static_cast<float>(db[c]);
}

}  // namespace mf::cpu
