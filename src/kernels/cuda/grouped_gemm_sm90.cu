// The grouped products on Hopper (sm_90a), offsets on the device, one persistent launch per product
// for all groups (no host issue per expert, no host copy of the offsets), the same clamping of bad
// offsets and the same result contract as grouped_gemm.cuh (each output element owned by one block,
// fp32 sums in a fixed k order, no atomics):
//   forward          out[r, :] = inp[r, :] · weight[e]ᵀ        (rows r of group e)
//   input gradient   dinp[r, :] = dout[r, :] · weight[e]       (written)
//   weight gradient  dweight[e] (+)= Σ_r dout[r, :]ᵀ · inp[r, :]
//
// Tiles: 128 x 256 outputs; the row products number their tiles across groups (a prefix of row
// tiles per group in shared memory, a binary search for the group), the weight gradient group by
// group. One block per SM takes tiles b, b + grid, ...
// Warp specialisation: warpgroup 0 is the producer (one thread issues the tensor-memory-accelerator
// loads, the rest give their registers away with setmaxnreg), warpgroups 1 and 2 each multiply 64
// rows of the tile with wgmma.m64n256k16 (bf16 in, fp32 accumulators in registers). A 4-stage ring
// in shared memory holds K slices of 64: the A slice (128 rows) and the B slice (256 columns),
// loaded by TMA with the 128-byte swizzle that wgmma's descriptors read (K-major, or MN-major for
// the transposed operands). Each stage has a "full" mbarrier (the producer arms it with the slice's
// bytes, the TMA completes it) and an "empty" one (each consumer warpgroup arrives once its wgmmas
// on the slice are done); the producer runs into the next tile while the consumers store.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "core/check.h"
#include "core/cuda_check.h"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/grouped_gemm_sm90.cuh"
#include "kernels/cuda/mbarrier_sm90.cuh"
#include "kernels/cuda/mma_sm80.cuh"
#include "kernels/cuda/swiglu.cuh"

namespace mf::cuda {

namespace {

constexpr int kTileM = 128;
constexpr int kTileN = 256;
constexpr int kSliceK = 64;    // bf16 per 128-byte smem row
constexpr int kStoreCols = 8;  // bf16 per 16-byte store: the granule of a tile's valid columns
constexpr int kStages = 4;
constexpr int kThreads = 384;                  // producer warpgroup + two consumer warpgroups
constexpr int kABytes = kTileM * kSliceK * 2;  // 16 KB
constexpr int kBBytes = kTileN * kSliceK * 2;  // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kRingBytes = kStages * kStageBytes;  // 192 KB
constexpr int kAlign = 1024;                       // the swizzle atom: 8 rows of 128 bytes
constexpr int kBarrierBytes = 2 * kStages * 8;

size_t smem_bytes(int64_t num_experts) {
    return kAlign + kRingBytes + kBarrierBytes + 3 * static_cast<size_t>(num_experts + 1) * sizeof(int);
}

// wgmma shared-memory matrix descriptor with the 128-byte swizzle (8-row atoms of 128-byte rows,
// 1024 bytes). Fields (in 16-byte units): start address [0, 14), leading byte offset [16, 30),
// stride byte offset [32, 46); layout type [62, 64) = 1 (128-byte swizzle).
// K-major operand (rows of 64 K values): the stride offset steps 8 rows (1024 bytes); the leading
// offset is unused (1 by convention).
// MN-major operand (rows of 64 M or N values, one row per K index, in boxes of 64 K rows x 64
// columns): the stride offset steps 8 K rows (1024 bytes), the leading offset one box of columns
// (64 x 128 = 8192 bytes).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading = 16) {
    uint64_t desc = (addr & 0x3FFFFu) >> 4;
    desc |= uint64_t{(leading >> 4) & 0x3FFFu} << 16;
    desc |= uint64_t{1024 >> 4} << 32;
    desc |= uint64_t{1} << 62;
    return desc;
}
constexpr uint32_t kMnBoxBytes = 64 * 128;  // one 64 x 64 box of an MN-major operand

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Arrives once where `pred` holds: a predicate inside the instruction, not a branch around it, so
// that the warp does not split (see converge()).
__device__ __forceinline__ void mbar_arrive_if(uint64_t* bar, bool pred) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(static_cast<uint32_t>(pred))
        : "memory");
}
// Rejoins the warp's lanes before an .aligned instruction (bar.sync, wgmma) that follows code whose
// control flow differs by lane (a loop's trip count, an epilogue's stored rows and columns): every
// lane of the warp must execute such an instruction together.
__device__ __forceinline__ void converge() { __syncwarp(); }
// The consumer warpgroup's 128 threads meet (named barrier 2 + consumer; 0 is __syncthreads', 1 the
// weight gradient's two consumer warpgroups) before each tile's wgmma sequence. Without it the warps of
// one warpgroup may leave a tile's epilogue far apart, and that hangs the warpgroup: the SwiGLU
// backward, whose warps with rows to store wait for their loads of h while the warps with none in a
// group's last tile go straight on, hung within a few hundred calls at J1's geometry (test
// Sm90RepeatedCallsFinishAndRepeat), with or without its lanes rejoined, with the loads unbranched or
// bypassing L1; with the loads replaced by arithmetic, or a 20 µs sleep in every warp's epilogue
// (slow, but alike for all warps), it ran; with this barrier it runs (H200, 2026-12-04: 3 x 1000
// calls of each kernel at 4888 and 18994 rows).
__device__ __forceinline__ void warpgroup_sync(int consumer) {
    converge();
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + consumer) : "memory");
}

// A 2-D tile of `map` at (c0 innermost, c1) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
        "[%2];\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
        : "memory");
}

// d (64 x 256 fp32, this warpgroup's fragment) += A (64 x 16 at desc_a) · B (16 x 256 at desc_b);
// kTransA / kTransB: the operand is MN-major in shared memory (else K-major).
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, 1, 1, 1, %130, %131;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
          "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
          "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),
          "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),
          "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),
          "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),
          "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),
          "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),
          "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),
          "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
          "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB));
}

