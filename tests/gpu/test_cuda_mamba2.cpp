// GPU parity of the Mamba-2 ops (conv1d_silu, ssd_scan, gated_rmsnorm; ops.h) against an fp64
// reference written here, with the CPU reference kernels (kernels/cpu, reached through ops.h on CPU
// tensors) as the naive same-dtype computation, all fed the same bf16-rounded inputs. The rule
// (CONVENTIONS.md 6): max |gpu − fp64| <= 2 · max |naive − fp64| + 2^-16 · max(1, max |fp64|), naive =
// the CPU reference's fp32 result, rounded to bf16 where the GPU stores bf16 (the scan's chunk states,
// which the CPU path does not produce, take the fp64 recurrence run in fp32 as naive). So that the
// bound cannot grow from a wrong CPU reference, the CPU result must also lie within 1e-3·max(1, |fp64|)
// of the fp64 one. Every output is poisoned (NaN) before the GPU writes it; "+=" gradients start from
// random values. Sweeps: several (T, chunk) with T % chunk != 0 (and chunk 1, chunk > T), G = 1 and
// G > 1, B > 1, ragged documents with one-token documents, documents starting mid-chunk and at a
// chunk start, no doc_ids, an active dt clamp, parameters f32 and bf16, and (the scan) Nemotron 3
// Nano's layer geometry over 4 chunks. The ops with reductions run twice and must give the same bits.
// Prints each error and bound, and (a print, never an assertion) the scan's ms, GB/s and TFLOP/s at
// the Nemotron 3 Nano geometry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/tensor.h"
#include "ops/ops.h"
#include "test_cuda_common.h"

namespace {

using mf::Buffer;
using mf::Device;
using mf::DType;
using mf::Shape;
using mf::Tensor;
using namespace mf::test;

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// ---------------------------------------------------------------------------------------------
// tensors on both devices

// One tensor's values on both devices: f32 on the CPU, bf16 (or f32) on the GPU.
struct Pair {
    Buffer host, device;
    Tensor cpu, gpu;
};

void upload_values(const Tensor& gpu, const std::vector<float>& v) {
    if (v.empty()) return;
    if (gpu.dtype() == DType::bf16) {
        std::vector<uint16_t> bits(v.size());
        for (size_t i = 0; i < v.size(); ++i) bits[i] = mf::f32_to_bf16(v[i]);
        mf::ops::copy_from_host(gpu, bits.data());
    } else {
        mf::ops::copy_from_host(gpu, v.data());
    }
}

Pair both_devices(const std::vector<float>& v, const Shape& shape, DType gpu_dtype = DType::bf16) {
    Pair p{Buffer(std::max<size_t>(v.size(), 1) * 4, Device::cpu),
           Buffer(std::max<size_t>(v.size(), 1) * mf::dtype_size(gpu_dtype), Device::cuda),
           {},
           {}};
    p.cpu = p.host.as(DType::f32, shape);
    p.gpu = p.device.as(gpu_dtype, shape);
    if (!v.empty()) std::memcpy(p.host.data(), v.data(), v.size() * 4);
    upload_values(p.gpu, v);
    return p;
}

// An output: zeros on the CPU, NaN bytes on the GPU (an element never written fails).
Pair output(size_t n, const Shape& shape, DType gpu_dtype = DType::bf16) {
    Pair p = both_devices(std::vector<float>(n, 0.0f), shape, gpu_dtype);
    MF_CHECK_CUDA(cudaMemset(p.gpu.data(), 0xFF, p.gpu.nbytes()));
    return p;
}

std::vector<float> host_values(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (v.empty()) return v;
    if (t.device() == Device::cpu) {
        mf::ops::copy_to_host(v.data(), t);
    } else if (t.dtype() == DType::bf16) {
        std::vector<uint16_t> bits(v.size());
        mf::ops::copy_to_host(bits.data(), t);
        for (size_t i = 0; i < v.size(); ++i) v[i] = mf::bf16_to_f32(bits[i]);
    } else {
        mf::ops::copy_to_host(v.data(), t);
    }
    return v;
}

struct DocIds {
    Buffer host, device;
    Tensor cpu, gpu;  // undefined when there are none
};

DocIds doc_tensors(const std::vector<int32_t>& ids) {
    DocIds d{Buffer(std::max<size_t>(ids.size(), 1) * 4, Device::cpu),
             Buffer(std::max<size_t>(ids.size(), 1) * 4, Device::cuda),
             {},
             {}};
    if (ids.empty()) return d;
    const int64_t n = static_cast<int64_t>(ids.size());
    d.cpu = d.host.as(DType::i32, {n});
    d.gpu = d.device.as(DType::i32, {n});
    std::memcpy(d.host.data(), ids.data(), ids.size() * 4);
    mf::ops::copy_from_host(d.gpu, ids.data());
    return d;
}

// Document ids of B rows of T tokens from per-row document lengths (each row's lengths sum to T; an
// empty list: no doc_ids at all). Ids are never reused.
std::vector<int32_t> doc_ids_of(const std::vector<std::vector<int64_t>>& lengths, int64_t T) {
    std::vector<int32_t> ids;
    int32_t next = 7;
    for (const auto& row : lengths) {
        int64_t total = 0;
        for (const int64_t len : row) {
            for (int64_t i = 0; i < len; ++i) ids.push_back(next);
            total += len;
            ++next;
        }
        MF_CHECK(total == T, "test: a row's document lengths sum to ", total, ", not T = ", T);
    }
    return ids;
}

bool starts(const std::vector<int32_t>& ids, int64_t n, int64_t T) {
    return n % T == 0 || (!ids.empty() && ids[static_cast<size_t>(n)] != ids[static_cast<size_t>(n - 1)]);
}

// ---------------------------------------------------------------------------------------------
// the tolerance rule

void expect_vs_fp64(const std::string& what, const std::vector<float>& gpu, const std::vector<double>& ref,
                    const std::vector<float>& naive) {
    ASSERT_EQ(gpu.size(), ref.size()) << what;
    ASSERT_EQ(naive.size(), ref.size()) << what;
    double err = 0.0, naive_err = 0.0, ref_max = 0.0;
    size_t worst = 0, non_finite = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        ref_max = std::max(ref_max, std::fabs(ref[i]));
        naive_err = std::max(naive_err, std::fabs(static_cast<double>(naive[i]) - ref[i]));
        if (!std::isfinite(gpu[i])) {
            ++non_finite;
            continue;
        }
        const double e = std::fabs(static_cast<double>(gpu[i]) - ref[i]);
        if (e > err) err = e, worst = i;
    }
    const double floor = std::ldexp(std::max(1.0, ref_max), -16);
    const double tol = 2.0 * naive_err + floor;
    EXPECT_EQ(non_finite, 0u) << what << ": " << non_finite << " elements not finite (never written?)";
    EXPECT_LE(err, tol) << what << ": max error " << err << " at " << worst << " (gpu " << gpu[worst] << ", fp64 "
                        << ref[worst] << ")";
    std::printf("  %-58s n=%-7zu max|gpu-fp64| %.3e  naive %.3e  tol %.3e\n", what.c_str(), gpu.size(), err, naive_err,
                tol);
}

