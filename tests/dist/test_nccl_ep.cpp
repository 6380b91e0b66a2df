// Expert parallelism on the CUDA backend over NCCL, on 2 GPUs (forked ranks, rendezvous on loopback):
//  1. Dispatch then combine (model/ep_exchange.h) with rank-coded bf16 payloads compared bit for bit
//     (the harness of tests/dist/ep_round_trip.h: each owner checks its local rows token by token,
//     each source checks the weighted sums that come back), every routing of the harness,
//     unpipelined and in 2 chunks, at row widths 8, 5 and 2056.
//  2. A whole EP=2 moe_block_forward + moe_block_backward (rank p: experts [p·E/2, (p+1)·E/2) of one
//     shared random weight set, and its own N tokens), unpipelined with the own-token rows cut at
//     half (the default), at 0 and at 1 (all computed after, or before, the other ranks' rows), and
//     pipelined in 3 chunks cut at 0.3, against
//     the EP=1 block on one GPU computing both ranks' 2N tokens, and all against the fp32 CPU block
//     fed the same bf16-rounded inputs.
//     Tolerance (CONVENTIONS.md, the rule for reductions, with the one-GPU block as the "naive"
//     computation of the same thing in bf16): for y, dx, rank p's expert weight gradients vs the
//     matching slice, and the router gradient summed over both ranks,
//        max |ep − cpu| <= 2 · max |one_gpu − cpu| + 2^-16 · max(1, max |cpu|).
//     EP changes where rows are computed, the order of the router-gradient sum (two partial GEMMs
//     added in fp32 instead of one), and rounds each destination's partial sum of y and dx to bf16
//     before the exchange (one rounding more per destination than the one-GPU block's single one),
//     so the two GPU runs should be close; max |ep − one_gpu| is printed too. The router inputs are multiples of 1/8
//     (x) and 1/64 (weights), so the fp32 logits are exact whatever the GEMM's summation order and all three runs pick
//     the same experts (checked first: a flipped choice would be a routing difference, not rounding). The same harness
//     also runs on the CPU backend over TCP (every build), where "one GPU" is the CPU block.
//  3. MF_BENCH=1: the EP=2 MoE block forward and forward+backward at the Qwen3-30B-A3B-like shape
//     (16384 tokens per rank, hidden 2048, 128 experts, top-8, expert dim 768) with ep_chunks 1, 2, 4
//     and 8, then unpipelined over own-row cuts and SMs left to the exchange (MoeDims::ep_own_split,
//     ep_comm_sms), the dispatch+combine exchange alone, and one GPU running its 16384 tokens through all
//     128 experts (no EP).
// The GPU tests skip (exit 77) with fewer than 2 GPUs, and are not built without NCCL.
// NOTE: the parent never touches CUDA, so that the forked ranks can initialise it.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "dist_test_util.h"
#include "ep_round_trip.h"
#include "model/ffn_blocks.h"
#include "ops/ops.h"

#if defined(MOEFORGE_WITH_NCCL)
#include <cuda_runtime.h>

#include "parallel/nccl_communicator.h"
#endif

namespace mf::test {
namespace {

// ---------------------------------------------------------------------------------------------
// memory helpers (any device: the CPU reference runs through the same code)

// Tensors with their own allocations, freed together.
class Pool {
 public:
    explicit Pool(Device device) : device_(device) {}
    Tensor make(DType dtype, Shape shape) {
        const int64_t n = shape_numel(shape);
        buffers_.emplace_back(std::max<size_t>(static_cast<size_t>(n) * dtype_size(dtype), 256), device_);
        return buffers_.back().as(dtype, std::move(shape));
    }
    Device device() const { return device_; }

