#include "model/ffn_blocks.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <span>

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

std::vector<Tensor> EpRowStore::carve(int64_t rows, const std::vector<int64_t>& cols, DType dt, Device dev) {
    MF_CHECK(rows >= 0, "EpRowStore: negative row count");
    int64_t width = 0;
    for (const int64_t c : cols) width += c;
    const size_t need = static_cast<size_t>(rows * width) * dtype_size(dt);
    if (buf_.nbytes() < need || buf_.device() != dev || buf_.data() == nullptr) {
        buf_ = Buffer();  // free first: the old and new buffers never coexist
        buf_ = Buffer(std::max<size_t>(need + need / 8, 256), dev);
    }
    std::vector<Tensor> out;
    size_t off = 0;
    for (const int64_t c : cols) {
        out.push_back(buf_.as(dt, {rows, c}, off));
        off += static_cast<size_t>(rows * c) * dtype_size(dt);
    }
    return out;
}

void MoeActs::alloc(Arena& arena, const MoeDims& d, int64_t N, DType act, std::shared_ptr<EpRowStore> local,
                    std::shared_ptr<EpRowStore> output, const Tensor* shared_x_perm) {
    const int64_t P = N * d.top_k;
    if (d.ep != nullptr) {
        // The row buffers are carved per step from the stores (sized by the real routing).
        local_store = local ? std::move(local) : std::make_shared<EpRowStore>();
        output_store = output ? std::move(output) : std::make_shared<EpRowStore>();
        const int64_t El = d.num_experts / d.ep_size();
        plan_buffers.peer_offsets = arena.alloc(DType::i32, {d.ep_size() * (El + 1)});
        plan_buffers.index = arena.alloc(DType::i32, {El + 1});
    }
    logits = arena.alloc(DType::f32, {N, d.num_experts});
    probs = arena.alloc(DType::f32, {N, d.num_experts});
    topk_idx = arena.alloc(DType::i32, {N, d.top_k});
    topk_weight = arena.alloc(DType::f32, {N, d.top_k});
    expert_offsets = arena.alloc(DType::i32, {d.num_experts + 1});
    sorted_pair = arena.alloc(DType::i32, {P});
    pair_row = arena.alloc(DType::i32, {P});
    x_perm = d.ep != nullptr && shared_x_perm != nullptr ? *shared_x_perm : arena.alloc(act, {P, d.hidden});
    if (d.ep == nullptr) {  // under EP the expert activations live in the *_local buffers
        h_perm = arena.alloc(act, {P, 2 * d.intermediate});
        a_perm = arena.alloc(act, {P, d.intermediate});
    }
    y_perm = arena.alloc(act, {P, d.hidden});
}

void MoeScratch::alloc(Arena& arena, const MoeDims& d, int64_t N, DType act, std::shared_ptr<EpRowStore> rows) {
    const int64_t P = N * d.top_k;
    if (d.ep != nullptr) store = rows ? std::move(rows) : std::make_shared<EpRowStore>();
    dy_perm = arena.alloc(act, {P, d.hidden});
    if (d.ep == nullptr) {
        da_perm = arena.alloc(act, {P, d.intermediate});
        dh_perm = arena.alloc(act, {P, 2 * d.intermediate});
    }
    dx_perm = arena.alloc(act, {P, d.hidden});
    dtopk_weight = arena.alloc(DType::f32, {N, d.top_k});
    dlogits = arena.alloc(DType::f32, {N, d.num_experts});
}

// --- expert parallelism -----------------------------------------------------------------------------

