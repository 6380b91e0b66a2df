// Flash attention (FlashAttention-2 style) with mma.sync tensor cores: GQA, causal, packed documents.
//
// Forward: a block of 4 warps owns 64 queries of one (batch row, query head); each warp owns 16 of
//   them and keeps its output rows, running max m and running sum l in registers. Key/value tiles
//   of 64 rows stream through a 2-stage cp.async ring; per tile a warp computes S = Q·Kᵀ (fp32),
//   masks it, rescales (online softmax in base 2: x = scale·log2(e)·S), turns P into bf16 mma
//   operands straight from the accumulator registers and adds P·V. lse = (m + log2 l)·ln 2.
// Backward, three kernels, none with atomics:
//   delta   D_t = Σ_d dout_t · out_t per (row, head), into the workspace;
//   dK/dV   a block owns 64 keys of one KV head (16 per warp, dK/dV accumulators in registers) and
//           loops over the query heads of its group (or of its share of them, dkv_head_splits) and
//           the 32-query tiles that can see its keys:
//           Sᵀ = K·Qᵀ, Pᵀ = exp2(x − lse), dPᵀ = V·dOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dV += Pᵀ·dO, dK += dSᵀ·Q;
//           with the heads split, each share's fp32 sums go to the workspace and a last kernel adds
//           them in share order;
//   dQ      a block owns 64 queries of one head (16 per warp) and loops over its 64-key tiles:
//           S, P, dP = dO·Vᵀ, dS = P∘(dP − D), dQ += dS·K.
// Every sum runs in a fixed order, so results are bitwise reproducible. Tiles are chosen from the
// allowed key range [run_start(t), t] (documents are contiguous runs); inside a tile that is not
// entirely allowed, each score is masked exactly by position and doc id. Masked scores have P = 0
// and a row with nothing allowed so far keeps m = -inf without producing NaN.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "core/check.h"
#include "core/cuda_check.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/mma_sm80.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kTileQ = 64;     // the finest query tiling of any kernel (bounds the grids in check_shape)
constexpr int kTileKV = 64;    // keys per tile (forward, dQ) and per block (dK/dV, 16 per warp)
constexpr int kScanPerThread = 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int kD>
constexpr int tile_ld() {
    return kD + 8;  // rows 16 bytes apart mod 128: ldmatrix reads 8 rows without bank conflicts
}

// ---------------------------------------------------------------------------------------------
// register packing (the PTX wrappers are in kernels/cuda/mma_sm80.cuh)

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// ---------------------------------------------------------------------------------------------
// fragment helpers (tiles stored [row][d] with ld = kD + 8)
//
// The mma m16n8k16 register layouts (lane = 4·g + t) are spelled out in kernels/cuda/mma_sm80.cuh.

// A fragment: rows row0..row0+15 of a [row][k] tile, k columns k0..k0+15.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* tile, int ld, int row0, int k0, int lane) {
    ldmatrix_x4(a, tile + (row0 + (lane % 8) + ((lane / 8) % 2) * 8) * ld + k0 + (lane / 16) * 8);
}
// B fragments for two n8 tiles (cols n0..n0+15) when the tile is stored [n][k] (k contiguous):
// r0, r1 = (n0.., k lo / hi), r2, r3 = (n0+8.., k lo / hi).
__device__ __forceinline__ void load_b_nk(uint32_t (&r)[4], const bf16* tile, int ld, int n0, int k0, int lane) {
    ldmatrix_x4(r, tile + (n0 + (lane % 8) + (lane / 16) * 8) * ld + k0 + ((lane / 8) % 2) * 8);
}
// B fragments for two n8 tiles (cols n0..n0+15) when the tile is stored [k][n] (n contiguous).
__device__ __forceinline__ void load_b_kn(uint32_t (&r)[4], const bf16* tile, int ld, int n0, int k0, int lane) {
    ldmatrix_x4_trans(r, tile + (k0 + (lane % 8) + ((lane / 8) % 2) * 8) * ld + n0 + (lane / 16) * 8);
}

// acc[2·j + i] (16 x 8 tiles, j over n pairs) += A(16 x kD, from tile_a rows row0..) · B where B is
// stored [n][k] (rows n of tile_b, k = d): i.e. S = A · tile_bᵀ over kD.
template <int kD, int kNTiles>
__device__ __forceinline__ void gemm_abt(float (&acc)[kNTiles][4], const bf16* tile_a, int row0, const bf16* tile_b,
                                         int lane) {
    constexpr int kLd = tile_ld<kD>();
#pragma unroll
    for (int kd = 0; kd < kD / 16; ++kd) {
        uint32_t a[4];
        load_a(a, tile_a, kLd, row0, kd * 16, lane);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            uint32_t r[4];
            load_b_nk(r, tile_b, kLd, np * 16, kd * 16, lane);
            mma_bf16(acc[2 * np], a, r[0], r[1]);
            mma_bf16(acc[2 * np + 1], a, r[2], r[3]);
        }
    }
}

// acc (16 x kD) += P (16 x 16·kKSteps, fp32 C fragments p[2·kk + 0/1]) · tile_b rows 0.. (stored [k][d]).
template <int kD, int kKSteps>
__device__ __forceinline__ void gemm_pv(float (&acc)[kD / 8][4], const float (&p)[2 * kKSteps][4], const bf16* tile_b,
                                        int lane) {
    constexpr int kLd = tile_ld<kD>();
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t a[4];
        a[0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
        a[1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
        a[2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
            uint32_t r[4];
            load_b_kn(r, tile_b, kLd, dp * 16, kk * 16, lane);
            mma_bf16(acc[2 * dp], a, r[0], r[1]);
            mma_bf16(acc[2 * dp + 1], a, r[2], r[3]);
        }
    }
}

// The same two products for kMTiles stacked 16-row tiles of A: every B fragment read from shared
// memory feeds kMTiles mma instructions (the forward gives each warp 32 query rows this way).
template <int kD, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_abt_m(float (&acc)[kMTiles][kNTiles][4], const bf16* tile_a, int row0,
                                           const bf16* tile_b, int lane) {
    constexpr int kLd = tile_ld<kD>();
#pragma unroll
    for (int kd = 0; kd < kD / 16; ++kd) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) load_a(a[mt], tile_a, kLd, row0 + mt * 16, kd * 16, lane);
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            uint32_t r[4];
            load_b_nk(r, tile_b, kLd, np * 16, kd * 16, lane);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                mma_bf16(acc[mt][2 * np], a[mt], r[0], r[1]);
                mma_bf16(acc[mt][2 * np + 1], a[mt], r[2], r[3]);
            }
        }
    }
}

