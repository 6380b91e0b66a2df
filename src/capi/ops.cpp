// The C API's ops (include/moeforge/moeforge.h): each checks its descriptors (dtype, shape, device,
// contiguity) and scalars, then calls the ops:: function it wraps inside the caller's execution
// context. The checks are the API's own, complete enough that a CPU kernel never reads or writes
// outside the caller's buffers; index values the CPU kernels read unchecked (grouped GEMM offsets)
// are checked on the host. On a GPU the index values stay on the device, where the kernels skip
// what is out of range (ops.h).
#include "ops/ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "capi/capi_util.h"

using mf::Device;
using mf::DType;
using mf::Tensor;
using mf::capi::ApiError;
using mf::capi::guarded;
using mf::capi::OpCall;
using mf::capi::refuse;
using mf::capi::Want;

namespace {

int64_t rows(const Tensor& t) { return t.ndim() == 0 ? 1 : t.numel() / std::max<int64_t>(t.dim(-1), 1); }

// A workspace-size query's device (device_type MF_CPU or MF_CUDA, refused otherwise, and CUDA only
// where a device is there) with its bytes out-pointer checked.
Device sizing_device(const char* op, int32_t device_type, const size_t* bytes) {
    if (device_type != MF_CPU && device_type != MF_CUDA) refuse(op, ": device_type = ", device_type, " is unknown");
    if (bytes == nullptr) refuse(op, ": bytes is required (got NULL)");
    if (device_type == MF_CUDA && !mf::cuda_available())
        throw ApiError(MF_ERR_UNSUPPORTED,
                       std::string(op) + ": CUDA, but no CUDA device is available (or this build has no CUDA)");
    return device_type == MF_CUDA ? Device::cuda : Device::cpu;
}
int64_t cols(const Tensor& t) { return t.ndim() == 0 ? 1 : t.dim(-1); }

// A C boolean argument: 0 or 1, anything else refused by name.
bool flag(const OpCall& call, const char* name, int32_t value) {
    if (value != 0 && value != 1) refuse(call.op(), ": ", name, " = ", value, " must be 0 or 1");
    return value == 1;
}

// offsets [E + 1] i32 of groups within M rows; on the CPU their values too.
void check_offsets(const OpCall& call, const Tensor& offsets, int64_t E, int64_t M) {
    call.numel_of(offsets, "offsets", E + 1);
    if (!mf::capi::on_cpu(offsets)) return;
    const int32_t* off = offsets.ptr<int32_t>();
    for (int64_t e = 0; e < E; ++e)
        if (off[e] < 0 || off[e + 1] < off[e] || off[e + 1] > M)
            refuse(call.op(), ": offsets[", e, ".. ", e + 1, "] = ", off[e], ", ", off[e + 1],
                   " are not non-decreasing within [0, ", M, "] (the rows of inp)");
}

// weight [E, OC, C]; returns {E, OC, C}.
std::array<int64_t, 3> expert_weight_dims(const OpCall& call, const Tensor& w, const char* name) {
    if (w.ndim() != 3) refuse(call.op(), ": ", name, " is ", mf::shape_str(w.shape()), ", expected [E, OC, C]");
    return {w.dim(0), w.dim(1), w.dim(2)};
}

// [N, K] routing tensors of logits [N, E]; returns {N, E, K}.
std::array<int64_t, 3> routing_dims(const OpCall& call, const Tensor& logits, const Tensor& topk) {
    if (logits.ndim() != 2 || topk.ndim() != 2)
        refuse(call.op(), ": logits ", mf::shape_str(logits.shape()), " and topk ", mf::shape_str(topk.shape()),
               " must be [N, E] and [N, K]");
    const int64_t N = logits.dim(0), E = logits.dim(1), K = topk.dim(1);
    if (E < 1 || K < 1 || K > E) refuse(call.op(), ": E = ", E, ", K = ", K, " (need 1 <= K <= E)");
    call.rows_of(topk, "topk", N, K);
    return {N, E, K};
}

}  // namespace

extern "C" {

// --- grouped GEMM ----------------------------------------------------------------------------------

mf_status mf_grouped_gemm_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* inp,
                                  const mf_tensor* weight, const mf_tensor* offsets) {
    return guarded([&] {
        OpCall call("mf_grouped_gemm_forward", ctx);
        const Tensor o = call.tensor(out, "out", Want::act), x = call.tensor(inp, "inp", Want::act);
        const Tensor w = call.tensor(weight, "weight", Want::act), off = call.tensor(offsets, "offsets", Want::i32);
        const auto [E, OC, C] = expert_weight_dims(call, w, "weight");
        const int64_t M = rows(x);
        call.rows_of(x, "inp", M, C);
        call.rows_of(o, "out", M, OC);
        check_offsets(call, off, E, M);
        call.run([&] { mf::ops::grouped_matmul_forward(o, x, w, off); });
    });
}

mf_status mf_grouped_gemm_input_grad(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dout,
                                     const mf_tensor* weight, const mf_tensor* offsets, int accumulate) {
    return guarded([&] {
        OpCall call("mf_grouped_gemm_input_grad", ctx);
        const Tensor dx = call.tensor(dinp, "dinp", Want::act), dy = call.tensor(dout, "dout", Want::act);
        const Tensor w = call.tensor(weight, "weight", Want::act), off = call.tensor(offsets, "offsets", Want::i32);
        const auto [E, OC, C] = expert_weight_dims(call, w, "weight");
        const int64_t M = rows(dx);
        call.rows_of(dx, "dinp", M, C);
        call.rows_of(dy, "dout", M, OC);
        check_offsets(call, off, E, M);
        // The input gradient needs no input: dinp stands in for inp's shape.
        call.run([&] { mf::ops::grouped_matmul_backward(dx, Tensor(), dy, dx, w, off, {}, accumulate != 0, true); });
    });
}

