// Expert-parallel token exchange, CUDA (spec: kernels/cpu/ep_tokens.h, the CPU reference).
//   positions   one block of kScanThreads per destination v walks the N tokens in tiles of
//               kScanTile: the tile's slots are read striped (16-byte loads of 4 slots when K % 4 ==
//               0, coalesced) and a slot whose expert is v's (a bit per expert in shared memory)
//               flags its token in shared memory; then each thread takes kScanItems consecutive
//               flags and a block-wide exclusive scan (warp shuffles, then one warp over the warp
//               totals) gives every bound token its position, carried from tile to tile in token
//               order. The last carry is counts[v]. Bitwise the CPU reference's.
//   row ops     one warp per row (grid-stride), in 16-byte units of 8 bf16 when H % 8 == 0 and the
//               buffers are aligned, else single elements. The row's targets or sources (a token's
//               destinations, V at a time; a received row's K slots) sit one per lane; a ballot
//               lists the valid ones and the warp walks them in ascending order, broadcasting each
//               row index with a shuffle. Copies load a chunk of the row into registers once and
//               store it to every target; sums keep kSumUnroll units per lane in fp32 and add the
//               sources k (or v) ascending from 0, so the order matches the CPU reference.
//   block offsets  each block of a kernel that needs off(v) scans counts into shared memory once
//               (warp 0, V at most kEpMaxDestinations).
// Every index read from memory is range-checked before use; invalid ones are skipped. No atomics:
// every output element has one writer (given the exchange's invariant that a local row is named by
// one slot), and dot products end in a fixed xor butterfly.
#include <algorithm>
#include <limits>
#include <type_traits>

#include "core/cuda_check.h"
#include "kernels/cuda/ep_tokens.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;  // row kernels: 8 warps, one row each at a time
constexpr int kWarps = kThreads / 32;
constexpr int kScanThreads = 1024;
constexpr int kScanItems = 8;  // tokens per thread and tile (marked striped, scanned consecutive)
constexpr int kScanTile = kScanThreads * kScanItems;
constexpr int kMarkLoads = 8;    // slot loads in flight per thread while marking a tile
constexpr int kCopyUnroll = 8;   // units per lane held in registers by the copies (8 × 16 B)
constexpr int kSumUnroll = 4;    // units per lane summed in fp32 by the sums (4 × 8 floats)
constexpr int kBlocksPerSm = 8;  // 8 × 256 threads: a full SM

static_assert(kScanThreads == 32 * 32, "the scan's second level is one warp over 32 warp totals");
static_assert(kScanItems == 8, "a thread reads its scan flags as one 8-byte word");

// ----------------------------------------------------------------------------------------------
// device helpers

// Inclusive prefix sum over the 32 lanes (Hillis-Steele with shuffles).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T x, int lane) {
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const T other = __shfl_up_sync(detail::kFullMask, x, offset);
        if (lane >= offset) x += other;
    }
    return x;
}

// off[v] = Σ_{v' < v} max(counts[v'], 0) for v in [0, V]. Called by the whole block (it syncs).
__device__ void load_block_offsets(int64_t* off, const int32_t* counts, int V) {
    if (threadIdx.x < 32) {
        const int lane = static_cast<int>(threadIdx.x);
        int64_t carry = 0;
        for (int v0 = 0; v0 < V; v0 += 32) {
            const int v = v0 + lane;
            const int64_t c = v < V ? max(counts[v], 0) : 0;
            const int64_t inclusive = warp_inclusive_scan(c, lane);
            if (v < V) off[v] = carry + inclusive - c;
            carry += __shfl_sync(detail::kFullMask, inclusive, 31);
        }
        if (lane == 0) off[V] = carry;
    }
    __syncthreads();
}

// Block row of token t for destination v, or -1: send_pos outside [0, counts[v]) or a row past the
// buffer. off: load_block_offsets (counts[v] clamped at 0 is off[v + 1] − off[v]).
__device__ __forceinline__ int64_t block_row(const int32_t* send_pos, const int64_t* off, int64_t N, int v, int64_t t,
                                             int64_t num_rows) {
    const int32_t pos = send_pos[v * N + t];
    if (pos < 0 || pos >= off[v + 1] - off[v]) return -1;
    const int64_t row = off[v] + pos;
    return row < num_rows ? row : -1;
}

// Lane `lane` < K: the local row of slot `lane` of meta row m (-1 when outside [0, num_local)), and
// its weight.
__device__ __forceinline__ int64_t meta_slot(const int32_t* m, int K, int lane, int64_t num_local, float* w) {
    *w = 0.0f;
    if (lane >= K) return -1;
    const int32_t d = m[lane];
    *w = __int_as_float(m[K + lane]);
    return d >= 0 && d < num_local ? d : -1;
}

