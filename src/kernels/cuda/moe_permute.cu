// Dropless MoE token permutation, CUDA.
//   indices   a stable counting sort of the pairs by expert, in three kernels:
//             1. histogram: the pairs are cut into tiles of kTile consecutive pairs, one warp per
//                tile; tile_counts[tile][e] = pairs of tile with expert e (shared-memory integer
//                atomics: exact, order-free);
//             2. scan (one block): per expert, an exclusive scan over the tiles (warp shuffles,
//                counts stored [E][tiles]), then an exclusive scan over the experts gives
//                expert_offsets and base[e][tile] = the first row of expert e's pairs of that tile;
//             3. rank: each warp loads its tile's experts, then walks it in steps of 32 pairs in pair
//                order; lanes with the
//                same expert find each other with __match_any_sync, a lane's row is
//                cursor[e] + (number of lower lanes with e), and the group's lowest lane advances
//                cursor[e]. Pair order is kept inside a step, across steps and across tiles, so the
//                result is exactly the CPU reference's.
//   gather / unpermute   one thread per 8-column group of an output row (16-byte accesses when
//             H % 8 == 0 and the buffers are aligned), summing the K source rows in k order in fp32.
//   unpermute backward   one warp per token: dout[t] is read once per column group and reused for
//             the K rows of dy_perm and the K partial dot products, which are reduced by xor
//             butterflies at the end (fixed order).
// No floating-point atomics anywhere; every output element has one writer.
#include <algorithm>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/moe_permute.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kIndexWarps = 4;  // warps per block in the histogram and rank kernels
constexpr int kTile = 512;      // pairs per warp tile
constexpr int kScanThreads = 1024;
constexpr int kMaxExperts = 4096;
constexpr int64_t kMaxBlocks = 65536;

int64_t num_tiles(int64_t num_pairs) { return (num_pairs + kTile - 1) / kTile; }

// ----------------------------------------------------------------------------------------------
// kernels: indices

__global__ void permute_histogram_kernel(int32_t* tile_counts, const int32_t* topk_idx, int64_t num_pairs, int E,
                                         int64_t tiles) {
    extern __shared__ int32_t hist[];  // [kIndexWarps][E]
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    for (int i = threadIdx.x; i < kIndexWarps * E; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * kIndexWarps + warp;
    if (tile < tiles) {
        const int64_t begin = tile * kTile;
        const int64_t end = min(num_pairs, begin + kTile);
        for (int64_t p = begin + lane; p < end; p += 32) {
            const int32_t e = topk_idx[p];
            if (e >= 0 && e < E) atomicAdd(&hist[warp * E + e], 1);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kIndexWarps * E; i += blockDim.x) {
        const int64_t t = static_cast<int64_t>(blockIdx.x) * kIndexWarps + i / E;
        if (t < tiles) tile_counts[static_cast<int64_t>(i % E) * tiles + t] = hist[i];  // [E][tiles]
    }
}

// Inclusive prefix sum over the 32 lanes of a warp (Hillis-Steele with shuffles).
__device__ __forceinline__ int32_t warp_inclusive_scan(int32_t v) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int32_t other = __shfl_up_sync(detail::kFullMask, v, offset);
        if (lane >= offset) v += other;
    }
    return v;
}