mf_status mf_grouped_gemm_weight_grad(const mf_context* ctx, const mf_tensor* dweight, const mf_tensor* dout,
                                      const mf_tensor* inp, const mf_tensor* offsets, int accumulate) {
    return guarded([&] {
        OpCall call("mf_grouped_gemm_weight_grad", ctx);
        const Tensor dw = call.tensor(dweight, "dweight", Want::param), dy = call.tensor(dout, "dout", Want::act);
        const Tensor x = call.tensor(inp, "inp", Want::act), off = call.tensor(offsets, "offsets", Want::i32);
        const auto [E, OC, C] = expert_weight_dims(call, dw, "dweight");
        const int64_t M = rows(x);
        call.rows_of(x, "inp", M, C);
        call.rows_of(dy, "dout", M, OC);
        check_offsets(call, off, E, M);
        const Tensor tables[1] = {off};
        call.run([&] { mf::ops::grouped_matmul_backward_weight(dw, dy, x, tables, {}, accumulate != 0); });
    });
}

mf_status mf_grouped_gemm_swiglu_forward(const mf_context* ctx, const mf_tensor* h, const mf_tensor* a,
                                         const mf_tensor* inp, const mf_tensor* weight, const mf_tensor* offsets) {
    return guarded([&] {
        OpCall call("mf_grouped_gemm_swiglu_forward", ctx);
        const Tensor th = call.tensor(h, "h", Want::act), ta = call.tensor(a, "a", Want::act);
        const Tensor x = call.tensor(inp, "inp", Want::act), w = call.tensor(weight, "weight", Want::act);
        const Tensor off = call.tensor(offsets, "offsets", Want::i32);
        const auto [E, two_i, C] = expert_weight_dims(call, w, "weight");
        if (two_i % 2 != 0) refuse(call.op(), ": weight ", mf::shape_str(w.shape()), " must be [E, 2I, C]");
        const int64_t M = rows(x);
        call.rows_of(x, "inp", M, C);
        call.rows_of(th, "h", M, two_i);
        call.rows_of(ta, "a", M, two_i / 2);
        check_offsets(call, off, E, M);
        call.run([&] { mf::ops::grouped_matmul_swiglu_forward(th, ta, x, w, off); });
    });
}

mf_status mf_grouped_gemm_swiglu_backward(const mf_context* ctx, const mf_tensor* dh, const mf_tensor* da,
                                          const mf_tensor* dout, const mf_tensor* weight, const mf_tensor* h,
                                          const mf_tensor* offsets) {
    return guarded([&] {
        OpCall call("mf_grouped_gemm_swiglu_backward", ctx);
        const Tensor tdh = call.tensor(dh, "dh", Want::act), tda = call.tensor(da, "da", Want::act);
        const Tensor dy = call.tensor(dout, "dout", Want::act), w = call.tensor(weight, "weight", Want::act);
        const Tensor th = call.tensor(h, "h", Want::act), off = call.tensor(offsets, "offsets", Want::i32);
        const auto [E, OC, I] = expert_weight_dims(call, w, "weight");
        const int64_t M = rows(dy);
        call.rows_of(dy, "dout", M, OC);
        call.rows_of(tda, "da", M, I);
        call.rows_of(th, "h", M, 2 * I);
        call.rows_of(tdh, "dh", M, 2 * I);
        check_offsets(call, off, E, M);
        call.run([&] { mf::ops::grouped_matmul_swiglu_backward(tdh, tda, dy, w, th, off); });
    });
}

// --- routers ---------------------------------------------------------------------------------------

mf_status mf_router_softmax_topk_forward(const mf_context* ctx, const mf_tensor* probs, const mf_tensor* topk_idx,
                                         const mf_tensor* topk_weight, const mf_tensor* logits, int norm_topk_prob) {
    return guarded([&] {
        OpCall call("mf_router_softmax_topk_forward", ctx);
        const Tensor p = call.tensor(probs, "probs", Want::f32), idx = call.tensor(topk_idx, "topk_idx", Want::i32);
        const Tensor w = call.tensor(topk_weight, "topk_weight", Want::f32);
        const Tensor l = call.tensor(logits, "logits", Want::f32);
        const auto [N, E, K] = routing_dims(call, l, idx);
        call.rows_of(p, "probs", N, E);
        call.rows_of(w, "topk_weight", N, K);
        call.run([&] { mf::ops::router_forward(p, idx, w, l, norm_topk_prob != 0); });
    });
}

mf_status mf_router_softmax_topk_backward(const mf_context* ctx, const mf_tensor* dlogits,
                                          const mf_tensor* dtopk_weight, const mf_tensor* dprobs,
                                          const mf_tensor* probs, const mf_tensor* topk_idx, int norm_topk_prob) {
    return guarded([&] {
        OpCall call("mf_router_softmax_topk_backward", ctx);
        const Tensor dl = call.tensor(dlogits, "dlogits", Want::f32);
        const Tensor dw = call.tensor(dtopk_weight, "dtopk_weight", Want::f32);
        const Tensor dp = call.tensor(dprobs, "dprobs", Want::f32, true);
        const Tensor p = call.tensor(probs, "probs", Want::f32), idx = call.tensor(topk_idx, "topk_idx", Want::i32);
        const auto [N, E, K] = routing_dims(call, p, idx);
        call.rows_of(dl, "dlogits", N, E);
        call.rows_of(dw, "dtopk_weight", N, K);
        if (dp.data() != nullptr) call.rows_of(dp, "dprobs", N, E);
        call.run([&] { mf::ops::router_backward(dl, dw, dp, p, idx, norm_topk_prob != 0); });
    });
}