// The CPU reference (fp32) must be close to fp64, so that it cannot widen the bound by being wrong.
void expect_cpu_sane(const std::string& what, const std::vector<float>& cpu, const std::vector<double>& ref) {
    ASSERT_EQ(cpu.size(), ref.size()) << what;
    double err = 0.0, ref_max = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        ref_max = std::max(ref_max, std::fabs(ref[i]));
        err = std::max(err, std::fabs(static_cast<double>(cpu[i]) - ref[i]));
    }
    EXPECT_LE(err, 1e-3 * std::max(1.0, ref_max)) << what << ": the CPU reference is " << err << " from fp64";
}

// The naive value of an output the GPU stores in `dtype`.
std::vector<float> stored(const std::vector<float>& v, DType dtype) { return dtype == DType::bf16 ? round_bf16(v) : v; }

// GPU "+=" gradient vs fp64: before + gradient; naive = the CPU's fp32 "+=" result, stored in dtype.
void expect_grad(const std::string& what, const Tensor& gpu, const Tensor& cpu, const std::vector<double>& ref) {
    const std::vector<float> cpu_values = host_values(cpu);
    expect_cpu_sane(what, cpu_values, ref);
    expect_vs_fp64(what, host_values(gpu), ref, stored(cpu_values, gpu.dtype()));
}

std::vector<double> plus(const std::vector<float>& before, const std::vector<double>& grad) {
    std::vector<double> out(grad.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = before[i] + grad[i];
    return out;
}

void expect_same_bits(const std::string& what, const std::vector<float>& a, const std::vector<float>& b) {
    ASSERT_EQ(a.size(), b.size()) << what;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << ": two runs differ";
}

double sigmoid64(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// ---------------------------------------------------------------------------------------------
// conv1d_silu

struct ConvRef {
    std::vector<double> out, dinp, dweight, dbias;
};

ConvRef conv_reference(const std::vector<float>& inp, const std::vector<float>& w, const std::vector<float>& bias,
                       const std::vector<float>& dout, const std::vector<int32_t>& ids, int64_t N, int64_t T, int64_t C,
                       int64_t K) {
    ConvRef r;
    r.out.assign(static_cast<size_t>(N * C), 0.0);
    r.dinp.assign(static_cast<size_t>(N * C), 0.0);
    r.dweight.assign(static_cast<size_t>(C * K), 0.0);
    r.dbias.assign(static_cast<size_t>(C), 0.0);
    std::vector<int64_t> first(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) first[n] = starts(ids, n, T) ? n : first[n - 1];
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t c = 0; c < C; ++c) {
            double pre = bias.empty() ? 0.0 : bias[c];
            for (int64_t j = 0; j < K; ++j) {
                const int64_t m = n - (K - 1) + j;
                if (m >= first[n]) pre += static_cast<double>(w[c * K + j]) * inp[m * C + c];
            }
            const double s = sigmoid64(pre);
            r.out[n * C + c] = pre * s;
            const double dpre = dout[n * C + c] * s * (1.0 + pre * (1.0 - s));
            r.dbias[c] += dpre;
            for (int64_t j = 0; j < K; ++j) {
                const int64_t m = n - (K - 1) + j;
                if (m < first[n]) continue;
                r.dweight[c * K + j] += dpre * inp[m * C + c];
                r.dinp[m * C + c] += dpre * w[c * K + j];
            }
        }
    }
    return r;
}

struct ConvCase {
    int64_t B, T, C, K;
    std::vector<std::vector<int64_t>> docs;  // per row; empty: no doc_ids
    bool with_bias;
};

