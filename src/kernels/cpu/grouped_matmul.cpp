// Grouped matmul over per-expert row groups (dropless MoE expert GEMMs), fp32 CPU reference.
// Group e owns rows [offsets[e], offsets[e + 1]) of inp/out/dout and the slice weight[e] of the
// stacked [E, OC, C] weight; each group is one dense matmul (kernels/cpu/matmul.cpp), so the
// numerics are exactly those of matmul: every element a sequential sum in ascending index order,
// independent of how the other groups are sized. Empty groups do nothing (their dweight slice is
// left unchanged). offsets must start at >= 0 and never decrease; anything else is an error.
#include "kernels/cpu/grouped_matmul.h"

#include "core/check.h"
#include "kernels/cpu/matmul.h"

namespace mf::cpu {

namespace {

void check_groups(const int32_t* offsets, int64_t E, int64_t C, int64_t OC) {
    MF_CHECK(E >= 0 && C >= 0 && OC >= 0, "grouped_matmul: negative shape E=", E, " C=", C, " OC=", OC);
    if (E == 0) return;
    MF_CHECK(offsets[0] >= 0, "grouped_matmul: offsets[0] = ", offsets[0], " is negative");
    for (int64_t e = 0; e < E; ++e) {
        MF_CHECK(offsets[e + 1] >= offsets[e], "grouped_matmul: offsets decrease at expert ", e, ": ", offsets[e],
                 " -> ", offsets[e + 1]);
    }
}

}  // namespace

void grouped_matmul_forward(float* out, const float* inp, const float* weight, const int32_t* offsets, int64_t E,
                            int64_t C, int64_t OC) {
    check_groups(offsets, E, C, OC);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t begin = offsets[e];
        const int64_t rows = offsets[e + 1] - begin;
        if (rows == 0) continue;
        matmul_forward(out + begin * OC, inp + begin * C, weight + e * OC * C, rows, C, OC);
    }
}

void grouped_matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const int32_t* offsets, int64_t E, int64_t C, int64_t OC) {
    check_groups(offsets, E, C, OC);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t begin = offsets[e];
        const int64_t rows = offsets[e + 1] - begin;
        if (rows == 0) continue;
        matmul_backward(dinp != nullptr ? dinp + begin * C : nullptr,
                        dweight != nullptr ? dweight + e * OC * C : nullptr, dout + begin * OC, inp + begin * C,
                        weight + e * OC * C, rows, C, OC);
    }
}

}  // namespace mf::cpu