// Warp-wide: the running maximum of table[0 .. num_experts], each entry clamped to [0, num_rows]
// first (the clamping of bad offsets).
__device__ void clamp_offsets(int* table, int num_experts, int num_rows) {
    const int lane = static_cast<int>(threadIdx.x) % 32;
    constexpr unsigned kFull = 0xffffffffu;
    int carry = 0;
    for (int base = 0; base <= num_experts; base += 32) {
        const int e = base + lane;
        int v = e <= num_experts ? min(max(table[e], 0), num_rows) : num_rows;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
            const int other = __shfl_up_sync(kFull, v, d);
            if (lane >= d) v = max(v, other);
        }
        v = max(v, carry);
        if (e <= num_experts) table[e] = v;
        carry = __shfl_sync(kFull, v, 31);
    }
}

// Clamped offsets (and a second table when `offsets2` is given), and the exclusive prefix of row
// tiles per group of the first (the sm80 kernel's table). Ends with a block barrier.
__device__ void build_table(int* begin, int* begin2, int* tile_prefix, const int32_t* offsets, const int32_t* offsets2,
                            int num_experts, int num_rows) {
    const int tid = static_cast<int>(threadIdx.x);
    for (int e = tid; e <= num_experts; e += kThreads) {
        begin[e] = offsets[e];
        if (offsets2 != nullptr) begin2[e] = offsets2[e];
    }
    __syncthreads();
    if (tid < 32) {
        clamp_offsets(begin, num_experts, num_rows);
        __syncwarp();
        const int lane = tid;
        constexpr unsigned kFull = 0xffffffffu;
        int carry = 0;
        for (int base = 0; base <= num_experts; base += 32) {  // tiles of groups 0 .. e - 1
            const int e = base + lane;
            int v = (e >= 1 && e <= num_experts) ? (begin[e] - begin[e - 1] + kTileM - 1) / kTileM : 0;
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int other = __shfl_up_sync(kFull, v, d);
                if (lane >= d) v += other;
            }
            v += carry;
            if (e <= num_experts) tile_prefix[e] = v;
            carry = __shfl_sync(kFull, v, 31);
        }
    } else if (tid < 64 && offsets2 != nullptr) {
        clamp_offsets(begin2, num_experts, num_rows);
    }
    __syncthreads();
}

