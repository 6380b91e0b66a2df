// The EP exchange of the dropless MoE block (model/ep_exchange.h): planning, dispatch and combine,
// the pipelined expert compute of the forward and the backward.
#include "model/ep_exchange.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>

#include "core/check.h"
#include "model/ffn_blocks.h"
#include "ops/ops.h"

namespace mf::model {

std::vector<Tensor> EpRowStore::carve(const std::vector<Part>& parts, Device dev) {
    auto padded = [](size_t n) { return (n + 255) / 256 * 256; };
    size_t need = 0;
    for (const Part& p : parts) {
        MF_CHECK(p.rows >= 0 && p.cols >= 0, "EpRowStore: negative shape");
        need += padded(static_cast<size_t>(p.rows * p.cols) * dtype_size(p.dtype));
    }
    if (buf_.nbytes() < need || buf_.device() != dev || buf_.data() == nullptr) {
        buf_ = Buffer();  // free first: the old and new buffers never coexist
        buf_ = Buffer(std::max<size_t>(need + need / 8, 256), dev);
    }
    std::vector<Tensor> out;
    size_t off = 0;
    for (const Part& p : parts) {
        out.push_back(buf_.as(p.dtype, {p.rows, p.cols}, off));
        off += padded(static_cast<size_t>(p.rows * p.cols) * dtype_size(p.dtype));
    }
    return out;
}

namespace {

int64_t num_chunks(const MoeDims& d) {
    const int64_t El = d.num_experts / d.ep_size();
    return std::clamp<int64_t>(d.ep_chunks, 1, std::max<int64_t>(El, 1));
}

// Chunk c of C holds the local experts [c·El/C, (c+1)·El/C).
int64_t chunk_begin(int64_t c, int64_t C, int64_t El) { return c * El / C; }

// Destinations: v = c·S + p is chunk c of rank p.
int64_t num_destinations(const MoeDims& d) { return d.ep_size() * num_chunks(d); }

// MoeDims::ep_own_split and ep_comm_sms, or their environment overrides (for tuning runs).
double own_split(const MoeDims& d) {
    double f = d.ep_own_split;
    if (const char* env = std::getenv("MOEFORGE_EP_OWN_SPLIT"); env != nullptr && *env != '\0') {
        char* end = nullptr;
        f = std::strtod(env, &end);
        if (end == env || *end != '\0' || !(f >= 0 && f <= 1))
            fail("MOEFORGE_EP_OWN_SPLIT='", env, "': expected a number in [0, 1]");
    }
    MF_CHECK(f >= 0 && f <= 1, "MoeDims::ep_own_split must lie in [0, 1], got ", f);
    return f;
}

int comm_sms(const MoeDims& d) {
    int64_t n = d.ep_comm_sms;
    if (const char* env = std::getenv("MOEFORGE_EP_COMM_SMS"); env != nullptr && *env != '\0') {
        char* end = nullptr;
        n = std::strtoll(env, &end, 10);
        if (end == env || *end != '\0' || n < 0 || n > 1024)
            fail("MOEFORGE_EP_COMM_SMS='", env, "': expected a whole number of SMs in [0, 1024]");
    }
    MF_CHECK(n >= 0, "MoeDims::ep_comm_sms must not be negative, got ", n);
    return static_cast<int>(n);
}

}  // namespace

Tensor EpPlanBuffers::expert_offsets() const {
    const int64_t E1 = expert_dest.numel() + 1;
    return Tensor(plan.data(), DType::i32, {E1}, plan.device());
}

Tensor EpPlanBuffers::counts() const {
    const int64_t E1 = expert_dest.numel() + 1;
    char* base = plan.data() == nullptr ? nullptr : static_cast<char*>(plan.data()) + E1 * sizeof(int32_t);
    return Tensor(base, DType::i32, {plan.numel() - E1}, plan.device());
}

void EpPlanBuffers::alloc(Arena& arena, const MoeDims& d, int64_t N) {
    const int64_t S = d.ep_size(), E = d.num_experts, El = E / S, V = num_destinations(d);
    expert_dest = arena.alloc(DType::i32, {E});
    plan = arena.alloc(DType::i32, {E + 1 + V});
    plan_all = arena.alloc(DType::i32, {S * (E + 1 + V)});
    send_pos = arena.alloc(DType::i32, {V, N});
    index = arena.alloc(DType::i32, {E + 4 * (El + num_chunks(d))});
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

void check_ep(const MoeDims& d, const MoeWeights& w) {
    MF_CHECK(d.num_experts % d.ep_size() == 0, "EP size ", d.ep_size(), " does not divide ", d.num_experts, " experts");
    MF_CHECK(w.gate_up.dim(0) == d.num_experts / d.ep_size(), "the expert weights hold ", w.gate_up.dim(0),
             " experts, this EP rank owns ", d.num_experts / d.ep_size());
}

// Each expert's destination, chunk·S + owner (EpPlanBuffers::expert_dest), uploaded once per
// activation plan.
void upload_expert_dest(const MoeDims& d, MoeActs& a) {
    if (a.expert_dest_ready) return;
    const int64_t S = d.ep_size(), E = d.num_experts, El = E / S, C = num_chunks(d);
    std::vector<int32_t> dest(static_cast<size_t>(E));
    for (int64_t p = 0; p < S; ++p)
        for (int64_t c = 0; c < C; ++c)
            for (int64_t j = chunk_begin(c, C, El); j < chunk_begin(c + 1, C, El); ++j)
                dest[static_cast<size_t>(p * El + j)] = static_cast<int32_t>(c * S + p);
    ops::copy_from_host(a.plan_buffers.expert_dest, dest.data());
    a.expert_dest_ready = true;
}

int32_t checked_i32(int64_t v, const char* what) {
    MF_CHECK(v >= 0 && v <= std::numeric_limits<int32_t>::max(), "expert parallelism: ", v, " ", what,
             " do not fit int32 row numbers");
    return static_cast<int32_t>(v);
}

}  // namespace

void ep_plan(const MoeDims& d, MoeActs& a) {
    parallel::Communicator& ep = *d.ep;
    const int64_t S = ep.size(), me = ep.rank(), E = d.num_experts, El = E / S, C = num_chunks(d);
    const int64_t V = S * C, W = E + 1 + V;  // W: one rank's plan entries
    const EpPlanBuffers& b = a.plan_buffers;
    const Device device = a.topk_idx.device();
    MF_CHECK(E % S == 0, "EP size ", S, " does not divide ", E, " experts");
    MF_CHECK(has_data(b.plan) && b.plan.numel() == W && b.plan_all.numel() == S * W && b.send_pos.dim(0) == V &&
                 b.send_pos.dim(1) == a.topk_idx.dim(0) && b.index.numel() == E + 4 * (El + C),
             "ep_plan: the plan buffers were allocated for another shape (MoeActs::alloc)");
    check_backend(ep, device, "ep_plan");
    upload_expert_dest(d, a);
    ops::ep_token_positions(b.send_pos, b.counts(), a.topk_idx, b.expert_dest);
    // Every rank's expert offsets and token counts, on the host.
    std::vector<int32_t> all(static_cast<size_t>(S * W));
    if (device == Device::cuda) {
        ep.all_gather(b.plan.data(), b.plan_all.data(), W, DType::i32);
        ep.synchronize();  // waits for the peers (and every kernel before) with the communicator's timeout
        ops::copy_to_host(all.data(), b.plan_all);
    } else {
        ep.all_gather(b.plan.data(), all.data(), W, DType::i32);
    }
    auto off = [&](int64_t s, int64_t e) { return int64_t{all[static_cast<size_t>(s * W + e)]}; };
    auto tokens = [&](int64_t s, int64_t v) { return int64_t{all[static_cast<size_t>(s * W + E + 1 + v)]}; };
    for (int64_t s = 0; s < S; ++s) {
        bool ok = off(s, 0) == 0;
        for (int64_t e = 0; e < E; ++e) ok = ok && off(s, e + 1) >= off(s, e);
        for (int64_t v = 0; v < V; ++v) ok = ok && tokens(s, v) >= 0;
        if (!ok)
            fail("expert parallelism: rank ", ep.world_rank(), " received a plan from EP rank ", s,
                 " with decreasing expert offsets or negative token counts");
    }
    auto cnt = [&](int64_t s, int64_t e) { return off(s, e + 1) - off(s, e); };

    // Local rows at every owner p, chunk by chunk; within a chunk part 0 (p's own tokens,
    // expert-major), then part 1 (the other ranks' tokens, expert-major, by source rank within an
    // expert). row_base[e] (the first E entries of the index) is where e's owner puts this rank's
    // rows of e; this rank's parts' group offsets follow.
    EpRouting r;
    std::vector<int32_t> index(static_cast<size_t>(E));
    for (int64_t p = 0; p < S; ++p) {
        int64_t row = 0;
        for (int64_t c = 0; c < C; ++c) {
            const int64_t j0 = chunk_begin(c, C, El), j1 = chunk_begin(c + 1, C, El);
            EpChunk ch;
            ch.first_expert = j0;
            ch.num_experts = j1 - j0;
            ch.first_row = row;
            for (int part = 0; part < 2; ++part) {
                EpChunk::Part& pt = ch.parts[part];
                pt.first_row = row;
                pt.offsets = static_cast<int64_t>(index.size()) - E;
                for (int64_t j = j0; j < j1; ++j) {
                    const int64_t e = p * El + j;
                    if (p == me) index.push_back(checked_i32(row, "expert rows"));
                    for (int64_t s = 0; s < S; ++s) {
                        if ((s == p) != (part == 0)) continue;
                        if (s == me) index[static_cast<size_t>(e)] = checked_i32(row, "expert rows");
                        row += cnt(s, e);
                    }
                }
                if (p == me) index.push_back(checked_i32(row, "expert rows"));
                pt.num_rows = row - pt.first_row;
            }
            ch.num_rows = row - ch.first_row;
            if (p == me) r.chunks.push_back(std::move(ch));
        }
        if (p == me) r.num_local = row;
    }
    // The own pieces: part 0 cut at a row, its group offsets clamped to either side.
    const double split = own_split(d);
    for (EpChunk& ch : r.chunks) {
        const EpChunk::Part& own = ch.parts[0];
        const int64_t cut = own.first_row + std::llround(split * static_cast<double>(own.num_rows));
        const size_t table = static_cast<size_t>(E + own.offsets);
        for (int piece = 0; piece < 2; ++piece) {
            EpChunk::Part& pt = ch.own_pieces[piece];
            pt.first_row = piece == 0 ? own.first_row : cut;
            pt.num_rows = piece == 0 ? cut - own.first_row : own.first_row + own.num_rows - cut;
            pt.offsets = static_cast<int64_t>(index.size()) - E;
            for (int64_t j = 0; j <= ch.num_experts; ++j) {
                const int64_t o = index[table + static_cast<size_t>(j)];
                index.push_back(checked_i32(piece == 0 ? std::min(o, cut) : std::max(o, cut), "expert rows"));
            }
        }
    }
    r.local_offsets.assign(index.begin() + E, index.end());

    // Buffers: the send buffer holds the tokens per destination v = c·S + p in v order (the
    // layout ops::ep_pack_rows writes); the receive buffer those from every source for chunk c,
    // chunk-major, this rank's own first, then the others in rank order, so that a chunk's received
    // tokens and each of its parts' are contiguous.
    int64_t sent = 0, received = 0;
    for (int64_t c = 0; c < C; ++c) {
        EpChunk& ch = r.chunks[static_cast<size_t>(c)];
        ch.first_recv = received;
        ch.recv_offsets.assign(static_cast<size_t>(S), 0);
        ch.recv_counts.assign(static_cast<size_t>(S), 0);
        auto take = [&](int64_t p) {
            ch.recv_offsets[static_cast<size_t>(p)] = received;
            ch.recv_counts[static_cast<size_t>(p)] = tokens(p, c * S + me);
            received += ch.recv_counts[static_cast<size_t>(p)];
        };
        take(me);
        for (int64_t p = 0; p < S; ++p)
            if (p != me) take(p);
        for (int64_t p = 0; p < S; ++p) {
            ch.send_offsets.push_back(sent);
            ch.send_counts.push_back(tokens(me, c * S + p));
            sent += ch.send_counts.back();
        }
        ch.num_recv = received - ch.first_recv;
        ch.num_self = ch.recv_counts[static_cast<size_t>(me)];
    }
    r.num_sent = checked_i32(sent, "tokens sent");
    r.num_received = checked_i32(received, "tokens received");
    MF_CHECK(static_cast<int64_t>(index.size()) == b.index.numel(), "ep_plan: index of ", index.size(),
             " entries for a buffer of ", b.index.numel());
    r.row_base = flat_view(b.index, 0, E);
    r.group_offsets = flat_view(b.index, E, static_cast<int64_t>(r.local_offsets.size()));
    ops::copy_from_host(b.index, index.data());
    a.routing = std::move(r);
}

namespace {

// The rows of one chunk's exchange, `width` elements per token: toward the owners (send buffer ->
// receive buffer) or back. With `overlap` it is only started (Communicator::all_to_all_v_start);
// returns the ticket to join (0: done). With `others_only` this rank's own rows stay out of it
// (copy_own moves them).
uint64_t exchange_chunk(parallel::Communicator& ep, bool overlap, const EpChunk& ch, bool to_owners, const Tensor& sent,
                        const Tensor& received, bool others_only = false) {
    MF_CHECK(sent.dtype() == received.dtype() && sent.dim(-1) == received.dim(-1) && sent.device() == received.device(),
             "expert parallelism: exchange buffers differ in dtype, width or device");
    const int64_t width = sent.dim(-1);
    auto scaled = [width](const std::vector<int64_t>& v) {
        std::vector<int64_t> out(v.size());
        for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] * width;
        return out;
    };
    auto sc = scaled(ch.send_counts), so = scaled(ch.send_offsets), rc = scaled(ch.recv_counts),
         ro = scaled(ch.recv_offsets);
    if (others_only) sc[static_cast<size_t>(ep.rank())] = rc[static_cast<size_t>(ep.rank())] = 0;
    const Tensor& from = to_owners ? sent : received;
    const Tensor& to = to_owners ? received : sent;
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

// This rank's own rows of a chunk's exchange (left out of exchange_chunk with others_only): a copy
// between its block of the send buffer and the chunk's first rows of the receive buffer.
void copy_own(const parallel::Communicator& ep, const EpChunk& ch, bool to_owners, const Tensor& sent,
              const Tensor& received) {
    const auto me = static_cast<size_t>(ep.rank());
    const int64_t n = ch.send_counts[me];
    MF_CHECK(n == ch.num_self && ch.recv_offsets[me] == ch.first_recv, "expert parallelism: own rows out of place");
    if (n == 0) return;
    const Tensor own_sent = row_view(sent, ch.send_offsets[me], n), own_received = row_view(received, ch.first_recv, n);
    if (to_owners)
        ops::copy(own_received, own_sent);
    else
        ops::copy(own_sent, own_received);
}

// A chunk's received tokens (rows of a receive-side buffer).
Tensor chunk_rows(const Tensor& t, const EpChunk& ch) { return row_view(t, ch.first_recv, ch.num_recv); }

// A part's received tokens: part 0 this rank's own, part 1 the other ranks'.
Tensor part_rows(const Tensor& t, const EpChunk& ch, int part) {
    return part == 0 ? row_view(t, ch.first_recv, ch.num_self)
                     : row_view(t, ch.first_recv + ch.num_self, ch.num_recv - ch.num_self);
}

// The group offsets of a part or own piece of a chunk, on the device and on the host.
Tensor part_offsets(const EpRouting& r, const EpChunk& ch, const EpChunk::Part& pt) {
    return flat_view(r.group_offsets, pt.offsets, ch.num_experts + 1);
}
std::span<const int32_t> part_host_offsets(const EpRouting& r, const EpChunk& ch, const EpChunk::Part& pt) {
    return std::span<const int32_t>(r.local_offsets)
        .subspan(static_cast<size_t>(pt.offsets), static_cast<size_t>(ch.num_experts + 1));
}

// Leaves SMs to the exchange's copy kernels for as long as it lives (see MoeDims::ep_comm_sms).
class CommSms {
 public:
    CommSms(Device device, int sms) : device_(device), on_(sms > 0) {
        if (on_) ops::set_grouped_matmul_reserved_sms(device_, sms);
    }
    ~CommSms() {
        if (on_) ops::set_grouped_matmul_reserved_sms(device_, 0);
    }
    CommSms(const CommSms&) = delete;
    CommSms& operator=(const CommSms&) = delete;