 private:
    Device device_;
    std::vector<Buffer> buffers_;
};

std::vector<uint8_t> to_bytes(const std::vector<float>& v, DType dtype) {
    std::vector<uint8_t> out(v.size() * dtype_size(dtype));
    for (size_t i = 0; i < v.size(); ++i) {
        if (dtype == DType::bf16) {
            const uint16_t bits = f32_to_bf16(v[i]);
            std::memcpy(&out[2 * i], &bits, 2);
        } else {
            std::memcpy(&out[4 * i], &v[i], 4);
        }
    }
    return out;
}

void upload(const Tensor& t, const std::vector<float>& v) {
    rank_check(static_cast<int64_t>(v.size()) == t.numel(), "upload size");
    const auto bytes = to_bytes(v, t.dtype());
    ops::copy_from_host(t, bytes.data());
}

std::vector<float> download(const Tensor& t) {
    std::vector<uint8_t> bytes(t.nbytes());
    ops::copy_to_host(bytes.data(), t);
    std::vector<float> v(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < v.size(); ++i) {
        if (t.dtype() == DType::bf16) {
            uint16_t bits;
            std::memcpy(&bits, &bytes[2 * i], 2);
            v[i] = bf16_to_f32(bits);
        } else {
            std::memcpy(&v[i], &bytes[4 * i], 4);
        }
    }
    return v;
}

template <typename T>
std::vector<T> download_raw(const Tensor& t) {
    std::vector<T> v(static_cast<size_t>(t.numel()));
    ops::copy_to_host(v.data(), t);
    return v;
}

// ---------------------------------------------------------------------------------------------
// 2. the whole block: EP=2 vs one GPU vs the fp32 CPU block (the CPU variant runs everywhere)

struct BlockShape {
    int64_t N, H, I, E, K;  // N: tokens per rank
};

// One shared problem for both ranks (same seed), values already bf16-exact.
struct Problem {
    BlockShape s;
    std::vector<float> router, gate_up, down, x, dy;  // [E,H], [E,2I,H], [E,H,I], [2N,H], [2N,H]
};

// Routing skews for 2 ranks (Skew::own: every token of rank p picks experts of rank p only; other:
// of the other rank only), made by column 0: x[t][0] = +1 for rank 0's tokens, -1 for rank 1's, and
// router[e][0] = ±32 by the half e is in: 64 between the halves' logits, against the other 255
// columns' terms, whose sums differ between two experts by about 8 in standard deviation (block_parity
// checks the routing it got). The values stay multiples of 1/8 and 1/64, so the fp32 logits stay exact.
enum class Skew { none, own, other };

Problem make_problem(const BlockShape& s, uint32_t seed, Skew skew = Skew::none) {
    std::mt19937 rng(seed);
    auto grid = [&](size_t n, int steps, float unit) {  // multiples of `unit` in [-steps, steps]·unit
        std::vector<float> v(n);
        for (float& x : v) x = static_cast<float>(static_cast<int>(rng() % (2 * steps + 1)) - steps) * unit;
        return v;
    };
    auto uniform = [&](size_t n, float scale) {
        std::uniform_real_distribution<float> dist(-scale, scale);
        std::vector<float> v(n);
        for (float& x : v) x = bf16_to_f32(f32_to_bf16(dist(rng)));
        return v;
    };
    Problem p{s, {}, {}, {}, {}, {}};
    p.router = grid(static_cast<size_t>(s.E * s.H), 64, 1.0f / 64);
    p.gate_up = uniform(static_cast<size_t>(s.E * 2 * s.I * s.H), 0.08f);
    p.down = uniform(static_cast<size_t>(s.E * s.H * s.I), 0.1f);
    p.x = grid(static_cast<size_t>(2 * s.N * s.H), 8, 1.0f / 8);
    p.dy = uniform(static_cast<size_t>(2 * s.N * s.H), 1.0f);
    if (skew != Skew::none) {
        for (int64_t t = 0; t < 2 * s.N; ++t) p.x[static_cast<size_t>(t * s.H)] = t < s.N ? 1.0f : -1.0f;
        for (int64_t e = 0; e < s.E; ++e) {
            const bool first_half = e < s.E / 2;
            p.router[static_cast<size_t>(e * s.H)] = (first_half == (skew == Skew::own)) ? 32.0f : -32.0f;
        }
    }
    return p;
}

struct BlockResult {
    std::vector<float> y, dx, g_router, g_gate_up, g_down;
    std::vector<int32_t> topk;
};

std::vector<float> slice(const std::vector<float>& v, int64_t first, int64_t n) {
    return std::vector<float>(v.begin() + first, v.begin() + first + n);
}

// Forward + backward of the MoE block over tokens [first_token, first_token + num_tokens) of the
// problem, with experts [first_expert, first_expert + num_experts) (all E without EP). Parameter
// gradients f32; with EP the router gradient is summed over the group before it is returned.
BlockResult run_block(Device device, const Problem& p, const model::MoeDims& d, int64_t first_token, int64_t num_tokens,
                      int64_t first_expert, int64_t num_experts) {
    const BlockShape& s = p.s;
    const DType act = device == Device::cuda ? DType::bf16 : DType::f32;
    Pool pool(device);
    model::MoeWeights w{pool.make(act, {s.E, s.H}), pool.make(act, {num_experts, 2 * s.I, s.H}),
                        pool.make(act, {num_experts, s.H, s.I})};
    model::MoeWeights g{pool.make(DType::f32, {s.E, s.H}), pool.make(DType::f32, {num_experts, 2 * s.I, s.H}),
                        pool.make(DType::f32, {num_experts, s.H, s.I})};
    upload(w.router, p.router);
    upload(w.gate_up, slice(p.gate_up, first_expert * 2 * s.I * s.H, num_experts * 2 * s.I * s.H));
    upload(w.down, slice(p.down, first_expert * s.H * s.I, num_experts * s.H * s.I));
    for (const Tensor* t : {&g.router, &g.gate_up, &g.down}) ops::zero(*t);
    const Tensor x = pool.make(act, {num_tokens, s.H}), dy = pool.make(act, {num_tokens, s.H});
    const Tensor y = pool.make(act, {num_tokens, s.H}), dx = pool.make(act, {num_tokens, s.H});
    upload(x, slice(p.x, first_token * s.H, num_tokens * s.H));
    upload(dy, slice(p.dy, first_token * s.H, num_tokens * s.H));
    ops::zero(dx);

    Arena measure = Arena::measuring(device);
    {
        model::MoeActs a;
        model::MoeScratch sc;
        a.alloc(measure, d, num_tokens, act);
        sc.alloc(measure, d, num_tokens, act);
    }
    Arena arena(measure.used(), device);
    model::MoeActs a;
    model::MoeScratch sc;
    a.alloc(arena, d, num_tokens, act);
    sc.alloc(arena, d, num_tokens, act);
    model::moe_block_forward(y, a, x, w, d);
    model::moe_block_backward(dx, g, sc, dy, Tensor(), x, a, w, d);
    if (d.ep != nullptr) {
        d.ep->all_reduce_sum(g.router.data(), g.router.numel(), DType::f32);
        d.ep->synchronize();
    }
    return BlockResult{download(y),         download(dx),     download(g.router),
                       download(g.gate_up), download(g.down), download_raw<int32_t>(a.topk_idx)};
}

// The rule of the file comment; throws when broken, else returns a line for the report.
std::string compare(const std::string& what, const std::vector<float>& ep, const std::vector<float>& one,
                    const std::vector<float>& ref) {
    rank_check(ep.size() == ref.size() && one.size() == ref.size(), what + ": sizes differ");
    double e_ep = 0, e_one = 0, d_ep_one = 0, ref_max = 0;
    size_t same = 0, non_finite = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!std::isfinite(ep[i])) ++non_finite;
        e_ep = std::max(e_ep, std::fabs(static_cast<double>(ep[i]) - ref[i]));
        e_one = std::max(e_one, std::fabs(static_cast<double>(one[i]) - ref[i]));
        d_ep_one = std::max(d_ep_one, std::fabs(static_cast<double>(ep[i]) - one[i]));
        ref_max = std::max(ref_max, std::fabs(static_cast<double>(ref[i])));
        same += std::memcmp(&ep[i], &one[i], sizeof(float)) == 0 ? 1 : 0;
    }
    const double tol = 2 * e_one + std::ldexp(std::max(1.0, ref_max), -16);
    char line[256];
    std::snprintf(line, sizeof line,
                  "  %-27s n=%-8zu max|ep-cpu| %.3e  tol %.3e (2·max|1gpu-cpu| %.3e + floor)  max|ep-1gpu| %.3e  "
                  "bitwise equal %.1f%%\n",
                  what.c_str(), ref.size(), e_ep, tol, 2 * e_one, d_ep_one,
                  100.0 * static_cast<double>(same) / static_cast<double>(std::max<size_t>(ref.size(), 1)));
    rank_check(non_finite == 0, what + ": " + std::to_string(non_finite) + " non-finite values");
    rank_check(e_ep <= tol, std::string("tolerance broken:\n") + line);
    return line;
}