mf_status mf_router_sigmoid_forward(const mf_context* ctx, const mf_tensor* scores, const mf_tensor* topk_idx,
                                    const mf_tensor* topk_weight, const mf_tensor* logits,
                                    const mf_tensor* correction_bias, int64_t n_group, int64_t topk_group,
                                    int norm_topk_prob, float routed_scaling_factor, float masked_score) {
    return guarded([&] {
        OpCall call("mf_router_sigmoid_forward", ctx);
        const Tensor s = call.tensor(scores, "scores", Want::f32), idx = call.tensor(topk_idx, "topk_idx", Want::i32);
        const Tensor w = call.tensor(topk_weight, "topk_weight", Want::f32);
        const Tensor l = call.tensor(logits, "logits", Want::f32);
        const Tensor bias = call.tensor(correction_bias, "correction_bias", Want::param, true);
        routing_dims(call, l, idx);  // ops checks the rest, naming each tensor
        call.run([&] {
            mf::ops::router_sigmoid_forward(s, idx, w, l, bias, n_group, topk_group, norm_topk_prob != 0,
                                            routed_scaling_factor, masked_score);
        });
    });
}

mf_status mf_router_sigmoid_backward(const mf_context* ctx, const mf_tensor* dlogits, const mf_tensor* dtopk_weight,
                                     const mf_tensor* scores, const mf_tensor* topk_idx, int norm_topk_prob,
                                     float routed_scaling_factor) {
    return guarded([&] {
        OpCall call("mf_router_sigmoid_backward", ctx);
        const Tensor dl = call.tensor(dlogits, "dlogits", Want::f32);
        const Tensor dw = call.tensor(dtopk_weight, "dtopk_weight", Want::f32);
        const Tensor s = call.tensor(scores, "scores", Want::f32), idx = call.tensor(topk_idx, "topk_idx", Want::i32);
        call.run([&] { mf::ops::router_sigmoid_backward(dl, dw, s, idx, norm_topk_prob != 0, routed_scaling_factor); });
    });
}

// --- permute / unpermute ---------------------------------------------------------------------------

mf_status mf_moe_aux_stats(const mf_context* ctx, const mf_tensor* counts, const mf_tensor* prob_sums,
                           const mf_tensor* topk_idx, const mf_tensor* probs, const mf_tensor* mask) {
    return guarded([&] {
        OpCall call("mf_moe_aux_stats", ctx);
        const Tensor c = call.tensor(counts, "counts", Want::f32), ps = call.tensor(prob_sums, "prob_sums", Want::f32);
        const Tensor idx = call.tensor(topk_idx, "topk_idx", Want::i32), p = call.tensor(probs, "probs", Want::f32);
        const Tensor m = call.tensor(mask, "mask", Want::f32);
        if (p.ndim() != 2 || p.dim(1) < 1)
            refuse(call.op(), ": probs is ", mf::shape_str(p.shape()), ", expected [N, E]");
        const int64_t N = p.dim(0), E = p.dim(1);
        if (idx.ndim() != 2 || idx.dim(0) != N || idx.dim(1) < 1)
            refuse(call.op(), ": topk_idx is ", mf::shape_str(idx.shape()), ", expected [", N, ", K]");
        call.numel_of(c, "counts", E);
        call.numel_of(ps, "prob_sums", E);
        call.numel_of(m, "mask", N);
        call.run([&] { mf::ops::moe_aux_stats(c, ps, idx, p, m); });
    });
}

mf_status mf_moe_aux_dprobs(const mf_context* ctx, const mf_tensor* dprobs, const mf_tensor* counts,
                            const mf_tensor* mask, float scale) {
    return guarded([&] {
        OpCall call("mf_moe_aux_dprobs", ctx);
        const Tensor dp = call.tensor(dprobs, "dprobs", Want::f32), c = call.tensor(counts, "counts", Want::f32);
        const Tensor m = call.tensor(mask, "mask", Want::f32);
        if (dp.ndim() != 2 || dp.dim(1) < 1)
            refuse(call.op(), ": dprobs is ", mf::shape_str(dp.shape()), ", expected [N, E]");
        call.numel_of(c, "counts", dp.dim(1));
        call.numel_of(m, "mask", dp.dim(0));
        if (!std::isfinite(scale)) refuse(call.op(), ": scale = ", scale, " is not finite");
        call.run([&] { mf::ops::moe_aux_dprobs(dp, c, m, scale); });
    });
}

mf_status mf_group_offsets(const mf_context* ctx, const mf_tensor* offsets, const mf_tensor* group_sizes,
                           int64_t num_rows) {
    return guarded([&] {
        OpCall call("mf_group_offsets", ctx);
        const Tensor off = call.tensor(offsets, "offsets", Want::i32);
        const Tensor sizes = call.tensor(group_sizes, "group_sizes", Want::i32);
        if (num_rows < 0 || num_rows > std::numeric_limits<int32_t>::max())
            refuse(call.op(), ": num_rows = ", num_rows, " (expected 0 .. ", std::numeric_limits<int32_t>::max(), ")");
        call.numel_of(off, "offsets", sizes.numel() + 1);
        call.run([&] { mf::ops::group_offsets(off, sizes, num_rows); });
    });
}

mf_status mf_zero_rows_past_groups(const mf_context* ctx, const mf_tensor* x, const mf_tensor* offsets) {
    return guarded([&] {
        OpCall call("mf_zero_rows_past_groups", ctx);
        const Tensor tx = call.tensor(x, "x", Want::act), off = call.tensor(offsets, "offsets", Want::i32);
        if (off.numel() < 1) refuse(call.op(), ": offsets is empty (expected [E + 1])");
        if (tx.ndim() < 1) refuse(call.op(), ": x is a scalar (expected [M, C])");
        call.run([&] { mf::ops::zero_rows_past_groups(tx, off); });
    });
}

