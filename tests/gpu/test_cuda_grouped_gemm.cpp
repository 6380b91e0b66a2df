// GPU parity of the grouped expert GEMMs against the fp32 CPU reference (kernels/cpu/grouped_matmul.h),
// fed the same bf16-rounded inputs; offsets live on the device. Every case runs through every path:
// the own kernel (kernels/cuda/grouped_gemm.cuh) and the cuBLAS path (kernels/cuda/grouped_gemm_cublas.cuh).
//
// Tolerance rule (CONVENTIONS.md): max_i |gpu_i − ref_i| <= 2 · max_i |naive_i − ref_i| + floor, where
// ref is the CPU kernel and naive is the same computation stored the way a bf16 kernel stores it
// (the fp32 result rounded to bf16; bf16 "+=" rounds the product, then the sum; for fp32 outputs
// naive = ref). floor = 2^-16 · max(1, max|ref|)
// covers fp32 summation-order differences. Outputs are poisoned with NaN before every GPU call, so an
// element never written fails, and rows outside the groups must come back untouched. Sweeps: empty
// experts, single rows, ragged groups, sizes that are no tile multiple, offsets[0] > 0 with rows after
// offsets[E], 130 experts. MF_BENCH=1 times both paths at the Qwen3-30B-A3B expert shapes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/cpu/grouped_matmul.h"
#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/grouped_gemm_cublas.cuh"
#include "kernels/cuda/grouped_gemm_sm90.cuh"
#include "kernels/cuda/swiglu.cuh"
#include "test_cuda_helpers.h"