// `device`: cuda (NCCL group) compares EP=2 and one GPU against the CPU; cpu (TCP group) runs the
// same comparison with the CPU block in place of both GPU runs (then EP must match it to the floor).
// EP runs unpipelined (ep_chunks 1) with the own rows cut at 0.5, 0 and 1 (MoeDims::ep_own_split),
// and pipelined in 3 uneven chunks (8 local experts: 2, 3, 3) cut at 0.3; under a skew (own: no
// rank receives the other's tokens; other: no rank computes rows of its own tokens), once each
// unpipelined and in 3 chunks, after checking that the routing is the skew asked for.
std::string block_parity(parallel::Communicator& comm, const BlockShape& s, Device device, Skew skew = Skew::none) {
    const int me = comm.rank(), S = comm.size();
    const int64_t El = s.E / S;
    const Problem p = make_problem(s, 1234, skew);
    model::MoeDims d_one{s.H, s.I, s.E, s.K, true, nullptr};
    const BlockResult one = run_block(device, p, d_one, 0, S * s.N, 0, s.E);
    const BlockResult ref = run_block(Device::cpu, p, d_one, 0, S * s.N, 0, s.E);
    const int64_t NH = s.N * s.H, NK = s.N * s.K;
    const std::vector<int32_t> one_topk(one.topk.begin() + me * NK, one.topk.begin() + (me + 1) * NK);
    const std::vector<int32_t> ref_topk(ref.topk.begin() + me * NK, ref.topk.begin() + (me + 1) * NK);
    std::string out = "N=" + std::to_string(s.N) + "/rank H=" + std::to_string(s.H) + " I=" + std::to_string(s.I) +
                      " E=" + std::to_string(s.E) + " K=" + std::to_string(s.K) + "; this rank's pairs per expert:";
    std::vector<int64_t> load(static_cast<size_t>(s.E), 0);
    for (const int32_t e : one_topk) ++load[static_cast<size_t>(e)];
    for (const int64_t c : load) out += " " + std::to_string(c);
    out += "\n";
    if (skew != Skew::none) {
        rank_check(S == 2, "the skewed routings are for 2 ranks");
        for (const int32_t e : one_topk)
            rank_check((e / El == me) == (skew == Skew::own),
                       std::string("the routing is not the skew asked for (expert ") + std::to_string(e) + ")");
        out += skew == Skew::own ? "skew: every token to its own rank's experts\n"
                                 : "skew: every token to the other rank's experts\n";
    }
    using Run = std::pair<int64_t, double>;
    const std::vector<Run> runs = skew == Skew::none ? std::vector<Run>{{1, 0.5}, {1, 0.0}, {1, 1.0}, {3, 0.3}}
                                                     : std::vector<Run>{{1, 0.5}, {3, 0.3}};
    for (const auto& [chunks, split] : runs) {
        const model::MoeDims d_ep{s.H, s.I, s.E, s.K, true, &comm, chunks, split};
        const BlockResult ep = run_block(device, p, d_ep, me * s.N, s.N, me * El, El);
        rank_check(ep.topk == one_topk && ep.topk == ref_topk, "the runs routed differently");
        char tag[32];
        std::snprintf(tag, sizeof tag, "c%lld s%.1f ", static_cast<long long>(chunks), split);
        const std::string c = tag;
        const int64_t gu = El * 2 * s.I * s.H, dn = El * s.H * s.I;
        out += compare(c + "y", ep.y, slice(one.y, me * NH, NH), slice(ref.y, me * NH, NH));
        out += compare(c + "dx", ep.dx, slice(one.dx, me * NH, NH), slice(ref.dx, me * NH, NH));
        out += compare(c + "d gate_up (own slice)", ep.g_gate_up, slice(one.g_gate_up, me * gu, gu),
                       slice(ref.g_gate_up, me * gu, gu));
        out += compare(c + "d down (own slice)", ep.g_down, slice(one.g_down, me * dn, dn),
                       slice(ref.g_down, me * dn, dn));
        out += compare(c + "d router (sum of ranks)", ep.g_router, one.g_router, ref.g_router);
    }
    return out;
}