template <int kD, int kMTiles, int kKSteps>
__device__ __forceinline__ void gemm_pv_m(float (&acc)[kMTiles][kD / 8][4], const float (&p)[kMTiles][2 * kKSteps][4],
                                          const bf16* tile_b, int lane) {
    constexpr int kLd = tile_ld<kD>();
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
            a[mt][0] = pack_bf16(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            a[mt][1] = pack_bf16(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            a[mt][2] = pack_bf16(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            a[mt][3] = pack_bf16(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < kD / 16; ++dp) {
            uint32_t r[4];
            load_b_kn(r, tile_b, kLd, dp * 16, kk * 16, lane);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                mma_bf16(acc[mt][2 * dp], a[mt], r[0], r[1]);
                mma_bf16(acc[mt][2 * dp + 1], a[mt], r[2], r[3]);
            }
        }
    }
}

// rows [0, num_rows) x kD of a [T, stride] matrix starting at row t0 -> tile; rows >= T zero-filled.
// kNumThreads: the block's thread count (all of them share the copy).
template <int kD, int kNumThreads = kThreads>
__device__ __forceinline__ void load_rows(bf16* tile, const bf16* row0_ptr, int64_t row_stride, int rows_valid,
                                          int num_rows) {
    constexpr int kChunks = kD / 8;
    constexpr int kLd = tile_ld<kD>();
    for (int c = static_cast<int>(threadIdx.x); c < num_rows * kChunks; c += kNumThreads) {
        const int r = c / kChunks;
        const int dc = (c % kChunks) * 8;
        const bool valid = r < rows_valid;
        cp_async_16(tile + r * kLd + dc, valid ? row0_ptr + r * row_stride + dc : row0_ptr, valid);
    }
}

template <int N>
__device__ __forceinline__ void zero(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) x[i][c] = 0.0f;
}

// ---------------------------------------------------------------------------------------------
// document runs (block-wide; every thread gets the same answer)

// First position of the run of equal doc ids that holds t (0 without doc ids).
__device__ int block_run_start(const int32_t* doc, int t, int* scratch) {
    if (doc == nullptr) return 0;
    const int id = doc[t];
    if (doc[0] == id) return 0;
    const int tid = static_cast<int>(threadIdx.x);
    int hi = t;
    while (true) {
        const int lo = max(0, hi - static_cast<int>(blockDim.x) * kScanPerThread + 1);
        if (tid == 0) *scratch = -1;
        __syncthreads();
        int found = -1;
#pragma unroll
        for (int i = 0; i < kScanPerThread; ++i) {
            const int p = lo + i * static_cast<int>(blockDim.x) + tid;
            if (p <= hi && doc[p] != id) found = max(found, p);
        }
        if (found >= 0) atomicMax(scratch, found);
        __syncthreads();
        const int last_other = *scratch;
        __syncthreads();
        if (last_other >= 0) return last_other + 1;
        if (lo == 0) return 0;
        hi = lo - 1;
    }
}

// Last position of the run of equal doc ids that holds t (T - 1 without doc ids).
__device__ int block_run_end(const int32_t* doc, int t, int T, int* scratch) {
    if (doc == nullptr) return T - 1;
    const int id = doc[t];
    if (doc[T - 1] == id) return T - 1;
    const int tid = static_cast<int>(threadIdx.x);
    int lo = t;
    while (true) {
        const int hi = min(T - 1, lo + static_cast<int>(blockDim.x) * kScanPerThread - 1);
        if (tid == 0) *scratch = INT_MAX;
        __syncthreads();
        int found = INT_MAX;
#pragma unroll
        for (int i = 0; i < kScanPerThread; ++i) {
            const int p = lo + i * static_cast<int>(blockDim.x) + tid;
            if (p <= hi && doc[p] != id) found = min(found, p);
        }
        if (found != INT_MAX) atomicMin(scratch, found);
        __syncthreads();
        const int first_other = *scratch;
        __syncthreads();
        if (first_other != INT_MAX) return first_other - 1;
        if (hi == T - 1) return T - 1;
        lo = hi + 1;
    }
}

// ---------------------------------------------------------------------------------------------
// forward

struct FwdParams {
    bf16* out;
    float* lse;
    const bf16* q;
    const bf16* k;
    const bf16* v;
    const int32_t* doc_ids;
    int B, T, Hq, Hkv;
    float scale_log2;
};

constexpr int kFwdTileQ = 128;  // queries per block: 32 per warp (two 16-row mma tiles)
constexpr int kFwdTileKV = 32;  // keys per tile
constexpr int kFwdMTiles = 2;

template <int kD>
constexpr int fwd_smem_bytes() {
    return (kFwdTileQ + 4 * kFwdTileKV) * tile_ld<kD>() * 2;
}

