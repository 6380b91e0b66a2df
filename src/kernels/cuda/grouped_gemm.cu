// Grouped GEMMs over device-side expert row groups: one tensor-core kernel body, three uses.
//
// Every output tile is 128 x 128, owned by one block of 8 warps (2 x 4, each warp 64 x 32), which
// runs the whole K loop for it: BK = 64 slices of A and B stream through a 3-stage cp.async ring
// in shared memory (zero-filled past the matrix edges), warps read fragments with ldmatrix
// (.trans where the operand is not K-contiguous) and multiply with mma.sync.m16n8k16 bf16 -> fp32.
// The three products differ only in operand layouts and in how a block finds its tile:
//   forward          A = inp rows (K = C contiguous), B = weight[e] as [OC][C] (K contiguous)
//   backward input   A = dout rows (K = OC contiguous), B = weight[e] as [OC][C] (N = C contiguous)
//   backward weight  A = doutᵀ (M = OC contiguous), B = inp (N = C contiguous), K = the group's rows
// Row-group products (the first two) number their tiles across experts: every block loads the
// E + 1 offsets, clamps them (see the header), and a warp scan turns them into a prefix of row
// tiles per expert; blockIdx.x = row_tile · col_tiles + col_tile, and a binary search over that
// prefix gives the expert. The grid is sized for the worst case (ceil(M / 128) + E row tiles), so
// the host never reads the offsets; surplus blocks exit. Weight-gradient tiles are (expert,
// OC tile, C tile), so each dweight tile has exactly one owner and no atomics are needed.
#include <cstdint>

#include "core/check.h"
#include "core/cuda_check.h"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/mma_sm80.cuh"

namespace mf::cuda {

namespace {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;
constexpr int kBlockK = 64;
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kWarpM = 64;  // warps are laid out 2 (M) x 4 (N)
constexpr int kWarpN = 32;
constexpr int kPad = 8;  // bf16 elements of row padding: rows 16 bytes apart mod 128, so ldmatrix is conflict-free
constexpr int kKMajorLd = kBlockK + kPad;      // tile stored [outer 128][k 64 + pad]
constexpr int kOuterMajorLd = kBlockM + kPad;  // tile stored [k 64][outer 128 + pad]
constexpr int kKMajorElems = kBlockM * kKMajorLd;
constexpr int kOuterMajorElems = kBlockK * kOuterMajorLd;
constexpr int kOperandElems = kKMajorElems > kOuterMajorElems ? kKMajorElems : kOuterMajorElems;
constexpr int kStageElems = 2 * kOperandElems;
constexpr int kSmemBytes = kStages * kStageElems * static_cast<int>(sizeof(bf16));
static_assert(kBlockM == kBlockN, "one operand tile shape serves A and B");
constexpr int kChunksPerThread = kBlockM * kBlockK / 8 / kThreads;  // 16-byte chunks per operand and stage
static_assert(kChunksPerThread * kThreads * 8 == kBlockM * kBlockK, "chunks divide evenly among threads");

// ---------------------------------------------------------------------------------------------
// tile loads and fragment reads
//
// An operand tile covers 128 "outer" indices (M for A, N for B) by BK k indices. K-major operands
// (element (o, k) at ptr[o · ld + k]) are stored [o][k]; outer-major ones (ptr[k · ld + o]) are
// stored [k][o]. outer_valid / k_valid bound the indices that exist; both are multiples of 8 along
// the contiguous dimension (checked on the host), so a 16-byte chunk is all in or all out.

template <bool kKMajor>
__device__ __forceinline__ void load_operand(bf16* tile, const bf16* ptr, int64_t ld, int outer_valid, int k_valid,
                                             int k0, int tid) {
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
        const int chunk = tid + j * kThreads;
        if constexpr (kKMajor) {
            const int o = chunk / (kBlockK / 8);
            const int kc = (chunk % (kBlockK / 8)) * 8;
            const bool valid = o < outer_valid && k0 + kc < k_valid;
            cp_async_16(tile + o * kKMajorLd + kc, valid ? ptr + o * ld + (k0 + kc) : ptr, valid);
        } else {
            const int kr = chunk / (kBlockM / 8);
            const int oc = (chunk % (kBlockM / 8)) * 8;
            const bool valid = k0 + kr < k_valid && oc < outer_valid;
            cp_async_16(tile + kr * kOuterMajorLd + oc, valid ? ptr + (k0 + kr) * ld + oc : ptr, valid);
        }
    }
}

// A fragment (16 x 16 at rows m0, k columns kk) in the register order of mma's A operand:
// r0 = rows 0-7 / k 0-7, r1 = rows 8-15 / k 0-7, r2 = rows 0-7 / k 8-15, r3 = rows 8-15 / k 8-15.
template <bool kKMajor>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const bf16* tile, int m0, int kk, int lane) {
    if constexpr (kKMajor) {
        const int row = m0 + (lane % 8) + ((lane / 8) % 2) * 8;
        const int col = kk + (lane / 16) * 8;
        ldmatrix_x4(a, tile + row * kKMajorLd + col);
    } else {
        const int krow = kk + (lane % 8) + (lane / 16) * 8;
        const int mcol = m0 + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(a, tile + krow * kOuterMajorLd + mcol);
    }
}