// Ragged shapes: 16 experts (8 per rank), 77 tokens per rank; I = 96 is no tile multiple.
const BlockShape kParityShape{77, 256, 96, 16, 4};

// The same harness on the CPU backend over TCP (runs everywhere; checks the comparison itself).
TEST(NcclEp, MoeBlockEp2OnCpuOverTcpMatchesOneRank) {
    const auto results = run_ranks(
        2, 60,
        [](parallel::Communicator& comm) {
            return block_parity(comm, kParityShape, Device::cpu) +
                   block_parity(comm, kParityShape, Device::cpu, Skew::own) +
                   block_parity(comm, kParityShape, Device::cpu, Skew::other);
        },
        120);
    for (int r = 0; r < 2; ++r) {
        std::printf("--- rank %d (exit %d)\n%s\n", r, results[r].exit_code, results[r].output.c_str());
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
    }
}

#if defined(MOEFORGE_WITH_NCCL)

constexpr const char* kSkip = "skip";

// Runs fn on 2 forked ranks, each on its own GPU in an NCCL world of 2; the test is skipped when a
// rank sees fewer than 2 GPUs. Prints what each rank returned.
void run_on_two_gpus(const std::function<std::string(parallel::NcclCommunicator&)>& fn, double deadline_s) {
    const int port = free_port();
    const auto results = run_processes(
        2,
        [&](int rank) -> std::string {
            int devices = 0;
            if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) return kSkip;
            parallel::DistEnv env{rank, 2, rank, "127.0.0.1", port};
            parallel::Rendezvous rdv(env, 60, nullptr);
            parallel::NcclCommunicator comm(rdv, 60);
            return fn(comm);
        },
        deadline_s);
    if (results[0].output == kSkip) {
        std::printf("SKIPPED: fewer than 2 CUDA devices\n");
        std::fflush(stdout);
        // A failure of the CPU test before must not turn into "skipped".
        std::exit(::testing::UnitTest::GetInstance()->failed_test_count() > 0 ? 1 : 77);
    }
    for (int r = 0; r < 2; ++r) {
        std::printf("--- rank %d (exit %d, %.1f s)\n%s\n", r, results[r].exit_code, results[r].seconds,
                    results[r].output.c_str());
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
    }
}

