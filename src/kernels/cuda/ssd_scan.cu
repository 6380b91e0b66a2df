// The SSD chunked scan, CUDA. Per row b, chunk c of Q tokens (the last one may hold fewer: L) and
// head h, with cs_t = Σ_{u<=t} δ_u·A inside the chunk and seg_t = the number of segment starts
// in tokens 0..t of the chunk (so s and t share a segment iff seg_s == seg_t, and token t still
// sees the state entering the chunk iff seg_t == 0):
//   intra   y_t += Σ_{s<=t, seg_s = seg_t} (C_t·B_s) · exp(cs_t − cs_s) · δ_s · x_s   (C·Bᵀ masked by L)
//   inter   y_t += [seg_t = 0] · exp(cs_t) · C_t · h_in                              (h_in: state entering)
//   state   h_out = [seg_last = 0] · exp(cs_last) · h_in + Σ_{seg_s = seg_last} exp(cs_last − cs_s) δ_s x_s⊗B_s
// Forward: (1) per chunk the local end state (h_in = 0) into `states` and its decay
// [seg_last = 0]·exp(cs_last); (2) per (b, h) a sequential pass over the chunks turning `states` in
// place into the state entering each chunk; (3) per chunk the outputs (intra + inter + D·x).
// Backward, the same in reverse: (1) per chunk Σ_{seg_t = 0} exp(cs_t)·dy_t⊗C_t (the gradient at h_in
// from the chunk's own outputs); (2) a reverse pass over the chunks giving dh_out, the gradient at each
// chunk's end state; (3) per chunk and B/C group (its heads in order, C·Bᵀ computed once): dx, the
// gradient at cs and δ, ddt at the raw dt, per-chunk partial sums of ddt_bias, dA_log, dD (reduced over
// chunks in a fixed order), and the weights of dB and dC's intra-chunk part summed over the heads (f32
// scratch, in head order); then dB and dC, each one product over the summed weights and every head's
// state term.
// Every product runs on the tensor cores (mma_product: mma.sync m16n8k16 bf16 → fp32). x, B, C and dy
// are bf16 already and enter exactly; an fp32 operand (a decayed C·Bᵀ, a state, a scaled row) enters
// as hi + lo, two bf16 whose sum carries ~16 mantissa bits, and costs a second mma (a·b = hi·b + lo·b;
// both sides split: hi·hi + lo·hi + hi·lo), so the products keep about fp32 accuracy. cs, the exp of
// its differences, the masks and the chunk-to-chunk state pass stay fp32 on CUDA cores. Each output
// element is summed by one thread in a fixed order: no atomics, bitwise reproducible.
// NOTE: the per-chunk matrices are [Q, Q] fp32 in shared memory, so Q <= kSsdMaxChunk and the launch
// checks the shared-memory budget for the (Q, P, S) given.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.h"
#include "kernels/cuda/mma_sm80.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/ssd_scan.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;      // the chunk-state and dstate kernels (two blocks per SM)
constexpr int kWideThreads = 512;  // the output and backward chunk kernels (one block per SM)
constexpr int kMaxWarps = kWideThreads / 32;
constexpr int kMaxQ = static_cast<int>(kSsdMaxChunk);
constexpr int kPassThreads = 256;
constexpr int kPassBatch = 16;                   // chunk states the passes load before they use the first
constexpr int kColParts = kWideThreads / kMaxQ;  // the backward's column sums: threads a column

// mma_product's tiling: outputs in blocks of kBlockRows × kBlockRows, each cut into warp tiles of
// kWarpTile × kWarpTile (2 × 4 mma tiles of 16 × 8); the contracted index in slices of kTileK staged
// as bf16 rows of kTileStride (80 bytes: the 8 rows an ldmatrix reads fall in distinct banks).
constexpr int kBlockRows = 128;
constexpr int kWarpTile = 32;
constexpr int kTilesPerSide = kBlockRows / kWarpTile;
constexpr int kTileK = 32;
constexpr int kTileStride = kTileK + 8;
constexpr int kStagedElems = kBlockRows * kTileStride;
constexpr int kTransStride = kBlockRows + 8;  // a slice staged k-major: kTileK rows of kBlockRows (+ 16 bytes)
static_assert(kTileK * kTransStride <= kStagedElems, "a k-major slice fits a staging buffer");
constexpr size_t kStagingBytes = 4 * kStagedElems * sizeof(bf16);  // A hi, A lo, B hi, B lo
static_assert((kBlockRows & (kBlockRows - 1)) == 0 && kTileK % 32 == 0, "SliceRegs::place: powers of two");
static_assert(kMaxQ <= kBlockRows && kMaxQ % 32 == 0, "one output block covers a chunk; prefix sums: kMaxQ/32 a lane");

// The geometry as the kernels use it.
struct Dims {
    int64_t T;
    int H, P, G, S, Q, num_chunks, heads_per_group;
    int64_t ld;  // xbc row length I + 2GS
    int64_t I;
    float dt_min, dt_max;
};

Dims dims_of(const SsdGeometry& g) {
    Dims d{};
    d.T = g.T;
    d.H = static_cast<int>(g.H);
    d.P = static_cast<int>(g.P);
    d.G = static_cast<int>(g.G);
    d.S = static_cast<int>(g.S);
    d.Q = static_cast<int>(g.Q);
    d.num_chunks = static_cast<int>((g.T + g.Q - 1) / g.Q);
    d.heads_per_group = static_cast<int>(g.H / g.G);
    d.I = g.H * g.P;
    d.ld = d.I + 2 * g.G * g.S;
    d.dt_min = g.dt_min;
    d.dt_max = g.dt_max;
    return d;
}

// Dynamic shared memory: the staging first (constant addresses), then a kernel's fp32 matrices.
size_t output_smem_bytes(const Dims& d) { return kStagingBytes + static_cast<size_t>(d.Q) * d.Q * sizeof(float); }
size_t backward_smem_bytes(const Dims& d) {
    return kStagingBytes + (2 * static_cast<size_t>(d.Q) * d.Q + static_cast<size_t>(d.Q) * d.P) * sizeof(float);
}
size_t align256(size_t n) { return (n + 255) / 256 * 256; }

int64_t chunks_total(const SsdGeometry& g) { return g.num_rows * ((g.T + g.Q - 1) / g.Q); }
size_t decay_bytes(const SsdGeometry& g) {
    return align256(static_cast<size_t>(chunks_total(g) * g.H) * sizeof(float));
}
// The backward's scratch besides the gradient states and the decay: wsum [B·chunks, G, Q, Q] and
// ends [B·chunks, H, 2, Q] (ChunkGradOut).
size_t wsum_bytes(const SsdGeometry& g) {
    return align256(static_cast<size_t>(chunks_total(g) * g.G * g.Q * g.Q) * sizeof(float));
}
size_t ends_bytes(const SsdGeometry& g) {
    return align256(static_cast<size_t>(chunks_total(g) * g.H * 2 * g.Q) * sizeof(float));
}

// ----------------------------------------------------------------------------------------------
// the tensor-core product

// Where a loader's source is contiguous: along k (k_fast) or along the row index, for the slices
// that start below k_switch, and k_fast_after for the rest (a product over two concatenated ranges
// of k, each with its own source). Only the staging's access order depends on it.
struct Layout {
    bool k_fast;
    int k_switch = INT_MAX;
    bool k_fast_after = false;
    __device__ bool at(int k0) const { return k0 < k_switch ? k_fast : k_fast_after; }
};
__device__ __forceinline__ Layout along_k() { return {true}; }
__device__ __forceinline__ Layout along_rows() { return {false}; }

// The staged slice of both operands (dynamic shared memory, kStagingBytes).
struct Staging {
    bf16 *a_hi, *a_lo, *b_hi, *b_lo;
};
__device__ Staging staging_at(void* smem) {
    bf16* base = static_cast<bf16*>(smem);
    return {base, base + kStagedElems, base + 2 * kStagedElems, base + 3 * kStagedElems};
}

