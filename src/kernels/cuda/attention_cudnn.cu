// Causal attention on cuDNN's fused flash-attention engines, through the backend graph API.
//
// cuDNN recognises attention as a graph of matmuls, pointwise ops and reductions in the exact shape
// its fused engines match. Forward (S: [B, Hq, T, T] scores, never materialised):
//   S = Q·Kᵀ · scale;  S = select(S, lowest, row >= col);  M = max_row S;  E = exp(S - M);
//   L = Σ_row E;  lse = M + log L;  P = E / L (bf16);  O = P·V
// Backward (P recomputed from lse; Δ = rowsum(dO ∘ O), an fp32 workspace tensor):
//   P = exp(select(S·scale - lse, lowest, row >= col));  dV = Pᵀ·dO;  dP = dO·Vᵀ;
//   dS = (dP - Δ) ∘ P · scale;  dK = dSᵀ·Q;  dQ = dS·K
// With GQA (Hq > Hkv) dK and dV come per query head and are summed over each KV group by a
// reduction node. K and V are handed over as their transposes (strides swapped), as cuDNN's matmul
// wants them. dQ either accumulates in an fp32 workspace (atomics; the engine's fast path) and is
// cast by an identity node, or is written straight from the dP-workspace engine (deterministic).
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/cuda/attention_cudnn.cuh"

#if MOEFORGE_WITH_CUDNN
#include <cudnn.h>
#endif

namespace mf::cuda {

namespace {

bool g_deterministic = true;

bool turned_off() {
    const char* env = std::getenv("MOEFORGE_ATTENTION");
    return env != nullptr && std::string_view(env) == "native";
}

constexpr size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

void set_cudnn_attention_deterministic(bool deterministic) { g_deterministic = deterministic; }
bool cudnn_attention_deterministic() { return g_deterministic; }

#if MOEFORGE_WITH_CUDNN

namespace {

[[noreturn]] void cudnn_fail(cudnnStatus_t status, const char* what) {
    char detail[1024] = {};
    cudnnGetLastErrorString(detail, sizeof(detail));
    MF_FAIL("cuDNN: ", what, ": ", cudnnGetErrorString(status), detail[0] != '\0' ? " (" : "", detail,
            detail[0] != '\0' ? ")" : "");
}

void check(cudnnStatus_t status, const char* what) {
    if (status != CUDNN_STATUS_SUCCESS) [[unlikely]]
        cudnn_fail(status, what);
}

// An owned backend descriptor.
class Desc {
 public:
    explicit Desc(cudnnBackendDescriptorType_t type) {
        check(cudnnBackendCreateDescriptor(type, &d_), "create descriptor");
    }
    ~Desc() {
        if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
    }
    Desc(Desc&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
    Desc(const Desc&) = delete;
    Desc& operator=(const Desc&) = delete;
    Desc& operator=(Desc&&) = delete;

    cudnnBackendDescriptor_t get() const { return d_; }
    template <typename T>
    Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values, int64_t count = 1) {
        check(cudnnBackendSetAttribute(d_, name, type, count, values), "set attribute");
        return *this;
    }
    Desc& set(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t desc) {
        return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &desc);
    }
    void finalize(const char* what) { check(cudnnBackendFinalize(d_), what); }

 private:
    cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// Tensor uids the variant packs bind (virtual tensors count up from kFirstVirtual).
enum Uid : int64_t {
    kQ = 1,
    kK,
    kV,
    kO,
    kStats,
    kDO,
    kDQ,
    kDK,
    kDV,
    kScale,
    kLowest,
    kOne,
    kDelta,
    kDQAccum,
    kFirstVirtual = 100
};

// Builds one operation graph and finds an execution plan for it.
class GraphBuilder {
 public:
    explicit GraphBuilder(cudnnHandle_t handle) : handle_(handle) {}

    cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                    bool is_virtual = false, bool by_value = false) {
        Desc& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
        const int64_t alignment = 16;
        t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type)
            .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4)
            .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4)
            .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid)
            .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment)
            .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &is_virtual);
        if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value);
        t.finalize("tensor descriptor");
        return t.get();
    }
    cudnnBackendDescriptor_t scalar(int64_t uid) {
        return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
    }
    cudnnBackendDescriptor_t virt(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
        return tensor(next_uid_++, type, dims, strides, true);
    }

    // y = mode(x[, b[, t]]); axis for GEN_INDEX.
    void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                   cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t prec = CUDNN_DATA_FLOAT,
                   int64_t axis = -1) {
        Desc& pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
        pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode)
            .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &prec);
        if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
        pw.finalize("pointwise descriptor");
        Desc& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
        op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.get()).set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
        if (b != nullptr) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
        if (t != nullptr) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
        op.set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
        add_op(op, "pointwise operation");
    }
    void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
        Desc& red = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
        const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
        red.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode)
            .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &prec)
            .finalize("reduction descriptor");
        Desc& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
        op.set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
            .set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
            .set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, red.get());
        add_op(op, "reduction operation");
    }
    void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
        Desc& mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
        const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
        mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &prec).finalize("matmul descriptor");
        Desc& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
        op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
            .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
            .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
            .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.get());
        add_op(op, "matmul operation");
    }
    void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
        Desc& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
        op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x).set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
        add_op(op, "reshape operation");
    }

    // The operation graph, then the first heuristics candidate that finalises into a plan (on the
    // deterministic request, the first whose engine is not marked non-deterministic). Throws
    // mf::Error when there is none.
    struct Result {
        std::deque<Desc> descs;  // everything the plan was built from, kept alive with it
        cudnnBackendDescriptor_t plan = nullptr;
        int64_t workspace = 0;
        std::string engine;
    };
    Result build(const char* what, bool need_deterministic) {
        Desc& graph = keep(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
        graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle_)
            .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops_.data(),
                 static_cast<int64_t>(ops_.size()));
        graph.finalize("operation graph");
        Desc& heur = keep(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
        const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
        heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph.get())
            .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode)
            .finalize("engine heuristics");
        int64_t count = 0;
        check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                       &count, nullptr),
              "engine heuristics count");
        std::vector<cudnnBackendDescriptor_t> cfgs;
        for (int64_t i = 0; i < count; ++i) cfgs.push_back(keep(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR).get());
        if (count > 0)
            check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                           count, &count, cfgs.data()),
                  "engine heuristics results");
        std::string tried;
        for (int64_t i = 0; i < count; ++i) {
            Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
            cudnnBackendDescriptor_t e = engine.get();
            int64_t n = 0, index = -1;
            check(cudnnBackendGetAttribute(cfgs[static_cast<size_t>(i)], CUDNN_ATTR_ENGINECFG_ENGINE,
                                           CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e),
                  "engine of a config");
            check(cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index),
                  "engine index");
            std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
            int64_t num_notes = 0;
            check(cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                           static_cast<int64_t>(notes.size()), &num_notes, notes.data()),
                  "engine numerical notes");
            bool nondeterministic = false;
            for (int64_t j = 0; j < num_notes; ++j)
                nondeterministic |= notes[static_cast<size_t>(j)] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
            const std::string name =
                "engine " + std::to_string(index) + (nondeterministic ? " (non-deterministic)" : "");
            tried += (tried.empty() ? "" : ", ") + name;
            if (need_deterministic && nondeterministic) continue;
            Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
            plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle_)
                .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[static_cast<size_t>(i)]);
            if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS) continue;
            Result r;
            check(cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                           &n, &r.workspace),
                  "plan workspace size");
            r.plan = plan.get();
            r.engine = name;
            descs_.push_back(std::move(plan));
            r.descs = std::move(descs_);
            return r;
        }
        MF_FAIL("cuDNN has no usable engine for ", what, " (", count, " candidates", tried.empty() ? "" : ": ", tried,
                need_deterministic ? "; deterministic requested" : "", ")");
    }

 private:
    Desc& keep(cudnnBackendDescriptorType_t type) {
        descs_.emplace_back(type);
        return descs_.back();
    }
    void add_op(Desc& op, const char* what) {
        op.finalize(what);
        ops_.push_back(op.get());
    }

    cudnnHandle_t handle_;
    std::deque<Desc> descs_;  // a deque: references from keep() stay valid as it grows
    std::vector<cudnnBackendDescriptor_t> ops_;
    int64_t next_uid_ = kFirstVirtual;
};