mf_status mf_moe_permute_indices(const mf_context* ctx, const mf_tensor* expert_offsets, const mf_tensor* sorted_pair,
                                 const mf_tensor* pair_row, const mf_tensor* topk_idx, int64_t num_experts) {
    return guarded([&] {
        OpCall call("mf_moe_permute_indices", ctx);
        const Tensor off = call.tensor(expert_offsets, "expert_offsets", Want::i32);
        const Tensor sp = call.tensor(sorted_pair, "sorted_pair", Want::i32);
        const Tensor pr = call.tensor(pair_row, "pair_row", Want::i32);
        const Tensor idx = call.tensor(topk_idx, "topk_idx", Want::i32);
        call.positive("num_experts", num_experts);
        if (idx.ndim() != 2 || idx.dim(1) < 1)
            refuse(call.op(), ": topk_idx is ", mf::shape_str(idx.shape()), ", expected [N, K] with K >= 1");
        call.numel_of(off, "expert_offsets", num_experts + 1);
        call.numel_of(sp, "sorted_pair", idx.numel());
        call.numel_of(pr, "pair_row", idx.numel());
        call.run([&] { mf::ops::moe_permute_indices(off, sp, pr, idx, num_experts); });
    });
}

mf_status mf_moe_gather(const mf_context* ctx, const mf_tensor* x_perm, const mf_tensor* x,
                        const mf_tensor* sorted_pair, int64_t top_k) {
    return guarded([&] {
        OpCall call("mf_moe_gather", ctx);
        const Tensor xp = call.tensor(x_perm, "x_perm", Want::act), xt = call.tensor(x, "x", Want::act);
        const Tensor sp = call.tensor(sorted_pair, "sorted_pair", Want::i32);
        call.positive("top_k", top_k);
        const int64_t N = rows(xt), H = cols(xt);
        call.rows_of(xp, "x_perm", N * top_k, H);
        call.numel_of(sp, "sorted_pair", N * top_k);
        call.run([&] { mf::ops::moe_gather_forward(xp, xt, sp, top_k); });
    });
}

mf_status mf_moe_gather_backward(const mf_context* ctx, const mf_tensor* dx, const mf_tensor* dx_perm,
                                 const mf_tensor* pair_row, int64_t top_k) {
    return guarded([&] {
        OpCall call("mf_moe_gather_backward", ctx);
        const Tensor d = call.tensor(dx, "dx", Want::act), dp = call.tensor(dx_perm, "dx_perm", Want::act);
        const Tensor pr = call.tensor(pair_row, "pair_row", Want::i32);
        call.positive("top_k", top_k);
        const int64_t N = rows(d), H = cols(d);
        call.rows_of(dp, "dx_perm", N * top_k, H);
        call.numel_of(pr, "pair_row", N * top_k);
        call.run([&] { mf::ops::moe_gather_backward(d, dp, pr, top_k); });
    });
}

mf_status mf_moe_unpermute(const mf_context* ctx, const mf_tensor* out, const mf_tensor* y_perm,
                           const mf_tensor* topk_weight, const mf_tensor* pair_row) {
    return guarded([&] {
        OpCall call("mf_moe_unpermute", ctx);
        const Tensor o = call.tensor(out, "out", Want::act), yp = call.tensor(y_perm, "y_perm", Want::act);
        const Tensor w = call.tensor(topk_weight, "topk_weight", Want::f32);
        const Tensor pr = call.tensor(pair_row, "pair_row", Want::i32);
        const int64_t N = rows(o), H = cols(o), K = cols(w);
        call.positive("K (topk_weight's last dimension)", K);
        call.rows_of(w, "topk_weight", N, K);
        call.rows_of(yp, "y_perm", N * K, H);
        call.numel_of(pr, "pair_row", N * K);
        call.run([&] { mf::ops::moe_unpermute_forward(o, yp, w, pr); });
    });
}

mf_status mf_moe_unpermute_backward(const mf_context* ctx, const mf_tensor* dy_perm, const mf_tensor* dtopk_weight,
                                    const mf_tensor* dout, const mf_tensor* y_perm, const mf_tensor* topk_weight,
                                    const mf_tensor* pair_row) {
    return guarded([&] {
        OpCall call("mf_moe_unpermute_backward", ctx);
        const Tensor dyp = call.tensor(dy_perm, "dy_perm", Want::act);
        const Tensor dw = call.tensor(dtopk_weight, "dtopk_weight", Want::f32);
        const Tensor dy = call.tensor(dout, "dout", Want::act), yp = call.tensor(y_perm, "y_perm", Want::act);
        const Tensor w = call.tensor(topk_weight, "topk_weight", Want::f32);
        const Tensor pr = call.tensor(pair_row, "pair_row", Want::i32);
        const int64_t N = rows(dy), H = cols(dy), K = cols(w);
        call.positive("K (topk_weight's last dimension)", K);
        call.rows_of(w, "topk_weight", N, K);
        call.rows_of(dw, "dtopk_weight", N, K);
        call.rows_of(yp, "y_perm", N * K, H);
        call.rows_of(dyp, "dy_perm", N * K, H);
        call.numel_of(pr, "pair_row", N * K);
        call.run([&] { mf::ops::moe_unpermute_backward(dyp, dw, dy, yp, w, pr); });
    });
}

// --- expert activations ----------------------------------------------------------------------------

mf_status mf_swiglu_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* inp) {
    return guarded([&] {
        OpCall call("mf_swiglu_forward", ctx);
        const Tensor o = call.tensor(out, "out", Want::act), x = call.tensor(inp, "inp", Want::act);
        call.rows_of(x, "inp", rows(o), 2 * cols(o));
        call.run([&] { mf::ops::swiglu_forward(o, x); });
    });
}

mf_status mf_swiglu_backward(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dout,
                             const mf_tensor* inp) {
    return guarded([&] {
        OpCall call("mf_swiglu_backward", ctx);
        const Tensor dx = call.tensor(dinp, "dinp", Want::act), dy = call.tensor(dout, "dout", Want::act);
        const Tensor x = call.tensor(inp, "inp", Want::act);
        call.rows_of(x, "inp", rows(dy), 2 * cols(dy));
        call.rows_of(dx, "dinp", rows(dy), 2 * cols(dy));
        call.run([&] { mf::ops::swiglu_backward(dx, dy, x); });
    });
}

