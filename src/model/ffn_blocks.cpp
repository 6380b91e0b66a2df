#include "model/ffn_blocks.h"

#include <cstring>

#include "core/check.h"
#include "ops/ops.h"

namespace mf::model {

// --- dense MLP ------------------------------------------------------------------------------------

void MlpActs::alloc(Arena& arena, int64_t N, int64_t I, DType act) {
    h = arena.alloc(act, {N, 2 * I});
    a = arena.alloc(act, {N, I});
}

void MlpScratch::alloc(Arena& arena, int64_t N, int64_t I, DType act) {
    dh = arena.alloc(act, {N, 2 * I});
    da = arena.alloc(act, {N, I});
}

void mlp_block_forward(const Tensor& y, MlpActs& acts, const Tensor& x, const MlpWeights& w) {
    ops::matmul_forward(acts.h, x, w.gate_up);
    ops::swiglu_forward(acts.a, acts.h);
    ops::matmul_forward(y, acts.a, w.down);
}

void mlp_block_backward(const Tensor& dx, const MlpWeights& g, MlpScratch& s, const Tensor& dy, const Tensor& x,
                        const MlpActs& acts, const MlpWeights& w) {
    ops::zero(s.da);
    ops::matmul_backward(s.da, g.down, dy, acts.a, w.down);
    ops::swiglu_backward(s.dh, s.da, acts.h);
    ops::matmul_backward(dx, g.gate_up, s.dh, x, w.gate_up);
}

// --- dropless MoE ---------------------------------------------------------------------------------

void MoeActs::alloc(Arena& arena, const MoeDims& d, int64_t N, DType act) {
    const int64_t P = N * d.top_k;
    if (d.ep != nullptr) {
        // Worst case: every rank of the group routes all its pairs to this rank's experts.
        const int64_t cap = P * d.ep_size();
        x_local = arena.alloc(act, {cap, d.hidden});
        h_local = arena.alloc(act, {cap, 2 * d.intermediate});
        a_local = arena.alloc(act, {cap, d.intermediate});
        y_local = arena.alloc(act, {cap, d.hidden});
        exchange = arena.alloc(act, {cap, d.hidden});
        local_offsets = arena.alloc(DType::i32, {d.num_experts / d.ep_size() + 1});
    }
    logits = arena.alloc(DType::f32, {N, d.num_experts});
    probs = arena.alloc(DType::f32, {N, d.num_experts});
    topk_idx = arena.alloc(DType::i32, {N, d.top_k});
    topk_weight = arena.alloc(DType::f32, {N, d.top_k});
    expert_offsets = arena.alloc(DType::i32, {d.num_experts + 1});
    sorted_pair = arena.alloc(DType::i32, {P});
    pair_row = arena.alloc(DType::i32, {P});
    x_perm = arena.alloc(act, {P, d.hidden});
    h_perm = arena.alloc(act, {P, 2 * d.intermediate});
    a_perm = arena.alloc(act, {P, d.intermediate});
    y_perm = arena.alloc(act, {P, d.hidden});
}

void MoeScratch::alloc(Arena& arena, const MoeDims& d, int64_t N, DType act) {
    const int64_t P = N * d.top_k;
    if (d.ep != nullptr) {
        const int64_t cap = P * d.ep_size();
        dy_local = arena.alloc(act, {cap, d.hidden});
        da_local = arena.alloc(act, {cap, d.intermediate});
        dh_local = arena.alloc(act, {cap, 2 * d.intermediate});
        dx_local = arena.alloc(act, {cap, d.hidden});
        exchange = arena.alloc(act, {cap, d.hidden});
    }
    dy_perm = arena.alloc(act, {P, d.hidden});
    da_perm = arena.alloc(act, {P, d.intermediate});
    dh_perm = arena.alloc(act, {P, 2 * d.intermediate});
    dx_perm = arena.alloc(act, {P, d.hidden});
    dtopk_weight = arena.alloc(DType::f32, {N, d.top_k});
    dlogits = arena.alloc(DType::f32, {N, d.num_experts});
}

// --- expert parallelism (host bookkeeping and row exchange; CPU tensors) ----------------------------

namespace {

// Rows [first, first + n) of a row-major [R, C] tensor, as an [n, C] view.
Tensor row_view(const Tensor& t, int64_t first, int64_t n) {
    const int64_t C = t.dim(-1);
    char* base = static_cast<char*>(t.data()) + static_cast<size_t>(first * C) * dtype_size(t.dtype());
    return Tensor(base, t.dtype(), {n, C}, t.device());
}

}  // namespace

EpRouting ep_plan(const MoeDims& d, const Tensor& expert_offsets) {
    parallel::Communicator& ep = *d.ep;
    const int64_t S = ep.size(), E = d.num_experts, El = E / S;
    MF_CHECK(expert_offsets.numel() == E + 1 && expert_offsets.device() == Device::cpu,
             "ep_plan: expert_offsets must be [E + 1] on the host");
    const int32_t* off = expert_offsets.ptr<int32_t>();
    EpRouting r;
    r.send_counts.resize(static_cast<size_t>(S));
    r.send_offsets.resize(static_cast<size_t>(S));
    std::vector<int64_t> cnt_send(static_cast<size_t>(E)), cnt_recv(static_cast<size_t>(E));
    std::vector<int64_t> cnt_counts(static_cast<size_t>(S), El), cnt_offsets(static_cast<size_t>(S));
    for (int64_t e = 0; e < E; ++e) cnt_send[static_cast<size_t>(e)] = off[e + 1] - off[e];
    for (int64_t p = 0; p < S; ++p) {
        r.send_offsets[static_cast<size_t>(p)] = off[p * El];
        r.send_counts[static_cast<size_t>(p)] = off[(p + 1) * El] - off[p * El];
        cnt_offsets[static_cast<size_t>(p)] = p * El;
    }
    // cnt_recv[s * El + j]: rows source s sends for local expert j.
    ep.all_to_all_v(cnt_send.data(), cnt_counts, cnt_offsets, cnt_recv.data(), cnt_counts, cnt_offsets, DType::i64);
    r.recv_counts.assign(static_cast<size_t>(S), 0);
    r.recv_offsets.assign(static_cast<size_t>(S), 0);
    for (int64_t s = 0; s < S; ++s) {
        for (int64_t j = 0; j < El; ++j) {
            const int64_t c = cnt_recv[static_cast<size_t>(s * El + j)];
            if (c < 0) fail("expert parallelism: rank ", ep.world_rank(), " received a negative row count");
            r.recv_counts[static_cast<size_t>(s)] += c;
        }
        if (s + 1 < S)
            r.recv_offsets[static_cast<size_t>(s + 1)] =
                r.recv_offsets[static_cast<size_t>(s)] + r.recv_counts[static_cast<size_t>(s)];
    }
    r.num_local = r.recv_offsets.back() + r.recv_counts.back();
    r.local_offsets.assign(static_cast<size_t>(El + 1), 0);
    r.local_order.reserve(static_cast<size_t>(r.num_local));
    for (int64_t j = 0; j < El; ++j) {
        for (int64_t s = 0; s < S; ++s) {
            int64_t start = r.recv_offsets[static_cast<size_t>(s)];
            for (int64_t jj = 0; jj < j; ++jj) start += cnt_recv[static_cast<size_t>(s * El + jj)];
            const int64_t c = cnt_recv[static_cast<size_t>(s * El + j)];
            for (int64_t k = 0; k < c; ++k) r.local_order.push_back(start + k);
        }
        r.local_offsets[static_cast<size_t>(j + 1)] = static_cast<int32_t>(r.local_order.size());
    }
    return r;
}

// Rows counted per peer, H elements each, through the EP group's all_to_all_v.
static void exchange_rows(parallel::Communicator& ep, const Tensor& send, const std::vector<int64_t>& send_counts,
                          const std::vector<int64_t>& send_offsets, const Tensor& recv,
                          const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets) {
    const int64_t H = send.dim(-1);
    auto times_h = [H](const std::vector<int64_t>& v) {
        std::vector<int64_t> out(v.size());
        for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] * H;
        return out;
    };
    const auto sc = times_h(send_counts), so = times_h(send_offsets), rc = times_h(recv_counts),
               ro = times_h(recv_offsets);
    ep.all_to_all_v(send.data(), sc, so, recv.data(), rc, ro, send.dtype());
}

