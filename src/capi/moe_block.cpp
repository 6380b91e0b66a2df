// The C API's whole MoE block (include/moeforge/moeforge.h): model::moe_block_forward/backward, the
// blocks the CausalLM runs, over the caller's tensors. Their activations (MoeActs) and the
// backward's scratch (MoeScratch) are carved from the caller's workspace by the same allocation
// sequence in the forward and the backward, so the backward finds the forward's activations at the
// same places; the host copy of the expert offsets, which the GPU's cuBLAS path wants, is read back
// again in the backward. No expert parallelism here (a binding's EP is its own).
#include <cmath>

#include "capi/capi_util.h"
#include "model/ffn_blocks.h"
#include "ops/ops.h"

using mf::Arena;
using mf::Device;
using mf::DType;
using mf::Tensor;
using mf::capi::guarded;
using mf::capi::OpCall;
using mf::capi::refuse;
using mf::capi::Want;

namespace {

// A caller buffer's alignment: 128 bytes on a GPU (what XLA gives its buffers; the block's kernels
// need 16: vector loads and TMA base addresses, the arena keeping every view at a multiple of 256
// from the base), 64 on the CPU (what framework CPU allocators give).
size_t buffer_alignment(Device device) { return device == Device::cuda ? 128 : 64; }

mf::model::MoeDims dims_of(const char* op, const mf_moe_dims* dims) {
    if (dims == nullptr) refuse(op, ": dims is required (got NULL)");
    const mf_moe_dims& m = *dims;
    if (m.hidden < 1 || m.intermediate < 1 || m.num_experts < 1 || m.top_k < 1 || m.top_k > m.num_experts)
        refuse(op, ": dims hidden = ", m.hidden, ", intermediate = ", m.intermediate, ", num_experts = ", m.num_experts,
               ", top_k = ", m.top_k, " (each >= 1, top_k <= num_experts)");
    if (m.activation != MF_ACT_SWIGLU && m.activation != MF_ACT_RELU2)
        refuse(op, ": dims.activation = ", m.activation, " (expected MF_ACT_SWIGLU or MF_ACT_RELU2)");
    if (m.router != MF_ROUTER_SOFTMAX && m.router != MF_ROUTER_SIGMOID)
        refuse(op, ": dims.router = ", m.router, " (expected MF_ROUTER_SOFTMAX or MF_ROUTER_SIGMOID)");
    mf::model::MoeDims d{m.hidden, m.intermediate, m.num_experts, m.top_k, m.norm_topk_prob != 0};
    d.act = m.activation == MF_ACT_RELU2 ? mf::model::Activation::relu2 : mf::model::Activation::swiglu;
    d.router = m.router == MF_ROUTER_SIGMOID ? mf::model::RouterKind::sigmoid : mf::model::RouterKind::softmax;
    d.n_group = m.n_group;
    d.topk_group = m.topk_group;
    d.routed_scaling = m.routed_scaling_factor;
    d.masked_score = m.masked_score;
    return d;
}

DType act_dtype(Device device) { return device == Device::cuda ? DType::bf16 : DType::f32; }

// Bytes of N tokens' activations (kept from the forward to the backward) and of the backward's
// scratch; allocated in this order from one arena, both are the layout of a whole workspace.
size_t activation_bytes(const mf::model::MoeDims& d, int64_t N, Device device) {
    Arena arena = Arena::measuring(device);
    mf::model::MoeActs acts;
    acts.alloc(arena, d, N, act_dtype(device));
    return arena.high_water();
}

size_t scratch_bytes(const mf::model::MoeDims& d, int64_t N, Device device) {
    Arena arena = Arena::measuring(device);
    mf::model::MoeScratch scratch;
    scratch.alloc(arena, d, N, act_dtype(device));
    return arena.high_water();
}

// (every allocation is rounded to the arena's alignment, so the scratch begins where the activations end)
size_t workspace_bytes(const mf::model::MoeDims& d, int64_t N, Device device) {
    return activation_bytes(d, N, device) + scratch_bytes(d, N, device);
}

struct Block {
    Tensor x, router, gate_up, down, correction;
    mf::model::MoeWeights weights() const { return {router, gate_up, down, correction}; }
};

// The block's inputs and weights, checked against the dims; returns them.
Block block_inputs(OpCall& call, const mf::model::MoeDims& d, const mf_tensor* x, const mf_tensor* router,
                   const mf_tensor* gate_up, const mf_tensor* down, const mf_tensor* correction_bias) {
    Block b;
    b.x = call.tensor(x, "x", Want::act);
    b.router = call.tensor(router, "router", Want::act);
    b.gate_up = call.tensor(gate_up, "gate_up", Want::act);
    b.down = call.tensor(down, "down", Want::act);
    b.correction = call.tensor(correction_bias, "correction_bias", Want::f32, true);
    const int64_t N = b.x.ndim() >= 1 ? b.x.numel() / std::max<int64_t>(b.x.dim(-1), 1) : 0;
    call.rows_of(b.x, "x", N, d.hidden);
    call.rows_of(b.router, "router", d.num_experts, d.hidden);
    call.numel_of(b.gate_up, "gate_up", d.num_experts * d.first_width() * d.hidden);
    call.numel_of(b.down, "down", d.num_experts * d.hidden * d.intermediate);
    b.gate_up = b.gate_up.view({d.num_experts, d.first_width(), d.hidden});
    b.down = b.down.view({d.num_experts, d.hidden, d.intermediate});
    b.x = b.x.view({N, d.hidden});
    if (b.correction.data() != nullptr) {
        if (d.router != mf::model::RouterKind::sigmoid)
            refuse(call.op(), ": correction_bias is the sigmoid router's; dims.router is MF_ROUTER_SOFTMAX");
        call.numel_of(b.correction, "correction_bias", d.num_experts);
    }
    return b;
}

// An arena over a caller's buffer (`name`), which must hold `need` bytes (`what` says which size).
Arena borrowed_arena(OpCall& call, const mf_tensor* buffer, const char* name, size_t need, int64_t N,
                     const char* what) {
    const Tensor ws = call.tensor(buffer, name, Want::any);
    if (ws.nbytes() < need)
        refuse(call.op(), ": ", name, " holds ", ws.nbytes(), " bytes; ", N, " tokens need ", what, " = ", need);
    if (reinterpret_cast<uintptr_t>(ws.data()) % buffer_alignment(call.device()) != 0)
        refuse(call.op(), ": ", name, " is not ", buffer_alignment(call.device()), "-byte aligned");
    return Arena::borrowing(ws.data(), ws.nbytes(), call.device());
}

// The bytes function of one C API call (the dims and the device checked).
mf_status bytes_call(const char* op, const mf_moe_dims* dims, int64_t num_tokens, int32_t device_type, size_t* bytes,
                     size_t (*measure)(const mf::model::MoeDims&, int64_t, Device)) {
    return guarded([&] {
        const mf::model::MoeDims d = dims_of(op, dims);
        if (num_tokens < 0) refuse(op, ": num_tokens = ", num_tokens, " is negative");
        if (device_type != MF_CPU && device_type != MF_CUDA) refuse(op, ": device_type = ", device_type, " is unknown");
        if (bytes == nullptr) refuse(op, ": bytes is required (got NULL)");
        *bytes = measure(d, num_tokens, device_type == MF_CUDA ? Device::cuda : Device::cpu);
    });
}

}  // namespace

