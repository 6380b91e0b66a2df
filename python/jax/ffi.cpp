// moeforge._jax_ffi: XLA FFI handlers over moeforge's C API (include/moeforge/moeforge.h), for
// moeforge.jax. Typed handlers (xla/ffi/api/ffi.h, the headers of the jaxlib the module is built
// against), each registered twice by moeforge.jax: for CUDA (the stream XLA gives the call is the
// mf_context's stream; the device is the buffers') and for the CPU (the C API's CPU reference
// kernels). What each computes:
//
//   grouped_matmul      out[m] = x[m] · w[g(m)] (jax.lax.ragged_dot), x [M, K], w [G, K, N],
//                       group_sizes [G] i32 → out [M, N] (rows past the last group zero), offsets [G + 1]
//   grouped_matmul_bwd  dx = dout · w[g]ᵀ (rows past the groups zero), dw[g] = x[rows g]ᵀ · dout[rows g]
//                       (an empty group's is exactly 0), from the forward's offsets
//   expert_mlp          y = down(SwiGLU(gate_up(x))) per group, gate_up [E, 2I, H] (gate rows first),
//                       down [E, H, I] (the C API's, HF's stacked layout) → y, and h [M, 2I], a [M, I]
//                       and offsets kept for the backward
//   expert_mlp_bwd      dx, dgate_up, ddown (written), with da, dh as scratch outputs
//   moe_ffn / _bwd      mf_moe_block_forward / backward: the whole dropless layer; the activations the
//                       backward reads are an int32 output of the forward, the scratch one of the backward
//   route_softmax / _sigmoid (+ _bwd)  the routers: logits [N, E] f32 → probs or scores, topk_idx,
//                       topk_weight; dlogits from dtopk_weight (and, softmax, dprobs)
//   aux_stats / aux_dprobs  the load-balancing loss's per-expert counts and probability sums of one
//                       layer, and its gradient at the probabilities
//   permute / _bwd      the pairs grouped by expert (expert_offsets, sorted_pair, pair_row) and x's rows
//                       in that order; dx summed back per token
//   unpermute / _bwd    y = Σ_k w · y_perm[pair_row]; dy_perm and dtopk_weight
//
// Invariants. No handler synchronises with the host: group sizes become offsets on the device
// (mf_group_offsets) and every kernel reads them there. Every buffer a handler needs is an XLA
// buffer (an argument or a result sized by moeforge.jax at trace time); XLA's scratch allocator is
// not used, and the ops that need scratch on a GPU get a result of the call as their workspace.
// A failed C API call becomes an ffi::Error carrying mf_last_error()'s message.
// NOTE: the C API wants the MoE block's workspace 128-byte aligned on a GPU (64 on the CPU), what
// XLA gives its buffers: the activations are kept as the C API's image from byte 0 of their buffer,
// and a call whose buffer is not aligned (should XLA ever give less) goes through an aligned copy of
// it (stream-ordered cudaMallocAsync on a GPU), so the image stays valid wherever XLA moves it.
#include "xla/ffi/api/ffi.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>

#include "moeforge/moeforge.h"

#ifdef MOEFORGE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef MOEFORGE_JAXLIB_VERSION
#error "MOEFORGE_JAXLIB_VERSION (the jaxlib version the module is built against) must be defined by the build"
#endif

namespace ffi = xla::ffi;
namespace py = pybind11;

namespace {

// --- where a call runs -----------------------------------------------------------------------------

struct Where {
    int32_t device_type = MF_CPU;
    int32_t device_index = 0;
    void* stream = nullptr;  // the cudaStream_t XLA gave the call (CUDA only)
    mf_context context{};    // (CUDA only)

    // The C API's context: NULL on the CPU.
    const mf_context* ctx() const { return device_type == MF_CUDA ? &context : nullptr; }
    bool on_gpu() const { return device_type == MF_CUDA; }
    // The alignment the C API wants of the MoE block's buffers here.
    size_t workspace_alignment() const { return on_gpu() ? 128 : 64; }

    static Where cpu() { return Where{}; }
#ifdef MOEFORGE_WITH_CUDA
    // The device is that of `buffer` (an argument of the call), else the thread's current one.
    static Where cuda(cudaStream_t stream, const void* buffer) {
        Where w;
        w.device_type = MF_CUDA;
        w.stream = stream;
        int device = -1;
        cudaPointerAttributes attributes{};
        if (buffer != nullptr && cudaPointerGetAttributes(&attributes, buffer) == cudaSuccess &&
            attributes.type == cudaMemoryTypeDevice) {
            device = attributes.device;
        } else {
            (void)cudaGetLastError();  // (a failed query leaves no sticky error behind)
            if (cudaGetDevice(&device) != cudaSuccess) device = 0;
        }
        w.device_index = device;
        w.context.device = device;
        w.context.stream = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(stream));
        return w;
    }
#endif
};

// --- errors ----------------------------------------------------------------------------------------

ffi::ErrorCode code_of(mf_status status) {
    switch (status) {
        case MF_ERR_INVALID_ARGUMENT:
            return ffi::ErrorCode::kInvalidArgument;
        case MF_ERR_UNSUPPORTED:
            return ffi::ErrorCode::kUnimplemented;
        default:
            return ffi::ErrorCode::kInternal;
    }
}

// A C API call's status as an ffi::Error naming the moeforge.jax op.
ffi::Error checked(mf_status status, const char* op) {
    if (status == MF_OK) return ffi::Error::Success();
    return ffi::Error(code_of(status), std::string("moeforge.jax ") + op + ": " + mf_last_error());
}

#define MF_FFI_RETURN_IF_ERROR(expr)                       \
    do {                                                   \
        ffi::Error mf_ffi_error_ = (expr);                 \
        if (mf_ffi_error_.failure()) return mf_ffi_error_; \
    } while (0)

#define MF_FFI_CALL(op, call) MF_FFI_RETURN_IF_ERROR(checked((call), (op)))

// --- memory on either device -----------------------------------------------------------------------

