// GPU parity of the MoE routing kernels against their CPU references (kernels/cpu/router.h,
// kernels/cpu/moe_permute.h): router forward/backward, the aux-loss statistics, the permutation
// indices (bit for bit), gather and unpermute. Shapes cover E not a multiple of 32, K = E, experts
// with zero tokens, a single hot expert, many tiles of pairs, and H not a multiple of 8.
// Tolerances: test_cuda_common.h. MF_BENCH=1 adds figures at 16384 tokens, E=128, K=8, H=2048.
#include <gtest/gtest.h>

#include <numeric>

#include "kernels/cpu/moe_permute.h"
#include "kernels/cpu/router.h"
#include "kernels/cuda/moe_permute.cuh"
#include "kernels/cuda/router.cuh"
#include "test_cuda_common.h"

namespace {

using mf::cuda::bf16;
using namespace mf::test;

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// ---------------------------------------------------------------------------------------------
// router

struct RouterCase {
    int64_t N, E, K;
};

const RouterCase kRouterCases[] = {{37, 128, 8},  {50, 60, 4}, {9, 8, 8},     {20, 256, 8},
                                   {5, 1024, 32}, {3, 1, 1},   {2000, 128, 8}};

// Logits whose probabilities are well separated (distinct values 0.05 apart, shuffled per row), so
// the top-k order cannot depend on fp32 rounding; with `ties`, values come from {0, 0.5, 1} and
// most rows hold exact ties, which both sides must break toward the lower index.
std::vector<float> router_logits(std::mt19937& rng, const RouterCase& s, bool ties) {
    std::vector<float> logits(static_cast<size_t>(s.N * s.E));
    std::vector<int> perm(static_cast<size_t>(s.E));
    for (int64_t n = 0; n < s.N; ++n) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int64_t e = 0; e < s.E; ++e) {
            logits[n * s.E + e] =
                ties ? 0.5f * static_cast<float>(rng() % 3) : 0.05f * static_cast<float>(perm[e]) - 2.0f;
        }
    }
    return logits;
}

TEST(CudaRouter, ForwardMatchesCpuIncludingTies) {
    std::mt19937 rng(20);
    for (const RouterCase& s : kRouterCases) {
        for (const bool norm : {false, true}) {
            for (const bool ties : {false, true}) {
                const std::string name = std::string("router fwd") + (norm ? " norm" : "") + (ties ? " ties" : "") +
                                         " N=" + std::to_string(s.N) + " E=" + std::to_string(s.E) +
                                         " K=" + std::to_string(s.K);
                const std::vector<float> logits = router_logits(rng, s, ties);
                std::vector<float> probs_ref(logits.size()), w_ref(static_cast<size_t>(s.N * s.K));
                std::vector<int32_t> idx_ref(w_ref.size());
                mf::cpu::router_forward(probs_ref.data(), idx_ref.data(), w_ref.data(), logits.data(), s.N, s.E, s.K,
                                        norm);

                DeviceBuffer d_logits = device_copy(logits), d_probs(logits.size() * 4), d_idx(idx_ref.size() * 4),
                             d_w(w_ref.size() * 4);
                d_probs.poison();
                d_idx.poison();
                d_w.poison();
                mf::cuda::router_forward(d_probs.as<float>(), d_idx.as<int32_t>(), d_w.as<float>(),
                                         d_logits.as<float>(), s.N, s.E, s.K, norm, nullptr);
                device_sync();
                expect_close_f32(download<float>(d_probs.as<void>(), probs_ref.size()), probs_ref, name + " probs");
                expect_exact(download<int32_t>(d_idx.as<void>(), idx_ref.size()), idx_ref, name + " topk_idx");
                expect_close_f32(download<float>(d_w.as<void>(), w_ref.size()), w_ref, name + " topk_weight");
            }
        }
    }
}