template <int kVec>
using Unit = detail::Bf16Raw<kVec>;  // kVec bf16: a uint4 or one bf16

// Stores the kCopyUnroll units of `r` (units u0 + j·32 + lane of a row) into row `row` of out.
template <int kVec>
__device__ __forceinline__ void store_units(Unit<kVec>* out, int64_t row, int64_t units, int64_t u0, int lane,
                                            const Unit<kVec> (&r)[kCopyUnroll]) {
#pragma unroll
    for (int j = 0; j < kCopyUnroll; ++j) {
        const int64_t u = u0 + j * 32 + lane;
        if (u < units) out[row * units + u] = r[j];
    }
}

template <int kVec>
__device__ __forceinline__ void load_units(Unit<kVec> (&r)[kCopyUnroll], const Unit<kVec>* in, int64_t row,
                                           int64_t units, int64_t u0, int lane) {
#pragma unroll
    for (int j = 0; j < kCopyUnroll; ++j) {
        const int64_t u = u0 + j * 32 + lane;
        if (u < units) r[j] = in[row * units + u];
    }
}

// Copies row `src_row` of in to the rows held by the lanes in `mask` (lane b's `target`), ascending.
template <int kVec>
__device__ __forceinline__ void copy_row_to_targets(Unit<kVec>* out, const Unit<kVec>* in, int64_t src_row,
                                                    int64_t units, int64_t target, unsigned mask, int lane) {
    for (int64_t u0 = 0; u0 < units; u0 += 32 * kCopyUnroll) {
        Unit<kVec> r[kCopyUnroll];
        load_units<kVec>(r, in, src_row, units, u0, lane);
        for (unsigned rest = mask; rest != 0; rest &= rest - 1) {
            const int64_t dst = __shfl_sync(detail::kFullMask, target, __ffs(rest) - 1);
            store_units<kVec>(out, dst, units, u0, lane, r);
        }
    }
}

// acc[j][·] += w · row[units u0 + j·32 + lane] (fp32), for the units inside the row.
template <int kVec, typename T>
__device__ __forceinline__ void add_units(float (&acc)[kSumUnroll][kVec], const T* in, int64_t row, int64_t H,
                                          int64_t units, int64_t u0, int lane, float w) {
#pragma unroll
    for (int j = 0; j < kSumUnroll; ++j) {
        const int64_t u = u0 + j * 32 + lane;
        if (u >= units) continue;
        float x[kVec];
        detail::load_f32<kVec>(x, in + row * H + u * kVec);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[j][e] = fmaf(w, x[e], acc[j][e]);
    }
}

// ----------------------------------------------------------------------------------------------
// kernels

// n / d for n·d < 2^32 (n: a slot or slot-group index within a tile), with magic = 2^32 / d + 1:
// a multiply-high and one correction instead of a 32-bit division.
__device__ __forceinline__ uint32_t div_small(uint32_t n, uint32_t d, uint32_t magic) {
    if (d == 1) return n;  // magic would be 2^32
    uint32_t q = __umulhi(n, magic);
    if (q * d > n) --q;
    return q;
}

