// GPU parity of the expert-parallel token exchange kernels (kernels/cuda/ep_tokens.cuh) with the
// CPU reference (kernels/cpu/ep_tokens.h), on random routings:
//   exact (bit for bit)   positions and counts, pack_rows, pack_meta, scatter_rows, gather_slots, and
//                         every buffer row an op must leave alone;
//   reduction rule        reduce_rows, sum_blocks (= and +=): bf16 outputs of fp32 sums
//                         (test_cuda_common.h); scatter_grad's dweight: fp32 output of an fp32 dot;
//   elementwise bf16      scatter_grad's dlocal (one product).
// Shapes: V = 1, V = 8 and V > 32 (two lane batches), destinations without experts (zero tokens),
// N not a multiple of the 8192-token scan tile and several tiles, H not a multiple of 8 (scalar
// path), K = 1 and K = 32, a few expert ids and destinations out of range, send positions out of
// range, buffers cut shorter than Σ counts, meta rows outside the local tensor. Then the ops::
// entries on device tensors against the same entries on the CPU. MF_BENCH=1 adds timings at
// N = 16384, K = 8, E = 128, H = 2048, V = 2.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "kernels/cpu/ep_tokens.h"
#include "kernels/cpu/moe_permute.h"
#include "kernels/cuda/ep_tokens.cuh"
#include "ops/ops.h"
#include "test_cuda_common.h"

namespace {

using mf::cuda::bf16;
using namespace mf::test;
using I32 = std::vector<int32_t>;
using F32 = std::vector<float>;

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

struct EpCase {
    int64_t N, K, E, V, H;
    int64_t empty_dests;  // the last empty_dests destinations own no expert
};

const EpCase kCases[] = {{1, 1, 1, 1, 8, 0},       {37, 8, 128, 1, 2048, 0},  {5000, 8, 128, 8, 72, 3},
                         {4100, 4, 64, 3, 13, 1},  {300, 32, 64, 5, 24, 1},   {2000, 6, 60, 64, 16, 20},
                         {9000, 2, 16, 40, 8, 30}, {3000, 8, 128, 2, 2048, 0}};

std::string case_name(const EpCase& s) {
    return "N=" + std::to_string(s.N) + " K=" + std::to_string(s.K) + " E=" + std::to_string(s.E) +
           " V=" + std::to_string(s.V) + " H=" + std::to_string(s.H);
}

// Random routing: K distinct experts per token where K <= E; about 1% of the slots hold an expert
// id out of range, one expert (when E > 2) maps to a destination out of range.
struct Routing {
    I32 topk, dest;
};

Routing random_routing(std::mt19937& rng, const EpCase& s, bool invalid) {
    Routing r;
    r.topk.resize(static_cast<size_t>(s.N * s.K));
    r.dest.resize(static_cast<size_t>(s.E));
    I32 pool(static_cast<size_t>(s.E));
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t t = 0; t < s.N; ++t) {
        if (s.K <= s.E) std::shuffle(pool.begin(), pool.end(), rng);
        for (int64_t k = 0; k < s.K; ++k) {
            int32_t e = s.K <= s.E ? pool[k] : static_cast<int32_t>(rng() % s.E);
            if (invalid && rng() % 100 == 0) e = rng() % 2 == 0 ? -1 : static_cast<int32_t>(s.E + rng() % 5);
            r.topk[t * s.K + k] = e;
        }
    }
    const int64_t owning = std::max<int64_t>(s.V - s.empty_dests, 1);
    for (auto& d : r.dest) d = static_cast<int32_t>(rng() % owning);
    if (invalid && s.E > 2) r.dest[1] = static_cast<int32_t>(s.V + 3);
    return r;
}

// The source's permutation of the valid pairs (a counting sort written here: the CPU kernel
// refuses invalid experts): expert_offsets [E + 1], pair_row [N·K] (-1 for invalid experts).
void permutation(const Routing& r, int64_t E, I32& offsets, I32& pair_row) {
    offsets.assign(static_cast<size_t>(E + 1), 0);
    pair_row.assign(r.topk.size(), -1);
    for (const int32_t e : r.topk)
        if (e >= 0 && e < E) ++offsets[e + 1];
    for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    I32 cursor(offsets.begin(), offsets.end() - 1);
    for (size_t p = 0; p < r.topk.size(); ++p)
        if (r.topk[p] >= 0 && r.topk[p] < E) pair_row[p] = cursor[r.topk[p]]++;
}