// One accumulator row of this lane as bf16 in 16-byte pieces: the lane holds columns 8j + 2t and + 1
// (t = lane % 4) at acc[4j + kHalf] and acc[4j + kHalf + 1], j < 32 (kHalf 0: the fragment's row g,
// 2: row g + 8). Within each run of four 8-column blocks (run m: blocks 4m .. 4m + 3) the quad's
// lanes swap values (two xor shuffles, a 4 x 4 transpose) so that lane t holds all of block 4m + t:
// row_piece returns that piece (8 bf16, rounded to nearest); a warp's store of a run then covers 64
// contiguous bytes per row instead of 16 (full 32-byte sectors). Every lane of the warp takes part.
template <int kHalf>
__device__ __forceinline__ uint4 row_piece(const float (&acc)[128], int m) {
    const int t = static_cast<int>(threadIdx.x) % 4;
    const bool bit1 = (t & 2) != 0, bit0 = (t & 1) != 0;
    constexpr unsigned kFull = 0xffffffffu;
    uint32_t v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const __nv_bfloat162 pair =
            __floats2bfloat162_rn(acc[4 * (4 * m + q) + kHalf], acc[4 * (4 * m + q) + kHalf + 1]);
        v[q] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    uint32_t x0 = __shfl_xor_sync(kFull, bit1 ? v[0] : v[2], 2), x1 = __shfl_xor_sync(kFull, bit1 ? v[1] : v[3], 2);
    if (bit1) {
        v[0] = x0, v[1] = x1;
    } else {
        v[2] = x0, v[3] = x1;
    }
    x0 = __shfl_xor_sync(kFull, bit0 ? v[0] : v[1], 1), x1 = __shfl_xor_sync(kFull, bit0 ? v[2] : v[3], 1);
    if (bit0) {
        v[0] = x0, v[2] = x1;
    } else {
        v[1] = x0, v[3] = x1;
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}

// The lane's row of the tile stored at `row` (256 columns); `store` says whether this lane's row is
// written, and only the first `cols_valid` columns of it are (a multiple of 8: a tile that overhangs
// the matrix's last column).
template <int kHalf>
__device__ __forceinline__ void store_row_bf16(bf16* row, const float (&acc)[128], bool store, int cols_valid) {
    const int t = static_cast<int>(threadIdx.x) % 4;
#pragma unroll
    for (int m = 0; m < kTileN / 32; ++m) {
        const uint4 piece = row_piece<kHalf>(acc, m);
        if (store && 8 * (4 * m + t) < cols_valid) *reinterpret_cast<uint4*>(row + 8 * (4 * m + t)) = piece;
    }
}

// The SwiGLU forward epilogue of a tile whose columns 0 .. 127 are gate columns j0 .. j0 + 127 of h and
// 128 .. 255 the up columns I + j0 ..: the lane's row of h (gate at h_row, up at h_row + I) and of
// a = silu(gate) · up (at a_row), computed from h as stored (bf16), as swiglu_forward does.
template <int kHalf>
__device__ __forceinline__ void store_row_swiglu(bf16* h_row, bf16* a_row, int64_t I, const float (&acc)[128],
                                                 bool store, int cols_valid) {
    const int t = static_cast<int>(threadIdx.x) % 4;
#pragma unroll
    for (int m = 0; m < kTileN / 64; ++m) {
        const uint4 gate = row_piece<kHalf>(acc, m), up = row_piece<kHalf>(acc, m + kTileN / 64);
        const int col = 8 * (4 * m + t);
        if (!store || col >= cols_valid) continue;
        float g[8], u[8], y[8];
        detail::unpack<8>(g, gate);
        detail::unpack<8>(u, up);
#pragma unroll
        for (int e = 0; e < 8; ++e) y[e] = swiglu_value(g[e], u[e]);
        *reinterpret_cast<uint4*>(h_row + col) = gate;
        *reinterpret_cast<uint4*>(h_row + I + col) = up;
        detail::store_f32<8>(a_row + col, y);
    }
}

// The SwiGLU backward epilogue of an input-gradient tile da (columns n0 .. of the [M, I] product):
// the lane's row of dh (gate gradient at dh_row, up gradient at dh_row + I) from da as it would be
// stored (bf16) and h (at h_row, h_row + I), as swiglu_backward does; da itself is not stored.
template <int kHalf>
__device__ __forceinline__ void store_row_swiglu_backward(bf16* dh_row, const bf16* h_row, int64_t I,
                                                          const float (&acc)[128], bool store, int cols_valid) {
    const int t = static_cast<int>(threadIdx.x) % 4;
#pragma unroll
    for (int m = 0; m < kTileN / 32; ++m) {
        const uint4 da = row_piece<kHalf>(acc, m);
        const int col = 8 * (4 * m + t);
        if (!store || col >= cols_valid) continue;
        float d[8], g[8], u[8], dg[8], du[8];
        detail::unpack<8>(d, da);
        detail::load_f32<8>(g, h_row + col);
        detail::load_f32<8>(u, h_row + I + col);
#pragma unroll
        for (int e = 0; e < 8; ++e) swiglu_grad(g[e], u[e], d[e], dg[e], du[e]);
        detail::store_f32<8>(dh_row + col, dg);
        detail::store_f32<8>(dh_row + I + col, du);
    }
}

// The block's shared memory: a ring of kStages slices (A, then B), each with a "full" barrier (the
// producer's arrive plus the copy engine's bytes) and an "empty" one (one arrive per consumer
// warpgroup), then the group table (build_table). Slice g of the block's sequence uses stage
// g % kStages, in phase g / kStages.
struct Ring {
    unsigned char* base;
    uint64_t* full;
    uint64_t* empty;
    int* begin;
    int* tile_prefix;
    int* begin2;  // the weight gradient's second row table (when given)

    __device__ unsigned char* stage(int g) const { return base + (g % kStages) * kStageBytes; }
    // Producer: waits until slice g's stage is free, arms its barrier with a slice's bytes.
    __device__ uint64_t* acquire(int g) const {
        const int s = g % kStages;
        mbar_wait(&empty[s], ((g / kStages) & 1) ^ 1);
        mbar_arrive_expect_tx(&full[s], kStageBytes);
        return &full[s];
    }
    // Consumers: slice g has arrived; slice g is no longer read (every thread of the warpgroup
    // calls it, thread 0 of the warpgroup arrives).
    __device__ void wait_full(int g) const { mbar_wait(&full[g % kStages], (g / kStages) & 1); }
    __device__ void release(int g) const {
        mbar_arrive_if(&empty[g % kStages], static_cast<int>(threadIdx.x) % 128 == 0);
    }
};

// Carves the ring, initialises its barriers and builds the table(s); ends with a block barrier.
__device__ __forceinline__ Ring setup_ring(const int32_t* offsets, const int32_t* offsets2, int num_experts,
                                           int num_rows) {
    extern __shared__ unsigned char smem_raw[];
    Ring ring;
    ring.base =
        reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + kAlign - 1) / kAlign * kAlign);
    ring.full = reinterpret_cast<uint64_t*>(ring.base + kRingBytes);
    ring.empty = ring.full + kStages;
    ring.begin = reinterpret_cast<int*>(ring.empty + kStages);
    ring.tile_prefix = ring.begin + num_experts + 1;
    ring.begin2 = ring.tile_prefix + num_experts + 1;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(&ring.full[s], 1);
            mbar_init(&ring.empty[s], 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    build_table(ring.begin, ring.begin2, ring.tile_prefix, offsets, offsets2, num_experts, num_rows);
    return ring;
}

