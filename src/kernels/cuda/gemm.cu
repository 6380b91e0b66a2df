// Dense nn.Linear GEMMs through cuBLASLt (bf16 operands, fp32 compute and scale, bf16 or fp32 out).
//
// cuBLASLt is column-major; a row-major [R, S] matrix is the column-major [S, R] matrix with
// leading dimension S, i.e. its transpose. Each product is therefore issued transposed:
//   forward          outᵀ[OC, N]  = weightᵀ-op(A = weight as col-major [C, OC], op T) · inpᵀ (col-major [C, N])
//   backward input   dinpᵀ[C, N]  = (weight as col-major [C, OC], op N) · (dout as col-major [OC, N], op N)
//   backward weight  dweightᵀ[C, OC] += (inp as col-major [C, N], op N) · (dout as col-major [OC, N], op T)
// so no data is ever moved. The algorithm comes from cuBLASLt's heuristic, told the real alignment
// of every pointer (slices of larger buffers may be less than 256-byte aligned) and the workspace
// size. Accumulation is cuBLASLt's beta: beta = 1 adds to the existing output; the fp32 products
// themselves are deterministic for a given algorithm and shape (no split-K atomics are requested).
#include <cstdint>

#include "core/check.h"
#include "core/cuda_check.h"
#include "kernels/cuda/cublas_check.cuh"
#include "kernels/cuda/gemm.cuh"

namespace mf::cuda {

// ---------------------------------------------------------------------------------------------
// context

GemmContext::GemmContext() {
    MF_CHECK_CUBLAS(cublasLtCreate(&handle));
    MF_CHECK_CUDA(cudaMalloc(&workspace, kWorkspaceBytes));
    workspace_bytes = kWorkspaceBytes;
}

GemmContext::~GemmContext() {
    // Destructors must not throw: release what exists and ignore late errors.
    if (workspace != nullptr) cudaFree(workspace);
    if (handle != nullptr) cublasLtDestroy(handle);
}

namespace {

// ---------------------------------------------------------------------------------------------
// one cuBLASLt product: D[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · D  (column-major)

// Owns the descriptors of one call, so an error thrown half-way leaks nothing.
struct LtDescriptors {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    ~LtDescriptors() {
        if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
        if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
        if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
        if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
        if (op != nullptr) cublasLtMatmulDescDestroy(op);
    }
};

// Largest power of two (at most 256) that divides the address.
uint32_t pointer_alignment(const void* ptr) {
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    uint32_t align = 256;
    while (align > 1 && address % align != 0) align /= 2;
    return align;
}

struct LtGemm {
    cublasOperation_t trans_a, trans_b;
    int64_t m, n, k;
    const void* a;
    int64_t lda;
    const void* b;
    int64_t ldb;
    void* d;
    cudaDataType_t d_type;
    int64_t ldd;
    float beta;
};

void lt_matmul(GemmContext& ctx, const LtGemm& g, cudaStream_t stream) {
    MF_CHECK(ctx.handle != nullptr && ctx.workspace != nullptr, "gemm: GemmContext is not initialised");
    LtDescriptors desc;
    MF_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const int32_t trans_a = g.trans_a, trans_b = g.trans_b;
    MF_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
    MF_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
    // Stored shapes (column-major rows x cols) of A and B follow from the transposes.
    const bool ta = g.trans_a == CUBLAS_OP_T, tb = g.trans_b == CUBLAS_OP_T;
    MF_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_16BF, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
    MF_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_16BF, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
    MF_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&desc.d, g.d_type, g.m, g.n, g.ldd));

    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&desc.pref));
    const uint64_t workspace_bytes = ctx.workspace_bytes;
    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &workspace_bytes, sizeof(workspace_bytes)));
    const uint32_t align_a = pointer_alignment(g.a), align_b = pointer_alignment(g.b), align_d = pointer_alignment(g.d);
    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                         &align_a, sizeof(align_a)));
    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                         &align_b, sizeof(align_b)));
    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                         &align_d, sizeof(align_d)));
    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                         &align_d, sizeof(align_d)));

    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    MF_CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(ctx.handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1,
                                                   &heuristic, &found));
    MF_CHECK(found > 0, "gemm: cuBLASLt has no algorithm for m=", g.m, " n=", g.n, " k=", g.k);
    const float alpha = 1.0f;
    MF_CHECK_CUBLAS(cublasLtMatmul(ctx.handle, desc.op, &alpha, g.a, desc.a, g.b, desc.b, &g.beta, g.d, desc.d, g.d,
                                   desc.d, &heuristic.algo, ctx.workspace, ctx.workspace_bytes, stream));
}