mf_status mf_relu2_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* inp) {
    return guarded([&] {
        OpCall call("mf_relu2_forward", ctx);
        const Tensor o = call.tensor(out, "out", Want::act), x = call.tensor(inp, "inp", Want::act);
        call.rows_of(x, "inp", rows(o), cols(o));
        call.run([&] { mf::ops::relu2_forward(o, x); });
    });
}

mf_status mf_relu2_backward(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dout, const mf_tensor* inp) {
    return guarded([&] {
        OpCall call("mf_relu2_backward", ctx);
        const Tensor dx = call.tensor(dinp, "dinp", Want::act), dy = call.tensor(dout, "dout", Want::act);
        const Tensor x = call.tensor(inp, "inp", Want::act);
        call.rows_of(x, "inp", rows(dy), cols(dy));
        call.rows_of(dx, "dinp", rows(dy), cols(dy));
        call.run([&] { mf::ops::relu2_backward(dx, dy, x); });
    });
}

mf_status mf_clamped_swiglu_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* inp, float alpha,
                                    float limit) {
    return guarded([&] {
        OpCall call("mf_clamped_swiglu_forward", ctx);
        const Tensor o = call.tensor(out, "out", Want::act), x = call.tensor(inp, "inp", Want::act);
        call.run([&] { mf::ops::clamped_swiglu_forward(o, x, alpha, limit); });
    });
}

mf_status mf_clamped_swiglu_backward(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dout,
                                     const mf_tensor* inp, float alpha, float limit) {
    return guarded([&] {
        OpCall call("mf_clamped_swiglu_backward", ctx);
        const Tensor dx = call.tensor(dinp, "dinp", Want::act), dy = call.tensor(dout, "dout", Want::act);
        const Tensor x = call.tensor(inp, "inp", Want::act);
        call.run([&] { mf::ops::clamped_swiglu_backward(dx, dy, x, alpha, limit); });
    });
}

// --- attention -------------------------------------------------------------------------------------

namespace {
// q [B·T·Hq·D], k, v [B·T·Hkv·D], lse [B·Hq·T] f32, doc_ids [B·T] (optional); returns D.
int64_t attention_head_dim(const OpCall& call, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                           const Tensor& doc_ids, int64_t B, int64_t T, int64_t Hq, int64_t Hkv) {
    call.positive("batch", B);
    call.positive("seq_len", T);
    call.positive("num_heads", Hq);
    call.positive("num_kv_heads", Hkv);
    if (Hq % Hkv != 0) refuse(call.op(), ": num_heads = ", Hq, " is not a multiple of num_kv_heads = ", Hkv);
    const int64_t D = q.numel() / (B * T * Hq);
    if (D < 1 || q.numel() != B * T * Hq * D)
        refuse(call.op(), ": q ", mf::shape_str(q.shape()), " does not hold B·T·num_heads·D elements (B = ", B,
               ", T = ", T, ", num_heads = ", Hq, ")");
    call.numel_of(k, "k", B * T * Hkv * D);
    call.numel_of(v, "v", B * T * Hkv * D);
    call.numel_of(lse, "lse", B * Hq * T);
    if (doc_ids.data() != nullptr) call.numel_of(doc_ids, "doc_ids", B * T);
    return D;
}
}  // namespace

mf_status mf_attention_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* lse, const mf_tensor* q,
                               const mf_tensor* k, const mf_tensor* v, const mf_tensor* doc_ids, int64_t batch,
                               int64_t seq_len, int64_t num_heads, int64_t num_kv_heads) {
    return guarded([&] {
        OpCall call("mf_attention_forward", ctx);
        const Tensor o = call.tensor(out, "out", Want::act), l = call.tensor(lse, "lse", Want::f32);
        const Tensor tq = call.tensor(q, "q", Want::act), tk = call.tensor(k, "k", Want::act);
        const Tensor tv = call.tensor(v, "v", Want::act), docs = call.tensor(doc_ids, "doc_ids", Want::i32, true);
        attention_head_dim(call, tq, tk, tv, l, docs, batch, seq_len, num_heads, num_kv_heads);
        call.numel_of(o, "out", tq.numel());
        call.run([&] { mf::ops::attention_forward(o, l, tq, tk, tv, docs, batch, seq_len, num_heads, num_kv_heads); });
    });
}

mf_status mf_attention_backward(const mf_context* ctx, const mf_tensor* dq, const mf_tensor* dk, const mf_tensor* dv,
                                const mf_tensor* dout, const mf_tensor* q, const mf_tensor* k, const mf_tensor* v,
                                const mf_tensor* out, const mf_tensor* lse, const mf_tensor* doc_ids, int64_t batch,
                                int64_t seq_len, int64_t num_heads, int64_t num_kv_heads) {
    return guarded([&] {
        OpCall call("mf_attention_backward", ctx);
        const Tensor tdq = call.tensor(dq, "dq", Want::act), tdk = call.tensor(dk, "dk", Want::act);
        const Tensor tdv = call.tensor(dv, "dv", Want::act), tdo = call.tensor(dout, "dout", Want::act);
        const Tensor tq = call.tensor(q, "q", Want::act), tk = call.tensor(k, "k", Want::act);
        const Tensor tv = call.tensor(v, "v", Want::act), o = call.tensor(out, "out", Want::act);
        const Tensor l = call.tensor(lse, "lse", Want::f32);
        const Tensor docs = call.tensor(doc_ids, "doc_ids", Want::i32, true);
        attention_head_dim(call, tq, tk, tv, l, docs, batch, seq_len, num_heads, num_kv_heads);
        call.numel_of(o, "out", tq.numel());
        call.numel_of(tdo, "dout", tq.numel());
        call.numel_of(tdq, "dq", tq.numel());
        call.numel_of(tdk, "dk", tk.numel());
        call.numel_of(tdv, "dv", tv.numel());
        call.run([&] {
            mf::ops::attention_backward(tdq, tdk, tdv, tdo, tq, tk, tv, o, l, docs, batch, seq_len, num_heads,
                                        num_kv_heads);
        });
    });
}

// --- token embedding -------------------------------------------------------------------------------