// The row tile's group: the e with tile_prefix[e] <= row_tile < tile_prefix[e + 1].
__device__ __forceinline__ int group_of_tile(const int* tile_prefix, int num_experts, int row_tile) {
    int lo = 0, hi = num_experts;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (tile_prefix[mid] <= row_tile)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// out[r, n] = Σ_k a[r, k] · b_e[n, k] over the rows r of every group e, for the two row products:
// forward (kBackwardInput false): a = inp [M][K = C], b_e = weight[e] [N = OC][K], K-major;
// input gradient (true): a = dout [M][K = OC], b_e = weight[e]ᵀ, read from weight[e] [K][N = C] as
// an MN-major operand.
// map_a: a as [M][K] (K innermost), boxes of 128 rows x 64; map_b: the weights as [E·OC][C], boxes
// of 256 rows x 64 (forward) or 64 rows x 64 (input gradient: four boxes side by side per slice);
// both with the 128-byte swizzle. Persistent: block b takes tiles b, b + grid, ... (column tiles
// fastest, so the blocks at work share row tiles and a group's weights in L2); the producer runs on
// into the next tile's slices while the consumers store the last one, and the ring's stage and
// phase count on across tiles (slice g of the block's sequence uses stage g % 4).
// Epilogues (RowsOut): plain, out [M][N]; swiglu (forward only), N = I and the weights [E][2I][K]:
// a tile's B slice is two boxes of 128 rows, gate rows j0 .. j0 + 127 and up rows I + j0 .. (map_b's
// boxes 128 rows), its columns pairs of I / 128 column tiles, stored as h [M][2I] and a [M][I]
// (store_row_swiglu); swiglu_backward (input gradient only), N = I: da never stored, dh [M][2I]
// from it and h (store_row_swiglu_backward).
enum class RowsEpilogue { plain, swiglu, swiglu_backward };
// Columns of N per tile: 256, or 128 pairs for the SwiGLU forward (256 columns of h).
constexpr int tile_cols(RowsEpilogue epi) { return epi == RowsEpilogue::swiglu ? kTileN / 2 : kTileN; }

struct RowsOut {
    bf16* out;      // plain: out; swiglu: h; swiglu_backward: dh
    bf16* act;      // swiglu: a
    const bf16* h;  // swiglu_backward: h
};

template <bool kBackwardInput, RowsEpilogue kEpi>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_rows_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                              const RowsOut dst, const int32_t* offsets, int num_rows, int num_experts, int N, int K) {
    static_assert(kEpi != RowsEpilogue::swiglu || !kBackwardInput, "the SwiGLU epilogue is the forward's");
    static_assert(kEpi != RowsEpilogue::swiglu_backward || kBackwardInput, "the SwiGLU gradient is the input's");
    constexpr int kTileCols = tile_cols(kEpi);
    const Ring ring = setup_ring(offsets, nullptr, num_experts, num_rows);
    const int* begin = ring.begin;
    const int* tile_prefix = ring.tile_prefix;
    const int tid = static_cast<int>(threadIdx.x);

    const int col_tiles = (N + kTileCols - 1) / kTileCols;  // the last one may overhang N (see the store)
    const int num_tiles = tile_prefix[num_experts] * col_tiles;
    const int slices = K / kSliceK;
    const int warpgroup = tid / 128;

    if (warpgroup == 0) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int g = 0;  // the block's slice sequence number
            for (int tile = static_cast<int>(blockIdx.x); tile < num_tiles; tile += static_cast<int>(gridDim.x)) {
                const int row_tile = tile / col_tiles;
                const int expert = group_of_tile(tile_prefix, num_experts, row_tile);
                const int row0 = begin[expert] + (row_tile - tile_prefix[expert]) * kTileM;
                const int n0 = (tile % col_tiles) * kTileCols;
                for (int i = 0; i < slices; ++i, ++g) {
                    uint64_t* full = ring.acquire(g);
                    unsigned char* stage = ring.stage(g);
                    tma_load_2d(stage, &map_a, full, i * kSliceK, row0);
                    if constexpr (kBackwardInput) {
#pragma unroll
                        for (int j = 0; j < kTileN / 64; ++j)
                            tma_load_2d(stage + kABytes + j * kMnBoxBytes, &map_b, full, n0 + 64 * j,
                                        expert * K + i * kSliceK);
                    } else if constexpr (kEpi == RowsEpilogue::swiglu) {  // gate rows, then up rows
                        tma_load_2d(stage + kABytes, &map_b, full, i * kSliceK, expert * 2 * N + n0);
                        tma_load_2d(stage + kABytes + kBBytes / 2, &map_b, full, i * kSliceK, expert * 2 * N + N + n0);
                    } else {
                        tma_load_2d(stage + kABytes, &map_b, full, i * kSliceK, expert * N + n0);
                    }
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int consumer = warpgroup - 1;  // rows 64·consumer .. + 63 of the tile
    // Accumulator fragment of m64nNk16: warp w of the warpgroup holds rows 16w .. 16w + 15; lane
    // l = 4g + t holds, for each 8-column block j, (row g, cols 8j + 2t, +1) in acc[4j], acc[4j+1]
    // and (row g + 8, same cols) in acc[4j+2], acc[4j+3].
    const int lane = tid % 32, warp = (tid % 128) / 32;
    const int r_lo = consumer * 64 + warp * 16 + lane / 4, r_hi = r_lo + 8;
    int g = 0;
    for (int tile = static_cast<int>(blockIdx.x); tile < num_tiles; tile += static_cast<int>(gridDim.x)) {
        warpgroup_sync(consumer);  // after the last tile's epilogue
        const int row_tile = tile / col_tiles;
        const int expert = group_of_tile(tile_prefix, num_experts, row_tile);
        const int row0 = begin[expert] + (row_tile - tile_prefix[expert]) * kTileM;
        const int rows_valid = min(kTileM, begin[expert + 1] - row0);
        if (consumer * 64 >= rows_valid) {
            // A group's last tile with no rows in this warpgroup's half: no products (the other
            // warpgroup then has the tensor cores to itself), only the ring's protocol, as below.
            for (int i = 0; i < slices; ++i, ++g) {
                ring.wait_full(g);
                if (g > 0) ring.release(g - 1);
            }
            continue;
        }
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
        for (int i = 0; i < slices; ++i, ++g) {
            ring.wait_full(g);
            const uint32_t a_addr = smem_u32(ring.stage(g)) + consumer * 64 * 128;
            const uint32_t b_addr = smem_u32(ring.stage(g) + kABytes);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kSliceK / 16; ++kk) {
                if constexpr (kBackwardInput)  // 16 K rows of 128 bytes per step
                    wgmma_m64n256k16<0, 1>(acc, smem_desc(a_addr + kk * 32),
                                           smem_desc(b_addr + kk * 2048, kMnBoxBytes));
                else
                    wgmma_m64n256k16<0, 0>(acc, smem_desc(a_addr + kk * 32), smem_desc(b_addr + kk * 32));
            }
            wgmma_commit();
            // The slice before is done (within this tile, or the previous tile's last, already
            // waited for): release its stage. The block's very last slice is never waited for.
            wgmma_wait<1>();
            if (g > 0) ring.release(g - 1);
        }
        wgmma_wait<0>();
        const int n0 = (tile % col_tiles) * kTileCols, cols_valid = min(kTileCols, N - n0);
        const int64_t lo = row0 + r_lo, hi = row0 + r_hi;
        if constexpr (kEpi == RowsEpilogue::plain) {
            store_row_bf16<0>(dst.out + lo * N + n0, acc, r_lo < rows_valid, cols_valid);
            store_row_bf16<2>(dst.out + hi * N + n0, acc, r_hi < rows_valid, cols_valid);
        } else if constexpr (kEpi == RowsEpilogue::swiglu) {
            store_row_swiglu<0>(dst.out + lo * 2 * N + n0, dst.act + lo * N + n0, N, acc, r_lo < rows_valid,
                                cols_valid);
            store_row_swiglu<2>(dst.out + hi * 2 * N + n0, dst.act + hi * N + n0, N, acc, r_hi < rows_valid,
                                cols_valid);
        } else {
            store_row_swiglu_backward<0>(dst.out + lo * 2 * N + n0, dst.h + lo * 2 * N + n0, N, acc, r_lo < rows_valid,
                                         cols_valid);
            store_row_swiglu_backward<2>(dst.out + hi * 2 * N + n0, dst.h + hi * 2 * N + n0, N, acc, r_hi < rows_valid,
                                         cols_valid);
        }
    }
}

// Two adjacent fp32 sums into a gradient (written, or added to its values in fp32 and rounded once);
// returns the two values stored.
__device__ __forceinline__ float2 store_pair(float* p, float x, float y, bool accumulate) {
    float2 v = make_float2(x, y);
    if (accumulate) {
        const float2 old = *reinterpret_cast<const float2*>(p);
        v.x += old.x;
        v.y += old.y;
    }
    *reinterpret_cast<float2*>(p) = v;
    return v;
}
__device__ __forceinline__ float2 store_pair(bf16* p, float x, float y, bool accumulate) {
    if (accumulate) {
        const float2 old = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
        x += old.x;
        y += old.y;
    }
    const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    *reinterpret_cast<__nv_bfloat162*>(p) = v;
    return __bfloat1622float2(v);
}

// x² + y² (fp32: a thread's 128 squares are summed in fp32, then in double from there on; the
// conversions to double cost more than the tile's epilogue otherwise does).
__device__ __forceinline__ float square_pair(float2 v) { return fmaf(v.x, v.x, v.y * v.y); }

// Round `round` of a snake schedule over `grid` blocks: this block's tile is the blockIdx.x-th of the
// round's `grid` tiles, counted forward in even rounds and backward in odd ones; tiles numbered by
// decreasing cost then pair a heavier with a lighter one round after round.
__device__ __forceinline__ int snake_tile(int round, int grid) {
    const int b = static_cast<int>(blockIdx.x);
    return round * grid + ((round & 1) == 0 ? b : grid - 1 - b);
}

// The weight gradient: dweight[e][o, c] (+)= Σ_{r in group e} dout[r, o] · inp[r, c], over every
// group e (a group without rows gets zeros, or keeps its values when accumulating). The rows are
// the reduction: a = doutᵀ (M = OC) and b = inp (N = C), both read MN-major in boxes of 64 rows x
// 64 columns (A: two per slice, one per consumer; B: four). Tiles of 128 x 256 of one group's
// gradient, numbered group-major (column tiles fastest) with the groups by decreasing rows (a tile's
// cost is its group's rows) and dealt to the blocks in a snake order (snake_tile), so that the
// blocks' sums of rows come out even (plain round-robin over uneven groups leaves some blocks far
// behind the mean). A group's last slice may run past its rows: the consumers zero those rows of
// both operands in shared memory (rows of the next group, or zeros past M) before multiplying.
// map_a: dout as [M][OC]; map_b: inp as [M][C]; boxes of 64 x 64, 128-byte swizzle.
// With `squares`, each consumer warp also writes the sum of the squares of the values it stored
// (as stored: rounded, accumulated) to squares[tile · 8 + its warp]: per lane in fp32 over its 128
// values in a fixed order, then in double over a xor butterfly, so the result does not depend on the
// schedule.
template <typename TW>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_weight_grad_wgmma_kernel(const __grid_constant__ CUtensorMap map_a,
                                     const __grid_constant__ CUtensorMap map_b, TW* dweight, const int32_t* offsets,
                                     const int32_t* offsets2, int num_rows, int num_experts, int OC, int C,
                                     bool accumulate, double* squares) {
    const Ring ring = setup_ring(offsets, offsets2, num_experts, num_rows);
    const int parts = offsets2 != nullptr ? 2 : 1;
    // A group's rows: [t[e], t[e + 1]) of each table t, in table order.
    const auto table = [&](int part) -> const int* { return part == 0 ? ring.begin : ring.begin2; };
    const auto group_rows = [&](int part, int e) { return table(part)[e + 1] - table(part)[e]; };
    const int tid = static_cast<int>(threadIdx.x);
    // The groups by decreasing rows (ties by index), over the row products' tile table: the tiles
    // are numbered in this order, so the heaviest go first.
    int* order = ring.tile_prefix;
    for (int e = tid; e < num_experts; e += kThreads) {
        const int rows = group_rows(0, e) + (parts > 1 ? group_rows(1, e) : 0);
        int rank = 0;
        for (int f = 0; f < num_experts; ++f) {
            const int other = group_rows(0, f) + (parts > 1 ? group_rows(1, f) : 0);
            rank += (other > rows || (other == rows && f < e)) ? 1 : 0;
        }
        order[rank] = e;
    }
    __syncthreads();

    // The last row and column tiles may overhang OC and C: their loads past the matrices' ends read
    // zeros (the maps' bounds), so those sums are zero and are not stored.
    const int c_tiles = (C + kTileN - 1) / kTileN, tiles_per_group = ((OC + kTileM - 1) / kTileM) * c_tiles;
    const int num_tiles = num_experts * tiles_per_group, grid = static_cast<int>(gridDim.x);
    struct TileAt {
        int expert, o0, c0;  // the group, and the tile's first gradient row and column
    };
    const auto weight_tile = [&](int tile) {
        const int within = tile % tiles_per_group;
        return TileAt{order[tile / tiles_per_group], (within / c_tiles) * kTileM, (within % c_tiles) * kTileN};
    };
    const int warpgroup = tid / 128;

    if (warpgroup == 0) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int g = 0;
            for (int round = 0; round * grid < num_tiles; ++round) {
                const int tile = snake_tile(round, grid);
                if (tile >= num_tiles) continue;
                const auto [expert, o0, c0] = weight_tile(tile);
                for (int part = 0; part < parts; ++part) {
                    const int r_begin = table(part)[expert];
                    const int slices = (group_rows(part, expert) + kSliceK - 1) / kSliceK;
                    for (int i = 0; i < slices; ++i, ++g) {
                        uint64_t* full = ring.acquire(g);
                        unsigned char* stage = ring.stage(g);
                        const int r = r_begin + i * kSliceK;
#pragma unroll
                        for (int j = 0; j < kTileM / 64; ++j)
                            tma_load_2d(stage + j * kMnBoxBytes, &map_a, full, o0 + 64 * j, r);
#pragma unroll
                        for (int j = 0; j < kTileN / 64; ++j)
                            tma_load_2d(stage + kABytes + j * kMnBoxBytes, &map_b, full, c0 + 64 * j, r);
                    }
                }
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int consumer = warpgroup - 1;  // gradient rows 64·consumer .. + 63 of the tile
    const int lane = tid % 32, warp = (tid % 128) / 32;
    const int r_lo = consumer * 64 + warp * 16 + lane / 4, r_hi = r_lo + 8;
    const int c_lane = 2 * (lane % 4);
    int g = 0;
    for (int round = 0; round * grid < num_tiles; ++round) {
        const int tile = snake_tile(round, grid);
        if (tile >= num_tiles) continue;
        const auto [expert, o0, c0] = weight_tile(tile);
        warpgroup_sync(consumer);  // after the last tile's epilogue
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
        for (int part = 0; part < parts; ++part) {
            const int rows = group_rows(part, expert), slices = (rows + kSliceK - 1) / kSliceK;
            for (int i = 0; i < slices; ++i, ++g) {
                ring.wait_full(g);
                unsigned char* stage = ring.stage(g);
                const int valid = min(kSliceK, rows - i * kSliceK);
                if (valid < kSliceK) {  // zero rows valid .. 63 of the six boxes (a row is 128 bytes in any swizzle)
                    const int per_box = (kSliceK - valid) * 8;  // 16-byte words
                    for (int w = tid - 128; w < 6 * per_box; w += 256) {
                        const int box = w / per_box, k = w % per_box;
                        reinterpret_cast<uint4*>(stage + box * kMnBoxBytes + valid * 128)[k] = make_uint4(0, 0, 0, 0);
                    }
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    converge();                                       // the loop's trip count differs by lane
                    asm volatile("bar.sync 1, 256;\n" ::: "memory");  // both consumer warpgroups
                }
                const uint32_t a_addr = smem_u32(stage) + consumer * kMnBoxBytes;
                const uint32_t b_addr = smem_u32(stage + kABytes);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < kSliceK / 16; ++kk)
                    wgmma_m64n256k16<1, 1>(acc, smem_desc(a_addr + kk * 2048, kMnBoxBytes),
                                           smem_desc(b_addr + kk * 2048, kMnBoxBytes));
                wgmma_commit();
                wgmma_wait<1>();
                if (g > 0) ring.release(g - 1);
            }
        }
        wgmma_wait<0>();
        TW* out_tile = dweight + (static_cast<int64_t>(expert) * OC + o0) * C + c0;
        const int rows_valid = min(kTileM, OC - o0), cols_valid = min(kTileN, C - c0);
        float sq = 0.0f;
        bool stored = false;
        if constexpr (std::is_same_v<TW, bf16>) {
            if (!accumulate) {
                // (The squares of the values not stored are those zero sums.)
                store_row_bf16<0>(out_tile + static_cast<int64_t>(r_lo) * C, acc, r_lo < rows_valid, cols_valid);
                store_row_bf16<2>(out_tile + static_cast<int64_t>(r_hi) * C, acc, r_hi < rows_valid, cols_valid);
                if (squares != nullptr)
#pragma unroll
                    for (int i = 0; i < 128; i += 2)
                        sq += square_pair(__bfloat1622float2(__floats2bfloat162_rn(acc[i], acc[i + 1])));
                stored = true;
            }
        }
        if (!stored) {
#pragma unroll
            for (int j = 0; j < kTileN / 8; ++j) {
                const int col = 8 * j + c_lane;
                if (col >= cols_valid) continue;
                if (r_lo < rows_valid) {
                    const float2 lo = store_pair(out_tile + static_cast<int64_t>(r_lo) * C + col, acc[4 * j],
                                                 acc[4 * j + 1], accumulate);
                    if (squares != nullptr) sq += square_pair(lo);
                }
                if (r_hi < rows_valid) {
                    const float2 hi = store_pair(out_tile + static_cast<int64_t>(r_hi) * C + col, acc[4 * j + 2],
                                                 acc[4 * j + 3], accumulate);
                    if (squares != nullptr) sq += square_pair(hi);
                }
            }
        }
        if (squares != nullptr) {
            double warp_sq = sq;
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) warp_sq += __shfl_xor_sync(0xffffffffu, warp_sq, offset);
            if (lane == 0) squares[static_cast<int64_t>(tile) * 8 + consumer * 4 + warp] = warp_sq;
        }
    }
}