// An operand read straight from a bf16 tensor rather than through a loader: element (r, k) at
// base[r·ld + k] (DirectK: contiguous along k, staged row-major like a loader's slice) or at
// base[k·ld + r] (DirectRows, B operands only: contiguous along the rows, staged k-major and read
// transposed by ldmatrix). Its slices go to shared memory by cp.async, 16 bytes a copy, double
// buffered in the operand's hi and lo buffers (a direct operand is exact: it has no lo part). A
// copy that would leave the operand's range (or any copy, when base is not 16-byte aligned or ld
// not a multiple of 8) is done element by element; elements past K are zeros, as a loader's.
struct DirectK {
    const bf16* base;
    int ld;
};
struct DirectRows {
    const bf16* base;
    int ld;
};
template <typename T>
constexpr bool kIsDirect = std::is_same_v<T, DirectK> || std::is_same_v<T, DirectRows>;
__device__ __forceinline__ float direct_value(const DirectRows& src, int r, int k) {
    return __bfloat162float(src.base[k * src.ld + r]);
}

// A B operand over two ranges of k: a DirectRows tensor for k < k_switch, then a loader (k >= k_switch,
// split with the product's kSplitB). The slices wholly below k_switch are staged as the direct
// operand's, the others through the loader (reading the direct range's elements one by one where a
// slice straddles k_switch). The direct slices come first, so none is copied into a buffer while a
// loader slice in it is still being read.
template <typename Load>
struct DirectThen {
    DirectRows direct;
    int k_switch;
    Load load;
};
template <typename T>
struct IsDirectThen : std::false_type {};
template <typename Load>
struct IsDirectThen<DirectThen<Load>> : std::true_type {};

__device__ __forceinline__ bool copies_aligned(const bf16* base, int ld) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && ld % 8 == 0;
}

// Rows [r0, r0 + rows) × k [k0, k0 + kTileK) of src into dst (one staging buffer), copies issued,
// not waited for. The 8 elements of a copy run along k (DirectK) or along the rows (DirectRows).
template <int kNumThreads, typename Src>
__device__ void stage_direct(const Src& src, int r0, int rows, int k0, int K, bf16* dst) {
    constexpr bool kAlongK = std::is_same_v<Src, DirectK>;
    constexpr int kCopies = kBlockRows * kTileK / 8;
    constexpr int kPerLine = kAlongK ? kTileK / 8 : kBlockRows / 8;  // copies along a staged line
    static_assert(kCopies % kNumThreads == 0, "whole copies a thread");
    const bool aligned = copies_aligned(src.base, src.ld);
#pragma unroll
    for (int i = 0; i < kCopies / kNumThreads; ++i) {
        const int idx = static_cast<int>(threadIdx.x) + i * kNumThreads;
        const int line = idx / kPerLine, at = 8 * (idx % kPerLine);
        // kAlongK: line = row r, elements k .. k + 7; else line = k, elements rows r .. r + 7.
        const int r = kAlongK ? line : at, k = k0 + (kAlongK ? at : line);
        bf16* to = dst + (kAlongK ? line * kTileStride : line * kTransStride) + at;
        const int first = kAlongK ? k : r;               // the run's first index along its direction
        const int limit = kAlongK ? K : rows;            // where that direction ends
        const bool inside = kAlongK ? r < rows : k < K;  // the run's other index is in range
        const bf16* from = src.base + (kAlongK ? (r0 + r) * src.ld + k : k * src.ld + r0 + r);
        if (inside && first + 8 <= limit && aligned) {
            cp_async_16(to, from, true);
        } else if (inside && first < limit) {
#pragma unroll
            for (int j = 0; j < 8; ++j) to[j] = first + j < limit ? from[j] : __float2bfloat16_rn(0.0f);
        } else {
            cp_async_16(to, src.base, false);  // zeros
        }
    }
}

// A slice of one operand, rows [r0, r0 + rows) × k [k0, k0 + kTileK), in flight in registers: thread
// threadIdx.x + i·kNumThreads holds value pair i (row r, k = k0 + 2kp, k0 + 2kp + 1; k >= K as zeros).
// Loading a slice and storing it are two steps so that all of a thread's loads are in flight at once
// and the next slice's loads overlap the current slice's mma.
template <int kNumThreads>
struct SliceRegs {
    static constexpr int kPairs = kTileK / 2;
    static constexpr int kIters = kBlockRows * kPairs / kNumThreads;
    static_assert(kBlockRows * kPairs % kNumThreads == 0, "a slice is a whole number of pairs a thread");
    float v[kIters][2];

    // The (row, pair) of this thread's i-th pair of the kBlockRows × kPairs slice: k_fast walks k
    // first, else the rows first (powers of two: shifts and masks).
    __device__ static void place(int i, bool k_fast, int& r, int& kp) {
        const int idx = static_cast<int>(threadIdx.x) + i * kNumThreads;
        r = k_fast ? idx / kPairs : idx % kBlockRows;
        kp = k_fast ? idx % kPairs : idx / kBlockRows;
    }
    template <typename Load>
    __device__ void load(int r0, int rows, int k0, int K, bool k_fast, Load load_value) {
#pragma unroll
        for (int i = 0; i < kIters; ++i) {
            int r, kp;
            place(i, k_fast, r, kp);
            const int k = k0 + 2 * kp;
            const bool in = r < rows;
            v[i][0] = in && k < K ? load_value(r0 + r, k) : 0.0f;
            v[i][1] = in && k + 1 < K ? load_value(r0 + r, k + 1) : 0.0f;
        }
    }
    // Into hi (and lo = the rounding rest when kSplit). Rows past `rows` keep stale values: they only
    // feed outputs that are never emitted.
    template <bool kSplit>
    __device__ void store(bf16* hi, bf16* lo, int rows, bool k_fast) const {
#pragma unroll
        for (int i = 0; i < kIters; ++i) {
            int r, kp;
            place(i, k_fast, r, kp);
            if (r >= rows) continue;
            const __nv_bfloat162 h = __floats2bfloat162_rn(v[i][0], v[i][1]);
            *reinterpret_cast<__nv_bfloat162*>(hi + r * kTileStride + 2 * kp) = h;
            if constexpr (kSplit) {
                *reinterpret_cast<__nv_bfloat162*>(lo + r * kTileStride + 2 * kp) =
                    __floats2bfloat162_rn(v[i][0] - __low2float(h), v[i][1] - __high2float(h));
            }
        }
    }
};

// One warp tile's accumulators: 2 × 4 mma tiles of 16 × 8, 4 floats a lane each.
struct WarpAcc {
    float v[2][4][4];
};

// acc += the staged slice's contribution to the warp tile at (row tm, column tn) of the block:
// kTileK / 16 steps of (A hi·B hi [+ A lo·B hi] [+ A hi·B lo]). A is staged row-major, B row-major
// too or, with kTransB, k-major (a DirectRows operand).
template <bool kSplitA, bool kSplitB, bool kTransB>
__device__ void mma_slice(WarpAcc& acc, const bf16* a_hi_tile, const bf16* a_lo_tile, const bf16* b_hi_tile,
                          const bf16* b_lo_tile, int tm, int tn) {
    static_assert(!(kTransB && kSplitB), "a k-major operand is a direct one: exact");
    const int lane = threadIdx.x % 32;
    // ldmatrix row addresses: A matrices (rows 0-7 | 8-15) × (k 0-7 | 8-15); B (k 0-7 | 8-15) × (n 0-7 | 8-15).
    const int a_row = tm * kWarpTile + lane % 8 + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);
    const int b_row = tn * kWarpTile + lane % 8 + 8 * (lane / 16), b_col = 8 * ((lane / 8) % 2);
    // k-major B: the matrices' rows are k (0-7 | 8-15), their columns n (0-7 | 8-15), read transposed.
    const int bt_k = lane % 8 + 8 * ((lane / 8) % 2), bt_n = tn * kWarpTile + 8 * (lane / 16);
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
        uint32_t a_hi[2][4], a_lo[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
            const int at = (a_row + 16 * mi) * kTileStride + kk + a_col;
            ldmatrix_x4(a_hi[mi], a_hi_tile + at);
            if constexpr (kSplitA) ldmatrix_x4(a_lo[mi], a_lo_tile + at);
        }
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
            // b[0], b[1]: the n8 tile 2·nb (k 0-7, 8-15); b[2], b[3]: the tile 2·nb + 1.
            uint32_t b_hi[4], b_lo[4];
            if constexpr (kTransB) {
                ldmatrix_x4_trans(b_hi, b_hi_tile + (kk + bt_k) * kTransStride + bt_n + 16 * nb);
            } else {
                const int at = (b_row + 16 * nb) * kTileStride + kk + b_col;
                ldmatrix_x4(b_hi, b_hi_tile + at);
                if constexpr (kSplitB) ldmatrix_x4(b_lo, b_lo_tile + at);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float(&d)[4] = acc.v[mi][2 * nb + half];
                    mma_bf16(d, a_hi[mi], b_hi[2 * half], b_hi[2 * half + 1]);
                    if constexpr (kSplitA) mma_bf16(d, a_lo[mi], b_hi[2 * half], b_hi[2 * half + 1]);
                    if constexpr (kSplitB) mma_bf16(d, a_hi[mi], b_lo[2 * half], b_lo[2 * half + 1]);
                }
            }
        }
    }
}