// Layouts of the graph's tensors (dims are [b, h, s, d]-ordered as cuDNN wants them).
struct Layout {
    int64_t b, hq, hk, s, d;
    explicit Layout(const AttentionShape& sh) : b(sh.B), hq(sh.Hq), hk(sh.Hkv), s(sh.T), d(sh.D) {}
    // [B, T, H, D] memory viewed as [b, h, s, d], and its transpose [b, h, d, s].
    Dims bshd_dims(int64_t h) const { return {b, h, s, d}; }
    Dims bshd_strides(int64_t h) const { return {s * h * d, d, h * d, 1}; }
    Dims bshd_t_dims(int64_t h) const { return {b, h, d, s}; }
    Dims bshd_t_strides(int64_t h) const { return {s * h * d, d, 1, h * d}; }
    // Scores [b, hq, s, s] and their transpose; per-row statistics [b, hq, s, 1].
    Dims score_dims() const { return {b, hq, s, s}; }
    Dims score_strides() const { return {hq * s * s, s * s, s, 1}; }
    Dims score_t_strides() const { return {hq * s * s, s * s, 1, s}; }
    Dims row_dims() const { return {b, hq, s, 1}; }
    Dims row_strides() const { return {hq * s, s, 1, 1}; }
    // Per-query-head [b, hq, s, d] in BHSD order (dQ accumulator, per-head dK / dV before the sum).
    Dims bhsd_dims() const { return {b, hq, s, d}; }
    Dims bhsd_strides() const { return {hq * s * d, s * d, d, 1}; }
    size_t delta_bytes() const { return align256(static_cast<size_t>(b * hq * s) * sizeof(float)); }
    size_t dq_accum_bytes() const { return align256(static_cast<size_t>(b * hq * s * d) * sizeof(float)); }
};

// A bf16 tensor in [B, T, H, D] memory (the graph's inputs and outputs), or its transpose.
cudnnBackendDescriptor_t bshd(GraphBuilder& g, const Layout& l, int64_t uid, int64_t heads, bool transposed = false) {
    return transposed ? g.tensor(uid, CUDNN_DATA_BFLOAT16, l.bshd_t_dims(heads), l.bshd_t_strides(heads))
                      : g.tensor(uid, CUDNN_DATA_BFLOAT16, l.bshd_dims(heads), l.bshd_strides(heads));
}
// Virtual fp32 scores [b, hq, s, s] and per-row values [b, hq, s, 1].
cudnnBackendDescriptor_t scores(GraphBuilder& g, const Layout& l) {
    return g.virt(CUDNN_DATA_FLOAT, l.score_dims(), l.score_strides());
}
cudnnBackendDescriptor_t per_row(GraphBuilder& g, const Layout& l) {
    return g.virt(CUDNN_DATA_FLOAT, l.row_dims(), l.row_strides());
}

// The causal mask on scores `x`: select(x, lowest, row >= col).
cudnnBackendDescriptor_t causal_mask(GraphBuilder& g, const Layout& l, cudnnBackendDescriptor_t x,
                                     cudnnBackendDescriptor_t lowest) {
    const cudnnBackendDescriptor_t row = g.virt(CUDNN_DATA_INT32, l.score_dims(), l.score_strides());
    const cudnnBackendDescriptor_t col = g.virt(CUDNN_DATA_INT32, l.score_dims(), l.score_strides());
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
    const cudnnBackendDescriptor_t keep = g.virt(CUDNN_DATA_BOOLEAN, l.score_dims(), l.score_strides());
    g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
    const cudnnBackendDescriptor_t y = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, lowest, keep, y);
    return y;
}