namespace {

// Rows [first, first + n) of a row-major [R, C] tensor, as an [n, C] view.
Tensor row_view(const Tensor& t, int64_t first, int64_t n) {
    const int64_t C = t.dim(-1);
    char* base = static_cast<char*>(t.data()) + static_cast<size_t>(first * C) * dtype_size(t.dtype());
    return Tensor(base, t.dtype(), {n, C}, t.device());
}

// Elements [first, first + n) of a flat tensor.
Tensor flat_view(const Tensor& t, int64_t first, int64_t n) {
    char* base = static_cast<char*>(t.data()) + static_cast<size_t>(first) * dtype_size(t.dtype());
    return Tensor(base, t.dtype(), {n}, t.device());
}

bool has_data(const Tensor& t) { return t.data() != nullptr; }

// Experts [first, first + n) of a stacked [E', A, B] weight (undefined stays undefined).
Tensor expert_view(const Tensor& t, int64_t first, int64_t n) {
    if (!has_data(t)) return Tensor();
    const int64_t per_expert = t.dim(1) * t.dim(2);
    char* base = static_cast<char*>(t.data()) + static_cast<size_t>(first * per_expert) * dtype_size(t.dtype());
    return Tensor(base, t.dtype(), {n, t.dim(1), t.dim(2)}, t.device());
}

// CPU tensors travel over TCP, device tensors over NCCL: anything else would hand one a pointer it
// cannot read.
void check_backend(const parallel::Communicator& ep, Device device, const char* op) {
    const bool nccl = std::strcmp(ep.backend(), "nccl") == 0;
    MF_CHECK(nccl == (device == Device::cuda), op, ": ", device_name(device), " tensors with a ", ep.backend(),
             " EP group (cpu tensors need tcp, cuda tensors nccl)");
}

int64_t num_chunks(const MoeDims& d) {
    const int64_t El = d.num_experts / d.ep_size();
    return std::clamp<int64_t>(d.ep_chunks, 1, std::max<int64_t>(El, 1));
}

}  // namespace