#ifdef MOEFORGE_WITH_CUDA
ffi::Error cuda_checked(cudaError_t error, const char* op, const char* what) {
    if (error == cudaSuccess) return ffi::Error::Success();
    return ffi::Error::Internal(std::string("moeforge.jax ") + op + ": " + what +
                                " failed: " + cudaGetErrorString(error));
}

// The call's device current while it lives (the stream's device: cudaMemsetAsync and friends need it).
class DeviceGuard {
 public:
    explicit DeviceGuard(int device) {
        if (cudaGetDevice(&saved_) == cudaSuccess && saved_ != device && cudaSetDevice(device) == cudaSuccess)
            switched_ = true;
    }
    ~DeviceGuard() {
        if (switched_) (void)cudaSetDevice(saved_);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
    int saved_ = -1;
    bool switched_ = false;
};
#endif

// bytes at data set to 0 (enqueued on the call's stream on a GPU).
ffi::Error zero_bytes(const Where& where, void* data, size_t bytes, const char* op) {
    if (bytes == 0) return ffi::Error::Success();
#ifdef MOEFORGE_WITH_CUDA
    if (where.on_gpu()) {
        const DeviceGuard guard(where.device_index);
        return cuda_checked(cudaMemsetAsync(data, 0, bytes, static_cast<cudaStream_t>(where.stream)), op,
                            "cudaMemsetAsync");
    }
#endif
    std::memset(data, 0, bytes);
    return ffi::Error::Success();
}

ffi::Error copy_bytes(const Where& where, void* dst, const void* src, size_t bytes, const char* op) {
    if (bytes == 0) return ffi::Error::Success();
#ifdef MOEFORGE_WITH_CUDA
    if (where.on_gpu()) {
        const DeviceGuard guard(where.device_index);
        return cuda_checked(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(where.stream)), op,
            "cudaMemcpyAsync");
    }
#endif
    std::memcpy(dst, src, bytes);
    return ffi::Error::Success();
}

// An aligned buffer of `bytes` for the length of one call: stream-ordered on a GPU (freed behind the
// call's work on its stream), host memory on the CPU (whose kernels have returned when it is freed).
class AlignedTemp {
 public:
    AlignedTemp(const Where& where) : where_(where) {}
    ~AlignedTemp() {
        if (data_ == nullptr) return;
#ifdef MOEFORGE_WITH_CUDA
        if (where_.on_gpu()) {
            const DeviceGuard guard(where_.device_index);
            (void)cudaFreeAsync(data_, static_cast<cudaStream_t>(where_.stream));
            return;
        }
#endif
        std::free(data_);
    }
    AlignedTemp(const AlignedTemp&) = delete;
    AlignedTemp& operator=(const AlignedTemp&) = delete;

    ffi::Error allocate(size_t bytes, const char* op) {
        const size_t alignment = where_.workspace_alignment();
        const size_t rounded = (bytes + alignment - 1) / alignment * alignment;
#ifdef MOEFORGE_WITH_CUDA
        if (where_.on_gpu()) {
            const DeviceGuard guard(where_.device_index);
            // (cudaMallocAsync's allocations are aligned to at least 256 bytes)
            return cuda_checked(cudaMallocAsync(&data_, rounded, static_cast<cudaStream_t>(where_.stream)), op,
                                "cudaMallocAsync (an aligned copy of the MoE activations)");
        }
#endif
        data_ = std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded);
        if (data_ == nullptr) return ffi::Error::Internal(std::string("moeforge.jax ") + op + ": out of host memory");
        return ffi::Error::Success();
    }
    void* data() const { return data_; }

 private:
    Where where_;
    void* data_ = nullptr;
};

// --- buffers as mf_tensor descriptors --------------------------------------------------------------

// The mf_tensor views of one call's buffers; each stays valid (stable address) while the object lives.
// A dtype the C API has no name for is remembered as an error, returned by status().
class Views {
 public:
    Views(const Where& where, const char* op) : where_(where), op_(op) {}

    // `buffer` as it is.
    const mf_tensor* of(const ffi::AnyBuffer& buffer, const char* name) {
        const auto dims = buffer.dimensions();
        mf_tensor& t = add(buffer.untyped_data(), buffer.element_type(), name);
        if (dims.size() > MF_MAX_DIMS) {
            fail(std::string(name) + " has " + std::to_string(dims.size()) + " dimensions (at most " +
                 std::to_string(MF_MAX_DIMS) + ")");
            return &t;
        }
        t.ndim = static_cast<int32_t>(dims.size());
        for (size_t i = 0; i < dims.size(); ++i) t.shape[i] = dims[i];
        return &t;
    }
    // `bytes` of raw memory as an int32 vector (a workspace).
    const mf_tensor* words(void* data, size_t bytes, const char* name) {
        mf_tensor& t = add(data, ffi::DataType::S32, name);
        t.ndim = 1;
        t.shape[0] = static_cast<int64_t>(bytes / 4);
        return &t;
    }
    // `buffer`, or NULL when it has no element (an optional argument left out).
    const mf_tensor* optional(const ffi::AnyBuffer& buffer, const char* name) {
        return buffer.element_count() == 0 ? nullptr : of(buffer, name);
    }

    ffi::Error status() const {
        if (error_.empty()) return ffi::Error::Success();
        return ffi::Error::InvalidArgument(std::string("moeforge.jax ") + op_ + ": " + error_);
    }

 private:
    mf_tensor& add(void* data, ffi::DataType type, const char* name) {
        mf_tensor& t = slots_.emplace_back();
        t = mf_tensor{};
        t.data = data;
        t.device_type = where_.device_type;
        t.device_index = where_.device_index;
        switch (type) {
            case ffi::DataType::F32:
                t.dtype = MF_F32;
                break;
            case ffi::DataType::BF16:
                t.dtype = MF_BF16;
                break;
            case ffi::DataType::S32:
                t.dtype = MF_I32;
                break;
            case ffi::DataType::S64:
                t.dtype = MF_I64;
                break;
            case ffi::DataType::F64:
                t.dtype = MF_F64;
                break;
            default:
                t.dtype = MF_F32;
                fail(std::string(name) + " has XLA dtype " + std::to_string(static_cast<int>(type)) +
                     " (moeforge takes float32, bfloat16 and int32)");
        }
        return t;
    }
    void fail(const std::string& message) {
        if (error_.empty()) error_ = message;
    }

