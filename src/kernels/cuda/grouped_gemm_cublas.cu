// Grouped expert GEMMs through cuBLASLt (formulas and the offsets contract: grouped_gemm_cublas.cuh).
//
// Each call copies the E + 1 offsets to a pinned host buffer (one D2H copy, one stream sync), clamps
// them as the own kernel does, and issues one cuBLASLt matmul per non-empty group, in the column-major
// form of gemm.cu (a row-major [R, S] matrix is the column-major [S, R] one, so no data moves):
//   forward          outᵀ[OC, n]   = (W_e as col-major [C, OC], op T) · (inp rows as [C, n], op N)
//   backward input   dinpᵀ[C, n]   = (W_e as col-major [C, OC], op N) · (dout rows as [OC, n], op N)
//   backward weight  dW_eᵀ[C, OC] += (inp rows as [C, n], op N)        · (dout rows as [OC, n], op T)
// The matmuls are spread over num_lanes streams (the caller's stream plus side streams forked from it
// and joined back with events; the least loaded lane takes the next group), so the small products of
// many experts run side by side; every lane owns its workspace. The rows of a group (n for the row
// products, k for the weight gradient) change from call to call, so the algorithm is chosen per
// row BUCKET (the next power of two, at least 16): per (product, m, n, k with the row dimension
// bucketed, output type) one heuristic query on the bucket's shape, cached with its layouts; each
// group then sets its exact rows on those layouts (descriptors are read when the matmul is issued)
// and runs the bucket's algorithm. Should cuBLASLt refuse that algorithm for the exact shape, the
// exact shape's own heuristic answer is used (and cached). A group costs the host a hash lookup,
// two or three attribute writes and one cublasLtMatmul. (An exact-shape cache missed on nearly every
// group of a training step, since routing changes the rows each step: a heuristic query per group
// made the step several times slower than the kernel benchmark.)
//
// Chosen over one cublasGemmGroupedBatchedEx call (also tried, H200, CUDA 13): that was slower at every
// Qwen3-30B-A3B expert shape we timed but the down projection at 512 rows per expert (e.g. 282 vs 520
// TFLOP/s forward for gate_up at 131072 rows over 128 experts) and does not take an fp32 C with bf16 A/B
// (CUBLAS_STATUS_NOT_SUPPORTED), which the fp32 weight gradient needs.
//
// Determinism: every output element belongs to exactly one group product, and a given (product, m, n,
// k, output type) always runs the same algorithm (its bucket's, or its own cached fallback) with the
// same workspace size. Reduction
// schemes are restricted to NONE and COMPUTE_TYPE (split-K partials kept in fp32 in the lane's
// workspace and summed by a separate pass in a fixed order), so no atomics are involved and the fp32
// sum meets the stored value once, through beta (a bf16 output is rounded once). Lanes change only
// which stream a product runs on, not how it is computed.
#include <algorithm>
#include <cstddef>
#include <functional>
#include <unordered_map>
#include <vector>

#include "core/check.h"
#include "core/cuda_check.h"
#include "kernels/cuda/cublas_check.cuh"
#include "kernels/cuda/grouped_gemm_cublas.cuh"

