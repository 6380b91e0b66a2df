// Fused LM head + cross-entropy, CUDA. Per chunk of rows tokens [n0, n0 + rows):
//   1. logits[rows, V] fp32 (or bf16) = h[chunk] · wᵀ      cublasGemmEx, bf16 in, fp32 accumulation
//   2. the loss kernel (cross_entropy_loss_rows): per row a (max, Σ exp) per thread (one exp per
//      logit), combined in a fixed order; loss = max + log Σ − logit[target];
//      then dlogits = grad_scale · (exp(x − max) / Σ − [v == target]) as bf16 over the row's own
//      storage (bf16 row stride 2V over fp32 logits, V over bf16 ones). The per-logit exps are the
//      hardware approximation (__expf: ex2.approx, a few 1e-7 relative for arguments <= 0, far below
//      a bf16 logit's rounding): 7% off the kernel against the libm-accurate expf (2.21 -> 2.07 ms
//      per P1 step on an H200, GPU trace). Two kernels, the same per-logit math:
//      staged, where the row fits in 1, 2, 4 or 8 slices of at most kMaxSliceBytes (V a multiple of
//        the 16-byte vector; every bf16 vocabulary up to 192512, fp32 up to 96256): a thread-block
//        cluster per row, one CTA per slice. A CTA copies its slice global -> shared once (bulk
//        asynchronous copies completing on mbarriers), reduces it from shared memory (each thread's
//        max, then its Σ exp(x − max)) to one (max, Σ) pair, and publishes it; after a cluster
//        barrier every CTA combines the cluster's pairs through distributed shared memory in rank
//        order (all CTAs hold the same bits), then writes its slice's dlogits from shared memory.
//        DRAM traffic: one read and one write of the row.
//      streaming, every other row: one block per row reads the row twice (a 304 KB bf16 row misses
//        L2 the second time), each thread's (max, Σ) an online update. Pass 2 walks the row in tiles
//        of blockDim·kVec logits, each tile read into registers, then a __syncthreads, then written;
//        the bf16 of logits [b, b + T) lands on the bytes of fp32 logits [b/2, (b + T)/2) (bf16
//        logits: on their own bytes), all already read.
//      MOEFORGE_CE_KERNEL = staged | streaming overrides the choice at every call (staged still
//      streams where it does not apply); unset or empty: kCrossEntropyStagedByDefault says which.
//   3. dh[chunk] += dlogits · w,  dw += dlogitsᵀ · h[chunk]   cublasGemmEx, fp32 accumulation.
// Rows are independent and every reduction has a fixed order, so the loss is deterministic. The two
// kernels sum in different orders, so they agree to fp32 rounding in the loss and, in an occasional
// dlogit, to one bf16 rounding step; not bit for bit. The GEMMs are as deterministic as cuBLAS is
// (same GPU, same library: same bits).
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>

#include "core/cuda_check.h"
#include "kernels/cuda/cross_entropy.cuh"
#include "kernels/cuda/mbarrier_sm90.cuh"
#include "kernels/cuda/mma_sm80.cuh"

namespace mf::cuda {

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 512;  // streaming: one block per row
constexpr int32_t kIgnoreIndex = -100;
constexpr const char* kKernelEnv = "MOEFORGE_CE_KERNEL";

// staged: a slice is at most kMaxSliceBytes of shared memory, which with the kernel's static shared
// memory (112 bytes) stays within the 48 KiB a launch gets without opting in to more. An H100 SM then
// holds 5 CTAs of 38 KB (V = 151936 bf16 in 8 slices): 190 KB of logits landing or waiting per SM,
// and the other CTAs' reduction and store phases to overlap a CTA's load with. 256 threads:
// 5 x 256 = 1280 threads fit an SM's 2048 with registers to spare (512 would allow 4 CTAs); 9-10
// 16-byte vectors per thread per pass at 38 KB.
constexpr int kStagedThreads = 256;
constexpr int64_t kMaxSliceBytes = 47 * 1024;
constexpr int kMaxSlices = 8;  // the portable cluster size
// A slice lands in kLoadPieces bulk copies, each on its own mbarrier: pass 1 starts on the first
// piece while the rest are in flight.
constexpr int kLoadPieces = 4;
constexpr int kVectorBytes = 16;

void check_cublas(cublasStatus_t status, const char* what) {
    MF_CHECK(status == CUBLAS_STATUS_SUCCESS, "cross_entropy: ", what, " failed: ", cublasGetStatusName(status), " (",
             cublasGetStatusString(status), ")");
}

// ----------------------------------------------------------------------------------------------
// kernels

// Combines (max, sum) pairs: sum of exp(x − max) over the union.
__device__ __forceinline__ void combine(float& m, float& s, float other_m, float other_s) {
    const float new_m = fmaxf(m, other_m);
    if (new_m == -INFINITY) return;  // both empty
    s = s * expf(m - new_m) + other_s * expf(other_m - new_m);
    m = new_m;
}

// Adds kVec logits, in order, to a thread's running (max, Σ exp(x − max)).
template <int kVec>
__device__ __forceinline__ void online_update(float& m, float& s, const float (&f)[kVec]) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
        if (f[e] > m) {
            s = s * __expf(m - f[e]) + 1.0f;
            m = f[e];
        } else {
            s += __expf(f[e] - m);
        }
    }
}