TEST(CudaMamba2, Conv1dSiluMatchesReference) {
    std::mt19937 rng(11);
    const std::vector<ConvCase> cases = {
        {1, 37, 24, 4, {{10, 1, 26}}, true},
        {3, 20, 40, 4, {{20}, {1, 1, 18}, {5, 15}}, true},
        {2, 9, 7, 3, {}, false},
        {1, 64, 136, 8, {{3, 2, 1, 58}}, true},
        {2, 5, 16, 1, {{2, 3}, {5}}, true},
        {1, 130, 520, 4, {{64, 1, 65}}, true},
    };
    for (const ConvCase& s : cases) {
        for (const DType pdtype : {DType::f32, DType::bf16}) {
            const int64_t N = s.B * s.T;
            const std::string name = std::string("conv1d ") + mf::dtype_name(pdtype) + " B=" + std::to_string(s.B) +
                                     " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                                     " K=" + std::to_string(s.K) + (s.docs.empty() ? " no-docs" : "");
            const std::vector<int32_t> ids = s.docs.empty() ? std::vector<int32_t>{} : doc_ids_of(s.docs, s.T);
            const std::vector<float> inp = random_bf16(rng, static_cast<size_t>(N * s.C), -2.0f, 2.0f);
            const std::vector<float> w = random_bf16(rng, static_cast<size_t>(s.C * s.K), -0.8f, 0.8f);
            const std::vector<float> bias = random_bf16(rng, static_cast<size_t>(s.C), -0.5f, 0.5f);
            const std::vector<float> dout = random_bf16(rng, static_cast<size_t>(N * s.C));
            std::vector<float> dw0 = random_f32(rng, w.size()), db0 = random_f32(rng, bias.size());
            if (pdtype == DType::bf16) dw0 = round_bf16(dw0), db0 = round_bf16(db0);
            const ConvRef ref =
                conv_reference(inp, w, s.with_bias ? bias : std::vector<float>{}, dout, ids, N, s.T, s.C, s.K);

            DocIds d = doc_tensors(ids);
            Pair t_inp = both_devices(inp, {N, s.C}), t_dout = both_devices(dout, {N, s.C});
            Pair t_w = both_devices(w, {s.C, s.K}, pdtype);
            Pair t_b = both_devices(bias, {s.C}, pdtype);
            const Tensor b_cpu = s.with_bias ? t_b.cpu : Tensor(), b_gpu = s.with_bias ? t_b.gpu : Tensor();
            Pair out = output(inp.size(), {N, s.C});
            mf::ops::conv1d_silu_forward(out.cpu, t_inp.cpu, t_w.cpu, b_cpu, d.cpu, s.T);
            mf::ops::conv1d_silu_forward(out.gpu, t_inp.gpu, t_w.gpu, b_gpu, d.gpu, s.T);
            const std::vector<float> out_cpu = host_values(out.cpu);
            expect_cpu_sane(name + " out", out_cpu, ref.out);
            expect_vs_fp64(name + " out", host_values(out.gpu), ref.out, round_bf16(out_cpu));

            std::vector<float> runs[2][3];
            Pair dinp = output(inp.size(), {N, s.C});
            Pair dw = both_devices(dw0, {s.C, s.K}, pdtype);
            Pair db = both_devices(db0, {s.C}, pdtype);
            const Tensor db_cpu = s.with_bias ? db.cpu : Tensor(), db_gpu = s.with_bias ? db.gpu : Tensor();
            mf::ops::conv1d_silu_backward(dinp.cpu, dw.cpu, db_cpu, t_dout.cpu, t_inp.cpu, t_w.cpu, b_cpu, d.cpu, s.T);
            for (auto& run : runs) {
                MF_CHECK_CUDA(cudaMemset(dinp.gpu.data(), 0xFF, dinp.gpu.nbytes()));
                upload_values(dw.gpu, dw0);
                upload_values(db.gpu, db0);
                mf::ops::conv1d_silu_backward(dinp.gpu, dw.gpu, db_gpu, t_dout.gpu, t_inp.gpu, t_w.gpu, b_gpu, d.gpu,
                                              s.T);
                run[0] = host_values(dinp.gpu);
                run[1] = host_values(dw.gpu);
                run[2] = s.with_bias ? host_values(db.gpu) : std::vector<float>{};
            }
            const std::vector<float> dinp_cpu = host_values(dinp.cpu);
            expect_cpu_sane(name + " dinp", dinp_cpu, ref.dinp);
            expect_vs_fp64(name + " dinp", runs[0][0], ref.dinp, round_bf16(dinp_cpu));
            expect_grad(name + " dweight +=", dw.gpu, dw.cpu, plus(dw0, ref.dweight));
            if (s.with_bias) expect_grad(name + " dbias +=", db.gpu, db.cpu, plus(db0, ref.dbias));
            for (int k = 0; k < 3; ++k) expect_same_bits(name + " rerun " + std::to_string(k), runs[0][k], runs[1][k]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// gated_rmsnorm

struct GatedRef {
    std::vector<double> out, rstd, dx, dz, dweight;
};

GatedRef gated_reference(const std::vector<float>& x, const std::vector<float>& z, const std::vector<float>& w,
                         const std::vector<float>& dout, int64_t N, int64_t I, int64_t gs, double eps) {
    GatedRef r;
    r.out.resize(x.size());
    r.dx.resize(x.size());
    r.dz.resize(x.size());
    r.rstd.resize(static_cast<size_t>(N * (I / gs)));
    r.dweight.assign(w.size(), 0.0);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t g0 = 0; g0 < I; g0 += gs) {
            std::vector<double> g(static_cast<size_t>(gs));
            double sum_sq = 0.0;
            for (int64_t i = 0; i < gs; ++i) {
                const double zv = z[n * I + g0 + i];
                g[i] = x[n * I + g0 + i] * zv * sigmoid64(zv);
                sum_sq += g[i] * g[i];
            }
            const double rs = 1.0 / std::sqrt(sum_sq / static_cast<double>(gs) + eps);
            r.rstd[n * (I / gs) + g0 / gs] = rs;
            double sum_gx = 0.0;
            for (int64_t i = 0; i < gs; ++i) {
                const int64_t c = g0 + i;
                r.out[n * I + c] = w[c] * g[i] * rs;
                sum_gx += static_cast<double>(dout[n * I + c]) * w[c] * g[i] * rs;
                r.dweight[c] += dout[n * I + c] * g[i] * rs;
            }
            const double mean_gx = sum_gx / static_cast<double>(gs);
            for (int64_t i = 0; i < gs; ++i) {
                const int64_t c = g0 + i;
                const double dg = rs * (static_cast<double>(dout[n * I + c]) * w[c] - g[i] * rs * mean_gx);
                const double zv = z[n * I + c], s = sigmoid64(zv);
                r.dx[n * I + c] = dg * zv * s;
                r.dz[n * I + c] = dg * x[n * I + c] * s * (1.0 + zv * (1.0 - s));
            }
        }
    }
    return r;
}

TEST(CudaMamba2, GatedRmsnormMatchesReference) {
    std::mt19937 rng(12);
    struct Case {
        int64_t N, I, group_size;
    };
    const float eps = 1e-5f;
    for (const Case& s : {Case{37, 64, 16}, Case{5, 4096, 512}, Case{300, 96, 96}, Case{3, 2048, 2048}, Case{1, 30, 5},
                          Case{64, 1000, 200}}) {
        for (const DType pdtype : {DType::f32, DType::bf16}) {
            const std::string name = std::string("gated_rmsnorm ") + mf::dtype_name(pdtype) +
                                     " N=" + std::to_string(s.N) + " I=" + std::to_string(s.I) +
                                     " gs=" + std::to_string(s.group_size);
            const size_t n = static_cast<size_t>(s.N * s.I);
            const int64_t R = s.N * (s.I / s.group_size);
            const std::vector<float> x = random_bf16(rng, n, -2.0f, 2.0f), z = random_bf16(rng, n, -3.0f, 3.0f);
            const std::vector<float> w = random_bf16(rng, static_cast<size_t>(s.I), 0.5f, 1.5f);
            const std::vector<float> dout = random_bf16(rng, n);
            std::vector<float> dw0 = random_f32(rng, w.size());
            if (pdtype == DType::bf16) dw0 = round_bf16(dw0);
            const GatedRef ref = gated_reference(x, z, w, dout, s.N, s.I, s.group_size, eps);

            Pair t_x = both_devices(x, {s.N, s.I}), t_z = both_devices(z, {s.N, s.I});
            Pair t_dout = both_devices(dout, {s.N, s.I}), t_w = both_devices(w, {s.I}, pdtype);
            Pair out = output(n, {s.N, s.I}), rstd = output(static_cast<size_t>(R), {R}, DType::f32);
            mf::ops::gated_rmsnorm_forward(out.cpu, rstd.cpu, t_x.cpu, t_z.cpu, t_w.cpu, s.group_size, eps);
            mf::ops::gated_rmsnorm_forward(out.gpu, rstd.gpu, t_x.gpu, t_z.gpu, t_w.gpu, s.group_size, eps);
            const std::vector<float> out_cpu = host_values(out.cpu), rstd_cpu = host_values(rstd.cpu);
            expect_cpu_sane(name + " out", out_cpu, ref.out);
            expect_vs_fp64(name + " out", host_values(out.gpu), ref.out, round_bf16(out_cpu));
            expect_vs_fp64(name + " rstd", host_values(rstd.gpu), ref.rstd, rstd_cpu);

            Pair dx = output(n, {s.N, s.I}), dz = output(n, {s.N, s.I});
            Pair dw = both_devices(dw0, {s.I}, pdtype);
            mf::ops::gated_rmsnorm_backward(dx.cpu, dz.cpu, dw.cpu, t_dout.cpu, t_x.cpu, t_z.cpu, t_w.cpu, rstd.cpu,
                                            s.group_size);
            std::vector<float> runs[2][3];
            for (auto& run : runs) {
                MF_CHECK_CUDA(cudaMemset(dx.gpu.data(), 0xFF, dx.gpu.nbytes()));
                MF_CHECK_CUDA(cudaMemset(dz.gpu.data(), 0xFF, dz.gpu.nbytes()));
                upload_values(dw.gpu, dw0);
                mf::ops::gated_rmsnorm_backward(dx.gpu, dz.gpu, dw.gpu, t_dout.gpu, t_x.gpu, t_z.gpu, t_w.gpu, rstd.gpu,
                                                s.group_size);
                run[0] = host_values(dx.gpu);
                run[1] = host_values(dz.gpu);
                run[2] = host_values(dw.gpu);
            }
            const std::vector<float> dx_cpu = host_values(dx.cpu), dz_cpu = host_values(dz.cpu);
            expect_cpu_sane(name + " dx", dx_cpu, ref.dx);
            expect_cpu_sane(name + " dz", dz_cpu, ref.dz);
            expect_vs_fp64(name + " dx", runs[0][0], ref.dx, round_bf16(dx_cpu));
            expect_vs_fp64(name + " dz", runs[0][1], ref.dz, round_bf16(dz_cpu));
            expect_grad(name + " dweight +=", dw.gpu, dw.cpu, plus(dw0, ref.dweight));
            for (int k = 0; k < 3; ++k) expect_same_bits(name + " rerun " + std::to_string(k), runs[0][k], runs[1][k]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ssd_scan

struct ScanCase {
    int64_t B, T, H, P, G, S, Q;
    std::vector<std::vector<int64_t>> docs;  // per row; empty: no doc_ids
    float dt_min, dt_max;
};

struct ScanInputs {
    std::vector<float> xbc, dt, dt_bias, A_log, D, dy;
    std::vector<int32_t> ids;
};

// The sequential recurrence and its adjoint in Real (double: the reference; float: the naive fp32
// recurrence, used for the chunk states).
template <typename Real>
struct ScanRef {
    std::vector<Real> y, states, dxbc, ddt, ddt_bias, dA_log, dD;
};

template <typename Real>
ScanRef<Real> scan_reference(const ScanInputs& in, const ScanCase& s) {
    const int64_t N = s.B * s.T, I = s.H * s.P, W = I + 2 * s.G * s.S, PS = s.P * s.S;
    const int64_t chunks = (s.T + s.Q - 1) / s.Q;
    ScanRef<Real> r;
    r.y.assign(static_cast<size_t>(N * I), 0);
    r.states.assign(static_cast<size_t>(s.B * chunks * s.H * PS), 0);
    r.dxbc.assign(static_cast<size_t>(N * W), 0);
    r.ddt.assign(static_cast<size_t>(N * s.H), 0);
    r.ddt_bias.assign(static_cast<size_t>(s.H), 0);
    r.dA_log.assign(static_cast<size_t>(s.H), 0);
    r.dD.assign(static_cast<size_t>(s.H), 0);
    for (int64_t b = 0; b < s.B; ++b) {
        for (int64_t h = 0; h < s.H; ++h) {
            const int64_t g = h / (s.H / s.G), cx = h * s.P, cb = I + g * s.S, cc = I + (s.G + g) * s.S;
            const Real A = -std::exp(static_cast<Real>(in.A_log[h]));
            std::vector<Real> history(static_cast<size_t>(s.T * PS)), state(static_cast<size_t>(PS), 0);
            std::vector<Real> delta(static_cast<size_t>(s.T)), slope(static_cast<size_t>(s.T));
            auto X = [&](int64_t n, int64_t col) { return static_cast<Real>(in.xbc[n * W + col]); };
            for (int64_t t = 0; t < s.T; ++t) {
                const int64_t n = b * s.T + t;
                if (t > 0 && t % s.Q == 0) {
                    const int64_t at = ((b * chunks + t / s.Q) * s.H + h) * PS;
                    std::copy(state.begin(), state.end(), r.states.begin() + at);
                }
                if (starts(in.ids, n, s.T)) std::fill(state.begin(), state.end(), Real(0));
                const Real u = static_cast<Real>(in.dt[n * s.H + h]) + static_cast<Real>(in.dt_bias[h]);
                const Real sp = u > 20 ? u : std::log1p(std::exp(u));
                delta[t] = std::min(std::max(sp, static_cast<Real>(s.dt_min)), static_cast<Real>(s.dt_max));
                const bool passes = sp >= static_cast<Real>(s.dt_min) && sp <= static_cast<Real>(s.dt_max);
                slope[t] = passes ? (u > 20 ? Real(1) : Real(1) / (Real(1) + std::exp(-u))) : Real(0);
                const Real a = std::exp(delta[t] * A);
                for (int64_t p = 0; p < s.P; ++p)
                    for (int64_t k = 0; k < s.S; ++k)
                        state[p * s.S + k] = a * state[p * s.S + k] + delta[t] * X(n, cx + p) * X(n, cb + k);
                std::copy(state.begin(), state.end(), history.begin() + t * PS);
                for (int64_t p = 0; p < s.P; ++p) {
                    Real acc = static_cast<Real>(in.D[h]) * X(n, cx + p);
                    for (int64_t k = 0; k < s.S; ++k) acc += X(n, cc + k) * state[p * s.S + k];
                    r.y[n * I + h * s.P + p] = acc;
                }
            }
            // The adjoint λ_t = ∂L/∂state_t, in reverse.
            std::vector<Real> lambda(static_cast<size_t>(PS), 0);
            Real dA = 0;
            for (int64_t t = s.T - 1; t >= 0; --t) {
                const int64_t n = b * s.T + t;
                const bool first = starts(in.ids, n, s.T);
                const Real a = std::exp(delta[t] * A);
                Real xlb = 0, q = 0;
                for (int64_t p = 0; p < s.P; ++p) {
                    const Real dyv = in.dy[n * I + h * s.P + p];
                    Real lb = 0;
                    for (int64_t k = 0; k < s.S; ++k) {
                        Real& l = lambda[p * s.S + k];
                        l += dyv * X(n, cc + k);
                        r.dxbc[n * W + cc + k] += dyv * history[t * PS + p * s.S + k];
                        lb += l * X(n, cb + k);
                        if (!first) q += l * history[(t - 1) * PS + p * s.S + k];
                    }
                    r.dxbc[n * W + cx + p] = static_cast<Real>(in.D[h]) * dyv + delta[t] * lb;
                    xlb += X(n, cx + p) * lb;
                    r.dD[h] += dyv * X(n, cx + p);
                }
                for (int64_t k = 0; k < s.S; ++k) {
                    Real acc = 0;
                    for (int64_t p = 0; p < s.P; ++p) acc += lambda[p * s.S + k] * X(n, cx + p);
                    r.dxbc[n * W + cb + k] += delta[t] * acc;
                }
                q *= a;
                const Real ddt = (xlb + A * q) * slope[t];
                r.ddt[n * s.H + h] = ddt;
                r.ddt_bias[h] += ddt;
                dA += delta[t] * q;
                for (Real& l : lambda) l = first ? Real(0) : a * l;
            }
            r.dA_log[h] += A * dA;
        }
    }
    return r;
}

ScanInputs scan_inputs(std::mt19937& rng, const ScanCase& s) {
    const int64_t N = s.B * s.T, I = s.H * s.P, W = I + 2 * s.G * s.S;
    ScanInputs in;
    in.xbc = random_bf16(rng, static_cast<size_t>(N * W));
    in.dt = random_bf16(rng, static_cast<size_t>(N * s.H), -4.0f, 1.0f);
    in.dt_bias = random_bf16(rng, static_cast<size_t>(s.H), -1.0f, 1.0f);
    in.A_log = random_bf16(rng, static_cast<size_t>(s.H), -1.0f, 1.5f);
    in.D = random_bf16(rng, static_cast<size_t>(s.H));
    in.dy = random_bf16(rng, static_cast<size_t>(N * I));
    if (!s.docs.empty()) in.ids = doc_ids_of(s.docs, s.T);
    return in;
}

mf::ops::SsdDims dims_of(const ScanCase& s) {
    mf::ops::SsdDims d;
    d.T = s.T;
    d.num_heads = s.H;
    d.head_dim = s.P;
    d.num_groups = s.G;
    d.state_size = s.S;
    d.chunk_size = s.Q;
    d.dt_min = s.dt_min;
    d.dt_max = s.dt_max;
    return d;
}

std::string scan_name(const ScanCase& s, DType pdtype) {
    return std::string("ssd ") + mf::dtype_name(pdtype) + " B" + std::to_string(s.B) + " T" + std::to_string(s.T) +
           " Q" + std::to_string(s.Q) + " H" + std::to_string(s.H) + " P" + std::to_string(s.P) + " G" +
           std::to_string(s.G) + " S" + std::to_string(s.S) + (s.docs.empty() ? " no-docs" : "") +
           (std::isfinite(s.dt_max) ? " clamp" : "");
}

TEST(CudaMamba2, SsdScanMatchesReference) {
    std::mt19937 rng(13);
    const float kInf = INFINITY;
    const std::vector<ScanCase> cases = {
        // a document starting mid-chunk (token 10), a one-token document (10), T % Q = 5
        {1, 37, 2, 8, 1, 16, 16, {{10, 1, 26}}, 0.0f, kInf},
        // B = 2, G = 2: row 0 ragged with a one-token document; row 1 a document starting at a chunk start
        {2, 50, 4, 16, 2, 32, 32, {{20, 1, 29}, {32, 18}}, 0.0f, kInf},
        // Nemotron's head and state sizes and chunk, T % Q = 2, G = 1
        {1, 130, 2, 64, 1, 128, 128, {{64, 1, 65}}, 0.0f, kInf},
        // odd sizes, G = H, no doc_ids, an active clamp on both sides
        {3, 7, 3, 5, 3, 3, 4, {}, 0.05f, 0.5f},
        // chunk 1, and a chunk longer than the row
        {1, 9, 2, 4, 2, 4, 1, {{3, 1, 5}}, 0.0f, kInf},
        {2, 5, 2, 4, 1, 8, 8, {{1, 1, 1, 2}, {5}}, 0.0f, kInf},
        // G = 2 of 4 heads each, several chunks, one-token documents at a chunk's start and end
        {2, 100, 8, 16, 2, 16, 24, {{23, 1, 1, 75}, {48, 52}}, 0.001f, kInf},
        // Nemotron 3 Nano's layer geometry (H 64, P 64, G 8, S 128, Q 128) over 4 chunks (the full
        // 4096 tokens only in the timing below: the fp64 reference is sequential), a document starting
        // mid-chunk after a one-token one, the last chunk full
        {1, 512, 64, 64, 8, 128, 128, {{200, 1, 311}}, 0.0f, kInf},
    };
    for (const ScanCase& s : cases) {
        for (const DType pdtype : {DType::f32, DType::bf16}) {
            const std::string name = scan_name(s, pdtype);
            const int64_t N = s.B * s.T, I = s.H * s.P, W = I + 2 * s.G * s.S;
            const mf::ops::SsdDims d = dims_of(s);
            const ScanInputs in = scan_inputs(rng, s);
            const ScanRef<double> ref = scan_reference<double>(in, s);
            const ScanRef<float> ref32 = scan_reference<float>(in, s);
            std::vector<float> g0[3];
            for (auto& g : g0) g = stored(random_f32(rng, static_cast<size_t>(s.H)), pdtype);

            DocIds ids = doc_tensors(in.ids);
            Pair xbc = both_devices(in.xbc, {N, W}), dt = both_devices(in.dt, {N, s.H});
            Pair dy = both_devices(in.dy, {N, I});
            Pair dt_bias = both_devices(in.dt_bias, {s.H}, pdtype), A_log = both_devices(in.A_log, {s.H}, pdtype);
            Pair D = both_devices(in.D, {s.H}, pdtype);
            const int64_t states_n = mf::ops::ssd_chunk_states_numel(N, d);
            ASSERT_EQ(static_cast<size_t>(states_n), ref.states.size()) << name;
            Pair states = output(static_cast<size_t>(states_n), {states_n}, DType::f32);
            Pair y = output(static_cast<size_t>(N * I), {N, I});
            mf::ops::ssd_scan_forward(y.cpu, states.cpu, xbc.cpu, dt.cpu, dt_bias.cpu, A_log.cpu, D.cpu, ids.cpu, d);
            std::vector<float> y_runs[2], states_runs[2];
            for (int k = 0; k < 2; ++k) {
                MF_CHECK_CUDA(cudaMemset(y.gpu.data(), 0xFF, y.gpu.nbytes()));
                MF_CHECK_CUDA(cudaMemset(states.gpu.data(), 0xFF, states.gpu.nbytes()));
                mf::ops::ssd_scan_forward(y.gpu, states.gpu, xbc.gpu, dt.gpu, dt_bias.gpu, A_log.gpu, D.gpu, ids.gpu,
                                          d);
                y_runs[k] = host_values(y.gpu);
                states_runs[k] = host_values(states.gpu);
            }
            const std::vector<float> y_cpu = host_values(y.cpu);
            expect_cpu_sane(name + " y", y_cpu, ref.y);
            expect_vs_fp64(name + " y", y_runs[0], ref.y, round_bf16(y_cpu));
            expect_vs_fp64(name + " states", states_runs[0], ref.states, {ref32.states.begin(), ref32.states.end()});
            expect_same_bits(name + " y rerun", y_runs[0], y_runs[1]);
            expect_same_bits(name + " states rerun", states_runs[0], states_runs[1]);

            Pair dxbc = output(static_cast<size_t>(N * W), {N, W}),
                 ddt = output(static_cast<size_t>(N * s.H), {N, s.H});
            Pair ddt_bias = both_devices(g0[0], {s.H}, pdtype), dA_log = both_devices(g0[1], {s.H}, pdtype);
            Pair dD = both_devices(g0[2], {s.H}, pdtype);
            mf::ops::ssd_scan_backward(dxbc.cpu, ddt.cpu, ddt_bias.cpu, dA_log.cpu, dD.cpu, dy.cpu, xbc.cpu, dt.cpu,
                                       dt_bias.cpu, A_log.cpu, D.cpu, states.cpu, ids.cpu, d);
            std::vector<float> runs[2][5];
            for (auto& run : runs) {
                MF_CHECK_CUDA(cudaMemset(dxbc.gpu.data(), 0xFF, dxbc.gpu.nbytes()));
                MF_CHECK_CUDA(cudaMemset(ddt.gpu.data(), 0xFF, ddt.gpu.nbytes()));
                upload_values(ddt_bias.gpu, g0[0]);
                upload_values(dA_log.gpu, g0[1]);
                upload_values(dD.gpu, g0[2]);
                mf::ops::ssd_scan_backward(dxbc.gpu, ddt.gpu, ddt_bias.gpu, dA_log.gpu, dD.gpu, dy.gpu, xbc.gpu, dt.gpu,
                                           dt_bias.gpu, A_log.gpu, D.gpu, states.gpu, ids.gpu, d);
                run[0] = host_values(dxbc.gpu);
                run[1] = host_values(ddt.gpu);
                run[2] = host_values(ddt_bias.gpu);
                run[3] = host_values(dA_log.gpu);
                run[4] = host_values(dD.gpu);
            }
            const std::vector<float> dxbc_cpu = host_values(dxbc.cpu), ddt_cpu = host_values(ddt.cpu);
            expect_cpu_sane(name + " dxbc", dxbc_cpu, ref.dxbc);
            expect_cpu_sane(name + " ddt", ddt_cpu, ref.ddt);
            // dx, dB and dC separately: their magnitudes differ.
            const std::pair<int64_t, int64_t> parts[3] = {{0, I}, {I, I + s.G * s.S}, {I + s.G * s.S, W}};
            const char* part_names[3] = {" dx", " dB", " dC"};
            for (int k = 0; k < 3; ++k) {
                std::vector<float> gpu_part, cpu_part;
                std::vector<double> ref_part;
                for (int64_t n = 0; n < N; ++n) {
                    for (int64_t c = parts[k].first; c < parts[k].second; ++c) {
                        gpu_part.push_back(runs[0][0][n * W + c]);
                        cpu_part.push_back(dxbc_cpu[n * W + c]);
                        ref_part.push_back(ref.dxbc[n * W + c]);
                    }
                }
                expect_vs_fp64(name + part_names[k], gpu_part, ref_part, round_bf16(cpu_part));
            }
            expect_vs_fp64(name + " ddt", runs[0][1], ref.ddt, round_bf16(ddt_cpu));
            expect_grad(name + " ddt_bias +=", ddt_bias.gpu, ddt_bias.cpu, plus(g0[0], ref.ddt_bias));
            expect_grad(name + " dA_log +=", dA_log.gpu, dA_log.cpu, plus(g0[1], ref.dA_log));
            expect_grad(name + " dD +=", dD.gpu, dD.cpu, plus(g0[2], ref.dD));
            for (int k = 0; k < 5; ++k)
                expect_same_bits(name + " bwd rerun " + std::to_string(k), runs[0][k], runs[1][k]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// throughput at the Nemotron 3 Nano geometry (a print)

TEST(CudaMamba2, SsdScanThroughputAtNemotronNano) {
    const ScanCase s{1, 4096, 64, 64, 8, 128, 128, {{4096}}, 0.0f, INFINITY};
    const int64_t N = s.B * s.T, I = s.H * s.P, W = I + 2 * s.G * s.S;
    const mf::ops::SsdDims d = dims_of(s);
    std::mt19937 rng(14);
    const ScanInputs in = scan_inputs(rng, s);
    DocIds ids = doc_tensors(in.ids);
    Pair xbc = both_devices(in.xbc, {N, W}), dt = both_devices(in.dt, {N, s.H}), dy = both_devices(in.dy, {N, I});
    Pair dt_bias = both_devices(in.dt_bias, {s.H}, DType::f32), A_log = both_devices(in.A_log, {s.H}, DType::f32);
    Pair D = both_devices(in.D, {s.H}, DType::f32);
    const int64_t states_n = mf::ops::ssd_chunk_states_numel(N, d);
    Pair states = output(static_cast<size_t>(states_n), {states_n}, DType::f32);
    Pair y = output(static_cast<size_t>(N * I), {N, I});
    Pair dxbc = output(static_cast<size_t>(N * W), {N, W}), ddt = output(static_cast<size_t>(N * s.H), {N, s.H});
    Pair ddt_bias = output(static_cast<size_t>(s.H), {s.H}, DType::f32);
    Pair dA_log = output(static_cast<size_t>(s.H), {s.H}, DType::f32),
         dD = output(static_cast<size_t>(s.H), {s.H}, DType::f32);
    mf::ops::zero(ddt_bias.gpu);
    mf::ops::zero(dA_log.gpu);
    mf::ops::zero(dD.gpu);
    const double fwd_us = time_us([&] {
        mf::ops::ssd_scan_forward(y.gpu, states.gpu, xbc.gpu, dt.gpu, dt_bias.gpu, A_log.gpu, D.gpu, ids.gpu, d);
    });
    const double bwd_us = time_us([&] {
        mf::ops::ssd_scan_backward(dxbc.gpu, ddt.gpu, ddt_bias.gpu, dA_log.gpu, dD.gpu, dy.gpu, xbc.gpu, dt.gpu,
                                   dt_bias.gpu, A_log.gpu, D.gpu, states.gpu, ids.gpu, d);
    });
    // Bytes: the activations read and written once, the chunk states written and read (forward: local
    // states written, the pass reads and writes them, the output reads them; backward: states read, the
    // gradient states written, passed and read, the dB|dC f32 scratch written and read).
    const double Q = static_cast<double>(s.Q), P = static_cast<double>(s.P), S = static_cast<double>(s.S);
    const double chunk_heads = static_cast<double>(s.B * ((s.T + s.Q - 1) / s.Q) * s.H);
    const double act = 2.0 * (N * W + N * s.H + N * I);
    const double state_bytes = 4.0 * static_cast<double>(states_n);
    const double fwd_bytes = act + 4.0 * state_bytes;
    const double bwd_bytes = act + 2.0 * N * I + 2.0 * (N * W + N * s.H) + 5.0 * state_bytes + 8.0 * N * 2 * s.G * s.S;
    // FLOPs of the chunked algorithm's products (2 per multiply-add; the causal C·Bᵀ counted as half):
    // forward per (chunk, head): states 2QPS, C·Bᵀ Q²S, M·X 2Q²P, C·h_in 2QPS;
    // backward: dstates 2QPS, C·Bᵀ Q²S per group, dy·xᵀ 2Q²P, B·dh_out 2QPS, dx 2Q²P, C·h_in 2QPS,
    // dB 2Q²S + 2QPS, dC 2Q²S + 2QPS.
    const double fwd_flops = chunk_heads * (4 * Q * P * S + Q * Q * S + 2 * Q * Q * P);
    const double bwd_flops = chunk_heads * (10 * Q * P * S + 4 * Q * Q * P + 4 * Q * Q * S) +
                             chunk_heads / static_cast<double>(s.H / s.G) * Q * Q * S;
    std::printf("BENCH ssd_scan forward  H64 P64 G8 S128 Q128 T4096 B1: %7.3f ms  %7.1f GB/s  %6.2f TFLOP/s\n",
                fwd_us * 1e-3, fwd_bytes / (fwd_us * 1e3), fwd_flops / (fwd_us * 1e6));
    std::printf("BENCH ssd_scan backward H64 P64 G8 S128 Q128 T4096 B1: %7.3f ms  %7.1f GB/s  %6.2f TFLOP/s\n",
                bwd_us * 1e-3, bwd_bytes / (bwd_us * 1e3), bwd_flops / (bwd_us * 1e6));
    EXPECT_TRUE(std::isfinite(host_values(dA_log.gpu)[0]));
}

}  // namespace