template <int kD>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(FwdParams p) {
    constexpr int kLd = tile_ld<kD>();
    constexpr int kNTiles = kFwdTileKV / 8;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* q_tile = reinterpret_cast<bf16*>(smem_raw);
    bf16* k_tiles = q_tile + kFwdTileQ * kLd;        // [2][kFwdTileKV][kLd]
    bf16* v_tiles = k_tiles + 2 * kFwdTileKV * kLd;  // [2][kFwdTileKV][kLd]
    __shared__ int q_doc[kFwdTileQ];
    __shared__ int kv_doc[2][kFwdTileKV];
    __shared__ int scan_scratch;

    const int tid = static_cast<int>(threadIdx.x);
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int num_q_tiles = (p.T + kFwdTileQ - 1) / kFwdTileQ;
    const int bh_count = p.B * p.Hq;
    // Later query tiles see more keys: hand them out first.
    const int q_tile_idx = num_q_tiles - 1 - static_cast<int>(blockIdx.x) / bh_count;
    const int bh = static_cast<int>(blockIdx.x) % bh_count;
    const int b = bh / p.Hq;
    const int h = bh % p.Hq;
    const int hk = h / (p.Hq / p.Hkv);
    const int q0 = q_tile_idx * kFwdTileQ;
    const int q_end = min(q0 + kFwdTileQ, p.T);

    const int64_t q_stride = static_cast<int64_t>(p.Hq) * kD;
    const int64_t kv_stride = static_cast<int64_t>(p.Hkv) * kD;
    const bf16* q_base = p.q + static_cast<int64_t>(b) * p.T * q_stride + static_cast<int64_t>(h) * kD;
    const bf16* k_base = p.k + static_cast<int64_t>(b) * p.T * kv_stride + static_cast<int64_t>(hk) * kD;
    const bf16* v_base = p.v + static_cast<int64_t>(b) * p.T * kv_stride + static_cast<int64_t>(hk) * kD;
    const int32_t* doc = p.doc_ids != nullptr ? p.doc_ids + static_cast<int64_t>(b) * p.T : nullptr;

    for (int i = tid; i < kFwdTileQ; i += kThreads) q_doc[i] = (doc != nullptr && q0 + i < p.T) ? doc[q0 + i] : 0;
    const int kv_first = block_run_start(doc, q0, &scan_scratch);
    const int tile_begin = kv_first / kFwdTileKV;
    const int tile_end = (q_end + kFwdTileKV - 1) / kFwdTileKV;

    auto load_kv = [&](int tile, int buf) {
        const int kv0 = tile * kFwdTileKV;
        load_rows<kD>(k_tiles + buf * kFwdTileKV * kLd, k_base + kv0 * kv_stride, kv_stride, p.T - kv0, kFwdTileKV);
        load_rows<kD>(v_tiles + buf * kFwdTileKV * kLd, v_base + kv0 * kv_stride, kv_stride, p.T - kv0, kFwdTileKV);
        if (tid < kFwdTileKV) kv_doc[buf][tid] = (doc != nullptr && kv0 + tid < p.T) ? doc[kv0 + tid] : 0;
    };
    load_rows<kD>(q_tile, q_base + q0 * q_stride, q_stride, p.T - q0, kFwdTileQ);
    load_kv(tile_begin, 0);
    cp_async_commit();

    float o[kFwdMTiles][kD / 8][4];
    float m[kFwdMTiles][2], l[kFwdMTiles][2];
    const int warp_q0 = q0 + warp * 16 * kFwdMTiles;
    const int lane_q0 = warp_q0 + lane / 4;  // query of this lane's row r of m tile mt: lane_q0 + 16·mt + 8·r
#pragma unroll
    for (int mt = 0; mt < kFwdMTiles; ++mt) {
        zero(o[mt]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            m[mt][r] = -INFINITY;
            l[mt][r] = 0.0f;
        }
    }

    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const int buf = (tile - tile_begin) % 2;
        __syncthreads();  // every warp is done with the buffer the prefetch overwrites
        if (tile + 1 < tile_end) load_kv(tile + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const int kv0 = tile * kFwdTileKV;
        const bf16* k_tile = k_tiles + buf * kFwdTileKV * kLd;
        const bf16* v_tile = v_tiles + buf * kFwdTileKV * kLd;
        float s[kFwdMTiles][kNTiles][4];
#pragma unroll
        for (int mt = 0; mt < kFwdMTiles; ++mt) zero(s[mt]);
        gemm_abt_m<kD, kFwdMTiles, kNTiles>(s, q_tile, warp * 16 * kFwdMTiles, k_tile, lane);

        // A tile needs no mask when all its keys precede all 32 queries of the warp, the queries
        // exist and every doc id involved is the same.
        bool full = kv0 + kFwdTileKV - 1 <= warp_q0 && warp_q0 + 16 * kFwdMTiles - 1 < p.T;
        if (doc != nullptr) {
            const int id = q_doc[warp * 16 * kFwdMTiles];
            const bool same = kv_doc[buf][lane] == id && q_doc[warp * 16 * kFwdMTiles + lane] == id;
            full = __all_sync(0xffffffffu, same) && full;
        }
#pragma unroll
        for (int mt = 0; mt < kFwdMTiles; ++mt) {
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float x = s[mt][nt][c] * p.scale_log2;
                    if (!full) {
                        const int key_local = nt * 8 + (lane % 4) * 2 + (c & 1);
                        const int key = kv0 + key_local;
                        const int qpos = lane_q0 + mt * 16 + (c / 2) * 8;
                        bool allowed = key <= qpos && qpos < p.T;
                        if (doc != nullptr) allowed = allowed && kv_doc[buf][key_local] == q_doc[qpos - q0];
                        if (!allowed) x = -INFINITY;
                    }
                    s[mt][nt][c] = x;
                }
            }
            // Online softmax per row (rows g and g + 8 of the m tile; a row lives in one lane quad).
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m[mt][r], mx);
                const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // nothing allowed yet: p = 0, no NaN
                const float alpha = exp2f(m[mt][r] - m_use);
                m[mt][r] = m_new;
                float sum = 0.0f;
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
                    s[mt][nt][2 * r] = exp2f(s[mt][nt][2 * r] - m_use);
                    s[mt][nt][2 * r + 1] = exp2f(s[mt][nt][2 * r + 1] - m_use);
                    sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
                }
                l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
                for (int dn = 0; dn < kD / 8; ++dn) {
                    o[mt][dn][2 * r] *= alpha;
                    o[mt][dn][2 * r + 1] *= alpha;
                }
            }
        }
        gemm_pv_m<kD, kFwdMTiles, kFwdTileKV / 16>(o, s, v_tile, lane);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < kFwdMTiles; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int qpos = lane_q0 + mt * 16 + r * 8;
            if (qpos >= p.T) continue;
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            bf16* out_row = p.out + (static_cast<int64_t>(b) * p.T + qpos) * q_stride + static_cast<int64_t>(h) * kD;
#pragma unroll
            for (int dn = 0; dn < kD / 8; ++dn) {
                const int col = dn * 8 + (lane % 4) * 2;
                *reinterpret_cast<__nv_bfloat162*>(out_row + col) =
                    __floats2bfloat162_rn(o[mt][dn][2 * r] * inv, o[mt][dn][2 * r + 1] * inv);
            }
            if (lane % 4 == 0)
                p.lse[(static_cast<int64_t>(b) * p.Hq + h) * p.T + qpos] = (m[mt][r] + log2f(sum)) * kLn2;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// backward: D_t = dout_t · out_t