TEST(CudaRouter, BackwardMatchesCpu) {
    std::mt19937 rng(21);
    for (const RouterCase& s : kRouterCases) {
        for (const bool norm : {false, true}) {
            for (const bool with_dprobs : {false, true}) {
                const std::string name = std::string("router bwd") + (norm ? " norm" : "") +
                                         (with_dprobs ? " +dprobs" : "") + " N=" + std::to_string(s.N) +
                                         " E=" + std::to_string(s.E) + " K=" + std::to_string(s.K);
                const std::vector<float> logits = router_logits(rng, s, false);
                std::vector<float> probs(logits.size()), w(static_cast<size_t>(s.N * s.K));
                std::vector<int32_t> idx(w.size());
                mf::cpu::router_forward(probs.data(), idx.data(), w.data(), logits.data(), s.N, s.E, s.K, norm);
                const std::vector<float> dw = random_f32(rng, w.size());
                const std::vector<float> dprobs = random_f32(rng, probs.size(), -0.1f, 0.1f);
                std::vector<float> ref(logits.size());
                mf::cpu::router_backward(ref.data(), dw.data(), with_dprobs ? dprobs.data() : nullptr, probs.data(),
                                         idx.data(), s.N, s.E, s.K, norm);

                DeviceBuffer d_probs = device_copy(probs), d_idx = device_copy(idx), d_dw = device_copy(dw),
                             d_dprobs = device_copy(dprobs), d_dlogits(ref.size() * 4);
                d_dlogits.poison();
                mf::cuda::router_backward(d_dlogits.as<float>(), d_dw.as<float>(),
                                          with_dprobs ? d_dprobs.as<float>() : nullptr, d_probs.as<float>(),
                                          d_idx.as<int32_t>(), s.N, s.E, s.K, norm, nullptr);
                device_sync();
                expect_reduction(download<float>(d_dlogits.as<void>(), ref.size()), ref, ref, name + " dlogits");
            }
        }
    }
}

TEST(CudaRouter, AuxStatsAccumulateOverLayersDeterministically) {
    std::mt19937 rng(22);
    for (const RouterCase& s : {RouterCase{37, 128, 8}, RouterCase{3000, 60, 4}, RouterCase{20000, 128, 8}}) {
        const std::string name = "router aux stats N=" + std::to_string(s.N) + " E=" + std::to_string(s.E);
        std::vector<float> mask(static_cast<size_t>(s.N));
        for (auto& m : mask) m = rng() % 4 == 0 ? 0.0f : 1.0f;
        std::vector<double> counts_ref(static_cast<size_t>(s.E), 0.0), sums_ref(static_cast<size_t>(s.E), 0.0);
        DeviceBuffer d_counts(static_cast<size_t>(s.E) * 4), d_sums(static_cast<size_t>(s.E) * 4);
        d_counts.zero();
        d_sums.zero();
        DeviceBuffer d_mask = device_copy(mask);
        const size_t sb = mf::cuda::router_aux_stats_scratch_bytes(s.N, s.E);
        DeviceBuffer scratch(sb);
        std::vector<float> first_counts, first_sums;
        for (int layer = 0; layer < 2; ++layer) {
            const std::vector<float> logits = router_logits(rng, s, false);
            std::vector<float> probs(logits.size()), w(static_cast<size_t>(s.N * s.K));
            std::vector<int32_t> idx(w.size());
            mf::cpu::router_forward(probs.data(), idx.data(), w.data(), logits.data(), s.N, s.E, s.K, true);
            // As the CPU model computes them (qwen3_moe.cpp): rows with mask 0 are skipped.
            for (int64_t t = 0; t < s.N; ++t) {
                if (mask[t] == 0.0f) continue;
                for (int64_t k = 0; k < s.K; ++k) counts_ref[idx[t * s.K + k]] += 1.0;
                for (int64_t e = 0; e < s.E; ++e) sums_ref[e] += probs[t * s.E + e];
            }
            DeviceBuffer d_probs = device_copy(probs), d_idx = device_copy(idx);
            scratch.poison();
            mf::cuda::router_aux_stats(d_counts.as<float>(), d_sums.as<float>(), d_probs.as<float>(),
                                       d_idx.as<int32_t>(), d_mask.as<float>(), s.N, s.E, s.K, scratch.as<void>(), sb,
                                       nullptr);
        }
        device_sync();
        const std::vector<float> counts = download<float>(d_counts.as<void>(), counts_ref.size());
        const std::vector<float> sums = download<float>(d_sums.as<void>(), sums_ref.size());
        expect_exact(counts, std::vector<float>(counts_ref.begin(), counts_ref.end()), name + " counts");
        const std::vector<float> sums_ref_f(sums_ref.begin(), sums_ref.end());
        expect_reduction(sums, sums_ref_f, sums_ref_f, name + " prob_sums");

        // aux dprobs from these counts
        const double scale = 0.001 * static_cast<double>(s.E) / (1000.0 * 1000.0);
        DeviceBuffer d_dp(static_cast<size_t>(s.N * s.E) * 4);
        d_dp.poison();
        mf::cuda::router_aux_dprobs(d_dp.as<float>(), d_counts.as<float>(), d_mask.as<float>(), scale, s.N, s.E,
                                    nullptr);
        device_sync();
        std::vector<float> dp_ref(static_cast<size_t>(s.N * s.E));
        for (int64_t t = 0; t < s.N; ++t)
            for (int64_t e = 0; e < s.E; ++e)
                dp_ref[t * s.E + e] = static_cast<float>(scale * static_cast<double>(counts[e])) * mask[t];
        expect_exact(download<float>(d_dp.as<void>(), dp_ref.size()), dp_ref, name + " aux dprobs");
    }
}