// One block of kScanThreads. tile_counts [E][tiles] becomes base [E][tiles]: the absolute first row
// of each expert's pairs within each tile. Warp w scans the tiles of experts w, w + 32, ...
// 32 tiles at a time; warp 0 then scans the expert totals into expert_offsets.
__global__ void __launch_bounds__(kScanThreads)
    permute_scan_kernel(int32_t* expert_offsets, int32_t* tile_counts, int32_t* sorted_pair, int64_t num_pairs, int E,
                        int64_t tiles) {
    extern __shared__ int32_t offsets[];  // [E + 1]
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    for (int e = warp; e < E; e += warps) {
        int32_t* row = tile_counts + static_cast<int64_t>(e) * tiles;
        int32_t carry = 0;
        for (int64_t t0 = 0; t0 < tiles; t0 += 32) {
            const int64_t t = t0 + lane;
            const int32_t c = t < tiles ? row[t] : 0;
            const int32_t inclusive = warp_inclusive_scan(c);
            if (t < tiles) row[t] = carry + inclusive - c;
            carry += __shfl_sync(detail::kFullMask, inclusive, 31);
        }
        if (lane == 0) offsets[e] = carry;  // the expert's total, for now
    }
    __syncthreads();
    if (warp == 0) {
        int32_t carry = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            const int e = e0 + lane;
            const int32_t c = e < E ? offsets[e] : 0;
            const int32_t inclusive = warp_inclusive_scan(c);
            if (e < E) {
                offsets[e] = carry + inclusive - c;
                expert_offsets[e] = carry + inclusive - c;
            }
            carry += __shfl_sync(detail::kFullMask, inclusive, 31);
        }
        if (lane == 0) {
            offsets[E] = carry;
            expert_offsets[E] = carry;
        }
    }
    __syncthreads();
    const int64_t cells = static_cast<int64_t>(E) * tiles;
    for (int64_t i = threadIdx.x; i < cells; i += blockDim.x) tile_counts[i] += offsets[i / tiles];
    // Rows past the valid pairs (only when some expert index was out of range) hold no pair.
    for (int64_t r = offsets[E] + threadIdx.x; r < num_pairs; r += blockDim.x) sorted_pair[r] = -1;
}

__global__ void permute_rank_kernel(int32_t* sorted_pair, int32_t* pair_row, const int32_t* base,
                                    const int32_t* topk_idx, int64_t num_pairs, int E, int64_t tiles) {
    extern __shared__ int32_t cursor_all[];  // [kIndexWarps][E]
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int64_t tile = static_cast<int64_t>(blockIdx.x) * kIndexWarps + warp;
    if (tile >= tiles) return;  // whole warp
    int32_t* cursor = cursor_all + warp * E;
    for (int e = lane; e < E; e += 32) cursor[e] = base[static_cast<int64_t>(e) * tiles + tile];
    const unsigned lanes_below = (1u << lane) - 1u;
    const int64_t begin = tile * kTile;
    const int64_t end = min(num_pairs, begin + kTile);
    // All of the tile's expert indices are loaded up front (kTile / 32 per lane), then ranked.
    constexpr int kSteps = kTile / 32;
    int32_t experts[kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
        const int64_t p = begin + s * 32 + lane;
        const int32_t e = p < end ? topk_idx[p] : -1;
        experts[s] = (e >= 0 && e < E) ? e : -1;
    }
    __syncwarp();
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
        const int64_t p = begin + s * 32 + lane;
        const int32_t e = experts[s];
        const unsigned peers = __match_any_sync(detail::kFullMask, e);
        int32_t row = -1;
        if (e >= 0) row = cursor[e] + __popc(peers & lanes_below);
        __syncwarp();
        if (e >= 0 && (peers & lanes_below) == 0) cursor[e] += __popc(peers);
        __syncwarp();
        if (p < end) {
            pair_row[p] = row;
            if (row >= 0) sorted_pair[row] = static_cast<int32_t>(p);
        }
    }
}

// ----------------------------------------------------------------------------------------------
// kernels: data movement

// The row kernels below give each row (a pair's, a token's) one warp, so that the row's index is
// read once and every lane keeps several 16-byte loads in flight; a thread per 16-byte piece (with a
// 64-bit division for its row) moved 1.9 TB/s at 65536 x 2048 on an H200.
constexpr int kRowWarps = kThreads / 32;  // rows a block works on at once
constexpr int kRowUnroll = 4;             // pieces of a row in flight per lane
constexpr int64_t kRowBlocks = 4096;      // the grid's cap (the warps then stride over the rows)

unsigned row_grid(int64_t rows) {
    return static_cast<unsigned>(std::clamp<int64_t>((rows + kRowWarps - 1) / kRowWarps, 1, kRowBlocks));
}

template <int kVec>
__device__ __forceinline__ detail::Bf16Raw<kVec> zero_raw() {
    if constexpr (kVec == 8)
        return make_uint4(0, 0, 0, 0);
    else
        return __ushort_as_bfloat16(0);
}