namespace {

using mf::cuda::bf16;
using namespace mf::test;  // DeviceBuffer, bf16 copies (test_cuda_common.h), expect_parity (test_cuda_helpers.h)

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// ---------------------------------------------------------------------------------------------
// paths: the same three entries through the own kernel or through cuBLAS

struct Path {
    const char* name;
    bool cublas;
    bool host_offsets = false;  // cuBLAS only: the caller passes the offsets on the host (no read-back)
    bool sm90 = false;          // through the wgmma kernels (grouped_gemm_sm90.cuh; input gradient written only)
};

const std::vector<Path> kPaths = {{"own", false}, {"cublas", true}, {"cublas+host", true, true}};

// The cuBLAS path's state (default lanes), created on first use and kept for the process.
mf::cuda::GroupedGemmCublas& cublas_state() {
    static auto* lt = new mf::cuda::GemmContext();
    static auto* state = new mf::cuda::GroupedGemmCublas(lt->handle);
    return *state;
}

// The host copy a "+host" path hands over: the caller's `known` values (the benchmark's), else read
// from the device here (when there is anything valid to read; the argument-error cases then reach
// the callee's own checks).
struct HostOffsets {
    std::vector<int32_t> values;
    HostOffsets(const Path& p, const int32_t* offsets, int64_t E, const std::vector<int32_t>* known) {
        if (!p.host_offsets) return;
        if (known != nullptr) {
            values = *known;
            return;
        }
        if (offsets == nullptr || E < 0 || E > mf::cuda::kMaxGroupedExperts) return;
        values.resize(static_cast<size_t>(E + 1));
        MF_CHECK_CUDA(cudaMemcpy(values.data(), offsets, values.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    }
};

void forward(const Path& p, bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int64_t M,
             int64_t E, int64_t C, int64_t OC, const std::vector<int32_t>* known = nullptr) {
    if (p.sm90)
        mf::cuda::grouped_matmul_forward_sm90(out, inp, weight, offsets, M, E, C, OC, nullptr);
    else if (p.cublas)
        mf::cuda::grouped_matmul_forward_cublas(cublas_state(), out, inp, weight, offsets, M, E, C, OC, nullptr,
                                                HostOffsets(p, offsets, E, known).values);
    else
        mf::cuda::grouped_matmul_forward(out, inp, weight, offsets, M, E, C, OC, nullptr);
}

void backward_input(const Path& p, bf16* dinp, const bf16* dout, const bf16* weight, const int32_t* offsets, int64_t M,
                    int64_t E, int64_t C, int64_t OC, bool accumulate, const std::vector<int32_t>* known = nullptr) {
    if (p.sm90) {
        MF_CHECK(!accumulate, "the sm90 input gradient is written, never accumulated");
        mf::cuda::grouped_matmul_backward_input_sm90(dinp, dout, weight, offsets, M, E, C, OC, nullptr);
    } else if (p.cublas)
        mf::cuda::grouped_matmul_backward_input_cublas(cublas_state(), dinp, dout, weight, offsets, M, E, C, OC,
                                                       accumulate, nullptr, HostOffsets(p, offsets, E, known).values);
    else
        mf::cuda::grouped_matmul_backward_input(dinp, dout, weight, offsets, M, E, C, OC, accumulate, nullptr);
}

// Accumulates onto dweight.
void backward_weight(const Path& p, void* dweight, mf::DType dtype, const bf16* dout, const bf16* inp,
                     const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                     const std::vector<int32_t>* known = nullptr) {
    if (p.sm90)
        mf::cuda::grouped_matmul_backward_weight_sm90(dweight, dtype, dout, inp, offsets, M, E, C, OC, true, nullptr);
    else if (p.cublas)
        mf::cuda::grouped_matmul_backward_weight_cublas(cublas_state(), dweight, dtype, dout, inp, offsets, M, E, C, OC,
                                                        nullptr, HostOffsets(p, offsets, E, known).values);
    else
        mf::cuda::grouped_matmul_backward_weight(dweight, dtype, dout, inp, offsets, M, E, C, OC, nullptr);
}

// ---------------------------------------------------------------------------------------------
// cases

struct GroupCase {
    int64_t E, C, OC;
    std::vector<int32_t> sizes;  // rows per expert
    int32_t lead = 0;            // rows before offsets[0] (never touched)
    int32_t tail = 0;            // rows after offsets[E] (never touched)

    int64_t rows() const {
        int64_t m = lead + tail;
        for (int32_t s : sizes) m += s;
        return m;
    }
    std::vector<int32_t> offsets() const {
        std::vector<int32_t> off(E + 1);
        off[0] = lead;
        for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + sizes[e];
        return off;
    }
    std::string label(const Path& p, const char* op) const {
        return std::string(p.name) + " " + op + " E=" + std::to_string(E) + " C=" + std::to_string(C) +
               " OC=" + std::to_string(OC) + " M=" + std::to_string(rows());
    }
};

std::vector<GroupCase> make_cases() {
    std::vector<GroupCase> cases = {
        {4, 64, 48, {0, 1, 130, 37}},                     // an empty expert, a single row, > one row tile
        {5, 200, 136, {3, 0, 0, 257, 64}, 5, 7},          // no tile multiples; rows outside the groups
        {8, 128, 256, {0, 0, 0, 0, 0, 0, 300, 0}, 0, 3},  // one busy expert among empty ones
        {1, 512, 384, {300}},                             // long K loop
        {3, 8, 8, {1, 2, 3}, 2, 0},                       // tiny
    };
    // Many experts (the group table scan runs over several 32-expert chunks), ragged, many empty.
    std::mt19937 rng(42);
    GroupCase many{130, 32, 24, {}, 1, 1};
    for (int e = 0; e < 130; ++e) many.sizes.push_back(rng() % 3 == 0 ? 0 : static_cast<int32_t>(rng() % 40));
    cases.push_back(many);
    return cases;
}

// Rows of a [M, width] matrix split into those inside [off[0], off[E]) and those outside.
void split_rows(const std::vector<float>& all, int64_t width, const std::vector<int32_t>& off,
                std::vector<float>* inside, std::vector<float>* outside) {
    const int64_t rows = static_cast<int64_t>(all.size()) / std::max<int64_t>(width, 1);
    for (int64_t r = 0; r < rows; ++r) {
        auto* dst = (r >= off.front() && r < off.back()) ? inside : outside;
        dst->insert(dst->end(), all.begin() + r * width, all.begin() + (r + 1) * width);
    }
}

// Outside rows must be bitwise what they were before the call (NaN poison counts as equal).
void expect_untouched(const std::string& what, const std::vector<float>& now, const std::vector<float>& before) {
    ASSERT_EQ(now.size(), before.size());
    size_t changed = 0;
    for (size_t i = 0; i < now.size(); ++i)
        changed += !(now[i] == before[i] || (std::isnan(now[i]) && std::isnan(before[i])));
    EXPECT_EQ(changed, 0u) << what << ": " << changed << " elements outside the groups were written";
}

// ---------------------------------------------------------------------------------------------
// parity

// The forward of case g through path p on fresh random inputs against the CPU, rows outside the
// groups untouched; `runs` > 1 repeats the call, which must give the same bits.
void check_forward(const Path& p, const GroupCase& g, std::mt19937& rng, int runs = 1) {
    const int64_t M = g.rows();
    const auto off = g.offsets();
    const auto inp = random_bf16(rng, M * g.C);
    const auto weight = random_bf16(rng, g.E * g.OC * g.C);
    std::vector<float> ref(M * g.OC, 0.0f);
    mf::cpu::grouped_matmul_forward(ref.data(), inp.data(), weight.data(), off.data(), g.E, g.C, g.OC);

    DeviceBuffer d_inp(inp.size() * 2), d_w(weight.size() * 2), d_out(ref.size() * 2);
    const DeviceBuffer d_off = device_copy(off);
    upload_bf16(d_inp.as<void>(), inp);
    upload_bf16(d_w.as<void>(), weight);
    std::vector<uint16_t> first;
    for (int run = 0; run < runs; ++run) {
        d_out.poison();
        forward(p, d_out.as<bf16>(), d_inp.as<bf16>(), d_w.as<bf16>(), d_off.as<int32_t>(), M, g.E, g.C, g.OC);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        const auto bits = download<uint16_t>(d_out.as<void>(), ref.size());
        if (run > 0) {
            EXPECT_TRUE(bits == first) << g.label(p, "forward") << ": run " << run << " differs from the first";
            continue;
        }
        first = bits;
        const auto gpu = download_bf16(d_out.as<void>(), ref.size());
        std::vector<float> gpu_in, gpu_out, ref_in, ref_out;
        split_rows(gpu, g.OC, off, &gpu_in, &gpu_out);
        split_rows(ref, g.OC, off, &ref_in, &ref_out);
        expect_parity(g.label(p, "forward"), gpu_in, ref_in, round_bf16(ref_in));
        expect_untouched(g.label(p, "forward"), gpu_out, std::vector<float>(gpu_out.size(), NAN));
    }
}

TEST(CudaGroupedGemm, ForwardParity) {
    for (const Path& p : kPaths) {
        std::mt19937 rng(11);
        for (const GroupCase& g : make_cases()) check_forward(p, g, rng);
    }
}

// The input gradient of case g through path p (written, or accumulated onto random values) against
// the CPU, rows outside the groups untouched; `runs` > 1 repeats the call, which must give the same
// bits.
void check_backward_input(const Path& p, const GroupCase& g, std::mt19937& rng, bool accumulate, int runs = 1) {
    const int64_t M = g.rows();
    const auto off = g.offsets();
    const auto dout = random_bf16(rng, M * g.OC);
    const auto weight = random_bf16(rng, g.E * g.OC * g.C);
    const auto before = random_bf16(rng, M * g.C);
    std::vector<float> product(M * g.C, 0.0f);
    mf::cpu::grouped_matmul_backward(product.data(), nullptr, dout.data(), nullptr, weight.data(), off.data(), g.E, g.C,
                                     g.OC);
    const auto ref = accumulate ? fp32_add(before, product) : product;
    const auto naive = accumulate ? naive_bf16_add(before, product) : round_bf16(product);

    DeviceBuffer d_dout(dout.size() * 2), d_w(weight.size() * 2), d_dinp(ref.size() * 2);
    const DeviceBuffer d_off = device_copy(off);
    upload_bf16(d_dout.as<void>(), dout);
    upload_bf16(d_w.as<void>(), weight);
    const char* op = accumulate ? "backward input +=" : "backward input =";
    std::vector<uint16_t> first;
    for (int run = 0; run < runs; ++run) {
        if (accumulate)
            upload_bf16(d_dinp.as<void>(), before);
        else
            d_dinp.poison();
        backward_input(p, d_dinp.as<bf16>(), d_dout.as<bf16>(), d_w.as<bf16>(), d_off.as<int32_t>(), M, g.E, g.C, g.OC,
                       accumulate);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        const auto bits = download<uint16_t>(d_dinp.as<void>(), ref.size());
        if (run > 0) {
            EXPECT_TRUE(bits == first) << g.label(p, op) << ": run " << run << " differs from the first";
            continue;
        }
        first = bits;
        const auto gpu = download_bf16(d_dinp.as<void>(), ref.size());
        std::vector<float> gpu_in, gpu_out, ref_in, ref_out, naive_in, naive_out, before_in, before_out;
        split_rows(gpu, g.C, off, &gpu_in, &gpu_out);
        split_rows(ref, g.C, off, &ref_in, &ref_out);
        split_rows(naive, g.C, off, &naive_in, &naive_out);
        split_rows(before, g.C, off, &before_in, &before_out);
        expect_parity(g.label(p, op), gpu_in, ref_in, naive_in);
        expect_untouched(g.label(p, op), gpu_out, accumulate ? before_out : std::vector<float>(gpu_out.size(), NAN));
    }
}

TEST(CudaGroupedGemm, BackwardInputParity) {
    for (const Path& p : kPaths) {
        std::mt19937 rng(12);
        for (const GroupCase& g : make_cases())
            for (bool accumulate : {false, true}) check_backward_input(p, g, rng, accumulate);
    }
}

// The weight gradient of case g through path p, accumulated onto random values, against the CPU in
// both gradient dtypes; empty experts keep their values bit for bit.
void check_backward_weight(const Path& p, const GroupCase& g, std::mt19937& rng) {
    for (mf::DType dtype : {mf::DType::f32, mf::DType::bf16}) {
        const int64_t M = g.rows();
        const auto off = g.offsets();
        const auto dout = random_bf16(rng, M * g.OC);
        const auto inp = random_bf16(rng, M * g.C);
        const auto before = random_bf16(rng, g.E * g.OC * g.C);
        std::vector<float> product(g.E * g.OC * g.C, 0.0f);
        mf::cpu::grouped_matmul_backward(nullptr, product.data(), dout.data(), inp.data(), nullptr, off.data(), g.E,
                                         g.C, g.OC);
        const auto ref = fp32_add(before, product);

        const bool f32 = dtype == mf::DType::f32;
        DeviceBuffer d_dout(dout.size() * 2), d_inp(inp.size() * 2), d_dw(ref.size() * (f32 ? 4 : 2));
        const DeviceBuffer d_off = device_copy(off);
        upload_bf16(d_dout.as<void>(), dout);
        upload_bf16(d_inp.as<void>(), inp);
        upload_grad(d_dw.as<void>(), before, f32);
        backward_weight(p, d_dw.as<void>(), dtype, d_dout.as<bf16>(), d_inp.as<bf16>(), d_off.as<int32_t>(), M, g.E,
                        g.C, g.OC);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        const auto gpu = download_grad(d_dw.as<void>(), ref.size(), f32);
        expect_parity(g.label(p, f32 ? "backward weight f32 +=" : "backward weight bf16 +="), gpu, ref,
                      f32 ? ref : naive_bf16_add(before, product));
        for (int64_t e = 0; e < g.E; ++e) {
            if (g.sizes[e] != 0) continue;
            const int64_t n = g.OC * g.C;
            EXPECT_TRUE(std::equal(gpu.begin() + e * n, gpu.begin() + (e + 1) * n, before.begin() + e * n))
                << g.label(p, "backward weight") << ": empty expert " << e << " changed";
        }
    }
}

TEST(CudaGroupedGemm, BackwardWeightParity) {
    for (const Path& p : kPaths) {
        std::mt19937 rng(13);
        for (const GroupCase& g : make_cases()) check_backward_weight(p, g, rng);
    }
}

// The written weight gradient through path p (cublas or sm90) over a buffer of NaNs: the bits of
// zeroing and accumulating (so the old values are not read), an empty expert's slice zeros.
void expect_written_equals_accumulated(const Path& p, const GroupCase& g, std::mt19937& rng) {
    for (mf::DType dtype : {mf::DType::f32, mf::DType::bf16}) {
        const int64_t M = g.rows(), n = g.E * g.OC * g.C;
        const auto off = g.offsets();
        const auto dout = random_bf16(rng, M * g.OC);
        const auto inp = random_bf16(rng, M * g.C);
        const size_t elem = dtype == mf::DType::f32 ? 4 : 2;
        DeviceBuffer d_dout(dout.size() * 2), d_inp(inp.size() * 2), written(n * elem), summed(n * elem);
        const DeviceBuffer d_off = device_copy(off);
        upload_bf16(d_dout.as<void>(), dout);
        upload_bf16(d_inp.as<void>(), inp);
        MF_CHECK_CUDA(cudaMemset(written.as<void>(), 0xff, written.bytes()));  // NaN in f32 and bf16
        MF_CHECK_CUDA(cudaMemset(summed.as<void>(), 0, summed.bytes()));
        if (p.sm90) {
            mf::cuda::grouped_matmul_backward_weight_sm90(written.as<void>(), dtype, d_dout.as<bf16>(),
                                                          d_inp.as<bf16>(), d_off.as<int32_t>(), M, g.E, g.C, g.OC,
                                                          false, nullptr);
        } else {
            const HostOffsets host(p, d_off.as<int32_t>(), g.E, nullptr);
            mf::cuda::grouped_matmul_backward_weight_cublas(cublas_state(), written.as<void>(), dtype,
                                                            d_dout.as<bf16>(), d_inp.as<bf16>(), d_off.as<int32_t>(), M,
                                                            g.E, g.C, g.OC, nullptr, host.values, false);
        }
        backward_weight(p, summed.as<void>(), dtype, d_dout.as<bf16>(), d_inp.as<bf16>(), d_off.as<int32_t>(), M, g.E,
                        g.C, g.OC);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        const auto a = download<uint8_t>(written.as<void>(), n * elem);
        const auto b = download<uint8_t>(summed.as<void>(), n * elem);
        EXPECT_TRUE(a == b) << g.label(p, dtype == mf::DType::f32 ? "backward weight f32 =" : "backward weight bf16 =");
    }
}

// The sm90 weight gradient's square sums (square_sum +=, formed while storing): the gradient's bits
// are those of the call without them, and the sum is that of the stored values' squares in double
// (added to the slot's old value), within the kernel's fp32 sums of 128 squares per thread (128·2^-24
// relative) and the double additions on each side (n·2^-53 relative each).
void expect_square_sums(const GroupCase& g, std::mt19937& rng) {
    for (mf::DType dtype : {mf::DType::f32, mf::DType::bf16})
        for (const bool accumulate : {false, true}) {
            const int64_t M = g.rows(), n = g.E * g.OC * g.C;
            const bool f32 = dtype == mf::DType::f32;
            const auto off = g.offsets();
            const auto dout = random_bf16(rng, M * g.OC), inp = random_bf16(rng, M * g.C), before = random_bf16(rng, n);
            DeviceBuffer d_dout(dout.size() * 2), d_inp(inp.size() * 2), plain(n * (f32 ? 4 : 2)),
                fused(n * (f32 ? 4 : 2)), sum(sizeof(double)),
                scratch(mf::cuda::grouped_matmul_backward_weight_sm90_squares_bytes(g.E, g.C, g.OC));
            const DeviceBuffer d_off = device_copy(off);
            upload_bf16(d_dout.as<void>(), dout);
            upload_bf16(d_inp.as<void>(), inp);
            upload_grad(plain.as<void>(), before, f32);
            upload_grad(fused.as<void>(), before, f32);
            const double old = 1.5;
            MF_CHECK_CUDA(cudaMemcpy(sum.as<void>(), &old, sizeof old, cudaMemcpyHostToDevice));
            mf::cuda::grouped_matmul_backward_weight_sm90(plain.as<void>(), dtype, d_dout.as<bf16>(), d_inp.as<bf16>(),
                                                          d_off.as<int32_t>(), M, g.E, g.C, g.OC, accumulate, nullptr);
            mf::cuda::grouped_matmul_backward_weight_sm90(fused.as<void>(), dtype, d_dout.as<bf16>(), d_inp.as<bf16>(),
                                                          d_off.as<int32_t>(), M, g.E, g.C, g.OC, accumulate, nullptr,
                                                          nullptr, sum.as<double>(), scratch.as<void>());
            MF_CHECK_CUDA(cudaDeviceSynchronize());
            const std::string what = g.label(Path{"sm90", false, false, true}, "backward weight square sums") +
                                     (f32 ? " f32" : " bf16") + (accumulate ? " +=" : " =");
            const auto a = download<uint8_t>(plain.as<void>(), n * (f32 ? 4 : 2));
            const auto b = download<uint8_t>(fused.as<void>(), n * (f32 ? 4 : 2));
            EXPECT_TRUE(a == b) << what << ": the gradient changed";
            const auto stored = download_grad(fused.as<void>(), n, f32);
            double want = 0;
            for (const float x : stored) want += static_cast<double>(x) * x;
            double got = 0;
            MF_CHECK_CUDA(cudaMemcpy(&got, sum.as<void>(), sizeof got, cudaMemcpyDeviceToHost));
            const double bound =
                128.0 * std::ldexp(want, -24) + 2.0 * static_cast<double>(n + 64) * std::ldexp(old + want, -53);
            EXPECT_NEAR(got, old + want, bound) << what;
            EXPECT_GT(want, 0.0) << what;
        }
}

// The written weight gradient (accumulate false, what the backward right after zero_grads uses): over
// a buffer of NaNs it gives the bits of zeroing and accumulating (so the old values are not read),
// an empty expert's slice zeros; with no rows at all, zeros everywhere.
TEST(CudaGroupedGemm, BackwardWeightWrittenEqualsZeroedThenAccumulated) {
    for (const Path& p : kPaths) {
        if (!p.cublas) continue;  // the own kernel only accumulates (ops zeroes before it)
        std::mt19937 rng(17);
        for (const GroupCase& g : make_cases()) expect_written_equals_accumulated(p, g, rng);
        // No rows at all: every slice written with zeros.
        const std::vector<int32_t> none = {0, 0, 0, 0};
        const DeviceBuffer d_none = device_copy(none), dw(3 * 8 * 16 * 4), dummy(16);
        MF_CHECK_CUDA(cudaMemset(dw.as<void>(), 0xff, dw.bytes()));
        const HostOffsets host(p, d_none.as<int32_t>(), 3, nullptr);
        mf::cuda::grouped_matmul_backward_weight_cublas(cublas_state(), dw.as<void>(), mf::DType::f32, dummy.as<bf16>(),
                                                        dummy.as<bf16>(), d_none.as<int32_t>(), 0, 3, 16, 8, nullptr,
                                                        host.values, false);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        const auto z = download<float>(dw.as<void>(), 3 * 8 * 16);
        EXPECT_TRUE(std::all_of(z.begin(), z.end(), [](float x) { return x == 0.0f; })) << p.name << ": M = 0";
    }
}

// Three runs of every product give the same bits (the cuBLAS path spreads groups over streams).
// The wgmma forward (sm_90 only; C % 64 == 0, OC % 8 == 0) on cases of the same kinds: an empty
// expert, a single row, more than one row tile, rows outside the groups, one busy expert, a long K
// loop, 130 ragged experts, each run twice (bitwise equal); the clamping of bad offsets is checked
// with the other paths (BadOffsetsStayInBounds).
const Path kSm90{"sm90", false, false, true};

std::vector<GroupCase> sm90_cases() {
    std::vector<GroupCase> cases = {
        {4, 64, 256, {0, 1, 130, 37}},
        {5, 256, 256, {3, 0, 0, 257, 64}, 5, 7},
        {8, 128, 512, {0, 0, 0, 0, 0, 0, 300, 0}, 0, 3},
        {1, 2048, 256, {300}},
        {3, 768, 2048, {129, 2, 255}},
        // Column tiles that overhang the output (N % 256 != 0): 64 and 136 columns past a whole tile.
        {4, 576, 320, {0, 70, 129, 3}, 2, 5},
        {3, 64, 392, {200, 0, 57}},
        {2, 2688, 1856, {70, 130}},  // Nemotron 3 Nano's expert up projection (its down one, swapped, below)
    };
    std::mt19937 rng(43);
    GroupCase many{130, 64, 256, {}, 1, 1};
    for (int e = 0; e < 130; ++e) many.sizes.push_back(rng() % 3 == 0 ? 0 : static_cast<int32_t>(rng() % 200));
    cases.push_back(many);
    // Several tiles per block (about 600 row tiles over the 132 blocks of an H200), so that the ring's
    // stages and phases run on from tile to tile; the cases above give a block one tile or two.
    GroupCase busy{128, 64, 256, {}};
    for (int e = 0; e < 128; ++e) busy.sizes.push_back(static_cast<int32_t>(300 + rng() % 500));
    cases.push_back(busy);
    return cases;
}

bool sm90_available() {
    int device = 0, major = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    MF_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major == 9;
}

TEST(CudaGroupedGemm, Sm90Parity) {
    if (!sm90_available()) GTEST_SKIP() << "the wgmma kernel needs an sm_90 GPU";
    std::mt19937 rng(21);
    for (const GroupCase& g : sm90_cases()) {
        ASSERT_TRUE(mf::cuda::grouped_matmul_forward_sm90_supported(g.C, g.OC)) << g.label(kSm90, "forward");
        check_forward(kSm90, g, rng, 2);
    }
    // The input gradient's shapes swap C and OC: C % 8 == 0, OC % 64 == 0.
    for (GroupCase g : sm90_cases()) {
        std::swap(g.C, g.OC);
        ASSERT_TRUE(mf::cuda::grouped_matmul_backward_input_sm90_supported(g.C, g.OC))
            << g.label(kSm90, "backward input");
        check_backward_input(kSm90, g, rng, false, 2);
    }
    // The weight gradient: OC % 8 == 0, C % 8 == 0 (tiles of 128 x 256 that overhang OC and C are
    // stored in part: the last three cases); groups whose rows end inside a 64-row slice
    // (the next group's rows, or the end of the buffer, must not count), empty groups, lead and tail
    // rows; accumulated onto random values, and written over NaNs.
    std::vector<GroupCase> weight_cases = {
        {4, 256, 128, {0, 1, 130, 37}},  {5, 256, 256, {3, 0, 0, 257, 64}, 5, 7}, {3, 768, 2048, {129, 2, 255}},
        {2, 2048, 128, {64, 300}, 0, 0}, {4, 320, 192, {0, 70, 129, 3}, 2, 5},    {3, 136, 200, {65, 0, 190}},
        {2, 1856, 2688, {70, 130}},  // Nemotron 3 Nano's expert down projection
    };
    GroupCase many{130, 256, 128, {}, 1, 1};
    for (int e = 0; e < 130; ++e) many.sizes.push_back(rng() % 3 == 0 ? 0 : static_cast<int32_t>(rng() % 200));
    weight_cases.push_back(many);
    for (const GroupCase& g : weight_cases) {
        ASSERT_TRUE(mf::cuda::grouped_matmul_backward_weight_sm90_supported(g.C, g.OC)) << g.label(kSm90, "weight");
        check_backward_weight(kSm90, g, rng);
        expect_written_equals_accumulated(kSm90, g, rng);
        expect_square_sums(g, rng);
    }
    // Two row tables (EP's own and other ranks' rows of each expert, in two regions of the buffer):
    // one pass equals the fp32 sum of both tables' products, rounded once.
    for (mf::DType dtype : {mf::DType::f32, mf::DType::bf16}) {
        const GroupCase g1{5, 256, 128, {3, 0, 130, 64, 7}, 2, 0}, g2{5, 256, 128, {0, 0, 65, 200, 1}, 0, 9};
        const int64_t M1 = g1.rows(), M = M1 + g2.rows(), n = g1.E * g1.OC * g1.C;
        auto off1 = g1.offsets(), off2 = g2.offsets();
        for (auto& o : off2) o += static_cast<int32_t>(M1);
        const auto dout = random_bf16(rng, M * g1.OC), inp = random_bf16(rng, M * g1.C), before = random_bf16(rng, n);
        std::vector<float> p1(n, 0.0f), p2(n, 0.0f);
        mf::cpu::grouped_matmul_backward(nullptr, p1.data(), dout.data(), inp.data(), nullptr, off1.data(), g1.E, g1.C,
                                         g1.OC);
        mf::cpu::grouped_matmul_backward(nullptr, p2.data(), dout.data(), inp.data(), nullptr, off2.data(), g1.E, g1.C,
                                         g1.OC);
        const auto product = fp32_add(p1, p2);
        const auto ref = fp32_add(before, product);
        const bool f32 = dtype == mf::DType::f32;
        DeviceBuffer d_dout(dout.size() * 2), d_inp(inp.size() * 2), d_dw(n * (f32 ? 4 : 2));
        const DeviceBuffer d_off1 = device_copy(off1), d_off2 = device_copy(off2);
        upload_bf16(d_dout.as<void>(), dout);
        upload_bf16(d_inp.as<void>(), inp);
        upload_grad(d_dw.as<void>(), before, f32);
        mf::cuda::grouped_matmul_backward_weight_sm90(d_dw.as<void>(), dtype, d_dout.as<bf16>(), d_inp.as<bf16>(),
                                                      d_off1.as<int32_t>(), M, g1.E, g1.C, g1.OC, true, nullptr,
                                                      d_off2.as<int32_t>());
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        const auto gpu = download_grad(d_dw.as<void>(), n, f32);
        expect_parity(f32 ? "sm90 backward weight, two tables, f32 +=" : "sm90 backward weight, two tables, bf16 +=",
                      gpu, ref, f32 ? ref : naive_bf16_add(before, product));
    }
    // Shapes it does not serve are refused, not computed wrongly: a reduction dimension that is not
    // whole slices of 64, output columns (or weight-gradient rows) not in whole 16-byte pieces.
    EXPECT_FALSE(mf::cuda::grouped_matmul_backward_weight_sm90_supported(128, 100));
    EXPECT_FALSE(mf::cuda::grouped_matmul_backward_weight_sm90_supported(100, 128));
    EXPECT_FALSE(mf::cuda::grouped_matmul_backward_input_sm90_supported(256, 96));
    EXPECT_FALSE(mf::cuda::grouped_matmul_backward_input_sm90_supported(100, 64));
    EXPECT_FALSE(mf::cuda::grouped_matmul_forward_sm90_supported(96, 256));
    EXPECT_FALSE(mf::cuda::grouped_matmul_forward_sm90_supported(64, 100));
    DeviceBuffer buf(4096);
    EXPECT_THROW(forward(kSm90, buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(), buf.as<int32_t>(), 4, 1, 96, 128),
                 mf::Error);
    // More groups than the shared-memory table holds: refused before anything is read.
    const int64_t too_many = mf::cuda::kSm90MaxGroups + 1;
    EXPECT_THROW(
        forward(kSm90, buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(), buf.as<int32_t>(), 4, too_many, 64, 256),
        mf::Error);
    EXPECT_THROW(
        mf::cuda::grouped_matmul_backward_weight_sm90(buf.as<void>(), mf::DType::f32, buf.as<bf16>(), buf.as<bf16>(),
                                                      buf.as<int32_t>(), 4, too_many, 256, 128, false, nullptr),
        mf::Error);
}

// The SwiGLU epilogues (grouped_matmul_forward_swiglu_sm90, grouped_matmul_backward_swiglu_sm90)
// give the bits of the separate passes (the sm90 product, then swiglu_forward / swiglu_backward,
// themselves held to the CPU references above and in test_cuda_ops) in the groups' rows, and leave
// the other rows untouched (NaN poison). Cases: P1's expert (C 2048, I 768), pair tiles that
// overhang I (I = 136, 8), ragged and empty groups, lead and tail rows, 130 experts, and J1's
// 16384 and 4096 rows over 128 experts (several tiles per block).
TEST(CudaGroupedGemm, Sm90SwigluEpiloguesEqualSeparatePasses) {
    if (!sm90_available()) GTEST_SKIP() << "the wgmma kernel needs an sm_90 GPU";
    std::mt19937 rng(31);
    struct Case {
        int64_t E, C, I;  // the forward's C (hidden); the backward's OC is C
        std::vector<int32_t> sizes;
        int32_t lead = 0, tail = 0;
    };
    std::vector<Case> cases = {
        {4, 2048, 768, {0, 130, 1, 300}},
        {3, 256, 136, {65, 0, 200}, 3, 5},
        {2, 64, 8, {7, 129}, 0, 2},
        {5, 128, 256, {3, 0, 0, 257, 64}, 5, 7},
    };
    Case many{130, 64, 24, {}, 1, 1};
    for (int e = 0; e < 130; ++e) many.sizes.push_back(rng() % 3 == 0 ? 0 : static_cast<int32_t>(rng() % 200));
    cases.push_back(many);
    // J1's middle size (2048 tokens x top-8 over P1's 128 experts, uneven): many tiles per block, so
    // the ring's stages and phases run on across tiles (the cases above give a block one tile or two).
    // And its smallest (512 tokens: 32 rows per expert on average), where most tiles have rows in
    // one consumer's half only.
    std::lognormal_distribution<double> load(0.0, 0.6);
    for (const int mean_rows : {128, 32}) {
        Case j1{128, 2048, 768, {}};
        for (int e = 0; e < 128; ++e) j1.sizes.push_back(static_cast<int32_t>(mean_rows * load(rng)));
        cases.push_back(j1);
    }
    for (const Case& c : cases) {
        GroupCase g{c.E, c.C, 2 * c.I, c.sizes, c.lead, c.tail};
        const int64_t M = g.rows(), E = c.E, C = c.C, I = c.I;
        const auto off = g.offsets();
        const std::string what = "E=" + std::to_string(E) + " C=" + std::to_string(C) + " I=" + std::to_string(I) +
                                 " M=" + std::to_string(M);
        ASSERT_TRUE(mf::cuda::grouped_matmul_forward_swiglu_sm90_supported(C, I)) << what;
        ASSERT_TRUE(mf::cuda::grouped_matmul_backward_swiglu_sm90_supported(I, C)) << what;
        const DeviceBuffer d_off = device_copy(off);
        const auto inside = [&](const std::vector<float>& all, int64_t width) {
            std::vector<float> in, out;
            split_rows(all, width, off, &in, &out);
            return std::make_pair(in, out);
        };
        // forward: separate passes, then the fused one over NaNs
        const DeviceBuffer x = device_bf16(random_bf16(rng, M * C)), gu = device_bf16(random_bf16(rng, E * 2 * I * C));
        DeviceBuffer h_ref(M * 2 * I * 2), a_ref(M * I * 2), h(M * 2 * I * 2), a(M * I * 2);
        mf::cuda::grouped_matmul_forward_sm90(h_ref.as<bf16>(), x.as<bf16>(), gu.as<bf16>(), d_off.as<int32_t>(), M, E,
                                              C, 2 * I, nullptr);
        mf::cuda::swiglu_forward(a_ref.as<bf16>(), h_ref.as<bf16>(), M, I, nullptr);
        MF_CHECK_CUDA(cudaMemset(h.as<void>(), 0xff, h.bytes()));
        MF_CHECK_CUDA(cudaMemset(a.as<void>(), 0xff, a.bytes()));
        mf::cuda::grouped_matmul_forward_swiglu_sm90(h.as<bf16>(), a.as<bf16>(), x.as<bf16>(), gu.as<bf16>(),
                                                     d_off.as<int32_t>(), M, E, C, I, nullptr);
        device_sync();
        const auto [h_in, h_out] = inside(download_bf16(h.as<void>(), M * 2 * I), 2 * I);
        const auto [a_in, a_out] = inside(download_bf16(a.as<void>(), M * I), I);
        expect_exact(h_in, inside(download_bf16(h_ref.as<void>(), M * 2 * I), 2 * I).first, "swiglu fwd h " + what);
        expect_exact(a_in, inside(download_bf16(a_ref.as<void>(), M * I), I).first, "swiglu fwd a " + what);
        expect_untouched("swiglu fwd h " + what, h_out, std::vector<float>(h_out.size(), NAN));
        expect_untouched("swiglu fwd a " + what, a_out, std::vector<float>(a_out.size(), NAN));
        // backward: dy [M, C] through down [E, C, I] and h
        const DeviceBuffer dy = device_bf16(random_bf16(rng, M * C)), dn = device_bf16(random_bf16(rng, E * C * I));
        const DeviceBuffer hb = device_bf16(random_bf16(rng, M * 2 * I, -4.0f, 4.0f));
        DeviceBuffer da_ref(M * I * 2), dh_ref(M * 2 * I * 2), dh(M * 2 * I * 2);
        mf::cuda::grouped_matmul_backward_input_sm90(da_ref.as<bf16>(), dy.as<bf16>(), dn.as<bf16>(),
                                                     d_off.as<int32_t>(), M, E, I, C, nullptr);
        mf::cuda::swiglu_backward(dh_ref.as<bf16>(), da_ref.as<bf16>(), hb.as<bf16>(), M, I, nullptr);
        MF_CHECK_CUDA(cudaMemset(dh.as<void>(), 0xff, dh.bytes()));
        mf::cuda::grouped_matmul_backward_swiglu_sm90(dh.as<bf16>(), dy.as<bf16>(), dn.as<bf16>(), hb.as<bf16>(),
                                                      d_off.as<int32_t>(), M, E, I, C, nullptr);
        device_sync();
        const auto [dh_in, dh_out] = inside(download_bf16(dh.as<void>(), M * 2 * I), 2 * I);
        expect_exact(dh_in, inside(download_bf16(dh_ref.as<void>(), M * 2 * I), 2 * I).first, "swiglu bwd dh " + what);
        expect_untouched("swiglu bwd dh " + what, dh_out, std::vector<float>(dh_out.size(), NAN));
    }
    // Shapes they do not serve are refused: I not in whole 16-byte pieces, a reduction not in slices.
    EXPECT_FALSE(mf::cuda::grouped_matmul_forward_swiglu_sm90_supported(2048, 12));
    EXPECT_FALSE(mf::cuda::grouped_matmul_forward_swiglu_sm90_supported(100, 768));
    EXPECT_FALSE(mf::cuda::grouped_matmul_backward_swiglu_sm90_supported(12, 2048));
    EXPECT_FALSE(mf::cuda::grouped_matmul_backward_swiglu_sm90_supported(768, 100));
    DeviceBuffer buf(4096);
    EXPECT_THROW(mf::cuda::grouped_matmul_forward_swiglu_sm90(buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(),
                                                              buf.as<bf16>(), buf.as<int32_t>(), 4, 1, 64, 12, nullptr),
                 mf::Error);
}

// Waits for the legacy stream's work for at most `seconds`; false when it has not finished (a hang).
bool finished_within(double seconds) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
        const cudaError_t status = cudaStreamQuery(nullptr);
        if (status == cudaSuccess) return true;
        if (status != cudaErrorNotReady) MF_CHECK_CUDA(status);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
}

// Liveness and repeatability of every sm90 kernel at J1's geometry (P1's experts: 128 of C 2048,
// I 768; about 4900 and 19000 rows, uneven): 1000 back-to-back calls of each finish within a deadline
// and give the first call's bits. The SwiGLU backward hung here in every run of 1000 calls (often
// within 200) before the consumer warpgroups met at every tile (warpgroup_sync() in
// grouped_gemm_sm90.cu); a single call (the parity tests) does not show it. A hang ends the process
// at once, saying which kernel, rather than leaving ctest to time out.
TEST(CudaGroupedGemm, Sm90RepeatedCallsFinishAndRepeat) {
    if (!sm90_available()) GTEST_SKIP() << "the wgmma kernel needs an sm_90 GPU";
    constexpr int64_t E = 128, C = 2048, I = 768;
    constexpr int kCalls = 1000;
    constexpr double kDeadlineSeconds = 30.0;  // 1000 calls take about a second
    std::mt19937 rng(43);
    std::lognormal_distribution<double> load(0.0, 0.6);
    DeviceBuffer gu(E * 2 * I * C * 2), dn(E * C * I * 2);
    fill_random_bf16(gu, E * 2 * I * C, rng);
    fill_random_bf16(dn, E * C * I, rng);
    for (const int mean_rows : {32, 128}) {
        std::vector<int32_t> sizes;
        for (int e = 0; e < E; ++e) sizes.push_back(static_cast<int32_t>(mean_rows * load(rng)));
        const GroupCase g{E, C, 2 * I, sizes};
        const int64_t M = g.rows();
        const DeviceBuffer d_off = device_copy(g.offsets());
        DeviceBuffer x(M * C * 2), dy(M * C * 2), hb(M * 2 * I * 2), act(M * I * 2);
        fill_random_bf16(x, M * C, rng);
        fill_random_bf16(dy, M * C, rng);
        fill_random_bf16(hb, M * 2 * I, rng);
        fill_random_bf16(act, M * I, rng);
        DeviceBuffer h(M * 2 * I * 2), a(M * I * 2), da(M * I * 2), dh(M * 2 * I * 2), ddn(E * C * I * 2);
        const int32_t* off = d_off.as<int32_t>();
        struct Kernel {
            const char* name;
            std::function<void()> launch;
            std::vector<const DeviceBuffer*> outputs;
        };
        const std::vector<Kernel> kernels = {
            {"forward",
             [&] {
                 mf::cuda::grouped_matmul_forward_sm90(h.as<bf16>(), x.as<bf16>(), gu.as<bf16>(), off, M, E, C, 2 * I,
                                                       nullptr);
             },
             {&h}},
            {"input gradient",
             [&] {
                 mf::cuda::grouped_matmul_backward_input_sm90(da.as<bf16>(), dy.as<bf16>(), dn.as<bf16>(), off, M, E, I,
                                                              C, nullptr);
             },
             {&da}},
            {"weight gradient",
             [&] {
                 mf::cuda::grouped_matmul_backward_weight_sm90(ddn.as<void>(), mf::DType::bf16, dy.as<bf16>(),
                                                               act.as<bf16>(), off, M, E, I, C, false, nullptr);
             },
             {&ddn}},
            {"SwiGLU forward",
             [&] {
                 mf::cuda::grouped_matmul_forward_swiglu_sm90(h.as<bf16>(), a.as<bf16>(), x.as<bf16>(), gu.as<bf16>(),
                                                              off, M, E, C, I, nullptr);
             },
             {&h, &a}},
            {"SwiGLU backward",
             [&] {
                 mf::cuda::grouped_matmul_backward_swiglu_sm90(dh.as<bf16>(), dy.as<bf16>(), dn.as<bf16>(),
                                                               hb.as<bf16>(), off, M, E, I, C, nullptr);
             },
             {&dh}},
        };
        for (const Kernel& k : kernels) {
            const std::string what = std::string(k.name) + " M=" + std::to_string(M);
            k.launch();
            device_sync();
            std::vector<std::vector<uint16_t>> first;
            for (const DeviceBuffer* out : k.outputs)
                first.push_back(download<uint16_t>(out->as<void>(), out->bytes() / 2));
            for (int call = 0; call < kCalls; ++call) k.launch();
            if (!finished_within(kDeadlineSeconds)) {
                std::fprintf(stderr, "FAILED: sm90 %s: %d calls did not finish in %.0f s (a hang); exiting\n",
                             what.c_str(), kCalls, kDeadlineSeconds);
                std::fflush(stderr);
                std::_Exit(1);
            }
            for (size_t i = 0; i < k.outputs.size(); ++i)
                EXPECT_TRUE(download<uint16_t>(k.outputs[i]->as<void>(), k.outputs[i]->bytes() / 2) == first[i])
                    << what << ": the last of " << kCalls << " calls differs from the first (output " << i << ")";
            std::printf("  sm90 %-28s %d calls finished, bitwise equal\n", what.c_str(), kCalls + 1);
        }
    }
}

TEST(CudaGroupedGemm, Deterministic) {
    for (const Path& p : kPaths) {
        std::mt19937 rng(14);
        const GroupCase g{6, 256, 192, {100, 0, 513, 7, 250, 129}};
        const int64_t M = g.rows();
        const auto off = g.offsets();
        DeviceBuffer d_dout(M * g.OC * 2), d_inp(M * g.C * 2), d_w(g.E * g.OC * g.C * 2), d_dw(g.E * g.OC * g.C * 4),
            d_out(M * g.OC * 2), d_dinp(M * g.C * 2);
        const DeviceBuffer d_off = device_copy(off);
        upload_bf16(d_dout.as<void>(), random_bf16(rng, M * g.OC));
        upload_bf16(d_inp.as<void>(), random_bf16(rng, M * g.C));
        upload_bf16(d_w.as<void>(), random_bf16(rng, g.E * g.OC * g.C));
        std::vector<float> first_dw;
        std::vector<uint16_t> first_out, first_dinp;
        for (int run = 0; run < 3; ++run) {
            MF_CHECK_CUDA(cudaMemset(d_dw.as<void>(), 0, d_dw.bytes()));
            backward_weight(p, d_dw.as<void>(), mf::DType::f32, d_dout.as<bf16>(), d_inp.as<bf16>(),
                            d_off.as<int32_t>(), M, g.E, g.C, g.OC);
            forward(p, d_out.as<bf16>(), d_inp.as<bf16>(), d_w.as<bf16>(), d_off.as<int32_t>(), M, g.E, g.C, g.OC);
            backward_input(p, d_dinp.as<bf16>(), d_dout.as<bf16>(), d_w.as<bf16>(), d_off.as<int32_t>(), M, g.E, g.C,
                           g.OC, false);
            const auto dw = download<float>(d_dw.as<void>(), g.E * g.OC * g.C);
            const auto out = download<uint16_t>(d_out.as<void>(), M * g.OC);
            const auto dinp = download<uint16_t>(d_dinp.as<void>(), M * g.C);
            if (run == 0) {
                first_dw = dw, first_out = out, first_dinp = dinp;
                continue;
            }
            EXPECT_EQ(std::memcmp(first_dw.data(), dw.data(), dw.size() * 4), 0) << p.name << " run " << run << " dW";
            EXPECT_TRUE(first_out == out) << p.name << " run " << run << " forward differs";
            EXPECT_TRUE(first_dinp == dinp) << p.name << " run " << run << " backward input differs";
        }
    }
}

// Offsets that break the contract are clamped (running max, then [0, M]) instead of reading or
// writing outside the buffers; the result equals the CPU on the clamped offsets.
TEST(CudaGroupedGemm, BadOffsetsStayInBounds) {
    std::vector<Path> paths = kPaths;
    if (sm90_available()) paths.push_back(kSm90);
    for (const Path& p : paths) {
        std::mt19937 rng(15);
        const int64_t E = 4, C = 64, OC = 256, M = 100;
        const std::vector<int32_t> bad = {-5, 40, 20, 90, 1000};  // negative, decreasing, past M
        const std::vector<int32_t> clamped = {0, 40, 40, 90, 100};
        const auto inp = random_bf16(rng, M * C);
        const auto weight = random_bf16(rng, E * OC * C);
        std::vector<float> ref(M * OC, 0.0f);
        mf::cpu::grouped_matmul_forward(ref.data(), inp.data(), weight.data(), clamped.data(), E, C, OC);
        DeviceBuffer d_inp(inp.size() * 2), d_w(weight.size() * 2), d_out(ref.size() * 2);
        const DeviceBuffer d_off = device_copy(bad);
        upload_bf16(d_inp.as<void>(), inp);
        upload_bf16(d_w.as<void>(), weight);
        d_out.poison();
        forward(p, d_out.as<bf16>(), d_inp.as<bf16>(), d_w.as<bf16>(), d_off.as<int32_t>(), M, E, C, OC);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        expect_parity(std::string(p.name) + " forward with clamped offsets",
                      download_bf16(d_out.as<void>(), ref.size()), ref, round_bf16(ref));
    }
}

TEST(CudaGroupedGemm, ArgumentErrors) {
    DeviceBuffer buf(4096);
    const auto* off = buf.as<int32_t>();
    for (const Path& p : kPaths) {
        EXPECT_THROW(forward(p, buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(), off, 4, 1, 12, 8), mf::Error)
            << p.name << ": C not a multiple of 8";
        EXPECT_THROW(forward(p, buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(), off, 4, 5000, 8, 8), mf::Error)
            << p.name << ": too many experts";
        EXPECT_THROW(forward(p, buf.as<bf16>(), buf.as<bf16>() + 1, buf.as<bf16>(), off, 4, 1, 8, 8), mf::Error)
            << p.name << ": misaligned";
        EXPECT_THROW(backward_input(p, buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(), nullptr, 4, 1, 8, 8, false),
                     mf::Error)
            << p.name << ": null offsets";
        EXPECT_THROW(
            backward_weight(p, buf.as<void>(), mf::DType::i64, buf.as<bf16>(), buf.as<bf16>(), off, 4, 1, 8, 8),
            mf::Error)
            << p.name << ": dweight dtype";
    }
}

// ---------------------------------------------------------------------------------------------
// MF_BENCH=1: Qwen3-30B-A3B expert GEMMs (hidden 2048, expert dim 768: gate_up C=2048 OC=1536, down
// C=768 OC=2048) at 16384 rows over 128 experts (2048 tokens x top-8: J1's middle size), 65536 rows over
// 128 experts (8192 tokens x top-8), 131072 rows over 128 experts
// (16384 tokens), 65536 rows over 64 experts (one rank's share under P2's EP=2: 8192 tokens x top-8 from
// each of two ranks, half of them to its experts) and 131072 rows over 64 experts. Expert loads are uneven
// (log-normal, two experts empty). Every path is timed (median of 20 after 3 warm-ups, CUDA events
// around the whole call, so the cuBLAS path's offsets read and host issue count), with the dense
// cuBLASLt GEMM of the same total size as the baseline.
// MF_BENCH_GROUPED=M:E (e.g. 65536:128) times that one configuration only, and MF_BENCH_SM90_ONLY=1 leaves
// out the dense baseline and the other paths: scripts/gpu_ncu_grouped.sh profiles the wgmma kernels so.

std::vector<int32_t> bench_offsets(int64_t M, int64_t E, std::mt19937& rng) {
    std::lognormal_distribution<double> load(0.0, 0.6);
    std::vector<double> w(E);
    for (double& x : w) x = load(rng);
    w[7] = w[E - 11] = 0.0;
    double total = 0.0;
    for (double x : w) total += x;
    std::vector<int32_t> off(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + static_cast<int32_t>(M * w[e] / total);
    off[E] = static_cast<int32_t>(M);
    return off;
}

TEST(CudaGroupedGemm, Benchmark) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1 to time";
    mf::cuda::GemmContext ctx;
    std::mt19937 rng(77);
    struct Config {
        int64_t M, E;
    };
    struct Case {
        const char* label;
        int64_t C, OC;
    };
    std::vector<Config> configs = {{16384, 128}, {65536, 64}, {65536, 128}, {131072, 128}, {131072, 64}};
    if (const char* only = std::getenv("MF_BENCH_GROUPED")) {
        long long m = 0, e = 0;
        ASSERT_EQ(std::sscanf(only, "%lld:%lld", &m, &e), 2) << "MF_BENCH_GROUPED=" << only << ": expected M:E";
        ASSERT_TRUE(m > 0 && e > 11 && m <= (int64_t{1} << 30)) << "MF_BENCH_GROUPED=" << only << ": out of range";
        configs = {Config{m, e}};
    }
    const bool sm90_only = env_flag("MF_BENCH_SM90_ONLY");
    for (const Config& cfg : configs) {
        const int64_t M = cfg.M, E = cfg.E;
        const auto off = bench_offsets(M, E, rng);
        int32_t min_rows = INT32_MAX, max_rows = 0;
        for (int64_t e = 0; e < E; ++e)
            if (off[e + 1] > off[e])
                min_rows = std::min(min_rows, off[e + 1] - off[e]), max_rows = std::max(max_rows, off[e + 1] - off[e]);
        std::printf("BENCH grouped M=%lld E=%lld rows per expert: min %d max %d mean %lld (2 empty)\n",
                    static_cast<long long>(M), static_cast<long long>(E), min_rows, max_rows,
                    static_cast<long long>(M / E));
        const DeviceBuffer d_off = device_copy(off);
        for (const Case& c : {Case{"gate_up", 2048, 1536}, Case{"down", 768, 2048}}) {
            DeviceBuffer inp(M * c.C * 2), wt(E * c.OC * c.C * 2), out(M * c.OC * 2), dinp(M * c.C * 2),
                dw32(E * c.OC * c.C * 4), dw16(E * c.OC * c.C * 2), dense_w(c.OC * c.C * 2);
            fill_random_bf16(inp, M * c.C, rng);
            fill_random_bf16(wt, E * c.OC * c.C, rng);
            fill_random_bf16(out, M * c.OC, rng);
            fill_random_bf16(dense_w, c.OC * c.C, rng);
            dw32.zero();
            dw16.zero();
            const double flops = 2.0 * M * c.C * c.OC;
            const double dense = sm90_only ? 0.0 : median_us([&] {
                mf::cuda::matmul_forward(ctx, out.as<bf16>(), inp.as<bf16>(), dense_w.as<bf16>(), M, c.C, c.OC,
                                         nullptr);
            });
            if (!sm90_only)
                std::printf(
                    "BENCH grouped M=%lld E=%lld %-8s C=%-5lld OC=%-5lld dense cuBLASLt same size %8.1f us %6.1f "
                    "TFLOP/s\n",
                    static_cast<long long>(M), static_cast<long long>(E), c.label, static_cast<long long>(c.C),
                    static_cast<long long>(c.OC), dense, flops / dense * 1e-6);
            if (sm90_available()) {
                const double fwd = median_us(
                    [&] {
                        forward(kSm90, out.as<bf16>(), inp.as<bf16>(), wt.as<bf16>(), d_off.as<int32_t>(), M, E, c.C,
                                c.OC);
                    },
                    20, 5000);
                const double bwd_in = median_us(
                    [&] {
                        backward_input(kSm90, dinp.as<bf16>(), out.as<bf16>(), wt.as<bf16>(), d_off.as<int32_t>(), M, E,
                                       c.C, c.OC, false);
                    },
                    20, 5000);
                const auto bwd_w = [&](mf::DType dtype, auto& dw) {
                    return median_us(
                        [&] {
                            mf::cuda::grouped_matmul_backward_weight_sm90(dw.template as<void>(), dtype, out.as<bf16>(),
                                                                          inp.as<bf16>(), d_off.as<int32_t>(), M, E,
                                                                          c.C, c.OC, false, nullptr);
                        },
                        20, 5000);
                };
                const double bwd_w32 = bwd_w(mf::DType::f32, dw32), bwd_w16 = bwd_w(mf::DType::bf16, dw16);
                std::printf(
                    "BENCH grouped M=%lld E=%lld %-8s %-14s fwd %8.1f us %6.1f TFLOP/s | bwd-in %8.1f us %6.1f"
                    " | bwd-w f32 %8.1f us %6.1f | bwd-w bf16 %8.1f us %6.1f (written)\n",
                    static_cast<long long>(M), static_cast<long long>(E), c.label, "sm90 (wgmma)", fwd,
                    flops / fwd * 1e-6, bwd_in, flops / bwd_in * 1e-6, bwd_w32, flops / bwd_w32 * 1e-6, bwd_w16,
                    flops / bwd_w16 * 1e-6);
            }
            for (const Path& p : kPaths) {
                if (sm90_only) break;
                const auto timed = [&](auto&& fn) {
                    try {
                        return median_us(fn, 20, 5000);  // 5 ms of host lead: GPU time
                    } catch (const mf::Error& e) {
                        std::printf("BENCH   %s failed: %s\n", p.name, e.what());
                        return 0.0;
                    }
                };
                const double fwd = timed([&] {
                    forward(p, out.as<bf16>(), inp.as<bf16>(), wt.as<bf16>(), d_off.as<int32_t>(), M, E, c.C, c.OC,
                            &off);
                });
                const double bwd_in = timed([&] {
                    backward_input(p, dinp.as<bf16>(), out.as<bf16>(), wt.as<bf16>(), d_off.as<int32_t>(), M, E, c.C,
                                   c.OC, false, &off);
                });
                const double bwd_w32 = timed([&] {
                    backward_weight(p, dw32.as<void>(), mf::DType::f32, out.as<bf16>(), inp.as<bf16>(),
                                    d_off.as<int32_t>(), M, E, c.C, c.OC, &off);
                });
                const double bwd_w16 = timed([&] {
                    backward_weight(p, dw16.as<void>(), mf::DType::bf16, out.as<bf16>(), inp.as<bf16>(),
                                    d_off.as<int32_t>(), M, E, c.C, c.OC, &off);
                });
                const auto tf = [&](double us) { return us > 0 ? flops / us * 1e-6 : 0.0; };
                std::printf(
                    "BENCH grouped M=%lld E=%lld %-8s %-14s fwd %8.1f us %6.1f TFLOP/s | bwd-in %8.1f us %6.1f | "
                    "bwd-w f32 %8.1f us %6.1f | bwd-w bf16 %8.1f us %6.1f\n",
                    static_cast<long long>(M), static_cast<long long>(E), c.label, p.name, fwd, tf(fwd), bwd_in,
                    tf(bwd_in), bwd_w32, tf(bwd_w32), bwd_w16, tf(bwd_w16));
            }
        }
    }
}

}  // namespace
