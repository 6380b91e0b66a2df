// ops.h on the GPU: bf16 activations over the kernels in kernels/cuda. Each op's body has the
// signature of its declaration in ops.h (ops.cpp has checked the arguments) and is private to this
// file; the table at the end (cuda_ops.h) hands them to ops.cpp.
//
// Every op runs on the calling thread's execution context (ops.h, ExecScope): a stream with the
// cuBLASLt and cuBLAS handles, the grouped GEMM's lanes, a background stream and a scratch buffer
// that grows to the largest request, one context per (device, stream), created on first use and
// kept for the process. Without a scope, ops go to the engine's stream on the current device. Every
// op queues its kernels on its context's stream; only the ops that return a host value (sum,
// sum_squares, all_finite, copy_to_host) synchronise. Scratch is reused op after op, which is safe
// because a context's work is ordered on its one stream.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attention_cudnn.cuh"
#include "kernels/cuda/bias.cuh"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/clamped_swiglu.cuh"
#include "kernels/cuda/conv1d.cuh"
#include "kernels/cuda/cross_entropy.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/ep_tokens.cuh"
#include "kernels/cuda/gated_rmsnorm.cuh"
#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/grouped_gemm_cublas.cuh"
#include "kernels/cuda/grouped_gemm_sm90.cuh"
#include "kernels/cuda/moe_permute.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/relu2.cuh"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/rope_qknorm.cuh"
#include "kernels/cuda/router.cuh"
#include "kernels/cuda/router_sigmoid.cuh"
#include "kernels/cuda/sigmoid_gate.cuh"
#include "kernels/cuda/ssd_scan.cuh"
#include "kernels/cuda/swiglu.cuh"
#include "ops/cuda_ops.h"

namespace mf::ops::cuda_impl {

namespace {

using mf::cuda::bf16;

// Bound on the loss head's [chunk, V] logits scratch: chunks of up to 1 GiB / (4 V) tokens with fp32
// logits (1766 at V = 151936), twice that with bf16 logits (the bf16 policy). At
// 8192 tokens, 256 MiB chunks (441 rows) made the fused head + loss 29.4 ms (bf16 dw) / 35.1 ms (f32
// dw) on an H200 and 1 GiB chunks 26.8 / 27.4 ms (MF_BENCH=1 test_cuda_loss_optim): fewer passes of
// the dw accumulation over [V, C] and longer GEMMs.
constexpr size_t kLossScratchBytes = size_t{1} << 30;

// Background tickets: events recorded on the background stream, reused round robin (an old ticket's
// event may have been recorded again since; waiting on it then waits for later background work too,
// which the one in-order background stream makes a superset of the ticket's).
constexpr int64_t kBackgroundEvents = 64;

struct Context {
    int device = 0;
    cudaStream_t op_stream = nullptr;   // the context's stream
    cudaStream_t stream = nullptr;      // where ops go now: op_stream, or `background` inside ops::background
    cudaStream_t background = nullptr;  // created on first use, non-blocking
    bool in_background = false;
    int64_t tickets = 0;
    cudaEvent_t fork = nullptr;
    std::vector<cudaEvent_t> ticket_events;
    mf::cuda::GemmContext gemm;
    cublasHandle_t blas = nullptr;
    std::unique_ptr<mf::cuda::GroupedGemmCublas> grouped;  // created on first use
    Buffer scratch, background_scratch;
    Buffer small;               // a few device scalars
    void* workspace = nullptr;  // the scope's caller-owned scratch (ExecContext::workspace), if any
    size_t workspace_bytes = 0;

    // Made with `device` current.
    Context(int device_index, cudaStream_t s)
        : device(device_index), op_stream(s), stream(s), small(256, Device::cuda) {
        MF_CHECK(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS, "cublasCreate failed");
    }

    // Scratch of at least `bytes`, 256-byte aligned (the background stream's own inside background()).
    void* get(size_t bytes) {
        if (!in_background && workspace != nullptr && bytes <= workspace_bytes) return workspace;
        Buffer& b = in_background ? background_scratch : scratch;
        if (b.nbytes() < bytes) {
            wait_for_stream(stream);  // the old buffer may still be in use
            b = Buffer(std::max(bytes, b.nbytes() + b.nbytes() / 2), Device::cuda);
        }
        return b.data();
    }
    double* d_double() { return static_cast<double*>(small.data()); }
    unsigned long long* d_count() {
        return reinterpret_cast<unsigned long long*>(static_cast<char*>(small.data()) + 64);
    }
};

// The contexts, by (device, stream); stream nullptr stands for the engine's stream of that device.
// Never destroyed: no teardown-order trouble with CUDA at exit.
Context& context_for(int device, cudaStream_t stream) {
    static std::mutex mutex;
    static auto* contexts = new std::map<std::pair<int, cudaStream_t>, Context*>();
    std::lock_guard<std::mutex> lock(mutex);
    Context*& c = (*contexts)[{device, stream}];
    if (c == nullptr) {
        cudaStream_t s = stream;
        if (s == nullptr) MF_CHECK_CUDA(cudaStreamCreate(&s));  // blocking: ordered with the legacy stream
        c = new Context(device, s);
    }
    return *c;
}

thread_local Context* t_scope = nullptr;   // the innermost ExecScope's context on this thread, if any
thread_local Context* t_engine = nullptr;  // this thread's last engine context (the cache of context_for)

Context& ctx() {
    if (t_scope != nullptr) return *t_scope;
    int device = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    if (t_engine == nullptr || t_engine->device != device) t_engine = &context_for(device, nullptr);
    return *t_engine;
}

void exec_enter(const ExecContext& context, ExecSaved& saved) {
    int device = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    saved.device = device;
    saved.context = t_scope;
    if (context.device >= 0 && context.device != device) MF_CHECK_CUDA(cudaSetDevice(context.device));
    Context& c = context_for(context.device >= 0 ? context.device : device, static_cast<cudaStream_t>(context.stream));
    MF_CHECK(!c.in_background, "ops::ExecScope: its stream is inside ops::background");
    saved.workspace = c.workspace;
    saved.workspace_bytes = c.workspace_bytes;
    c.workspace = context.workspace;
    c.workspace_bytes = context.workspace != nullptr ? context.workspace_bytes : 0;
    t_scope = &c;
}

void exec_leave(const ExecSaved& saved) {
    t_scope->workspace = saved.workspace;
    t_scope->workspace_bytes = saved.workspace_bytes;
    t_scope = static_cast<Context*>(saved.context);
    int device = 0;
    if (cudaGetDevice(&device) == cudaSuccess && device != saved.device) cudaSetDevice(saved.device);
}

void* current_stream() { return ctx().stream; }

size_t align256(size_t n) { return (n + 255) / 256 * 256; }
bool defined(const Tensor& t) { return t.data() != nullptr; }
bf16* B(const Tensor& t) {
    MF_CHECK(t.dtype() == DType::bf16, "expected a bf16 tensor, got ", dtype_name(t.dtype()));
    return static_cast<bf16*>(t.data());
}
bf16* B_or_null(const Tensor& t) { return defined(t) ? B(t) : nullptr; }
float* F(const Tensor& t) { return defined(t) ? t.ptr<float>() : nullptr; }
int32_t* I(const Tensor& t) { return defined(t) ? t.ptr<int32_t>() : nullptr; }
int64_t rows(const Tensor& t) { return t.numel() / t.dim(-1); }

void zero(const Tensor& t) { MF_CHECK_CUDA(cudaMemsetAsync(t.data(), 0, t.nbytes(), ctx().stream)); }

void copy(const Tensor& dst, const Tensor& src) {
    MF_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), dst.nbytes(), cudaMemcpyDeviceToDevice, ctx().stream));
}