// x_perm[r] = x[sorted_pair[r] / K] (zeros for an out-of-range pair), a warp per row.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    gather_forward_kernel(bf16* x_perm, const bf16* x, const int32_t* sorted_pair, int64_t num_pairs, int K,
                          int64_t H) {
    using Raw = detail::Bf16Raw<kVec>;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int64_t vec_per_row = H / kVec, warps = static_cast<int64_t>(gridDim.x) * kRowWarps;
    for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32; r < num_pairs; r += warps) {
        const int32_t p = sorted_pair[r];
        const bool valid = p >= 0 && p < num_pairs;
        const Raw* src = reinterpret_cast<const Raw*>(x + (valid ? static_cast<int64_t>(p / K) * H : 0));
        Raw* dst = reinterpret_cast<Raw*>(x_perm + r * H);
        for (int64_t v0 = lane; v0 < vec_per_row; v0 += 32 * kRowUnroll) {
            Raw value[kRowUnroll];
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u) {
                const int64_t v = v0 + 32 * u;
                value[u] = valid && v < vec_per_row ? src[v] : zero_raw<kVec>();
            }
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u)
                if (v0 + 32 * u < vec_per_row) dst[v0 + 32 * u] = value[u];
        }
    }
}

// out[t] = (or += when accumulate) Σ_k weight(t, k) · src[pair_row[t·K + k]] in k order; weight 1
// when weights is null (1 · v is v: the same sums). A warp per token; the K rows in chunks of 8
// whose loads are in flight together.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    combine_rows_kernel(bf16* out, bool accumulate, const bf16* src, const float* weights, const int32_t* pair_row,
                        int64_t N, int K, int64_t H) {
    constexpr int kChunk = 8;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int64_t num_pairs = N * K, vec_per_row = H / kVec, warps = static_cast<int64_t>(gridDim.x) * kRowWarps;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32; t < N; t += warps) {
        for (int64_t v = lane; v < vec_per_row; v += 32) {
            const int64_t c = v * kVec;
            float acc[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[e] = 0.0f;
            for (int k0 = 0; k0 < K; k0 += kChunk) {
                float x[kChunk][kVec], w[kChunk];
                bool use[kChunk];
#pragma unroll
                for (int j = 0; j < kChunk; ++j) {
                    const int k = k0 + j;
                    const int32_t row = k < K ? pair_row[t * K + k] : -1;
                    use[j] = row >= 0 && row < num_pairs;
                    w[j] = use[j] && weights != nullptr ? weights[t * K + k] : 1.0f;
                    if (use[j]) detail::load_f32<kVec>(x[j], src + row * H + c);
                }
#pragma unroll
                for (int j = 0; j < kChunk; ++j) {
                    if (!use[j]) continue;
#pragma unroll
                    for (int e = 0; e < kVec; ++e) acc[e] += w[j] * x[j][e];
                }
            }
            bf16* o = out + t * H + c;
            if (accumulate) {
                float old[kVec];
                detail::load_f32<kVec>(old, o);
#pragma unroll
                for (int e = 0; e < kVec; ++e) acc[e] = old[e] + acc[e];
            }
            detail::store_f32<kVec>(o, acc);
        }
    }
}