__global__ void attention_delta_kernel(float* delta, const bf16* dout, const bf16* out, int B, int T, int Hq, int D) {
    const int64_t num_rows = static_cast<int64_t>(B) * T * Hq;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
    for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < num_rows;
         row += warps_total) {
        const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(dout + row * D);
        const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(out + row * D);
        float sum = 0.0f;
        for (int i = lane; i < D / 2; i += 32) {
            const float2 x = __bfloat1622float2(a[i]);
            const float2 y = __bfloat1622float2(o[i]);
            sum += x.x * y.x + x.y * y.y;
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0) {
            // row = (b · T + t) · Hq + h  ->  delta[(b · Hq + h) · T + t]
            const int64_t h = row % Hq;
            const int64_t bt = row / Hq;
            const int64_t b = bt / T;
            const int64_t t = bt % T;
            delta[(b * Hq + h) * T + t] = sum;
        }
    }
}

struct BwdParams {
    bf16* dq;
    bf16* dk;
    bf16* dv;
    const bf16* dout;
    const bf16* q;
    const bf16* k;
    const bf16* v;
    const float* lse;
    const float* delta;
    const int32_t* doc_ids;
    float* dk_part;  // head_splits > 1: [head_splits][B, T, Hkv, D] fp32 partial sums (unscaled), else null
    float* dv_part;
    int B, T, Hq, Hkv;
    int head_splits;  // the query heads of a KV group are split over this many blocks per key tile
    float scale;
    float scale_log2;
};

// ---------------------------------------------------------------------------------------------
// backward: dK, dV (block = 64 keys of one KV head, 8 warps, 64-query tiles)
//
// Two phases per query tile, the intermediate in shared memory so that each phase gets its own warp
// layout and no warp holds more than a quarter of the block's accumulators (two blocks of 8 warps
// fit an SM; the earlier one-phase kernel held dK and dV for 16 keys x D per warp, 255 registers,
// one block of 4 warps per scheduler pair, and was latency-bound):
//   1. warp (kw, qh) = (w % 4, w / 4): Sᵀ and dPᵀ for keys 16·kw.. and queries 32·qh.. of the tile,
//      then Pᵀ and dSᵀ = Pᵀ∘(dPᵀ − D), stored bf16 as [key][query] tiles;
//   2. warp (kp, dc) = (w % 2, w / 2): dV += Pᵀ·dO and dK += dSᵀ·Q for keys 32·kp.. (two mma row
//      tiles, so every dO / Q fragment feeds two mma) and the head-dim columns dc·D/4.., over the
//      tile's 64 queries.

constexpr int kDkvThreads = 256;
constexpr int kDkvTileQ = 64;
constexpr int kPLd = kDkvTileQ + 8;  // [key][query] bf16 tiles: rows 16 bytes apart mod 128

template <int kD>
constexpr int dkv_smem_bytes() {
    return (2 * kTileKV + 2 * kDkvTileQ) * tile_ld<kD>() * 2 + 2 * kTileKV * kPLd * 2;
}