// Grid: V blocks of kScanThreads; dynamic shared memory: ceil(E / 32) words (the experts v owns, one
// bit each). kSlots: slots per load, 4 (one 16-byte load; K % 4 == 0 and topk_idx 16-byte aligned)
// or 1.
template <int kSlots>
__global__ void __launch_bounds__(kScanThreads)
    token_positions_kernel(int32_t* send_pos, int32_t* counts, const int32_t* __restrict__ topk_idx,
                           const int32_t* __restrict__ expert_dest, int64_t N, int K, int E) {
    using Load = std::conditional_t<kSlots == 4, int4, int32_t>;
    extern __shared__ uint32_t owned[];                 // bit e: expert_dest[e] == v
    __shared__ __align__(16) uint8_t bound[kScanTile];  // token of the tile bound for v
    __shared__ int32_t warp_base[32];                   // exclusive scan of the warp totals
    __shared__ int32_t tile_total;
    const int v = static_cast<int>(blockIdx.x);
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int warp = static_cast<int>(threadIdx.x / 32);
    // Ownership bits by ballot, one word per warp at a time (no atomics). A few words serve every
    // lookup: lanes reading the same word are a broadcast, not a bank conflict.
    const int words = (E + 31) / 32;
    for (int w0 = 0; w0 < words; w0 += kScanThreads / 32) {
        const int word = w0 + warp;
        const int e = word * 32 + lane;
        const unsigned bits = __ballot_sync(detail::kFullMask, e < E && expert_dest[e] == v);
        if (word < words && lane == 0) owned[word] = bits;
    }
    const uint32_t loads_per_token = static_cast<uint32_t>(K / kSlots);
    const uint32_t magic = 0xffffffffu / loads_per_token + 1u;
    int32_t carry = 0;  // tokens bound for v before this tile, the same on every thread
    for (int64_t tile = 0; tile < N; tile += kScanTile) {
        reinterpret_cast<uint2*>(bound)[threadIdx.x] = make_uint2(0, 0);
        __syncthreads();  // also orders the ownership words before their first use
        // Mark: the tile's slots, striped over the threads in loads of kSlots (a warp reads contiguous
        // memory), kMarkLoads loads in flight per thread; a load with an expert of v flags its token.
        // Several loads of one token may flag it; they all store the same 1.
        const Load* slots = reinterpret_cast<const Load*>(topk_idx + tile * K);
        const uint32_t tile_loads =
            static_cast<uint32_t>(min(static_cast<int64_t>(kScanTile), N - tile)) * loads_per_token;
        for (uint32_t l0 = threadIdx.x; l0 < tile_loads; l0 += kScanThreads * kMarkLoads) {
            Load raw[kMarkLoads];
#pragma unroll
            for (int j = 0; j < kMarkLoads; ++j) {
                const uint32_t l = l0 + j * kScanThreads;
                if (l < tile_loads) raw[j] = slots[l];
            }
#pragma unroll
            for (int j = 0; j < kMarkLoads; ++j) {
                const uint32_t l = l0 + j * kScanThreads;
                if (l >= tile_loads) continue;
                const uint32_t* e = reinterpret_cast<const uint32_t*>(&raw[j]);
                uint32_t hit = 0;
#pragma unroll
                for (int i = 0; i < kSlots; ++i) {  // branch-free: e < E as unsigned also rules out e < 0
                    const bool valid = e[i] < static_cast<uint32_t>(E);
                    hit |= (owned[valid ? e[i] >> 5 : 0] >> (e[i] & 31)) & static_cast<uint32_t>(valid);
                }
                if (hit != 0) bound[div_small(l, loads_per_token, magic)] = 1;
            }
        }
        __syncthreads();
        // Scan: thread i owns the tile's tokens [i·kScanItems, (i + 1)·kScanItems).
        const uint2 packed = reinterpret_cast<const uint2*>(bound)[threadIdx.x];  // its 8 flags, one load
        int32_t flags[kScanItems];
        int32_t mine = 0;
#pragma unroll
        for (int i = 0; i < kScanItems; ++i) {
            flags[i] = static_cast<int32_t>(((i < 4 ? packed.x : packed.y) >> (8 * (i % 4))) & 0xffu);
            mine += flags[i];
        }
        const int32_t inclusive = warp_inclusive_scan(mine, lane);
        if (lane == 31) warp_base[warp] = inclusive;
        __syncthreads();
        if (warp == 0) {
            const int32_t total = warp_base[lane];
            const int32_t warp_inclusive = warp_inclusive_scan(total, lane);
            warp_base[lane] = warp_inclusive - total;
            if (lane == 31) tile_total = warp_inclusive;
        }
        __syncthreads();
        int32_t pos = carry + warp_base[warp] + inclusive - mine;
#pragma unroll
        for (int i = 0; i < kScanItems; ++i) {
            const int64_t t = tile + threadIdx.x * kScanItems + i;
            if (t < N) send_pos[v * N + t] = flags[i] != 0 ? pos : -1;
            pos += flags[i];
        }
        carry += tile_total;
        __syncthreads();  // bound, warp_base and tile_total are reused by the next tile
    }
    if (threadIdx.x == 0) counts[v] = carry;
}

// One warp per token: its row goes to every destination it is bound for. Dynamic shared: V + 1 int64.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    pack_rows_kernel(bf16* rows, int64_t num_rows, const bf16* __restrict__ src, const int32_t* __restrict__ send_pos,
                     const int32_t* __restrict__ counts, int64_t N, int V, int64_t H) {
    extern __shared__ int64_t off[];
    load_block_offsets(off, counts, V);
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int64_t units = H / kVec;
    auto* out = reinterpret_cast<Unit<kVec>*>(rows);
    const auto* in = reinterpret_cast<const Unit<kVec>*>(src);
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < N;
         t += static_cast<int64_t>(gridDim.x) * kWarps) {
        for (int v0 = 0; v0 < V; v0 += 32) {
            const int v = v0 + lane;
            const int64_t row = v < V ? block_row(send_pos, off, N, v, t, num_rows) : -1;
            const unsigned mask = __ballot_sync(detail::kFullMask, row >= 0);
            if (mask != 0) copy_row_to_targets<kVec>(out, in, t, units, row, mask, lane);
        }
    }
}