// One warp per token; kMaxK bounds the per-slot dot-product registers. For each piece of dout, the
// token's rows of y_perm are loaded in chunks of 8 that are in flight together before any product
// is stored (a load after each store: 251 us for 8192 tokens x 8 x 2048 on an H100, 66% of DRAM);
// the loads precede the stores in program order, so dy_perm may even be y_perm. Each slot's dot
// product is summed in the same order either way.
template <int kVec, int kMaxK>
__global__ void __launch_bounds__(kThreads)
    unpermute_backward_kernel(bf16* dy_perm, float* dtopk_weight, const bf16* dout, const bf16* y_perm,
                              const float* topk_weight, const int32_t* pair_row, int64_t N, int K, int64_t H) {
    constexpr int kChunk = kMaxK < 8 ? kMaxK : 8;
    const int lane = threadIdx.x % 32;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
    if (t >= N) return;  // whole warp
    const int64_t num_pairs = N * K;
    int64_t rows[kMaxK];
    float w[kMaxK], dot[kMaxK];
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
        rows[k] = -1;
        w[k] = 0.0f;
        dot[k] = 0.0f;
        if (k < K) {
            const int32_t row = pair_row[t * K + k];
            if (row >= 0 && row < num_pairs) rows[k] = row;
            w[k] = topk_weight[t * K + k];
        }
    }
    const int64_t num_vec = H / kVec;
    for (int64_t v = lane; v < num_vec; v += 32) {
        const int64_t c = v * kVec;
        float g[kVec];
        detail::load_f32<kVec>(g, dout + t * H + c);
#pragma unroll
        for (int k0 = 0; k0 < kMaxK; k0 += kChunk) {
            float y[kChunk][kVec];
#pragma unroll
            for (int j = 0; j < kChunk; ++j)
                if (rows[k0 + j] >= 0) detail::load_f32<kVec>(y[j], y_perm + rows[k0 + j] * H + c);
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                const int k = k0 + j;
                if (rows[k] < 0) continue;
                float d[kVec];
#pragma unroll
                for (int e = 0; e < kVec; ++e) {
                    dot[k] += g[e] * y[j][e];
                    d[e] = w[k] * g[e];
                }
                detail::store_f32<kVec>(dy_perm + rows[k] * H + c, d);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
        if (k >= K) break;
        const float total = detail::group_sum<32>(dot[k]);
        if (lane == 0) dtopk_weight[t * K + k] = total;
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

void check_shape(const char* op, int64_t N, int64_t K, int64_t H) {
    MF_CHECK(N >= 0 && K > 0 && H >= 0, op, ": bad shape N=", N, " K=", K, " H=", H);
    MF_CHECK(N <= std::numeric_limits<int32_t>::max() / K, op, ": N·K = ", N, "·", K,
             " does not fit the int32 row indices");
}

// One warp: the group sizes in chunks of 32, each scanned with shuffles on top of the running sum
// (int64: sizes may add past int32 before the clamp).
__global__ void group_offsets_kernel(int32_t* offsets, const int32_t* group_sizes, int64_t E, int64_t num_rows) {
    const int lane = threadIdx.x;
    int64_t carry = 0;
    if (lane == 0) offsets[0] = 0;
    for (int64_t base = 0; base < E; base += 32) {
        const int64_t e = base + lane;
        int64_t v = e < E ? max(group_sizes[e], 0) : 0;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int64_t other = __shfl_up_sync(detail::kFullMask, v, offset);
            if (lane >= offset) v += other;
        }
        if (e < E) offsets[e + 1] = static_cast<int32_t>(min(carry + v, num_rows));
        carry = min(carry + __shfl_sync(detail::kFullMask, v, 31), num_rows);
    }
}

template <int kVec>
__global__ void zero_rows_past_kernel(bf16* x, const int32_t* end_row, int64_t M, int64_t C) {
    const int64_t end = min(static_cast<int64_t>(max(*end_row, 0)), M);
    const int64_t first = end * C / kVec, total = M * C / kVec;
    for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        if constexpr (kVec == 8) {
            reinterpret_cast<uint4*>(x)[i] = make_uint4(0, 0, 0, 0);
        } else {
            x[i] = __float2bfloat16(0.0f);
        }
    }
}