// Every thread's (m, s) combined over the block: over the warp by butterfly, then warps 0, 1, ... in
// order; every thread returns the same pair. shared_m / shared_s: blockDim.x / 32 floats each.
__device__ __forceinline__ void block_combine(float& m, float& s, float* shared_m, float* shared_s) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_m = __shfl_xor_sync(detail::kFullMask, m, offset);
        const float other_s = __shfl_xor_sync(detail::kFullMask, s, offset);
        combine(m, s, other_m, other_s);
    }
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
        shared_m[warp] = m;
        shared_s[warp] = s;
    }
    __syncthreads();
    m = shared_m[0];
    s = shared_s[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) combine(m, s, shared_m[w], shared_s[w]);
}

// The dlogit of logit x at row index v: grad_scale · (exp(x − m) / s − [v == target]), with
// scale = grad_scale / s.
__device__ __forceinline__ float dlogit(float x, int64_t v, float m, float scale, int64_t target, float grad_scale) {
    float g = __expf(x - m) * scale;
    if (v == target) g -= grad_scale;
    return g;
}

// blockIdx.x: the row inside the chunk. logits: [rows, V] of TL (fp32 or bf16), overwritten by bf16
// rows of stride V · sizeof(TL) / 2.
template <int kVec, typename TL>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(float* losses, TL* logits, const int32_t* targets, int64_t V, float grad_scale,
                              const float* grad_scale_by, bool want_grad) {
    __shared__ float shared_m[kThreads / 32];
    __shared__ float shared_s[kThreads / 32];
    const int64_t r = blockIdx.x;
    TL* x = logits + r * V;
    bf16* d = reinterpret_cast<bf16*>(x);  // this row's dlogits, over its own logits
    const int32_t target = targets[r];
    const bool ignored = target == kIgnoreIndex;
    const bool valid = target >= 0 && target < V;

    if (!valid) {
        // Ignored (loss 0) or out of range (loss NaN); no gradient. Zeroing the bf16 half of the row
        // only touches fp32 logits nobody reads.
        if (threadIdx.x == 0) losses[r] = ignored ? 0.0f : NAN;
        if (want_grad) {
            for (int64_t v = threadIdx.x; v < V; v += blockDim.x) d[v] = __ushort_as_bfloat16(0);
        }
        return;
    }
    const float target_logit = detail::to_f32(x[target]);  // read before any thread writes the row

    // Pass 1: online (max, Σ exp) per thread.
    float m = -INFINITY, s = 0.0f;
    for (int64_t v = static_cast<int64_t>(threadIdx.x) * kVec; v < V; v += static_cast<int64_t>(blockDim.x) * kVec) {
        float f[kVec];
        detail::load_f32<kVec>(f, x + v);
        online_update<kVec>(m, s, f);
    }
    block_combine(m, s, shared_m, shared_s);
    if (threadIdx.x == 0) losses[r] = m + logf(s) - target_logit;
    if (!want_grad) return;

    // Pass 2: dlogits in place, tile by tile (see the file comment for why this is race-free).
    if (grad_scale_by != nullptr) grad_scale *= *grad_scale_by;  // (the device factor: no host sync)
    const float scale = grad_scale / s;
    const int64_t tile = static_cast<int64_t>(blockDim.x) * kVec;
    for (int64_t base = 0; base < V; base += tile) {
        const int64_t v = base + static_cast<int64_t>(threadIdx.x) * kVec;
        float f[kVec];
        if (v < V) detail::load_f32<kVec>(f, x + v);
        __syncthreads();
        if (v < V) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) f[e] = dlogit(f[e], v + e, m, scale, target, grad_scale);
            if constexpr (kVec % 4 == 0) {
#pragma unroll
                for (int q = 0; q < kVec; q += 4) {
                    uint2 raw;
                    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
                    pairs[0] = __floats2bfloat162_rn(f[q], f[q + 1]);
                    pairs[1] = __floats2bfloat162_rn(f[q + 2], f[q + 3]);
                    *reinterpret_cast<uint2*>(d + v + q) = raw;
                }
            } else {
                d[v] = __float2bfloat16_rn(f[0]);
            }
        }
    }
}

