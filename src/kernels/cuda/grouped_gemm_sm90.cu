// The grouped forward product on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a):
//   out[r, :] = inp[r, :] · weight[e]ᵀ for the rows r of every group e
// with the offsets on the device, one launch for all groups (no host issue per expert, no host
// copy of the offsets), the same clamping of bad offsets and the same result contract as
// grouped_gemm.cuh's forward (each output element owned by one block, fp32 sums in a fixed k
// order, no atomics).
//
// Tiles and grid: a block owns one 128 x 128 output tile (a row tile of one group x a column tile);
// tiles are numbered across groups exactly like the sm80 kernel's (a prefix of row tiles per group
// in shared memory, a binary search for the group), and the grid is sized for the worst case so
// the host never reads the offsets. Two warpgroups each multiply 64 rows of the tile with
// wgmma.m64n128k16 (bf16 in, fp32 accumulators in registers).
// Main loop: K in slices of 64 through a 3-stage cp.async ring; each stage holds the A slice
// (128 rows x 64 k) and the B slice (128 columns x 64 k), both K-major with rows of 128 bytes in
// the 128-byte swizzle wgmma reads (16-byte chunk c of row r stored at chunk c ^ (r % 8), stages
// 1024-byte aligned); rows past the group's end are zero-filled. Per slice: wait for its copies,
// fence them to the async proxy, barrier, issue the 4 k16 wgmmas, let the previous slice's wgmmas
// finish, barrier, and refill the stage they read.
#include <cstdint>

#include "core/check.h"
#include "core/cuda_check.h"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/grouped_gemm_sm90.cuh"
#include "kernels/cuda/mma_sm80.cuh"

namespace mf::cuda {

namespace {

constexpr int kTile = 128;  // rows (M) and columns (N) of a block's output tile
constexpr int kSliceK = 64;  // bf16 per 128-byte smem row
constexpr int kStages = 3;
constexpr int kThreads = 256;  // two warpgroups
constexpr int kOperandBytes = kTile * kSliceK * 2;  // 16 KB
constexpr int kStageBytes = 2 * kOperandBytes;
constexpr int kRingBytes = kStages * kStageBytes;  // 96 KB
constexpr int kAlign = 1024;                       // the swizzle atom: 8 rows of 128 bytes
constexpr int kChunksPerThread = kTile * kSliceK / 8 / kThreads;  // 16-byte chunks per operand slice

size_t smem_bytes(int64_t num_experts) {
    return kAlign + kRingBytes + 2 * static_cast<size_t>(num_experts + 1) * sizeof(int);
}

// wgmma shared-memory matrix descriptor: K-major, 128-byte swizzle, rows of 128 bytes, 8-row atoms
// 1024 bytes apart. Fields (in 16-byte units): start address [0, 14), leading byte offset
// [16, 30) (unused by swizzled K-major layouts, 1 by convention), stride byte offset [32, 46);
// layout type [62, 64) = 1 (128-byte swizzle).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
    uint64_t desc = (addr & 0x3FFFFu) >> 4;
    desc |= uint64_t{1} << 16;
    desc |= uint64_t{1024 >> 4} << 32;
    desc |= uint64_t{1} << 62;
    return desc;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (64 x 128 fp32, this warpgroup's fragment) += A (64 x 16 at desc_a) · B (16 x 128 at desc_b).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, 1, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b));
}

// One operand slice (128 K-major rows x 64 k) into a swizzled stage buffer; rows >= rows_valid are
// zero-filled (nothing read).
__device__ __forceinline__ void load_slice(unsigned char* stage, const bf16* rows, int64_t ld, int rows_valid, int k0,
                                           int tid) {
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
        const int chunk = tid + j * kThreads;
        const int r = chunk / 8, c = chunk % 8;
        const bool valid = r < rows_valid;
        unsigned char* dst = stage + r * 128 + ((c ^ (r % 8)) * 16);
        cp_async_16(dst, valid ? rows + r * ld + k0 + c * 8 : rows, valid);
    }
}

// Clamped offsets and the exclusive prefix of row tiles per group (the sm80 kernel's table).
__device__ void build_table(int* begin, int* tile_prefix, const int32_t* offsets, int num_experts, int num_rows) {
    const int tid = static_cast<int>(threadIdx.x);
    for (int e = tid; e <= num_experts; e += kThreads) begin[e] = offsets[e];
    __syncthreads();
    if (tid < 32) {
        const int lane = tid;
        constexpr unsigned kFull = 0xffffffffu;
        int carry = 0;
        for (int base = 0; base <= num_experts; base += 32) {  // running maximum, clamped to [0, num_rows]
            const int e = base + lane;
            int v = e <= num_experts ? min(max(begin[e], 0), num_rows) : num_rows;
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int other = __shfl_up_sync(kFull, v, d);
                if (lane >= d) v = max(v, other);
            }
            v = max(v, carry);
            if (e <= num_experts) begin[e] = v;
            carry = __shfl_sync(kFull, v, 31);
        }
        __syncwarp();
        carry = 0;
        for (int base = 0; base <= num_experts; base += 32) {  // tiles of groups 0 .. e - 1
            const int e = base + lane;
            int v = (e >= 1 && e <= num_experts) ? (begin[e] - begin[e - 1] + kTile - 1) / kTile : 0;
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int other = __shfl_up_sync(kFull, v, d);
                if (lane >= d) v += other;
            }
            v += carry;
            if (e <= num_experts) tile_prefix[e] = v;
            carry = __shfl_sync(kFull, v, 31);
        }
    }
    __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 2)
    grouped_forward_wgmma_kernel(bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int num_rows,
                                 int num_experts, int N, int K) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* ring = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(smem_raw) + kAlign - 1) / kAlign * kAlign);
    int* begin = reinterpret_cast<int*>(ring + kRingBytes);
    int* tile_prefix = begin + num_experts + 1;
    build_table(begin, tile_prefix, offsets, num_experts, num_rows);

    const int col_tiles = N / kTile;
    const int row_tile = static_cast<int>(blockIdx.x) / col_tiles;
    const int col_tile = static_cast<int>(blockIdx.x) % col_tiles;
    if (row_tile >= tile_prefix[num_experts]) return;  // uniform across the block
    int lo = 0, hi = num_experts;  // tile_prefix[lo] <= row_tile < tile_prefix[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (tile_prefix[mid] <= row_tile)
            lo = mid;
        else
            hi = mid;
    }
    const int expert = lo;
    const int row0 = begin[expert] + (row_tile - tile_prefix[expert]) * kTile;
    const int rows_valid = min(kTile, begin[expert + 1] - row0);
    const int n0 = col_tile * kTile;
    const bf16* a_rows = inp + static_cast<int64_t>(row0) * K;
    const bf16* b_rows = weight + (static_cast<int64_t>(expert) * N + n0) * K;

    const int tid = static_cast<int>(threadIdx.x);
    const int warpgroup = tid / 128;
    const int slices = K / kSliceK;
    auto stage_a = [&](int s) { return ring + s * kStageBytes; };
    auto stage_b = [&](int s) { return ring + s * kStageBytes + kOperandBytes; };
    auto load = [&](int slice) {
        const int s = slice % kStages;
        load_slice(stage_a(s), a_rows, K, rows_valid, slice * kSliceK, tid);
        load_slice(stage_b(s), b_rows, K, kTile, slice * kSliceK, tid);
    };

    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < slices) load(s);
        cp_async_commit();
    }
    for (int slice = 0; slice < slices; ++slice) {
        cp_async_wait<kStages - 2>();
        fence_async_proxy();
        __syncthreads();
        const int s = slice % kStages;
        const uint32_t a_addr = smem_u32(stage_a(s)) + warpgroup * 64 * 128;
        const uint32_t b_addr = smem_u32(stage_b(s));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kSliceK / 16; ++kk)
            wgmma_m64n128k16(acc, smem_desc(a_addr + kk * 32), smem_desc(b_addr + kk * 32));
        wgmma_commit();
        wgmma_wait<1>();  // the previous slice's products are done: its stage may be refilled
        __syncthreads();
        if (slice + kStages - 1 < slices) load(slice + kStages - 1);
        cp_async_commit();
    }
    wgmma_wait<0>();

    // Accumulator fragment of m64nNk16: warp w of the warpgroup holds rows 16w .. 16w + 15; lane
    // l = 4g + t holds, for each 8-column block j, (row g, cols 8j + 2t, +1) in acc[4j], acc[4j+1]
    // and (row g + 8, same cols) in acc[4j+2], acc[4j+3].
    const int lane = tid % 32, warp = (tid % 128) / 32;
    const int g = lane / 4, t = lane % 4;
    const int r_lo = warpgroup * 64 + warp * 16 + g, r_hi = r_lo + 8;
    bf16* out_tile = out + static_cast<int64_t>(row0) * N + n0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int col = 8 * j + 2 * t;
        if (r_lo < rows_valid)
            *reinterpret_cast<__nv_bfloat162*>(out_tile + static_cast<int64_t>(r_lo) * N + col) =
                __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
        if (r_hi < rows_valid)
            *reinterpret_cast<__nv_bfloat162*>(out_tile + static_cast<int64_t>(r_hi) * N + col) =
                __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
    }
}

}  // namespace