// ---------------------------------------------------------------------------------------------
// permutation

struct PermuteCase {
    int64_t N, K, E;
    int64_t used_experts;  // top-k drawn from experts [0, used_experts): the rest get no tokens
    bool distinct;         // K distinct experts per token (as the router gives), else any
};

const PermuteCase kPermuteCases[] = {{1, 1, 1, 1, true},      {37, 8, 128, 64, true},     {16384, 8, 128, 128, true},
                                     {1000, 2, 7, 7, false},  {513, 3, 4096, 4096, true}, {100, 6, 64, 1, false},
                                     {2049, 4, 16, 16, false}};

std::vector<int32_t> random_topk(std::mt19937& rng, const PermuteCase& s) {
    std::vector<int32_t> idx(static_cast<size_t>(s.N * s.K));
    std::vector<int32_t> pool(static_cast<size_t>(s.used_experts));
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t t = 0; t < s.N; ++t) {
        if (s.distinct && s.K <= s.used_experts) {
            std::shuffle(pool.begin(), pool.end(), rng);
            for (int64_t k = 0; k < s.K; ++k) idx[t * s.K + k] = pool[k];
        } else {
            for (int64_t k = 0; k < s.K; ++k) idx[t * s.K + k] = static_cast<int32_t>(rng() % s.used_experts);
        }
    }
    return idx;
}

TEST(CudaMoePermute, IndicesMatchCpuBitForBit) {
    std::mt19937 rng(23);
    for (const PermuteCase& s : kPermuteCases) {
        const std::string name = "permute indices N=" + std::to_string(s.N) + " K=" + std::to_string(s.K) +
                                 " E=" + std::to_string(s.E) + " used=" + std::to_string(s.used_experts);
        const std::vector<int32_t> topk = random_topk(rng, s);
        const size_t P = topk.size();
        std::vector<int32_t> off_ref(static_cast<size_t>(s.E + 1)), sp_ref(P), pr_ref(P);
        mf::cpu::moe_permute_indices(off_ref.data(), sp_ref.data(), pr_ref.data(), topk.data(), s.N, s.K, s.E);

        DeviceBuffer d_topk = device_copy(topk), d_off(off_ref.size() * 4), d_sp(P * 4), d_pr(P * 4);
        const size_t sb = mf::cuda::moe_permute_indices_scratch_bytes(s.N, s.K, s.E);
        DeviceBuffer scratch(sb);
        for (int run = 0; run < 2; ++run) {  // the second run must give the same bits again
            d_off.poison();
            d_sp.poison();
            d_pr.poison();
            scratch.poison();
            mf::cuda::moe_permute_indices(d_off.as<int32_t>(), d_sp.as<int32_t>(), d_pr.as<int32_t>(),
                                          d_topk.as<int32_t>(), s.N, s.K, s.E, scratch.as<void>(), sb, nullptr);
            device_sync();
            const std::string tag = name + (run == 0 ? "" : " rerun");
            expect_exact(download<int32_t>(d_off.as<void>(), off_ref.size()), off_ref, tag + " offsets");
            expect_exact(download<int32_t>(d_sp.as<void>(), P), sp_ref, tag + " sorted_pair");
            expect_exact(download<int32_t>(d_pr.as<void>(), P), pr_ref, tag + " pair_row");
        }
    }
}