namespace mf::cuda {

namespace {

constexpr size_t kLaneWorkspaceBytes = size_t{16} << 20;
// Every group pointer is a 16-byte aligned base plus a multiple of 8 bf16 (or fp32) elements.
constexpr uint32_t kOperandAlignment = 16;
constexpr size_t kMaxCachedPlans = size_t{1} << 13;

enum class Product : int { forward = 0, backward_input = 1, backward_weight = 2 };
constexpr int kNumProducts = 3;

// The three products' operand transposes (column-major view, see the file comment).
constexpr cublasOperation_t kTransA[kNumProducts] = {CUBLAS_OP_T, CUBLAS_OP_N, CUBLAS_OP_N};
constexpr cublasOperation_t kTransB[kNumProducts] = {CUBLAS_OP_N, CUBLAS_OP_N, CUBLAS_OP_T};

// (product, m, n, k, output type) fixes the leading dimensions too: lda = m for products 1 and 2 and
// k for the forward, ldb = k (forward, backward input) or n (backward weight), ldd = m.
struct PlanKey {
    int product;
    int64_t m, n, k;
    int d_type;
    bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
    size_t operator()(const PlanKey& key) const noexcept {
        size_t h = std::hash<int64_t>{}(key.m);
        for (int64_t v : {key.n, key.k, static_cast<int64_t>(key.product), static_cast<int64_t>(key.d_type)})
            h = h * 1000003u ^ std::hash<int64_t>{}(v);
        return h;
    }
};

struct Plan {
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
};

void destroy_layouts(Plan& plan) {
    if (plan.d != nullptr) cublasLtMatrixLayoutDestroy(plan.d);
    if (plan.b != nullptr) cublasLtMatrixLayoutDestroy(plan.b);
    if (plan.a != nullptr) cublasLtMatrixLayoutDestroy(plan.a);
    plan.a = plan.b = plan.d = nullptr;
}

// One group's column-major product D[m, n] (+)= op(A)[m, k] · op(B)[k, n].
struct GroupProduct {
    int64_t m, n, k;
    const void* a;
    int64_t lda;
    const void* b;
    int64_t ldb;
    void* d;
    int64_t ldd;
};

}  // namespace

struct GroupedGemmCublas::State {
    cublasLtHandle_t lt = nullptr;
    int num_lanes = 1;
    int32_t* host_offsets = nullptr;         // pinned, kMaxGroupedExperts + 1
    std::vector<int64_t> begin;              // the clamped offsets of the current call
    std::vector<GroupProduct> groups;        // the current call's non-empty groups
    std::vector<cudaStream_t> side_streams;  // lanes 1 .. num_lanes - 1
    std::vector<cudaEvent_t> side_done;
    cudaEvent_t fork = nullptr;
    void* workspace = nullptr;  // num_lanes · kLaneWorkspaceBytes
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulDesc_t ops[kNumProducts] = {};
    std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;