bool grouped_matmul_forward_sm90_supported(int64_t C, int64_t OC) {
    static const bool hopper = [] {
        int device = 0, major = 0, minor = 0;
        if (cudaGetDevice(&device) != cudaSuccess) return false;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
        if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
        return major == 9 && minor == 0;
    }();
    return hopper && C > 0 && C % kSliceK == 0 && OC > 0 && OC % kTile == 0;
}

void grouped_matmul_forward_sm90(bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int64_t M,
                                 int64_t E, int64_t C, int64_t OC, cudaStream_t stream) {
    check_grouped_args("grouped_matmul_forward_sm90", out, inp, weight, offsets, M, E, C, OC);
    MF_CHECK(grouped_matmul_forward_sm90_supported(C, OC), "grouped_matmul_forward_sm90: needs an sm_90 GPU, C % ",
             kSliceK, " == 0 and OC % ", kTile, " == 0 (C=", C, ", OC=", OC, ")");
    if (M == 0 || E == 0) return;
    const int64_t row_tiles = (M + kTile - 1) / kTile + E;  // Σ_e ceil(rows_e / 128) never exceeds this
    const int64_t blocks = row_tiles * (OC / kTile);
    MF_CHECK(blocks < (int64_t{1} << 31), "grouped_matmul_forward_sm90: grid of ", blocks, " blocks is too large");
    const size_t smem = smem_bytes(E);
    MF_CHECK_CUDA(cudaFuncSetAttribute(grouped_forward_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    grouped_forward_wgmma_kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
        out, inp, weight, offsets, static_cast<int>(M), static_cast<int>(E), static_cast<int>(OC), static_cast<int>(C));
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