static void copy_row(const Tensor& dst, int64_t dst_row, const Tensor& src, int64_t src_row) {
    const size_t row_bytes = static_cast<size_t>(src.dim(-1)) * dtype_size(src.dtype());
    std::memcpy(static_cast<char*>(dst.data()) + static_cast<size_t>(dst_row) * row_bytes,
                static_cast<const char*>(src.data()) + static_cast<size_t>(src_row) * row_bytes, row_bytes);
}

// sorted [P, H] (expert-sorted rows of this rank) -> local [num_local, H] (expert-major rows of the
// local experts, from every source), through `exchange` (source-major).
void ep_dispatch(const MoeDims& d, const EpRouting& r, const Tensor& sorted, const Tensor& exchange,
                 const Tensor& local) {
    MF_CHECK(exchange.dim(0) >= r.num_local && local.dim(0) >= r.num_local && sorted.dim(-1) == exchange.dim(-1) &&
                 local.dim(-1) == exchange.dim(-1),
             "ep_dispatch: buffer shapes");
    exchange_rows(*d.ep, sorted, r.send_counts, r.send_offsets, exchange, r.recv_counts, r.recv_offsets);
    for (int64_t i = 0; i < r.num_local; ++i) copy_row(local, i, exchange, r.local_order[static_cast<size_t>(i)]);
}