TEST(CudaMoePermute, IndicesDropPairsWithInvalidExperts) {
    const int64_t N = 4, K = 2, E = 3;
    const std::vector<int32_t> topk = {0, 2, -1, 1, 2, 3, 0, 1};
    // Valid pairs by expert, in pair order: e0: 0, 6; e1: 3, 7; e2: 1, 4.
    const std::vector<int32_t> off_want = {0, 2, 4, 6};
    const std::vector<int32_t> sp_want = {0, 6, 3, 7, 1, 4, -1, -1};
    const std::vector<int32_t> pr_want = {0, 4, -1, 2, 5, -1, 1, 3};
    DeviceBuffer d_topk = device_copy(topk), d_off(16), d_sp(32), d_pr(32);
    const size_t sb = mf::cuda::moe_permute_indices_scratch_bytes(N, K, E);
    DeviceBuffer scratch(sb);
    mf::cuda::moe_permute_indices(d_off.as<int32_t>(), d_sp.as<int32_t>(), d_pr.as<int32_t>(), d_topk.as<int32_t>(), N,
                                  K, E, scratch.as<void>(), sb, nullptr);
    device_sync();
    expect_exact(download<int32_t>(d_off.as<void>(), 4), off_want, "permute invalid experts offsets");
    expect_exact(download<int32_t>(d_sp.as<void>(), 8), sp_want, "permute invalid experts sorted_pair");
    expect_exact(download<int32_t>(d_pr.as<void>(), 8), pr_want, "permute invalid experts pair_row");
}

struct MoveCase {
    int64_t N, K, E, H;
};

TEST(CudaMoePermute, GatherAndUnpermuteMatchCpu) {
    std::mt19937 rng(24);
    for (const MoveCase& s :
         {MoveCase{37, 8, 128, 2048}, MoveCase{50, 3, 7, 13}, MoveCase{300, 4, 16, 64}, MoveCase{5, 32, 40, 24}}) {
        const std::string name = "N=" + std::to_string(s.N) + " K=" + std::to_string(s.K) + " H=" + std::to_string(s.H);
        const PermuteCase pc{s.N, s.K, s.E, s.E, true};
        const std::vector<int32_t> topk = random_topk(rng, pc);
        const size_t P = topk.size(), nx = static_cast<size_t>(s.N * s.H), np = P * static_cast<size_t>(s.H);
        std::vector<int32_t> off(static_cast<size_t>(s.E + 1)), sp(P), pr(P);
        mf::cpu::moe_permute_indices(off.data(), sp.data(), pr.data(), topk.data(), s.N, s.K, s.E);
        const std::vector<float> x = random_bf16(rng, nx), y_perm = random_bf16(rng, np);
        const std::vector<float> dx_perm = random_bf16(rng, np), dout = random_bf16(rng, nx);
        const std::vector<float> weights = random_f32(rng, P, 0.0f, 1.0f);
        DeviceBuffer d_sp = device_copy(sp), d_pr = device_copy(pr), d_w = device_copy(weights);
        DeviceBuffer d_x = device_bf16(x), d_y = device_bf16(y_perm), d_dxp = device_bf16(dx_perm),
                     d_dout = device_bf16(dout);

        // gather forward: exact row copies
        std::vector<float> xp_ref(np);
        mf::cpu::moe_gather_forward(xp_ref.data(), x.data(), sp.data(), s.N, s.K, s.H);
        DeviceBuffer d_xp(np * 2);
        d_xp.poison();
        mf::cuda::moe_gather_forward(d_xp.as<bf16>(), d_x.as<bf16>(), d_sp.as<int32_t>(), s.N, s.K, s.H, nullptr);
        device_sync();
        expect_exact(download_bf16(d_xp.as<void>(), np), xp_ref, "gather fwd " + name);

        // gather backward: = and +=
        for (const bool accumulate : {false, true}) {
            const std::vector<float> dx0 = accumulate ? random_bf16(rng, nx) : std::vector<float>(nx, 0.0f);
            std::vector<float> ref = dx0;
            mf::cpu::moe_gather_backward(ref.data(), dx_perm.data(), pr.data(), s.N, s.K, s.H);
            DeviceBuffer d_dx = device_bf16(dx0);
            if (!accumulate) d_dx.poison();
            mf::cuda::moe_gather_backward(d_dx.as<bf16>(), accumulate, d_dxp.as<bf16>(), d_pr.as<int32_t>(), s.N, s.K,
                                          s.H, nullptr);
            device_sync();
            expect_reduction_bf16_out(download_bf16(d_dx.as<void>(), nx), ref,
                                      std::string("gather bwd ") + (accumulate ? "+= " : "= ") + name);
        }

        // unpermute forward
        std::vector<float> out_ref(nx);
        mf::cpu::moe_unpermute_forward(out_ref.data(), y_perm.data(), weights.data(), pr.data(), s.N, s.K, s.H);
        DeviceBuffer d_out(nx * 2);
        d_out.poison();
        mf::cuda::moe_unpermute_forward(d_out.as<bf16>(), d_y.as<bf16>(), d_w.as<float>(), d_pr.as<int32_t>(), s.N, s.K,
                                        s.H, nullptr);
        device_sync();
        expect_reduction_bf16_out(download_bf16(d_out.as<void>(), nx), out_ref, "unpermute fwd " + name);

        // unpermute backward
        std::vector<float> dyp_ref(np), dw_ref(P);
        mf::cpu::moe_unpermute_backward(dyp_ref.data(), dw_ref.data(), dout.data(), y_perm.data(), weights.data(),
                                        pr.data(), s.N, s.K, s.H);
        DeviceBuffer d_dyp(np * 2), d_dw(P * 4);
        d_dyp.poison();
        d_dw.poison();
        mf::cuda::moe_unpermute_backward(d_dyp.as<bf16>(), d_dw.as<float>(), d_dout.as<bf16>(), d_y.as<bf16>(),
                                         d_w.as<float>(), d_pr.as<int32_t>(), s.N, s.K, s.H, nullptr);
        device_sync();
        expect_close_bf16(download_bf16(d_dyp.as<void>(), np), dyp_ref, "unpermute bwd dy_perm " + name);
        expect_reduction(download<float>(d_dw.as<void>(), P), dw_ref, dw_ref, "unpermute bwd dtopk_weight " + name);
    }
}