// --- staged kernel helpers: the 1-D bulk copy (sm_90; its mbarriers: mbarrier_sm90.cuh) -----------

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to this CTA's shared memory,
// completing on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_u32(dst)),
                 "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

// Elements [begin, end) of load piece `piece` of a slice of `len` elements (pieces of a whole number
// of vectors; the last ones may be short or empty).
template <int kVec>
__device__ __forceinline__ void piece_range(int len, int piece, int& begin, int& end) {
    const int per_piece = ((len + kLoadPieces - 1) / kLoadPieces + kVec - 1) / kVec * kVec;
    begin = min(piece * per_piece, len);
    end = min(begin + per_piece, len);
}

// Thread 0 arms the CTA's load barriers and issues its slice's bulk copies (the caller syncs the
// block before anyone waits on them).
template <int kVec, typename TL>
__device__ __forceinline__ void issue_slice_load(TL* slice_smem, const TL* slice_gmem, int len, uint64_t* loaded) {
    for (int p = 0; p < kLoadPieces; ++p) mbar_init(&loaded[p], 1);
    // The inits visible to the async proxy that completes the copies on them.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int p = 0; p < kLoadPieces; ++p) {
        int begin, end;
        piece_range<kVec>(len, p, begin, end);
        if (end == begin) continue;  // (never armed: nobody waits on it)
        const uint32_t bytes = static_cast<uint32_t>((end - begin) * sizeof(TL));
        mbar_arrive_expect_tx(&loaded[p], bytes);
        bulk_load(slice_smem + begin, slice_gmem + begin, bytes, &loaded[p]);
    }
}

// p[0..kVec) = bf16(f[0..kVec)): one 16-byte store (kVec 8) or one 8-byte store (kVec 4).
template <int kVec>
__device__ __forceinline__ void store_bf16(bf16* p, const float (&f)[kVec]) {
    if constexpr (kVec == 8) {
        detail::store_f32<8, bf16>(p, f);
    } else {
        static_assert(kVec == 4, "staged rows store 4 or 8 bf16 at a time");
        uint2 raw;
        __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
        pairs[0] = __floats2bfloat162_rn(f[0], f[1]);
        pairs[1] = __floats2bfloat162_rn(f[2], f[3]);
        *reinterpret_cast<uint2*>(p) = raw;
    }
}

// d[0..len) = 0 (bf16), kVec at a time.
template <int kVec>
__device__ __forceinline__ void zero_bf16(bf16* d, int len) {
    const float zeros[kVec] = {};
    for (int i = threadIdx.x * kVec; i < len; i += kStagedThreads * kVec) store_bf16<kVec>(d + i, zeros);
}

// Pass 1 of the staged kernel: the thread's (max, Σ exp(x − max)) over its vectors of the slice in
// shared memory: the max piece by piece as the copies land, then the sum over the same vectors in a
// second walk of shared memory. Every exp is then independent of the others; the online update runs
// each exp through the running sum (a chain of ~30 cycles a logit), and with it the staged kernel
// took 830 us at 2731 rows of V = 151936 (H100) where its DRAM traffic alone needs about 500.
template <int kVec, typename TL>
__device__ __forceinline__ void reduce_slice(float& m, float& s, const TL* xs, int len, uint64_t* loaded) {
    m = -INFINITY;
    for (int p = 0; p < kLoadPieces; ++p) {
        int piece_begin, piece_end;
        piece_range<kVec>(len, p, piece_begin, piece_end);
        if (piece_end == piece_begin) continue;
        mbar_wait(&loaded[p], 0);
#pragma unroll 4
        for (int i = piece_begin + threadIdx.x * kVec; i < piece_end; i += kStagedThreads * kVec) {
            float f[kVec];
            detail::load_f32<kVec>(f, xs + i);
#pragma unroll
            for (int e = 0; e < kVec; ++e) m = fmaxf(m, f[e]);
        }
    }
    s = 0.0f;
    if (m == -INFINITY) return;  // (no logits here, or only -inf ones: the empty pair, which combine() skips)
    for (int p = 0; p < kLoadPieces; ++p) {
        int piece_begin, piece_end;
        piece_range<kVec>(len, p, piece_begin, piece_end);
#pragma unroll 4
        for (int i = piece_begin + threadIdx.x * kVec; i < piece_end; i += kStagedThreads * kVec) {
            float f[kVec];
            detail::load_f32<kVec>(f, xs + i);
#pragma unroll
            for (int e = 0; e < kVec; ++e) s += __expf(f[e] - m);
        }
    }
}