    const Where& where_;
    const char* op_;
    std::deque<mf_tensor> slots_;
    std::string error_;
};

int64_t rows_of(const ffi::AnyBuffer& buffer) {
    const auto dims = buffer.dimensions();
    return dims.size() == 0 ? 1 : dims[0];
}

// --- grouped_matmul: jax.lax.ragged_dot over the C API's grouped GEMMs -----------------------------
// The C API's weight is [E, OC, C]: w [G, K, N] is read as OC = K, C = N. Then
//   out = x · w[g]          is mf_grouped_gemm_input_grad(dinp = out, dout = x)     (dinp = dout · w[e])
//   dx  = dout · w[g]ᵀ      is mf_grouped_gemm_forward(out = dx, inp = dout)        (out = inp · w[e]ᵀ)
//   dw[g] = x_gᵀ · dout_g   is mf_grouped_gemm_weight_grad(dout = x, inp = dout)   (dw[e] = dout_eᵀ · inp_e)

ffi::Error grouped_matmul_forward(const Where& where, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer group_sizes,
                                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> offsets) {
    constexpr const char* op = "grouped_matmul";
    Views v(where, op);
    const mf_tensor *tx = v.of(x, "x"), *tw = v.of(w, "w"), *ts = v.of(group_sizes, "group_sizes");
    const mf_tensor *to = v.of(*out, "out"), *toff = v.of(*offsets, "offsets");
    MF_FFI_RETURN_IF_ERROR(v.status());
    const mf_context* ctx = where.ctx();
    MF_FFI_CALL(op, mf_group_offsets(ctx, toff, ts, rows_of(x)));
    MF_FFI_CALL(op, mf_grouped_gemm_input_grad(ctx, to, tx, tw, toff, 0));
    MF_FFI_CALL(op, mf_zero_rows_past_groups(ctx, to, toff));
    return ffi::Error::Success();
}

ffi::Error grouped_matmul_backward(const Where& where, ffi::AnyBuffer dout, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                   ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> dx,
                                   ffi::Result<ffi::AnyBuffer> dw) {
    constexpr const char* op = "grouped_matmul (backward)";
    Views v(where, op);
    const mf_tensor *tdy = v.of(dout, "dout"), *tx = v.of(x, "x"), *tw = v.of(w, "w");
    const mf_tensor *toff = v.of(offsets, "offsets"), *tdx = v.of(*dx, "dx"), *tdw = v.of(*dw, "dw");
    MF_FFI_RETURN_IF_ERROR(v.status());
    const mf_context* ctx = where.ctx();
    MF_FFI_CALL(op, mf_grouped_gemm_forward(ctx, tdx, tdy, tw, toff));
    MF_FFI_CALL(op, mf_zero_rows_past_groups(ctx, tdx, toff));
    MF_FFI_CALL(op, mf_grouped_gemm_weight_grad(ctx, tdw, tx, tdy, toff, 0));
    return ffi::Error::Success();
}

// --- expert_mlp: gate_up → SwiGLU → down per group, in the C API's weight layout -------------------
// gate_up [E, 2I, H] and down [E, H, I] are [E, OC, C] as they are: h = x · gate_upᵀ is the grouped
// forward, and so is y = a · downᵀ. Rows past the groups: h and y zeroed (so a is 0 there, and the
// saved h and a hold no stale memory), dx zeroed; da and dh there are never read.

ffi::Error expert_mlp_forward(const Where& where, ffi::AnyBuffer x, ffi::AnyBuffer gate_up, ffi::AnyBuffer down,
                              ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                              ffi::Result<ffi::AnyBuffer> a, ffi::Result<ffi::AnyBuffer> offsets) {
    constexpr const char* op = "expert_mlp";
    Views v(where, op);
    const mf_tensor *tx = v.of(x, "x"), *tgu = v.of(gate_up, "w_gate_up"), *tdn = v.of(down, "w_down");
    const mf_tensor *ts = v.of(group_sizes, "group_sizes"), *ty = v.of(*y, "y"), *th = v.of(*h, "h");
    const mf_tensor *ta = v.of(*a, "a"), *toff = v.of(*offsets, "offsets");
    MF_FFI_RETURN_IF_ERROR(v.status());
    const mf_context* ctx = where.ctx();
    MF_FFI_CALL(op, mf_group_offsets(ctx, toff, ts, rows_of(x)));
    MF_FFI_CALL(op, mf_grouped_gemm_forward(ctx, th, tx, tgu, toff));
    MF_FFI_CALL(op, mf_zero_rows_past_groups(ctx, th, toff));
    MF_FFI_CALL(op, mf_swiglu_forward(ctx, ta, th));
    MF_FFI_CALL(op, mf_grouped_gemm_forward(ctx, ty, ta, tdn, toff));
    MF_FFI_CALL(op, mf_zero_rows_past_groups(ctx, ty, toff));
    return ffi::Error::Success();
}

ffi::Error expert_mlp_backward(const Where& where, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer gate_up,
                               ffi::AnyBuffer down, ffi::AnyBuffer h, ffi::AnyBuffer a, ffi::AnyBuffer offsets,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgate_up,
                               ffi::Result<ffi::AnyBuffer> ddown, ffi::Result<ffi::AnyBuffer> da,
                               ffi::Result<ffi::AnyBuffer> dh) {
    constexpr const char* op = "expert_mlp (backward)";
    Views v(where, op);
    const mf_tensor *tdy = v.of(dy, "dy"), *tx = v.of(x, "x"), *tgu = v.of(gate_up, "w_gate_up");
    const mf_tensor *tdn = v.of(down, "w_down"), *th = v.of(h, "h"), *ta = v.of(a, "a");
    const mf_tensor *toff = v.of(offsets, "offsets"), *tdx = v.of(*dx, "dx"), *tdgu = v.of(*dgate_up, "dw_gate_up");
    const mf_tensor *tddn = v.of(*ddown, "dw_down"), *tda = v.of(*da, "da"), *tdh = v.of(*dh, "dh");
    MF_FFI_RETURN_IF_ERROR(v.status());
    const mf_context* ctx = where.ctx();
    MF_FFI_CALL(op, mf_grouped_gemm_input_grad(ctx, tda, tdy, tdn, toff, 0));
    MF_FFI_CALL(op, mf_grouped_gemm_weight_grad(ctx, tddn, tdy, ta, toff, 0));
    MF_FFI_CALL(op, mf_swiglu_backward(ctx, tdh, tda, th));
    MF_FFI_CALL(op, mf_grouped_gemm_input_grad(ctx, tdx, tdh, tgu, toff, 0));
    MF_FFI_CALL(op, mf_zero_rows_past_groups(ctx, tdx, toff));
    MF_FFI_CALL(op, mf_grouped_gemm_weight_grad(ctx, tdgu, tdh, tx, toff, 0));
    return ffi::Error::Success();
}