// ---------------------------------------------------------------------------------------------
// benchmarks (MF_BENCH=1)

TEST(CudaMoeBench, Qwen3MoeShapes) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1 for the benchmark";
    std::mt19937 rng(25);
    const int64_t N = 16384, E = 128, K = 8, H = 2048;
    const size_t P = static_cast<size_t>(N * K);
    // router
    const RouterCase rc{N, E, K};
    DeviceBuffer logits = device_copy(router_logits(rng, rc, false));
    DeviceBuffer probs(static_cast<size_t>(N * E) * 4), idx(P * 4), w(P * 4), dlogits(static_cast<size_t>(N * E) * 4);
    const double rows_bytes = static_cast<double>(N * E) * 4;
    double us = time_us([&] {
        mf::cuda::router_forward(probs.as<float>(), idx.as<int32_t>(), w.as<float>(), logits.as<float>(), N, E, K, true,
                                 nullptr);
    });
    report_bandwidth("router_forward N=16384 E=128 K=8", us, 2 * rows_bytes + 8.0 * P);
    us = time_us([&] {
        mf::cuda::router_backward(dlogits.as<float>(), w.as<float>(), probs.as<float>(), probs.as<float>(),
                                  idx.as<int32_t>(), N, E, K, true, nullptr);
    });
    report_bandwidth("router_backward (+dprobs)", us, 3 * rows_bytes + 8.0 * P);
    DeviceBuffer counts(E * 4), sums(E * 4);
    counts.zero();
    sums.zero();
    const size_t sb_aux = mf::cuda::router_aux_stats_scratch_bytes(N, E);
    DeviceBuffer scratch_aux(sb_aux);
    us = time_us([&] {
        mf::cuda::router_aux_stats(counts.as<float>(), sums.as<float>(), probs.as<float>(), idx.as<int32_t>(), nullptr,
                                   N, E, K, scratch_aux.as<void>(), sb_aux, nullptr);
    });
    report_bandwidth("router_aux_stats", us, rows_bytes + 4.0 * P);

    // permutation indices
    DeviceBuffer off(static_cast<size_t>(E + 1) * 4), sp(P * 4), pr(P * 4);
    const size_t sb = mf::cuda::moe_permute_indices_scratch_bytes(N, K, E);
    DeviceBuffer scratch(sb);
    us = time_us([&] {
        mf::cuda::moe_permute_indices(off.as<int32_t>(), sp.as<int32_t>(), pr.as<int32_t>(), idx.as<int32_t>(), N, K, E,
                                      scratch.as<void>(), sb, nullptr);
    });
    report_bandwidth("moe_permute_indices pairs=131072", us, 12.0 * P);

    // data movement at H = 2048
    DeviceBuffer x(static_cast<size_t>(N * H) * 2), xp(P * H * 2), dyp(P * H * 2);
    upload_bf16(x.as<void>(), random_bf16(rng, static_cast<size_t>(N * H)));
    upload_bf16(xp.as<void>(), random_bf16(rng, P * H));
    const double act = static_cast<double>(N * H) * 2, perm = static_cast<double>(P * H) * 2;
    us = time_us(
        [&] { mf::cuda::moe_gather_forward(dyp.as<bf16>(), x.as<bf16>(), sp.as<int32_t>(), N, K, H, nullptr); });
    report_bandwidth("moe_gather_forward H=2048 (x read once per slot)", us, 2 * perm);
    us = time_us(
        [&] { mf::cuda::moe_gather_backward(x.as<bf16>(), true, xp.as<bf16>(), pr.as<int32_t>(), N, K, H, nullptr); });
    report_bandwidth("moe_gather_backward (+=)", us, perm + 2 * act);
    us = time_us([&] {
        mf::cuda::moe_unpermute_forward(x.as<bf16>(), xp.as<bf16>(), w.as<float>(), pr.as<int32_t>(), N, K, H, nullptr);
    });
    report_bandwidth("moe_unpermute_forward", us, perm + act);
    us = time_us([&] {
        mf::cuda::moe_unpermute_backward(dyp.as<bf16>(), dlogits.as<float>(), x.as<bf16>(), xp.as<bf16>(),
                                         w.as<float>(), pr.as<int32_t>(), N, K, H, nullptr);
    });
    report_bandwidth("moe_unpermute_backward", us, 2 * perm + act);
}

}  // namespace