 private:
    Device device_;
    bool on_;
};

// Carves the forward's local rows and exchange buffers (see MoeActs).
void carve_forward(const MoeDims& d, MoeActs& a, DType act, Device dev) {
    const EpRouting& r = a.routing;
    const int64_t R = r.num_local, H = d.hidden, I = d.intermediate, K = d.top_k;
    const auto kept = a.local_store->carve(
        {{R, H, act}, {R, d.first_width(), act}, {R, I, act}, {R, H, act}, {r.num_received, 2 * K, DType::i32}}, dev);
    a.x_local = kept[0];
    a.h_local = kept[1];
    a.a_local = kept[2];
    a.y_local = kept[3];
    a.recv_meta = kept[4];
    const auto temp = a.output_store->carve({{r.num_sent, H, act},
                                             {r.num_sent, 2 * K, DType::i32},
                                             {r.num_received, H, act},
                                             {r.num_received, H, DType::f32},
                                             {r.num_sent, H, DType::f32}},
                                            dev);
    a.send_rows = temp[0];
    a.send_meta = temp[1];
    a.recv_rows = temp[2];
    a.recv_back = temp[3];
    a.send_back = temp[4];
}

// One exchanged quantity: its rows on the sending side (the send buffer's layout) and on the
// receiving side (the receive buffer's).
struct Exchanged {
    Tensor sent, received;
    bool defined() const { return has_data(sent) || has_data(received); }
};

// The EP pipeline shared by forward and backward: `out` (and `meta` when defined) travel to the
// owners, the other ranks' rows of every chunk started first (this rank's own are copied); then
// chunk by chunk (EpChunk): `arrive` part 0 (place this rank's own tokens in the local rows) and
// `compute` the first own piece while the others travel; `arrive` part 1 once they are here,
// `compute` it, `depart` it (reduce its results into its rows of back.received, and of
// extra.received when defined) and start sending them back (back.sent, extra.sent); `compute` the
// second own piece while they travel, `depart` part 0 and copy its results back; then `after`
// (work nothing of the exchange waits for, e.g. the weight gradients, over both parts); finally
// join every exchange. While the own pieces (and, with more chunks, part 1) compute beside an
// exchange, the grouped GEMMs leave comm_sms(d) SMs to its copies. On NCCL the exchanges run on a
// side stream; over TCP each completes before the call returns.
template <typename Arrive, typename Compute, typename Depart, typename After>
void ep_pipeline(const MoeDims& d, const EpRouting& r, const Exchanged& out, const Exchanged& meta,
                 const Exchanged& back, const Exchanged& extra, Arrive&& arrive, Compute&& compute, Depart&& depart,
                 After&& after) {
    const Device device = out.sent.device();
    check_backend(*d.ep, device, "expert parallelism");
    parallel::Communicator& ep = *d.ep;
    const int sms = comm_sms(d);
    std::vector<uint64_t> tickets(r.chunks.size(), 0);
    for (size_t c = 0; c < r.chunks.size(); ++c) {
        const EpChunk& ch = r.chunks[c];
        if (meta.defined()) exchange_chunk(ep, true, ch, true, meta.sent, meta.received, true);
        tickets[c] = exchange_chunk(ep, true, ch, true, out.sent, out.received, true);
        if (meta.defined()) copy_own(ep, ch, true, meta.sent, meta.received);
        copy_own(ep, ch, true, out.sent, out.received);
    }
    for (size_t c = 0; c < r.chunks.size(); ++c) {
        const EpChunk& ch = r.chunks[c];
        {
            const CommSms reserve(device, sms);
            arrive(ch, 0);
            compute(ch, ch.own_pieces[0]);
            ops::phase_mark("ep own computed");
        }
        join(ep, tickets[c]);
        arrive(ch, 1);
        ops::phase_mark("ep arrived");
        {
            // Only later chunks' exchanges can be in flight here.
            const CommSms reserve(device, c + 1 < r.chunks.size() ? sms : 0);
            compute(ch, ch.parts[1]);
        }
        ops::phase_mark("ep computed");
        depart(ch, 1);
        if (extra.defined()) exchange_chunk(ep, true, ch, false, extra.sent, extra.received, true);
        tickets[c] = exchange_chunk(ep, true, ch, false, back.sent, back.received, true);
        {
            const CommSms reserve(device, sms);
            compute(ch, ch.own_pieces[1]);
        }
        depart(ch, 0);
        if (extra.defined()) copy_own(ep, ch, false, extra.sent, extra.received);
        copy_own(ep, ch, false, back.sent, back.received);
        ops::phase_mark("ep own computed #2");
        // The way back is a fraction of the second own piece's compute at the P2 shape (~70 MB of
        // fp32 rows over NVLink); `after` gets every SM.
        after(ch);
        ops::phase_mark("ep after");
    }
    for (const uint64_t t : tickets) join(ep, t);
    ops::phase_mark("ep joined");
}

void check_ep_acts(const MoeDims& d, const MoeActs& a, const char* op) {
    MF_CHECK(d.ep != nullptr, op, ": no EP group");
    MF_CHECK(a.routing.chunks.size() == static_cast<size_t>(num_chunks(d)), op, ": run ep_plan first");
}

void pack_forward(MoeActs& a, const Tensor& x) {
    const EpPlanBuffers& b = a.plan_buffers;
    ops::ep_pack_rows(a.send_rows, x, b.send_pos, b.counts());
    ops::ep_pack_meta(a.send_meta, b.send_pos, b.counts(), a.topk_idx, a.topk_weight, a.pair_row, a.expert_offsets,
                      a.routing.row_base, b.expert_dest);
}

}  // namespace

void ep_dispatch(const MoeDims& d, MoeActs& a, const Tensor& x) {
    check_ep_acts(d, a, "ep_dispatch");
    carve_forward(d, a, x.dtype(), x.device());
    pack_forward(a, x);
    for (const EpChunk& ch : a.routing.chunks) {
        exchange_chunk(*d.ep, false, ch, true, a.send_meta, a.recv_meta);
        exchange_chunk(*d.ep, false, ch, true, a.send_rows, a.recv_rows);
        ops::ep_scatter_rows(a.x_local, chunk_rows(a.recv_rows, ch), chunk_rows(a.recv_meta, ch));
    }
}

void ep_combine(const MoeDims& d, MoeActs& a, const Tensor& y) {
    check_ep_acts(d, a, "ep_combine");
    for (const EpChunk& ch : a.routing.chunks) {
        ops::ep_reduce_rows(chunk_rows(a.recv_back, ch), a.y_local, chunk_rows(a.recv_meta, ch), true);
        exchange_chunk(*d.ep, false, ch, false, a.send_back, a.recv_back);
    }
    const EpPlanBuffers& b = a.plan_buffers;
    ops::ep_sum_blocks(y, a.send_back, b.send_pos, b.counts(), false);
}

void ep_moe_forward(const Tensor& y, MoeActs& a, const Tensor& x, const MoeWeights& w, const MoeDims& d) {
    check_ep(d, w);
    ep_plan(d, a);
    ops::phase_mark("fwd moe plan");
    carve_forward(d, a, x.dtype(), x.device());
    pack_forward(a, x);
    const EpRouting& r = a.routing;
    // Each chunk's grouped GEMMs see all local rows but only its experts' offsets (absolute row
    // numbers), so they touch only the chunk's rows.
    ep_pipeline(
        d, r, {a.send_rows, a.recv_rows}, {a.send_meta, a.recv_meta}, {a.send_back, a.recv_back}, {},
        [&](const EpChunk& ch, int part) {
            ops::ep_scatter_rows(a.x_local, part_rows(a.recv_rows, ch, part), part_rows(a.recv_meta, ch, part));
        },
        [&](const EpChunk& ch, const EpChunk::Part& pt) {
            // The grouped GEMMs see all local rows but only the piece's offsets (absolute row
            // numbers), so they touch only its rows.
            if (pt.num_rows == 0) return;
            const Tensor offsets = part_offsets(r, ch, pt);
            const auto host = part_host_offsets(r, ch, pt);
            ops::grouped_matmul_forward(a.h_local, a.x_local, expert_view(w.gate_up, ch.first_expert, ch.num_experts),
                                        offsets, host);
            expert_act_forward(d.act, row_view(a.a_local, pt.first_row, pt.num_rows),
                               row_view(a.h_local, pt.first_row, pt.num_rows));
            ops::grouped_matmul_forward(a.y_local, a.a_local, expert_view(w.down, ch.first_expert, ch.num_experts),
                                        offsets, host);
        },
        [&](const EpChunk& ch, int part) {
            ops::ep_reduce_rows(part_rows(a.recv_back, ch, part), a.y_local, part_rows(a.recv_meta, ch, part), true);
        },
        [](const EpChunk&) {});
    const EpPlanBuffers& b = a.plan_buffers;
    ops::phase_mark("fwd moe experts");
    ops::ep_sum_blocks(y, a.send_back, b.send_pos, b.counts(), false);
}

void ep_moe_backward(const Tensor& dx, const MoeWeights& g, MoeScratch& s, const Tensor& dy, const Tensor& x,
                     const MoeActs& a, const MoeWeights& w, const MoeDims& d, bool acc,
                     const ExpertGradSquares& squares) {
    check_ep(d, w);
    const EpRouting& r = a.routing;
    const EpPlanBuffers& b = a.plan_buffers;
    const int64_t R = r.num_local, H = d.hidden, I = d.intermediate, K = d.top_k;
    const DType act = dy.dtype();
    const auto rows = s.store->carve({{R, H, act},
                                      {R, I, act},
                                      {R, d.first_width(), act},
                                      {R, H, act},
                                      {r.num_received, K, DType::f32},
                                      {r.num_sent, K, DType::f32},
                                      {r.num_sent, H, act},
                                      {r.num_received, H, act},
                                      {r.num_received, H, DType::f32},
                                      {r.num_sent, H, DType::f32}},
                                     dy.device());
    s.dy_local = rows[0];
    s.da_local = rows[1];
    s.dh_local = rows[2];
    s.dx_local = rows[3];
    s.dw_recv = rows[4];
    s.dw_sent = rows[5];
    s.send_rows = rows[6];
    s.recv_rows = rows[7];
    s.recv_back = rows[8];
    s.send_back = rows[9];
    ops::ep_pack_rows(s.send_rows, dy, b.send_pos, b.counts());
    ops::phase_mark("bwd moe start");
    // Output gradients travel the dispatch way (the owner weights them and takes the weight
    // gradients), input gradients and weight gradients come back the combine way.
    ep_pipeline(
        d, r, {s.send_rows, s.recv_rows}, {}, {s.send_back, s.recv_back}, {s.dw_sent, s.dw_recv},
        [&](const EpChunk& ch, int part) {
            ops::ep_scatter_grad(s.dy_local, part_rows(s.dw_recv, ch, part), part_rows(s.recv_rows, ch, part),
                                 part_rows(a.recv_meta, ch, part), a.y_local);
        },
        [&](const EpChunk& ch, const EpChunk::Part& pt) {
            if (pt.num_rows == 0) return;
            const Tensor offsets = part_offsets(r, ch, pt);
            const auto host = part_host_offsets(r, ch, pt);
            // The input gradients (written: the piece's rows are exactly its groups' rows), so
            // that they travel back while the weight gradients are computed (`after`).
            ops::grouped_matmul_backward(s.da_local, Tensor(), s.dy_local, a.a_local,
                                         expert_view(w.down, ch.first_expert, ch.num_experts), offsets, host, false);
            expert_act_backward(d.act, row_view(s.dh_local, pt.first_row, pt.num_rows),
                                row_view(s.da_local, pt.first_row, pt.num_rows),
                                row_view(a.h_local, pt.first_row, pt.num_rows));
            ops::grouped_matmul_backward(s.dx_local, Tensor(), s.dh_local, a.x_local,
                                         expert_view(w.gate_up, ch.first_expert, ch.num_experts), offsets, host, false);
        },
        [&](const EpChunk& ch, int part) {
            ops::ep_reduce_rows(part_rows(s.recv_back, ch, part), s.dx_local, part_rows(a.recv_meta, ch, part), false);
        },
        [&](const EpChunk& ch) {
            // Both parts' rows of each expert in one pass; each chunk's experts are its own, so
            // written gradients are written exactly once.
            const Tensor offsets[2] = {part_offsets(r, ch, ch.parts[0]), part_offsets(r, ch, ch.parts[1])};
            const std::span<const int32_t> host[2] = {part_host_offsets(r, ch, ch.parts[0]),
                                                      part_host_offsets(r, ch, ch.parts[1])};
            ops::grouped_matmul_backward_weight(expert_view(g.down, ch.first_expert, ch.num_experts), s.dy_local,
                                                a.a_local, offsets, host, acc, squares.down);
            ops::grouped_matmul_backward_weight(expert_view(g.gate_up, ch.first_expert, ch.num_experts), s.dh_local,
                                                a.x_local, offsets, host, acc, squares.gate_up);
        });
    ops::phase_mark("bwd moe experts");
    ops::ep_sum_blocks(dx, s.send_back, b.send_pos, b.counts(), true);
    ops::ep_gather_slots(s.dtopk_weight, s.dw_sent, b.send_pos, b.counts(), a.topk_idx, b.expert_dest);
}

}  // namespace mf::model