// Σ parts[i] in double in one fixed order, in two launches (a single block walking them all is
// bound by load latency: ~50 µs for the 10^5 parts of a layer's gradient): block b of kSumBlocks
// sums its contiguous share (thread t: elements t, t + 256, ... of it, then a fixed tree) into
// block_sums[b]; then one block adds those in a fixed tree, *out += the total.
constexpr int kSumBlocks = 128;

__device__ __forceinline__ double block_sum_256(double s) {
    __shared__ double partial[256];
    partial[threadIdx.x] = s;
    __syncthreads();
    for (int width = 128; width > 0; width >>= 1) {
        if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
        __syncthreads();
    }
    return partial[0];
}

__global__ void __launch_bounds__(256) sum_parts_kernel(double* block_sums, const double* parts, int64_t n) {
    const int64_t share = (n + kSumBlocks - 1) / kSumBlocks, first = blockIdx.x * share, end = min(n, first + share);
    double s = 0.0;
    for (int64_t i = first + threadIdx.x; i < end; i += 256) s += parts[i];
    s = block_sum_256(s);
    if (threadIdx.x == 0) block_sums[blockIdx.x] = s;
}

__global__ void __launch_bounds__(256) add_block_sums_kernel(double* out, const double* block_sums) {
    const double s = block_sum_256(static_cast<int>(threadIdx.x) < kSumBlocks ? block_sums[threadIdx.x] : 0.0);
    if (threadIdx.x == 0) *out += s;
}

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no link to libcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
        MF_CHECK_CUDA(
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status));
        MF_CHECK(status == cudaDriverEntryPointSuccess && ptr != nullptr,
                 "grouped matmul (sm90): the driver has no cuTensorMapEncodeTiled");
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }();
    return fn;
}

