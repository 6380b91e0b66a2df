// The fixed-order fp32 dot product shared by the CPU reference kernels (attention, moe_permute,
// rmsnorm). Lane l sums the elements i ≡ l (mod kDotLanes) of the full kDotLanes-blocks in order, the
// tail is summed sequentially, then the lanes are combined by a fixed pairwise tree and the tail is
// added last. The order never depends on the data or the thread, so results are the same bits on every
// run, and the lane loop vectorises.
#pragma once

#include <cstdint>
#include <cstring>

namespace mf::cpu {

constexpr int kDotLanes = 8;
using DotLaneVec = float __attribute__((vector_size(kDotLanes * sizeof(float))));

// Σ a[i]·b[i] for i in [0, n).
inline float lane_dot(const float* a, const float* b, int64_t n) {
    DotLaneVec acc = {};
    int64_t i = 0;
    for (; i + kDotLanes <= n; i += kDotLanes) {
        DotLaneVec va, vb;
        std::memcpy(&va, a + i, sizeof(va));
        std::memcpy(&vb, b + i, sizeof(vb));
        acc += va * vb;
    }
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * b[i];
    return (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + tail;
}
static_assert(kDotLanes == 8, "lane_dot's combine tree is written for 8 lanes");

}  // namespace mf::cpu