EpRouting ep_plan(const MoeDims& d, const Tensor& expert_offsets, const EpPlanBuffers& buffers) {
    parallel::Communicator& ep = *d.ep;
    const int64_t S = ep.size(), E = d.num_experts, El = E / S;
    const Device device = expert_offsets.device();
    MF_CHECK(expert_offsets.numel() == E + 1 && expert_offsets.dtype() == DType::i32,
             "ep_plan: expert_offsets must be [E + 1] i32");
    check_backend(ep, device, "ep_plan");
    // Each peer p gets this rank's offsets of p's experts, off[p·El .. (p+1)·El] (El + 1 entries, the
    // slices overlap by one), straight from expert_offsets; the receiver takes differences.
    std::vector<int64_t> slice_counts(static_cast<size_t>(S), El + 1), send_slices(static_cast<size_t>(S)),
        recv_slices(static_cast<size_t>(S));
    for (int64_t p = 0; p < S; ++p) {
        send_slices[static_cast<size_t>(p)] = p * El;
        recv_slices[static_cast<size_t>(p)] = p * (El + 1);
    }
    std::vector<int32_t> off(static_cast<size_t>(E + 1)), peer(static_cast<size_t>(S * (El + 1)));
    if (device == Device::cuda) {
        const Tensor& staging = buffers.peer_offsets;
        MF_CHECK(has_data(staging) && staging.device() == Device::cuda && staging.dtype() == DType::i32 &&
                     staging.numel() >= S * (El + 1),
                 "ep_plan: device expert_offsets need a device i32 peer_offsets buffer of ", S * (El + 1), " entries");
        ep.all_to_all_v(expert_offsets.data(), slice_counts, send_slices, staging.data(), slice_counts, recv_slices,
                        DType::i32);
        ep.synchronize();  // waits for the peers (and every kernel before) with the communicator's timeout
        ops::copy_to_host(off.data(), expert_offsets);
        ops::copy_to_host(peer.data(), flat_view(staging, 0, S * (El + 1)));
    } else {
        ops::copy_to_host(off.data(), expert_offsets);
        ep.all_to_all_v(off.data(), slice_counts, send_slices, peer.data(), slice_counts, recv_slices, DType::i32);
    }
    // cnt[s·El + j]: rows source s sends for local expert j.
    std::vector<int64_t> cnt(static_cast<size_t>(S * El));
    for (int64_t s = 0; s < S; ++s) {
        const int32_t* o = peer.data() + s * (El + 1);
        for (int64_t j = 0; j < El; ++j) {
            if (o[j] < 0 || o[j + 1] < o[j])
                fail("expert parallelism: rank ", ep.world_rank(), " received decreasing row offsets from EP rank ", s);
            cnt[static_cast<size_t>(s * El + j)] = o[j + 1] - o[j];
        }
    }
    for (int64_t e = 0; e < E; ++e)
        MF_CHECK(off[static_cast<size_t>(e)] >= 0 && off[static_cast<size_t>(e + 1)] >= off[static_cast<size_t>(e)],
                 "ep_plan: expert_offsets are not ascending from 0");

    // Local rows are expert-major, then source rank: expert j's rows from source s start at
    // local_offsets[j] + Σ_{s' < s} cnt[s'·El + j]. Chunk c holds local experts [c·El/C, (c+1)·El/C),
    // a contiguous block of local rows. Its remote rows travel as one block per peer (contiguous in
    // the sender's expert-sorted rows) into the staging buffer, chunk after chunk and source-major
    // within a chunk; row-range copies then put them, and this rank's own rows, in place.
    EpRouting r;
    r.local_offsets.assign(static_cast<size_t>(El + 1), 0);
    for (int64_t j = 0; j < El; ++j) {
        int64_t rows = 0;
        for (int64_t s = 0; s < S; ++s) rows += cnt[static_cast<size_t>(s * El + j)];
        const int64_t next = r.local_offsets[static_cast<size_t>(j)] + rows;
        MF_CHECK(next <= std::numeric_limits<int32_t>::max(), "expert parallelism: ", next,
                 " rows received do not fit int32 row offsets");
        r.local_offsets[static_cast<size_t>(j + 1)] = static_cast<int32_t>(next);
    }
    r.num_local = r.local_offsets[static_cast<size_t>(El)];
    const int64_t me = ep.rank(), C = num_chunks(d);
    int64_t staged = 0;
    for (int64_t c = 0; c < C; ++c) {
        EpChunk ch;
        ch.first_expert = c * El / C;
        ch.num_experts = (c + 1) * El / C - ch.first_expert;
        const int64_t j0 = ch.first_expert, j1 = j0 + ch.num_experts;
        ch.first_row = r.local_offsets[static_cast<size_t>(j0)];
        ch.num_rows = r.local_offsets[static_cast<size_t>(j1)] - ch.first_row;
        ch.send_counts.assign(static_cast<size_t>(S), 0);
        ch.send_offsets.assign(static_cast<size_t>(S), 0);
        ch.recv_counts.assign(static_cast<size_t>(S), 0);
        ch.recv_offsets.assign(static_cast<size_t>(S), 0);
        for (int64_t p = 0; p < S; ++p) {
            // Where source p's rows of expert j sit among the local rows.
            auto local_row = [&](int64_t j) {
                int64_t at = r.local_offsets[static_cast<size_t>(j)];
                for (int64_t s = 0; s < p; ++s) at += cnt[static_cast<size_t>(s * El + j)];
                return at;
            };
            if (p == me) {
                for (int64_t j = j0; j < j1; ++j)
                    for (const int64_t v : {int64_t{off[static_cast<size_t>(me * El + j)]}, local_row(j),
                                            cnt[static_cast<size_t>(me * El + j)]})
                        ch.self_pieces.push_back(v);
                continue;
            }
            const int32_t first = off[static_cast<size_t>(p * El + j0)];
            ch.send_offsets[static_cast<size_t>(p)] = first;
            ch.send_counts[static_cast<size_t>(p)] = off[static_cast<size_t>(p * El + j1)] - first;
            ch.recv_offsets[static_cast<size_t>(p)] = staged;
            for (int64_t j = j0; j < j1; ++j) {
                const int64_t n = cnt[static_cast<size_t>(p * El + j)];
                for (const int64_t v : {staged, local_row(j), n}) ch.staging_pieces.push_back(v);
                staged += n;
                ch.recv_counts[static_cast<size_t>(p)] += n;
            }
        }
        r.chunks.push_back(std::move(ch));
    }
    r.num_staged = staged;

    const Tensor& index = buffers.index;
    if (!has_data(index)) {
        MF_CHECK(device == Device::cpu, "ep_plan: device expert_offsets need a device i32 index buffer");
        return r;
    }
    MF_CHECK(index.device() == device && index.dtype() == DType::i32 && index.numel() >= El + 1,
             "ep_plan: the index buffer needs ", El + 1, " i32 entries on the ", device_name(device), ", has ",
             index.numel());
    r.group_offsets = flat_view(index, 0, El + 1);
    ops::copy_from_host(r.group_offsets, r.local_offsets.data());
    return r;
}