// A bf16 [rows][cols] row-major matrix (cols innermost) read in boxes of box_rows x 64 with the
// 128-byte swizzle; rows past the end read as zeros.
CUtensorMap tile_map(const bf16* base, int64_t rows, int64_t cols, int box_rows) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(bf16)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(kSliceK), static_cast<cuuint32_t>(box_rows)};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(base), dims, strides,
                                      box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    MF_CHECK(r == CUDA_SUCCESS, "grouped matmul (sm90): cuTensorMapEncodeTiled failed (", static_cast<int>(r),
             ") for a [", rows, ", ", cols, "] bf16 matrix");
    return map;
}

int sm_count() {
    static const int sms = [] {
        int device = 0, count = 0;
        MF_CHECK_CUDA(cudaGetDevice(&device));
        MF_CHECK_CUDA(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
        return count;
    }();
    return sms;
}

std::atomic<int> g_reserved_sms{0};

// Blocks of a persistent launch: one per SM, less the SMs reserved for other streams' kernels.
int persistent_blocks() { return std::max(1, sm_count() - g_reserved_sms.load(std::memory_order_relaxed)); }

bool sm90_device() {
    static const bool hopper = [] {
        int device = 0, major = 0, minor = 0;
        if (cudaGetDevice(&device) != cudaSuccess) return false;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
        if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
        return major == 9 && minor == 0;
    }();
    return hopper;
}

// One launch of the row-product kernel: out [M][N] from a [M][K] and the weights [E][N or K][...]
// (the SwiGLU forward: [E][2N][K]), stored by epilogue kEpi into dst.
template <bool kBackwardInput, RowsEpilogue kEpi = RowsEpilogue::plain>
void launch_rows(const char* what, const RowsOut& dst, const bf16* a, const bf16* weight, const int32_t* offsets,
                 int64_t M, int64_t E, int64_t N, int64_t K, cudaStream_t stream) {
    constexpr int kTileCols = tile_cols(kEpi);
    const int64_t row_tiles = (M + kTileM - 1) / kTileM + E;  // Σ_e ceil(rows_e / 128) never exceeds this
    MF_CHECK(E <= kSm90MaxGroups, what, ": at most ", kSm90MaxGroups, " groups (E=", E, ")");
    const int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
    MF_CHECK(row_tiles * col_tiles < (int64_t{1} << 31), what, ": ", row_tiles * col_tiles, " tiles is too many");
    if (M == 0 || E == 0) return;
    const int64_t blocks = std::min<int64_t>(persistent_blocks(), row_tiles * col_tiles);
    const CUtensorMap map_a = tile_map(a, M, K, kTileM);
    const CUtensorMap map_b = kBackwardInput                 ? tile_map(weight, E * K, N, 64)
                              : kEpi == RowsEpilogue::swiglu ? tile_map(weight, E * 2 * N, K, kTileN / 2)
                                                             : tile_map(weight, E * N, K, kTileN);
    const size_t smem = smem_bytes(E);
    const auto kernel = grouped_rows_wgmma_kernel<kBackwardInput, kEpi>;
    MF_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
        map_a, map_b, dst, offsets, static_cast<int>(M), static_cast<int>(E), static_cast<int>(N), static_cast<int>(K));
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void set_grouped_gemm_sm90_reserved_sms(int sms) { g_reserved_sms.store(std::max(sms, 0), std::memory_order_relaxed); }

// The reduction dimension in whole slices of 64; the output's columns (and the weight gradient's
// rows) in 16-byte pieces: rows of the matrices 16-byte aligned, as the tensor maps need, and a tile
// that overhangs the last column stores whole pieces.
bool grouped_matmul_forward_sm90_supported(int64_t C, int64_t OC) {
    return sm90_device() && C > 0 && C % kSliceK == 0 && OC > 0 && OC % kStoreCols == 0;
}

bool grouped_matmul_backward_weight_sm90_supported(int64_t C, int64_t OC) {
    return sm90_device() && OC > 0 && OC % kStoreCols == 0 && C > 0 && C % kStoreCols == 0;
}

bool grouped_matmul_backward_input_sm90_supported(int64_t C, int64_t OC) {
    return sm90_device() && OC > 0 && OC % kSliceK == 0 && C > 0 && C % kStoreCols == 0;
}

void grouped_matmul_forward_sm90(bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int64_t M,
                                 int64_t E, int64_t C, int64_t OC, cudaStream_t stream) {
    check_grouped_args("grouped_matmul_forward_sm90", out, inp, weight, offsets, M, E, C, OC);
    MF_CHECK(grouped_matmul_forward_sm90_supported(C, OC), "grouped_matmul_forward_sm90: needs an sm_90 GPU, C % ",
             kSliceK, " == 0 and OC % ", kStoreCols, " == 0 (C=", C, ", OC=", OC, ")");
    launch_rows<false>("grouped_matmul_forward_sm90", RowsOut{out, nullptr, nullptr}, inp, weight, offsets, M, E, OC, C,
                       stream);
}

bool grouped_matmul_forward_swiglu_sm90_supported(int64_t C, int64_t I) {
    return grouped_matmul_forward_sm90_supported(C, 2 * I) && I > 0 && I % kStoreCols == 0;
}

void grouped_matmul_forward_swiglu_sm90(bf16* h, bf16* a, const bf16* inp, const bf16* weight, const int32_t* offsets,
                                        int64_t M, int64_t E, int64_t C, int64_t I, cudaStream_t stream) {
    const char* what = "grouped_matmul_forward_swiglu_sm90";
    check_grouped_args(what, h, inp, weight, offsets, M, E, C, 2 * I);
    MF_CHECK(M == 0 || E == 0 || a != nullptr, what, ": null a");
    MF_CHECK(grouped_matmul_forward_swiglu_sm90_supported(C, I), what, ": needs an sm_90 GPU, C % ", kSliceK,
             " == 0 and I % ", kStoreCols, " == 0 (C=", C, ", I=", I, ")");
    launch_rows<false, RowsEpilogue::swiglu>(what, RowsOut{h, a, nullptr}, inp, weight, offsets, M, E, I, C, stream);
}

void grouped_matmul_backward_input_sm90(bf16* dinp, const bf16* dout, const bf16* weight, const int32_t* offsets,
                                        int64_t M, int64_t E, int64_t C, int64_t OC, cudaStream_t stream) {
    check_grouped_args("grouped_matmul_backward_input_sm90", dinp, dout, weight, offsets, M, E, C, OC);
    MF_CHECK(grouped_matmul_backward_input_sm90_supported(C, OC),
             "grouped_matmul_backward_input_sm90: needs an sm_90 GPU, OC % ", kSliceK, " == 0 and C % ", kStoreCols,
             " == 0 (C=", C, ", OC=", OC, ")");
    launch_rows<true>("grouped_matmul_backward_input_sm90", RowsOut{dinp, nullptr, nullptr}, dout, weight, offsets, M,
                      E, C, OC, stream);
}

bool grouped_matmul_backward_swiglu_sm90_supported(int64_t I, int64_t OC) {
    return grouped_matmul_backward_input_sm90_supported(I, OC);
}

void grouped_matmul_backward_swiglu_sm90(bf16* dh, const bf16* dout, const bf16* weight, const bf16* h,
                                         const int32_t* offsets, int64_t M, int64_t E, int64_t I, int64_t OC,
                                         cudaStream_t stream) {
    const char* what = "grouped_matmul_backward_swiglu_sm90";
    check_grouped_args(what, dh, dout, weight, offsets, M, E, I, OC);
    MF_CHECK(M == 0 || E == 0 || h != nullptr, what, ": null h");
    MF_CHECK(grouped_matmul_backward_swiglu_sm90_supported(I, OC), what, ": needs an sm_90 GPU, OC % ", kSliceK,
             " == 0 and I % ", kStoreCols, " == 0 (I=", I, ", OC=", OC, ")");
    launch_rows<true, RowsEpilogue::swiglu_backward>(what, RowsOut{dh, nullptr, h}, dout, weight, offsets, M, E, I, OC,
                                                     stream);
}

// The weight gradient's tiles: E groups of ceil(OC / 128) x ceil(C / 256).
static int64_t weight_grad_tiles(int64_t E, int64_t C, int64_t OC) {
    return E * ((OC + kTileM - 1) / kTileM) * ((C + kTileN - 1) / kTileN);
}

size_t grouped_matmul_backward_weight_sm90_squares_bytes(int64_t E, int64_t C, int64_t OC) {
    return (static_cast<size_t>(std::max<int64_t>(weight_grad_tiles(E, C, OC), 0)) * 8 + kSumBlocks) * sizeof(double);
}

void grouped_matmul_backward_weight_sm90(void* dweight, DType dweight_dtype, const bf16* dout, const bf16* inp,
                                         const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                                         bool accumulate, cudaStream_t stream, const int32_t* offsets2,
                                         double* square_sum, void* squares_scratch) {
    const char* what = "grouped_matmul_backward_weight_sm90";
    check_grouped_args(what, dweight, dout, inp, offsets, M, E, C, OC);
    MF_CHECK(dweight_dtype == DType::f32 || dweight_dtype == DType::bf16, what, ": dweight must be f32 or bf16, got ",
             dtype_name(dweight_dtype));
    MF_CHECK(grouped_matmul_backward_weight_sm90_supported(C, OC), what, ": needs an sm_90 GPU, OC % ", kStoreCols,
             " == 0 and C % ", kStoreCols, " == 0 (C=", C, ", OC=", OC, ")");
    MF_CHECK(E <= kSm90MaxGroups, what, ": at most ", kSm90MaxGroups, " groups (E=", E, ")");
    MF_CHECK(weight_grad_tiles(E, C, OC) < (int64_t{1} << 31), what, ": too many tiles");
    MF_CHECK(square_sum == nullptr || squares_scratch != nullptr, what, ": square_sum needs squares_scratch");
    if (E == 0) return;
    const int64_t tiles = weight_grad_tiles(E, C, OC);
    const int64_t blocks = std::min<int64_t>(persistent_blocks(), tiles);
    // Rows past M read as zeros; with M == 0 every group is empty and gets zeros (or keeps its values).
    const CUtensorMap map_a = tile_map(dout, std::max<int64_t>(M, 1), OC, 64);
    const CUtensorMap map_b = tile_map(inp, std::max<int64_t>(M, 1), C, 64);
    const size_t smem = smem_bytes(E);
    const auto launch = [&](auto* typed) {
        using TW = std::remove_pointer_t<decltype(typed)>;
        const auto kernel = grouped_weight_grad_wgmma_kernel<TW>;
        MF_CHECK_CUDA(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
            map_a, map_b, typed, offsets, offsets2, static_cast<int>(M), static_cast<int>(E), static_cast<int>(OC),
            static_cast<int>(C), accumulate, square_sum != nullptr ? static_cast<double*>(squares_scratch) : nullptr);
    };
    if (dweight_dtype == DType::f32)
        launch(static_cast<float*>(dweight));
    else
        launch(static_cast<bf16*>(dweight));
    MF_CHECK_CUDA(cudaGetLastError());
    if (square_sum != nullptr) {
        double* parts = static_cast<double*>(squares_scratch);
        double* block_sums = parts + tiles * 8;
        sum_parts_kernel<<<kSumBlocks, 256, 0, stream>>>(block_sums, parts, tiles * 8);
        MF_CHECK_CUDA(cudaGetLastError());
        add_block_sums_kernel<<<1, 256, 0, stream>>>(square_sum, block_sums);
        MF_CHECK_CUDA(cudaGetLastError());
    }
}

}  // namespace mf::cuda