// The row's (m, s) from the cluster's published pairs, combined in rank order 0, 1, ...: every CTA
// of the row computes the same bits. (All the distributed shared memory loads first, then the
// combines: one round trip, not one per rank.)
__device__ __forceinline__ void combine_cluster_pairs(float& m, float& s, float2* slice_pair) {
    const cg::cluster_group cluster = cg::this_cluster();
    const int num_slices = static_cast<int>(cluster.num_blocks());
    float2 pairs[kMaxSlices];
#pragma unroll
    for (int k = 0; k < kMaxSlices; ++k) {
        if (k < num_slices) pairs[k] = *cluster.map_shared_rank(slice_pair, k);
    }
    m = pairs[0].x;
    s = pairs[0].y;
#pragma unroll
    for (int k = 1; k < kMaxSlices; ++k) {
        if (k < num_slices) combine(m, s, pairs[k].x, pairs[k].y);
    }
}

// Pass 2 of the staged kernel: the dlogits of the slice's len logits (row indices begin, ...) from
// shared memory to d[begin, begin + len), bf16.
template <int kVec, typename TL>
__device__ __forceinline__ void write_slice_dlogits(bf16* d, const TL* xs, int64_t begin, int len, float m, float scale,
                                                    int64_t target, float grad_scale) {
#pragma unroll 4
    for (int i = threadIdx.x * kVec; i < len; i += kStagedThreads * kVec) {
        float f[kVec];
        detail::load_f32<kVec>(f, xs + i);
        const int64_t v = begin + i;
#pragma unroll
        for (int e = 0; e < kVec; ++e) f[e] = dlogit(f[e], v + e, m, scale, target, grad_scale);
        store_bf16<kVec>(d + v, f);
    }
}