// f(mi, ni, e, i, j) for each of a lane's 32 accumulators of the warp tile whose lane-0 element is
// (i0, j0): WarpAcc::v[mi][ni][e] holds output (i, j).
template <typename F>
__device__ __forceinline__ void for_lane_elements(int i0, int j0, F f) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
            for (int e = 0; e < 4; ++e) f(mi, ni, e, i0 + 16 * mi + 8 * (e / 2), j0 + 8 * ni + e % 2);
        }
    }
}

// For every i < M, j < N: emit(i, j, Σ_{k<K} a(i, k)·b(j, k), prior(i, j)), called once, by one thread.
// a(i, k) and b(j, k) are floats (exact bf16 values unless kSplitA / kSplitB: then split into hi + lo).
// With kLowerTriangle, warp tiles wholly above the diagonal (every j > i) are not multiplied and emit 0.
// An operand may instead be a DirectK / DirectRows tensor (not split; its Layout is not used).
// The sum is fp32 in the mma's fixed order over slices of k ascending. prior reads what an element's
// emit combines with (a value it updates, a term it adds): a thread reads all of its tile's priors
// before its first emit, so the reads are in flight together, rather than each waiting behind the
// store before it (which the compiler cannot prove it does not alias). Barriers at entry and exit
// (emit may write shared memory the caller reads next; the loaders may read what it wrote before);
// blockDim.x must be kNumThreads.
template <int kNumThreads, bool kSplitA, bool kSplitB, bool kLowerTriangle, typename LoadA, typename LoadB,
          typename Prior, typename Emit>
__device__ void mma_product_prior(int M, int N, int K, Layout layout_a, Layout layout_b, LoadA load_a, LoadB load_b,
                                  Prior prior, Emit emit, const Staging& st) {
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kTilesPerWarp = (kTilesPerSide * kTilesPerSide + kNumWarps - 1) / kNumWarps;
    constexpr bool kDirectA = kIsDirect<LoadA>, kDirectB = kIsDirect<LoadB>, kThenB = IsDirectThen<LoadB>::value;
    constexpr bool kTransB = std::is_same_v<LoadB, DirectRows>;
    static_assert(!std::is_same_v<LoadA, DirectRows>, "A operands are staged row-major");
    static_assert(!IsDirectThen<LoadA>::value, "DirectThen: B operands only");
    static_assert(!(kDirectA && kSplitA) && !(kDirectB && kSplitB), "a direct operand is exact bf16");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
#pragma unroll 1
    for (int m0 = 0; m0 < M; m0 += kBlockRows) {
#pragma unroll 1
        for (int n0 = 0; n0 < N; n0 += kBlockRows) {
            const int rows_m = min(kBlockRows, M - m0), rows_n = min(kBlockRows, N - n0);
            const int tiles_n = (rows_n + kWarpTile - 1) / kWarpTile;
            const int num_tiles = (rows_m + kWarpTile - 1) / kWarpTile * tiles_n;
            WarpAcc acc[kTilesPerWarp];
            bool active[kTilesPerWarp];
#pragma unroll
            for (int w = 0; w < kTilesPerWarp; ++w) {
                const int tile = warp + w * kNumWarps, tm = tile / tiles_n, tn = tile % tiles_n;
                active[w] =
                    tile < num_tiles && !(kLowerTriangle && n0 + tn * kWarpTile > m0 + tm * kWarpTile + kWarpTile - 1);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[w].v[mi][ni][e] = 0.0f;
            }
            // A loader operand's next slice waits in registers, a direct one's in its other buffer.
            SliceRegs<kNumThreads> next_a, next_b;
            auto fetch = [&](int k0, int buffer) {
                if constexpr (kDirectA) {
                    stage_direct<kNumThreads>(load_a, m0, rows_m, k0, K, buffer == 0 ? st.a_hi : st.a_lo);
                } else {
                    next_a.load(m0, rows_m, k0, K, layout_a.at(k0), load_a);
                }
                if constexpr (kDirectB) {
                    stage_direct<kNumThreads>(load_b, n0, rows_n, k0, K, buffer == 0 ? st.b_hi : st.b_lo);
                } else if constexpr (kThenB) {
                    if (k0 + kTileK <= load_b.k_switch) {
                        stage_direct<kNumThreads>(load_b.direct, n0, rows_n, k0, K, buffer == 0 ? st.b_hi : st.b_lo);
                    } else {
                        next_b.load(n0, rows_n, k0, K, layout_b.at(k0), [&](int r, int k) {
                            return k < load_b.k_switch ? direct_value(load_b.direct, r, k) : load_b.load(r, k);
                        });
                    }
                } else {
                    next_b.load(n0, rows_n, k0, K, layout_b.at(k0), load_b);
                }
                if constexpr (kDirectA || kDirectB || kThenB) cp_async_commit();
            };
            if (K > 0) fetch(0, 0);
#pragma unroll 1
            for (int k0 = 0, buffer = 0; k0 < K; k0 += kTileK, buffer ^= 1) {
                if constexpr (!kDirectA) next_a.template store<kSplitA>(st.a_hi, st.a_lo, rows_m, layout_a.at(k0));
                bool b_direct = kDirectB;  // this slice of B staged as a direct operand's
                if constexpr (kThenB) b_direct = k0 + kTileK <= load_b.k_switch;
                if constexpr (!kDirectB) {
                    if (!b_direct) next_b.template store<kSplitB>(st.b_hi, st.b_lo, rows_n, layout_b.at(k0));
                }
                if constexpr (kDirectA || kDirectB || kThenB) cp_async_wait<0>();
                __syncthreads();
                if (k0 + kTileK < K) fetch(k0 + kTileK, buffer ^ 1);
                const bf16* a_hi = kDirectA && buffer == 1 ? st.a_lo : st.a_hi;
                const bf16* b_hi = b_direct && buffer == 1 ? st.b_lo : st.b_hi;
#pragma unroll
                for (int w = 0; w < kTilesPerWarp; ++w) {
                    const int tile = warp + w * kNumWarps;
                    if (!active[w]) continue;
                    if constexpr (kThenB) {
                        if (b_direct) {  // (its direct range is staged k-major)
                            mma_slice<kSplitA, false, true>(acc[w], a_hi, st.a_lo, b_hi, st.b_lo, tile / tiles_n,
                                                            tile % tiles_n);
                        } else {
                            mma_slice<kSplitA, kSplitB, false>(acc[w], a_hi, st.a_lo, b_hi, st.b_lo, tile / tiles_n,
                                                               tile % tiles_n);
                        }
                    } else {
                        mma_slice<kSplitA, kSplitB, kTransB>(acc[w], a_hi, st.a_lo, b_hi, st.b_lo, tile / tiles_n,
                                                             tile % tiles_n);
                    }
                }
                __syncthreads();
            }
#pragma unroll
            for (int w = 0; w < kTilesPerWarp; ++w) {
                const int tile = warp + w * kNumWarps;
                if (tile >= num_tiles) continue;
                const int i0 = m0 + (tile / tiles_n) * kWarpTile + lane / 4;
                const int j0 = n0 + (tile % tiles_n) * kWarpTile + 2 * (lane % 4);
                float before[2][4][4];
                for_lane_elements(i0, j0, [&](int mi, int ni, int e, int i, int j) {
                    before[mi][ni][e] = i < M && j < N ? prior(i, j) : 0.0f;
                });
                for_lane_elements(i0, j0, [&](int mi, int ni, int e, int i, int j) {
                    if (i < M && j < N) emit(i, j, acc[w].v[mi][ni][e], before[mi][ni][e]);
                });
            }
        }
    }
    __syncthreads();
}

// mma_product_prior with nothing to combine: emit(i, j, value).
struct NoPrior {
    __device__ float operator()(int, int) const { return 0.0f; }
};
template <int kNumThreads, bool kSplitA, bool kSplitB, bool kLowerTriangle, typename LoadA, typename LoadB,
          typename Emit>