namespace {

// (src, dst, rows) triples with src and dst swapped: the combine's copies are the dispatch's reversed.
std::vector<int64_t> reversed(const std::vector<int64_t>& pieces) {
    std::vector<int64_t> out(pieces);
    for (size_t i = 0; i + 2 < out.size(); i += 3) std::swap(out[i], out[i + 1]);
    return out;
}

// The NCCL part of one chunk's exchange, H elements per row: the remote rows toward the owners
// (sorted -> staging) or back (staging -> sorted). With `overlap` it is only started
// (Communicator::all_to_all_v_start); returns the ticket to join (0: done).
uint64_t exchange_chunk(parallel::Communicator& ep, bool overlap, const EpChunk& ch, bool to_owners,
                        const Tensor& sorted, const Tensor& staging) {
    const int64_t H = sorted.dim(-1);
    auto times_h = [H](const std::vector<int64_t>& v) {
        std::vector<int64_t> out(v.size());
        for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] * H;
        return out;
    };
    const auto sc = times_h(ch.send_counts), so = times_h(ch.send_offsets), rc = times_h(ch.recv_counts),
               ro = times_h(ch.recv_offsets);
    const Tensor& from = to_owners ? sorted : staging;
    const Tensor& to = to_owners ? staging : sorted;
    const auto& from_counts = to_owners ? sc : rc;
    const auto& from_offsets = to_owners ? so : ro;
    const auto& to_counts = to_owners ? rc : sc;
    const auto& to_offsets = to_owners ? ro : so;
    if (overlap)
        return ep.all_to_all_v_start(from.data(), from_counts, from_offsets, to.data(), to_counts, to_offsets,
                                     from.dtype());
    ep.all_to_all_v(from.data(), from_counts, from_offsets, to.data(), to_counts, to_offsets, from.dtype());
    return 0;
}

void join(parallel::Communicator& ep, uint64_t ticket) {
    if (ticket != 0) ep.all_to_all_v_join(ticket);
}

void check_exchange(const char* op, const MoeDims& d, const EpRouting& r, const Tensor& sorted,
                    const Tensor& staging, const Tensor& local) {
    MF_CHECK(staging.dim(0) >= r.num_staged && local.dim(0) >= r.num_local && sorted.dim(-1) == staging.dim(-1) &&
                 local.dim(-1) == staging.dim(-1) && sorted.dtype() == staging.dtype() &&
                 local.dtype() == staging.dtype(),
             op, ": buffer shapes");
    MF_CHECK(sorted.device() == staging.device() && local.device() == staging.device(), op, ": mixed devices");
    check_backend(*d.ep, staging.device(), op);
}

// A chunk's dispatch, split around the wait for its exchange: this rank's own rows go sorted ->
// local at once (no exchange), the received ones staging -> local after it.
void place_own_rows(const EpChunk& ch, const Tensor& sorted, const Tensor& local) {
    ops::copy_row_pieces(local, sorted, ch.self_pieces);
}
void place_received_rows(const EpChunk& ch, const Tensor& staging, const Tensor& local) {
    ops::copy_row_pieces(local, staging, ch.staging_pieces);
}
// A chunk's combine: outputs for the peers local -> staging (then the exchange), this rank's own
// local -> sorted.
void stage_outgoing_rows(const EpChunk& ch, const Tensor& local, const Tensor& staging, const Tensor& sorted) {
    ops::copy_row_pieces(staging, local, reversed(ch.staging_pieces));
    ops::copy_row_pieces(sorted, local, reversed(ch.self_pieces));
}

}  // namespace

// sorted [P, H] (expert-sorted rows of this rank) -> local [num_local, H] (expert-major rows of the
// local experts, from every source), through `staging` (the rows from the peers).
void ep_dispatch(const MoeDims& d, const EpRouting& r, const Tensor& sorted, const Tensor& staging,
                 const Tensor& local) {
    check_exchange("ep_dispatch", d, r, sorted, staging, local);
    for (const EpChunk& ch : r.chunks) {
        exchange_chunk(*d.ep, false, ch, true, sorted, staging);
        place_own_rows(ch, sorted, local);
        place_received_rows(ch, staging, local);
    }
}

// The reverse: local [num_local, H] -> sorted [P, H], every row back where dispatch took it from.
void ep_combine(const MoeDims& d, const EpRouting& r, const Tensor& local, const Tensor& staging,
                const Tensor& sorted) {
    check_exchange("ep_combine", d, r, sorted, staging, local);
    for (const EpChunk& ch : r.chunks) {
        stage_outgoing_rows(ch, local, staging, sorted);
        exchange_chunk(*d.ep, false, ch, false, sorted, staging);
    }
}