void copy_from_host(const Tensor& dst, const void* src) {
    MF_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src, dst.nbytes(), cudaMemcpyHostToDevice, ctx().stream));
    wait_for_stream(ctx().stream);  // the host buffer may go away after return
}

void copy_to_host(void* dst, const Tensor& src) {
    MF_CHECK_CUDA(cudaMemcpyAsync(dst, src.data(), src.nbytes(), cudaMemcpyDeviceToHost, ctx().stream));
    wait_for_stream(ctx().stream);
}

void fill_normal(const Tensor& x, uint64_t seed, float mean, float std) {
    mf::cuda::fill_normal(x.data(), x.dtype(), x.numel(), seed, mean, std, ctx().stream);
}

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
    mf::cuda::add_bf16(B(out), B(a), B(b), out.numel(), ctx().stream);
}

void cast(const Tensor& dst, const Tensor& src) {
    if (dst.dtype() == src.dtype()) return copy(dst, src);
    if (dst.dtype() == DType::bf16 && src.dtype() == DType::f32)
        return mf::cuda::cast_f32_to_bf16(B(dst), F(src), dst.numel(), ctx().stream);
    if (dst.dtype() == DType::f32 && src.dtype() == DType::bf16)
        return mf::cuda::cast_bf16_to_f32(F(dst), B(src), dst.numel(), ctx().stream);
    MF_FAIL("cast from ", dtype_name(src.dtype()), " to ", dtype_name(dst.dtype()), " is not supported");
}

void synchronize(Device) {
    wait_for_stream(ctx().stream);
    if (ctx().background != nullptr && !ctx().in_background) wait_for_stream(ctx().background);
}

std::vector<cudaEvent_t>& mark_events() {
    static std::vector<cudaEvent_t> events;  // grown on demand, kept for the process
    return events;
}

void background_begin() {
    Context& c = ctx();
    MF_CHECK(!c.in_background, "ops::background: nested background work");
    if (c.background == nullptr) {
        MF_CHECK_CUDA(cudaStreamCreateWithFlags(&c.background, cudaStreamNonBlocking));
        MF_CHECK_CUDA(cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming));
        c.ticket_events.resize(static_cast<size_t>(kBackgroundEvents));
        for (cudaEvent_t& e : c.ticket_events) MF_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    MF_CHECK_CUDA(cudaEventRecord(c.fork, c.stream));
    MF_CHECK_CUDA(cudaStreamWaitEvent(c.background, c.fork, 0));
    c.stream = c.background;
    c.in_background = true;
}

void background_abandon() {
    Context& c = ctx();
    c.stream = c.op_stream;
    c.in_background = false;
}

int64_t background_end() {
    Context& c = ctx();
    const int64_t ticket = ++c.tickets;
    MF_CHECK_CUDA(cudaEventRecord(c.ticket_events[static_cast<size_t>(ticket % kBackgroundEvents)], c.background));
    background_abandon();
    return ticket;
}

void wait_background(Device, int64_t ticket) {
    Context& c = ctx();
    MF_CHECK(!c.in_background && ticket <= c.tickets, "ops::wait_background: ticket ", ticket, " was not issued");
    MF_CHECK_CUDA(cudaStreamWaitEvent(c.stream, c.ticket_events[static_cast<size_t>(ticket % kBackgroundEvents)], 0));
}

void record_mark(int index) {
    auto& events = mark_events();
    while (static_cast<int>(events.size()) <= index) {
        cudaEvent_t e = nullptr;
        MF_CHECK_CUDA(cudaEventCreate(&e));
        events.push_back(e);
    }
    MF_CHECK_CUDA(cudaEventRecord(events[static_cast<size_t>(index)], ctx().stream));
}

std::vector<double> mark_times_ms(int count) {
    synchronize(Device::cuda);
    const auto& events = mark_events();
    MF_CHECK(count <= static_cast<int>(events.size()), "mark_times_ms: ", count, " marks, ", events.size(),
             " recorded");
    std::vector<double> out(static_cast<size_t>(std::max(count, 0)), 0.0);
    for (int i = 1; i < count; ++i) {
        float ms = 0;
        MF_CHECK_CUDA(cudaEventElapsedTime(&ms, events[0], events[static_cast<size_t>(i)]));
        out[static_cast<size_t>(i)] = ms;
    }
    return out;
}

void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight) {
    const int64_t N = rows(inp), C = inp.dim(-1), OC = weight.dim(0);
    if (out.dtype() == DType::f32)
        mf::cuda::matmul_forward_f32out(ctx().gemm, F(out), B(inp), B(weight), N, C, OC, ctx().stream);
    else
        mf::cuda::matmul_forward(ctx().gemm, B(out), B(inp), B(weight), N, C, OC, ctx().stream);
}

void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight, bool accumulate_dinp) {
    const int64_t N = rows(inp), C = inp.dim(-1), OC = weight.dim(0);
    const bf16* g = nullptr;
    if (dout.dtype() == DType::f32) {  // the router's f32 logit gradient: round to bf16 for the GEMMs
        bf16* tmp = static_cast<bf16*>(ctx().get(align256(static_cast<size_t>(dout.numel()) * sizeof(bf16))));
        mf::cuda::cast_f32_to_bf16(tmp, F(dout), dout.numel(), ctx().stream);
        g = tmp;
    } else {
        g = B(dout);
    }
    if (defined(dinp))
        mf::cuda::matmul_backward_input(ctx().gemm, B(dinp), g, B(weight), N, C, OC, accumulate_dinp, ctx().stream);
    if (defined(dweight))
        mf::cuda::matmul_backward_weight(ctx().gemm, dweight.data(), dweight.dtype(), g, B(inp), N, C, OC,
                                         ctx().stream);
}

void add_bias(const Tensor& out, const Tensor& bias) {
    mf::cuda::add_bias(B(out), B(bias), rows(out), bias.numel(), ctx().stream);
}

void bias_backward(const Tensor& dbias, const Tensor& dout) {
    const int64_t N = rows(dout), C = dbias.numel();
    const size_t bytes = mf::cuda::bias_backward_scratch_bytes(N, C);
    mf::cuda::bias_backward(dbias.data(), dbias.dtype(), B(dout), N, C, ctx().get(bytes), bytes, ctx().stream);
}

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte) {
    mf::cuda::embedding_forward(B(out), I(ids), B(wte), ids.numel(), wte.dim(0), wte.dim(-1), ctx().stream);
}

void embedding_backward(const Tensor& dwte, const Tensor& dout, const Tensor& ids) {
    const int64_t N = ids.numel(), V = dwte.dim(0), C = dwte.dim(-1);
    const size_t bytes = mf::cuda::embedding_backward_scratch_bytes(N, V);
    mf::cuda::embedding_backward(dwte.data(), dwte.dtype(), B(dout), I(ids), N, V, C, ctx().get(bytes), bytes,
                                 ctx().stream);
}