// --- moe_ffn: the C API's whole MoE block -----------------------------------------------------------

struct MoeAttrs {
    int64_t top_k, norm_topk_prob, router, n_group, topk_group, masked_zero;
    float routed_scaling_factor;
};

// The block's dims from x [N, H], gate_up [E, 2I, H] and the attributes.
ffi::ErrorOr<mf_moe_dims> moe_dims(const ffi::AnyBuffer& x, const ffi::AnyBuffer& gate_up, const MoeAttrs& at) {
    const auto xd = x.dimensions(), gd = gate_up.dimensions();
    if (xd.size() != 2 || gd.size() != 3)
        return ffi::Unexpected(
            ffi::Error::InvalidArgument("moeforge.jax moe_ffn: x must be [N, H] and w_gate_up [E, 2I, H]"));
    mf_moe_dims d{};
    d.hidden = xd[1];
    d.intermediate = gd[1] / 2;
    d.num_experts = gd[0];
    d.top_k = at.top_k;
    d.norm_topk_prob = at.norm_topk_prob != 0 ? 1 : 0;
    d.activation = MF_ACT_SWIGLU;
    d.router = at.router == 1 ? MF_ROUTER_SIGMOID : MF_ROUTER_SOFTMAX;
    d.n_group = at.n_group;
    d.topk_group = at.topk_group;
    d.routed_scaling_factor = at.routed_scaling_factor;
    d.masked_score = at.masked_zero != 0 ? 0.0f : -INFINITY;
    return d;
}

size_t align_up(size_t value, size_t alignment) { return (value + alignment - 1) / alignment * alignment; }

// The activations' image at byte 0 of `buffer`, as an aligned workspace for the C API: the buffer
// itself when aligned, else an aligned temporary (filled from the buffer when `load`).
class ActsWorkspace {
 public:
    ActsWorkspace(const Where& where, void* buffer, size_t bytes)
        : where_(where), buffer_(buffer), bytes_(bytes), temp_(where) {}

    ffi::Error prepare(bool load, const char* op) {
        if (reinterpret_cast<uintptr_t>(buffer_) % where_.workspace_alignment() == 0) {
            data_ = buffer_;
            return ffi::Error::Success();
        }
        MF_FFI_RETURN_IF_ERROR(temp_.allocate(bytes_, op));
        data_ = temp_.data();
        return load ? copy_bytes(where_, data_, buffer_, bytes_, op) : ffi::Error::Success();
    }
    // After a forward: the image into the buffer (when it went through the temporary).
    ffi::Error store(const char* op) {
        return data_ == buffer_ ? ffi::Error::Success() : copy_bytes(where_, buffer_, data_, bytes_, op);
    }
    void* data() const { return data_; }

 private:
    const Where& where_;
    void* buffer_;
    size_t bytes_;
    AlignedTemp temp_;
    void* data_ = nullptr;
};

ffi::Error moe_ffn_forward(const Where& where, ffi::AnyBuffer x, ffi::AnyBuffer router, ffi::AnyBuffer gate_up,
                           ffi::AnyBuffer down, ffi::AnyBuffer correction_bias, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> acts, const MoeAttrs& attrs) {
    constexpr const char* op = "moe_ffn";
    const ffi::ErrorOr<mf_moe_dims> dims = moe_dims(x, gate_up, attrs);
    if (!dims.has_value()) return dims.error();
    size_t act_bytes = 0;
    MF_FFI_CALL(op, mf_moe_block_activation_bytes(&*dims, rows_of(x), where.device_type, &act_bytes));
    if (acts->size_bytes() < act_bytes)
        return ffi::Error::InvalidArgument("moeforge.jax moe_ffn: the activations output holds " +
                                           std::to_string(acts->size_bytes()) + " bytes, the C API needs " +
                                           std::to_string(act_bytes));
    ActsWorkspace ws(where, acts->untyped_data(), act_bytes);
    MF_FFI_RETURN_IF_ERROR(ws.prepare(false, op));
    Views v(where, op);
    const mf_tensor *tx = v.of(x, "x"), *tr = v.of(router, "router_w"), *tgu = v.of(gate_up, "w_gate_up");
    const mf_tensor *tdn = v.of(down, "w_down"), *tb = v.optional(correction_bias, "correction_bias");
    const mf_tensor *ty = v.of(*y, "y"), *tws = v.words(ws.data(), act_bytes, "activations");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_CALL(op, mf_moe_block_forward(where.ctx(), &*dims, ty, tx, tr, tgu, tdn, tb, tws));
    return ws.store(op);
}