template <int kD>
__global__ void __launch_bounds__(kDkvThreads, 2) attention_backward_dkv_kernel(BwdParams p) {
    constexpr int kLd = tile_ld<kD>();
    // Phase 2 columns per warp: a quarter of the head dim, at least 16 (the mma tiles are 16 columns
    // wide; for D = 16 and 32 the warps past the head dim have no phase-2 work).
    constexpr int kCols = kD >= 64 ? kD / 4 : 16;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* k_tile = reinterpret_cast<bf16*>(smem_raw);
    bf16* v_tile = k_tile + kTileKV * kLd;
    bf16* q_tile = v_tile + kTileKV * kLd;      // [kDkvTileQ][kLd]
    bf16* do_tile = q_tile + kDkvTileQ * kLd;   // [kDkvTileQ][kLd]
    bf16* pt_tile = do_tile + kDkvTileQ * kLd;  // Pᵀ  [kTileKV][kPLd]
    bf16* dst_tile = pt_tile + kTileKV * kPLd;  // dSᵀ [kTileKV][kPLd]
    __shared__ float lse_s[kDkvTileQ];          // log2 units
    __shared__ float delta_s[kDkvTileQ];
    __shared__ int q_doc[kDkvTileQ];
    __shared__ int k_doc[kTileKV];
    __shared__ int scan_scratch;

    const int tid = static_cast<int>(threadIdx.x);
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int kw = warp % 4;  // the warp's 16 keys in both phases
    const int qh = warp / 4;  // phase 1: its 32 queries of the tile; phase 2: its half of the head dim
    const int bh_count = p.B * p.Hkv * p.head_splits;
    // Early key tiles are seen by more queries: hand them out first.
    const int k_tile_idx = static_cast<int>(blockIdx.x) / bh_count;
    const int split = static_cast<int>(blockIdx.x) % bh_count % p.head_splits;
    const int bh = static_cast<int>(blockIdx.x) % bh_count / p.head_splits;
    const int b = bh / p.Hkv;
    const int hk = bh % p.Hkv;
    const int group = p.Hq / p.Hkv / p.head_splits;  // query heads this block visits
    const int h_first = hk * (p.Hq / p.Hkv) + split * group;
    const int k0 = k_tile_idx * kTileKV;
    const int k_last = min(k0 + kTileKV, p.T) - 1;

    const int64_t q_stride = static_cast<int64_t>(p.Hq) * kD;
    const int64_t kv_stride = static_cast<int64_t>(p.Hkv) * kD;
    const int64_t kv_off = static_cast<int64_t>(b) * p.T * kv_stride + static_cast<int64_t>(hk) * kD;
    const int32_t* doc = p.doc_ids != nullptr ? p.doc_ids + static_cast<int64_t>(b) * p.T : nullptr;

    if (tid < kTileKV) k_doc[tid] = (doc != nullptr && k0 + tid < p.T) ? doc[k0 + tid] : 0;
    const int q_last = block_run_end(doc, k_last, p.T, &scan_scratch);
    const int qt_begin = k0 / kDkvTileQ;
    const int qt_count = q_last / kDkvTileQ + 1 - qt_begin;
    const int num_iters = group * qt_count;

    load_rows<kD, kDkvThreads>(k_tile, p.k + kv_off + k0 * kv_stride, kv_stride, p.T - k0, kTileKV);
    load_rows<kD, kDkvThreads>(v_tile, p.v + kv_off + k0 * kv_stride, kv_stride, p.T - k0, kTileKV);

    const int kp = warp % 2;  // phase 2: keys 32·kp..
    const int d0 = (warp / 2) * kCols;
    const bool has_cols = d0 < kD;
    float dk[2][kCols / 8][4];
    float dv[2][kCols / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        zero(dk[mt]);
        zero(dv[mt]);
    }
    const int warp_k0 = k0 + kw * 16;
    const int row_k[2] = {warp_k0 + lane / 4, warp_k0 + lane / 4 + 8};

    for (int iter = 0; iter < num_iters; ++iter) {
        const int h = h_first + iter / qt_count;
        const int qs = (qt_begin + iter % qt_count) * kDkvTileQ;
        __syncthreads();  // every warp is done with the previous tile (phase 2 read q, dO, Pᵀ, dSᵀ)
        {
            const int64_t off = static_cast<int64_t>(b) * p.T * q_stride + static_cast<int64_t>(h) * kD;
            load_rows<kD, kDkvThreads>(q_tile, p.q + off + qs * q_stride, q_stride, p.T - qs, kDkvTileQ);
            load_rows<kD, kDkvThreads>(do_tile, p.dout + off + qs * q_stride, q_stride, p.T - qs, kDkvTileQ);
            cp_async_commit();
            if (tid < kDkvTileQ) {
                const int t = qs + tid;
                const int64_t row = (static_cast<int64_t>(b) * p.Hq + h) * p.T + t;
                const bool in = t < p.T;
                lse_s[tid] = in ? p.lse[row] * kLog2e : 0.0f;
                delta_s[tid] = in ? p.delta[row] : 0.0f;
                q_doc[tid] = (doc != nullptr && in) ? doc[t] : 0;
            }
            cp_async_wait<0>();
        }
        __syncthreads();

        // phase 1: this warp's 16 keys x 32 queries
        {
            const int q_base = qh * 32;
            float st[4][4];  // Sᵀ, then Pᵀ
            zero(st);
            gemm_abt<kD, 4>(st, k_tile, kw * 16, q_tile + q_base * kLd, lane);
            float dpt[4][4];  // dPᵀ, then dSᵀ
            zero(dpt);
            gemm_abt<kD, 4>(dpt, v_tile, kw * 16, do_tile + q_base * kLd, lane);

            bool full = warp_k0 + 15 <= qs + q_base && qs + q_base + 31 < p.T;
            if (doc != nullptr) {
                const int id = k_doc[kw * 16];
                const bool same = q_doc[q_base + lane] == id && (lane >= 16 || k_doc[kw * 16 + lane] == id);
                full = __all_sync(0xffffffffu, same) && full;
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int q_local = q_base + nt * 8 + (lane % 4) * 2 + (c & 1);
                    bool allowed = true;
                    if (!full) {
                        const int qpos = qs + q_local;
                        const int key = row_k[c / 2];
                        allowed = key <= qpos && qpos < p.T;
                        if (doc != nullptr) allowed = allowed && q_doc[q_local] == k_doc[key - k0];
                    }
                    const float prob = allowed ? exp2f(st[nt][c] * p.scale_log2 - lse_s[q_local]) : 0.0f;
                    st[nt][c] = prob;
                    dpt[nt][c] = prob * (dpt[nt][c] - delta_s[q_local]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int at = (kw * 16 + lane / 4 + 8 * r) * kPLd + q_base + nt * 8 + (lane % 4) * 2;
                    *reinterpret_cast<__nv_bfloat162*>(pt_tile + at) =
                        __floats2bfloat162_rn(st[nt][2 * r], st[nt][2 * r + 1]);
                    *reinterpret_cast<__nv_bfloat162*>(dst_tile + at) =
                        __floats2bfloat162_rn(dpt[nt][2 * r], dpt[nt][2 * r + 1]);
                }
            }
        }
        __syncthreads();

        // phase 2: dV += Pᵀ·dO, dK += dSᵀ·Q for this warp's 32 keys x kCols columns, over 64 queries
        if (!has_cols) continue;
#pragma unroll
        for (int kk = 0; kk < kDkvTileQ / 16; ++kk) {
            uint32_t a_p[2][4], a_ds[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                load_a(a_p[mt], pt_tile, kPLd, kp * 32 + mt * 16, kk * 16, lane);
                load_a(a_ds[mt], dst_tile, kPLd, kp * 32 + mt * 16, kk * 16, lane);
            }
#pragma unroll
            for (int dp = 0; dp < kCols / 16; ++dp) {
                uint32_t r[4];
                load_b_kn(r, do_tile, kLd, d0 + dp * 16, kk * 16, lane);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_bf16(dv[mt][2 * dp], a_p[mt], r[0], r[1]);
                    mma_bf16(dv[mt][2 * dp + 1], a_p[mt], r[2], r[3]);
                }
                load_b_kn(r, q_tile, kLd, d0 + dp * 16, kk * 16, lane);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_bf16(dk[mt][2 * dp], a_ds[mt], r[0], r[1]);
                    mma_bf16(dk[mt][2 * dp + 1], a_ds[mt], r[2], r[3]);
                }
            }
        }
    }

    const int64_t part_off = static_cast<int64_t>(split) * p.B * p.T * kv_stride;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = k0 + kp * 32 + mt * 16 + lane / 4 + 8 * r;
            if (key >= p.T || !has_cols) continue;
            const int64_t off = kv_off + static_cast<int64_t>(key) * kv_stride + d0;
#pragma unroll
            for (int dn = 0; dn < kCols / 8; ++dn) {
                const int col = dn * 8 + (lane % 4) * 2;
                const float* k2 = &dk[mt][dn][2 * r];
                const float* v2 = &dv[mt][dn][2 * r];
                if (p.head_splits > 1) {
                    *reinterpret_cast<float2*>(p.dk_part + part_off + off + col) = make_float2(k2[0], k2[1]);
                    *reinterpret_cast<float2*>(p.dv_part + part_off + off + col) = make_float2(v2[0], v2[1]);
                } else {
                    *reinterpret_cast<__nv_bfloat162*>(p.dk + off + col) =
                        __floats2bfloat162_rn(k2[0] * p.scale, k2[1] * p.scale);
                    *reinterpret_cast<__nv_bfloat162*>(p.dv + off + col) = __floats2bfloat162_rn(v2[0], v2[1]);
                }
            }
        }
    }
}