size_t embedding_backward_scratch_bytes(int64_t N, int64_t V, Device) {
    return mf::cuda::embedding_backward_scratch_bytes(N, V);
}

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps) {
    const int64_t C = weight.numel(), N = inp.numel() / C;
    mf::cuda::rmsnorm_forward(B(out), F(rstd), B(inp), B(weight), N, C, eps, ctx().stream);
}

void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, bool accumulate_dinp) {
    const int64_t C = weight.numel(), N = inp.numel() / C;
    const size_t bytes = mf::cuda::rmsnorm_backward_scratch_bytes(N, C);
    mf::cuda::rmsnorm_backward(defined(dinp) ? B(dinp) : nullptr, accumulate_dinp,
                               defined(dweight) ? dweight.data() : nullptr,
                               defined(dweight) ? dweight.dtype() : DType::f32, B(dout), B(inp), B(weight), F(rstd), N,
                               C, ctx().get(bytes), bytes, ctx().stream);
}

void qknorm_rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                         const Tensor& q_raw, const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                         const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, float eps, float theta) {
    mf::cuda::rope_qknorm_forward(B(q), B(k), F(q_rstd), F(k_rstd), B(q_raw), B(k_raw), B(q_weight), B(k_weight),
                                  I(positions), positions.numel(), num_heads, num_kv_heads, q_weight.numel(), theta,
                                  eps, ctx().stream);
}

void qknorm_rope_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq_weight, const Tensor& dk_weight,
                          const Tensor& dq, const Tensor& dk, const Tensor& q_raw, const Tensor& k_raw,
                          const Tensor& q_weight, const Tensor& k_weight, const Tensor& q_rstd, const Tensor& k_rstd,
                          const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, float theta) {
    const int64_t N = positions.numel(), D = q_weight.numel();
    MF_CHECK(dq_weight.dtype() == dk_weight.dtype(), "q/k norm gradients differ in dtype");
    const size_t bytes = mf::cuda::rope_qknorm_backward_scratch_bytes(N, D);
    mf::cuda::rope_qknorm_backward(B(dq_raw), B(dk_raw), dq_weight.data(), dk_weight.data(), dq_weight.dtype(), B(dq),
                                   B(dk), B(q_raw), B(k_raw), B(q_weight), B(k_weight), F(q_rstd), F(k_rstd),
                                   I(positions), N, num_heads, num_kv_heads, D, theta, ctx().get(bytes), bytes,
                                   ctx().stream);
}

void qknorm_rope_table_forward(const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                               const Tensor& q_raw, const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                               const Tensor& cos, const Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                               float eps) {
    mf::cuda::rope_qknorm_table_forward(B(q), B(k), F(q_rstd), F(k_rstd), B(q_raw), B(k_raw), B(q_weight), B(k_weight),
                                        B(cos), B(sin), cos.dim(0), num_heads, num_kv_heads, q_weight.numel(), eps,
                                        ctx().stream);
}

void qknorm_rope_table_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq_weight,
                                const Tensor& dk_weight, const Tensor& dq, const Tensor& dk, const Tensor& q_raw,
                                const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                                const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& cos, const Tensor& sin,
                                int64_t num_heads, int64_t num_kv_heads) {
    const int64_t N = cos.dim(0), D = q_weight.numel();
    MF_CHECK(dq_weight.dtype() == dk_weight.dtype(), "q/k norm gradients differ in dtype");
    const size_t bytes = mf::cuda::rope_qknorm_backward_scratch_bytes(N, D);
    mf::cuda::rope_qknorm_table_backward(B(dq_raw), B(dk_raw), dq_weight.data(), dk_weight.data(), dq_weight.dtype(),
                                         B(dq), B(dk), B(q_raw), B(k_raw), B(q_weight), B(k_weight), F(q_rstd),
                                         F(k_rstd), B(cos), B(sin), N, num_heads, num_kv_heads, D, ctx().get(bytes),
                                         bytes, ctx().stream);
}

// RoPE alone: q or k may be undefined when its head count is 0.
void rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_raw, const Tensor& k_raw, const Tensor& positions,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, float theta) {
    mf::cuda::rope_forward(B_or_null(q), B_or_null(k), B_or_null(q_raw), B_or_null(k_raw), I(positions),
                           positions.numel(), num_heads, num_kv_heads, head_dim, rotary_dim, theta, ctx().stream);
}

void rope_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq, const Tensor& dk,
                   const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t rotary_dim, float theta) {
    mf::cuda::rope_backward(B_or_null(dq_raw), B_or_null(dk_raw), B_or_null(dq), B_or_null(dk), I(positions),
                            positions.numel(), num_heads, num_kv_heads, head_dim, rotary_dim, theta, ctx().stream);
}

// The plain causal mask (doc_ids undefined) goes to cuDNN's fused engines where they serve the
// shape; packed documents, and shapes cuDNN refuses, to the kernels of attention.cu.
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& doc_ids, int64_t Bn, int64_t T, int64_t num_heads, int64_t num_kv_heads) {
    const int64_t D = q.numel() / (Bn * T * num_heads);
    const mf::cuda::AttentionShape shape{Bn, T, num_heads, num_kv_heads, D};
    if (!defined(doc_ids) && mf::cuda::cudnn_attention_serves(shape)) {
        void* ws = ctx().get(mf::cuda::cudnn_attention_forward_workspace_bytes(shape));
        return mf::cuda::cudnn_attention_forward(B(out), F(lse), B(q), B(k), B(v), shape, ws, ctx().stream);
    }
    mf::cuda::attention_forward(B(out), F(lse), B(q), B(k), B(v), I(doc_ids), shape, ctx().stream);
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& doc_ids,
                        int64_t Bn, int64_t T, int64_t num_heads, int64_t num_kv_heads) {
    const int64_t D = q.numel() / (Bn * T * num_heads);
    const mf::cuda::AttentionShape shape{Bn, T, num_heads, num_kv_heads, D};
    if (!defined(doc_ids) && mf::cuda::cudnn_attention_serves(shape)) {
        void* ws = ctx().get(mf::cuda::cudnn_attention_backward_workspace_bytes(shape));
        return mf::cuda::cudnn_attention_backward(B(dq), B(dk), B(dv), B(dout), B(q), B(k), B(v), B(out), F(lse), shape,
                                                  ws, ctx().stream);
    }
    void* ws = ctx().get(mf::cuda::attention_backward_workspace_bytes(shape));
    mf::cuda::attention_backward(B(dq), B(dk), B(dv), B(dout), B(q), B(k), B(v), B(out), F(lse), I(doc_ids), shape, ws,
                                 ctx().stream);
}

void swiglu_forward(const Tensor& out, const Tensor& inp) {
    mf::cuda::swiglu_forward(B(out), B(inp), rows(out), out.dim(-1), ctx().stream);
}

void swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp) {
    mf::cuda::swiglu_backward(B(dinp), B(dout), B(inp), rows(dout), dout.dim(-1), ctx().stream);
}

void relu2_forward(const Tensor& out, const Tensor& inp) {
    mf::cuda::relu2_forward(B(out), B(inp), inp.numel(), ctx().stream);
}

void relu2_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp) {
    mf::cuda::relu2_backward(B(dinp), B(dout), B(inp), inp.numel(), ctx().stream);
}