namespace {

// ids [N] i32 and a table [V, C]; on the CPU every id's value too.
void check_ids(const OpCall& call, const Tensor& ids, int64_t V) {
    if (!mf::capi::on_cpu(ids)) return;
    const int32_t* p = ids.ptr<int32_t>();
    for (int64_t n = 0; n < ids.numel(); ++n)
        if (p[n] < 0 || p[n] >= V) refuse(call.op(), ": ids[", n, "] = ", p[n], " is outside the table's [0, ", V, ")");
}

// The table's [V, C] (at least one row and one column).
std::pair<int64_t, int64_t> table_dims(const OpCall& call, const Tensor& table, const char* name) {
    if (table.ndim() != 2 || table.dim(0) < 1 || table.dim(1) < 1)
        refuse(call.op(), ": ", name, " is ", mf::shape_str(table.shape()), ", expected [V, C] with V, C >= 1");
    return {table.dim(0), table.dim(1)};
}

}  // namespace

mf_status mf_embedding_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* ids,
                               const mf_tensor* wte) {
    return guarded([&] {
        OpCall call("mf_embedding_forward", ctx);
        const Tensor o = call.tensor(out, "out", Want::act), i = call.tensor(ids, "ids", Want::i32);
        const Tensor w = call.tensor(wte, "wte", Want::act);
        const auto [V, C] = table_dims(call, w, "wte");
        call.rows_of(o, "out", i.numel(), C);
        check_ids(call, i, V);
        call.run([&] { mf::ops::embedding_forward(o, i, w); });
    });
}

mf_status mf_embedding_backward(const mf_context* ctx, const mf_tensor* dwte, const mf_tensor* dout,
                                const mf_tensor* ids) {
    return guarded([&] {
        OpCall call("mf_embedding_backward", ctx);
        const Tensor dw = call.tensor(dwte, "dwte", Want::param), i = call.tensor(ids, "ids", Want::i32);
        const Tensor dy = call.tensor(dout, "dout", Want::act);
        const auto [V, C] = table_dims(call, dw, "dwte");
        call.rows_of(dy, "dout", i.numel(), C);
        check_ids(call, i, V);
        call.run([&] { mf::ops::embedding_backward(dw, dy, i); });
    });
}

mf_status mf_embedding_backward_workspace_bytes(int64_t num_rows, int64_t vocab, int32_t device_type, size_t* bytes) {
    return guarded([&] {
        const char* op = "mf_embedding_backward_workspace_bytes";
        if (num_rows < 0) refuse(op, ": num_rows = ", num_rows, " is negative");
        if (vocab < 1) refuse(op, ": vocab = ", vocab, " must be at least 1");
        *bytes = mf::ops::embedding_backward_scratch_bytes(num_rows, vocab, sizing_device(op, device_type, bytes));
    });
}

// --- RMSNorm ---------------------------------------------------------------------------------------

mf_status mf_rmsnorm_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* rstd, const mf_tensor* inp,
                             const mf_tensor* weight, float eps) {
    return guarded([&] {
        OpCall call("mf_rmsnorm_forward", ctx);
        const Tensor o = call.tensor(out, "out", Want::act), r = call.tensor(rstd, "rstd", Want::f32);
        const Tensor x = call.tensor(inp, "inp", Want::act), w = call.tensor(weight, "weight", Want::param);
        const int64_t C = w.numel();
        call.positive("weight's size C", C);
        if (!(std::isfinite(eps) && eps >= 0.0f)) refuse(call.op(), ": eps = ", eps, " must be finite and >= 0");
        call.rows_of(x, "inp", rows(x), C);
        call.rows_of(o, "out", rows(x), C);
        call.numel_of(r, "rstd", rows(x));
        call.run([&] { mf::ops::rmsnorm_forward(o, r, x, w, eps); });
    });
}

mf_status mf_rmsnorm_backward(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dweight,
                              const mf_tensor* dout, const mf_tensor* inp, const mf_tensor* weight,
                              const mf_tensor* rstd, int32_t accumulate_dinp) {
    return guarded([&] {
        OpCall call("mf_rmsnorm_backward", ctx);
        const bool accumulate = flag(call, "accumulate_dinp", accumulate_dinp);
        const Tensor dx = call.tensor(dinp, "dinp", Want::act), dw = call.tensor(dweight, "dweight", Want::param);
        const Tensor dy = call.tensor(dout, "dout", Want::act), x = call.tensor(inp, "inp", Want::act);
        const Tensor w = call.tensor(weight, "weight", Want::param), r = call.tensor(rstd, "rstd", Want::f32);
        const int64_t C = w.numel();
        call.positive("weight's size C", C);
        call.rows_of(x, "inp", rows(x), C);
        call.rows_of(dy, "dout", rows(x), C);
        call.rows_of(dx, "dinp", rows(x), C);
        call.numel_of(dw, "dweight", C);
        call.numel_of(r, "rstd", rows(x));
        call.run([&] { mf::ops::rmsnorm_backward(dx, dw, dy, x, w, r, accumulate); });
    });
}

// --- per-head RMSNorm + rotary embedding ---------------------------------------------------------------

namespace {
// The shared checks of the q/k-norm + rope pair: q-side tensors [N, Hq, D], k-side [N, Hkv, D],
// weights [D], tables [N, D]; returns (Hq, Hkv).
std::pair<int64_t, int64_t> qknorm_rope_heads(const OpCall& call, const Tensor& q, const Tensor& k,
                                              const Tensor& q_weight, const Tensor& k_weight, const Tensor& cos,
                                              const Tensor& sin) {
    if (q.ndim() != 3 || k.ndim() != 3)
        refuse(call.op(), ": q ", mf::shape_str(q.shape()), " and k ", mf::shape_str(k.shape()),
               " must be [N, heads, D]");
    const int64_t N = q.dim(0), D = q.dim(2);
    if (D < 2 || D % 2 != 0) refuse(call.op(), ": head dim D = ", D, " must be even and >= 2");
    if (k.dim(0) != N || k.dim(2) != D)
        refuse(call.op(), ": k ", mf::shape_str(k.shape()), " must be [N = ", N, ", Hkv, D = ", D, "]");
    call.numel_of(q_weight, "q_weight", D);
    call.numel_of(k_weight, "k_weight", D);
    call.rows_of(cos, "cos", N, D);
    call.rows_of(sin, "sin", N, D);
    return {q.dim(1), k.dim(1)};
}
}  // namespace