    void clear_plans() {
        for (auto& [key, plan] : plans) destroy_layouts(plan);
        plans.clear();
    }
    ~State() {
        // Destructors must not throw: release what exists and ignore late errors.
        clear_plans();
        for (cublasLtMatmulDesc_t op : ops)
            if (op != nullptr) cublasLtMatmulDescDestroy(op);
        if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
        if (workspace != nullptr) cudaFree(workspace);
        if (host_offsets != nullptr) cudaFreeHost(host_offsets);
        if (fork != nullptr) cudaEventDestroy(fork);
        for (cudaEvent_t e : side_done) cudaEventDestroy(e);
        for (cudaStream_t st : side_streams) cudaStreamDestroy(st);
    }
};

GroupedGemmCublas::GroupedGemmCublas(cublasLtHandle_t lt, int num_lanes) : state_(std::make_unique<State>()) {
    MF_CHECK(lt != nullptr, "GroupedGemmCublas: the cuBLASLt handle is null");
    MF_CHECK(num_lanes >= 1 && num_lanes <= 16, "GroupedGemmCublas: num_lanes=", num_lanes, " must be in [1, 16]");
    State& s = *state_;
    s.lt = lt;
    s.num_lanes = num_lanes;
    MF_CHECK_CUDA(cudaMallocHost(&s.host_offsets, (kMaxGroupedExperts + 1) * sizeof(int32_t)));
    MF_CHECK_CUDA(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
    for (int lane = 1; lane < num_lanes; ++lane) {
        cudaStream_t st = nullptr;
        MF_CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        s.side_streams.push_back(st);
        cudaEvent_t done = nullptr;
        MF_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
        s.side_done.push_back(done);
    }
    MF_CHECK_CUDA(cudaMalloc(&s.workspace, static_cast<size_t>(num_lanes) * kLaneWorkspaceBytes));

    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&s.pref));
    const uint64_t workspace_bytes = kLaneWorkspaceBytes;
    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &workspace_bytes, sizeof(workspace_bytes)));
    // No in-place (output-type, counter-ordered) reduction: split-K sums stay fp32 and meet beta once.
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    MF_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                         sizeof(schemes)));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
        MF_CHECK_CUBLAS(
            cublasLtMatmulPreferenceSetAttribute(s.pref, attr, &kOperandAlignment, sizeof(kOperandAlignment)));

    for (int p = 0; p < kNumProducts; ++p) {
        MF_CHECK_CUBLAS(cublasLtMatmulDescCreate(&s.ops[p], CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const int32_t trans_a = kTransA[p], trans_b = kTransB[p];
        MF_CHECK_CUBLAS(
            cublasLtMatmulDescSetAttribute(s.ops[p], CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
        MF_CHECK_CUBLAS(
            cublasLtMatmulDescSetAttribute(s.ops[p], CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
    }
}

GroupedGemmCublas::~GroupedGemmCublas() = default;

namespace {

// ---------------------------------------------------------------------------------------------
// argument checks and offsets

// The offsets on the host (the caller's copy, or read from the device: one stream sync), clamped
// like the own kernel clamps them: each to [0, M], then to the running maximum, so they are
// non-decreasing and in range (valid offsets are unchanged).
void read_offsets(GroupedGemmCublas::State& s, const int32_t* offsets, std::span<const int32_t> host_offsets, int64_t M,
                  int64_t E, cudaStream_t stream) {
    const int32_t* src = host_offsets.data();
    if (host_offsets.empty()) {
        MF_CHECK_CUDA(cudaMemcpyAsync(s.host_offsets, offsets, static_cast<size_t>(E + 1) * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, stream));
        wait_for_stream(stream);  // bounded by dist.timeout_s in a multi-process run (core/tensor.h)
        src = s.host_offsets;
    } else {
        MF_CHECK(static_cast<int64_t>(host_offsets.size()) == E + 1, "grouped_matmul (cuBLAS): ", host_offsets.size(),
                 " host offsets for ", E, " groups (need E + 1)");
    }
    s.begin.resize(static_cast<size_t>(E + 1));
    int64_t running = 0;
    for (int64_t e = 0; e <= E; ++e) {
        running = std::max(running, std::clamp<int64_t>(src[e], 0, M));
        s.begin[e] = running;
    }
}

// ---------------------------------------------------------------------------------------------
// issue

// Side lanes wait for the caller's stream; the caller's stream waits for every used side lane. The
// destructor joins (ignoring errors) when an exception left the call half-issued.
class LaneFork {
 public:
    LaneFork(GroupedGemmCublas::State& s, int lanes, cudaStream_t stream) : s_(s), lanes_(lanes), stream_(stream) {
        if (lanes_ <= 1) return;
        MF_CHECK_CUDA(cudaEventRecord(s_.fork, stream_));
        for (int i = 0; i + 1 < lanes_; ++i) MF_CHECK_CUDA(cudaStreamWaitEvent(s_.side_streams[i], s_.fork, 0));
    }
    ~LaneFork() {
        if (joined_) return;
        for (int i = 0; i + 1 < lanes_; ++i) {
            cudaEventRecord(s_.side_done[i], s_.side_streams[i]);
            cudaStreamWaitEvent(stream_, s_.side_done[i], 0);
        }
    }
    LaneFork(const LaneFork&) = delete;
    LaneFork& operator=(const LaneFork&) = delete;

    cudaStream_t stream_of(int lane) const { return lane == 0 ? stream_ : s_.side_streams[lane - 1]; }
    void join() {
        joined_ = true;
        for (int i = 0; i + 1 < lanes_; ++i) {
            MF_CHECK_CUDA(cudaEventRecord(s_.side_done[i], s_.side_streams[i]));
            MF_CHECK_CUDA(cudaStreamWaitEvent(stream_, s_.side_done[i], 0));
        }
    }

 private:
    GroupedGemmCublas::State& s_;
    int lanes_;
    cudaStream_t stream_;
    bool joined_ = false;
};

// The row dimension of a product (n for the forward and backward input, k for the weight gradient)
// rounded up to its bucket.
int64_t row_bucket(int64_t rows) {
    int64_t b = 16;
    while (b < rows) b *= 2;
    return b;
}

// Sets a column-major layout's rows and columns.
void set_dims(cublasLtMatrixLayout_t layout, int64_t rows, int64_t cols) {
    const uint64_t r = static_cast<uint64_t>(rows), c = static_cast<uint64_t>(cols);
    MF_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof r));
    MF_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof c));
}

// Points the plan's layouts at the exact shape of g.
void shape_layouts(const Plan& plan, Product product, const GroupProduct& g) {
    const int p = static_cast<int>(product);
    const bool ta = kTransA[p] == CUBLAS_OP_T, tb = kTransB[p] == CUBLAS_OP_T;
    set_dims(plan.a, ta ? g.k : g.m, ta ? g.m : g.k);
    set_dims(plan.b, tb ? g.n : g.k, tb ? g.k : g.n);
    set_dims(plan.d, g.m, g.n);
}

// The layouts of a product shape and the heuristic's first algorithm for it (created on first use).
const Plan& find_plan(GroupedGemmCublas::State& s, Product product, cudaDataType_t d_type, const GroupProduct& g,
                      bool exact) {
    GroupProduct shape = g;
    if (!exact)
        (product == Product::backward_weight ? shape.k : shape.n) =
            row_bucket(product == Product::backward_weight ? g.k : g.n);
    const PlanKey key{static_cast<int>(product) + (exact ? kNumProducts : 0), shape.m, shape.n, shape.k,
                      static_cast<int>(d_type)};
    if (auto it = s.plans.find(key); it != s.plans.end()) return it->second;
    const int p = static_cast<int>(product);
    const bool ta = kTransA[p] == CUBLAS_OP_T, tb = kTransB[p] == CUBLAS_OP_T;
    Plan plan;
    struct Guard {  // destroys the layouts unless the plan made it into the cache
        Plan* plan;
        ~Guard() {
            if (plan != nullptr) destroy_layouts(*plan);
        }
    } guard{&plan};
    MF_CHECK_CUBLAS(
        cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_16BF, ta ? shape.k : shape.m, ta ? shape.m : shape.k, shape.lda));
    MF_CHECK_CUBLAS(
        cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_16BF, tb ? shape.n : shape.k, tb ? shape.k : shape.n, shape.ldb));
    MF_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.d, d_type, shape.m, shape.n, shape.ldd));
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    MF_CHECK_CUBLAS(
        cublasLtMatmulAlgoGetHeuristic(s.lt, s.ops[p], plan.a, plan.b, plan.d, plan.d, s.pref, 1, &heuristic, &found));
    MF_CHECK(found > 0, "grouped_matmul (cuBLAS): cuBLASLt has no algorithm for m=", shape.m, " n=", shape.n,
             " k=", shape.k);
    plan.algo = heuristic.algo;
    if (s.plans.size() >= kMaxCachedPlans) s.clear_plans();
    const Plan& cached = s.plans.emplace(key, plan).first->second;
    guard.plan = nullptr;
    return cached;
}