// One warp per token; lane k holds slot k (K <= 32). Dynamic shared: V + 1 int64.
__global__ void __launch_bounds__(kThreads)
    pack_meta_kernel(int32_t* meta, int64_t num_rows, const int32_t* __restrict__ send_pos,
                     const int32_t* __restrict__ counts, const int32_t* __restrict__ topk_idx,
                     const float* __restrict__ topk_weight, const int32_t* __restrict__ pair_row,
                     const int32_t* __restrict__ expert_offsets, const int32_t* __restrict__ row_base,
                     const int32_t* __restrict__ expert_dest, int64_t N, int K, int E, int V) {
    extern __shared__ int64_t off[];
    load_block_offsets(off, counts, V);
    const int lane = static_cast<int>(threadIdx.x % 32);
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < N;
         t += static_cast<int64_t>(gridDim.x) * kWarps) {
        // Lane k's slot: its destination (-1: none), local row (-1: none) and weight bits. The loads
        // that depend on nothing come first (the slot, and the send positions of the first 32
        // destinations), then those that depend on the expert: two round trips, not four.
        int32_t e = -1, r = -1, weight_bits = 0;
        if (lane < K) {
            const int64_t p = t * K + lane;
            e = topk_idx[p];
            r = pair_row[p];
            weight_bits = __float_as_int(topk_weight[p]);
        }
        const int64_t first_row = lane < V ? block_row(send_pos, off, N, lane, t, num_rows) : -1;
        int dest = -1;
        int32_t local = -1;
        if (e >= 0 && e < E) {
            const int32_t d = expert_dest[e], begin = expert_offsets[e], end = expert_offsets[e + 1];
            const int64_t row = int64_t{row_base[e]} + r - begin;
            if (d >= 0 && d < V) {
                dest = d;
                if (r >= begin && r < end && row >= 0 && row <= std::numeric_limits<int32_t>::max())
                    local = static_cast<int32_t>(row);
            }
        }
        if (local < 0) weight_bits = 0;
        for (int v0 = 0; v0 < V; v0 += 32) {
            const int v = v0 + lane;
            const int64_t row = v0 == 0 ? first_row : v < V ? block_row(send_pos, off, N, v, t, num_rows) : -1;
            for (unsigned rest = __ballot_sync(detail::kFullMask, row >= 0); rest != 0; rest &= rest - 1) {
                const int b = __ffs(rest) - 1;
                const int64_t dst = __shfl_sync(detail::kFullMask, row, b);
                if (lane < K) {
                    const bool mine = dest == v0 + b && local >= 0;
                    meta[dst * 2 * K + lane] = mine ? local : -1;
                    meta[dst * 2 * K + K + lane] = mine ? weight_bits : 0;
                }
            }
        }
    }
}

// One warp per received row; lane k holds slot k.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    scatter_rows_kernel(bf16* local, int64_t num_local, const bf16* __restrict__ rows, const int32_t* __restrict__ meta,
                        int64_t M, int K, int64_t H) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int64_t units = H / kVec;
    auto* out = reinterpret_cast<Unit<kVec>*>(local);
    const auto* in = reinterpret_cast<const Unit<kVec>*>(rows);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; i < M;
         i += static_cast<int64_t>(gridDim.x) * kWarps) {
        float w;
        const int64_t d = meta_slot(meta + i * 2 * K, K, lane, num_local, &w);
        const unsigned mask = __ballot_sync(detail::kFullMask, d >= 0);
        if (mask != 0) copy_row_to_targets<kVec>(out, in, i, units, d, mask, lane);
    }
}