// The reverse: local [num_local, H] -> sorted [P, H], every row back where dispatch took it from.
void ep_combine(const MoeDims& d, const EpRouting& r, const Tensor& local, const Tensor& exchange,
                const Tensor& sorted) {
    MF_CHECK(exchange.dim(0) >= r.num_local && local.dim(0) >= r.num_local && sorted.dim(-1) == exchange.dim(-1) &&
                 local.dim(-1) == exchange.dim(-1),
             "ep_combine: buffer shapes");
    for (int64_t i = 0; i < r.num_local; ++i) copy_row(exchange, r.local_order[static_cast<size_t>(i)], local, i);
    exchange_rows(*d.ep, exchange, r.recv_counts, r.recv_offsets, sorted, r.send_counts, r.send_offsets);
}

namespace {

void check_ep(const MoeDims& d, const Tensor& x, const MoeWeights& w) {
    MF_CHECK(x.device() == Device::cpu, "expert parallelism runs on the CPU backend only for now");
    MF_CHECK(d.num_experts % d.ep_size() == 0, "EP size ", d.ep_size(), " does not divide ", d.num_experts, " experts");
    MF_CHECK(w.gate_up.dim(0) == d.num_experts / d.ep_size(), "the expert weights hold ", w.gate_up.dim(0),
             " experts, this EP rank owns ", d.num_experts / d.ep_size());
}

}  // namespace