void issue(GroupedGemmCublas::State& s, Product product, cudaDataType_t d_type, float beta, cudaStream_t stream) {
    if (s.groups.empty()) return;
    const int lanes = static_cast<int>(std::min<size_t>(static_cast<size_t>(s.num_lanes), s.groups.size()));
    LaneFork fork(s, lanes, stream);
    std::vector<double> load(static_cast<size_t>(lanes), 0.0);
    const float alpha = 1.0f;
    for (const GroupProduct& g : s.groups) {
        // The least loaded lane takes the next group (ties go to the lowest lane).
        const int lane = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
        load[lane] += static_cast<double>(g.m) * static_cast<double>(g.n) * static_cast<double>(g.k);
        void* workspace = static_cast<char*>(s.workspace) + static_cast<size_t>(lane) * kLaneWorkspaceBytes;
        const int p = static_cast<int>(product);
        // The bucket's algorithm on the exact shape; if cuBLASLt refuses it, the exact shape's own.
        const PlanKey exact_key{p + kNumProducts, g.m, g.n, g.k, static_cast<int>(d_type)};
        const bool known_exact = s.plans.count(exact_key) != 0;
        const Plan& plan = find_plan(s, product, d_type, g, known_exact);
        shape_layouts(plan, product, g);
        cublasStatus_t st = cublasLtMatmul(s.lt, s.ops[p], &alpha, g.a, plan.a, g.b, plan.b, &beta, g.d, plan.d, g.d,
                                           plan.d, &plan.algo, workspace, kLaneWorkspaceBytes, fork.stream_of(lane));
        if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
            const Plan& own = find_plan(s, product, d_type, g, true);
            st = cublasLtMatmul(s.lt, s.ops[p], &alpha, g.a, own.a, g.b, own.b, &beta, g.d, own.d, g.d, own.d,
                                &own.algo, workspace, kLaneWorkspaceBytes, fork.stream_of(lane));
        }
        MF_CHECK_CUBLAS(st);
    }
    fork.join();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// public entries