// B fragments of two n8 tiles (n0 and n0 + 8) for k columns kk: b[i][0] = k 0-7, b[i][1] = k 8-15.
template <bool kKMajor>
__device__ __forceinline__ void load_b_frags(uint32_t (&b)[2][2], const bf16* tile, int n0, int kk, int lane) {
    uint32_t r[4];
    if constexpr (kKMajor) {
        const int row = n0 + (lane % 8) + (lane / 16) * 8;
        const int col = kk + ((lane / 8) % 2) * 8;
        ldmatrix_x4(r, tile + row * kKMajorLd + col);
    } else {
        const int krow = kk + (lane % 8) + ((lane / 8) % 2) * 8;
        const int ncol = n0 + (lane / 16) * 8;
        ldmatrix_x4_trans(r, tile + krow * kOuterMajorLd + ncol);
    }
    b[0][0] = r[0];
    b[0][1] = r[1];
    b[1][0] = r[2];
    b[1][1] = r[3];
}

// ---------------------------------------------------------------------------------------------
// the block's main loop: acc (warp tile 64 x 32 = 4 x 4 mma tiles) = A[128, K] · B[K, 128]

struct Operand {
    const bf16* ptr;  // element (outer 0, k 0) of this block's tile
    int64_t ld;
    int outer_valid;  // outer indices < outer_valid exist
};

template <bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void tile_product(float (&acc)[4][4][4], const Operand& a, const Operand& b, int k_valid,
                                             bf16* smem) {
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int warp_m0 = (warp / 4) * kWarpM;
    const int warp_n0 = (warp % 4) * kWarpN;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

    const int num_k_tiles = (k_valid + kBlockK - 1) / kBlockK;
    auto load_stage = [&](int stage, int k_tile) {
        bf16* base = smem + stage * kStageElems;
        load_operand<kAKMajor>(base, a.ptr, a.ld, a.outer_valid, k_valid, k_tile * kBlockK, tid);
        load_operand<kBKMajor>(base + kOperandElems, b.ptr, b.ld, b.outer_valid, k_valid, k_tile * kBlockK, tid);
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_k_tiles) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < num_k_tiles; ++kt) {
        // The group of k tile kt is complete once at most kStages - 2 younger groups are pending;
        // the barrier also retires every warp's reads of the stage the next prefetch overwrites.
        cp_async_wait<kStages - 2>();
        __syncthreads();
        const int next = kt + kStages - 1;
        if (next < num_k_tiles) load_stage(next % kStages, next);
        cp_async_commit();

        const bf16* a_tile = smem + (kt % kStages) * kStageElems;
        const bf16* b_tile = a_tile + kOperandElems;
#pragma unroll
        for (int kk = 0; kk < kBlockK; kk += 16) {
            uint32_t af[4][4];
            uint32_t bfr[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) load_a_frag<kAKMajor>(af[i], a_tile, warp_m0 + i * 16, kk, lane);
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                uint32_t pair[2][2];
                load_b_frags<kBKMajor>(pair, b_tile, warp_n0 + p * 16, kk, lane);
                bfr[2 * p][0] = pair[0][0];
                bfr[2 * p][1] = pair[0][1];
                bfr[2 * p + 1][0] = pair[1][0];
                bfr[2 * p + 1][1] = pair[1][1];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], af[i], bfr[j][0], bfr[j][1]);
        }
    }
    cp_async_wait<0>();
}