extern "C" {

mf_status mf_moe_block_workspace_bytes(const mf_moe_dims* dims, int64_t num_tokens, int32_t device_type,
                                       size_t* bytes) {
    return bytes_call("mf_moe_block_workspace_bytes", dims, num_tokens, device_type, bytes, workspace_bytes);
}

mf_status mf_moe_block_activation_bytes(const mf_moe_dims* dims, int64_t num_tokens, int32_t device_type,
                                        size_t* bytes) {
    return bytes_call("mf_moe_block_activation_bytes", dims, num_tokens, device_type, bytes, activation_bytes);
}

mf_status mf_moe_block_forward(const mf_context* ctx, const mf_moe_dims* dims, const mf_tensor* y, const mf_tensor* x,
                               const mf_tensor* router, const mf_tensor* gate_up, const mf_tensor* down,
                               const mf_tensor* correction_bias, const mf_tensor* workspace) {
    return guarded([&] {
        OpCall call("mf_moe_block_forward", ctx);
        const mf::model::MoeDims d = dims_of(call.op(), dims);
        const Tensor out = call.tensor(y, "y", Want::act);
        const Block b = block_inputs(call, d, x, router, gate_up, down, correction_bias);
        const int64_t N = b.x.dim(0);
        call.rows_of(out, "y", N, d.hidden);
        Arena arena = borrowed_arena(call, workspace, "workspace", activation_bytes(d, N, call.device()), N,
                                     "mf_moe_block_activation_bytes");
        mf::model::MoeActs acts;
        acts.alloc(arena, d, N, act_dtype(call.device()));
        call.run([&] { mf::model::moe_block_forward(out.view({N, d.hidden}), acts, b.x, b.weights(), d); });
    });
}

mf_status mf_moe_block_backward(const mf_context* ctx, const mf_moe_dims* dims, const mf_tensor* dx,
                                const mf_tensor* drouter, const mf_tensor* dgate_up, const mf_tensor* ddown,
                                const mf_tensor* dy, const mf_tensor* dprobs, const mf_tensor* x,
                                const mf_tensor* router, const mf_tensor* gate_up, const mf_tensor* down,
                                const mf_tensor* correction_bias, const mf_tensor* workspace, const mf_tensor* scratch,
                                int accumulate_expert_grads) {
    return guarded([&] {
        OpCall call("mf_moe_block_backward", ctx);
        const mf::model::MoeDims d = dims_of(call.op(), dims);
        const Tensor tdx = call.tensor(dx, "dx", Want::act), tdy = call.tensor(dy, "dy", Want::act);
        const Tensor tdr = call.tensor(drouter, "drouter", Want::param);
        const Tensor tdgu = call.tensor(dgate_up, "dgate_up", Want::param);
        const Tensor tdd = call.tensor(ddown, "ddown", Want::param);
        const Tensor tdp = call.tensor(dprobs, "dprobs", Want::f32, true);
        const Block b = block_inputs(call, d, x, router, gate_up, down, correction_bias);
        const int64_t N = b.x.dim(0);
        call.rows_of(tdx, "dx", N, d.hidden);
        call.rows_of(tdy, "dy", N, d.hidden);
        call.numel_of(tdr, "drouter", d.num_experts * d.hidden);
        call.numel_of(tdgu, "dgate_up", b.gate_up.numel());
        call.numel_of(tdd, "ddown", b.down.numel());
        if (tdp.data() != nullptr) call.rows_of(tdp, "dprobs", N, d.num_experts);
        const DType act = act_dtype(call.device());
        // the forward's activations, then the scratch after them or in its own buffer
        Arena arena = scratch == nullptr
                          ? borrowed_arena(call, workspace, "workspace", workspace_bytes(d, N, call.device()), N,
                                           "mf_moe_block_workspace_bytes")
                          : borrowed_arena(call, workspace, "workspace", activation_bytes(d, N, call.device()), N,
                                           "mf_moe_block_activation_bytes");
        mf::model::MoeActs acts;
        acts.alloc(arena, d, N, act);
        Arena scratch_arena = scratch == nullptr
                                  ? Arena()
                                  : borrowed_arena(call, scratch, "scratch", scratch_bytes(d, N, call.device()), N,
                                                   "mf_moe_block_workspace_bytes - mf_moe_block_activation_bytes");
        mf::model::MoeScratch moe_scratch;
        moe_scratch.alloc(scratch == nullptr ? arena : scratch_arena, d, N, act);
        const mf::model::MoeWeights grads{tdr.view({d.num_experts, d.hidden}), tdgu.view(b.gate_up.shape()),
                                          tdd.view(b.down.shape())};
        call.run([&] {
            if (mf::model::experts_use_host_offsets(b.weights(), call.device())) {
                acts.host_offsets.resize(static_cast<size_t>(d.num_experts + 1));
                mf::ops::copy_to_host(acts.host_offsets.data(), acts.expert_offsets);
            }
            mf::model::moe_block_backward(tdx.view({N, d.hidden}), grads, moe_scratch, tdy.view({N, d.hidden}),
                                          tdp.data() != nullptr ? tdp.view({N, d.num_experts}) : Tensor(), b.x, acts,
                                          b.weights(), d, accumulate_expert_grads != 0);
        });
    });
}

}  // extern "C"