I32 random_i32(std::mt19937& rng, size_t n, int32_t lo, int32_t hi) {
    I32 v(n);
    for (auto& x : v) x = lo + static_cast<int32_t>(rng() % static_cast<uint32_t>(hi - lo));
    return v;
}

// ---------------------------------------------------------------------------------------------
// source side: positions, pack, sum, gather

TEST(CudaEpTokens, SourceSideMatchesCpu) {
    std::mt19937 rng(31);
    for (const EpCase& s : kCases) {
        for (const bool corrupt : {false, true}) {
            const std::string name = case_name(s) + (corrupt ? " corrupt" : "");
            const Routing r = random_routing(rng, s, corrupt);
            const size_t NV = static_cast<size_t>(s.N * s.V), P = r.topk.size();

            // positions
            I32 pos_ref(NV), counts_ref(static_cast<size_t>(s.V));
            mf::cpu::ep_token_positions(pos_ref.data(), counts_ref.data(), r.topk.data(), r.dest.data(), s.N, s.K, s.E,
                                        s.V);
            DeviceBuffer d_topk = device_copy(r.topk), d_dest = device_copy(r.dest), d_pos(NV * 4),
                         d_counts(counts_ref.size() * 4);
            d_pos.poison();
            d_counts.poison();
            mf::cuda::ep_token_positions(d_pos.as<int32_t>(), d_counts.as<int32_t>(), d_topk.as<int32_t>(),
                                         d_dest.as<int32_t>(), s.N, s.K, s.E, s.V, nullptr);
            device_sync();
            expect_exact(download<int32_t>(d_pos.as<void>(), NV), pos_ref, "positions " + name);
            expect_exact(download<int32_t>(d_counts.as<void>(), counts_ref.size()), counts_ref, "counts " + name);
            const int64_t M = std::accumulate(counts_ref.begin(), counts_ref.end(), int64_t{0});

            // Corrupt: a few send positions out of range (at or past counts, below -1); and buffers
            // 3 rows short of Σ counts. Both sides must skip the same entries.
            I32 pos = pos_ref;
            if (corrupt) {
                for (int i = 0; i < 5; ++i) {
                    const size_t at = rng() % NV;
                    const int64_t v = static_cast<int64_t>(at) / s.N;
                    pos[at] = i % 2 == 0 ? counts_ref[v] + static_cast<int32_t>(rng() % 3) : -5;
                }
                upload(d_pos.as<void>(), pos);
            }
            const int64_t num_rows = corrupt ? std::max<int64_t>(M - 3, 0) : M + 2;

            // pack_rows: every buffer row compared (rows no token names keep their values)
            const F32 src = random_bf16(rng, static_cast<size_t>(s.N * s.H));
            F32 rows_ref = random_bf16(rng, static_cast<size_t>(num_rows * s.H));
            DeviceBuffer d_src = device_bf16(src), d_rows = device_bf16(rows_ref);
            mf::cpu::ep_pack_rows(rows_ref.data(), num_rows, src.data(), pos.data(), counts_ref.data(), s.N, s.V, s.H);
            mf::cuda::ep_pack_rows(d_rows.as<bf16>(), num_rows, d_src.as<bf16>(), d_pos.as<int32_t>(),
                                   d_counts.as<int32_t>(), s.N, s.V, s.H, nullptr);
            device_sync();
            expect_exact(download_bf16(d_rows.as<void>(), rows_ref.size()), rows_ref, "pack_rows " + name);

            // pack_meta (row_base arbitrary: pack_meta only adds it)
            I32 offsets, pair_row;
            permutation(r, s.E, offsets, pair_row);
            if (corrupt) pair_row[rng() % P] = static_cast<int32_t>(P + 1);  // outside its expert's range
            const I32 row_base = random_i32(rng, static_cast<size_t>(s.E), 0, 100000);
            const F32 weight = random_f32(rng, P, 0.0f, 1.0f);
            I32 meta_ref = random_i32(rng, static_cast<size_t>(num_rows * 2 * s.K), -50, 50);
            DeviceBuffer d_meta = device_copy(meta_ref), d_weight = device_copy(weight), d_pair = device_copy(pair_row),
                         d_off = device_copy(offsets), d_base = device_copy(row_base);
            mf::cpu::ep_pack_meta(meta_ref.data(), num_rows, pos.data(), counts_ref.data(), r.topk.data(),
                                  weight.data(), pair_row.data(), offsets.data(), row_base.data(), r.dest.data(), s.N,
                                  s.K, s.E, s.V);
            mf::cuda::ep_pack_meta(d_meta.as<int32_t>(), num_rows, d_pos.as<int32_t>(), d_counts.as<int32_t>(),
                                   d_topk.as<int32_t>(), d_weight.as<float>(), d_pair.as<int32_t>(),
                                   d_off.as<int32_t>(), d_base.as<int32_t>(), d_dest.as<int32_t>(), s.N, s.K, s.E, s.V,
                                   nullptr);
            device_sync();
            expect_exact(download<int32_t>(d_meta.as<void>(), meta_ref.size()), meta_ref, "pack_meta " + name);

            // sum_blocks, = and +=
            const F32 blocks = random_bf16(rng, static_cast<size_t>(num_rows * s.H));
            DeviceBuffer d_blocks = device_bf16(blocks);
            for (const bool accumulate : {false, true}) {
                F32 out_ref = accumulate ? random_bf16(rng, src.size()) : F32(src.size(), 0.0f);
                DeviceBuffer d_out = device_bf16(out_ref);
                if (!accumulate) d_out.poison();
                mf::cpu::ep_sum_blocks(out_ref.data(), accumulate, blocks.data(), num_rows, pos.data(),
                                       counts_ref.data(), s.N, s.V, s.H);
                mf::cuda::ep_sum_blocks(d_out.as<bf16>(), accumulate, d_blocks.as<bf16>(), num_rows,
                                        d_pos.as<int32_t>(), d_counts.as<int32_t>(), s.N, s.V, s.H, nullptr);
                device_sync();
                expect_reduction_bf16_out(download_bf16(d_out.as<void>(), out_ref.size()), out_ref,
                                          std::string("sum_blocks ") + (accumulate ? "+= " : "= ") + name);
            }
            // sum_blocks of fp32 rows (the combine's unrounded partials), +=
            {
                const F32 blocks32 = random_f32(rng, static_cast<size_t>(num_rows * s.H));
                DeviceBuffer d_blocks32 = device_copy(blocks32);
                F32 out_ref = random_bf16(rng, src.size());
                DeviceBuffer d_out = device_bf16(out_ref);
                mf::cpu::ep_sum_blocks(out_ref.data(), true, blocks32.data(), num_rows, pos.data(), counts_ref.data(),
                                       s.N, s.V, s.H);
                mf::cuda::ep_sum_blocks(d_out.as<bf16>(), true, d_blocks32.as<float>(), num_rows, d_pos.as<int32_t>(),
                                        d_counts.as<int32_t>(), s.N, s.V, s.H, nullptr);
                device_sync();
                expect_reduction_bf16_out(download_bf16(d_out.as<void>(), out_ref.size()), out_ref,
                                          "sum_blocks fp32 rows += " + name);
            }

            // gather_slots: a copy, exact
            const F32 dweight_rows = random_f32(rng, static_cast<size_t>(num_rows * s.K));
            F32 dtopk_ref(P);
            DeviceBuffer d_dwr = device_copy(dweight_rows), d_dtopk(P * 4);
            d_dtopk.poison();
            mf::cpu::ep_gather_slots(dtopk_ref.data(), dweight_rows.data(), num_rows, pos.data(), counts_ref.data(),
                                     r.topk.data(), r.dest.data(), s.N, s.K, s.E, s.V);
            mf::cuda::ep_gather_slots(d_dtopk.as<float>(), d_dwr.as<float>(), num_rows, d_pos.as<int32_t>(),
                                      d_counts.as<int32_t>(), d_topk.as<int32_t>(), d_dest.as<int32_t>(), s.N, s.K, s.E,
                                      s.V, nullptr);
            device_sync();
            expect_exact(download<float>(d_dtopk.as<void>(), P), dtopk_ref, "gather_slots " + name);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// owner side: scatter, scatter_grad, reduce

struct OwnerCase {
    int64_t M, K, H;
};

TEST(CudaEpTokens, OwnerSideMatchesCpu) {
    std::mt19937 rng(32);
    for (const OwnerCase& s : {OwnerCase{1, 1, 8}, OwnerCase{333, 8, 2048}, OwnerCase{1000, 4, 13},
                               OwnerCase{77, 32, 24}, OwnerCase{4000, 8, 64}, OwnerCase{50, 3, 1}}) {
        const std::string name = "M=" + std::to_string(s.M) + " K=" + std::to_string(s.K) + " H=" + std::to_string(s.H);
        // Local rows: a permutation of [0, L); slot (i, k) names a distinct one, or none (-1), or one
        // outside [0, L) (skipped). Rows named by no slot must keep their values.
        const int64_t L = s.M * s.K + 7;
        I32 perm(static_cast<size_t>(L));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        I32 meta(static_cast<size_t>(s.M * 2 * s.K));
        for (int64_t i = 0; i < s.M; ++i) {
            for (int64_t k = 0; k < s.K; ++k) {
                const uint32_t roll = rng() % 100;
                int32_t d = perm[i * s.K + k];
                if (roll < 15)
                    d = -1;
                else if (roll < 18)
                    d = static_cast<int32_t>(L + rng() % 3);
                else if (roll < 20)
                    d = -3;
                const float w = d == -1 ? 0.0f : static_cast<float>(rng() % 1000) / 1000.0f;
                meta[i * 2 * s.K + k] = d;
                std::memcpy(&meta[i * 2 * s.K + s.K + k], &w, sizeof w);
            }
        }
        DeviceBuffer d_meta = device_copy(meta);
        const size_t nl = static_cast<size_t>(L * s.H), nm = static_cast<size_t>(s.M * s.H);

        // scatter_rows
        const F32 rows = random_bf16(rng, nm);
        F32 local_ref = random_bf16(rng, nl);
        DeviceBuffer d_rows = device_bf16(rows), d_local = device_bf16(local_ref);
        mf::cpu::ep_scatter_rows(local_ref.data(), L, rows.data(), meta.data(), s.M, s.K, s.H);
        mf::cuda::ep_scatter_rows(d_local.as<bf16>(), L, d_rows.as<bf16>(), d_meta.as<int32_t>(), s.M, s.K, s.H,
                                  nullptr);
        device_sync();
        expect_exact(download_bf16(d_local.as<void>(), nl), local_ref, "scatter_rows " + name);

        // reduce_rows, weighted and not
        const F32 y_local = random_bf16(rng, nl);
        DeviceBuffer d_y = device_bf16(y_local);
        for (const bool weighted : {false, true}) {
            F32 out_ref(nm);
            DeviceBuffer d_out(nm * 2);
            d_out.poison();
            mf::cpu::ep_reduce_rows(out_ref.data(), y_local.data(), L, meta.data(), s.M, s.K, s.H, weighted);
            mf::cuda::ep_reduce_rows(d_out.as<bf16>(), d_y.as<bf16>(), L, d_meta.as<int32_t>(), s.M, s.K, s.H, weighted,
                                     nullptr);
            device_sync();
            expect_reduction_bf16_out(download_bf16(d_out.as<void>(), nm), out_ref,
                                      std::string("reduce_rows ") + (weighted ? "weighted " : "") + name);
            // fp32 output (the combine's unrounded partials)
            DeviceBuffer d_out32(nm * 4);
            d_out32.poison();
            mf::cuda::ep_reduce_rows(d_out32.as<float>(), d_y.as<bf16>(), L, d_meta.as<int32_t>(), s.M, s.K, s.H,
                                     weighted, nullptr);
            device_sync();
            expect_reduction(download<float>(d_out32.as<void>(), nm), out_ref, out_ref,
                             std::string("reduce_rows fp32 out ") + (weighted ? "weighted " : "") + name);
        }

        // scatter_grad
        const F32 drows = random_bf16(rng, nm);
        F32 dlocal_ref = random_bf16(rng, nl), dweight_ref(static_cast<size_t>(s.M * s.K));
        DeviceBuffer d_drows = device_bf16(drows), d_dlocal = device_bf16(dlocal_ref),
                     d_dweight(dweight_ref.size() * 4);
        d_dweight.poison();
        mf::cpu::ep_scatter_grad(dlocal_ref.data(), dweight_ref.data(), drows.data(), meta.data(), y_local.data(), L,
                                 s.M, s.K, s.H);
        mf::cuda::ep_scatter_grad(d_dlocal.as<bf16>(), d_dweight.as<float>(), d_drows.as<bf16>(), d_meta.as<int32_t>(),
                                  d_y.as<bf16>(), L, s.M, s.K, s.H, nullptr);
        device_sync();
        expect_close_bf16(download_bf16(d_dlocal.as<void>(), nl), dlocal_ref, "scatter_grad dlocal " + name);
        expect_reduction(download<float>(d_dweight.as<void>(), dweight_ref.size()), dweight_ref, dweight_ref,
                         "scatter_grad dweight " + name);
    }
}

// ---------------------------------------------------------------------------------------------
// ops:: entries on device tensors: the whole exchange of one rank (all destinations local), the
// same calls on CPU tensors as the reference.

TEST(CudaEpTokens, OpsEntriesMatchCpu) {
    std::mt19937 rng(33);
    const EpCase s{1500, 8, 32, 4, 40, 1};
    const Routing r = random_routing(rng, s, false);
    const int64_t N = s.N, K = s.K, E = s.E, V = s.V, H = s.H, P = N * K;
    I32 offsets, pair_row;
    permutation(r, E, offsets, pair_row);
    I32 row_base(offsets.begin(), offsets.end() - 1);  // one local buffer: local row = pair_row
    const F32 weight = random_f32(rng, static_cast<size_t>(P), 0.0f, 1.0f);
    const F32 x = random_bf16(rng, static_cast<size_t>(N * H));

    struct Side {
        mf::Device device;
        std::vector<mf::Buffer> buffers;
        mf::Tensor make(mf::DType dtype, mf::Shape shape) {
            buffers.emplace_back(static_cast<size_t>(std::max<int64_t>(mf::shape_numel(shape), 1)) * 4, device);
            return buffers.back().as(dtype, std::move(shape));
        }
    };
    const auto put_i32 = [](const mf::Tensor& t, const I32& v) { mf::ops::copy_from_host(t, v.data()); };
    const auto get_i32 = [](const mf::Tensor& t) {
        I32 v(static_cast<size_t>(t.numel()));
        mf::ops::copy_to_host(v.data(), t);
        return v;
    };
    // Rows: f32 on the CPU, bf16 on the GPU (values already bf16, so the uploads are exact).
    const auto put_rows = [](const mf::Tensor& t, const F32& v) {
        if (t.device() == mf::Device::cpu) return mf::ops::copy_from_host(t, v.data());
        upload_bf16(t.data(), v);
    };
    const auto get_rows = [](const mf::Tensor& t) {
        if (t.device() == mf::Device::cuda) return download_bf16(t.data(), static_cast<size_t>(t.numel()));
        F32 v(static_cast<size_t>(t.numel()));
        mf::ops::copy_to_host(v.data(), t);
        return v;
    };

    struct Result {
        I32 pos, counts, meta;
        F32 rows, local, back, out, dtopk;
    };
    const auto run = [&](mf::Device device) {
        Side side{device, {}};
        const mf::DType row_dtype = device == mf::Device::cuda ? mf::DType::bf16 : mf::DType::f32;
        auto topk = side.make(mf::DType::i32, {N, K}), dest = side.make(mf::DType::i32, {E});
        auto pos = side.make(mf::DType::i32, {V, N}), counts = side.make(mf::DType::i32, {V});
        put_i32(topk, r.topk);
        put_i32(dest, r.dest);
        mf::ops::ep_token_positions(pos, counts, topk, dest);
        Result res;
        res.pos = get_i32(pos);
        res.counts = get_i32(counts);
        const int64_t M = std::accumulate(res.counts.begin(), res.counts.end(), int64_t{0});
        auto src = side.make(row_dtype, {N, H}), rows = side.make(row_dtype, {M, H});
        put_rows(src, x);
        mf::ops::ep_pack_rows(rows, src, pos, counts);
        auto meta = side.make(mf::DType::i32, {M, 2 * K}), w = side.make(mf::DType::f32, {N, K});
        auto pr = side.make(mf::DType::i32, {P}), off = side.make(mf::DType::i32, {E + 1});
        auto base = side.make(mf::DType::i32, {E});
        mf::ops::copy_from_host(w, weight.data());
        put_i32(pr, pair_row);
        put_i32(off, offsets);
        put_i32(base, row_base);
        mf::ops::ep_pack_meta(meta, pos, counts, topk, w, pr, off, base, dest);
        auto local = side.make(row_dtype, {P, H}), back = side.make(row_dtype, {M, H});
        auto out = side.make(row_dtype, {N, H});
        mf::ops::zero(local);
        mf::ops::ep_scatter_rows(local, rows, meta);
        mf::ops::ep_reduce_rows(back, local, meta, true);
        mf::ops::ep_sum_blocks(out, back, pos, counts, false);
        auto dweight = side.make(mf::DType::f32, {M, K}), dlocal = side.make(row_dtype, {P, H});
        auto dtopk = side.make(mf::DType::f32, {N, K});
        mf::ops::ep_scatter_grad(dlocal, dweight, rows, meta, local);
        mf::ops::ep_gather_slots(dtopk, dweight, pos, counts, topk, dest);
        res.meta = get_i32(meta);
        res.rows = get_rows(rows);
        res.local = get_rows(local);
        res.back = get_rows(back);
        res.out = get_rows(out);
        res.dtopk.resize(static_cast<size_t>(P));
        mf::ops::copy_to_host(res.dtopk.data(), dtopk);
        return res;
    };
    const Result cpu = run(mf::Device::cpu), gpu = run(mf::Device::cuda);
    expect_exact(gpu.pos, cpu.pos, "ops positions");
    expect_exact(gpu.counts, cpu.counts, "ops counts");
    expect_exact(gpu.rows, cpu.rows, "ops pack_rows");
    expect_exact(gpu.meta, cpu.meta, "ops pack_meta");
    expect_exact(gpu.local, cpu.local, "ops scatter_rows");
    expect_reduction_bf16_out(gpu.back, cpu.back, "ops reduce_rows");
    // out sums the per-destination sums the GPU stored in bf16: naive = the CPU's computation with
    // those sums rounded to bf16 and the result rounded again.
    F32 naive_out(cpu.out.size());
    const F32 back_bf16 = round_bf16(cpu.back);
    mf::cpu::ep_sum_blocks(naive_out.data(), false, back_bf16.data(), static_cast<int64_t>(cpu.back.size()) / H,
                           cpu.pos.data(), cpu.counts.data(), N, V, H);
    expect_reduction(gpu.out, cpu.out, round_bf16(naive_out), "ops sum_blocks");
    expect_reduction(gpu.dtopk, cpu.dtopk, cpu.dtopk, "ops scatter_grad + gather_slots");
}

// ---------------------------------------------------------------------------------------------
// benchmarks (MF_BENCH=1)

TEST(CudaEpTokensBench, TwoDestinations) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1 for the benchmark";
    std::mt19937 rng(34);
    const EpCase s{16384, 8, 128, 2, 2048, 0};
    const int64_t N = s.N, K = s.K, E = s.E, V = s.V, H = s.H, P = N * K;
    Routing r = random_routing(rng, s, false);
    for (int64_t e = 0; e < E; ++e) r.dest[e] = static_cast<int32_t>(e * V / E);  // contiguous chunks
    I32 pos(static_cast<size_t>(V * N)), counts(static_cast<size_t>(V));
    mf::cpu::ep_token_positions(pos.data(), counts.data(), r.topk.data(), r.dest.data(), N, K, E, V);
    const int64_t M = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    I32 offsets(static_cast<size_t>(E + 1)), sorted(static_cast<size_t>(P)), pair_row(static_cast<size_t>(P));
    mf::cpu::moe_permute_indices(offsets.data(), sorted.data(), pair_row.data(), r.topk.data(), N, K, E);
    const I32 row_base(offsets.begin(), offsets.end() - 1);
    const F32 weight = random_f32(rng, static_cast<size_t>(P), 0.0f, 1.0f);

    DeviceBuffer topk = device_copy(r.topk), dest = device_copy(r.dest), d_pos(pos.size() * 4),
                 d_counts(counts.size() * 4), w = device_copy(weight), pr = device_copy(pair_row),
                 off = device_copy(offsets), base = device_copy(row_base);
    DeviceBuffer x(static_cast<size_t>(N * H) * 2), rows(static_cast<size_t>(M * H) * 2),
        meta(static_cast<size_t>(M * 2 * K) * 4), local(static_cast<size_t>(P * H) * 2),
        dlocal(static_cast<size_t>(P * H) * 2), back(static_cast<size_t>(M * H) * 2),
        dweight(static_cast<size_t>(M * K) * 4), dtopk(static_cast<size_t>(P) * 4);
    upload_bf16(x.as<void>(), random_bf16(rng, static_cast<size_t>(N * H)));
    upload_bf16(local.as<void>(), random_bf16(rng, static_cast<size_t>(P * H)));
    std::printf("  N=%lld K=%lld E=%lld V=%lld H=%lld: %lld block rows (%.2f per token)\n", static_cast<long long>(N),
                static_cast<long long>(K), static_cast<long long>(E), static_cast<long long>(V),
                static_cast<long long>(H), static_cast<long long>(M), static_cast<double>(M) / static_cast<double>(N));

    const double row = static_cast<double>(H) * 2, n = static_cast<double>(N), m = static_cast<double>(M),
                 p = static_cast<double>(P);
    double us = time_us([&] {
        mf::cuda::ep_token_positions(d_pos.as<int32_t>(), d_counts.as<int32_t>(), topk.as<int32_t>(),
                                     dest.as<int32_t>(), N, K, E, V, nullptr);
    });
    report_bandwidth("ep_token_positions", us, 4.0 * p + 4.0 * n * static_cast<double>(V));
    us = time_us([&] {
        mf::cuda::ep_pack_rows(rows.as<bf16>(), M, x.as<bf16>(), d_pos.as<int32_t>(), d_counts.as<int32_t>(), N, V, H,
                               nullptr);
    });
    report_bandwidth("ep_pack_rows", us, (n + m) * row);
    us = time_us([&] {
        mf::cuda::ep_pack_meta(meta.as<int32_t>(), M, d_pos.as<int32_t>(), d_counts.as<int32_t>(), topk.as<int32_t>(),
                               w.as<float>(), pr.as<int32_t>(), off.as<int32_t>(), base.as<int32_t>(),
                               dest.as<int32_t>(), N, K, E, V, nullptr);
    });
    report_bandwidth("ep_pack_meta", us, 12.0 * p + 8.0 * m * static_cast<double>(K));
    us = time_us(
        [&] { mf::cuda::ep_scatter_rows(local.as<bf16>(), P, rows.as<bf16>(), meta.as<int32_t>(), M, K, H, nullptr); });
    report_bandwidth("ep_scatter_rows", us, (m + p) * row);
    us = time_us([&] {
        mf::cuda::ep_reduce_rows(back.as<bf16>(), local.as<bf16>(), P, meta.as<int32_t>(), M, K, H, true, nullptr);
    });
    report_bandwidth("ep_reduce_rows (weighted)", us, (m + p) * row);
    us = time_us([&] {
        mf::cuda::ep_scatter_grad(dlocal.as<bf16>(), dweight.as<float>(), back.as<bf16>(), meta.as<int32_t>(),
                                  local.as<bf16>(), P, M, K, H, nullptr);
    });
    report_bandwidth("ep_scatter_grad", us, (m + 2 * p) * row);
    us = time_us([&] {
        mf::cuda::ep_sum_blocks(x.as<bf16>(), true, back.as<bf16>(), M, d_pos.as<int32_t>(), d_counts.as<int32_t>(), N,
                                V, H, nullptr);
    });
    report_bandwidth("ep_sum_blocks (+=)", us, (m + 2 * n) * row);
    us = time_us([&] {
        mf::cuda::ep_gather_slots(dtopk.as<float>(), dweight.as<float>(), M, d_pos.as<int32_t>(),
                                  d_counts.as<int32_t>(), topk.as<int32_t>(), dest.as<int32_t>(), N, K, E, V, nullptr);
    });
    report_bandwidth("ep_gather_slots", us, 4.0 * (3.0 * p + static_cast<double>(V) * n));

    // Positions at the top of the range: 65536 tokens, 64 destinations (one block each).
    const EpCase big{65536, 8, 128, 64, 0, 0};
    const Routing rb = random_routing(rng, big, false);
    DeviceBuffer big_topk = device_copy(rb.topk), big_dest = device_copy(rb.dest),
                 big_pos(static_cast<size_t>(big.N * big.V) * 4), big_counts(static_cast<size_t>(big.V) * 4);
    us = time_us([&] {
        mf::cuda::ep_token_positions(big_pos.as<int32_t>(), big_counts.as<int32_t>(), big_topk.as<int32_t>(),
                                     big_dest.as<int32_t>(), big.N, big.K, big.E, big.V, nullptr);
    });
    report_bandwidth("ep_token_positions N=65536 V=64", us,
                     4.0 * static_cast<double>(big.N) * static_cast<double>(big.K + big.V));
}

}  // namespace