ffi::Error moe_ffn_backward(const Where& where, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer router,
                            ffi::AnyBuffer gate_up, ffi::AnyBuffer down, ffi::AnyBuffer correction_bias,
                            ffi::AnyBuffer acts, ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> drouter,
                            ffi::Result<ffi::AnyBuffer> dgate_up, ffi::Result<ffi::AnyBuffer> ddown,
                            ffi::Result<ffi::AnyBuffer> scratch, const MoeAttrs& attrs) {
    constexpr const char* op = "moe_ffn (backward)";
    const ffi::ErrorOr<mf_moe_dims> dims = moe_dims(x, gate_up, attrs);
    if (!dims.has_value()) return dims.error();
    const int64_t N = rows_of(x);
    size_t act_bytes = 0, all_bytes = 0;
    MF_FFI_CALL(op, mf_moe_block_activation_bytes(&*dims, N, where.device_type, &act_bytes));
    MF_FFI_CALL(op, mf_moe_block_workspace_bytes(&*dims, N, where.device_type, &all_bytes));
    const size_t scratch_bytes = all_bytes - act_bytes, alignment = where.workspace_alignment();
    if (acts.size_bytes() < act_bytes || scratch->size_bytes() < scratch_bytes + alignment)
        return ffi::Error::InvalidArgument("moeforge.jax moe_ffn (backward): activations of " +
                                           std::to_string(acts.size_bytes()) + " bytes and scratch of " +
                                           std::to_string(scratch->size_bytes()) + ", the C API needs " +
                                           std::to_string(act_bytes) + " and " +
                                           std::to_string(scratch_bytes + alignment) + " (with alignment slack)");
    ActsWorkspace ws(where, acts.untyped_data(), act_bytes);
    MF_FFI_RETURN_IF_ERROR(ws.prepare(true, op));
    auto* scratch_base = static_cast<char*>(scratch->untyped_data());
    void* scratch_data = scratch_base + (align_up(reinterpret_cast<uintptr_t>(scratch_base), alignment) -
                                         reinterpret_cast<uintptr_t>(scratch_base));
    Views v(where, op);
    const mf_tensor *tdy = v.of(dy, "dy"), *tx = v.of(x, "x"), *tr = v.of(router, "router_w");
    const mf_tensor *tgu = v.of(gate_up, "w_gate_up"), *tdn = v.of(down, "w_down");
    const mf_tensor* tb = v.optional(correction_bias, "correction_bias");
    const mf_tensor *tdx = v.of(*dx, "dx"), *tdr = v.of(*drouter, "drouter_w"), *tdgu = v.of(*dgate_up, "dw_gate_up");
    const mf_tensor* tddn = v.of(*ddown, "dw_down");
    const mf_tensor *tws = v.words(ws.data(), act_bytes, "activations"),
                    *tsc = v.words(scratch_data, scratch_bytes, "scratch");
    MF_FFI_RETURN_IF_ERROR(v.status());
    // dx and drouter accumulate (+=) in the C API: start them at 0
    MF_FFI_RETURN_IF_ERROR(zero_bytes(where, dx->untyped_data(), dx->size_bytes(), op));
    MF_FFI_RETURN_IF_ERROR(zero_bytes(where, drouter->untyped_data(), drouter->size_bytes(), op));
    MF_FFI_CALL(op, mf_moe_block_backward(where.ctx(), &*dims, tdx, tdr, tdgu, tddn, tdy, nullptr, tx, tr, tgu, tdn, tb,
                                          tws, tsc, 0));
    return ffi::Error::Success();
}

// --- the ops' scratch from an XLA buffer -----------------------------------------------------------

// The call's context with a scratch result of the call as the C API's workspace (from its first
// aligned byte): the ops that need scratch on a GPU (the permutation's histogram, the aux-loss
// statistics' partial sums) take it from there instead of growing the engine's own pool, so the call
// allocates nothing. moeforge.jax sizes the buffer, alignment slack included. NOTE: an op that needs
// more than the buffer holds falls back to the engine's pool (correct, but it may allocate once).
class ScratchContext {
 public:
    ScratchContext(const Where& where, ffi::Result<ffi::AnyBuffer>& buffer)
        : context_(where.context), on_gpu_(where.on_gpu()) {
        auto* base = static_cast<char*>(buffer->untyped_data());
        const uintptr_t address = reinterpret_cast<uintptr_t>(base);
        // (an mf_context's workspace is 256-byte aligned, as moeforge.h asks; the result has that slack)
        const size_t skip = align_up(address, 256) - address, bytes = buffer->size_bytes();
        if (base != nullptr && bytes > skip) {
            context_.workspace = base + skip;
            context_.workspace_bytes = bytes - skip;
        }
    }
    // The C API's context: NULL on the CPU (whose kernels need no scratch), as Where::ctx().
    const mf_context* ctx() const { return on_gpu_ ? &context_ : nullptr; }

 private:
    mf_context context_;
    bool on_gpu_;
};

// --- route: the softmax and sigmoid routers ----------------------------------------------------------
// logits [N, E] f32 → probs (the sigmoid's scores) [N, E] f32, topk_idx [N, K] i32, topk_weight [N, K]
// f32, K being the results' (the C API reads it from topk_idx). The softmax backward takes the
// probabilities' own gradient (dprobs: an aux loss's) besides topk_weight's; the sigmoid backward
// takes topk_weight's alone (moeforge.jax adds the scores' own gradient, dscores · σ', elementwise).

ffi::Error router_softmax_forward(const Where& where, ffi::AnyBuffer logits, ffi::Result<ffi::AnyBuffer> probs,
                                  ffi::Result<ffi::AnyBuffer> topk_idx, ffi::Result<ffi::AnyBuffer> topk_weight,
                                  int64_t norm_topk_prob) {
    constexpr const char* op = "route (softmax)";
    Views v(where, op);
    const mf_tensor *tl = v.of(logits, "logits"), *tp = v.of(*probs, "probs"), *ti = v.of(*topk_idx, "topk_idx");
    const mf_tensor* tw = v.of(*topk_weight, "topk_weight");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_CALL(op, mf_router_softmax_topk_forward(where.ctx(), tp, ti, tw, tl, norm_topk_prob != 0 ? 1 : 0));
    return ffi::Error::Success();
}

ffi::Error router_softmax_backward(const Where& where, ffi::AnyBuffer dtopk_weight, ffi::AnyBuffer dprobs,
                                   ffi::AnyBuffer probs, ffi::AnyBuffer topk_idx, ffi::Result<ffi::AnyBuffer> dlogits,
                                   int64_t norm_topk_prob) {
    constexpr const char* op = "route (softmax, backward)";
    Views v(where, op);
    const mf_tensor *tdw = v.of(dtopk_weight, "dtopk_weight"), *tdp = v.of(dprobs, "dprobs");
    const mf_tensor *tp = v.of(probs, "probs"), *ti = v.of(topk_idx, "topk_idx"), *tdl = v.of(*dlogits, "dlogits");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_CALL(op, mf_router_softmax_topk_backward(where.ctx(), tdl, tdw, tdp, tp, ti, norm_topk_prob != 0 ? 1 : 0));
    return ffi::Error::Success();
}