void moe_block_forward(const Tensor& y, MoeActs& a, const Tensor& x, const MoeWeights& w, const MoeDims& d) {
    ops::matmul_forward(a.logits, x, w.router);
    ops::router_forward(a.probs, a.topk_idx, a.topk_weight, a.logits, d.norm_topk_prob);
    ops::moe_permute_indices(a.expert_offsets, a.sorted_pair, a.pair_row, a.topk_idx, d.num_experts);
    ops::moe_gather_forward(a.x_perm, x, a.sorted_pair, d.top_k);
    if (d.ep != nullptr) {
        check_ep(d, x, w);
        a.routing = ep_plan(d, a.expert_offsets);
        const EpRouting& r = a.routing;
        const int64_t R = r.num_local;
        // Every rank of the group has the same N·K pairs, so N·K·S rows (alloc) always suffice.
        MF_CHECK(R <= a.x_local.dim(0), "expert parallelism: ", R, " rows received, capacity ", a.x_local.dim(0));
        std::memcpy(a.local_offsets.data(), r.local_offsets.data(), r.local_offsets.size() * sizeof(int32_t));
        const Tensor x_local = row_view(a.x_local, 0, R), h_local = row_view(a.h_local, 0, R);
        const Tensor a_local = row_view(a.a_local, 0, R), y_local = row_view(a.y_local, 0, R);
        ep_dispatch(d, r, a.x_perm, a.exchange, x_local);
        ops::grouped_matmul_forward(h_local, x_local, w.gate_up, a.local_offsets);
        ops::swiglu_forward(a_local, h_local);
        ops::grouped_matmul_forward(y_local, a_local, w.down, a.local_offsets);
        ep_combine(d, r, y_local, a.exchange, a.y_perm);
        ops::moe_unpermute_forward(y, a.y_perm, a.topk_weight, a.pair_row);
        return;
    }
    ops::grouped_matmul_forward(a.h_perm, a.x_perm, w.gate_up, a.expert_offsets);
    ops::swiglu_forward(a.a_perm, a.h_perm);
    ops::grouped_matmul_forward(a.y_perm, a.a_perm, w.down, a.expert_offsets);
    ops::moe_unpermute_forward(y, a.y_perm, a.topk_weight, a.pair_row);
}

void moe_block_backward(const Tensor& dx, const MoeWeights& g, MoeScratch& s, const Tensor& dy, const Tensor& dprobs,
                        const Tensor& x, const MoeActs& a, const MoeWeights& w, const MoeDims& d) {
    ops::moe_unpermute_backward(s.dy_perm, s.dtopk_weight, dy, a.y_perm, a.topk_weight, a.pair_row);
    if (d.ep != nullptr) {
        check_ep(d, dy, w);
        const EpRouting& r = a.routing;
        const int64_t R = r.num_local;
        const Tensor x_local = row_view(a.x_local, 0, R), h_local = row_view(a.h_local, 0, R);
        const Tensor a_local = row_view(a.a_local, 0, R);
        const Tensor dy_local = row_view(s.dy_local, 0, R), da_local = row_view(s.da_local, 0, R);
        const Tensor dh_local = row_view(s.dh_local, 0, R), dx_local = row_view(s.dx_local, 0, R);
        ep_dispatch(d, r, s.dy_perm, s.exchange, dy_local);
        ops::zero(da_local);
        ops::grouped_matmul_backward(da_local, g.down, dy_local, a_local,
                                     w.down, a.local_offsets);
        ops::swiglu_backward(dh_local, da_local, h_local);
        ops::zero(dx_local);
        ops::grouped_matmul_backward(dx_local, g.gate_up, dh_local, x_local,
                                     w.gate_up, a.local_offsets);
        ep_combine(d, r, dx_local, s.exchange, s.dx_perm);  // every row of dx_perm comes back
    } else {
        ops::zero(s.da_perm);
        ops::grouped_matmul_backward(s.da_perm, g.down, s.dy_perm, a.a_perm, w.down, a.expert_offsets);
        ops::swiglu_backward(s.dh_perm, s.da_perm, a.h_perm);
        ops::zero(s.dx_perm);
        ops::grouped_matmul_backward(s.dx_perm, g.gate_up, s.dh_perm, a.x_perm, w.gate_up, a.expert_offsets);
    }
    ops::moe_gather_backward(dx, s.dx_perm, a.pair_row, d.top_k);
    ops::router_backward(s.dlogits, s.dtopk_weight, dprobs, a.probs, a.topk_idx, d.norm_topk_prob);
    ops::matmul_backward(dx, g.router, s.dlogits, x, w.router);
}

}  // namespace mf::model