namespace {

void check_ep(const MoeDims& d, const MoeWeights& w) {
    MF_CHECK(d.num_experts % d.ep_size() == 0, "EP size ", d.ep_size(), " does not divide ", d.num_experts, " experts");
    MF_CHECK(w.gate_up.dim(0) == d.num_experts / d.ep_size(), "the expert weights hold ", w.gate_up.dim(0),
             " experts, this EP rank owns ", d.num_experts / d.ep_size());
}

// A chunk's experts' offsets from the plan's host copy (the same values as its group_offsets slice).
std::span<const int32_t> chunk_host_offsets(const EpRouting& r, const EpChunk& ch) {
    return std::span<const int32_t>(r.local_offsets)
        .subspan(static_cast<size_t>(ch.first_expert), static_cast<size_t>(ch.num_experts + 1));
}

// The EP pipeline shared by forward and backward: every chunk's exchange of `sorted_in` is started,
// then chunk by chunk: place its own rows, join its exchange and place the received rows in
// `local_in`, run `compute` (which leaves the chunk's results in `local_out`), stage them and start
// their exchange back into `sorted_out`; finally join every exchange. With one chunk, or without an
// NCCL side stream, each exchange completes before the next step, which is the plain dispatch ->
// compute -> combine.
template <typename Compute>
void ep_pipeline(const MoeDims& d, const EpRouting& r, const Tensor& sorted_in, const Tensor& staging,
                 const Tensor& local_in, const Tensor& local_out, const Tensor& sorted_out, Compute&& compute) {
    check_exchange("expert parallelism", d, r, sorted_in, staging, local_in);
    check_exchange("expert parallelism", d, r, sorted_out, staging, local_out);
    const bool overlap = r.chunks.size() > 1;
    std::vector<uint64_t> tickets(r.chunks.size(), 0);
    for (size_t c = 0; c < r.chunks.size(); ++c)
        tickets[c] = exchange_chunk(*d.ep, overlap, r.chunks[c], true, sorted_in, staging);
    for (size_t c = 0; c < r.chunks.size(); ++c) {
        const EpChunk& ch = r.chunks[c];
        place_own_rows(ch, sorted_in, local_in);
        join(*d.ep, tickets[c]);
        place_received_rows(ch, staging, local_in);
        compute(ch);
        stage_outgoing_rows(ch, local_out, staging, sorted_out);
        tickets[c] = exchange_chunk(*d.ep, overlap, ch, false, sorted_out, staging);
    }
    for (const uint64_t t : tickets) join(*d.ep, t);
}

}  // namespace

void moe_block_forward(const Tensor& y, MoeActs& a, const Tensor& x, const MoeWeights& w, const MoeDims& d) {
    ops::matmul_forward(a.logits, x, w.router);
    ops::router_forward(a.probs, a.topk_idx, a.topk_weight, a.logits, d.norm_topk_prob);
    ops::moe_permute_indices(a.expert_offsets, a.sorted_pair, a.pair_row, a.topk_idx, d.num_experts);
    ops::moe_gather_forward(a.x_perm, x, a.sorted_pair, d.top_k);
    if (d.ep != nullptr) {
        check_ep(d, w);
        a.routing = ep_plan(d, a.expert_offsets, a.plan_buffers);
        const EpRouting& r = a.routing;
        const int64_t R = r.num_local;
        const int64_t H = d.hidden, I = d.intermediate;
        const auto rows = a.local_store->carve(R, {H, 2 * I, I}, x.dtype(), x.device());
        a.x_local = rows[0];
        a.h_local = rows[1];
        a.a_local = rows[2];
        const auto temp = a.output_store->carve(R, {H, H}, x.dtype(), x.device());
        a.y_local = temp[0];
        a.staging = temp[1];
        const Tensor x_local = row_view(a.x_local, 0, R), h_local = row_view(a.h_local, 0, R);
        const Tensor a_local = row_view(a.a_local, 0, R), y_local = row_view(a.y_local, 0, R);
        // Each chunk's grouped GEMMs see all R rows but only its experts' offsets (absolute row
        // numbers), so they touch only the chunk's rows.
        ep_pipeline(d, r, a.x_perm, a.staging, x_local, y_local, a.y_perm, [&](const EpChunk& ch) {
            const Tensor offsets = flat_view(r.group_offsets, ch.first_expert, ch.num_experts + 1);
            const auto host = chunk_host_offsets(r, ch);
            ops::grouped_matmul_forward(h_local, x_local, expert_view(w.gate_up, ch.first_expert, ch.num_experts),
                                        offsets, host);
            ops::swiglu_forward(row_view(a_local, ch.first_row, ch.num_rows),
                                row_view(h_local, ch.first_row, ch.num_rows));
            ops::grouped_matmul_forward(y_local, a_local, expert_view(w.down, ch.first_expert, ch.num_experts),
                                        offsets, host);
        });
        ops::moe_unpermute_forward(y, a.y_perm, a.topk_weight, a.pair_row);
        return;
    }
    a.host_offsets.clear();
    if (ops::grouped_matmul_uses_host_offsets(x.device())) {
        a.host_offsets.resize(static_cast<size_t>(d.num_experts + 1));
        ops::copy_to_host(a.host_offsets.data(), a.expert_offsets);
    }
    ops::grouped_matmul_forward(a.h_perm, a.x_perm, w.gate_up, a.expert_offsets, a.host_offsets);
    ops::swiglu_forward(a.a_perm, a.h_perm);
    ops::grouped_matmul_forward(a.y_perm, a.a_perm, w.down, a.expert_offsets, a.host_offsets);
    ops::moe_unpermute_forward(y, a.y_perm, a.topk_weight, a.pair_row);
}