__device__ void mma_product(int M, int N, int K, Layout layout_a, Layout layout_b, LoadA load_a, LoadB load_b,
                            Emit emit, const Staging& st) {
    mma_product_prior<kNumThreads, kSplitA, kSplitB, kLowerTriangle>(
        M, N, K, layout_a, layout_b, load_a, load_b, NoPrior{},
        [&](int i, int j, float value, float) { emit(i, j, value); }, st);
}

// ----------------------------------------------------------------------------------------------
// device helpers

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Per-token quantities of one (row, chunk, head), in shared memory.
struct ChunkMeta {
    float cs[kMaxQ];   // Σ_{u<=t} δ_u·A
    float dtv[kMaxQ];  // δ_t
    float dsp[kMaxQ];  // dδ/d(raw dt): sigmoid(dt + dt_bias) where the clamp passes, else 0
    int seg[kMaxQ];    // segment starts among tokens 0..t of the chunk
};

__device__ __forceinline__ bool starts_segment(const int32_t* doc_ids, int64_t n, int64_t T) {
    return n % T == 0 || (doc_ids != nullptr && doc_ids[n] != doc_ids[n - 1]);
}

// cs and seg of tokens [0, L) turned into inclusive prefix sums by warp 0, in a fixed order: each lane
// sums kMaxQ / 32 consecutive tokens, a shuffle scan adds the lanes before it.
__device__ void prefix_sums(ChunkMeta& m, int L) {
    constexpr int kPerLane = kMaxQ / 32;
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    float cs[kPerLane];
    int seg[kPerLane];
    float cs_sum = 0.0f;
    int seg_sum = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int t = lane * kPerLane + i;
        cs_sum += t < L ? m.cs[t] : 0.0f;
        seg_sum += t < L ? m.seg[t] : 0;
        cs[i] = cs_sum;
        seg[i] = seg_sum;
    }
    float cs_incl = cs_sum;
    int seg_incl = seg_sum;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float c = __shfl_up_sync(detail::kFullMask, cs_incl, offset);
        const int s = __shfl_up_sync(detail::kFullMask, seg_incl, offset);
        if (lane >= offset) cs_incl += c, seg_incl += s;
    }
    const float cs_before = __shfl_up_sync(detail::kFullMask, cs_incl, 1);
    const int seg_before = __shfl_up_sync(detail::kFullMask, seg_incl, 1);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int t = lane * kPerLane + i;
        if (t >= L) continue;
        m.cs[t] = lane > 0 ? cs_before + cs[i] : cs[i];
        m.seg[t] = lane > 0 ? seg_before + seg[i] : seg[i];
    }
}

// Fills meta for tokens [row0, row0 + L) and head h (ends with a barrier).
__device__ void load_chunk_meta(ChunkMeta& m, const bf16* dt, const SsdParams& params, const int32_t* doc_ids,
                                const Dims& d, int64_t row0, int L, int h) {
    const float A = -expf(params.A_log[h]);
    const float bias = params.dt_bias[h];
    __syncthreads();  // earlier readers of meta are done
    for (int t = threadIdx.x; t < L; t += blockDim.x) {
        const int64_t n = row0 + t;
        const float raw = __bfloat162float(dt[n * d.H + h]) + bias;
        const float sp = raw > 20.0f ? raw : log1pf(expf(raw));  // torch softplus (threshold 20)
        const float dtv = fminf(fmaxf(sp, d.dt_min), d.dt_max);
        m.dtv[t] = dtv;
        m.dsp[t] = (sp >= d.dt_min && sp <= d.dt_max) ? sigmoid(raw) : 0.0f;
        m.cs[t] = dtv * A;
        m.seg[t] = starts_segment(doc_ids, n, d.T) ? 1 : 0;
    }
    __syncthreads();
    prefix_sums(m, L);
    __syncthreads();
}

__device__ __forceinline__ bool same_segment_causal(const ChunkMeta& m, int t, int s) {
    return s <= t && m.seg[s] == m.seg[t];
}
// exp(cs_last − cs_s) if s is in the chunk's last segment, else 0.
__device__ __forceinline__ float decay_to_end(const ChunkMeta& m, int s, int L) {
    return m.seg[s] == m.seg[L - 1] ? expf(m.cs[L - 1] - m.cs[s]) : 0.0f;
}
// exp(cs_t) if t still sees the state entering the chunk, else 0.
__device__ __forceinline__ float decay_from_start(const ChunkMeta& m, int t) {
    return m.seg[t] == 0 ? expf(m.cs[t]) : 0.0f;
}

// out[r] = Σ_{j<cols} term(r, j) for r < rows (kCausal: only j <= r, the terms past it being zeros):
// a warp takes kRows rows at a time, lanes over j (each lane its j ascending), then a xor butterfly
// (fixed order). A lane evaluates kRows × kCols terms before it adds them, so the loads a term makes
// are in flight together. Barrier at exit.
template <bool kCausal = false, typename Term>
__device__ void row_sums(float* out, int rows, int cols, Term term) {
    constexpr int kRows = 4, kCols = 2;
    const int lane = threadIdx.x % 32, warps = static_cast<int>(blockDim.x / 32);
    for (int r0 = static_cast<int>(threadIdx.x / 32) * kRows; r0 < rows; r0 += warps * kRows) {
        float sum[kRows] = {};
        const int end = kCausal ? min(cols, r0 + kRows) : cols;
        for (int j0 = 0; j0 < end; j0 += 32 * kCols) {
            float terms[kRows][kCols];
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
#pragma unroll
                for (int q = 0; q < kCols; ++q) {
                    const int r = r0 + i, j = j0 + lane + 32 * q;
                    terms[i][q] = r < rows && j < (kCausal ? min(cols, r + 1) : cols) ? term(r, j) : 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
#pragma unroll
                for (int q = 0; q < kCols; ++q) sum[i] += terms[i][q];
            }
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const float total = detail::group_sum<32>(sum[i]);
            if (lane == 0 && r0 + i < rows) out[r0 + i] = total;
        }
    }
    __syncthreads();
}

// Σ v over the block, the same bits in every thread. slots: kMaxWarps floats of shared memory.
__device__ float block_sum(float v, float* slots) {
    v = detail::group_sum<32>(v);
    __syncthreads();
    if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += slots[w];
    return total;
}

// One chunk's operands in the token-major buffers, from base pointers at its first token (32-bit
// offsets inside the chunk: Q·ld fits an int, checked at launch).
struct Views {
    const bf16 *x0, *B0, *C0;
    int ld;
    __device__ Views(const bf16* xbc, const Dims& d, int64_t row0, int h, int g)
        : x0(xbc + row0 * d.ld + static_cast<int64_t>(h) * d.P),
          B0(xbc + row0 * d.ld + d.I + static_cast<int64_t>(g) * d.S),
          C0(xbc + row0 * d.ld + d.I + static_cast<int64_t>(d.G + g) * d.S),
          ld(static_cast<int>(d.ld)) {}
    __device__ float x(int t, int p) const { return __bfloat162float(x0[t * ld + p]); }
    __device__ float C(int t, int n) const { return __bfloat162float(C0[t * ld + n]); }
};
// A chunk's rows of a head in a [N, H·P] buffer (dy, y).
struct HeadRows {
    const bf16* at;
    int ld;
    __device__ HeadRows(const bf16* base, const Dims& d, int64_t row0, int h)
        : at(base + row0 * d.I + static_cast<int64_t>(h) * d.P), ld(static_cast<int>(d.I)) {}
    __device__ float operator()(int t, int p) const { return __bfloat162float(at[t * ld + p]); }
};

__device__ __forceinline__ int64_t state_offset(const Dims& d, int b, int c, int h) {
    return ((static_cast<int64_t>(b) * d.num_chunks + c) * d.H + h) * d.P * d.S;
}

// ----------------------------------------------------------------------------------------------
// forward kernels