ffi::Error router_sigmoid_forward(const Where& where, ffi::AnyBuffer logits, ffi::AnyBuffer correction_bias,
                                  ffi::Result<ffi::AnyBuffer> scores, ffi::Result<ffi::AnyBuffer> topk_idx,
                                  ffi::Result<ffi::AnyBuffer> topk_weight, int64_t norm_topk_prob, int64_t n_group,
                                  int64_t topk_group, int64_t masked_zero, float routed_scaling_factor) {
    constexpr const char* op = "route (sigmoid)";
    Views v(where, op);
    const mf_tensor *tl = v.of(logits, "logits"), *tb = v.optional(correction_bias, "correction_bias");
    const mf_tensor *ts = v.of(*scores, "scores"), *ti = v.of(*topk_idx, "topk_idx");
    const mf_tensor* tw = v.of(*topk_weight, "topk_weight");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_CALL(
        op, mf_router_sigmoid_forward(where.ctx(), ts, ti, tw, tl, tb, n_group, topk_group, norm_topk_prob != 0 ? 1 : 0,
                                      routed_scaling_factor, masked_zero != 0 ? 0.0f : -INFINITY));
    return ffi::Error::Success();
}

ffi::Error router_sigmoid_backward(const Where& where, ffi::AnyBuffer dtopk_weight, ffi::AnyBuffer scores,
                                   ffi::AnyBuffer topk_idx, ffi::Result<ffi::AnyBuffer> dlogits, int64_t norm_topk_prob,
                                   float routed_scaling_factor) {
    constexpr const char* op = "route (sigmoid, backward)";
    Views v(where, op);
    const mf_tensor *tdw = v.of(dtopk_weight, "dtopk_weight"), *ts = v.of(scores, "scores");
    const mf_tensor *ti = v.of(topk_idx, "topk_idx"), *tdl = v.of(*dlogits, "dlogits");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_CALL(op, mf_router_sigmoid_backward(where.ctx(), tdl, tdw, ts, ti, norm_topk_prob != 0 ? 1 : 0,
                                               routed_scaling_factor));
    return ffi::Error::Success();
}

// --- load_balancing_loss: the aux loss's statistics and its gradient at the probabilities -------------
// counts [E] and prob_sums [E] f32 (the C API's accumulate: zeroed here first) of one layer's
// topk_idx [N, K] i32, probs [N, E] f32, mask [N] f32; dprobs [N, E] = scale · counts[e] · mask[t]
// (moeforge.jax folds the loss's factor into counts and passes scale 1).

ffi::Error aux_stats_forward(const Where& where, ffi::AnyBuffer topk_idx, ffi::AnyBuffer probs, ffi::AnyBuffer mask,
                             ffi::Result<ffi::AnyBuffer> counts, ffi::Result<ffi::AnyBuffer> prob_sums,
                             ffi::Result<ffi::AnyBuffer> scratch) {
    constexpr const char* op = "load_balancing_loss";
    const ScratchContext sc(where, scratch);
    Views v(where, op);
    const mf_tensor *ti = v.of(topk_idx, "topk_idx"), *tp = v.of(probs, "probs"), *tm = v.of(mask, "mask");
    const mf_tensor *tc = v.of(*counts, "counts"), *tps = v.of(*prob_sums, "prob_sums");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_RETURN_IF_ERROR(zero_bytes(where, counts->untyped_data(), counts->size_bytes(), op));
    MF_FFI_RETURN_IF_ERROR(zero_bytes(where, prob_sums->untyped_data(), prob_sums->size_bytes(), op));
    MF_FFI_CALL(op, mf_moe_aux_stats(sc.ctx(), tc, tps, ti, tp, tm));
    return ffi::Error::Success();
}

ffi::Error aux_dprobs_backward(const Where& where, ffi::AnyBuffer counts, ffi::AnyBuffer mask,
                               ffi::Result<ffi::AnyBuffer> dprobs, float scale) {
    constexpr const char* op = "load_balancing_loss (backward)";
    Views v(where, op);
    const mf_tensor *tc = v.of(counts, "counts"), *tm = v.of(mask, "mask"), *tdp = v.of(*dprobs, "dprobs");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_CALL(op, mf_moe_aux_dprobs(where.ctx(), tdp, tc, tm, scale));
    return ffi::Error::Success();
}

// --- permute / unpermute -------------------------------------------------------------------------------
// permute: the pairs' indices (mf_moe_permute_indices) and x_perm = the rows of x in that order (a
// zero row for each dropped pair's row, past expert_offsets[E]); its backward sums dx_perm back per
// token (dx zeroed first: the C API accumulates). unpermute: y = Σ_k w · y_perm[pair_row]; its
// backward writes dy_perm (zeroed first: the C API leaves dropped pairs' rows alone) and dtopk_weight.

ffi::Error permute_forward(const Where& where, ffi::AnyBuffer x, ffi::AnyBuffer topk_idx,
                           ffi::Result<ffi::AnyBuffer> x_perm, ffi::Result<ffi::AnyBuffer> expert_offsets,
                           ffi::Result<ffi::AnyBuffer> sorted_pair, ffi::Result<ffi::AnyBuffer> pair_row,
                           ffi::Result<ffi::AnyBuffer> scratch, int64_t num_experts) {
    constexpr const char* op = "permute";
    const auto idx_dims = topk_idx.dimensions();
    if (idx_dims.size() != 2) return ffi::Error::InvalidArgument("moeforge.jax permute: topk_idx must be [N, K]");
    const ScratchContext sc(where, scratch);
    Views v(where, op);
    const mf_tensor *tx = v.of(x, "x"), *ti = v.of(topk_idx, "topk_idx"), *txp = v.of(*x_perm, "x_perm");
    const mf_tensor *toff = v.of(*expert_offsets, "expert_offsets"), *tsp = v.of(*sorted_pair, "sorted_pair");
    const mf_tensor* tpr = v.of(*pair_row, "pair_row");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_CALL(op, mf_moe_permute_indices(sc.ctx(), toff, tsp, tpr, ti, num_experts));
    MF_FFI_CALL(op, mf_moe_gather(sc.ctx(), txp, tx, tsp, idx_dims[1]));
    return ffi::Error::Success();
}