void moe_block_backward(const Tensor& dx, const MoeWeights& g, MoeScratch& s, const Tensor& dy, const Tensor& dprobs,
                        const Tensor& x, const MoeActs& a, const MoeWeights& w, const MoeDims& d) {
    ops::moe_unpermute_backward(s.dy_perm, s.dtopk_weight, dy, a.y_perm, a.topk_weight, a.pair_row);
    if (d.ep != nullptr) {
        check_ep(d, w);
        const EpRouting& r = a.routing;
        const int64_t R = r.num_local, H = d.hidden, I = d.intermediate;
        const auto rows = s.store->carve(R, {H, I, 2 * I, H, H}, dy.dtype(), dy.device());
        s.dy_local = rows[0];
        s.da_local = rows[1];
        s.dh_local = rows[2];
        s.dx_local = rows[3];
        s.staging = rows[4];
        const Tensor x_local = row_view(a.x_local, 0, R), h_local = row_view(a.h_local, 0, R);
        const Tensor a_local = row_view(a.a_local, 0, R);
        const Tensor dy_local = row_view(s.dy_local, 0, R), da_local = row_view(s.da_local, 0, R);
        const Tensor dh_local = row_view(s.dh_local, 0, R), dx_local = row_view(s.dx_local, 0, R);
        // Output gradients travel the dispatch way, input gradients come back the combine way (every
        // row of dx_perm is written).
        ep_pipeline(d, r, s.dy_perm, s.staging, dy_local, dx_local, s.dx_perm, [&](const EpChunk& ch) {
            const Tensor offsets = flat_view(r.group_offsets, ch.first_expert, ch.num_experts + 1);
            const auto host = chunk_host_offsets(r, ch);
            const Tensor rows_da = row_view(da_local, ch.first_row, ch.num_rows);
            ops::zero(rows_da);
            ops::grouped_matmul_backward(da_local, expert_view(g.down, ch.first_expert, ch.num_experts), dy_local,
                                         a_local, expert_view(w.down, ch.first_expert, ch.num_experts), offsets, host);
            ops::swiglu_backward(row_view(dh_local, ch.first_row, ch.num_rows), rows_da,
                                 row_view(h_local, ch.first_row, ch.num_rows));
            ops::zero(row_view(dx_local, ch.first_row, ch.num_rows));
            ops::grouped_matmul_backward(dx_local, expert_view(g.gate_up, ch.first_expert, ch.num_experts), dh_local,
                                         x_local, expert_view(w.gate_up, ch.first_expert, ch.num_experts), offsets,
                                         host);
        });
    } else {
        ops::zero(s.da_perm);
        ops::grouped_matmul_backward(s.da_perm, g.down, s.dy_perm, a.a_perm, w.down, a.expert_offsets, a.host_offsets);
        ops::swiglu_backward(s.dh_perm, s.da_perm, a.h_perm);
        ops::zero(s.dx_perm);
        ops::grouped_matmul_backward(s.dx_perm, g.gate_up, s.dh_perm, a.x_perm, w.gate_up, a.expert_offsets,
                                     a.host_offsets);
    }
    ops::moe_gather_backward(dx, s.dx_perm, a.pair_row, d.top_k);
    ops::router_backward(s.dlogits, s.dtopk_weight, dprobs, a.probs, a.topk_idx, d.norm_topk_prob);
    ops::matmul_backward(dx, g.router, s.dlogits, x, w.router);
}

}  // namespace mf::model