// One CTA per slice of `slice` logits (a multiple of the vector), the cs = clusterDim.x CTAs of a row
// one cluster; blockIdx.x = row · cs + rank. logits: [rows, V] of TL, V a multiple of the vector and
// rows 16-byte aligned; overwritten by bf16 rows of stride V · sizeof(TL) / 2. Dynamic shared memory:
// slice · sizeof(TL) bytes.
// Sync points: (a) the block barrier after thread 0 arms the mbarriers; (b) each load piece's
// mbarrier (that piece in shared memory); (c) cluster barrier 1: every CTA of the row holds its slice
// in shared memory, so the row's global bytes are all read, and has published its (m, s) pair;
// (d) cluster barrier 2, arrived at after reading the cluster's pairs and waited on just before exit:
// no CTA's shared memory goes away while another still reads it. The row's global bytes are written
// only after (c).
template <typename TL>
__global__ void __launch_bounds__(kStagedThreads)
    cross_entropy_staged_kernel(float* losses, TL* logits, const int32_t* targets, int64_t V, int slice,
                                float grad_scale, const float* grad_scale_by, bool want_grad) {
    constexpr int kVec = kVectorBytes / static_cast<int>(sizeof(TL));
    extern __shared__ __align__(kVectorBytes) unsigned char staged_smem[];
    __shared__ uint64_t loaded[kLoadPieces];
    __shared__ float shared_m[kStagedThreads / 32];
    __shared__ float shared_s[kStagedThreads / 32];
    __shared__ float2 slice_pair;  // this CTA's (m, s), read by the whole cluster
    const cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    const int64_t r = blockIdx.x / cluster.num_blocks();
    TL* x = logits + r * V;
    bf16* d = reinterpret_cast<bf16*>(x);  // this row's dlogits, over the row's own logits
    const int64_t begin = static_cast<int64_t>(rank) * slice;
    const int64_t rest = V - begin;
    const int len = rest <= 0 ? 0 : static_cast<int>(rest < slice ? rest : slice);  // this CTA's logits
    const int32_t target = targets[r];
    if (target < 0 || target >= V) {
        // Ignored (loss 0) or out of range (loss NaN); no gradient: each CTA zeroes its slice's part of
        // the bf16 row (no shared memory, no cluster barrier: every CTA of the row comes here).
        if (rank == 0 && threadIdx.x == 0) losses[r] = target == kIgnoreIndex ? 0.0f : NAN;
        if (want_grad) zero_bf16<kVec>(d + begin, len);
        return;
    }

    TL* xs = reinterpret_cast<TL*>(staged_smem);
    if (threadIdx.x == 0) issue_slice_load<kVec>(xs, x + begin, len, loaded);
    __syncthreads();  // (a)
    // The target's logit, read from global before (c), after which the row is overwritten.
    float target_logit = 0.0f;
    if (rank == 0 && threadIdx.x == 0) target_logit = detail::to_f32(x[target]);
    if (want_grad && grad_scale_by != nullptr) grad_scale *= *grad_scale_by;  // (the device factor: no host sync)

    float m = -INFINITY, s = 0.0f;
    reduce_slice<kVec>(m, s, xs, len, loaded);  // (b)
    block_combine(m, s, shared_m, shared_s);
    if (threadIdx.x == 0) {
        slice_pair = make_float2(m, s);
        // The bulk copies' reads of the row (async proxy), complete at (b), ordered before the
        // cluster's generic stores over the same bytes after (c).
        asm volatile("fence.proxy.async.global;\n" ::: "memory");
    }
    cluster.sync();  // (c)
    combine_cluster_pairs(m, s, &slice_pair);
    auto done_reading = cluster.barrier_arrive();  // (d): done with the other CTAs' shared memory
    if (rank == 0 && threadIdx.x == 0) losses[r] = m + logf(s) - target_logit;
    // dlogits over the row's global bytes. bf16 logits: a CTA writes its own slice's bytes. fp32 logits:
    // CTA k writes bytes [2·begin, 2·(begin + len)) of the row, logits of the CTAs around rank k / 2;
    // safe only because every CTA's copies completed (b) before it arrived at (c), and nobody writes
    // the row before (c).
    if (want_grad) write_slice_dlogits<kVec>(d, xs, begin, len, m, grad_scale / s, target, grad_scale);
    cluster.barrier_wait(std::move(done_reading));  // (d): no CTA still reads this one's pair
}

// ----------------------------------------------------------------------------------------------
// launchers

// The staged kernel for rows of V logits of `elem_bytes` each: the fewest (1, 2, 4 or 8) slices of a
// whole number of 16-byte vectors that fit kMaxSliceBytes; streaming where none do.
CrossEntropyLossKernel staged_or_streaming(int64_t V, int64_t elem_bytes) {
    const int64_t vec = kVectorBytes / elem_bytes;
    for (int num_slices = 1; num_slices <= kMaxSlices; num_slices *= 2) {
        const int64_t slice = ((V + num_slices - 1) / num_slices + vec - 1) / vec * vec;
        if (slice * elem_bytes <= kMaxSliceBytes) return {true, num_slices, slice};
    }
    return {false, 1, V};
}

// The kernel for rows of V logits; aligned: the logits start 16-byte aligned.
CrossEntropyLossKernel choose_loss_kernel(int64_t V, DType logits_dtype, bool aligned) {
    const char* env = std::getenv(kKernelEnv);
    const std::string wanted = env != nullptr ? env : "";
    MF_CHECK(wanted.empty() || wanted == "staged" || wanted == "streaming", kKernelEnv,
             " must be staged, streaming or unset, got '", wanted, "'");
    const int64_t elem_bytes = static_cast<int64_t>(dtype_size(logits_dtype));
    // The staged kernel copies whole 16-byte vectors from a 16-byte aligned row start.
    if (wanted == "streaming" || (wanted.empty() && !kCrossEntropyStagedByDefault) || !aligned ||
        V % (kVectorBytes / elem_bytes) != 0)
        return {false, 1, V};
    return staged_or_streaming(V, elem_bytes);
}

