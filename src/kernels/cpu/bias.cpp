// Row bias, fp32 CPU reference:
//   forward   out[n, c] += bias[c]
//   backward  dbias[c] += Σ_{n = 0..N-1} dout[n, c]     (+=, like every parameter gradient)
// The column sums run in fp32 in ascending row order into a zeroed row, which is then added to dbias
// once (old value + sum), the order the GPU's partial-row reduction also keeps: the sum first.
#include "kernels/cpu/bias.h"

#include <vector>

#include "core/check.h"

namespace mf::cpu {

void add_bias(float* out, const float* bias, int64_t N, int64_t C) {
    MF_CHECK(N >= 0 && C >= 0, "add_bias: negative shape N=", N, " C=", C);
    for (int64_t n = 0; n < N; ++n) {
        float* y = out + n * C;
        for (int64_t c = 0; c < C; ++c) y[c] += bias[c];
    }
}

void bias_backward(float* dbias, const float* dout, int64_t N, int64_t C) {
    MF_CHECK(N >= 0 && C >= 0, "bias_backward: negative shape N=", N, " C=", C);
    std::vector<float> sum(static_cast<size_t>(C), 0.0f);
    for (int64_t n = 0; n < N; ++n) {
        const float* dy = dout + n * C;
        for (int64_t c = 0; c < C; ++c) sum[static_cast<size_t>(c)] += dy[c];
    }
    for (int64_t c = 0; c < C; ++c) dbias[c] += sum[static_cast<size_t>(c)];
}

}  // namespace mf::cpu