// (Q·Kᵀ) · scale.
cudnnBackendDescriptor_t scaled_scores(GraphBuilder& g, const Layout& l, cudnnBackendDescriptor_t q,
                                       cudnnBackendDescriptor_t kt, cudnnBackendDescriptor_t scale) {
    const auto s = scores(g, l);
    g.matmul(q, kt, s);
    const auto scaled = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_MUL, s, scale, nullptr, scaled);
    return scaled;
}

GraphBuilder::Result build_forward(cudnnHandle_t handle, const AttentionShape& shape) {
    GraphBuilder g(handle);
    const Layout l(shape);
    const auto q = bshd(g, l, kQ, l.hq), kt = bshd(g, l, kK, l.hk, true), v = bshd(g, l, kV, l.hk);
    const auto o = bshd(g, l, kO, l.hq);
    const auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, l.row_dims(), l.row_strides());
    const auto scale = g.scalar(kScale), lowest = g.scalar(kLowest);

    const auto s = causal_mask(g, l, scaled_scores(g, l, q, kt, scale), lowest);
    const auto row_max = per_row(g, l);
    g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, row_max);
    const auto centred = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_SUB, s, row_max, nullptr, centred);
    const auto e = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_EXP, centred, nullptr, nullptr, e);
    const auto row_sum = per_row(g, l);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
    const auto log_sum = per_row(g, l);
    g.pointwise(CUDNN_POINTWISE_LOG, row_sum, nullptr, nullptr, log_sum);
    g.pointwise(CUDNN_POINTWISE_ADD, row_max, log_sum, nullptr, stats);
    const auto p = g.virt(CUDNN_DATA_BFLOAT16, l.score_dims(), l.score_strides());
    g.pointwise(CUDNN_POINTWISE_DIV, e, row_sum, nullptr, p);
    g.matmul(p, v, o);
    return g.build("the attention forward", false);
}

GraphBuilder::Result build_backward(cudnnHandle_t handle, const AttentionShape& shape, bool deterministic) {
    GraphBuilder g(handle);
    const Layout l(shape);
    const auto f32 = CUDNN_DATA_FLOAT, bf = CUDNN_DATA_BFLOAT16;
    const auto q = bshd(g, l, kQ, l.hq), kt = bshd(g, l, kK, l.hk, true), vt = bshd(g, l, kV, l.hk, true);
    const auto o = bshd(g, l, kO, l.hq), dout = bshd(g, l, kDO, l.hq);
    const auto stats = g.tensor(kStats, f32, l.row_dims(), l.row_strides());
    const auto dq = bshd(g, l, kDQ, l.hq), dk = bshd(g, l, kDK, l.hk), dv = bshd(g, l, kDV, l.hk);
    const auto scale = g.scalar(kScale), lowest = g.scalar(kLowest), one = g.scalar(kOne);

    // Δ = rowsum(dO ∘ O), kept in a workspace tensor.
    const auto d_o = g.virt(f32, l.bshd_dims(l.hq), {l.hq * l.s * l.d, l.s * l.d, l.hq * l.d, 1});
    g.pointwise(CUDNN_POINTWISE_MUL, dout, o, nullptr, d_o);
    const auto d_o_sum = per_row(g, l);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, d_o, d_o_sum);
    const auto delta = g.tensor(kDelta, f32, l.row_dims(), l.row_strides());
    g.pointwise(CUDNN_POINTWISE_MUL, d_o_sum, one, nullptr, delta);

    // P = exp(mask(S·scale - lse)).
    const auto centred = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_SUB, scaled_scores(g, l, q, kt, scale), stats, nullptr, centred);
    const auto p = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_EXP, causal_mask(g, l, centred, lowest), nullptr, nullptr, p);

    // dV = Pᵀ·dO (summed over the query heads of each KV group).
    const auto pt = g.virt(bf, l.score_dims(), l.score_t_strides());
    g.reshape(p, pt);
    const bool gqa = l.hq != l.hk;
    auto sum_heads = [&](cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t out) {
        if (!gqa) return g.matmul(a, b, out);
        const auto per_head = g.virt(bf, l.bhsd_dims(), l.bhsd_strides());
        g.matmul(a, b, per_head);
        g.reduction(CUDNN_REDUCE_TENSOR_ADD, per_head, out);
    };
    sum_heads(pt, dout, dv);

    // dS = (dO·Vᵀ - Δ) ∘ P · scale.
    const auto dp = scores(g, l);
    g.matmul(dout, vt, dp);
    const auto dp_centred = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_SUB, dp, delta, nullptr, dp_centred);
    const auto ds_unscaled = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_MUL, dp_centred, p, nullptr, ds_unscaled);
    const auto ds = scores(g, l);
    g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, scale, nullptr, ds);

    // dK = dSᵀ·Q (summed over each KV group).
    const auto dst = g.virt(bf, l.score_dims(), l.score_t_strides());
    g.reshape(ds, dst);
    sum_heads(dst, q, dk);

    // dQ = dS·K, K being Kᵀ reshaped back.
    const auto k = g.virt(bf, l.bshd_dims(l.hk), l.bshd_strides(l.hk));
    g.reshape(kt, k);
    if (deterministic) {
        g.matmul(ds, k, dq);
    } else {
        const auto dq_accum = g.tensor(kDQAccum, f32, l.bhsd_dims(), l.bhsd_strides());
        g.matmul(ds, k, dq_accum);
        g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dq);
    }
    return g.build("the attention backward", deterministic);
}