// head_splits > 1: dk = bf16(scale · Σ_s dk_part[s]), dv = bf16(Σ_s dv_part[s]), summed in split order.
__global__ void attention_dkv_reduce_kernel(bf16* dk, bf16* dv, const float* dk_part, const float* dv_part, int64_t n,
                                            int splits, float scale) {
    const int64_t num_vec = n / 4;  // n = B·T·Hkv·D, a multiple of 16
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vec;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        float4 a = reinterpret_cast<const float4*>(dk_part)[i];
        float4 c = reinterpret_cast<const float4*>(dv_part)[i];
        for (int s = 1; s < splits; ++s) {
            const float4 x = reinterpret_cast<const float4*>(dk_part + s * n)[i];
            const float4 y = reinterpret_cast<const float4*>(dv_part + s * n)[i];
            a.x += x.x, a.y += x.y, a.z += x.z, a.w += x.w;
            c.x += y.x, c.y += y.y, c.z += y.z, c.w += y.w;
        }
        __nv_bfloat162* k2 = reinterpret_cast<__nv_bfloat162*>(dk + 4 * i);
        __nv_bfloat162* v2 = reinterpret_cast<__nv_bfloat162*>(dv + 4 * i);
        k2[0] = __floats2bfloat162_rn(a.x * scale, a.y * scale);
        k2[1] = __floats2bfloat162_rn(a.z * scale, a.w * scale);
        v2[0] = __floats2bfloat162_rn(c.x, c.y);
        v2[1] = __floats2bfloat162_rn(c.z, c.w);
    }
}

// ---------------------------------------------------------------------------------------------
// backward: dQ (block = 64 queries of one head, 16 per warp; 64-key tiles, single-buffered, so that
// three blocks share an SM: the kernel is latency-bound, and more warps per scheduler beat the
// prefetch of a second buffer)

constexpr int kDqTileQ = 64;
constexpr int kDqTileKV = 64;

template <int kD>
constexpr int dq_smem_bytes() {
    return (2 * kDqTileQ + 2 * kDqTileKV) * tile_ld<kD>() * 2;
}

template <int kD>
__global__ void __launch_bounds__(kThreads, 3) attention_backward_dq_kernel(BwdParams p) {
    constexpr int kLd = tile_ld<kD>();
    constexpr int kNTiles = kDqTileKV / 8;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    bf16* q_tile = reinterpret_cast<bf16*>(smem_raw);
    bf16* do_tile = q_tile + kDqTileQ * kLd;
    bf16* k_tile = do_tile + kDqTileQ * kLd;
    bf16* v_tile = k_tile + kDqTileKV * kLd;
    __shared__ int q_doc[kDqTileQ];
    __shared__ int kv_doc[kDqTileKV];
    __shared__ int scan_scratch;

    const int tid = static_cast<int>(threadIdx.x);
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int num_q_tiles = (p.T + kDqTileQ - 1) / kDqTileQ;
    const int bh_count = p.B * p.Hq;
    // Later query tiles see more keys: hand them out first.
    const int q_tile_idx = num_q_tiles - 1 - static_cast<int>(blockIdx.x) / bh_count;
    const int bh = static_cast<int>(blockIdx.x) % bh_count;
    const int b = bh / p.Hq;
    const int h = bh % p.Hq;
    const int hk = h / (p.Hq / p.Hkv);
    const int q0 = q_tile_idx * kDqTileQ;
    const int q_end = min(q0 + kDqTileQ, p.T);

    const int64_t q_stride = static_cast<int64_t>(p.Hq) * kD;
    const int64_t kv_stride = static_cast<int64_t>(p.Hkv) * kD;
    const int64_t q_off = static_cast<int64_t>(b) * p.T * q_stride + static_cast<int64_t>(h) * kD;
    const bf16* k_base = p.k + static_cast<int64_t>(b) * p.T * kv_stride + static_cast<int64_t>(hk) * kD;
    const bf16* v_base = p.v + static_cast<int64_t>(b) * p.T * kv_stride + static_cast<int64_t>(hk) * kD;
    const int32_t* doc = p.doc_ids != nullptr ? p.doc_ids + static_cast<int64_t>(b) * p.T : nullptr;

    if (tid < kDqTileQ) q_doc[tid] = (doc != nullptr && q0 + tid < p.T) ? doc[q0 + tid] : 0;
    const int kv_first = block_run_start(doc, q0, &scan_scratch);
    const int tile_begin = kv_first / kDqTileKV;
    const int tile_end = (q_end + kDqTileKV - 1) / kDqTileKV;

    load_rows<kD>(q_tile, p.q + q_off + q0 * q_stride, q_stride, p.T - q0, kDqTileQ);
    load_rows<kD>(do_tile, p.dout + q_off + q0 * q_stride, q_stride, p.T - q0, kDqTileQ);

    const int warp_q0 = q0 + warp * 16;
    const int row_q[2] = {warp_q0 + lane / 4, warp_q0 + lane / 4 + 8};
    float lse2[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool in = row_q[r] < p.T;
        const int64_t row = (static_cast<int64_t>(b) * p.Hq + h) * p.T + row_q[r];
        lse2[r] = in ? p.lse[row] * kLog2e : 0.0f;
        delta[r] = in ? p.delta[row] : 0.0f;
    }
    float dq[kD / 8][4];
    zero(dq);

    for (int tile = tile_begin; tile < tile_end; ++tile) {
        const int kv0 = tile * kDqTileKV;
        __syncthreads();  // every warp is done with the previous K/V tile
        load_rows<kD>(k_tile, k_base + kv0 * kv_stride, kv_stride, p.T - kv0, kDqTileKV);
        load_rows<kD>(v_tile, v_base + kv0 * kv_stride, kv_stride, p.T - kv0, kDqTileKV);
        cp_async_commit();
        if (tid < kDqTileKV) kv_doc[tid] = (doc != nullptr && kv0 + tid < p.T) ? doc[kv0 + tid] : 0;
        cp_async_wait<0>();
        __syncthreads();

        float s[kNTiles][4];  // S, then P
        zero(s);
        gemm_abt<kD, kNTiles>(s, q_tile, warp * 16, k_tile, lane);
        float dp[kNTiles][4];  // dP, then dS
        zero(dp);
        gemm_abt<kD, kNTiles>(dp, do_tile, warp * 16, v_tile, lane);

        bool full = kv0 + kDqTileKV - 1 <= warp_q0 && warp_q0 + 15 < p.T;
        if (doc != nullptr) {
            const int id = q_doc[warp * 16];
            const bool same =
                kv_doc[lane] == id && kv_doc[lane + 32] == id && (lane >= 16 || q_doc[warp * 16 + lane] == id);
            full = __all_sync(0xffffffffu, same) && full;
        }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                bool allowed = true;
                if (!full) {
                    const int key_local = nt * 8 + (lane % 4) * 2 + (c & 1);
                    const int key = kv0 + key_local;
                    const int qpos = row_q[c / 2];
                    allowed = key <= qpos && qpos < p.T;
                    if (doc != nullptr) allowed = allowed && kv_doc[key_local] == q_doc[qpos - q0];
                }
                const float prob = allowed ? exp2f(s[nt][c] * p.scale_log2 - lse2[c / 2]) : 0.0f;
                dp[nt][c] = prob * (dp[nt][c] - delta[c / 2]);
            }
        }
        gemm_pv<kD, kDqTileKV / 16>(dq, dp, k_tile, lane);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int qpos = row_q[r];
        if (qpos >= p.T) continue;
        bf16* dq_row = p.dq + q_off + static_cast<int64_t>(qpos) * q_stride;