ffi::Error permute_backward(const Where& where, ffi::AnyBuffer dx_perm, ffi::AnyBuffer pair_row,
                            ffi::Result<ffi::AnyBuffer> dx, int64_t top_k) {
    constexpr const char* op = "permute (backward)";
    Views v(where, op);
    const mf_tensor *tdxp = v.of(dx_perm, "dx_perm"), *tpr = v.of(pair_row, "pair_row"), *tdx = v.of(*dx, "dx");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_RETURN_IF_ERROR(zero_bytes(where, dx->untyped_data(), dx->size_bytes(), op));
    MF_FFI_CALL(op, mf_moe_gather_backward(where.ctx(), tdx, tdxp, tpr, top_k));
    return ffi::Error::Success();
}

ffi::Error unpermute_forward(const Where& where, ffi::AnyBuffer y_perm, ffi::AnyBuffer topk_weight,
                             ffi::AnyBuffer pair_row, ffi::Result<ffi::AnyBuffer> out) {
    constexpr const char* op = "unpermute";
    Views v(where, op);
    const mf_tensor *typ = v.of(y_perm, "y_perm"), *tw = v.of(topk_weight, "topk_weight");
    const mf_tensor *tpr = v.of(pair_row, "pair_row"), *to = v.of(*out, "y");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_CALL(op, mf_moe_unpermute(where.ctx(), to, typ, tw, tpr));
    return ffi::Error::Success();
}

ffi::Error unpermute_backward(const Where& where, ffi::AnyBuffer dout, ffi::AnyBuffer y_perm,
                              ffi::AnyBuffer topk_weight, ffi::AnyBuffer pair_row, ffi::Result<ffi::AnyBuffer> dy_perm,
                              ffi::Result<ffi::AnyBuffer> dtopk_weight) {
    constexpr const char* op = "unpermute (backward)";
    Views v(where, op);
    const mf_tensor *tdy = v.of(dout, "dy"), *typ = v.of(y_perm, "y_perm"), *tw = v.of(topk_weight, "topk_weight");
    const mf_tensor *tpr = v.of(pair_row, "pair_row"), *tdyp = v.of(*dy_perm, "dy_perm");
    const mf_tensor* tdw = v.of(*dtopk_weight, "dtopk_weight");
    MF_FFI_RETURN_IF_ERROR(v.status());
    MF_FFI_RETURN_IF_ERROR(zero_bytes(where, dy_perm->untyped_data(), dy_perm->size_bytes(), op));
    MF_FFI_CALL(op, mf_moe_unpermute_backward(where.ctx(), tdyp, tdw, tdy, typ, tw, tpr));
    return ffi::Error::Success();
}

// --- bindings: one signature per op, bound for the CPU and for CUDA ---------------------------------

template <typename B>
auto moe_attrs(B&& binding) {
    return std::move(binding)
        .template Attr<int64_t>("top_k")
        .template Attr<int64_t>("norm_topk_prob")
        .template Attr<int64_t>("router")
        .template Attr<int64_t>("n_group")
        .template Attr<int64_t>("topk_group")
        .template Attr<int64_t>("masked_zero")
        .template Attr<float>("routed_scaling_factor");
}

// The other ops' attributes, after their buffers, in the order their bodies take them.
template <typename B>
auto norm_attrs(B&& binding) {
    return std::move(binding).template Attr<int64_t>("norm_topk_prob");
}
template <typename B>
auto sigmoid_attrs(B&& binding) {
    return std::move(binding)
        .template Attr<int64_t>("norm_topk_prob")
        .template Attr<int64_t>("n_group")
        .template Attr<int64_t>("topk_group")
        .template Attr<int64_t>("masked_zero")
        .template Attr<float>("routed_scaling_factor");
}
template <typename B>
auto sigmoid_bwd_attrs(B&& binding) {
    return std::move(binding).template Attr<int64_t>("norm_topk_prob").template Attr<float>("routed_scaling_factor");
}
template <typename B>
auto scale_attr(B&& binding) {
    return std::move(binding).template Attr<float>("scale");
}
template <typename B>
auto num_experts_attr(B&& binding) {
    return std::move(binding).template Attr<int64_t>("num_experts");
}
template <typename B>
auto top_k_attr(B&& binding) {
    return std::move(binding).template Attr<int64_t>("top_k");
}

// The moe handlers get the attributes of moe_attrs after their buffers; the bodies take one struct.
ffi::Error moe_ffn_forward_call(const Where& where, ffi::AnyBuffer x, ffi::AnyBuffer router, ffi::AnyBuffer gate_up,
                                ffi::AnyBuffer down, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                                ffi::Result<ffi::AnyBuffer> acts, int64_t top_k, int64_t norm_topk_prob,
                                int64_t router_kind, int64_t n_group, int64_t topk_group, int64_t masked_zero,
                                float scaling) {
    const MoeAttrs attrs{top_k, norm_topk_prob, router_kind, n_group, topk_group, masked_zero, scaling};
    return moe_ffn_forward(where, x, router, gate_up, down, bias, y, acts, attrs);
}

ffi::Error moe_ffn_backward_call(const Where& where, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer router,
                                 ffi::AnyBuffer gate_up, ffi::AnyBuffer down, ffi::AnyBuffer bias, ffi::AnyBuffer acts,
                                 ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> drouter,
                                 ffi::Result<ffi::AnyBuffer> dgate_up, ffi::Result<ffi::AnyBuffer> ddown,
                                 ffi::Result<ffi::AnyBuffer> scratch, int64_t top_k, int64_t norm_topk_prob,
                                 int64_t router_kind, int64_t n_group, int64_t topk_group, int64_t masked_zero,
                                 float scaling) {
    const MoeAttrs attrs{top_k, norm_topk_prob, router_kind, n_group, topk_group, masked_zero, scaling};
    return moe_ffn_backward(where, dy, x, router, gate_up, down, bias, acts, dx, drouter, dgate_up, ddown, scratch,
                            attrs);
}