mf_status mf_qknorm_rope_forward(const mf_context* ctx, const mf_tensor* q_out, const mf_tensor* k_out,
                                 const mf_tensor* q_rstd, const mf_tensor* k_rstd, const mf_tensor* q,
                                 const mf_tensor* k, const mf_tensor* q_weight, const mf_tensor* k_weight,
                                 const mf_tensor* cos, const mf_tensor* sin, float eps) {
    return guarded([&] {
        OpCall call("mf_qknorm_rope_forward", ctx);
        const Tensor qo = call.tensor(q_out, "q_out", Want::act), ko = call.tensor(k_out, "k_out", Want::act);
        const Tensor qr = call.tensor(q_rstd, "q_rstd", Want::f32), kr = call.tensor(k_rstd, "k_rstd", Want::f32);
        const Tensor tq = call.tensor(q, "q", Want::act), tk = call.tensor(k, "k", Want::act);
        const Tensor qw = call.tensor(q_weight, "q_weight", Want::act);
        const Tensor kw = call.tensor(k_weight, "k_weight", Want::act);
        const Tensor c = call.tensor(cos, "cos", Want::act), sn = call.tensor(sin, "sin", Want::act);
        if (!(std::isfinite(eps) && eps >= 0.0f)) refuse(call.op(), ": eps = ", eps, " must be finite and >= 0");
        const auto [Hq, Hkv] = qknorm_rope_heads(call, tq, tk, qw, kw, c, sn);
        const int64_t N = tq.dim(0), D = tq.dim(2);
        call.rows_of(qo, "q_out", N * Hq, D);
        call.rows_of(ko, "k_out", N * Hkv, D);
        call.numel_of(qr, "q_rstd", N * Hq);
        call.numel_of(kr, "k_rstd", N * Hkv);
        call.run([&] { mf::ops::qknorm_rope_table_forward(qo, ko, qr, kr, tq, tk, qw, kw, c, sn, Hq, Hkv, eps); });
    });
}

mf_status mf_qknorm_rope_backward(const mf_context* ctx, const mf_tensor* dq, const mf_tensor* dk,
                                  const mf_tensor* dq_weight, const mf_tensor* dk_weight, const mf_tensor* dq_out,
                                  const mf_tensor* dk_out, const mf_tensor* q, const mf_tensor* k,
                                  const mf_tensor* q_weight, const mf_tensor* k_weight, const mf_tensor* q_rstd,
                                  const mf_tensor* k_rstd, const mf_tensor* cos, const mf_tensor* sin) {
    return guarded([&] {
        OpCall call("mf_qknorm_rope_backward", ctx);
        const Tensor tdq = call.tensor(dq, "dq", Want::act), tdk = call.tensor(dk, "dk", Want::act);
        const Tensor dqw = call.tensor(dq_weight, "dq_weight", Want::param);
        const Tensor dkw = call.tensor(dk_weight, "dk_weight", Want::param);
        const Tensor gq = call.tensor(dq_out, "dq_out", Want::act), gk = call.tensor(dk_out, "dk_out", Want::act);
        const Tensor tq = call.tensor(q, "q", Want::act), tk = call.tensor(k, "k", Want::act);
        const Tensor qw = call.tensor(q_weight, "q_weight", Want::act);
        const Tensor kw = call.tensor(k_weight, "k_weight", Want::act);
        const Tensor qr = call.tensor(q_rstd, "q_rstd", Want::f32), kr = call.tensor(k_rstd, "k_rstd", Want::f32);
        const Tensor c = call.tensor(cos, "cos", Want::act), sn = call.tensor(sin, "sin", Want::act);
        const auto [Hq, Hkv] = qknorm_rope_heads(call, tq, tk, qw, kw, c, sn);
        const int64_t N = tq.dim(0), D = tq.dim(2);
        if (dqw.dtype() != dkw.dtype()) refuse(call.op(), ": dq_weight and dk_weight differ in dtype");
        for (const auto& [t, name, heads] : {std::tuple{&tdq, "dq", Hq}, std::tuple{&tdk, "dk", Hkv},
                                             std::tuple{&gq, "dq_out", Hq}, std::tuple{&gk, "dk_out", Hkv}}) {
            call.rows_of(*t, name, N * heads, D);
        }
        call.numel_of(dqw, "dq_weight", D);
        call.numel_of(dkw, "dk_weight", D);
        call.numel_of(qr, "q_rstd", N * Hq);
        call.numel_of(kr, "k_rstd", N * Hkv);
        call.run([&] {
            mf::ops::qknorm_rope_table_backward(tdq, tdk, dqw, dkw, gq, gk, tq, tk, qw, kw, qr, kr, c, sn, Hq, Hkv);
        });
    });
}

// --- LM head + cross-entropy -----------------------------------------------------------------------