// ---------------------------------------------------------------------------------------------
// 1. (GPU) dispatch / combine, rank-coded (tests/dist/ep_round_trip.h)

TEST(NcclEp, DispatchCombineRankCodedBitForBit) {
    run_on_two_gpus(
        [](parallel::NcclCommunicator& comm) {
            std::string out;
            for (int routing = 0; routing < 4; ++routing)
                for (const int64_t chunks : {1, 2})
                    for (const int64_t cols : {8, 5, 2056})  // 16-byte rows, odd rows, a model-like width
                        out += ep_round_trip(comm, Device::cuda, routing, chunks, cols);
            return out;
        },
        120);
}

TEST(NcclEp, MoeBlockEp2MatchesOneGpuAndCpu) {
    run_on_two_gpus(
        [](parallel::NcclCommunicator& comm) {
            return block_parity(comm, kParityShape, Device::cuda) +
                   block_parity(comm, kParityShape, Device::cuda, Skew::own) +
                   block_parity(comm, kParityShape, Device::cuda, Skew::other);
        },
        180);
}

// ---------------------------------------------------------------------------------------------
// 3. benchmark

bool bench_enabled() {
    const char* v = std::getenv("MF_BENCH");
    return v != nullptr && std::string(v) == "1";
}

// Median wall time in ms of fn over `iters` runs after 2 warm-ups, the device synchronised around each.
double median_ms(const std::function<void()>& fn, int iters = 7) {
    for (int i = 0; i < 2; ++i) fn();
    ops::synchronize(Device::cuda);
    std::vector<double> ms;
    for (int i = 0; i < iters; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        ops::synchronize(Device::cuda);
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

struct BenchModel {
    Pool pool{Device::cuda};
    model::MoeWeights w, g;
    Tensor x, dy, y, dx;
    Arena arena;
    model::MoeActs a;
    model::MoeScratch sc;

    BenchModel(const BlockShape& s, const model::MoeDims& d, int64_t num_experts, uint64_t seed) {
        const DType act = DType::bf16;
        w = {pool.make(act, {s.E, s.H}), pool.make(act, {num_experts, 2 * s.I, s.H}),
             pool.make(act, {num_experts, s.H, s.I})};
        g = {pool.make(DType::f32, {s.E, s.H}), pool.make(DType::f32, {num_experts, 2 * s.I, s.H}),
             pool.make(DType::f32, {num_experts, s.H, s.I})};
        ops::fill_normal(w.router, seed, 0.0f, 0.05f);  // the same router on every rank
        ops::fill_normal(w.gate_up, seed + 1 + static_cast<uint64_t>(d.ep != nullptr ? d.ep->rank() : 0), 0.0f, 0.02f);
        ops::fill_normal(w.down, seed + 7, 0.0f, 0.02f);
        x = pool.make(act, {s.N, s.H});
        dy = pool.make(act, {s.N, s.H});
        y = pool.make(act, {s.N, s.H});
        dx = pool.make(act, {s.N, s.H});
        ops::fill_normal(x, seed + 11 + static_cast<uint64_t>(d.ep != nullptr ? d.ep->rank() : 0), 0.0f, 1.0f);
        ops::fill_normal(dy, seed + 13, 0.0f, 1e-3f);
        Arena measure = Arena::measuring(Device::cuda);
        {
            model::MoeActs ma;
            model::MoeScratch ms;
            ma.alloc(measure, d, s.N, act);
            ms.alloc(measure, d, s.N, act);
        }
        arena = Arena(measure.used(), Device::cuda);
        a.alloc(arena, d, s.N, act);
        sc.alloc(arena, d, s.N, act);
    }
    void forward(const model::MoeDims& d) { model::moe_block_forward(y, a, x, w, d); }
    void backward(const model::MoeDims& d) {
        ops::zero(dx);
        model::moe_block_backward(dx, g, sc, dy, Tensor(), x, a, w, d);
    }
    // Median ms of the forward, and of forward + backward.
    std::pair<double, double> time(const model::MoeDims& d) {
        const double fwd = median_ms([&] { forward(d); });
        const double step = median_ms([&] {
            forward(d);
            backward(d);
        });
        return {fwd, step};
    }
};

std::string bench(parallel::Communicator& comm) {
    const BlockShape s{16384, 2048, 768, 128, 8};
    const int64_t El = s.E / comm.size();
    // Expert GEMM FLOPs of the rows this rank computes: 2·rows·(2I·H + H·I) forward, twice that backward.
    auto expert_tflop = [&](int64_t rows) { return 2.0 * static_cast<double>(rows) * 3.0 * s.I * s.H / 1e12; };
    char line[256];
    std::string out;
    for (const int64_t chunks : {1, 2, 4, 8}) {  // 1: no pipeline (the plan's buffers depend on it)
        model::MoeDims d{s.H, s.I, s.E, s.K, true, &comm, chunks};
        BenchModel m(s, d, El, 42);
        const auto [fwd, step] = m.time(d);
        const int64_t rows = m.a.routing.num_local;
        std::snprintf(line, sizeof line,
                      "BENCH EP=2 rank %d chunks %lld: local rows %lld; fwd %.2f ms, fwd+bwd %.2f ms "
                      "(%.0f TFLOP/s expert GEMMs)\n",
                      comm.rank(), static_cast<long long>(chunks), static_cast<long long>(rows), fwd, step,
                      3 * expert_tflop(rows) / (step * 1e-3));
        out += line;
    }
    // The overlap's knobs, unpipelined: the own rows' cut and the SMs left to the exchange.
    for (const double split : {0.3, 0.5, 0.7})
        for (const int sms : {0, 8, 16, 24, 32}) {
            model::MoeDims d{s.H, s.I, s.E, s.K, true, &comm, 1, split, sms};
            BenchModel m(s, d, El, 42);
            const auto [fwd, step] = m.time(d);
            std::snprintf(line, sizeof line,
                          "BENCH EP=2 rank %d own split %.1f, %2d SMs for the exchange: fwd %.2f ms, fwd+bwd %.2f ms\n",
                          comm.rank(), split, sms, fwd, step);
            out += line;
        }
    {
        model::MoeDims d{s.H, s.I, s.E, s.K, true, &comm, 1};
        BenchModel m(s, d, El, 42);
        m.forward(d);
        const int64_t sent = m.a.routing.num_sent;
        const double exch = median_ms([&] {
            model::ep_dispatch(d, m.a, m.x);
            model::ep_combine(d, m.a, m.y);
        });
        // Token rows moved by dispatch (bf16) and by combine (fp32 partials), this rank's own
        // destination included.
        const double bytes = static_cast<double>(sent * s.H * (2 + 4));
        std::snprintf(line, sizeof line,
                      "BENCH EP=2 rank %d: dispatch+combine alone %.2f ms (%lld token rows each way for %lld "
                      "expert rows, %.0f GB/s)\n",
                      comm.rank(), exch, static_cast<long long>(sent), static_cast<long long>(m.a.routing.num_local),
                      bytes / (exch * 1e-3) / 1e9);
        out += line;
    }
    comm.barrier();
    {
        model::MoeDims d{s.H, s.I, s.E, s.K, true, nullptr};
        BenchModel m(s, d, s.E, 42);
        const auto [fwd, step] = m.time(d);
        std::snprintf(line, sizeof line,
                      "BENCH no EP (one GPU, 16384 tokens, 128 experts): fwd %.2f ms, fwd+bwd %.2f ms (%.0f TFLOP/s)\n",
                      fwd, step, 3 * expert_tflop(s.N * s.K) / (step * 1e-3));
        out += line;
    }
    comm.barrier();
    return out;
}

TEST(NcclEp, Benchmark) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1";
    run_on_two_gpus([](parallel::NcclCommunicator& comm) { return bench(comm); }, 240);
}

#else

TEST(NcclEp, NotBuilt) {
    GTEST_SKIP() << "moeforge built without NCCL (needs MOEFORGE_CUDA and NCCL, cmake/nccl.cmake): "
                    "the GPU EP tests are not built";
}

#endif  // MOEFORGE_WITH_NCCL

}  // namespace
}  // namespace mf::test