// The deterministic backward's dP workspace is 2·B·Hq·T² bytes (2.1 GB for B=2, T=4096, Hq=32), so
// it runs over slices of the batch: the most rows (a divisor of B) whose estimated workspace stays
// under this budget, at least one. 1 GiB matches the LM head's logits scratch, which the same
// scratch buffer already holds, so slicing keeps attention from raising the step's peak.
constexpr int64_t kBackwardWorkspaceBudget = int64_t{1} << 30;

// MOEFORGE_CUDNN_ATTENTION_BUDGET (bytes) overrides the budget, for tests of the slicing.
int64_t backward_rows(const AttentionShape& s, bool deterministic) {
    if (!deterministic) return s.B;
    int64_t budget = kBackwardWorkspaceBudget;
    if (const char* env = std::getenv("MOEFORGE_CUDNN_ATTENTION_BUDGET"); env != nullptr && *env != '\0')
        budget = std::strtoll(env, nullptr, 10);
    const int64_t per_row = 2 * s.Hq * s.T * s.T + 4 * s.Hq * s.T * s.D;
    int64_t rows = 1;
    for (int64_t r = 1; r <= s.B; ++r)
        if (s.B % r == 0 && r * per_row <= budget) rows = r;
    return rows;
}

struct Plans {
    GraphBuilder::Result fwd, bwd;  // bwd for bwd_shape: bwd_shape.B rows of the batch per call
    AttentionShape bwd_shape{};
    bool deterministic = true;
};

struct Cache {
    std::mutex mu;
    std::map<int, cudnnHandle_t> handles;
    // (device, B, T, Hq, Hkv, D, backward rows per call, deterministic) -> plans, or nullptr where cuDNN
    // refused the shape.
    std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>, std::unique_ptr<Plans>> plans;
};

Cache& cache() {
    static Cache* c = new Cache;  // never destroyed: plans may be used until process exit
    return *c;
}

cudnnHandle_t handle_for(Cache& c, int device) {
    auto it = c.handles.find(device);
    if (it != c.handles.end()) return it->second;
    cudnnHandle_t h = nullptr;
    check(cudnnCreate(&h), "cudnnCreate");
    c.handles.emplace(device, h);
    return h;
}