void clamped_swiglu_forward(const Tensor& out, const Tensor& inp, float alpha, float limit) {
    mf::cuda::clamped_swiglu_forward(B(out), B(inp), rows(out), out.dim(-1), alpha, limit, ctx().stream);
}

void clamped_swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp, float alpha, float limit) {
    mf::cuda::clamped_swiglu_backward(B(dinp), B(dout), B(inp), rows(dout), dout.dim(-1), alpha, limit, ctx().stream);
}

void sigmoid_gate_forward(const Tensor& y, const Tensor& value, const Tensor& gate_logits) {
    mf::cuda::sigmoid_gate_forward(B(y), B(value), B(gate_logits), rows(value), value.dim(-1), ctx().stream);
}

void sigmoid_gate_backward(const Tensor& dvalue, const Tensor& dgate_logits, const Tensor& dy, const Tensor& value,
                           const Tensor& gate_logits) {
    mf::cuda::sigmoid_gate_backward(B(dvalue), B(dgate_logits), B(dy), B(value), B(gate_logits), rows(value),
                                    value.dim(-1), ctx().stream);
}

// --- Mamba-2: the kernels take f32 parameters; bf16 ones are cast into the op's scratch first.

// Bytes a parameter needs in scratch as f32 (none when it is f32 already or undefined).
size_t f32_room(const Tensor& t) {
    return defined(t) && t.dtype() != DType::f32 ? align256(static_cast<size_t>(t.numel()) * sizeof(float)) : 0;
}

// t as f32 on the device: itself, or a copy cast into room (advanced past it); null when undefined.
const float* as_f32(const Tensor& t, char*& room) {
    if (!defined(t)) return nullptr;
    if (t.dtype() == DType::f32) return t.ptr<float>();
    float* dst = reinterpret_cast<float*>(room);
    room += f32_room(t);
    mf::cuda::cast_bf16_to_f32(dst, B(t), t.numel(), ctx().stream);
    return dst;
}

void conv1d_silu_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                         const Tensor& doc_ids, int64_t T) {
    const int64_t C = inp.dim(-1), N = rows(inp), K = weight.numel() / C;
    char* room = static_cast<char*>(ctx().get(f32_room(weight) + f32_room(bias) + 256));
    const float* w = as_f32(weight, room);
    const float* b = as_f32(bias, room);
    mf::cuda::conv1d_silu_forward(B(out), B(inp), w, b, I(doc_ids), N, T, C, K, ctx().stream);
}

void conv1d_silu_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                          const Tensor& inp, const Tensor& weight, const Tensor& bias, const Tensor& doc_ids,
                          int64_t T) {
    const int64_t C = inp.dim(-1), N = rows(inp), K = weight.numel() / C;
    const size_t kernel_bytes = mf::cuda::conv1d_silu_backward_scratch_bytes(N, C, K);
    char* room = static_cast<char*>(ctx().get(align256(kernel_bytes) + f32_room(weight) + f32_room(bias)));
    void* kernel_scratch = room;
    room += align256(kernel_bytes);
    const float* w = as_f32(weight, room);
    const float* b = as_f32(bias, room);
    mf::cuda::conv1d_silu_backward(B(dinp), dweight.data(), dweight.dtype(), defined(dbias) ? dbias.data() : nullptr,
                                   defined(dbias) ? dbias.dtype() : DType::f32, B(dout), B(inp), w, b, I(doc_ids), N, T,
                                   C, K, kernel_scratch, kernel_bytes, ctx().stream);
}

mf::cuda::SsdGeometry ssd_geometry(const Tensor& xbc, const SsdDims& d) {
    mf::cuda::SsdGeometry g;
    g.T = d.T;
    g.num_rows = d.T > 0 ? rows(xbc) / d.T : 0;
    g.H = d.num_heads;
    g.P = d.head_dim;
    g.G = d.num_groups;
    g.S = d.state_size;
    g.Q = d.chunk_size;
    g.dt_min = d.dt_min;
    g.dt_max = d.dt_max;
    return g;
}

size_t ssd_param_room(const Tensor& dt_bias, const Tensor& A_log, const Tensor& D) {
    return f32_room(dt_bias) + f32_room(A_log) + f32_room(D);
}

mf::cuda::SsdParams ssd_params(const Tensor& dt_bias, const Tensor& A_log, const Tensor& D, char*& room) {
    const float* b = as_f32(dt_bias, room);
    const float* a = as_f32(A_log, room);
    const float* d = as_f32(D, room);
    return {b, a, d};
}

void ssd_scan_forward(const Tensor& y, const Tensor& states, const Tensor& xbc, const Tensor& dt, const Tensor& dt_bias,
                      const Tensor& A_log, const Tensor& D, const Tensor& doc_ids, const SsdDims& d) {
    const mf::cuda::SsdGeometry g = ssd_geometry(xbc, d);
    const size_t kernel_bytes = align256(mf::cuda::ssd_scan_forward_scratch_bytes(g));
    char* room = static_cast<char*>(ctx().get(kernel_bytes + ssd_param_room(dt_bias, A_log, D)));
    void* kernel_scratch = room;
    room += kernel_bytes;
    const mf::cuda::SsdParams params = ssd_params(dt_bias, A_log, D, room);
    mf::cuda::ssd_scan_forward(B(y), F(states), B(xbc), B(dt), params, I(doc_ids), g, kernel_scratch, kernel_bytes,
                               ctx().stream);
}

void ssd_scan_backward(const Tensor& dxbc, const Tensor& ddt, const Tensor& ddt_bias, const Tensor& dA_log,
                       const Tensor& dD, const Tensor& dy, const Tensor& xbc, const Tensor& dt, const Tensor& dt_bias,
                       const Tensor& A_log, const Tensor& D, const Tensor& states, const Tensor& doc_ids,
                       const SsdDims& d) {
    const mf::cuda::SsdGeometry g = ssd_geometry(xbc, d);
    const size_t kernel_bytes = align256(mf::cuda::ssd_scan_backward_scratch_bytes(g));
    char* room = static_cast<char*>(ctx().get(kernel_bytes + ssd_param_room(dt_bias, A_log, D)));
    void* kernel_scratch = room;
    room += kernel_bytes;
    const mf::cuda::SsdParams params = ssd_params(dt_bias, A_log, D, room);
    const mf::cuda::SsdGrads grads{B(dxbc),       B(ddt),         ddt_bias.data(), ddt_bias.dtype(),
                                   dA_log.data(), dA_log.dtype(), dD.data(),       dD.dtype()};
    mf::cuda::ssd_scan_backward(grads, B(dy), B(xbc), B(dt), params, F(states), I(doc_ids), g, kernel_scratch,
                                kernel_bytes, ctx().stream);
}

void gated_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& z,
                           const Tensor& weight, int64_t group_size, float eps) {
    char* room = static_cast<char*>(ctx().get(f32_room(weight) + 256));
    const float* w = as_f32(weight, room);
    mf::cuda::gated_rmsnorm_forward(B(out), F(rstd), B(x), B(z), w, rows(x), x.dim(-1), group_size, eps, ctx().stream);
}