// ---------------------------------------------------------------------------------------------
// epilogue: acc -> out[rows_valid, cols_valid] (ld = ldo), written or added to the stored value

__device__ __forceinline__ void store_pair(bf16* p, float v0, float v1, bool accumulate) {
    if (accumulate) {
        const float2 old = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
        v0 += old.x;
        v1 += old.y;
    }
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
}
__device__ __forceinline__ void store_pair(float* p, float v0, float v1, bool accumulate) {
    if (accumulate) {
        const float2 old = *reinterpret_cast<const float2*>(p);
        v0 += old.x;
        v1 += old.y;
    }
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
}

template <typename OutT>
__device__ __forceinline__ void store_tile(const float (&acc)[4][4][4], OutT* out, int64_t ldo, int rows_valid,
                                           int cols_valid, bool accumulate) {
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int warp_m0 = (warp / 4) * kWarpM;
    const int warp_n0 = (warp % 4) * kWarpN;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = warp_n0 + j * 8 + (lane % 4) * 2;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = warp_m0 + i * 16 + lane / 4 + half * 8;
                if (row < rows_valid && col < cols_valid)
                    store_pair(out + row * ldo + col, acc[i][j][2 * half], acc[i][j][2 * half + 1], accumulate);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// group table: clamped offsets and the prefix of row tiles per expert, in shared memory

// Lives in dynamic shared memory after the operand ring: 2 · (E + 1) ints.
struct GroupTable {
    int* begin;        // [E + 1] clamped offsets
    int* tile_prefix;  // [E + 1] Σ_{e' < e} ceil(rows_e' / 128)
};

__device__ __forceinline__ GroupTable group_table_in(unsigned char* smem_raw, int num_experts) {
    int* base = reinterpret_cast<int*>(smem_raw + kSmemBytes);
    return GroupTable{base, base + num_experts + 1};
}

size_t smem_bytes_for(int64_t num_experts) { return kSmemBytes + 2 * (num_experts + 1) * sizeof(int); }

__device__ void build_group_table(const GroupTable& table, const int32_t* offsets, int num_experts, int num_rows) {
    const int tid = static_cast<int>(threadIdx.x);
    for (int e = tid; e <= num_experts; e += kThreads) table.begin[e] = offsets[e];
    __syncthreads();
    if (tid < 32) {
        const int lane = tid;
        constexpr unsigned kFull = 0xffffffffu;
        // Running maximum, clamped to [0, num_rows]: offsets become non-decreasing and in range.
        int carry = 0;
        for (int base = 0; base <= num_experts; base += 32) {
            const int e = base + lane;
            int v = e <= num_experts ? min(max(table.begin[e], 0), num_rows) : num_rows;
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int other = __shfl_up_sync(kFull, v, d);
                if (lane >= d) v = max(v, other);
            }
            v = max(v, carry);
            if (e <= num_experts) table.begin[e] = v;
            carry = __shfl_sync(kFull, v, 31);
        }
        __syncwarp();
        // Exclusive prefix of row tiles: entry e counts the tiles of experts 0 .. e - 1.
        carry = 0;
        for (int base = 0; base <= num_experts; base += 32) {
            const int e = base + lane;
            int v = (e >= 1 && e <= num_experts) ? (table.begin[e] - table.begin[e - 1] + kBlockM - 1) / kBlockM : 0;
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int other = __shfl_up_sync(kFull, v, d);
                if (lane >= d) v += other;
            }
            v += carry;
            if (e <= num_experts) table.tile_prefix[e] = v;
            carry = __shfl_sync(kFull, v, 31);
        }
    }
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// kernels