void grouped_matmul_forward_cublas(GroupedGemmCublas& ctx, bf16* out, const bf16* inp, const bf16* weight,
                                   const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                                   cudaStream_t stream, std::span<const int32_t> host_offsets) {
    check_grouped_args("grouped_matmul_forward_cublas", out, inp, weight, offsets, M, E, C, OC);
    if (M == 0 || E == 0 || OC == 0) return;
    GroupedGemmCublas::State& s = ctx.state();
    read_offsets(s, offsets, host_offsets, M, E, stream);
    const int64_t first = s.begin[0], last = s.begin[E];
    if (last == first) return;
    if (C == 0) {  // an empty reduction writes zeros
        MF_CHECK_CUDA(
            cudaMemsetAsync(out + first * OC, 0, static_cast<size_t>((last - first) * OC) * sizeof(bf16), stream));
        return;
    }
    s.groups.clear();
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = s.begin[e], rows = s.begin[e + 1] - r0;
        if (rows == 0) continue;
        s.groups.push_back({OC, rows, C, weight + e * OC * C, C, inp + r0 * C, C, out + r0 * OC, OC});
    }
    issue(s, Product::forward, CUDA_R_16BF, 0.0f, stream);
}

void grouped_matmul_backward_input_cublas(GroupedGemmCublas& ctx, bf16* dinp, const bf16* dout, const bf16* weight,
                                          const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                                          bool accumulate, cudaStream_t stream, std::span<const int32_t> host_offsets) {
    check_grouped_args("grouped_matmul_backward_input_cublas", dinp, dout, weight, offsets, M, E, C, OC);
    if (M == 0 || E == 0 || C == 0) return;
    GroupedGemmCublas::State& s = ctx.state();
    read_offsets(s, offsets, host_offsets, M, E, stream);
    const int64_t first = s.begin[0], last = s.begin[E];
    if (last == first) return;
    if (OC == 0) {  // an empty reduction: "=" writes zeros, "+=" adds nothing
        if (!accumulate)
            MF_CHECK_CUDA(
                cudaMemsetAsync(dinp + first * C, 0, static_cast<size_t>((last - first) * C) * sizeof(bf16), stream));
        return;
    }
    s.groups.clear();
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = s.begin[e], rows = s.begin[e + 1] - r0;
        if (rows == 0) continue;
        s.groups.push_back({C, rows, OC, weight + e * OC * C, C, dout + r0 * OC, OC, dinp + r0 * C, C});
    }
    issue(s, Product::backward_input, CUDA_R_16BF, accumulate ? 1.0f : 0.0f, stream);
}

void grouped_matmul_backward_weight_cublas(GroupedGemmCublas& ctx, void* dweight, DType dweight_dtype, const bf16* dout,
                                           const bf16* inp, const int32_t* offsets, int64_t M, int64_t E, int64_t C,
                                           int64_t OC, cudaStream_t stream, std::span<const int32_t> host_offsets,
                                           bool accumulate) {
    check_grouped_args("grouped_matmul_backward_weight_cublas", dweight, dout, inp, offsets, M, E, C, OC);
    MF_CHECK(dweight_dtype == DType::f32 || dweight_dtype == DType::bf16,
             "grouped_matmul_backward_weight_cublas: dweight must be f32 or bf16, got ", dtype_name(dweight_dtype));
    if (E == 0 || C == 0 || OC == 0) return;
    const size_t elem = dweight_dtype == DType::f32 ? sizeof(float) : sizeof(bf16);
    const size_t slice_bytes = static_cast<size_t>(OC * C) * elem;
    if (M == 0) {  // every group empty: adds empty sums, or writes zeros
        if (!accumulate) MF_CHECK_CUDA(cudaMemsetAsync(dweight, 0, static_cast<size_t>(E) * slice_bytes, stream));
        return;
    }
    GroupedGemmCublas::State& s = ctx.state();
    read_offsets(s, offsets, host_offsets, M, E, stream);
    s.groups.clear();
    for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = s.begin[e], rows = s.begin[e + 1] - r0;
        void* slice = static_cast<char*>(dweight) + static_cast<size_t>(e) * slice_bytes;
        if (rows == 0) {  // an empty group leaves dweight[e] unchanged, or zeroes it
            if (!accumulate) MF_CHECK_CUDA(cudaMemsetAsync(slice, 0, slice_bytes, stream));
            continue;
        }
        s.groups.push_back({C, OC, rows, inp + r0 * C, C, dout + r0 * OC, OC, slice, C});
    }
    const cudaDataType_t d_type = dweight_dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
    issue(s, Product::backward_weight, d_type, accumulate ? 1.0f : 0.0f, stream);
}

}  // namespace mf::cuda