// Group sizes to offsets (jax.lax.ragged_dot's group_sizes) and the rows past the last group: the
// GPU against the CPU reference, bitwise; negative sizes, sums past the rows and past int32 included.
TEST(CudaMoePermute, GroupOffsetsAndRowsPastTheGroupsMatchCpu) {
    std::mt19937 rng(21);
    for (const int64_t E : {int64_t{0}, int64_t{3}, int64_t{31}, int64_t{33}, int64_t{1000}}) {
        for (const int64_t M : {int64_t{0}, int64_t{50}, int64_t{100000}}) {
            std::uniform_int_distribution<int32_t> size(-3, 200);
            std::vector<int32_t> sizes(static_cast<size_t>(E));
            for (int32_t& s : sizes) s = size(rng);
            if (E > 2) sizes[1] = 2147483000;  // (the running sum passes int32 before the clamp)
            std::vector<int32_t> ref(static_cast<size_t>(E + 1));
            mf::cpu::group_offsets(ref.data(), sizes.data(), E, M);
            DeviceBuffer d_sizes = device_copy(sizes.empty() ? std::vector<int32_t>{0} : sizes);
            DeviceBuffer d_off((E + 1) * sizeof(int32_t));
            mf::cuda::group_offsets(d_off.as<int32_t>(), d_sizes.as<int32_t>(), E, M, nullptr);
            device_sync();
            const std::string tag = "E=" + std::to_string(E) + " M=" + std::to_string(M);
            expect_exact(download<int32_t>(d_off.as<void>(), ref.size()), ref, "group_offsets " + tag);
        }
    }
    for (const int64_t C : {int64_t{16}, int64_t{3}}) {
        for (const int32_t end : {0, 7, 12, 40, -5}) {
            const int64_t M = 12;
            std::vector<float> x(static_cast<size_t>(M * C));
            for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) - 6.0f;
            std::vector<float> ref = x;
            const std::vector<int32_t> offsets = {0, 2, end};
            mf::cpu::zero_rows_past_groups(ref.data(), offsets.data(), 2, M, C);
            DeviceBuffer d_x(x.size() * 2), d_off = device_copy(offsets);
            upload_bf16(d_x.as<void>(), x);
            mf::cuda::zero_rows_past_groups(d_x.as<bf16>(), d_off.as<int32_t>(), 2, M, C, nullptr);
            device_sync();
            expect_exact(download_bf16(d_x.as<void>(), x.size()), ref,
                         "zero_rows_past_groups C=" + std::to_string(C) + " end=" + std::to_string(end));
        }
    }
}