// The plans for `shape` on the current device, or nullptr when cuDNN does not serve it. Sets
// *handle to the device's handle.
const Plans* plans_for(const AttentionShape& shape, cudnnHandle_t* handle) {
    int device = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    Cache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    const int64_t rows = backward_rows(shape, g_deterministic);
    const auto key = std::make_tuple(device, shape.B, shape.T, shape.Hq, shape.Hkv, shape.D, rows, g_deterministic);
    if (auto it = c.plans.find(key); it != c.plans.end()) {
        if (it->second != nullptr) *handle = c.handles.at(device);  // made when these plans were built
        return it->second.get();
    }
    std::unique_ptr<Plans> p;
    try {  // a cuDNN that cannot even make a handle here declines too
        *handle = handle_for(c, device);
        p = std::make_unique<Plans>();
        p->fwd = build_forward(*handle, shape);
        p->bwd_shape = shape;
        p->bwd_shape.B = rows;
        p->bwd = build_backward(*handle, p->bwd_shape, g_deterministic);
        p->deterministic = g_deterministic;
        if (std::getenv("MOEFORGE_ATTENTION_VERBOSE") != nullptr)
            std::fprintf(stderr,
                         "moeforge: cuDNN attention B=%lld T=%lld Hq=%lld Hkv=%lld D=%lld: forward %s (workspace %lld "
                         "B), backward %s (workspace %lld B, %lld rows per call)\n",
                         static_cast<long long>(shape.B), static_cast<long long>(shape.T),
                         static_cast<long long>(shape.Hq), static_cast<long long>(shape.Hkv),
                         static_cast<long long>(shape.D), p->fwd.engine.c_str(),
                         static_cast<long long>(p->fwd.workspace), p->bwd.engine.c_str(),
                         static_cast<long long>(p->bwd.workspace), static_cast<long long>(p->bwd_shape.B));
    } catch (const Error& e) {
        std::fprintf(stderr,
                     "moeforge: attention B=%lld T=%lld Hq=%lld Hkv=%lld D=%lld stays on moeforge's kernels: %s\n",
                     static_cast<long long>(shape.B), static_cast<long long>(shape.T), static_cast<long long>(shape.Hq),
                     static_cast<long long>(shape.Hkv), static_cast<long long>(shape.D), e.what());
        p.reset();
    }
    return c.plans.emplace(key, std::move(p)).first->second.get();
}

const Plans& served_plans(const AttentionShape& shape, cudnnHandle_t* handle, const char* what) {
    const Plans* p = plans_for(shape, handle);
    MF_CHECK(p != nullptr, what, ": cuDNN does not serve this shape (ask cudnn_attention_serves first)");
    return *p;
}

void execute(cudnnHandle_t handle, const GraphBuilder::Result& plan, const std::vector<int64_t>& uids,
             const std::vector<void*>& ptrs, void* workspace, cudaStream_t stream, const char* what) {
    check(cudnnSetStream(handle, stream), "cudnnSetStream");
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), static_cast<int64_t>(uids.size()))
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(), static_cast<int64_t>(ptrs.size()))
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &workspace)
        .finalize("variant pack");
    check(cudnnBackendExecute(handle, plan.plan, pack.get()), what);
}

bool shape_fits(const AttentionShape& s) {
    // The engines want whole 128-key tiles without a padding mask (cuDNN <= 9.15 needs one for
    // T % 128 != 0), head dims the fused kernels hold, and sizes cuDNN's int64 strides index.
    return s.B > 0 && s.T > 0 && s.T % 128 == 0 && (s.D == 64 || s.D == 128) && s.Hkv > 0 && s.Hq % s.Hkv == 0 &&
           s.B * s.Hq * s.T * s.T < (int64_t{1} << 40);
}

}  // namespace

bool cudnn_attention_serves(const AttentionShape& shape) {
    if (turned_off() || !shape_fits(shape)) return false;
    cudnnHandle_t handle = nullptr;
    return plans_for(shape, &handle) != nullptr;
}

size_t cudnn_attention_forward_workspace_bytes(const AttentionShape& shape) {
    cudnnHandle_t handle = nullptr;
    return align256(static_cast<size_t>(served_plans(shape, &handle, "attention forward").fwd.workspace));
}