void gated_rmsnorm_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight, const Tensor& dout,
                            const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& rstd,
                            int64_t group_size) {
    const int64_t N = rows(x), C = x.dim(-1);
    const size_t kernel_bytes = align256(mf::cuda::gated_rmsnorm_backward_scratch_bytes(N, C));
    char* room = static_cast<char*>(ctx().get(kernel_bytes + f32_room(weight)));
    void* kernel_scratch = room;
    room += kernel_bytes;
    const float* w = as_f32(weight, room);
    mf::cuda::gated_rmsnorm_backward(B(dx), B(dz), dweight.data(), dweight.dtype(), B(dout), B(x), B(z), w, F(rstd), N,
                                     C, group_size, kernel_scratch, kernel_bytes, ctx().stream);
}

void router_forward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_weight, const Tensor& logits,
                    bool norm_topk_prob) {
    mf::cuda::router_forward(F(probs), I(topk_idx), F(topk_weight), F(logits), logits.dim(0), logits.dim(1),
                             topk_idx.dim(-1), norm_topk_prob, ctx().stream);
}

void router_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                     const Tensor& topk_idx, bool norm_topk_prob) {
    mf::cuda::router_backward(F(dlogits), F(dtopk_weight), F(dprobs), F(probs), I(topk_idx), probs.dim(0), probs.dim(1),
                              topk_idx.dim(-1), norm_topk_prob, ctx().stream);
}

void router_sigmoid_forward(const Tensor& scores, const Tensor& topk_idx, const Tensor& topk_weight,
                            const Tensor& logits, const Tensor& correction_bias, int64_t n_group, int64_t topk_group,
                            bool norm_topk_prob, float routed_scaling_factor, float masked_score) {
    const mf::cuda::RouterSigmoidParams p{n_group, topk_group, norm_topk_prob, routed_scaling_factor, masked_score};
    const bool has_bias = defined(correction_bias);
    mf::cuda::router_sigmoid_forward(F(scores), I(topk_idx), F(topk_weight), F(logits),
                                     has_bias ? correction_bias.data() : nullptr,
                                     has_bias ? correction_bias.dtype() : DType::f32, logits.dim(0), logits.dim(1),
                                     topk_idx.dim(1), p, ctx().stream);
}

void router_sigmoid_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& scores,
                             const Tensor& topk_idx, bool norm_topk_prob, float routed_scaling_factor) {
    mf::cuda::router_sigmoid_backward(F(dlogits), F(dtopk_weight), F(scores), I(topk_idx), scores.dim(0), scores.dim(1),
                                      topk_idx.dim(1), norm_topk_prob, routed_scaling_factor, ctx().stream);
}

void moe_aux_stats(const Tensor& counts, const Tensor& prob_sums, const Tensor& topk_idx, const Tensor& probs,
                   const Tensor& mask) {
    const int64_t N = probs.dim(0), E = probs.dim(1);
    const size_t bytes = mf::cuda::router_aux_stats_scratch_bytes(N, E);
    mf::cuda::router_aux_stats(F(counts), F(prob_sums), F(probs), I(topk_idx), F(mask), N, E, topk_idx.dim(-1),
                               ctx().get(bytes), bytes, ctx().stream);
}

void moe_aux_dprobs(const Tensor& dprobs, const Tensor& counts, const Tensor& mask, float scale) {
    mf::cuda::aux_dprobs(F(dprobs), F(counts), F(mask), scale, dprobs.dim(0), dprobs.dim(1), ctx().stream);
}

void moe_permute_indices(const Tensor& expert_offsets, const Tensor& sorted_pair, const Tensor& pair_row,
                         const Tensor& topk_idx, int64_t num_experts) {
    const int64_t N = topk_idx.dim(0), K = topk_idx.dim(-1);
    const size_t bytes = mf::cuda::moe_permute_indices_scratch_bytes(N, K, num_experts);
    mf::cuda::moe_permute_indices(I(expert_offsets), I(sorted_pair), I(pair_row), I(topk_idx), N, K, num_experts,
                                  ctx().get(bytes), bytes, ctx().stream);
}

size_t moe_permute_indices_scratch_bytes(int64_t N, int64_t K, int64_t num_experts, Device) {
    return mf::cuda::moe_permute_indices_scratch_bytes(N, K, num_experts);
}

size_t moe_aux_stats_scratch_bytes(int64_t N, int64_t num_experts, Device) {
    return mf::cuda::router_aux_stats_scratch_bytes(N, num_experts);
}

void moe_gather_forward(const Tensor& x_perm, const Tensor& x, const Tensor& sorted_pair, int64_t top_k) {
    mf::cuda::moe_gather_forward(B(x_perm), B(x), I(sorted_pair), rows(x), top_k, x.dim(-1), ctx().stream);
}

void group_offsets(const Tensor& offsets, const Tensor& group_sizes, int64_t num_rows) {
    mf::cuda::group_offsets(I(offsets), I(group_sizes), group_sizes.numel(), num_rows, ctx().stream);
}

void zero_rows_past_groups(const Tensor& x, const Tensor& offsets) {
    mf::cuda::zero_rows_past_groups(B(x), I(offsets), offsets.numel() - 1, rows(x), x.dim(-1), ctx().stream);
}

void moe_gather_backward(const Tensor& dx, const Tensor& dx_perm, const Tensor& pair_row, int64_t top_k) {
    mf::cuda::moe_gather_backward(B(dx), true, B(dx_perm), I(pair_row), rows(dx), top_k, dx.dim(-1), ctx().stream);
}

void moe_unpermute_forward(const Tensor& out, const Tensor& y_perm, const Tensor& topk_weight, const Tensor& pair_row) {
    mf::cuda::moe_unpermute_forward(B(out), B(y_perm), F(topk_weight), I(pair_row), rows(out), topk_weight.dim(-1),
                                    out.dim(-1), ctx().stream);
}

void moe_unpermute_backward(const Tensor& dy_perm, const Tensor& dtopk_weight, const Tensor& dout, const Tensor& y_perm,
                            const Tensor& topk_weight, const Tensor& pair_row) {
    mf::cuda::moe_unpermute_backward(B(dy_perm), F(dtopk_weight), B(dout), B(y_perm), F(topk_weight), I(pair_row),
                                     rows(dout), topk_weight.dim(-1), dout.dim(-1), ctx().stream);
}

// Expert-parallel token exchange (kernels/cuda/ep_tokens.cuh). ops.cpp checked the shapes; the
// kernels compute the block offsets from counts on the device and skip out-of-range indices.
void ep_token_positions(const Tensor& send_pos, const Tensor& counts, const Tensor& topk_idx,
                        const Tensor& expert_dest) {
    mf::cuda::ep_token_positions(I(send_pos), I(counts), I(topk_idx), I(expert_dest), send_pos.dim(1), topk_idx.dim(-1),
                                 expert_dest.numel(), counts.numel(), ctx().stream);
}

void ep_pack_rows(const Tensor& rows_buf, const Tensor& src, const Tensor& send_pos, const Tensor& counts) {
    mf::cuda::ep_pack_rows(B(rows_buf), rows(rows_buf), B(src), I(send_pos), I(counts), send_pos.dim(1), counts.numel(),
                           src.dim(-1), ctx().stream);
}