// grid (chunks, H, B). states[b, c, h] = the chunk's end state from a zero entering state;
// decay[b, c, h] = [seg_last = 0]·exp(cs_last).
__global__ void __launch_bounds__(kThreads, 2)
    ssd_chunk_state_kernel(float* states, float* decay, const bf16* xbc, const bf16* dt, SsdParams params,
                           const int32_t* doc_ids, Dims d) {
    __shared__ ChunkMeta meta;
    __shared__ float coef[kMaxQ];
    extern __shared__ __align__(16) unsigned char smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int64_t row0 = b * d.T + static_cast<int64_t>(c) * d.Q;
    const int L = static_cast<int>(std::min<int64_t>(d.Q, d.T - static_cast<int64_t>(c) * d.Q));
    const Views v{xbc, d, row0, h, h / d.heads_per_group};
    load_chunk_meta(meta, dt, params, doc_ids, d, row0, L, h);
    for (int s = threadIdx.x; s < L; s += blockDim.x) coef[s] = decay_to_end(meta, s, L) * meta.dtv[s];
    // states[p, n] = Σ_s coef_s·x_s[p] · B_s[n]
    float* out = states + state_offset(d, b, c, h);
    mma_product<kThreads, true, false, false>(
        d.P, d.S, L, along_rows(), along_rows(), [&](int p, int s) { return coef[s] * v.x(s, p); },
        DirectRows{v.B0, v.ld}, [&](int p, int n, float value) { out[p * d.S + n] = value; }, staging_at(smem));
    if (threadIdx.x == 0) decay[(static_cast<int64_t>(b) * d.num_chunks + c) * d.H + h] = decay_from_start(meta, L - 1);
}

// grid (ceil(P·S / kPassThreads), H, B): states turned in place from each chunk's local end state
// into the state entering it: h_0 = 0, h_{c+1} = decay_c·h_c + local_c. The loads of a batch of
// chunks go out before the first is used.
__global__ void __launch_bounds__(kPassThreads) ssd_state_pass_kernel(float* states, const float* decay, Dims d) {
    const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= static_cast<int64_t>(d.P) * d.S) return;
    const int h = blockIdx.y, b = blockIdx.z;
    float state = 0.0f;
    for (int c0 = 0; c0 < d.num_chunks; c0 += kPassBatch) {
        float local[kPassBatch], dec[kPassBatch];
#pragma unroll
        for (int i = 0; i < kPassBatch; ++i) {
            const int c = min(c0 + i, d.num_chunks - 1);
            local[i] = states[state_offset(d, b, c, h) + e];
            dec[i] = decay[(static_cast<int64_t>(b) * d.num_chunks + c) * d.H + h];
        }
#pragma unroll
        for (int i = 0; i < kPassBatch; ++i) {
            if (c0 + i >= d.num_chunks) break;
            states[state_offset(d, b, c0 + i, h) + e] = state;
            state = dec[i] * state + local[i];
        }
    }
}

// grid (chunks, H, B), kWideThreads. Dynamic shared memory: the staging, then M [Q, Q] fp32.
__global__ void __launch_bounds__(kWideThreads, 1)
    ssd_chunk_output_kernel(bf16* y, const float* states, const bf16* xbc, const bf16* dt, SsdParams params,
                            const int32_t* doc_ids, Dims d) {
    __shared__ ChunkMeta meta;
    __shared__ float coef[kMaxQ];
    extern __shared__ __align__(16) unsigned char smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int64_t row0 = b * d.T + static_cast<int64_t>(c) * d.Q;
    const int L = static_cast<int>(std::min<int64_t>(d.Q, d.T - static_cast<int64_t>(c) * d.Q));
    const Views v{xbc, d, row0, h, h / d.heads_per_group};
    const Staging st = staging_at(smem);
    float* M = reinterpret_cast<float*>(smem + kStagingBytes);
    load_chunk_meta(meta, dt, params, doc_ids, d, row0, L, h);
    for (int t = threadIdx.x; t < L; t += blockDim.x) coef[t] = decay_from_start(meta, t);

    // M[t, s] = (C_t·B_s)·exp(cs_t − cs_s)·δ_s inside a segment, s <= t; else 0.
    mma_product<kWideThreads, false, false, true>(
        L, L, d.S, along_k(), along_k(), DirectK{v.C0, v.ld}, DirectK{v.B0, v.ld},
        [&](int t, int s, float cb) {
            M[t * d.Q + s] = same_segment_causal(meta, t, s) ? cb * expf(meta.cs[t] - meta.cs[s]) * meta.dtv[s] : 0.0f;
        },
        st);
    // y_t = Σ_s M[t, s]·x_s + coef_t·C_t·h_in + D·x_t: one product over k = [s of the chunk | n of the
    // state] (the second range only past chunk 0: the state entering chunk 0 is zero).
    const float* h_in = states + state_offset(d, b, c, h);
    const int K = c > 0 ? L + d.S : L;
    const float D = params.D[h];
    bf16* y0 = y + row0 * d.I + static_cast<int64_t>(h) * d.P;
    const int ld_y = static_cast<int>(d.I);
    mma_product_prior<kWideThreads, true, true, false>(
        L, d.P, K, along_k(), Layout{false, L, true},
        [&](int t, int k) { return k < L ? M[t * d.Q + k] : coef[t] * v.C(t, k - L); },
        DirectThen{DirectRows{v.x0, v.ld}, L, [&](int p, int k) { return h_in[p * d.S + (k - L)]; }},
        [&](int t, int p) { return D * v.x(t, p); },
        [&](int t, int p, float value, float dx_term) { y0[t * ld_y + p] = __float2bfloat16_rn(value + dx_term); }, st);
}

// ----------------------------------------------------------------------------------------------
// backward kernels

// grid (chunks, H, B). dstates[b, c, h][p, n] = Σ_t [seg_t = 0]·exp(cs_t)·dy_t[p]·C_t[n] (the gradient at
// the state entering the chunk from the chunk's own outputs); decay as in the forward.
__global__ void __launch_bounds__(kThreads, 2)
    ssd_chunk_dstate_kernel(float* dstates, float* decay, const bf16* dy, const bf16* xbc, const bf16* dt,
                            SsdParams params, const int32_t* doc_ids, Dims d) {
    __shared__ ChunkMeta meta;
    __shared__ float coef[kMaxQ];
    extern __shared__ __align__(16) unsigned char smem[];
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int64_t row0 = b * d.T + static_cast<int64_t>(c) * d.Q;
    const int L = static_cast<int>(std::min<int64_t>(d.Q, d.T - static_cast<int64_t>(c) * d.Q));
    const Views v{xbc, d, row0, h, h / d.heads_per_group};
    load_chunk_meta(meta, dt, params, doc_ids, d, row0, L, h);
    for (int t = threadIdx.x; t < L; t += blockDim.x) coef[t] = decay_from_start(meta, t);
    const HeadRows dyv(dy, d, row0, h);
    float* out = dstates + state_offset(d, b, c, h);
    mma_product<kThreads, true, false, false>(
        d.P, d.S, L, along_rows(), along_rows(), [&](int p, int t) { return coef[t] * dyv(t, p); },
        DirectRows{v.C0, v.ld}, [&](int p, int n, float value) { out[p * d.S + n] = value; }, staging_at(smem));
    if (threadIdx.x == 0) decay[(static_cast<int64_t>(b) * d.num_chunks + c) * d.H + h] = decay_from_start(meta, L - 1);
}

// grid (ceil(P·S / kPassThreads), H, B): dstates turned in place into dh_out, the gradient at each
// chunk's end state: dh_out_{last} = 0, dh_out_{c−1} = own_c + decay_c·dh_out_c.
__global__ void __launch_bounds__(kPassThreads) ssd_dstate_pass_kernel(float* dstates, const float* decay, Dims d) {
    const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= static_cast<int64_t>(d.P) * d.S) return;
    const int h = blockIdx.y, b = blockIdx.z;
    float grad = 0.0f;
    for (int c0 = d.num_chunks - 1; c0 >= 0; c0 -= kPassBatch) {
        float own[kPassBatch], dec[kPassBatch];
#pragma unroll
        for (int i = 0; i < kPassBatch; ++i) {
            const int c = max(c0 - i, 0);
            own[i] = dstates[state_offset(d, b, c, h) + e];
            dec[i] = decay[(static_cast<int64_t>(b) * d.num_chunks + c) * d.H + h];
        }
#pragma unroll
        for (int i = 0; i < kPassBatch; ++i) {
            if (c0 - i < 0) break;
            dstates[state_offset(d, b, c0 - i, h) + e] = grad;
            grad = own[i] + dec[i] * grad;
        }
    }
}

// What the backward chunk kernel writes, and its scratch.
struct ChunkGradOut {
    bf16* dxbc;      // dx, dB and dC columns written
    bf16* ddt;       // [N, H] written
    float* wsum;     // [B·chunks, G, Q, Q] f32 scratch: Σ over the group's heads of W ∘ exp(cs_t − cs_s) ∘ δ_s
    float* ends;     // [B·chunks, H, 2, Q] f32 scratch: each head's to_end and from_start
    float* partial;  // [3, B·chunks, H]: Σ ddt, A·Σ da·δ (dA_log), Σ dy·x (dD) per chunk
};