// Row-group products: out[r, 0:N] = A[r, 0:K] · B_e for r in group e. A is K-major with ld = K;
// B_e = b + e · K · N is weight[e], K-major ([N][K], forward) or N-major ([K][N], backward input).
template <bool kBKMajor>
__global__ void __launch_bounds__(kThreads, 2)
    grouped_rows_kernel(bf16* out, const bf16* a, const bf16* b, const int32_t* offsets, int num_rows, int num_experts,
                        int N, int K, bool accumulate) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const GroupTable table = group_table_in(smem_raw, num_experts);
    build_group_table(table, offsets, num_experts, num_rows);

    const int col_tiles = (N + kBlockN - 1) / kBlockN;
    const int row_tile = static_cast<int>(blockIdx.x) / col_tiles;
    const int col_tile = static_cast<int>(blockIdx.x) % col_tiles;
    if (row_tile >= table.tile_prefix[num_experts]) return;  // uniform across the block
    // Binary search, invariant tile_prefix[lo] <= row_tile < tile_prefix[hi].
    int lo = 0, hi = num_experts;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (table.tile_prefix[mid] <= row_tile)
            lo = mid;
        else
            hi = mid;
    }
    const int expert = lo;
    const int row0 = table.begin[expert] + (row_tile - table.tile_prefix[expert]) * kBlockM;
    const int rows_valid = min(kBlockM, table.begin[expert + 1] - row0);
    const int n0 = col_tile * kBlockN;

    const bf16* weight = b + static_cast<int64_t>(expert) * K * N;
    const Operand a_op{a + static_cast<int64_t>(row0) * K, K, rows_valid};
    const Operand b_op =
        kBKMajor ? Operand{weight + static_cast<int64_t>(n0) * K, K, N - n0} : Operand{weight + n0, N, N - n0};
    float acc[4][4][4];
    tile_product<true, kBKMajor>(acc, a_op, b_op, K, reinterpret_cast<bf16*>(smem_raw));
    store_tile(acc, out + static_cast<int64_t>(row0) * N + n0, N, rows_valid, N - n0, accumulate);
}

// Weight gradient: dweight[e][m, n] += Σ_r dout[r, m] · inp[r, n] over the rows r of group e.
// M = OC (A = doutᵀ, M-major, ld = OC), N = C (B = inp, N-major, ld = C), K = the group's rows.
template <typename OutT>
__global__ void __launch_bounds__(kThreads, 2)
    grouped_weight_grad_kernel(OutT* dweight, const bf16* dout, const bf16* inp, const int32_t* offsets, int num_rows,
                               int num_experts, int OC, int C) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const GroupTable table = group_table_in(smem_raw, num_experts);
    build_group_table(table, offsets, num_experts, num_rows);

    const int m_tiles = (OC + kBlockM - 1) / kBlockM;
    const int n_tiles = (C + kBlockN - 1) / kBlockN;
    const int tiles_per_expert = m_tiles * n_tiles;
    const int expert = static_cast<int>(blockIdx.x) / tiles_per_expert;
    const int rem = static_cast<int>(blockIdx.x) % tiles_per_expert;
    const int m0 = (rem / n_tiles) * kBlockM;
    const int n0 = (rem % n_tiles) * kBlockN;
    const int row0 = table.begin[expert];
    const int rows = table.begin[expert + 1] - row0;
    if (rows == 0) return;  // an empty group adds nothing

    const Operand a_op{dout + static_cast<int64_t>(row0) * OC + m0, OC, OC - m0};
    const Operand b_op{inp + static_cast<int64_t>(row0) * C + n0, C, C - n0};
    float acc[4][4][4];
    tile_product<false, false>(acc, a_op, b_op, rows, reinterpret_cast<bf16*>(smem_raw));
    OutT* tile_out = dweight + static_cast<int64_t>(expert) * OC * C + static_cast<int64_t>(m0) * C + n0;
    store_tile(acc, tile_out, C, OC - m0, C - n0, /*accumulate=*/true);
}

// ---------------------------------------------------------------------------------------------
// launchers