void ep_pack_meta(const Tensor& meta, const Tensor& send_pos, const Tensor& counts, const Tensor& topk_idx,
                  const Tensor& topk_weight, const Tensor& pair_row, const Tensor& expert_offsets,
                  const Tensor& row_base, const Tensor& expert_dest) {
    mf::cuda::ep_pack_meta(I(meta), meta.dim(0), I(send_pos), I(counts), I(topk_idx), F(topk_weight), I(pair_row),
                           I(expert_offsets), I(row_base), I(expert_dest), send_pos.dim(1), topk_idx.dim(-1),
                           expert_dest.numel(), counts.numel(), ctx().stream);
}

void ep_scatter_rows(const Tensor& local, const Tensor& rows_buf, const Tensor& meta) {
    mf::cuda::ep_scatter_rows(B(local), rows(local), B(rows_buf), I(meta), rows(rows_buf), meta.dim(1) / 2,
                              rows_buf.dim(-1), ctx().stream);
}

void ep_scatter_grad(const Tensor& dlocal, const Tensor& dweight, const Tensor& drows, const Tensor& meta,
                     const Tensor& y_local) {
    mf::cuda::ep_scatter_grad(B(dlocal), F(dweight), B(drows), I(meta), B(y_local), rows(dlocal), rows(drows),
                              meta.dim(1) / 2, drows.dim(-1), ctx().stream);
}

void ep_reduce_rows(const Tensor& out, const Tensor& local, const Tensor& meta, bool weighted) {
    if (out.dtype() == DType::f32)
        return mf::cuda::ep_reduce_rows(F(out), B(local), rows(local), I(meta), rows(out), meta.dim(1) / 2, out.dim(-1),
                                        weighted, ctx().stream);
    mf::cuda::ep_reduce_rows(B(out), B(local), rows(local), I(meta), rows(out), meta.dim(1) / 2, out.dim(-1), weighted,
                             ctx().stream);
}

void ep_sum_blocks(const Tensor& out, const Tensor& rows_buf, const Tensor& send_pos, const Tensor& counts,
                   bool accumulate) {
    if (rows_buf.dtype() == DType::f32)
        return mf::cuda::ep_sum_blocks(B(out), accumulate, F(rows_buf), rows(rows_buf), I(send_pos), I(counts),
                                       send_pos.dim(1), counts.numel(), out.dim(-1), ctx().stream);
    mf::cuda::ep_sum_blocks(B(out), accumulate, B(rows_buf), rows(rows_buf), I(send_pos), I(counts), send_pos.dim(1),
                            counts.numel(), out.dim(-1), ctx().stream);
}

void ep_gather_slots(const Tensor& dtopk_weight, const Tensor& dweight_rows, const Tensor& send_pos,
                     const Tensor& counts, const Tensor& topk_idx, const Tensor& expert_dest) {
    mf::cuda::ep_gather_slots(F(dtopk_weight), F(dweight_rows), dweight_rows.dim(0), I(send_pos), I(counts),
                              I(topk_idx), I(expert_dest), send_pos.dim(1), topk_idx.dim(-1), expert_dest.numel(),
                              counts.numel(), ctx().stream);
}

// Grouped expert GEMMs: the persistent wgmma kernels (grouped_gemm_sm90.cuh: Hopper only, one launch
// per product, device offsets), the own mma.sync kernel (grouped_gemm.cuh: device offsets, never
// syncs) or the cuBLAS path (grouped_gemm_cublas.cuh: one host read of the offsets and one stream
// sync per call unless the caller has them, then one cuBLASLt matmul per group over 4 streams). All
// compute the same formulas with fp32 accumulation, deterministically.
// MOEFORGE_GROUPED_GEMM=sm90|cublas|own|auto picks one (default sm90, its figures in
// grouped_gemm_sm90.cuh; where it does not serve, cublas).
//
// cublas over own, from whole training steps on the H200 (2026-11-30, bench/p1.sh and bench/p2.sh):
//   P1 (4 layers, 512 rows per expert)   own 64.1k tok/s, auto 71.5k, cublas 72.7k (70.8k in p1.sh)
//   P2 EP=2 (8 layers, 2 GPUs)          own 36.1k tok/s/GPU, auto 41.7k, cublas 41.6k
// (grouped GEMM per P1 step: own 9.2 + 26.4 ms, cublas 8.5 + 17.4 ms fwd + bwd). In a step the
// cuBLAS path also wins the down projection at 512 rows that the isolated benchmark below gives to
// the own kernel, so the rule of auto is kept only as an option. The first version of the cuBLAS
// path chose its algorithm per exact row count and was several times slower in a step (a heuristic
// query per group: routing changes the rows every step); it now chooses per row bucket.
//
// auto: the cuBLAS path when the mean work of a group, 2·(M/E)·C·OC flops, reaches 2^31 for the row
// products (forward, backward input) or 2^30 for the weight gradient. H200 (MF_BENCH=1 of
// test_cuda_grouped_gemm, uneven log-normal loads; TFLOP/s own -> cuBLAS; fwd / bwd-in / bwd-w f32):
//   65536 rows / 128 experts (512 rows each) gate_up 3.2 GFLOP/group  294->391  254->385  149->276
//                                            down    1.6 GFLOP/group  242->229  281->223  156->225
//   131072 rows / 128 experts (1024 rows)    gate_up 6.4 GFLOP/group  282->525  264->534  217->459
//                                            down    3.2 GFLOP/group  252->412  284->380  211->383
//   131072 rows / 64 experts (2048 rows)     gate_up                  290->656  273->656  264->608
//                                            down                     256->531  298->531  252->516
// (dense cuBLASLt of the same total size: 770-795 gate_up, 683-693 down.) Below ~2 GFLOP per group
// the cuBLAS path is bound by the host issuing one matmul per group, and the own kernel wins the row
// products; the weight gradient is the own kernel's weakest product, so cuBLAS wins it already at
// 1.6 GFLOP per group. M/E over-estimates the rows per group when the offsets cover only part of the
// buffer (the EP pipeline hands each chunk of experts all local rows).
enum class GroupedGemmPath { own, cublas, automatic, sm90 };

constexpr double kCublasMinRowProductFlops = 2147483648.0;  // 2^31 per group
constexpr double kCublasMinWeightGradFlops = 1073741824.0;  // 2^30 per group

// MOEFORGE_GROUPED_GEMM: sm90 (default: the forward, the written input gradient and the weight
// gradient on the wgmma kernels of grouped_gemm_sm90.cuh where they serve the device and shape, the
// rest as cublas), cublas, own (the sm80 kernels) or auto (own for small groups, else cublas).
GroupedGemmPath grouped_gemm_setting() {
    static const GroupedGemmPath path = [] {
        const char* env = std::getenv("MOEFORGE_GROUPED_GEMM");
        const std::string_view v = env == nullptr ? "sm90" : env;
        if (v == "own") return GroupedGemmPath::own;
        if (v == "cublas") return GroupedGemmPath::cublas;
        if (v == "auto") return GroupedGemmPath::automatic;
        if (v == "sm90" || v.empty()) return GroupedGemmPath::sm90;
        mf::fail("environment variable MOEFORGE_GROUPED_GEMM='", v, "': expected own, cublas, auto or sm90");
    }();
    return path;
}