bool product_fits(int64_t a, int64_t b) { return a == 0 || b <= INT64_MAX / a; }

void check_dims(const char* what, int64_t N, int64_t C, int64_t OC) {
    MF_CHECK(N >= 0 && C >= 0 && OC >= 0, what, ": negative shape N=", N, " C=", C, " OC=", OC);
    MF_CHECK(product_fits(N, C) && product_fits(N, OC) && product_fits(C, OC), what, ": shape N=", N, " C=", C,
             " OC=", OC, " overflows int64 element counts");
}

void forward_impl(GemmContext& ctx, void* out, cudaDataType_t out_type, size_t out_elem, const bf16* inp,
                  const bf16* weight, int64_t N, int64_t C, int64_t OC, cudaStream_t stream) {
    check_dims("matmul_forward", N, C, OC);
    if (N == 0 || OC == 0) return;
    MF_CHECK(out != nullptr, "matmul_forward: out is null");
    if (C == 0) {
        MF_CHECK_CUDA(cudaMemsetAsync(out, 0, static_cast<size_t>(N * OC) * out_elem, stream));
        return;
    }
    MF_CHECK(inp != nullptr && weight != nullptr, "matmul_forward: null input");
    lt_matmul(ctx, LtGemm{CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, out, out_type, OC, /*beta=*/0.0f},
              stream);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// public entries

void matmul_forward(GemmContext& ctx, bf16* out, const bf16* inp, const bf16* weight, int64_t N, int64_t C, int64_t OC,
                    cudaStream_t stream) {
    forward_impl(ctx, out, CUDA_R_16BF, sizeof(bf16), inp, weight, N, C, OC, stream);
}

void matmul_forward_f32out(GemmContext& ctx, float* out, const bf16* inp, const bf16* weight, int64_t N, int64_t C,
                           int64_t OC, cudaStream_t stream) {
    forward_impl(ctx, out, CUDA_R_32F, sizeof(float), inp, weight, N, C, OC, stream);
}

void matmul_backward_input(GemmContext& ctx, bf16* dinp, const bf16* dout, const bf16* weight, int64_t N, int64_t C,
                           int64_t OC, bool accumulate, cudaStream_t stream) {
    check_dims("matmul_backward_input", N, C, OC);
    if (N == 0 || C == 0) return;
    MF_CHECK(dinp != nullptr, "matmul_backward_input: dinp is null");
    if (OC == 0) {
        if (!accumulate) MF_CHECK_CUDA(cudaMemsetAsync(dinp, 0, static_cast<size_t>(N * C) * sizeof(bf16), stream));
        return;
    }
    MF_CHECK(dout != nullptr && weight != nullptr, "matmul_backward_input: null input");
    lt_matmul(
        ctx,
        LtGemm{CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout, OC, dinp, CUDA_R_16BF, C, accumulate ? 1.0f : 0.0f},
        stream);
}

void matmul_backward_weight(GemmContext& ctx, void* dweight, DType dweight_dtype, const bf16* dout, const bf16* inp,
                            int64_t N, int64_t C, int64_t OC, cudaStream_t stream) {
    check_dims("matmul_backward_weight", N, C, OC);
    MF_CHECK(dweight_dtype == DType::f32 || dweight_dtype == DType::bf16,
             "matmul_backward_weight: dweight must be f32 or bf16, got ", dtype_name(dweight_dtype));
    if (N == 0 || C == 0 || OC == 0) return;  // adds an empty sum
    MF_CHECK(dweight != nullptr && dout != nullptr && inp != nullptr, "matmul_backward_weight: null pointer");
    const cudaDataType_t d_type = dweight_dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
    lt_matmul(ctx, LtGemm{CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout, OC, dweight, d_type, C, /*beta=*/1.0f},
              stream);
}

}  // namespace mf::cuda