template <typename Kernel>
void set_smem_limit(Kernel kernel, size_t bytes) {
    MF_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

void launch_rows(bool b_k_major, bf16* out, const bf16* a, const bf16* b, const int32_t* offsets, int64_t M, int64_t E,
                 int64_t N, int64_t K, bool accumulate, cudaStream_t stream) {
    const int64_t row_tiles = (M + kBlockM - 1) / kBlockM + E;  // Σ_e ceil(rows_e / 128) never exceeds this
    const int64_t col_tiles = (N + kBlockN - 1) / kBlockN;
    const int64_t blocks = row_tiles * col_tiles;
    MF_CHECK(blocks < (int64_t{1} << 31), "grouped_matmul: grid of ", blocks, " blocks is too large");
    if (blocks == 0) return;
    const auto args = [&](auto kernel) {
        const size_t smem = smem_bytes_for(E);
        set_smem_limit(kernel, smem);
        kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(out, a, b, offsets, static_cast<int>(M),
                                                                          static_cast<int>(E), static_cast<int>(N),
                                                                          static_cast<int>(K), accumulate);
    };
    if (b_k_major)
        args(grouped_rows_kernel<true>);
    else
        args(grouped_rows_kernel<false>);
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// public entries

void check_grouped_args(const char* what, const void* x, const void* y, const void* z, const int32_t* offsets,
                        int64_t M, int64_t E, int64_t C, int64_t OC) {
    auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    MF_CHECK(M >= 0 && E >= 0 && C >= 0 && OC >= 0, what, ": negative shape M=", M, " E=", E, " C=", C, " OC=", OC);
    MF_CHECK(E <= kMaxGroupedExperts, what, ": E=", E, " experts exceeds the supported ", kMaxGroupedExperts);
    MF_CHECK(M < (int64_t{1} << 31) && C < (int64_t{1} << 31) && OC < (int64_t{1} << 31), what,
             ": shape exceeds int32 (M=", M, " C=", C, " OC=", OC, ")");
    MF_CHECK(C % 8 == 0 && OC % 8 == 0, what, ": C=", C, " and OC=", OC, " must be multiples of 8");
    MF_CHECK(E == 0 || OC == 0 || C <= INT64_MAX / OC / E, what, ": weight size E·OC·C overflows");
    MF_CHECK(offsets != nullptr, what, ": offsets is null");
    MF_CHECK(x != nullptr && y != nullptr && z != nullptr, what, ": null tensor pointer");
    MF_CHECK(aligned16(x) && aligned16(y) && aligned16(z), what, ": tensor pointers must be 16-byte aligned");
}

void grouped_matmul_forward(bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int64_t M,
                            int64_t E, int64_t C, int64_t OC, cudaStream_t stream) {
    check_grouped_args("grouped_matmul_forward", out, inp, weight, offsets, M, E, C, OC);
    if (M == 0 || E == 0 || OC == 0) return;
    launch_rows(/*b_k_major=*/true, out, inp, weight, offsets, M, E, /*N=*/OC, /*K=*/C, false, stream);
}

void grouped_matmul_backward_input(bf16* dinp, const bf16* dout, const bf16* weight, const int32_t* offsets, int64_t M,
                                   int64_t E, int64_t C, int64_t OC, bool accumulate, cudaStream_t stream) {
    check_grouped_args("grouped_matmul_backward_input", dinp, dout, weight, offsets, M, E, C, OC);
    if (M == 0 || E == 0 || C == 0) return;
    launch_rows(/*b_k_major=*/false, dinp, dout, weight, offsets, M, E, /*N=*/C, /*K=*/OC, accumulate, stream);
}

void grouped_matmul_backward_weight(void* dweight, DType dweight_dtype, const bf16* dout, const bf16* inp,
                                    const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                                    cudaStream_t stream) {
    check_grouped_args("grouped_matmul_backward_weight", dweight, dout, inp, offsets, M, E, C, OC);
    MF_CHECK(dweight_dtype == DType::f32 || dweight_dtype == DType::bf16,
             "grouped_matmul_backward_weight: dweight must be f32 or bf16, got ", dtype_name(dweight_dtype));
    if (M == 0 || E == 0 || C == 0 || OC == 0) return;
    const int64_t tiles_per_expert = ((OC + kBlockM - 1) / kBlockM) * ((C + kBlockN - 1) / kBlockN);
    const int64_t blocks = E * tiles_per_expert;
    MF_CHECK(blocks < (int64_t{1} << 31), "grouped_matmul_backward_weight: grid of ", blocks, " blocks is too large");
    const auto launch = [&](auto kernel, auto* typed_dweight) {
        const size_t smem = smem_bytes_for(E);
        set_smem_limit(kernel, smem);
        kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(typed_dweight, dout, inp, offsets,
                                                                          static_cast<int>(M), static_cast<int>(E),
                                                                          static_cast<int>(OC), static_cast<int>(C));
    };
    if (dweight_dtype == DType::f32)
        launch(grouped_weight_grad_kernel<float>, static_cast<float*>(dweight));
    else
        launch(grouped_weight_grad_kernel<bf16>, static_cast<bf16*>(dweight));
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