// Whether a grouped product over M buffer rows and E groups of [C] x [OC] takes the cuBLAS path.
bool grouped_uses_cublas(int64_t M, int64_t E, int64_t C, int64_t OC, bool weight_grad) {
    switch (grouped_gemm_setting()) {
        case GroupedGemmPath::own:
            return false;
        case GroupedGemmPath::cublas:
        case GroupedGemmPath::sm90:  // for the products the sm90 kernel does not serve
            return true;
        case GroupedGemmPath::automatic:
            break;
    }
    if (E <= 0) return false;
    const double flops_per_group = 2.0 * static_cast<double>(M / E) * static_cast<double>(C) * static_cast<double>(OC);
    return flops_per_group >= (weight_grad ? kCublasMinWeightGradFlops : kCublasMinRowProductFlops);
}

// The sm90 kernels serve the product (their shape checks aside).
bool use_sm90(int64_t E) { return grouped_gemm_setting() == GroupedGemmPath::sm90 && E <= mf::cuda::kSm90MaxGroups; }

// MOEFORGE_GROUPED_GEMM_LANES: the streams the per-expert products spread over (1 .. 16; the class's
// default, 4, when unset): a tuning knob for benchmarks. 0: the default.
int grouped_gemm_lanes() {
    static const int lanes = [] {
        const char* env = std::getenv("MOEFORGE_GROUPED_GEMM_LANES");
        if (env == nullptr || *env == '\0') return 0;
        char* end = nullptr;
        const long n = std::strtol(env, &end, 10);
        if (*end != '\0' || n < 1 || n > 16)
            mf::fail("environment variable MOEFORGE_GROUPED_GEMM_LANES='", env, "': expected an integer in [1, 16]");
        return static_cast<int>(n);
    }();
    return lanes;
}

mf::cuda::GroupedGemmCublas& grouped_cublas() {
    Context& c = ctx();
    if (c.grouped == nullptr) {
        const int lanes = grouped_gemm_lanes();
        c.grouped = lanes == 0 ? std::make_unique<mf::cuda::GroupedGemmCublas>(c.gemm.handle)
                               : std::make_unique<mf::cuda::GroupedGemmCublas>(c.gemm.handle, lanes);
    }
    return *c.grouped;
}

bool grouped_matmul_uses_host_offsets(Device, int64_t E, int64_t C, int64_t OC) {
    if (grouped_gemm_setting() == GroupedGemmPath::own) return false;
    const bool all_sm90 = use_sm90(E) && mf::cuda::grouped_matmul_forward_sm90_supported(C, OC) &&
                          mf::cuda::grouped_matmul_backward_input_sm90_supported(C, OC) &&
                          mf::cuda::grouped_matmul_backward_weight_sm90_supported(C, OC);
    return !all_sm90;
}
void set_grouped_matmul_reserved_sms(Device, int sms) { mf::cuda::set_grouped_gemm_sm90_reserved_sms(sms); }

void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets,
                            std::span<const int32_t> host_offsets) {
    const int64_t M = rows(inp), E = weight.dim(0), OC = weight.dim(1), C = weight.dim(2);
    if (use_sm90(E) && mf::cuda::grouped_matmul_forward_sm90_supported(C, OC))
        mf::cuda::grouped_matmul_forward_sm90(B(out), B(inp), B(weight), I(offsets), M, E, C, OC, ctx().stream);
    else if (grouped_uses_cublas(M, E, C, OC, false))
        mf::cuda::grouped_matmul_forward_cublas(grouped_cublas(), B(out), B(inp), B(weight), I(offsets), M, E, C, OC,
                                                ctx().stream, host_offsets);
    else
        mf::cuda::grouped_matmul_forward(B(out), B(inp), B(weight), I(offsets), M, E, C, OC, ctx().stream);
}

void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& offsets, std::span<const int32_t> host_offsets,
                             bool accumulate_dinp, bool accumulate_dweight) {
    const int64_t M = rows(inp), E = weight.dim(0), OC = weight.dim(1), C = weight.dim(2);
    if (defined(dinp)) {
        if (use_sm90(E) && !accumulate_dinp && mf::cuda::grouped_matmul_backward_input_sm90_supported(C, OC))
            mf::cuda::grouped_matmul_backward_input_sm90(B(dinp), B(dout), B(weight), I(offsets), M, E, C, OC,
                                                         ctx().stream);
        else if (grouped_uses_cublas(M, E, C, OC, false))
            mf::cuda::grouped_matmul_backward_input_cublas(grouped_cublas(), B(dinp), B(dout), B(weight), I(offsets), M,
                                                           E, C, OC, accumulate_dinp, ctx().stream, host_offsets);
        else
            mf::cuda::grouped_matmul_backward_input(B(dinp), B(dout), B(weight), I(offsets), M, E, C, OC,
                                                    accumulate_dinp, ctx().stream);
    }
    if (defined(dweight)) {
        if (use_sm90(E) && mf::cuda::grouped_matmul_backward_weight_sm90_supported(C, OC)) {
            mf::cuda::grouped_matmul_backward_weight_sm90(dweight.data(), dweight.dtype(), B(dout), B(inp), I(offsets),
                                                          M, E, C, OC, accumulate_dweight, ctx().stream);
        } else if (grouped_uses_cublas(M, E, C, OC, true)) {
            mf::cuda::grouped_matmul_backward_weight_cublas(grouped_cublas(), dweight.data(), dweight.dtype(), B(dout),
                                                            B(inp), I(offsets), M, E, C, OC, ctx().stream, host_offsets,
                                                            accumulate_dweight);
        } else {  // the own kernel only accumulates
            if (!accumulate_dweight) zero(dweight);
            mf::cuda::grouped_matmul_backward_weight(dweight.data(), dweight.dtype(), B(dout), B(inp), I(offsets), M, E,
                                                     C, OC, ctx().stream);
        }
    }
}

// One pass through the sm90 SwiGLU epilogues where they serve, else the two ops.
void grouped_matmul_swiglu_forward(const Tensor& h, const Tensor& a, const Tensor& inp, const Tensor& weight,
                                   const Tensor& offsets, std::span<const int32_t> host_offsets) {
    const int64_t M = rows(inp), E = weight.dim(0), inter = weight.dim(1) / 2, C = weight.dim(2);
    if (use_sm90(E) && mf::cuda::grouped_matmul_forward_swiglu_sm90_supported(C, inter)) {
        mf::cuda::grouped_matmul_forward_swiglu_sm90(B(h), B(a), B(inp), B(weight), I(offsets), M, E, C, inter,
                                                     ctx().stream);
        return;
    }
    grouped_matmul_forward(h, inp, weight, offsets, host_offsets);
    swiglu_forward(a, h);
}

void grouped_matmul_swiglu_backward(const Tensor& dh, const Tensor& da, const Tensor& dout, const Tensor& weight,
                                    const Tensor& h, const Tensor& offsets, std::span<const int32_t> host_offsets) {
    const int64_t M = rows(dout), E = weight.dim(0), OC = weight.dim(1), inter = weight.dim(2);
    if (use_sm90(E) && mf::cuda::grouped_matmul_backward_swiglu_sm90_supported(inter, OC)) {
        mf::cuda::grouped_matmul_backward_swiglu_sm90(B(dh), B(dout), B(weight), B(h), I(offsets), M, E, inter, OC,
                                                      ctx().stream);
        return;
    }
    // (The input gradient reads no input: da stands in for inp's rows.)
    grouped_matmul_backward(da, Tensor(), dout, da, weight, offsets, host_offsets, false, true);
    swiglu_backward(dh, da, h);
}

