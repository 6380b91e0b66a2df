// The expert-parallel token exchange ops (ops.h, "expert-parallel token exchange") on the CPU,
// through the ops:: entries (argument checks and dispatch) over the reference kernels of
// kernels/cpu/ep_tokens.h.
//   Hand-built cases: N = 5 tokens, K = 2, E = 4 experts over V = 3 destinations, one of which owns
//   no expert (zero tokens), tokens with no slot for some destination, an expert id out of range, a
//   pair_row out of its expert's range, meta rows out of the local tensor, a block buffer cut short.
//   Every expected value is worked out by hand in the comments.
//   Round trip: random routing, integer-valued rows and dyadic weights (every fp32 sum exact):
//   pack -> per destination scatter, an "expert" scaling its rows by (e + 1), reduce -> sum over the
//   blocks equals Σ_k w_k (e_k + 1) src[t] from a brute-force loop over the slots; the backward
//   (scatter_grad -> gather_slots, and the reduce/sum of dlocal) likewise.
//   Refusals: wrong dtypes, ranks and shapes, K > 32, name the op.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/tensor.h"
#include "kernels/cpu/moe_permute.h"
#include "ops/ops.h"

namespace {

using mf::DType;
using mf::Tensor;
using I32 = std::vector<int32_t>;
using F32 = std::vector<float>;

Tensor t_i32(I32& v, mf::Shape s) { return Tensor(v.data(), DType::i32, std::move(s)); }
Tensor t_f32(F32& v, mf::Shape s) { return Tensor(v.data(), DType::f32, std::move(s)); }

int32_t bits(float w) {
    int32_t b;
    std::memcpy(&b, &w, sizeof b);
    return b;
}

// ---------------------------------------------------------------------------------------------
// The hand-built routing.
//   expert_dest = {0, 2, 0, 2}: destination 1 owns no expert.
//   topk_idx: t0 {0, 2} -> v0 only;  t1 {1, 3} -> v2 only;  t2 {2, 1} -> v0, v2;
//             t3 {3, 0} -> v2, v0;   t4 {7, 1} -> expert 7 is out of range, so v2 only.
//   send_pos v0: t0 0, t2 1, t3 2 (counts 3); v1: none (0); v2: t1 0, t2 1, t3 2, t4 3 (counts 4).
//   Block offsets 0, 3, 3: block rows 0..6 = (v0 t0) (v0 t2) (v0 t3) (v2 t1) (v2 t2) (v2 t3) (v2 t4).
constexpr int64_t kN = 5, kK = 2, kE = 4, kV = 3;

struct Routing {
    I32 topk = {0, 2, 1, 3, 2, 1, 3, 0, 7, 1};
    I32 dest = {0, 2, 0, 2};
    I32 send_pos = I32(kV * kN, 99);
    I32 counts = I32(kV, 99);
    Tensor topk_t() { return t_i32(topk, {kN, kK}); }
    Tensor dest_t() { return t_i32(dest, {kE}); }
    Tensor send_pos_t() { return t_i32(send_pos, {kV, kN}); }
    Tensor counts_t() { return t_i32(counts, {kV}); }
    void positions() { mf::ops::ep_token_positions(send_pos_t(), counts_t(), topk_t(), dest_t()); }
};

TEST(EpTokens, PositionsByHand) {
    Routing r;
    r.positions();
    EXPECT_EQ(r.counts, (I32{3, 0, 4}));
    EXPECT_EQ(r.send_pos, (I32{0, -1, 1, 2, -1,     //
                               -1, -1, -1, -1, -1,  //
                               -1, 0, 1, 2, 3}));
}

TEST(EpTokens, DestinationOutOfRangeIsSkipped) {
    Routing r;
    r.dest = {0, 5, 0, -1};  // experts 1 and 3 go nowhere: t1 is bound for no destination
    r.positions();
    EXPECT_EQ(r.counts, (I32{3, 0, 0}));
    EXPECT_EQ(r.send_pos, (I32{0, -1, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}));
}

TEST(EpTokens, PackRowsByHand) {
    Routing r;
    r.positions();
    const int64_t H = 3;
    F32 src(kN * H);
    for (int64_t t = 0; t < kN; ++t)
        for (int64_t h = 0; h < H; ++h) src[t * H + h] = static_cast<float>(10 * t + h + 1);
    F32 rows(8 * H, -7.0f);  // one row more than Σ counts: it stays untouched
    mf::ops::ep_pack_rows(t_f32(rows, {8, H}), t_f32(src, {kN, H}), r.send_pos_t(), r.counts_t());
    const F32 want = {1,  2,  3,  21, 22, 23, 31, 32, 33, 11, 12, 13,   // t0 t2 t3 t1
                      21, 22, 23, 31, 32, 33, 41, 42, 43, -7, -7, -7};  // t2 t3 t4, untouched
    EXPECT_EQ(rows, want);

    // A buffer of 5 rows: block rows 5 and 6 (v2's t3 and t4) fall outside and are skipped.
    F32 short_rows(5 * H, -7.0f);
    mf::ops::ep_pack_rows(t_f32(short_rows, {5, H}), t_f32(src, {kN, H}), r.send_pos_t(), r.counts_t());
    EXPECT_EQ(short_rows, F32(want.begin(), want.begin() + 5 * H));
}

// pairs p = t·K + k, experts [0 2 | 1 3 | 2 1 | 3 0 | 7 1]; by expert, in pair order:
//   e0: p0 p7  e1: p2 p5 p9  e2: p1 p4  e3: p3 p6   -> expert_offsets {0, 2, 5, 7, 9}
//   pair_row p0..p9 = {0, 5, 2, 7, 6, 3, 8, 1, -1, 4} (p8: invalid expert)
// local row = row_base[e] + pair_row − expert_offsets[e], row_base = {100, 200, 300, 400}:
//   p0 100  p1 300  p2 200  p3 400  p4 301  p5 201  p6 401  p7 101  p9 202
// weights topk_weight[p] = (p + 1) / 4.
struct MetaInputs {
    I32 pair_row = {0, 5, 2, 7, 6, 3, 8, 1, -1, 4};
    I32 offsets = {0, 2, 5, 7, 9};
    I32 row_base = {100, 200, 300, 400};
    F32 weight = F32(kN * kK);
    MetaInputs() {
        for (int p = 0; p < kN * kK; ++p) weight[p] = 0.25f * static_cast<float>(p + 1);
    }
};

TEST(EpTokens, PackMetaByHand) {
    Routing r;
    r.positions();
    MetaInputs in;
    I32 meta(8 * 2 * kK, 55);
    const auto run = [&] {
        mf::ops::ep_pack_meta(t_i32(meta, {8, 2 * kK}), r.send_pos_t(), r.counts_t(), r.topk_t(),
                              t_f32(in.weight, {kN, kK}), t_i32(in.pair_row, {kN * kK}), t_i32(in.offsets, {kE + 1}),
                              t_i32(in.row_base, {kE}), r.dest_t());
    };
    run();
    // Row: local rows of slots 0, 1, then the weight bits (0 where the slot is not the block's).
    const I32 want = {
        100, 300, bits(0.25f), bits(0.5f),  // v0 t0: e0 (p0), e2 (p1)
        301, -1,  bits(1.25f), 0,           // v0 t2: e2 (p4); e1 goes to v2
        -1,  101, 0,           bits(2.0f),  // v0 t3: e3 goes to v2; e0 (p7)
        200, 400, bits(0.75f), bits(1.0f),  // v2 t1: e1 (p2), e3 (p3)
        -1,  201, 0,           bits(1.5f),  // v2 t2: e1 (p5)
        401, -1,  bits(1.75f), 0,           // v2 t3: e3 (p6)
        -1,  202, 0,           bits(2.5f),  // v2 t4: expert 7 invalid; e1 (p9)
        55,  55,  55,          55,          // past Σ counts: untouched
    };
    EXPECT_EQ(meta, want);

    // A pair_row outside its expert's range [5, 7)... of e1: [2, 5): p9 -> 9 is invalid.
    in.pair_row[9] = 9;
    run();
    EXPECT_EQ(I32(meta.begin() + 6 * 4, meta.begin() + 7 * 4), (I32{-1, -1, 0, 0}));
}

// Owner side, by hand: M = 3 received rows, K = 2, a local tensor of 5 rows of H = 2.
//   meta row 0: slots -> local 2 (w 0.5), local 0 (w 2)
//   meta row 1: slot 0 none, slot 1 -> local 3 (w 1.5)
//   meta row 2: slot 0 -> local 9 (outside the 5 rows: skipped), slot 1 -> local 1 (w 0.25)
struct OwnerCase {
    I32 meta = {2, 0, bits(0.5f), bits(2.0f), -1, 3, 0, bits(1.5f), 9, 1, bits(3.0f), bits(0.25f)};
    Tensor meta_t() { return t_i32(meta, {3, 4}); }
};

TEST(EpTokens, ScatterRowsByHand) {
    OwnerCase c;
    F32 rows = {1, 2, 3, 4, 5, 6};
    F32 local(5 * 2, -9.0f);
    mf::ops::ep_scatter_rows(t_f32(local, {5, 2}), t_f32(rows, {3, 2}), c.meta_t());
    // local 0 <- row 0, 1 <- row 2, 2 <- row 0, 3 <- row 1, 4 untouched.
    EXPECT_EQ(local, (F32{1, 2, 5, 6, 1, 2, 3, 4, -9, -9}));
}

TEST(EpTokens, ReduceRowsByHand) {
    OwnerCase c;
    F32 local = {1, 0, 0, 1, 2, 2, -1, 4, 100, 100};  // y0..y4
    F32 out(3 * 2, -9.0f);
    mf::ops::ep_reduce_rows(t_f32(out, {3, 2}), t_f32(local, {5, 2}), c.meta_t(), true);
    // row 0: 0.5·y2 + 2·y0 = (1, 1) + (2, 0);  row 1: 1.5·y3;  row 2: 0.25·y1 (slot 0 skipped).
    EXPECT_EQ(out, (F32{3, 1, -1.5f, 6, 0, 0.25f}));
    mf::ops::ep_reduce_rows(t_f32(out, {3, 2}), t_f32(local, {5, 2}), c.meta_t(), false);
    EXPECT_EQ(out, (F32{3, 2, -1, 4, 0, 1}));
}

TEST(EpTokens, ScatterGradByHand) {
    OwnerCase c;
    F32 y = {1, 0, 0, 1, 2, 2, -1, 4, 100, 100};  // y0..y4
    F32 drows = {1, 2, 3, -1, 0.5f, 4};           // g0, g1, g2
    F32 dlocal(5 * 2, -9.0f), dweight(3 * 2, -9.0f);
    mf::ops::ep_scatter_grad(t_f32(dlocal, {5, 2}), t_f32(dweight, {3, 2}), t_f32(drows, {3, 2}), c.meta_t(),
                             t_f32(y, {5, 2}));
    // dlocal 2 = 0.5·g0, 0 = 2·g0, 3 = 1.5·g1, 1 = 0.25·g2, 4 untouched.
    EXPECT_EQ(dlocal, (F32{2, 4, 0.125f, 1, 0.5f, 1, 4.5f, -1.5f, -9, -9}));
    // <g0, y2> = 6, <g0, y0> = 1;  none, <g1, y3> = -7;  skipped, <g2, y1> = 4.
    EXPECT_EQ(dweight, (F32{6, 1, 0, -7, 0, 4}));
}

TEST(EpTokens, SumBlocksByHand) {
    Routing r;
    r.positions();
    F32 rows(7 * 2);
    for (int i = 0; i < 7; ++i)
        rows[2 * i] = static_cast<float>(i + 1), rows[2 * i + 1] = static_cast<float>(10 * (i + 1));
    F32 out(kN * 2, -9.0f);
    mf::ops::ep_sum_blocks(t_f32(out, {kN, 2}), t_f32(rows, {7, 2}), r.send_pos_t(), r.counts_t(), false);
    // t0: row 0;  t1: row 3;  t2: rows 1 + 4;  t3: rows 2 + 5;  t4: row 6.
    EXPECT_EQ(out, (F32{1, 10, 4, 40, 7, 70, 9, 90, 7, 70}));

    std::fill(out.begin(), out.end(), 0.5f);
    mf::ops::ep_sum_blocks(t_f32(out, {kN, 2}), t_f32(rows, {7, 2}), r.send_pos_t(), r.counts_t(), true);
    EXPECT_EQ(out, (F32{1.5f, 10.5f, 4.5f, 40.5f, 7.5f, 70.5f, 9.5f, 90.5f, 7.5f, 70.5f}));

    // A buffer of 6 rows: row 6 (t4's) is past it and skipped, so t4 sums nothing.
    mf::ops::ep_sum_blocks(t_f32(out, {kN, 2}), t_f32(rows, {6, 2}), r.send_pos_t(), r.counts_t(), false);
    EXPECT_EQ(out, (F32{1, 10, 4, 40, 7, 70, 9, 90, 0, 0}));

    // A send position at or past counts[v] is skipped: t3's position 3 in v0 (counts 3).
    r.send_pos[3] = 3;
    mf::ops::ep_sum_blocks(t_f32(out, {kN, 2}), t_f32(rows, {7, 2}), r.send_pos_t(), r.counts_t(), false);
    EXPECT_EQ(out, (F32{1, 10, 4, 40, 7, 70, 6, 60, 7, 70}));
}

TEST(EpTokens, GatherSlotsByHand) {
    Routing r;
    r.positions();
    F32 dweight_rows(7 * kK);
    for (int i = 0; i < 7; ++i)
        for (int k = 0; k < kK; ++k) dweight_rows[i * kK + k] = static_cast<float>(10 * i + k) + 0.5f;
    F32 dtopk(kN * kK, -9.0f);
    mf::ops::ep_gather_slots(t_f32(dtopk, {kN, kK}), t_f32(dweight_rows, {7, kK}), r.send_pos_t(), r.counts_t(),
                             r.topk_t(), r.dest_t());
    // t0: row 0 k0, row 0 k1;  t1: row 3, row 3;  t2: row 1 k0, row 4 k1;  t3: row 5 k0, row 2 k1;
    // t4: expert 7 -> 0, row 6 k1.
    EXPECT_EQ(dtopk, (F32{0.5f, 1.5f, 30.5f, 31.5f, 10.5f, 41.5f, 50.5f, 21.5f, 0.0f, 61.5f}));
}

// ---------------------------------------------------------------------------------------------
// round trip on random routings

struct TripCase {
    int64_t N, K, E, V, H;
};

TEST(EpTokens, RoundTripReproducesTheSlotSums) {
    std::mt19937 rng(7);
    for (const TripCase& s :
         {TripCase{1, 1, 1, 1, 3}, TripCase{37, 4, 16, 3, 5}, TripCase{200, 8, 64, 8, 16}, TripCase{64, 2, 8, 5, 7}}) {
        SCOPED_TRACE("N=" + std::to_string(s.N) + " K=" + std::to_string(s.K) + " E=" + std::to_string(s.E) +
                     " V=" + std::to_string(s.V));
        const int64_t N = s.N, K = s.K, E = s.E, V = s.V, H = s.H;
        // Routing: K distinct experts per token; experts over destinations at random, the last
        // destination without experts when V > 1 (zero tokens).
        I32 topk(N * K), dest(E), pool(E);
        std::iota(pool.begin(), pool.end(), 0);
        for (int64_t t = 0; t < N; ++t) {
            std::shuffle(pool.begin(), pool.end(), rng);
            std::copy_n(pool.begin(), K, topk.begin() + t * K);
        }
        for (auto& d : dest) d = static_cast<int32_t>(rng() % (V > 1 ? V - 1 : 1));
        F32 weight(N * K), src(N * H), dout(N * H);
        for (auto& w : weight) w = 0.5f * static_cast<float>(1 + rng() % 4);  // 0.5, 1, 1.5, 2
        for (auto& x : src) x = static_cast<float>(static_cast<int>(rng() % 17) - 8);
        for (auto& x : dout) x = static_cast<float>(static_cast<int>(rng() % 9) - 4);

        // Positions, against a brute force: the tokens bound for v listed in order.
        I32 send_pos(V * N), counts(V);
        mf::ops::ep_token_positions(t_i32(send_pos, {V, N}), t_i32(counts, {V}), t_i32(topk, {N, K}), t_i32(dest, {E}));
        for (int64_t v = 0; v < V; ++v) {
            I32 listed;
            for (int64_t t = 0; t < N; ++t) {
                const bool bound = std::any_of(topk.begin() + t * K, topk.begin() + (t + 1) * K,
                                               [&](int32_t e) { return dest[e] == v; });
                EXPECT_EQ(send_pos[v * N + t], bound ? static_cast<int32_t>(listed.size()) : -1)
                    << "v=" << v << " t=" << t;
                if (bound) listed.push_back(static_cast<int32_t>(t));
            }
            EXPECT_EQ(counts[v], static_cast<int32_t>(listed.size()));
        }
        I32 block_begin(V + 1, 0);
        for (int64_t v = 0; v < V; ++v) block_begin[v + 1] = block_begin[v] + counts[v];
        const int64_t M = block_begin[V];

        // The source's permutation and each destination's local layout: the experts of v in order,
        // each with its pairs (one source, so row_base[e] = Σ pairs of v's experts before e).
        I32 offsets(E + 1), sorted(N * K), pair_row(N * K), row_base(E), local_rows(V, 0);
        mf::cpu::moe_permute_indices(offsets.data(), sorted.data(), pair_row.data(), topk.data(), N, K, E);
        for (int64_t e = 0; e < E; ++e) {
            row_base[e] = local_rows[dest[e]];
            local_rows[dest[e]] += offsets[e + 1] - offsets[e];
        }

        // Forward: pack, then per destination scatter / expert / reduce, then sum the blocks.
        F32 rows(M * H), back(M * H);
        I32 meta(M * 2 * K);
        mf::ops::ep_pack_rows(t_f32(rows, {M, H}), t_f32(src, {N, H}), t_i32(send_pos, {V, N}), t_i32(counts, {V}));
        mf::ops::ep_pack_meta(t_i32(meta, {M, 2 * K}), t_i32(send_pos, {V, N}), t_i32(counts, {V}), t_i32(topk, {N, K}),
                              t_f32(weight, {N, K}), t_i32(pair_row, {N * K}), t_i32(offsets, {E + 1}),
                              t_i32(row_base, {E}), t_i32(dest, {E}));
        F32 dweight_rows(M * K, -1.0f), dx_blocks(M * H);
        for (const bool weighted : {false, true}) {
            for (int64_t v = 0; v < V; ++v) {
                const int64_t L = local_rows[v], b = block_begin[v], m = counts[v];
                F32 x_local(L * H, -1000.0f), y_local(L * H);
                const Tensor rows_v = t_f32(rows, {M, H}).slice_rows(b, b + m);
                const Tensor meta_v = t_i32(meta, {M, 2 * K}).slice_rows(b, b + m);
                mf::ops::ep_scatter_rows(t_f32(x_local, {L, H}), rows_v, meta_v);
                // The "expert" e of local row d scales it by e + 1.
                for (int64_t e = 0; e < E; ++e) {
                    if (dest[e] != v) continue;
                    for (int32_t d = row_base[e]; d < row_base[e] + offsets[e + 1] - offsets[e]; ++d)
                        for (int64_t h = 0; h < H; ++h)
                            y_local[d * H + h] = static_cast<float>(e + 1) * x_local[d * H + h];
                }
                mf::ops::ep_reduce_rows(t_f32(back, {M, H}).slice_rows(b, b + m), t_f32(y_local, {L, H}), meta_v,
                                        weighted);
                if (weighted) {
                    // Backward through the same destination: dlocal, dweight, and dx back to the blocks.
                    F32 drows(m * H), dlocal(L * H, -1000.0f);
                    mf::ops::ep_pack_rows(t_f32(drows, {m, H}), t_f32(dout, {N, H}),
                                          t_i32(send_pos, {V, N}).slice_rows(v, v + 1),
                                          t_i32(counts, {V}).slice_rows(v, v + 1));
                    mf::ops::ep_scatter_grad(t_f32(dlocal, {L, H}), t_f32(dweight_rows, {M, K}).slice_rows(b, b + m),
                                             t_f32(drows, {m, H}), meta_v, t_f32(y_local, {L, H}));
                    mf::ops::ep_reduce_rows(t_f32(dx_blocks, {M, H}).slice_rows(b, b + m), t_f32(dlocal, {L, H}),
                                            meta_v, false);
                }
            }
            F32 out(N * H, -1.0f);
            mf::ops::ep_sum_blocks(t_f32(out, {N, H}), t_f32(back, {M, H}), t_i32(send_pos, {V, N}), t_i32(counts, {V}),
                                   false);
            // Brute force over the slots: out[t] = Σ_k w_k (e_k + 1) src[t].
            F32 want(N * H, 0.0f);
            for (int64_t t = 0; t < N; ++t)
                for (int64_t k = 0; k < K; ++k) {
                    const float c = (weighted ? weight[t * K + k] : 1.0f) * static_cast<float>(topk[t * K + k] + 1);
                    for (int64_t h = 0; h < H; ++h) want[t * H + h] += c * src[t * H + h];
                }
            EXPECT_EQ(out, want) << (weighted ? "weighted" : "unweighted");
        }

        // Backward: dtopk_weight[t, k] = <dout[t], (e_k + 1) src[t]>; dx[t] = Σ_k w_k dout[t].
        F32 dtopk(N * K, -1.0f), dx(N * H, -1.0f);
        mf::ops::ep_gather_slots(t_f32(dtopk, {N, K}), t_f32(dweight_rows, {M, K}), t_i32(send_pos, {V, N}),
                                 t_i32(counts, {V}), t_i32(topk, {N, K}), t_i32(dest, {E}));
        mf::ops::ep_sum_blocks(t_f32(dx, {N, H}), t_f32(dx_blocks, {M, H}), t_i32(send_pos, {V, N}), t_i32(counts, {V}),
                               false);
        F32 dtopk_want(N * K, 0.0f), dx_want(N * H, 0.0f);
        for (int64_t t = 0; t < N; ++t) {
            double dot = 0.0;
            for (int64_t h = 0; h < H; ++h) dot += static_cast<double>(dout[t * H + h]) * src[t * H + h];
            for (int64_t k = 0; k < K; ++k) {
                dtopk_want[t * K + k] = static_cast<float>(dot * (topk[t * K + k] + 1));
                for (int64_t h = 0; h < H; ++h) dx_want[t * H + h] += weight[t * K + k] * dout[t * H + h];
            }
        }
        EXPECT_EQ(dtopk, dtopk_want);
        EXPECT_EQ(dx, dx_want);
    }
}

// ---------------------------------------------------------------------------------------------
// refusals

template <typename Fn>
void expect_refused(Fn&& fn, const std::string& op, const std::string& what) {
    try {
        fn();
        ADD_FAILURE() << op << ": " << what << " was accepted";
    } catch (const mf::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(op), std::string::npos) << msg;
        EXPECT_NE(msg.find(what), std::string::npos) << msg;
    }
}