// One warp per received row; lane k holds slot k; kMaxK partial dot products per lane.
template <int kVec, int kMaxK>
__global__ void __launch_bounds__(kThreads)
    scatter_grad_kernel(bf16* dlocal, float* dweight, const bf16* __restrict__ drows, const int32_t* __restrict__ meta,
                        const bf16* __restrict__ y_local, int64_t num_local, int64_t M, int K, int64_t H) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int64_t units = H / kVec;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; i < M;
         i += static_cast<int64_t>(gridDim.x) * kWarps) {
        float w;
        const int64_t d = meta_slot(meta + i * 2 * K, K, lane, num_local, &w);
        const unsigned mask = __ballot_sync(detail::kFullMask, d >= 0);
        float dot[kMaxK];
#pragma unroll
        for (int k = 0; k < kMaxK; ++k) dot[k] = 0.0f;
        if (mask != 0) {
            for (int64_t u0 = 0; u0 < units; u0 += 32 * kSumUnroll) {
                float g[kSumUnroll][kVec];
#pragma unroll
                for (int j = 0; j < kSumUnroll; ++j) {
                    const int64_t u = u0 + j * 32 + lane;
                    if (u < units) detail::load_f32<kVec>(g[j], drows + i * H + u * kVec);
                }
#pragma unroll
                for (int k = 0; k < kMaxK; ++k) {
                    if (((mask >> k) & 1u) == 0) continue;  // warp-uniform
                    const int64_t dk = __shfl_sync(detail::kFullMask, d, k);
                    const float wk = __shfl_sync(detail::kFullMask, w, k);
#pragma unroll
                    for (int j = 0; j < kSumUnroll; ++j) {
                        const int64_t u = u0 + j * 32 + lane;
                        if (u >= units) continue;
                        float y[kVec], dl[kVec];
                        detail::load_f32<kVec>(y, y_local + dk * H + u * kVec);
#pragma unroll
                        for (int e = 0; e < kVec; ++e) {
                            dot[k] = fmaf(g[j][e], y[e], dot[k]);
                            dl[e] = wk * g[j][e];
                        }
                        detail::store_f32<kVec>(dlocal + dk * H + u * kVec, dl);
                    }
                }
            }
        }
        float slot_total = 0.0f;
#pragma unroll
        for (int k = 0; k < kMaxK; ++k) {
            if (k >= K) break;
            const float total = detail::group_sum<32>(dot[k]);
            if (lane == k) slot_total = total;
        }
        if (lane < K) dweight[i * K + lane] = slot_total;
    }
}

// One warp per output row; lane k holds slot k; sums k ascending in fp32.
template <int kVec, typename Out>
__global__ void __launch_bounds__(kThreads)
    reduce_rows_kernel(Out* out, const bf16* __restrict__ local, int64_t num_local, const int32_t* __restrict__ meta,
                       int64_t M, int K, int64_t H, bool weighted) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int64_t units = H / kVec;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; i < M;
         i += static_cast<int64_t>(gridDim.x) * kWarps) {
        float w;
        const int64_t d = meta_slot(meta + i * 2 * K, K, lane, num_local, &w);
        if (!weighted) w = 1.0f;
        const unsigned mask = __ballot_sync(detail::kFullMask, d >= 0);
        for (int64_t u0 = 0; u0 < units; u0 += 32 * kSumUnroll) {
            float acc[kSumUnroll][kVec] = {};
            for (unsigned rest = mask; rest != 0; rest &= rest - 1) {
                const int b = __ffs(rest) - 1;
                const int64_t src = __shfl_sync(detail::kFullMask, d, b);
                const float wb = __shfl_sync(detail::kFullMask, w, b);
                add_units<kVec>(acc, local, src, H, units, u0, lane, wb);
            }
#pragma unroll
            for (int j = 0; j < kSumUnroll; ++j) {
                const int64_t u = u0 + j * 32 + lane;
                if (u < units) detail::store_f32<kVec>(out + i * H + u * kVec, acc[j]);
            }
        }
    }
}

// One warp per token; lane l holds destination v0 + l; sums v ascending in fp32. Dynamic shared:
// V + 1 int64.
template <int kVec, typename In>
__global__ void __launch_bounds__(kThreads)
    sum_blocks_kernel(bf16* out, bool accumulate, const In* __restrict__ rows, int64_t num_rows,
                      const int32_t* __restrict__ send_pos, const int32_t* __restrict__ counts, int64_t N, int V,
                      int64_t H) {
    extern __shared__ int64_t off[];
    load_block_offsets(off, counts, V);
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int64_t units = H / kVec;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < N;
         t += static_cast<int64_t>(gridDim.x) * kWarps) {
        for (int64_t u0 = 0; u0 < units; u0 += 32 * kSumUnroll) {
            float acc[kSumUnroll][kVec] = {};
            for (int v0 = 0; v0 < V; v0 += 32) {
                const int v = v0 + lane;
                const int64_t row = v < V ? block_row(send_pos, off, N, v, t, num_rows) : -1;
                for (unsigned rest = __ballot_sync(detail::kFullMask, row >= 0); rest != 0; rest &= rest - 1) {
                    const int64_t src = __shfl_sync(detail::kFullMask, row, __ffs(rest) - 1);
                    add_units<kVec>(acc, rows, src, H, units, u0, lane, 1.0f);
                }
            }
#pragma unroll
            for (int j = 0; j < kSumUnroll; ++j) {
                const int64_t u = u0 + j * 32 + lane;
                if (u >= units) continue;
                bf16* o = out + t * H + u * kVec;
                if (accumulate) {
                    float old[kVec];
                    detail::load_f32<kVec>(old, o);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) acc[j][e] = old[e] + acc[j][e];
                }
                detail::store_f32<kVec>(o, acc[j]);
            }
        }
    }
}