void grouped_matmul_backward_weight(const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                                    std::span<const Tensor> offsets,
                                    std::span<const std::span<const int32_t>> host_offsets, bool accumulate,
                                    const Tensor& square_sum) {
    const int64_t M = rows(inp), E = dweight.dim(0), OC = dweight.dim(1), C = dweight.dim(2);
    double* sum = defined(square_sum) ? square_sum.ptr<double>() : nullptr;
    if (use_sm90(E) && mf::cuda::grouped_matmul_backward_weight_sm90_supported(C, OC)) {
        // One pass over both tables: each gradient rounded once (and its squares summed as stored).
        void* scratch =
            sum != nullptr ? ctx().get(mf::cuda::grouped_matmul_backward_weight_sm90_squares_bytes(E, C, OC)) : nullptr;
        mf::cuda::grouped_matmul_backward_weight_sm90(dweight.data(), dweight.dtype(), B(dout), B(inp), I(offsets[0]),
                                                      M, E, C, OC, accumulate, ctx().stream,
                                                      offsets.size() > 1 ? I(offsets[1]) : nullptr, sum, scratch);
        return;
    }
    for (size_t p = 0; p < offsets.size(); ++p)  // table by table, the later ones accumulated
        grouped_matmul_backward(Tensor(), dweight, dout, inp, dweight, offsets[p],
                                host_offsets.empty() ? std::span<const int32_t>() : host_offsets[p], true,
                                accumulate || p > 0);
    if (sum != nullptr)
        mf::cuda::sum_squares(sum, dweight.data(), dweight.dtype(), dweight.numel(), true,
                              ctx().get(mf::cuda::sum_squares_scratch_bytes()), ctx().stream);
}

// The loss's rows per chunk: equal chunks (the last may be shorter by rounding), each as large as the
// budget allows.
int64_t loss_chunk_rows(int64_t N, int64_t V, DType logits_dtype) {
    if (N <= 0) return 1;  // (no rows: the smallest chunk, so that the scratch asked for is a row's)
    const size_t row_bytes = dtype_size(logits_dtype) * static_cast<size_t>(V);
    const int64_t max_chunk = std::clamp<int64_t>(static_cast<int64_t>(kLossScratchBytes / row_bytes), 1, N);
    const int64_t num_chunks = (N + max_chunk - 1) / max_chunk;
    return std::min(max_chunk, (N + num_chunks - 1) / num_chunks);
}

size_t lm_head_cross_entropy_scratch_bytes(int64_t N, int64_t V, DType logits_dtype, Device) {
    return mf::cuda::lm_head_cross_entropy_scratch_bytes(loss_chunk_rows(N, V, logits_dtype), V, logits_dtype);
}

void lm_head_cross_entropy(const Tensor& losses, const Tensor& dh, const Tensor& dw, const Tensor& h, const Tensor& w,
                           const Tensor& targets, float grad_scale, DType logits_dtype, bool accumulate,
                           const Tensor& grad_scale_by) {
    const int64_t N = rows(h), C = h.dim(-1), V = w.dim(0);
    const int64_t chunk = loss_chunk_rows(N, V, logits_dtype);
    const size_t bytes = mf::cuda::lm_head_cross_entropy_scratch_bytes(chunk, V, logits_dtype);
    mf::cuda::lm_head_cross_entropy(ctx().blas, F(losses), defined(dh) ? B(dh) : nullptr,
                                    defined(dw) ? dw.data() : nullptr, defined(dw) ? dw.dtype() : DType::f32, B(h),
                                    B(w), I(targets), N, C, V, grad_scale, ctx().get(bytes), bytes, chunk, ctx().stream,
                                    logits_dtype, accumulate, defined(grad_scale_by) ? F(grad_scale_by) : nullptr);
}

void adamw_update(const Tensor& param, const Tensor& master, const Tensor& m, const Tensor& v, const Tensor& grad,
                  const AdamWHyper& h) {
    const mf::cuda::AdamWParams p{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.grad_scale};
    if (defined(master))
        mf::cuda::adamw_update_mixed(F(master), F(m), F(v), grad.data(), grad.dtype(), B(param), param.numel(), p,
                                     nullptr, ctx().stream);
    else
        mf::cuda::adamw_update_bf16(B(param), B(m), B(v), B(grad), param.numel(), p, nullptr, ctx().stream);
}

double sum(const Tensor& x) {
    mf::cuda::sum_f32(ctx().d_double(), F(x), x.numel(), ctx().stream);
    double v = 0;
    MF_CHECK_CUDA(cudaMemcpyAsync(&v, ctx().d_double(), sizeof v, cudaMemcpyDeviceToHost, ctx().stream));
    wait_for_stream(ctx().stream);
    return v;
}

double sum_squares(const Tensor& x) {
    const size_t bytes = mf::cuda::sum_squares_scratch_bytes();
    mf::cuda::sum_squares(ctx().d_double(), x.data(), x.dtype(), x.numel(), false, ctx().get(bytes), ctx().stream);
    double v = 0;
    MF_CHECK_CUDA(cudaMemcpyAsync(&v, ctx().d_double(), sizeof v, cudaMemcpyDeviceToHost, ctx().stream));
    wait_for_stream(ctx().stream);
    return v;
}

void sum_squares_to(const Tensor& sums, std::span<const int64_t> slots, std::span<const Tensor> xs) {
    if (xs.empty()) return;
    std::vector<mf::cuda::SumSquaresItem> items;
    items.reserve(xs.size());
    for (size_t i = 0; i < xs.size(); ++i)
        items.push_back({xs[i].data(), xs[i].numel(), sums.ptr<double>() + slots[i]});
    mf::cuda::sum_squares_many(items.data(), static_cast<int64_t>(items.size()), xs[0].dtype(),
                               ctx().get(mf::cuda::sum_squares_many_scratch_bytes()), ctx().stream);
}

void scale_by(const Tensor& x, const Tensor& scale) {
    mf::cuda::scale_inplace(x.data(), x.dtype(), F(scale), x.numel(), ctx().stream);
}

bool all_finite(const Tensor& x) {
    mf::cuda::count_nonfinite(ctx().d_count(), x.data(), x.dtype(), x.numel(), ctx().stream);
    unsigned long long n = 0;
    MF_CHECK_CUDA(cudaMemcpyAsync(&n, ctx().d_count(), sizeof n, cudaMemcpyDeviceToHost, ctx().stream));
    wait_for_stream(ctx().stream);
    return n == 0;
}

// The table, in CudaOps' order (designated initializers): the spelled-out entries, then the list's.
#define MF_CUDA_TABLE_ENTRY(name) .name = &name,
constexpr CudaOps kTable{.sum_squares_to = &sum_squares_to,
                         .record_mark = &record_mark,
                         .mark_times_ms = &mark_times_ms,
                         .background_begin = &background_begin,
                         .background_end = &background_end,
                         .background_abandon = &background_abandon,
                         .exec_enter = &exec_enter,
                         .exec_leave = &exec_leave,
                         .current_stream = &current_stream,
                         MF_CUDA_OPS(MF_CUDA_TABLE_ENTRY)};
#undef MF_CUDA_TABLE_ENTRY

}  // namespace
}  // namespace mf::ops::cuda_impl

namespace mf::ops {

const CudaOps& cuda_ops() { return cuda_impl::kTable; }

}  // namespace mf::ops