size_t cudnn_attention_backward_workspace_bytes(const AttentionShape& shape) {
    cudnnHandle_t handle = nullptr;
    const Plans& p = served_plans(shape, &handle, "attention backward");
    const Layout l(p.bwd_shape);
    return align256(static_cast<size_t>(p.bwd.workspace)) + l.delta_bytes() +
           (p.deterministic ? 0 : l.dq_accum_bytes());
}

void cudnn_attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                             const AttentionShape& shape, void* workspace, cudaStream_t stream) {
    cudnnHandle_t handle = nullptr;
    const Plans& p = served_plans(shape, &handle, "attention forward");
    float scale = 1.0f / std::sqrt(static_cast<float>(shape.D));
    float lowest = std::numeric_limits<float>::lowest();
    execute(handle, p.fwd, {kQ, kK, kV, kO, kStats, kScale, kLowest},
            {const_cast<bf16*>(q), const_cast<bf16*>(k), const_cast<bf16*>(v), out, lse, &scale, &lowest}, workspace,
            stream, "attention forward");
}

void cudnn_attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                              const bf16* v, const bf16* out, const float* lse, const AttentionShape& shape,
                              void* workspace, cudaStream_t stream) {
    cudnnHandle_t handle = nullptr;
    const Plans& p = served_plans(shape, &handle, "attention backward");
    const Layout l(p.bwd_shape);
    char* ws = static_cast<char*>(workspace);
    void* delta = ws + align256(static_cast<size_t>(p.bwd.workspace));
    void* dq_accum = static_cast<char*>(delta) + l.delta_bytes();
    float scale = 1.0f / std::sqrt(static_cast<float>(shape.D));
    float lowest = std::numeric_limits<float>::lowest();
    float one = 1.0f;
    // Element offsets of one slice of bwd_shape.B rows in the [B, T, H, D] and [B, Hq, T] tensors.
    const int64_t rows = p.bwd_shape.B;
    const int64_t q_step = rows * shape.T * shape.Hq * shape.D, kv_step = rows * shape.T * shape.Hkv * shape.D,
                  lse_step = rows * shape.Hq * shape.T;
    for (int64_t b = 0; b < shape.B; b += rows) {
        const int64_t i = b / rows;
        std::vector<int64_t> uids = {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kLowest, kOne, kDelta};
        std::vector<void*> ptrs = {const_cast<bf16*>(q + i * q_step),
                                   const_cast<bf16*>(k + i * kv_step),
                                   const_cast<bf16*>(v + i * kv_step),
                                   const_cast<bf16*>(out + i * q_step),
                                   const_cast<bf16*>(dout + i * q_step),
                                   const_cast<float*>(lse + i * lse_step),
                                   dq + i * q_step,
                                   dk + i * kv_step,
                                   dv + i * kv_step,
                                   &scale,
                                   &lowest,
                                   &one,
                                   delta};
        if (!p.deterministic) {
            MF_CHECK_CUDA(cudaMemsetAsync(dq_accum, 0, l.dq_accum_bytes(), stream));
            uids.push_back(kDQAccum);
            ptrs.push_back(dq_accum);
        }
        execute(handle, p.bwd, uids, ptrs, ws, stream, "attention backward");
    }
}

#else  // built without cuDNN

bool cudnn_attention_serves(const AttentionShape&) { return false; }
size_t cudnn_attention_forward_workspace_bytes(const AttentionShape&) { MF_FAIL("built without cuDNN"); }
size_t cudnn_attention_backward_workspace_bytes(const AttentionShape&) { MF_FAIL("built without cuDNN"); }
void cudnn_attention_forward(bf16*, float*, const bf16*, const bf16*, const bf16*, const AttentionShape&, void*,
                             cudaStream_t) {
    MF_FAIL("built without cuDNN");
}
void cudnn_attention_backward(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                              const float*, const AttentionShape&, void*, cudaStream_t) {
    MF_FAIL("built without cuDNN");
}

#endif

}  // namespace mf::cuda