// One thread per slot (grid-stride). Dynamic shared: V + 1 int64.
__global__ void __launch_bounds__(kThreads)
    gather_slots_kernel(float* dtopk_weight, const float* __restrict__ dweight_rows, int64_t num_rows,
                        const int32_t* __restrict__ send_pos, const int32_t* __restrict__ counts,
                        const int32_t* __restrict__ topk_idx, const int32_t* __restrict__ expert_dest, int64_t N, int K,
                        int E, int V) {
    extern __shared__ int64_t off[];
    load_block_offsets(off, counts, V);
    const int64_t num_slots = N * K;
    for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < num_slots;
         p += static_cast<int64_t>(gridDim.x) * kThreads) {
        float value = 0.0f;
        const int32_t e = topk_idx[p];
        if (e >= 0 && e < E) {
            const int32_t v = expert_dest[e];
            if (v >= 0 && v < V) {
                // N·K < 2^31 (checked on the host): a 32-bit division.
                const int64_t t = static_cast<uint32_t>(p) / static_cast<uint32_t>(K);
                const int64_t row = block_row(send_pos, off, N, v, t, num_rows);
                if (row >= 0) value = dweight_rows[row * K + (p - t * K)];
            }
        }
        dtopk_weight[p] = value;
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

void check_shape(const char* op, int64_t N, int64_t K, int64_t V, int64_t H) {
    MF_CHECK(N >= 0 && K >= 1 && H >= 0, op, ": bad shape N=", N, " K=", K, " H=", H);
    MF_CHECK(V >= 1 && V <= kEpMaxDestinations, op, ": V = ", V, " destinations outside [1, ", kEpMaxDestinations, "]");
    MF_CHECK(N <= std::numeric_limits<int32_t>::max() / K, op, ": N·K = ", N, "·", K, " does not fit int32 indices");
}

void check_slots(const char* op, int64_t K) {
    MF_CHECK(K <= kEpMaxTopK, op, ": K = ", K, " above the supported ", kEpMaxTopK, " (one slot per lane)");
}

// Blocks for `work_items` items of `per_block` each, at most kBlocksPerSm per SM (grid-stride beyond).
unsigned grid_for(int64_t work_items, int64_t per_block) {
    int device = 0, sms = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    MF_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int64_t want = (work_items + per_block - 1) / per_block;
    return static_cast<unsigned>(std::clamp<int64_t>(want, 1, int64_t{kBlocksPerSm} * std::max(sms, 1)));
}

size_t offsets_bytes(int64_t V) { return static_cast<size_t>(V + 1) * sizeof(int64_t); }

bool use_vectors(int64_t H, const void* a, const void* b, const void* c = nullptr) {
    return H % 8 == 0 && aligned_to(16, a, b, c);
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void ep_token_positions(int32_t* send_pos, int32_t* counts, const int32_t* topk_idx, const int32_t* expert_dest,
                        int64_t N, int64_t K, int64_t E, int64_t V, cudaStream_t stream) {
    check_shape("ep_token_positions", N, K, V, 0);
    check_slots("ep_token_positions", K);
    MF_CHECK(E >= 1 && E <= kEpMaxExperts, "ep_token_positions: E = ", E, " outside [1, ", kEpMaxExperts, "]");
    MF_CHECK(counts != nullptr && expert_dest != nullptr && (N == 0 || (send_pos != nullptr && topk_idx != nullptr)),
             "ep_token_positions: null buffer");
    const unsigned grid = static_cast<unsigned>(V);
    const size_t shared = static_cast<size_t>((E + 31) / 32) * sizeof(uint32_t);
    const int k32 = static_cast<int>(K), e32 = static_cast<int>(E);
    if (K % 4 == 0 && aligned_to(16, topk_idx))
        token_positions_kernel<4>
            <<<grid, kScanThreads, shared, stream>>>(send_pos, counts, topk_idx, expert_dest, N, k32, e32);
    else
        token_positions_kernel<1>
            <<<grid, kScanThreads, shared, stream>>>(send_pos, counts, topk_idx, expert_dest, N, k32, e32);
    MF_CHECK_CUDA(cudaGetLastError());
}

void ep_pack_rows(bf16* rows, int64_t num_rows, const bf16* src, const int32_t* send_pos, const int32_t* counts,
                  int64_t N, int64_t V, int64_t H, cudaStream_t stream) {
    check_shape("ep_pack_rows", N, 1, V, H);
    if (N == 0 || H == 0 || num_rows <= 0) return;
    MF_CHECK(rows != nullptr && src != nullptr && send_pos != nullptr && counts != nullptr,
             "ep_pack_rows: null buffer");
    const unsigned grid = grid_for(N, kWarps);
    const int v32 = static_cast<int>(V);
    if (use_vectors(H, rows, src))
        pack_rows_kernel<8>
            <<<grid, kThreads, offsets_bytes(V), stream>>>(rows, num_rows, src, send_pos, counts, N, v32, H);
    else
        pack_rows_kernel<1>
            <<<grid, kThreads, offsets_bytes(V), stream>>>(rows, num_rows, src, send_pos, counts, N, v32, H);
    MF_CHECK_CUDA(cudaGetLastError());
}

void ep_pack_meta(int32_t* meta, int64_t num_rows, const int32_t* send_pos, const int32_t* counts,
                  const int32_t* topk_idx, const float* topk_weight, const int32_t* pair_row,
                  const int32_t* expert_offsets, const int32_t* row_base, const int32_t* expert_dest, int64_t N,
                  int64_t K, int64_t E, int64_t V, cudaStream_t stream) {
    check_shape("ep_pack_meta", N, K, V, 0);
    check_slots("ep_pack_meta", K);
    MF_CHECK(E >= 1 && E < std::numeric_limits<int32_t>::max(), "ep_pack_meta: bad expert count E=", E);
    if (N == 0 || num_rows <= 0) return;
    MF_CHECK(meta != nullptr && send_pos != nullptr && counts != nullptr && topk_idx != nullptr &&
                 topk_weight != nullptr && pair_row != nullptr && expert_offsets != nullptr && row_base != nullptr &&
                 expert_dest != nullptr,
             "ep_pack_meta: null buffer");
    pack_meta_kernel<<<grid_for(N, kWarps), kThreads, offsets_bytes(V), stream>>>(
        meta, num_rows, send_pos, counts, topk_idx, topk_weight, pair_row, expert_offsets, row_base, expert_dest, N,
        static_cast<int>(K), static_cast<int>(E), static_cast<int>(V));
    MF_CHECK_CUDA(cudaGetLastError());
}

void ep_scatter_rows(bf16* local, int64_t num_local, const bf16* rows, const int32_t* meta, int64_t M, int64_t K,
                     int64_t H, cudaStream_t stream) {
    check_shape("ep_scatter_rows", M, K, 1, H);
    check_slots("ep_scatter_rows", K);
    if (M == 0 || H == 0 || num_local <= 0) return;
    MF_CHECK(local != nullptr && rows != nullptr && meta != nullptr, "ep_scatter_rows: null buffer");
    const unsigned grid = grid_for(M, kWarps);
    const int k32 = static_cast<int>(K);
    if (use_vectors(H, local, rows))
        scatter_rows_kernel<8><<<grid, kThreads, 0, stream>>>(local, num_local, rows, meta, M, k32, H);
    else
        scatter_rows_kernel<1><<<grid, kThreads, 0, stream>>>(local, num_local, rows, meta, M, k32, H);
    MF_CHECK_CUDA(cudaGetLastError());
}

void ep_scatter_grad(bf16* dlocal, float* dweight, const bf16* drows, const int32_t* meta, const bf16* y_local,
                     int64_t num_local, int64_t M, int64_t K, int64_t H, cudaStream_t stream) {
    check_shape("ep_scatter_grad", M, K, 1, H);
    check_slots("ep_scatter_grad", K);
    if (M == 0) return;
    MF_CHECK(dweight != nullptr && meta != nullptr &&
                 (num_local <= 0 || H == 0 || (dlocal != nullptr && drows != nullptr && y_local != nullptr)),
             "ep_scatter_grad: null buffer");
    const unsigned grid = grid_for(M, kWarps);
    const int k32 = static_cast<int>(K);
    const int64_t L = std::max<int64_t>(num_local, 0);
    const bool vec = use_vectors(H, dlocal, drows, y_local);
    if (vec && K <= 8)
        scatter_grad_kernel<8, 8><<<grid, kThreads, 0, stream>>>(dlocal, dweight, drows, meta, y_local, L, M, k32, H);
    else if (vec)
        scatter_grad_kernel<8, 32><<<grid, kThreads, 0, stream>>>(dlocal, dweight, drows, meta, y_local, L, M, k32, H);
    else if (K <= 8)
        scatter_grad_kernel<1, 8><<<grid, kThreads, 0, stream>>>(dlocal, dweight, drows, meta, y_local, L, M, k32, H);
    else
        scatter_grad_kernel<1, 32><<<grid, kThreads, 0, stream>>>(dlocal, dweight, drows, meta, y_local, L, M, k32, H);
    MF_CHECK_CUDA(cudaGetLastError());
}

namespace {

template <typename Out>
void launch_reduce_rows(Out* out, const bf16* local, int64_t num_local, const int32_t* meta, int64_t M, int64_t K,
                        int64_t H, bool weighted, cudaStream_t stream) {
    check_shape("ep_reduce_rows", M, K, 1, H);
    check_slots("ep_reduce_rows", K);
    if (M == 0 || H == 0) return;
    MF_CHECK(out != nullptr && meta != nullptr && (num_local <= 0 || local != nullptr), "ep_reduce_rows: null buffer");
    const unsigned grid = grid_for(M, kWarps);
    const int k32 = static_cast<int>(K);
    const int64_t L = std::max<int64_t>(num_local, 0);
    if (use_vectors(H, out, local))
        reduce_rows_kernel<8, Out><<<grid, kThreads, 0, stream>>>(out, local, L, meta, M, k32, H, weighted);
    else
        reduce_rows_kernel<1, Out><<<grid, kThreads, 0, stream>>>(out, local, L, meta, M, k32, H, weighted);
    MF_CHECK_CUDA(cudaGetLastError());
}

template <typename In>
void launch_sum_blocks(bf16* out, bool accumulate, const In* rows, int64_t num_rows, const int32_t* send_pos,
                       const int32_t* counts, int64_t N, int64_t V, int64_t H, cudaStream_t stream) {
    check_shape("ep_sum_blocks", N, 1, V, H);
    if (N == 0 || H == 0) return;
    MF_CHECK(out != nullptr && send_pos != nullptr && counts != nullptr && (num_rows <= 0 || rows != nullptr),
             "ep_sum_blocks: null buffer");
    const unsigned grid = grid_for(N, kWarps);
    const int v32 = static_cast<int>(V);
    const int64_t R = std::max<int64_t>(num_rows, 0);
    if (use_vectors(H, out, rows))
        sum_blocks_kernel<8, In>
            <<<grid, kThreads, offsets_bytes(V), stream>>>(out, accumulate, rows, R, send_pos, counts, N, v32, H);
    else
        sum_blocks_kernel<1, In>
            <<<grid, kThreads, offsets_bytes(V), stream>>>(out, accumulate, rows, R, send_pos, counts, N, v32, H);
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void ep_reduce_rows(bf16* out, const bf16* local, int64_t num_local, const int32_t* meta, int64_t M, int64_t K,
                    int64_t H, bool weighted, cudaStream_t stream) {
    launch_reduce_rows(out, local, num_local, meta, M, K, H, weighted, stream);
}

void ep_reduce_rows(float* out, const bf16* local, int64_t num_local, const int32_t* meta, int64_t M, int64_t K,
                    int64_t H, bool weighted, cudaStream_t stream) {
    launch_reduce_rows(out, local, num_local, meta, M, K, H, weighted, stream);
}

void ep_sum_blocks(bf16* out, bool accumulate, const bf16* rows, int64_t num_rows, const int32_t* send_pos,
                   const int32_t* counts, int64_t N, int64_t V, int64_t H, cudaStream_t stream) {
    launch_sum_blocks(out, accumulate, rows, num_rows, send_pos, counts, N, V, H, stream);
}

void ep_sum_blocks(bf16* out, bool accumulate, const float* rows, int64_t num_rows, const int32_t* send_pos,
                   const int32_t* counts, int64_t N, int64_t V, int64_t H, cudaStream_t stream) {
    launch_sum_blocks(out, accumulate, rows, num_rows, send_pos, counts, N, V, H, stream);
}

void ep_gather_slots(float* dtopk_weight, const float* dweight_rows, int64_t num_rows, const int32_t* send_pos,
                     const int32_t* counts, const int32_t* topk_idx, const int32_t* expert_dest, int64_t N, int64_t K,
                     int64_t E, int64_t V, cudaStream_t stream) {
    check_shape("ep_gather_slots", N, K, V, 0);
    check_slots("ep_gather_slots", K);
    MF_CHECK(E >= 1 && E < std::numeric_limits<int32_t>::max(), "ep_gather_slots: bad expert count E=", E);
    if (N == 0) return;
    MF_CHECK(dtopk_weight != nullptr && send_pos != nullptr && counts != nullptr && topk_idx != nullptr &&
                 expert_dest != nullptr && (num_rows <= 0 || dweight_rows != nullptr),
             "ep_gather_slots: null buffer");
    gather_slots_kernel<<<grid_for(N * K, kThreads), kThreads, offsets_bytes(V), stream>>>(
        dtopk_weight, dweight_rows, std::max<int64_t>(num_rows, 0), send_pos, counts, topk_idx, expert_dest, N,
        static_cast<int>(K), static_cast<int>(E), static_cast<int>(V));
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