TEST(EpTokens, BadArgumentsAreRefusedNamingTheOp) {
    Routing r;
    I32 counts4(4), topk33(kN * 33, 0), meta(7 * 4);
    F32 rows_f(7 * 3), src_f(kN * 3), src_wide(kN * 4), out_f(kN * 3), wf(kN * kK);
    I32 as_i32(kN * 3);
    expect_refused([&] { mf::ops::ep_token_positions(r.send_pos_t(), t_i32(counts4, {4}), r.topk_t(), r.dest_t()); },
                   "ep_token_positions", "send_pos");
    expect_refused(
        [&] {
            mf::ops::ep_token_positions(r.send_pos_t(), r.counts_t(), t_i32(topk33, {kN, 33}), r.dest_t());
        },
        "ep_token_positions", "K = 33");
    expect_refused(
        [&] {
            mf::ops::ep_token_positions(r.send_pos_t(), r.counts_t(), t_i32(r.topk, {kK, kN}), r.dest_t());
        },
        "ep_token_positions", "topk_idx");
    expect_refused(
        [&] {
            mf::ops::ep_token_positions(r.send_pos_t(), r.counts_t(), t_f32(wf, {kN, kK}), r.dest_t());
        },
        "ep_token_positions", "topk_idx is f32");
    expect_refused(
        [&] {
            mf::ops::ep_pack_rows(t_f32(rows_f, {7, 3}), t_f32(src_wide, {kN, 4}), r.send_pos_t(), r.counts_t());
        },
        "ep_pack_rows", "rows");
    expect_refused(
        [&] {
            mf::ops::ep_pack_rows(t_f32(rows_f, {7, 3}), t_i32(as_i32, {kN, 3}), r.send_pos_t(), r.counts_t());
        },
        "ep_pack_rows", "src is i32");
    expect_refused(
        [&] {
            mf::ops::ep_pack_rows(t_f32(rows_f, {7, 3}), t_f32(src_f, {3, 3}), r.send_pos_t(), r.counts_t());
        },
        "ep_pack_rows", "src");
    MetaInputs in;
    expect_refused(
        [&] {
            mf::ops::ep_pack_meta(t_i32(meta, {7, 4}), r.send_pos_t(), r.counts_t(), r.topk_t(),
                                  t_f32(in.weight, {kN, kK}), t_i32(in.pair_row, {kN * kK}), t_i32(in.offsets, {kE}),
                                  t_i32(in.row_base, {kE}), r.dest_t());
        },
        "ep_pack_meta", "expert_offsets");
    expect_refused(
        [&] {
            mf::ops::ep_pack_meta(t_i32(meta, {14, 2}), r.send_pos_t(), r.counts_t(), r.topk_t(),
                                  t_f32(in.weight, {kN, kK}), t_i32(in.pair_row, {kN * kK}),
                                  t_i32(in.offsets, {kE + 1}), t_i32(in.row_base, {kE}), r.dest_t());
        },
        "ep_pack_meta", "meta");
    OwnerCase c;
    F32 local(5 * 2), rows2(3 * 2), rows3(3 * 3), dweight(3 * 2), dweight_bad(3 * 3);
    expect_refused(
        [&] {
            mf::ops::ep_scatter_rows(t_f32(local, {5, 2}), t_f32(rows2, {2, 3}), c.meta_t());
        },
        "ep_scatter_rows", "local");
    expect_refused(
        [&] {
            mf::ops::ep_scatter_rows(t_f32(local, {5, 2}), t_f32(local, {5, 2}), c.meta_t());
        },
        "ep_scatter_rows", "meta");
    expect_refused(
        [&] {
            mf::ops::ep_scatter_grad(t_f32(local, {5, 2}), t_f32(dweight_bad, {3, 3}), t_f32(rows2, {3, 2}), c.meta_t(),
                                     t_f32(local, {5, 2}));
        },
        "ep_scatter_grad", "dweight");
    expect_refused(
        [&] {
            mf::ops::ep_scatter_grad(t_f32(local, {5, 2}), t_f32(dweight, {3, 2}), t_f32(rows2, {3, 2}), c.meta_t(),
                                     t_f32(local, {4, 2}));
        },
        "ep_scatter_grad", "y_local");
    expect_refused(
        [&] {
            mf::ops::ep_reduce_rows(t_f32(rows3, {3, 3}), t_f32(local, {5, 2}), c.meta_t(), true);
        },
        "ep_reduce_rows", "local");
    expect_refused(
        [&] {
            mf::ops::ep_sum_blocks(t_f32(out_f, {3, 3}), t_f32(rows_f, {7, 3}), r.send_pos_t(), r.counts_t(), false);
        },
        "ep_sum_blocks", "out");
    F32 dtopk(kN * kK), dwr(7 * 3);
    expect_refused(
        [&] {
            mf::ops::ep_gather_slots(t_f32(dtopk, {kN, kK}), t_f32(dwr, {7, 3}), r.send_pos_t(), r.counts_t(),
                                     r.topk_t(), r.dest_t());
        },
        "ep_gather_slots", "dweight_rows");
}

}  // namespace