#pragma unroll
        for (int dn = 0; dn < kD / 8; ++dn) {
            const int col = dn * 8 + (lane % 4) * 2;
            *reinterpret_cast<__nv_bfloat162*>(dq_row + col) =
                __floats2bfloat162_rn(dq[dn][2 * r] * p.scale, dq[dn][2 * r + 1] * p.scale);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// launchers

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

void check_shape(const char* what, const AttentionShape& s) {
    MF_CHECK(s.B >= 0 && s.T >= 0 && s.Hq > 0 && s.Hkv > 0, what, ": bad shape B=", s.B, " T=", s.T, " Hq=", s.Hq,
             " Hkv=", s.Hkv);
    MF_CHECK(s.D == 16 || s.D == 32 || s.D == 64 || s.D == 128, what, ": head dim D=", s.D,
             " is not supported (16, 32, 64 or 128)");
    MF_CHECK(s.Hq % s.Hkv == 0, what, ": Hq=", s.Hq, " is not a multiple of Hkv=", s.Hkv);
    MF_CHECK(s.B < (int64_t{1} << 20) && s.T < (int64_t{1} << 30) && s.Hq < (int64_t{1} << 16), what,
             ": shape too large (B=", s.B, " T=", s.T, " Hq=", s.Hq, ")");
    MF_CHECK(s.B * s.T * s.Hq * s.D < (int64_t{1} << 40), what, ": B·T·Hq·D is too large");
    const int64_t blocks = ((s.T + kTileQ - 1) / kTileQ) * s.B * s.Hq;
    MF_CHECK(blocks < (int64_t{1} << 31), what, ": grid of ", blocks, " blocks is too large");
}

float softmax_scale(int64_t D) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))); }