template <typename TL>
void launch_streaming(float* losses, TL* logits, const int32_t* targets, int64_t rows, int64_t V, float grad_scale,
                      const float* grad_scale_by, bool want_grad, bool vec, cudaStream_t stream) {
    constexpr int kVec = kVectorBytes / static_cast<int>(sizeof(TL));
    if (vec)
        cross_entropy_rows_kernel<kVec, TL><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
            losses, logits, targets, V, grad_scale, grad_scale_by, want_grad);
    else
        cross_entropy_rows_kernel<1, TL><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
            losses, logits, targets, V, grad_scale, grad_scale_by, want_grad);
    MF_CHECK_CUDA(cudaGetLastError());
}

template <typename TL>
void launch_staged(float* losses, TL* logits, const int32_t* targets, int64_t rows, int64_t V, float grad_scale,
                   const float* grad_scale_by, bool want_grad, const CrossEntropyLossKernel& shape,
                   cudaStream_t stream) {
    MF_CHECK(rows * shape.num_slices <= std::numeric_limits<int32_t>::max(), "cross_entropy: ", rows, " rows of ",
             shape.num_slices, " slices are too many CTAs for one launch");
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(rows * shape.num_slices));
    config.blockDim = dim3(kStagedThreads);
    config.dynamicSmemBytes = static_cast<size_t>(shape.slice_elements) * sizeof(TL);  // (see kMaxSliceBytes)
    config.stream = stream;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(shape.num_slices);
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    MF_CHECK_CUDA(cudaLaunchKernelEx(&config, cross_entropy_staged_kernel<TL>, losses, logits, targets, V,
                                     static_cast<int>(shape.slice_elements), grad_scale, grad_scale_by, want_grad));
}

