// Expert-parallel dispatch and combine (model/ep_exchange.h) with rank-coded payloads compared bit
// for bit, on either backend (CPU tensors over TCP, CUDA bf16 tensors over NCCL). Every token row
// carries (source rank, token, column numbers), so each owner checks that its local rows are exactly
// the tokens routed to its experts in the plan's layout (per chunk its own tokens, then the other
// ranks', expert-major, by source rank within an expert, each source in token order);
// the owner then writes, per local row, (expert + 1, token, owner + 1, column numbers), and combine
// must return y[t] = Σ_k w[t, k] · that row of slot k. The weights (0.75, 0.25) and the values
// (tokens < 64, column codes c mod 32) are chosen so every partial and total sum is exact in bf16, so the comparison is
// bitwise there too (a swapped slot weight, a row from the wrong owner or a missing destination all change bits).
// Routings (E = 6, K = 2): 0 spread; 1 the last rank routes only to its own experts (sends nothing
// to the peers); 2 everything to rank 0's experts (the others receive nothing, several experts get
// no rows); 3 heavier (40 tokens per rank).
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "dist_test_util.h"
#include "model/ffn_blocks.h"
#include "ops/ops.h"

namespace mf::test {

constexpr int64_t kRoundTripExperts = 6, kRoundTripK = 2;

inline int64_t round_trip_tokens(int routing, int rank) { return routing == 3 ? 40 : 5 + 3 * rank; }

// The two experts of token t on rank r.
inline std::pair<int32_t, int32_t> round_trip_experts(int routing, int r, int S, int64_t t) {
    const int64_t E = kRoundTripExperts, El = E / S;
    if (routing == 1 && r == S - 1) {  // both within its own experts
        const int64_t a = t % El;
        return {static_cast<int32_t>(r * El + a), static_cast<int32_t>(r * El + (a + 1) % El)};
    }
    if (routing == 2) {  // rank 0's experts only (El >= 2)
        const int64_t a = (t + r) % El;
        return {static_cast<int32_t>(a), static_cast<int32_t>((a + 1) % El)};
    }
    const int64_t e0 = (t * 5 + r) % E, e1 = (e0 + 1 + (t + r) % (E - 1)) % E;
    return {static_cast<int32_t>(e0), static_cast<int32_t>(e1)};
}

// Host values <-> a tensor of `t`'s dtype (f32 or bf16).
inline void round_trip_upload(const Tensor& t, const std::vector<float>& v) {
    if (t.dtype() == DType::f32) return ops::copy_from_host(t, v.data());
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16(v[i]);
    ops::copy_from_host(t, bits.data());
}

inline std::vector<float> round_trip_download(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (t.dtype() == DType::f32) {
        ops::copy_to_host(v.data(), t);
        return v;
    }
    std::vector<uint16_t> bits(v.size());
    ops::copy_to_host(bits.data(), t);
    for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(bits[i]);
    return v;
}

inline std::string ep_round_trip(parallel::Communicator& comm, Device device, int routing, int64_t chunks,
                                 int64_t cols) {
    const int S = comm.size(), me = comm.rank();
    const int64_t E = kRoundTripExperts, K = kRoundTripK, El = E / S, N = round_trip_tokens(routing, me);
    const DType act = device == Device::cuda ? DType::bf16 : DType::f32;
    const std::string name = "routing " + std::to_string(routing) + ", " + std::to_string(chunks) + " chunk(s)";
    model::MoeDims d{cols, 1, E, K, false, &comm, chunks};

    Arena measure = Arena::measuring(device);
    {
        model::MoeActs m;
        m.alloc(measure, d, N, act);
    }
    const size_t extra = static_cast<size_t>(4 * N * cols) * dtype_size(act) + 4096;
    Arena arena(measure.used() + extra, device);
    model::MoeActs a;
    a.alloc(arena, d, N, act);
    const Tensor x = arena.alloc(act, {N, cols}), y = arena.alloc(act, {N, cols});

    std::vector<int32_t> topk(static_cast<size_t>(N * K));
    std::vector<float> weights(static_cast<size_t>(N * K)), xs(static_cast<size_t>(N * cols));
    for (int64_t t = 0; t < N; ++t) {
        const auto [e0, e1] = round_trip_experts(routing, me, S, t);
        topk[static_cast<size_t>(t * K)] = e0;
        topk[static_cast<size_t>(t * K + 1)] = e1;
        weights[static_cast<size_t>(t * K)] = 0.75f;
        weights[static_cast<size_t>(t * K + 1)] = 0.25f;
        xs[static_cast<size_t>(t * cols)] = static_cast<float>(me);
        xs[static_cast<size_t>(t * cols + 1)] = static_cast<float>(t);
        xs[static_cast<size_t>(t * cols + 2)] = 0.5f;
        for (int64_t c = 3; c < cols; ++c) xs[static_cast<size_t>(t * cols + c)] = static_cast<float>(c % 32);
    }
    ops::copy_from_host(a.topk_idx, topk.data());
    ops::copy_from_host(a.topk_weight, weights.data());
    round_trip_upload(x, xs);
    ops::moe_permute_indices(a.expert_offsets, a.sorted_pair, a.pair_row, a.topk_idx, E);
    model::ep_plan(d, a);
    model::ep_dispatch(d, a, x);

    // What this rank's experts must hold: chunk by chunk (the plan's expert chunks), this rank's own
    // tokens expert-major, then the other ranks' expert-major, by source rank within an expert; each
    // source's tokens in order.
    std::vector<float> want;
    std::vector<int64_t> row_token;  // the source token of each local row (for the combine codes)
    std::vector<int64_t> row_expert;
    int64_t experts_seen = 0;
    for (const model::EpChunk& ch : a.routing.chunks) {
        rank_check(ch.first_expert == experts_seen && ch.num_experts >= 1, name + ": chunks do not tile the experts");
        experts_seen += ch.num_experts;
        for (int part = 0; part < 2; ++part)
            for (int64_t j = ch.first_expert; j < ch.first_expert + ch.num_experts; ++j) {
                const int64_t e = me * El + j;
                for (int s = 0; s < S; ++s) {
                    if ((s == me) != (part == 0)) continue;
                    for (int64_t t = 0; t < round_trip_tokens(routing, s); ++t) {
                        const auto [e0, e1] = round_trip_experts(routing, s, S, t);
                        if (e0 != e && e1 != e) continue;
                        want.push_back(static_cast<float>(s));
                        want.push_back(static_cast<float>(t));
                        want.push_back(0.5f);
                        for (int64_t c = 3; c < cols; ++c) want.push_back(static_cast<float>(c % 32));
                        row_token.push_back(t);
                        row_expert.push_back(e);
                    }
                }
            }
    }
    rank_check(experts_seen == El, name + ": chunks do not cover the local experts");
    const int64_t R = static_cast<int64_t>(row_token.size());
    rank_check(a.routing.num_local == R,
               name + ": " + std::to_string(a.routing.num_local) + " local rows, expected " + std::to_string(R));
    const Tensor x_local(a.x_local.data(), act, {R, cols}, device);
    const std::vector<float> got = R > 0 ? round_trip_download(x_local) : std::vector<float>();
    for (int64_t i = 0; i < R * cols; ++i)
        rank_check(std::memcmp(&got[static_cast<size_t>(i)], &want[static_cast<size_t>(i)], sizeof(float)) == 0,
                   name + ": local row " + std::to_string(i / cols) + " column " + std::to_string(i % cols) +
                       " holds " + std::to_string(got[static_cast<size_t>(i)]) + ", expected " +
                       std::to_string(want[static_cast<size_t>(i)]));

    // The owner's outputs, then combine.
    std::vector<float> outs(static_cast<size_t>(R * cols));
    for (int64_t i = 0; i < R; ++i) {
        float* o = &outs[static_cast<size_t>(i * cols)];
        o[0] = static_cast<float>(row_expert[static_cast<size_t>(i)] + 1);
        o[1] = static_cast<float>(row_token[static_cast<size_t>(i)]);
        o[2] = static_cast<float>(me + 1);
        for (int64_t c = 3; c < cols; ++c) o[c] = static_cast<float>(c % 32);
    }
    if (R > 0) round_trip_upload(Tensor(a.y_local.data(), act, {R, cols}, device), outs);
    round_trip_upload(y, std::vector<float>(static_cast<size_t>(N * cols), -1.0f));
    model::ep_combine(d, a, y);
    const std::vector<float> came = round_trip_download(y);
    for (int64_t t = 0; t < N; ++t) {
        const auto [e0, e1] = round_trip_experts(routing, me, S, t);
        std::vector<float> home(static_cast<size_t>(cols));
        home[0] = 0.75f * static_cast<float>(e0 + 1) + 0.25f * static_cast<float>(e1 + 1);
        home[1] = static_cast<float>(t);
        home[2] = 0.75f * static_cast<float>(e0 / El + 1) + 0.25f * static_cast<float>(e1 / El + 1);
        for (int64_t c = 3; c < cols; ++c) home[static_cast<size_t>(c)] = static_cast<float>(c % 32);
        for (int64_t c = 0; c < cols; ++c)
            rank_check(std::memcmp(&came[static_cast<size_t>(t * cols + c)], &home[static_cast<size_t>(c)],
                                   sizeof(float)) == 0,
                       name + ": combined token " + std::to_string(t) + " column " + std::to_string(c) + " is " +
                           std::to_string(came[static_cast<size_t>(t * cols + c)]) + ", expected " +
                           std::to_string(home[static_cast<size_t>(c)]));
    }
    return name + ": " + std::to_string(N) + " tokens, sent " + std::to_string(a.routing.num_sent) +
           " token rows, received " + std::to_string(a.routing.num_received) + ", computed " + std::to_string(R) +
           " expert rows; bit for bit\n";
}

}  // namespace mf::test