mf_status mf_lm_head_cross_entropy(const mf_context* ctx, const mf_tensor* losses, const mf_tensor* dh,
                                   const mf_tensor* dw, const mf_tensor* h, const mf_tensor* w,
                                   const mf_tensor* targets, float grad_scale, int32_t logits_dtype, int32_t accumulate,
                                   const mf_tensor* grad_scale_by) {
    return guarded([&] {
        OpCall call("mf_lm_head_cross_entropy", ctx);
        const Tensor l = call.tensor(losses, "losses", Want::f32);
        const Tensor tdh = call.tensor(dh, "dh", Want::act, true), tdw = call.tensor(dw, "dw", Want::param, true);
        const Tensor th = call.tensor(h, "h", Want::act), tw = call.tensor(w, "w", Want::act);
        const Tensor t = call.tensor(targets, "targets", Want::i32);
        const Tensor by = call.tensor(grad_scale_by, "grad_scale_by", Want::f32, true);
        if (by.data() != nullptr) call.numel_of(by, "grad_scale_by", 1);
        if (logits_dtype != MF_F32 && logits_dtype != MF_BF16)
            refuse(call.op(), ": logits_dtype ", logits_dtype, " must be MF_F32 or MF_BF16");
        if (!std::isfinite(grad_scale)) refuse(call.op(), ": grad_scale = ", grad_scale, " is not finite");
        const bool add = flag(call, "accumulate", accumulate);
        if (tw.ndim() != 2 || tw.dim(0) < 1)
            refuse(call.op(), ": w is ", mf::shape_str(tw.shape()), ", expected [V, C]");
        const int64_t V = tw.dim(0), C = tw.dim(1), N = rows(th);
        call.rows_of(th, "h", N, C);
        call.numel_of(t, "targets", N);
        call.numel_of(l, "losses", N);
        if (tdh.data() != nullptr) call.rows_of(tdh, "dh", N, C);
        if (tdw.data() != nullptr) call.rows_of(tdw, "dw", V, C);
        call.run([&] {
            mf::ops::lm_head_cross_entropy(l, tdh, tdw, th, tw, t, grad_scale,
                                           logits_dtype == MF_BF16 ? DType::bf16 : DType::f32, add, by);
        });
    });
}

mf_status mf_lm_head_cross_entropy_workspace_bytes(int64_t num_rows, int64_t vocab, int32_t logits_dtype,
                                                   int32_t device_type, size_t* bytes) {
    return guarded([&] {
        const char* op = "mf_lm_head_cross_entropy_workspace_bytes";
        if (num_rows < 0) refuse(op, ": num_rows = ", num_rows, " is negative");
        if (vocab < 1) refuse(op, ": vocab = ", vocab, " must be at least 1");
        if (logits_dtype != MF_F32 && logits_dtype != MF_BF16)
            refuse(op, ": logits_dtype ", logits_dtype, " must be MF_F32 or MF_BF16");
        const Device device = sizing_device(op, device_type, bytes);
        *bytes = mf::ops::lm_head_cross_entropy_scratch_bytes(
            num_rows, vocab, logits_dtype == MF_BF16 ? DType::bf16 : DType::f32, device);
    });
}

mf_status mf_moe_aux_stats_workspace_bytes(int64_t num_rows, int64_t num_experts, int32_t device_type, size_t* bytes) {
    return guarded([&] {
        const char* op = "mf_moe_aux_stats_workspace_bytes";
        if (num_rows < 0) refuse(op, ": num_rows = ", num_rows, " is negative");
        if (num_experts < 1) refuse(op, ": num_experts = ", num_experts, " must be at least 1");
        *bytes = mf::ops::moe_aux_stats_scratch_bytes(num_rows, num_experts, sizing_device(op, device_type, bytes));
    });
}

mf_status mf_moe_permute_indices_workspace_bytes(int64_t num_rows, int64_t top_k, int64_t num_experts,
                                                 int32_t device_type, size_t* bytes) {
    return guarded([&] {
        const char* op = "mf_moe_permute_indices_workspace_bytes";
        if (num_rows < 0) refuse(op, ": num_rows = ", num_rows, " is negative");
        if (top_k < 1 || num_experts < 1)
            refuse(op, ": top_k = ", top_k, " and num_experts = ", num_experts, " must be at least 1");
        *bytes = mf::ops::moe_permute_indices_scratch_bytes(num_rows, top_k, num_experts,
                                                            sizing_device(op, device_type, bytes));
    });
}

// --- AdamW -----------------------------------------------------------------------------------------

mf_status mf_scale_by(const mf_context* ctx, const mf_tensor* x, const mf_tensor* scale) {
    return guarded([&] {
        OpCall call("mf_scale_by", ctx);
        const Tensor tx = call.tensor(x, "x", Want::param);
        const Tensor s = call.tensor(scale, "scale", Want::f32);
        call.numel_of(s, "scale", 1);
        call.run([&] { mf::ops::scale_by(tx, s); });
    });
}

mf_status mf_adamw_update(const mf_context* ctx, const mf_tensor* param, const mf_tensor* master, const mf_tensor* m,
                          const mf_tensor* v, const mf_tensor* grad, const mf_adamw_hyper* hyper) {
    return guarded([&] {
        OpCall call("mf_adamw_update", ctx);
        const Tensor p = call.tensor(param, "param", Want::param);
        const Tensor pm = call.tensor(master, "master", Want::f32, true);
        const Tensor tm = call.tensor(m, "m", Want::param), tv = call.tensor(v, "v", Want::param);
        const Tensor g = call.tensor(grad, "grad", Want::param);
        if (hyper == nullptr) refuse(call.op(), ": hyper is required (got NULL)");
        const mf_adamw_hyper& hp = *hyper;
        for (const auto& [name, value] : {std::pair{"lr", hp.lr},
                                          {"beta1", hp.beta1},
                                          {"beta2", hp.beta2},
                                          {"eps", hp.eps},
                                          {"weight_decay", hp.weight_decay},
                                          {"grad_scale", hp.grad_scale}})
            if (!std::isfinite(value)) refuse(call.op(), ": ", name, " = ", value, " is not finite");
        if (hp.step < 1) refuse(call.op(), ": step = ", hp.step, " must be >= 1 (the first update is step 1)");
        call.numel_of(tm, "m", p.numel());
        call.numel_of(tv, "v", p.numel());
        call.numel_of(g, "grad", p.numel());
        if (pm.data() != nullptr) call.numel_of(pm, "master", p.numel());
        call.run([&] {
            mf::ops::adamw_update(p, pm, tm, tv, g,
                                  {hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.step, hp.grad_scale});
        });
    });
}

}  // extern "C"