// C (col-major m×n, ldc) = alpha · op(A) · op(B) + beta · C, bf16 inputs, fp32 compute.
void gemm(cublasHandle_t handle, cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t n, int64_t k,
          const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta, void* c, cudaDataType_t c_type,
          int64_t ldc, const char* what) {
    const float alpha = 1.0f;
    check_cublas(cublasGemmEx(handle, op_a, op_b, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha,
                              a, CUDA_R_16BF, static_cast<int>(lda), b, CUDA_R_16BF, static_cast<int>(ldb), &beta, c,
                              c_type, static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 what);
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

CrossEntropyLossKernel cross_entropy_loss_kernel(int64_t V, DType logits_dtype) {
    MF_CHECK(V > 0, "cross_entropy_loss_kernel: bad V ", V);
    MF_CHECK(logits_dtype == DType::f32 || logits_dtype == DType::bf16,
             "cross_entropy_loss_kernel: logits dtype must be f32 or bf16, got ", dtype_name(logits_dtype));
    return choose_loss_kernel(V, logits_dtype, true);
}

void cross_entropy_loss_rows(float* losses, void* logits, DType logits_dtype, const int32_t* targets, int64_t rows,
                             int64_t V, float grad_scale, const float* grad_scale_by, bool want_grad,
                             cudaStream_t stream) {
    MF_CHECK(rows >= 0 && rows <= std::numeric_limits<int32_t>::max() && V > 0,
             "cross_entropy_loss_rows: bad shape rows=", rows, " V=", V);
    MF_CHECK(logits_dtype == DType::f32 || logits_dtype == DType::bf16,
             "cross_entropy_loss_rows: logits dtype must be f32 or bf16, got ", dtype_name(logits_dtype));
    const CrossEntropyLossKernel kernel = choose_loss_kernel(V, logits_dtype, aligned_to(kVectorBytes, logits));
    if (rows == 0) return;
    MF_CHECK(losses != nullptr && logits != nullptr && targets != nullptr, "cross_entropy_loss_rows: null buffer");
    const bool wide = logits_dtype == DType::f32;
    // Vector loads of the streaming kernel: 16 bytes, from rows that start 16-byte aligned.
    const bool vec = V % (wide ? 4 : 8) == 0 && aligned_to(kVectorBytes, logits);
    const auto launch = [&](auto* x) {
        if (kernel.staged)
            launch_staged(losses, x, targets, rows, V, grad_scale, grad_scale_by, want_grad, kernel, stream);
        else
            launch_streaming(losses, x, targets, rows, V, grad_scale, grad_scale_by, want_grad, vec, stream);
    };
    if (wide)
        launch(static_cast<float*>(logits));
    else
        launch(static_cast<bf16*>(logits));
}

size_t lm_head_cross_entropy_scratch_bytes(int64_t chunk, int64_t V, DType logits_dtype) {
    MF_CHECK(chunk > 0 && V > 0, "lm_head_cross_entropy: bad chunk ", chunk, " or V ", V);
    MF_CHECK(logits_dtype == DType::f32 || logits_dtype == DType::bf16,
             "lm_head_cross_entropy: logits dtype must be f32 or bf16, got ", dtype_name(logits_dtype));
    return static_cast<size_t>(chunk * V) * dtype_size(logits_dtype);
}

void lm_head_cross_entropy(cublasHandle_t handle, float* losses, bf16* dh, void* dw, DType dw_dtype, const bf16* h,
                           const bf16* w, const int32_t* targets, int64_t N, int64_t C, int64_t V, float grad_scale,
                           void* scratch, size_t scratch_bytes, int64_t chunk, cudaStream_t stream, DType logits_dtype,
                           bool accumulate, const float* grad_scale_by) {
    MF_CHECK(N >= 0 && C > 0 && V > 0, "lm_head_cross_entropy: bad shape N=", N, " C=", C, " V=", V);
    constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
    MF_CHECK(C <= kIntMax && 2 * V <= kIntMax, "lm_head_cross_entropy: C = ", C, " or V = ", V,
             " too large for cuBLAS int sizes");
    MF_CHECK(chunk > 0 && chunk <= kIntMax, "lm_head_cross_entropy: bad chunk ", chunk);
    MF_CHECK(dw == nullptr || dw_dtype == DType::f32 || dw_dtype == DType::bf16,
             "lm_head_cross_entropy: dw dtype must be f32 or bf16, got ", dtype_name(dw_dtype));
    cross_entropy_loss_kernel(V, logits_dtype);  // (a bad MOEFORGE_CE_KERNEL throws before any work)
    if (N == 0) {                                // (no rows: dh is empty, dw's gradient is zero)
        if (!accumulate && dw != nullptr)
            MF_CHECK_CUDA(cudaMemsetAsync(dw, 0, static_cast<size_t>(V * C) * dtype_size(dw_dtype), stream));
        return;
    }
    MF_CHECK(handle != nullptr && losses != nullptr && h != nullptr && w != nullptr && targets != nullptr,
             "lm_head_cross_entropy: null handle or buffer");
    const size_t needed = lm_head_cross_entropy_scratch_bytes(chunk, V, logits_dtype);
    MF_CHECK(scratch != nullptr && scratch_bytes >= needed, "lm_head_cross_entropy: scratch has ", scratch_bytes,
             " bytes, needs ", needed);
    MF_CHECK(aligned_to(16, scratch), "lm_head_cross_entropy: scratch must be 16-byte aligned");
    check_cublas(cublasSetStream(handle, stream), "cublasSetStream");

    const bool want_grad = dh != nullptr || dw != nullptr;
    const bool wide = logits_dtype == DType::f32;
    const bf16* dlogits = static_cast<const bf16*>(scratch);
    const int64_t ld_dlogits = wide ? 2 * V : V;  // bf16 elements between dlogits rows
    const cudaDataType_t dw_type = dw_dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t rows = std::min(chunk, N - n0);
        const bf16* h_chunk = h + n0 * C;
        // logits_cm (V × rows) = w_cm(C × V)ᵀ · h_cm(C × rows)
        gemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, V, rows, C, w, C, h_chunk, C, 0.0f, scratch,
             wide ? CUDA_R_32F : CUDA_R_16BF, V, "logits GEMM");
        cross_entropy_loss_rows(losses + n0, scratch, logits_dtype, targets + n0, rows, V, grad_scale, grad_scale_by,
                                want_grad, stream);
        if (dh != nullptr) {
            // dh_cm (C × rows) += w_cm (C × V) · dlogits_cm (V × rows, ld 2V)
            gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, C, rows, V, w, C, dlogits, ld_dlogits, accumulate ? 1.0f : 0.0f,
                 dh + n0 * C, CUDA_R_16BF, C, "dh GEMM");
        }
        if (dw != nullptr) {
            // dw_cm (C × V) += h_cm (C × rows) · dlogits_cm (V × rows, ld 2V)ᵀ
            gemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, C, V, rows, h_chunk, C, dlogits, ld_dlogits,
                 accumulate || n0 > 0 ? 1.0f : 0.0f, dw, dw_type, C, "dw GEMM");
        }
    }
}

}  // namespace mf::cuda