int grid_for(int64_t work) {
    return static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

bool use_vectors(int64_t H, const void* a, const void* b) { return H % 8 == 0 && aligned_to(16, a, b); }

void launch_combine(bf16* out, bool accumulate, const bf16* src, const float* weights, const int32_t* pair_row,
                    int64_t N, int64_t K, int64_t H, cudaStream_t stream) {
    if (use_vectors(H, out, src)) {
        combine_rows_kernel<8>
            <<<row_grid(N), kThreads, 0, stream>>>(out, accumulate, src, weights, pair_row, N, static_cast<int>(K), H);
    } else {
        combine_rows_kernel<1>
            <<<row_grid(N), kThreads, 0, stream>>>(out, accumulate, src, weights, pair_row, N, static_cast<int>(K), H);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

size_t moe_permute_indices_scratch_bytes(int64_t N, int64_t K, int64_t E) {
    check_shape("moe_permute_indices", N, K, 0);
    MF_CHECK(E > 0 && E <= kMaxExperts, "moe_permute_indices: E = ", E, " outside [1, ", kMaxExperts, "]");
    return static_cast<size_t>(std::max<int64_t>(num_tiles(N * K), 1) * E) * sizeof(int32_t);
}

void moe_permute_indices(int32_t* expert_offsets, int32_t* sorted_pair, int32_t* pair_row, const int32_t* topk_idx,
                         int64_t N, int64_t K, int64_t E, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
    const size_t needed = moe_permute_indices_scratch_bytes(N, K, E);
    MF_CHECK(expert_offsets != nullptr, "moe_permute_indices: null expert_offsets");
    const int64_t num_pairs = N * K;
    MF_CHECK(num_pairs == 0 || (sorted_pair != nullptr && pair_row != nullptr && topk_idx != nullptr),
             "moe_permute_indices: null buffer");
    MF_CHECK(scratch != nullptr && scratch_bytes >= needed, "moe_permute_indices: scratch has ", scratch_bytes,
             " bytes, needs ", needed);
    MF_CHECK(aligned_to(16, scratch), "moe_permute_indices: scratch must be 16-byte aligned");
    int32_t* tile_counts = static_cast<int32_t*>(scratch);
    const int64_t tiles = num_tiles(num_pairs);
    const int e32 = static_cast<int>(E);
    const size_t warp_tables = static_cast<size_t>(kIndexWarps) * E * sizeof(int32_t);
    const unsigned blocks = static_cast<unsigned>(std::max<int64_t>((tiles + kIndexWarps - 1) / kIndexWarps, 1));
    MF_CHECK_CUDA(cudaFuncSetAttribute(permute_histogram_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(warp_tables)));
    MF_CHECK_CUDA(cudaFuncSetAttribute(permute_rank_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(warp_tables)));
    if (tiles > 0) {
        permute_histogram_kernel<<<blocks, kIndexWarps * 32, warp_tables, stream>>>(tile_counts, topk_idx, num_pairs,
                                                                                    e32, tiles);
        MF_CHECK_CUDA(cudaGetLastError());
    }
    permute_scan_kernel<<<1, kScanThreads, (E + 1) * sizeof(int32_t), stream>>>(expert_offsets, tile_counts,
                                                                                sorted_pair, num_pairs, e32, tiles);
    MF_CHECK_CUDA(cudaGetLastError());
    if (tiles > 0) {
        permute_rank_kernel<<<blocks, kIndexWarps * 32, warp_tables, stream>>>(sorted_pair, pair_row, tile_counts,
                                                                               topk_idx, num_pairs, e32, tiles);
        MF_CHECK_CUDA(cudaGetLastError());
    }
}

void moe_gather_forward(bf16* x_perm, const bf16* x, const int32_t* sorted_pair, int64_t N, int64_t K, int64_t H,
                        cudaStream_t stream) {
    check_shape("moe_gather_forward", N, K, H);
    if (N == 0 || H == 0) return;
    MF_CHECK(x_perm != nullptr && x != nullptr && sorted_pair != nullptr, "moe_gather_forward: null buffer");
    const int64_t num_pairs = N * K;
    if (use_vectors(H, x_perm, x)) {
        gather_forward_kernel<8>
            <<<row_grid(num_pairs), kThreads, 0, stream>>>(x_perm, x, sorted_pair, num_pairs, static_cast<int>(K), H);
    } else {
        gather_forward_kernel<1>
            <<<row_grid(num_pairs), kThreads, 0, stream>>>(x_perm, x, sorted_pair, num_pairs, static_cast<int>(K), H);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

void moe_gather_backward(bf16* dx, bool accumulate, const bf16* dx_perm, const int32_t* pair_row, int64_t N, int64_t K,
                         int64_t H, cudaStream_t stream) {
    check_shape("moe_gather_backward", N, K, H);
    if (N == 0 || H == 0) return;
    MF_CHECK(dx != nullptr && dx_perm != nullptr && pair_row != nullptr, "moe_gather_backward: null buffer");
    launch_combine(dx, accumulate, dx_perm, nullptr, pair_row, N, K, H, stream);
}

void moe_unpermute_forward(bf16* out, const bf16* y_perm, const float* topk_weight, const int32_t* pair_row, int64_t N,
                           int64_t K, int64_t H, cudaStream_t stream) {
    check_shape("moe_unpermute_forward", N, K, H);
    if (N == 0 || H == 0) return;
    MF_CHECK(out != nullptr && y_perm != nullptr && topk_weight != nullptr && pair_row != nullptr,
             "moe_unpermute_forward: null buffer");
    launch_combine(out, false, y_perm, topk_weight, pair_row, N, K, H, stream);
}

void moe_unpermute_backward(bf16* dy_perm, float* dtopk_weight, const bf16* dout, const bf16* y_perm,
                            const float* topk_weight, const int32_t* pair_row, int64_t N, int64_t K, int64_t H,
                            cudaStream_t stream) {
    check_shape("moe_unpermute_backward", N, K, H);
    MF_CHECK(K <= 32, "moe_unpermute_backward: K = ", K, " above the supported 32");
    if (N == 0) return;
    MF_CHECK(dy_perm != nullptr && dtopk_weight != nullptr && dout != nullptr && y_perm != nullptr &&
                 topk_weight != nullptr && pair_row != nullptr,
             "moe_unpermute_backward: null buffer");
    const unsigned blocks = static_cast<unsigned>((N + kThreads / 32 - 1) / (kThreads / 32));
    const bool vec = H % 8 == 0 && aligned_to(16, dy_perm, dout, y_perm);
    const int k32 = static_cast<int>(K);
    if (vec && K <= 8) {
        unpermute_backward_kernel<8, 8>
            <<<blocks, kThreads, 0, stream>>>(dy_perm, dtopk_weight, dout, y_perm, topk_weight, pair_row, N, k32, H);
    } else if (vec) {
        unpermute_backward_kernel<8, 32>
            <<<blocks, kThreads, 0, stream>>>(dy_perm, dtopk_weight, dout, y_perm, topk_weight, pair_row, N, k32, H);
    } else if (K <= 8) {
        unpermute_backward_kernel<1, 8>
            <<<blocks, kThreads, 0, stream>>>(dy_perm, dtopk_weight, dout, y_perm, topk_weight, pair_row, N, k32, H);
    } else {
        unpermute_backward_kernel<1, 32>
            <<<blocks, kThreads, 0, stream>>>(dy_perm, dtopk_weight, dout, y_perm, topk_weight, pair_row, N, k32, H);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

void group_offsets(int32_t* offsets, const int32_t* group_sizes, int64_t E, int64_t num_rows, cudaStream_t stream) {
    MF_CHECK(E >= 0 && num_rows >= 0 && num_rows <= std::numeric_limits<int32_t>::max(), "group_offsets: E = ", E,
             ", num_rows = ", num_rows);
    MF_CHECK(offsets != nullptr && (E == 0 || group_sizes != nullptr), "group_offsets: null buffer");
    group_offsets_kernel<<<1, 32, 0, stream>>>(offsets, group_sizes, E, num_rows);
    MF_CHECK_CUDA(cudaGetLastError());
}

void zero_rows_past_groups(bf16* x, const int32_t* offsets, int64_t E, int64_t M, int64_t C, cudaStream_t stream) {
    MF_CHECK(E >= 0 && M >= 0 && C >= 0, "zero_rows_past_groups: E = ", E, ", M = ", M, ", C = ", C);
    if (M * C == 0) return;
    MF_CHECK(x != nullptr && offsets != nullptr, "zero_rows_past_groups: null buffer");
    // Which rows lie past the groups is known on the device only, and usually none do: a grid of at
    // most kZeroBlocks strides over whatever there is (a grid for all the rows cost 40 µs at 65536 x
    // 2048 on an H200 when every block found nothing to do).
    constexpr int kZeroBlocks = 1024;
    if (C % 8 == 0 && aligned_to(16, x))
        zero_rows_past_kernel<8>
            <<<std::min(grid_for(M * C / 8), kZeroBlocks), kThreads, 0, stream>>>(x, offsets + E, M, C);
    else
        zero_rows_past_kernel<1><<<std::min(grid_for(M * C), kZeroBlocks), kThreads, 0, stream>>>(x, offsets + E, M, C);
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