// Per-token sums of one head's chunk, in shared memory.
struct HeadSums {
    float row_g[kMaxQ];   // Σ_s G[t, s], G = (dy_t·x_s)(C_t·B_s)·exp(cs_t − cs_s)·δ_s (masked)
    float col_h[kMaxQ];   // Σ_t G[t, s] / δ_s: the intra part of dδ_s
    float diag[kMaxQ];    // dy_t·x_t
    float v[kMaxQ];       // x_s · (dh_out·B_s)
    float u[kMaxQ];       // dy_t · (h_in·C_t)
    float to_end[kMaxQ];  // exp(cs_last − cs_s)·δ_s in the last segment, else 0
    float from_start[kMaxQ];
    float col_part[kColParts][kMaxQ];  // col_h's parts
};

// The scalar chain of one head's chunk, by warp 0 (lane l owns tokens 4l .. 4l + 3): dcs, its reverse
// cumsum da, dδ, ddt at the raw dt (written) and the chunk's parameter-gradient partial sums (lane 0
// writes them). Fixed order: each lane's tokens in sequence, then shuffles in a fixed pattern.
__device__ void finish_head(const ChunkMeta& m, const HeadSums& hs, float hh, float A, int L, int64_t row0, int h,
                            int64_t chunk_idx, int64_t num_chunks_total, const Dims& d, const ChunkGradOut& out) {
    constexpr int kPerLane = kMaxQ / 32;
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x, last = L - 1;
    float w = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int t = lane * kPerLane + i;
        if (t < L) w += hs.to_end[t] * hs.v[t];
    }
    const float sum_w = detail::group_sum<32>(w);
    // dcs_t, and within the lane the reverse inclusive sums of its tokens.
    float rev[kPerLane];
    float lane_total = 0.0f;
#pragma unroll
    for (int i = kPerLane - 1; i >= 0; --i) {
        const int t = lane * kPerLane + i;
        float dcs = 0.0f;
        if (t < L) {
            dcs = hs.row_g[t] - m.dtv[t] * hs.col_h[t] - hs.to_end[t] * hs.v[t] + hs.from_start[t] * hs.u[t];
            if (t == last) dcs += sum_w + (m.seg[last] == 0 ? expf(m.cs[last]) * hh : 0.0f);
        }
        lane_total += dcs;
        rev[i] = lane_total;
    }
    // Σ over the lanes after this one: an inclusive suffix scan, shifted by one lane.
    float suffix = lane_total;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float other = __shfl_down_sync(detail::kFullMask, suffix, offset);
        if (lane + offset < 32) suffix += other;
    }
    float after = __shfl_down_sync(detail::kFullMask, suffix, 1);
    if (lane == 31) after = 0.0f;
    float sum_ddt = 0.0f, sum_da_dt = 0.0f, sum_diag = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int t = lane * kPerLane + i;
        if (t >= L) continue;
        const float da = after + rev[i];
        const float e_t = m.seg[t] == m.seg[last] ? expf(m.cs[last] - m.cs[t]) : 0.0f;
        const float d_dtv = hs.col_h[t] + e_t * hs.v[t] + A * da;
        const float d_raw = d_dtv * m.dsp[t];
        out.ddt[(row0 + t) * d.H + h] = __float2bfloat16_rn(d_raw);
        sum_ddt += d_raw;
        sum_da_dt += da * m.dtv[t];
        sum_diag += hs.diag[t];
    }
    sum_ddt = detail::group_sum<32>(sum_ddt);
    sum_da_dt = detail::group_sum<32>(sum_da_dt);
    sum_diag = detail::group_sum<32>(sum_diag);
    if (lane != 0) return;
    const int64_t slot = chunk_idx * d.H + h;
    out.partial[slot] = sum_ddt;
    out.partial[num_chunks_total * d.H + slot] = A * sum_da_dt;  // dA/dA_log = A
    out.partial[2 * num_chunks_total * d.H + slot] = sum_diag;
}