template <int kD>
void launch_forward(const FwdParams& p, cudaStream_t stream) {
    constexpr int kSmem = fwd_smem_bytes<kD>();
    MF_CHECK_CUDA(
        cudaFuncSetAttribute(attention_forward_kernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    const int64_t blocks = static_cast<int64_t>((p.T + kFwdTileQ - 1) / kFwdTileQ) * p.B * p.Hq;
    attention_forward_kernel<kD><<<static_cast<unsigned>(blocks), kThreads, kSmem, stream>>>(p);
    MF_CHECK_CUDA(cudaGetLastError());
}

// The query heads of a KV group are split over `head_splits` blocks per key tile when the (key tile,
// batch row, KV head) blocks alone would not fill the GPU several times over: under the causal mask
// the first key tile has twice the mean work, so with few blocks the longest one sets the time (B=2,
// T=4096, Hkv=4: 512 blocks for ~400 resident slots on an H200). The split blocks write fp32 partial
// dK, dV that a second kernel sums in split order, so the result is still deterministic. On an H200
// (MF_BENCH=1 test_cuda_attention, B=2 T=4096 Hq=32 Hkv=4 D=128, 8-warp dK/dV kernel) the split
// (4 here) took the backward from 1646 to 1441 us with packed 1024-token documents, where each key
// tile has less work, and cost ~35 us (0.8%) on the plain causal mask. A function
// of the shape and the SM count only, unless MOEFORGE_ATTENTION_HEAD_SPLITS=N (a divisor of Hq / Hkv;
// the parity test uses it to cover both paths) chooses.
int dkv_head_splits(const AttentionShape& s) {
    const int64_t group = s.Hq / s.Hkv;
    if (const char* forced = std::getenv("MOEFORGE_ATTENTION_HEAD_SPLITS"); forced != nullptr && *forced != '\0') {
        char* end = nullptr;
        const long n = std::strtol(forced, &end, 10);
        MF_CHECK(*end == '\0' && n >= 1 && group % n == 0, "MOEFORGE_ATTENTION_HEAD_SPLITS=", forced,
                 " must be a divisor of Hq / Hkv = ", group);
        return static_cast<int>(n);
    }
    int device = 0, sms = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    MF_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int64_t blocks = (s.T + kTileKV - 1) / kTileKV * s.B * s.Hkv;
    const int64_t target = int64_t{12} * sms;  // about four waves of three resident blocks per SM
    int splits = 1;
    while (group % (2 * splits) == 0 && blocks * splits < target) splits *= 2;
    return splits;
}

size_t delta_bytes(const AttentionShape& s) {
    return (static_cast<size_t>(s.B * s.Hq * s.T) * sizeof(float) + 255) / 256 * 256;
}
size_t dkv_part_bytes(const AttentionShape& s, int splits) {
    return splits > 1 ? static_cast<size_t>(splits * s.B * s.T * s.Hkv * s.D) * sizeof(float) : 0;
}

template <int kD>
void launch_backward(const BwdParams& p, cudaStream_t stream) {
    constexpr int kSmemDkv = dkv_smem_bytes<kD>();
    constexpr int kSmemDq = dq_smem_bytes<kD>();
    MF_CHECK_CUDA(
        cudaFuncSetAttribute(attention_backward_dkv_kernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemDkv));
    MF_CHECK_CUDA(
        cudaFuncSetAttribute(attention_backward_dq_kernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemDq));
    // The whole unified memory as shared memory, so that the blocks the registers allow all fit.
    for (const void* kernel : {reinterpret_cast<const void*>(attention_backward_dkv_kernel<kD>),
                               reinterpret_cast<const void*>(attention_backward_dq_kernel<kD>)})
        MF_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
    const int64_t dkv_blocks = static_cast<int64_t>((p.T + kTileKV - 1) / kTileKV) * p.B * p.Hkv * p.head_splits;
    attention_backward_dkv_kernel<kD><<<static_cast<unsigned>(dkv_blocks), kDkvThreads, kSmemDkv, stream>>>(p);
    MF_CHECK_CUDA(cudaGetLastError());
    if (p.head_splits > 1) {
        const int64_t n = static_cast<int64_t>(p.B) * p.T * p.Hkv * kD;
        const int64_t blocks = std::min<int64_t>((n / 4 + 255) / 256, int64_t{1} << 16);
        attention_dkv_reduce_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p.dk, p.dv, p.dk_part, p.dv_part,
                                                                                       n, p.head_splits, p.scale);
        MF_CHECK_CUDA(cudaGetLastError());
    }
    const int64_t dq_blocks = static_cast<int64_t>((p.T + kDqTileQ - 1) / kDqTileQ) * p.B * p.Hq;
    attention_backward_dq_kernel<kD><<<static_cast<unsigned>(dq_blocks), kThreads, kSmemDq, stream>>>(p);
    MF_CHECK_CUDA(cudaGetLastError());
}

template <typename Fn>
void dispatch_head_dim(int64_t D, Fn&& fn) {
    switch (D) {
        case 16:
            fn(std::integral_constant<int, 16>{});
            break;
        case 32:
            fn(std::integral_constant<int, 32>{});
            break;
        case 64:
            fn(std::integral_constant<int, 64>{});
            break;
        case 128:
            fn(std::integral_constant<int, 128>{});
            break;
        default:
            MF_FAIL("attention: unsupported head dim ", D);
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// public entries

void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, const int32_t* doc_ids,
                       const AttentionShape& shape, cudaStream_t stream) {
    check_shape("attention_forward", shape);
    if (shape.B == 0 || shape.T == 0) return;
    MF_CHECK(out != nullptr && lse != nullptr && q != nullptr && k != nullptr && v != nullptr,
             "attention_forward: null tensor pointer");
    MF_CHECK(aligned16(out) && aligned16(q) && aligned16(k) && aligned16(v),
             "attention_forward: q, k, v and out must be 16-byte aligned");
    FwdParams p{};
    p.out = out;
    p.lse = lse;
    p.q = q;
    p.k = k;
    p.v = v;
    p.doc_ids = doc_ids;
    p.B = static_cast<int>(shape.B);
    p.T = static_cast<int>(shape.T);
    p.Hq = static_cast<int>(shape.Hq);
    p.Hkv = static_cast<int>(shape.Hkv);
    p.scale_log2 = softmax_scale(shape.D) * kLog2e;
    dispatch_head_dim(shape.D, [&](auto d) { launch_forward<decltype(d)::value>(p, stream); });
}

size_t attention_backward_workspace_bytes(const AttentionShape& shape) {
    check_shape("attention_backward_workspace_bytes", shape);
    return delta_bytes(shape) + 2 * dkv_part_bytes(shape, dkv_head_splits(shape));
}

void attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                        const bf16* out, const float* lse, const int32_t* doc_ids, const AttentionShape& shape,
                        void* workspace, cudaStream_t stream) {
    check_shape("attention_backward", shape);
    if (shape.B == 0 || shape.T == 0) return;
    MF_CHECK(dq != nullptr && dk != nullptr && dv != nullptr && dout != nullptr && q != nullptr && k != nullptr &&
                 v != nullptr && out != nullptr && lse != nullptr && workspace != nullptr,
             "attention_backward: null pointer");
    MF_CHECK(aligned16(dq) && aligned16(dk) && aligned16(dv) && aligned16(dout) && aligned16(q) && aligned16(k) &&
                 aligned16(v) && aligned16(out) && aligned16(workspace),
             "attention_backward: tensors and workspace must be 16-byte aligned");
    float* delta = static_cast<float*>(workspace);
    const int64_t rows = shape.B * shape.T * shape.Hq;
    const int64_t delta_blocks = std::min<int64_t>((rows + 7) / 8, int64_t{1} << 20);
    attention_delta_kernel<<<static_cast<unsigned>(delta_blocks), 256, 0, stream>>>(
        delta, dout, out, static_cast<int>(shape.B), static_cast<int>(shape.T), static_cast<int>(shape.Hq),
        static_cast<int>(shape.D));
    MF_CHECK_CUDA(cudaGetLastError());
    BwdParams p{};
    p.dq = dq;
    p.dk = dk;
    p.dv = dv;
    p.dout = dout;
    p.q = q;
    p.k = k;
    p.v = v;
    p.lse = lse;
    p.delta = delta;
    p.doc_ids = doc_ids;
    p.B = static_cast<int>(shape.B);
    p.T = static_cast<int>(shape.T);
    p.Hq = static_cast<int>(shape.Hq);
    p.Hkv = static_cast<int>(shape.Hkv);
    p.scale = softmax_scale(shape.D);
    p.scale_log2 = p.scale * kLog2e;
    p.head_splits = dkv_head_splits(shape);
    if (p.head_splits > 1) {
        const size_t part = dkv_part_bytes(shape, p.head_splits);
        p.dk_part = reinterpret_cast<float*>(static_cast<char*>(workspace) + delta_bytes(shape));
        p.dv_part = reinterpret_cast<float*>(static_cast<char*>(workspace) + delta_bytes(shape) + part);
    }
    dispatch_head_dim(shape.D, [&](auto d) { launch_backward<decltype(d)::value>(p, stream); });
}

}  // namespace mf::cuda