// N buffer arguments, then M buffer results. (A Binding cannot be moved, only made: each step returns
// the next one as a prvalue.)
template <int N, int M, typename B>
auto buffers(B&& binding) {
    static_assert(N + M > 0, "a handler has at least one buffer");
    if constexpr (N > 0) {
        if constexpr (N + M == 1) {
            return std::move(binding).template Arg<ffi::AnyBuffer>();
        } else {
            return buffers<N - 1, M>(std::move(binding).template Arg<ffi::AnyBuffer>());
        }
    } else if constexpr (M == 1) {
        return std::move(binding).template Ret<ffi::AnyBuffer>();
    } else {
        return buffers<0, M - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
    }
}

}  // namespace

// The handlers: NAME_cpu and (with CUDA) NAME_cuda, each calling BODY(where, arguments...) with the
// buffers (ARGS arguments, RETS results) and, when MOE, the moe attributes.
#define MF_CPU_HANDLER(NAME, BODY, ARGS, RETS, MOE) \
    XLA_FFI_DEFINE_HANDLER(                         \
        NAME##_cpu, [](auto... a) { return BODY(Where::cpu(), a...); }, MOE(buffers<ARGS, RETS>(ffi::Ffi::Bind())))
#ifdef MOEFORGE_WITH_CUDA
template <typename First, typename... Rest>
const void* first_data(const First& first, const Rest&...) {
    return first.untyped_data();
}
#define MF_CUDA_HANDLER(NAME, BODY, ARGS, RETS, MOE)                                                                   \
    XLA_FFI_DEFINE_HANDLER(                                                                                            \
        NAME##_cuda, [](cudaStream_t stream, auto... a) { return BODY(Where::cuda(stream, first_data(a...)), a...); }, \
        MOE(buffers<ARGS, RETS>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())))
#else
#define MF_CUDA_HANDLER(NAME, BODY, ARGS, RETS, MOE)
#endif
#define MF_HANDLERS(NAME, BODY, ARGS, RETS, MOE) \
    MF_CPU_HANDLER(NAME, BODY, ARGS, RETS, MOE); \
    MF_CUDA_HANDLER(NAME, BODY, ARGS, RETS, MOE)

namespace {
MF_HANDLERS(grouped_matmul, grouped_matmul_forward, 3, 2, );
MF_HANDLERS(grouped_matmul_bwd, grouped_matmul_backward, 4, 2, );
MF_HANDLERS(expert_mlp, expert_mlp_forward, 4, 4, );
MF_HANDLERS(expert_mlp_bwd, expert_mlp_backward, 7, 5, );
MF_HANDLERS(moe_ffn, moe_ffn_forward_call, 5, 2, moe_attrs);
MF_HANDLERS(moe_ffn_bwd, moe_ffn_backward_call, 7, 5, moe_attrs);
MF_HANDLERS(route_softmax, router_softmax_forward, 1, 3, norm_attrs);
MF_HANDLERS(route_softmax_bwd, router_softmax_backward, 4, 1, norm_attrs);
MF_HANDLERS(route_sigmoid, router_sigmoid_forward, 2, 3, sigmoid_attrs);
MF_HANDLERS(route_sigmoid_bwd, router_sigmoid_backward, 3, 1, sigmoid_bwd_attrs);
MF_HANDLERS(aux_stats, aux_stats_forward, 3, 3, );
MF_HANDLERS(aux_dprobs, aux_dprobs_backward, 2, 1, scale_attr);
MF_HANDLERS(permute, permute_forward, 2, 5, num_experts_attr);
MF_HANDLERS(permute_bwd, permute_backward, 2, 1, top_k_attr);
MF_HANDLERS(unpermute, unpermute_forward, 3, 1, );
MF_HANDLERS(unpermute_bwd, unpermute_backward, 4, 2, );

py::capsule capsule_of(XLA_FFI_Handler* handler) { return py::capsule(reinterpret_cast<void*>(handler)); }
}  // namespace

PYBIND11_MODULE(_jax_ffi, m) {
    m.doc() =
        "moeforge's XLA FFI handlers (moeforge.jax registers them); built against jaxlib " MOEFORGE_JAXLIB_VERSION;
    py::dict cpu, cuda;
#define MF_EXPORT(NAME)                  \
    cpu[#NAME] = capsule_of(NAME##_cpu); \
    MF_EXPORT_CUDA(NAME)
#ifdef MOEFORGE_WITH_CUDA
#define MF_EXPORT_CUDA(NAME) cuda[#NAME] = capsule_of(NAME##_cuda);
#else
#define MF_EXPORT_CUDA(NAME)
#endif
    MF_EXPORT(grouped_matmul)
    MF_EXPORT(grouped_matmul_bwd)
    MF_EXPORT(expert_mlp)
    MF_EXPORT(expert_mlp_bwd)
    MF_EXPORT(moe_ffn)
    MF_EXPORT(moe_ffn_bwd)
    MF_EXPORT(route_softmax)
    MF_EXPORT(route_softmax_bwd)
    MF_EXPORT(route_sigmoid)
    MF_EXPORT(route_sigmoid_bwd)
    MF_EXPORT(aux_stats)
    MF_EXPORT(aux_dprobs)
    MF_EXPORT(permute)
    MF_EXPORT(permute_bwd)
    MF_EXPORT(unpermute)
    MF_EXPORT(unpermute_bwd)
    m.attr("CPU_HANDLERS") = cpu;
    m.attr("CUDA_HANDLERS") = cuda;
    m.attr("FFI_API_VERSION") = py::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    m.attr("JAXLIB_VERSION") = MOEFORGE_JAXLIB_VERSION;
    m.attr("BUILT_WITH_CUDA") = mf_built_with_cuda() != 0;
    m.attr("C_API_VERSION") = mf_api_version();
}