// grid (chunks, G, B), kWideThreads. Dynamic shared memory: the staging, then CB [Q, Q] (the group's
// C·Bᵀ, masked), W [Q, Q], ACC [Q, P] fp32. dstates: dh_out per chunk (ssd_dstate_pass_kernel).
// The heads in order: each head's dx, ddt and parameter partials, and its share of dB and dC's
// weights added into wsum; then dB and dC of the group, each one product over all its heads.
__global__ void __launch_bounds__(kWideThreads, 1)
    ssd_chunk_backward_kernel(ChunkGradOut out, const bf16* dy, const bf16* xbc, const bf16* dt, SsdParams params,
                              const float* states, const float* dstates, const int32_t* doc_ids, Dims d) {
    constexpr int kN = kWideThreads;
    __shared__ ChunkMeta meta;
    __shared__ HeadSums hs;
    __shared__ float slots[kMaxWarps];
    extern __shared__ __align__(16) unsigned char smem[];
    const int c = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
    const int64_t row0 = b * d.T + static_cast<int64_t>(c) * d.Q;
    const int L = static_cast<int>(std::min<int64_t>(d.Q, d.T - static_cast<int64_t>(c) * d.Q));
    const int64_t chunk_idx = static_cast<int64_t>(b) * d.num_chunks + c;
    const Staging st = staging_at(smem);
    float* wsum = out.wsum + (chunk_idx * d.G + g) * d.Q * d.Q;
    float* CB = reinterpret_cast<float*>(smem + kStagingBytes);
    float* W = CB + d.Q * d.Q;
    float* ACC = W + d.Q * d.Q;
    const Views gv{xbc, d, row0, g * d.heads_per_group, g};  // B and C of the group

    // The segments do not depend on the head: the first head's meta masks C·Bᵀ.
    load_chunk_meta(meta, dt, params, doc_ids, d, row0, L, g * d.heads_per_group);
    mma_product<kN, false, false, true>(
        L, L, d.S, along_k(), along_k(), DirectK{gv.C0, gv.ld}, DirectK{gv.B0, gv.ld},
        [&](int t, int s, float value) { CB[t * d.Q + s] = same_segment_causal(meta, t, s) ? value : 0.0f; }, st);

    for (int k = 0; k < d.heads_per_group; ++k) {
        const int h = g * d.heads_per_group + k;
        if (k > 0) load_chunk_meta(meta, dt, params, doc_ids, d, row0, L, h);
        const Views v{xbc, d, row0, h, g};
        const HeadRows dyv(dy, d, row0, h);
        bf16* dx0 = out.dxbc + row0 * d.ld + static_cast<int64_t>(h) * d.P;
        const float* h_in = c > 0 ? states + state_offset(d, b, c, h) : nullptr;
        const float* dh_out = c + 1 < d.num_chunks ? dstates + state_offset(d, b, c, h) : nullptr;
        const float A = -expf(params.A_log[h]);
        const float D = params.D[h];
        const int last = L - 1;

        // W[t, s] = dy_t·x_s (masked), then the row and column sums of G and the diagonal.
        mma_product<kN, false, false, true>(
            L, L, d.P, along_k(), along_k(), DirectK{dyv.at, dyv.ld}, DirectK{v.x0, v.ld},
            [&](int t, int s, float value) { W[t * d.Q + s] = same_segment_causal(meta, t, s) ? value : 0.0f; }, st);
        auto g_over_dt = [&](int t, int s) {
            return same_segment_causal(meta, t, s) ? W[t * d.Q + s] * CB[t * d.Q + s] * expf(meta.cs[t] - meta.cs[s])
                                                   : 0.0f;
        };
        row_sums<true>(hs.row_g, L, L, [&](int t, int s) { return g_over_dt(t, s) * meta.dtv[s]; });
        // col_h in kColParts interleaved parts of t, added in part order.
        for (int e = threadIdx.x; e < kColParts * L; e += blockDim.x) {
            const int part = e / L, s = e % L;
            float sum = 0.0f;
            for (int t = s + part; t < L; t += kColParts) sum += g_over_dt(t, s);
            hs.col_part[part][s] = sum;
        }
        __syncthreads();
        float* ends = out.ends + (chunk_idx * d.H + h) * 2 * d.Q;
        for (int s = threadIdx.x; s < L; s += blockDim.x) {
            float sum = 0.0f;
            for (int part = 0; part < kColParts; ++part) sum += hs.col_part[part][s];
            hs.col_h[s] = sum;
            hs.diag[s] = W[s * d.Q + s];
            hs.to_end[s] = decay_to_end(meta, s, L) * meta.dtv[s];
            hs.from_start[s] = decay_from_start(meta, s);
            ends[s] = hs.to_end[s];
            ends[d.Q + s] = hs.from_start[s];
        }
        __syncthreads();
        // wsum (+)= W ∘ exp(cs_t − cs_s) ∘ δ_s over s <= t (dB and dC's intra weights; L2-resident
        // scratch, each element kept by one thread, the heads added in order): two rows a warp, the
        // earlier heads' sums all loaded before the first is stored.
        {
            constexpr int kPerRow = kMaxQ / 32;
            const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
            const bool first_head = k == 0;
            for (int t0 = 2 * warp; t0 < L; t0 += 2 * static_cast<int>(blockDim.x / 32)) {
                float earlier[2][kPerRow];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
#pragma unroll
                    for (int i = 0; i < kPerRow; ++i) {
                        const int t = t0 + r, s = lane + 32 * i;
                        earlier[r][i] = !first_head && t < L && s <= t ? wsum[t * d.Q + s] : 0.0f;
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {
#pragma unroll
                    for (int i = 0; i < kPerRow; ++i) {
                        const int t = t0 + r, s = lane + 32 * i;
                        if (t >= L || s > t) continue;
                        const float w = meta.seg[s] == meta.seg[t]
                                            ? W[t * d.Q + s] * (expf(meta.cs[t] - meta.cs[s]) * meta.dtv[s])
                                            : W[t * d.Q + s];
                        wsum[t * d.Q + s] = first_head ? w : earlier[r][i] + w;
                    }
                }
            }
        }

        // dx_s = D·dy_s + to_end_s·(dh_out·B_s) + Σ_t (C_t·B_s)·exp(cs_t − cs_s)·δ_s·dy_t; v_s on the way.
        if (dh_out != nullptr) {
            mma_product<kN, false, true, false>(
                L, d.P, d.S, along_k(), along_k(), DirectK{v.B0, v.ld},
                [&](int p, int n) { return dh_out[p * d.S + n]; },
                [&](int s, int p, float value) { ACC[s * d.P + p] = value; }, st);
            row_sums(hs.v, L, d.P, [&](int s, int p) { return v.x(s, p) * ACC[s * d.P + p]; });
        } else {
            for (int s = threadIdx.x; s < L; s += blockDim.x) hs.v[s] = 0.0f;
        }
        const bool has_dh_out = dh_out != nullptr;
        mma_product_prior<kN, true, false, false>(
            L, d.P, L, along_rows(), along_rows(),
            [&](int s, int t) {
                return same_segment_causal(meta, t, s) ? CB[t * d.Q + s] * expf(meta.cs[t] - meta.cs[s]) * meta.dtv[s]
                                                       : 0.0f;
            },
            DirectRows{dyv.at, dyv.ld},
            [&](int s, int p) { return has_dh_out ? hs.to_end[s] * ACC[s * d.P + p] + D * dyv(s, p) : D * dyv(s, p); },
            [&](int s, int p, float value, float state_terms) {
                dx0[s * v.ld + p] = __float2bfloat16_rn(state_terms + value);
            },
            st);

        // u_t = dy_t · (h_in·C_t) (ACC is free again after the barrier at mma_product's exit).
        if (h_in != nullptr) {
            mma_product<kN, false, true, false>(
                L, d.P, d.S, along_k(), along_k(), DirectK{v.C0, v.ld}, [&](int p, int n) { return h_in[p * d.S + n]; },
                [&](int t, int p, float value) { ACC[t * d.P + p] = value; }, st);
            row_sums(hs.u, L, d.P, [&](int t, int p) { return dyv(t, p) * ACC[t * d.P + p]; });
        } else {
            for (int t = threadIdx.x; t < L; t += blockDim.x) hs.u[t] = 0.0f;
            __syncthreads();
        }

        // hh = dh_out · h_in (the gradient at cs_last through the entering state's decay).
        float hh = 0.0f;
        if (h_in != nullptr && dh_out != nullptr && meta.seg[last] == 0) {
            // a thread's elements in ascending order, kBatch pairs of loads in flight at a time
            constexpr int kBatch = 8;
            const int n = d.P * d.S, stride = static_cast<int>(blockDim.x);
            float sum = 0.0f;
            for (int e0 = static_cast<int>(threadIdx.x); e0 < n; e0 += kBatch * stride) {
                float terms[kBatch];
#pragma unroll
                for (int i = 0; i < kBatch; ++i) {
                    const int e = e0 + i * stride;
                    terms[i] = e < n ? dh_out[e] * h_in[e] : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < kBatch; ++i) sum += terms[i];
            }
            hh = block_sum(sum, slots);
        }
        finish_head(meta, hs, hh, A, L, row0, h, chunk_idx, static_cast<int64_t>(gridDim.z) * d.num_chunks, d, out);
        __syncthreads();
    }

    // dB_s = Σ_t wsum[t, s]·C_t + Σ_heads to_end_s·(x_s·dh_out): one product over k = [t | (head, p)];
    // dC_t = Σ_s wsum[t, s]·B_s + Σ_heads from_start_t·(dy_t·h_in): one product over k = [s | (head, p)].
    // The group's heads are consecutive, so their x and dy columns and their states are contiguous:
    // (head, p) is one index rel = head·P + p (the head of rel by a float reciprocal: exact for
    // rel < 2^22, checked at launch). The barrier that ended the last head orders wsum and ends.
    const int HP = d.heads_per_group * d.P;
    const int ld = static_cast<int>(d.ld), ld_dy = static_cast<int>(d.I);
    const float inv_P = 1.0f / static_cast<float>(d.P);
    auto head_of = [&](int rel) { return static_cast<int>((static_cast<float>(rel) + 0.5f) * inv_P); };
    const float* ends = out.ends + (chunk_idx * d.H + static_cast<int64_t>(g) * d.heads_per_group) * 2 * d.Q;
    const bf16* xg = gv.x0;  // the group's first head's x: the group's x columns at (t, rel)
    const bf16* dyg = dy + row0 * d.I + static_cast<int64_t>(g) * HP;
    const float* dh_g = c + 1 < d.num_chunks ? dstates + state_offset(d, b, c, g * d.heads_per_group) : nullptr;
    const float* hin_g = c > 0 ? states + state_offset(d, b, c, g * d.heads_per_group) : nullptr;
    bf16* dB_out = out.dxbc + row0 * d.ld + d.I + static_cast<int64_t>(g) * d.S;
    bf16* dC_out = dB_out + static_cast<int64_t>(d.G) * d.S;
    mma_product<kN, true, true, false>(
        L, d.S, dh_g != nullptr ? L + HP : L, Layout{false, L, true}, along_rows(),
        [&](int s, int kk) {
            if (kk < L) return kk >= s ? wsum[kk * d.Q + s] : 0.0f;
            const int rel = kk - L;
            return ends[head_of(rel) * 2 * d.Q + s] * __bfloat162float(xg[s * ld + rel]);
        },
        DirectThen{DirectRows{gv.C0, gv.ld}, L,
                   [&](int n, int kk) { return dh_g[static_cast<int64_t>(kk - L) * d.S + n]; }},
        [&](int s, int n, float value) { dB_out[s * ld + n] = __float2bfloat16_rn(value); }, st);
    mma_product<kN, true, true, false>(
        L, d.S, hin_g != nullptr ? L + HP : L, along_k(), along_rows(),
        [&](int t, int kk) {
            if (kk < L) return kk <= t ? wsum[t * d.Q + kk] : 0.0f;
            const int rel = kk - L;
            return ends[head_of(rel) * 2 * d.Q + d.Q + t] * __bfloat162float(dyg[t * ld_dy + rel]);
        },
        DirectThen{DirectRows{gv.B0, gv.ld}, L,
                   [&](int n, int kk) { return hin_g[static_cast<int64_t>(kk - L) * d.S + n]; }},
        [&](int t, int n, float value) { dC_out[t * ld + n] = __float2bfloat16_rn(value); }, st);
}

// ----------------------------------------------------------------------------------------------
// launch helpers

int max_shared_bytes() {
    int device = 0, bytes = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    MF_CHECK_CUDA(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return bytes;
}

constexpr size_t kStaticSmemBytes = sizeof(ChunkMeta) + sizeof(HeadSums) + kMaxWarps * sizeof(float);

void check_geometry(const char* op, const SsdGeometry& g) {
    MF_CHECK(g.num_rows >= 0 && g.T > 0 && g.H > 0 && g.P > 0 && g.G > 0 && g.S > 0 && g.H % g.G == 0, op,
             ": bad geometry B=", g.num_rows, " T=", g.T, " H=", g.H, " P=", g.P, " G=", g.G, " S=", g.S);
    MF_CHECK(g.Q >= 1 && g.Q <= kSsdMaxChunk, op, ": chunk_size = ", g.Q, ", the CUDA scan supports 1..", kSsdMaxChunk);
    MF_CHECK(g.dt_min <= g.dt_max, op, ": dt_min ", g.dt_min, " > dt_max ", g.dt_max);
    MF_CHECK(g.H < 65536 && g.G < 65536 && g.num_rows < 65536 && (g.T + g.Q - 1) / g.Q < (int64_t{1} << 31), op,
             ": geometry too large");
    MF_CHECK(g.P <= 4096 && g.S <= 4096, op, ": head_dim ", g.P, " / state_size ", g.S, " too large");
    // the backward indexes a group's (head, p) columns as one index below 2^22 (see its dB / dC)
    MF_CHECK(g.H * g.P < (int64_t{1} << 22), op, ": num_heads × head_dim = ", g.H * g.P, " too large");
    // Views and HeadRows address a chunk's rows with 32-bit offsets.
    MF_CHECK(g.Q * (g.H * g.P + 2 * g.G * g.S) < INT_MAX, op, ": a chunk's rows span more than 2^31 elements");
    const Dims d = dims_of(g);
    const size_t need = backward_smem_bytes(d) + kStaticSmemBytes;
    MF_CHECK(need <= static_cast<size_t>(max_shared_bytes()), op, ": chunk_size ", g.Q, ", head_dim ", g.P,
             " and state_size ", g.S, " need ", need, " bytes of shared memory per block, the device has ",
             max_shared_bytes());
}

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
    MF_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

dim3 chunk_grid(const Dims& d, int64_t rows, int per_chunk) {
    return dim3(static_cast<unsigned>(d.num_chunks), static_cast<unsigned>(per_chunk), static_cast<unsigned>(rows));
}
dim3 pass_grid(const Dims& d, int64_t rows) {
    const int64_t elems = static_cast<int64_t>(d.P) * d.S;
    return dim3(static_cast<unsigned>((elems + kPassThreads - 1) / kPassThreads), static_cast<unsigned>(d.H),
                static_cast<unsigned>(rows));
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

int64_t ssd_num_chunks(const SsdGeometry& g) { return (g.T + g.Q - 1) / g.Q; }
int64_t ssd_states_numel(const SsdGeometry& g) { return chunks_total(g) * g.H * g.P * g.S; }

size_t ssd_scan_forward_scratch_bytes(const SsdGeometry& g) { return decay_bytes(g); }

void ssd_scan_forward(bf16* y, float* states, const bf16* xbc, const bf16* dt, const SsdParams& params,
                      const int32_t* doc_ids, const SsdGeometry& g, void* scratch, size_t scratch_bytes,
                      cudaStream_t stream) {
    check_geometry("ssd_scan_forward", g);
    if (g.num_rows == 0) return;
    MF_CHECK(y != nullptr && states != nullptr && xbc != nullptr && dt != nullptr && params.dt_bias != nullptr &&
                 params.A_log != nullptr && params.D != nullptr,
             "ssd_scan_forward: null buffer");
    MF_CHECK(scratch != nullptr && scratch_bytes >= ssd_scan_forward_scratch_bytes(g), "ssd_scan_forward: scratch has ",
             scratch_bytes, " bytes, needs ", ssd_scan_forward_scratch_bytes(g));
    const Dims d = dims_of(g);
    float* decay = static_cast<float*>(scratch);
    set_smem(ssd_chunk_state_kernel, kStagingBytes);
    ssd_chunk_state_kernel<<<chunk_grid(d, g.num_rows, d.H), kThreads, kStagingBytes, stream>>>(states, decay, xbc, dt,
                                                                                                params, doc_ids, d);
    MF_CHECK_CUDA(cudaGetLastError());
    ssd_state_pass_kernel<<<pass_grid(d, g.num_rows), kPassThreads, 0, stream>>>(states, decay, d);
    MF_CHECK_CUDA(cudaGetLastError());
    set_smem(ssd_chunk_output_kernel, output_smem_bytes(d));
    ssd_chunk_output_kernel<<<chunk_grid(d, g.num_rows, d.H), kWideThreads, output_smem_bytes(d), stream>>>(
        y, states, xbc, dt, params, doc_ids, d);
    MF_CHECK_CUDA(cudaGetLastError());
}

size_t ssd_scan_backward_scratch_bytes(const SsdGeometry& g) {
    return align256(static_cast<size_t>(ssd_states_numel(g)) * sizeof(float)) + decay_bytes(g) + wsum_bytes(g) +
           ends_bytes(g) + align256(static_cast<size_t>(3 * chunks_total(g) * g.H) * sizeof(float));
}

void ssd_scan_backward(const SsdGrads& grads, const bf16* dy, const bf16* xbc, const bf16* dt, const SsdParams& params,
                       const float* states, const int32_t* doc_ids, const SsdGeometry& g, void* scratch,
                       size_t scratch_bytes, cudaStream_t stream) {
    check_geometry("ssd_scan_backward", g);
    if (g.num_rows == 0) return;
    MF_CHECK(grads.dxbc != nullptr && grads.ddt != nullptr && grads.ddt_bias != nullptr && grads.dA_log != nullptr &&
                 grads.dD != nullptr && dy != nullptr && xbc != nullptr && dt != nullptr && states != nullptr &&
                 params.dt_bias != nullptr && params.A_log != nullptr && params.D != nullptr,
             "ssd_scan_backward: null buffer");
    for (const DType t : {grads.ddt_bias_dtype, grads.dA_log_dtype, grads.dD_dtype}) {
        MF_CHECK(t == DType::f32 || t == DType::bf16,
                 "ssd_scan_backward: parameter-gradient dtype must be f32 or bf16, got ", dtype_name(t));
    }
    const size_t needed = ssd_scan_backward_scratch_bytes(g);
    MF_CHECK(scratch != nullptr && scratch_bytes >= needed && aligned_to(256, scratch),
             "ssd_scan_backward: scratch has ", scratch_bytes, " bytes, needs ", needed, " (256-byte aligned)");
    const Dims d = dims_of(g);
    char* at = static_cast<char*>(scratch);
    float* dstates = reinterpret_cast<float*>(at);
    at += align256(static_cast<size_t>(ssd_states_numel(g)) * sizeof(float));
    float* decay = reinterpret_cast<float*>(at);
    at += decay_bytes(g);
    float* wsum = reinterpret_cast<float*>(at);
    at += wsum_bytes(g);
    float* ends = reinterpret_cast<float*>(at);
    at += ends_bytes(g);
    float* partial = reinterpret_cast<float*>(at);

    set_smem(ssd_chunk_dstate_kernel, kStagingBytes);
    ssd_chunk_dstate_kernel<<<chunk_grid(d, g.num_rows, d.H), kThreads, kStagingBytes, stream>>>(
        dstates, decay, dy, xbc, dt, params, doc_ids, d);
    MF_CHECK_CUDA(cudaGetLastError());
    ssd_dstate_pass_kernel<<<pass_grid(d, g.num_rows), kPassThreads, 0, stream>>>(dstates, decay, d);
    MF_CHECK_CUDA(cudaGetLastError());
    const ChunkGradOut out{grads.dxbc, grads.ddt, wsum, ends, partial};
    set_smem(ssd_chunk_backward_kernel, backward_smem_bytes(d));
    ssd_chunk_backward_kernel<<<chunk_grid(d, g.num_rows, d.G), kWideThreads, backward_smem_bytes(d), stream>>>(
        out, dy, xbc, dt, params, states, dstates, doc_ids, d);
    MF_CHECK_CUDA(cudaGetLastError());
    const int64_t rows = chunks_total(g);
    reduce_partial_rows(grads.ddt_bias, grads.ddt_bias_dtype, partial, rows, g.H, true, stream);
    reduce_partial_rows(grads.dA_log, grads.dA_log_dtype, partial + rows * g.H, rows, g.H, true, stream);
    reduce_partial_rows(grads.dD, grads.dD_dtype, partial + 2 * rows * g.H, rows, g.H, true, stream);
}

}  // namespace mf::cuda
