// GPU parity of the loss head and the optimizer kernels against their CPU references:
// fused LM head + cross-entropy (kernels/cpu/cross_entropy.h), AdamW in both storage policies
// (kernels/cpu/adamw.h; bit for bit, see adamw.cu), and the reductions behind gradient clipping
// (kernels/cpu/reduce.h). Tolerances: test_cuda_common.h; for the cross-entropy gradients the naive
// computation is the fp64 one with dlogits rounded to bf16 and the result stored in its dtype.
// MF_BENCH=1 adds figures at 8192 tokens, hidden 2048, vocabulary 151936, and 2^28 parameters, and
// the loss kernel alone each way (staged and streaming; lines "BENCH ce loss").
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/cross_entropy.cuh"
#include "kernels/cuda/reduce.cuh"
#include "test_cuda_common.h"

namespace {

using mf::DType;
using mf::cuda::bf16;
using namespace mf::test;

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

class CublasHandle {
 public:
    CublasHandle() { MF_CHECK(cublasCreate(&handle_) == CUBLAS_STATUS_SUCCESS, "cublasCreate failed"); }
    ~CublasHandle() { cublasDestroy(handle_); }
    CublasHandle(const CublasHandle&) = delete;
    CublasHandle& operator=(const CublasHandle&) = delete;
    cublasHandle_t get() const { return handle_; }

 private:
    cublasHandle_t handle_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// cross-entropy

struct CeCase {
    int64_t N, C, V, chunk;
};

// The naive bf16 computation of the losses and gradients: fp64 logits (rounded to bf16 when
// bf16_logits) and softmax, dlogits rounded to bf16, fp64 products, the result stored in the output
// dtype.
void naive_ce_grads(std::vector<float>& loss, std::vector<float>& dh, std::vector<float>& dw, bool dw_bf16,
                    bool bf16_logits, const std::vector<float>& h, const std::vector<float>& w,
                    const std::vector<int32_t>& targets, const CeCase& s, float grad_scale) {
    std::vector<double> dh_acc(dh.begin(), dh.end()), dw_acc(dw.begin(), dw.end());
    std::vector<double> logits(static_cast<size_t>(s.V));
    std::vector<double> dlog(static_cast<size_t>(s.V));
    loss.assign(static_cast<size_t>(s.N), 0.0f);
    for (int64_t n = 0; n < s.N; ++n) {
        const int32_t t = targets[n];
        if (t < 0) continue;
        double m = -1e300;
        for (int64_t v = 0; v < s.V; ++v) {
            double acc = 0.0;
            for (int64_t c = 0; c < s.C; ++c) acc += static_cast<double>(h[n * s.C + c]) * w[v * s.C + c];
            logits[v] = bf16_logits ? round_bf16(static_cast<float>(acc)) : acc;
            m = std::max(m, logits[v]);
        }
        double sum = 0.0;
        for (int64_t v = 0; v < s.V; ++v) sum += std::exp(logits[v] - m);
        loss[static_cast<size_t>(n)] = static_cast<float>(m + std::log(sum) - logits[t]);
        for (int64_t v = 0; v < s.V; ++v) {
            const double d = grad_scale * (std::exp(logits[v] - m) / sum - (v == t ? 1.0 : 0.0));
            dlog[v] = round_bf16(static_cast<float>(d));
        }
        for (int64_t v = 0; v < s.V; ++v) {
            for (int64_t c = 0; c < s.C; ++c) {
                dh_acc[n * s.C + c] += dlog[v] * w[v * s.C + c];
                dw_acc[v * s.C + c] += dlog[v] * h[n * s.C + c];
            }
        }
    }
    for (size_t i = 0; i < dh.size(); ++i) dh[i] = round_bf16(static_cast<float>(dh_acc[i]));
    for (size_t i = 0; i < dw.size(); ++i) {
        dw[i] = dw_bf16 ? round_bf16(static_cast<float>(dw_acc[i])) : static_cast<float>(dw_acc[i]);
    }
}

// A case's expected results, from dh0 / dw0: the CPU reference, the naive computation
// (naive_ce_grads) and the largest |logit| in fp64 (for the bf16-logits loss tolerance).
struct CeExpected {
    std::vector<float> loss, dh, dw, loss_naive, dh_naive, dw_naive;
    double max_logit = 0.0;
};

CeExpected expected_ce(const CeCase& s, const std::vector<float>& h, const std::vector<float>& w,
                       const std::vector<int32_t>& targets, const std::vector<float>& dh0,
                       const std::vector<float>& dw0, DType dw_dtype, DType logits_dtype, float grad_scale) {
    const bool bf16_logits = logits_dtype == DType::bf16;
    CeExpected e;
    e.loss.resize(static_cast<size_t>(s.N));
    e.dh = dh0;
    e.dw = dw0;
    mf::cpu::lm_head_cross_entropy(e.loss.data(), e.dh.data(), e.dw.data(), h.data(), w.data(), targets.data(), s.N,
                                   s.C, s.V, grad_scale, bf16_logits);
    e.dh_naive = dh0;
    e.dw_naive = dw0;
    naive_ce_grads(e.loss_naive, e.dh_naive, e.dw_naive, dw_dtype == DType::bf16, bf16_logits, h, w, targets, s,
                   grad_scale);
    for (int64_t n = 0; n < s.N; ++n)
        for (int64_t v = 0; v < s.V; ++v) {
            double acc = 0;
            for (int64_t c = 0; c < s.C; ++c) acc += static_cast<double>(h[n * s.C + c]) * w[v * s.C + c];
            e.max_logit = std::max(e.max_logit, std::fabs(acc));
        }
    return e;
}

// The GPU op's losses, dh and dw for a case: dh0 / dw0 accumulated into (dw in dw_dtype), chunks of
// s.chunk rows, poisoned scratch and losses. with_grads = false passes no dh and dw (losses only).
struct CeOutputs {
    std::vector<float> loss, dh, dw;
};

CeOutputs run_ce(cublasHandle_t handle, const CeCase& s, const std::vector<float>& h, const std::vector<float>& w,
                 const std::vector<int32_t>& targets, const std::vector<float>& dh0, const std::vector<float>& dw0,
                 DType dw_dtype, DType logits_dtype, float grad_scale, bool with_grads = true) {
    const bool dw_f32 = dw_dtype == DType::f32;
    DeviceBuffer d_h = device_bf16(h), d_w = device_bf16(w), d_t = device_copy(targets), d_dh = device_bf16(dh0),
                 d_loss(targets.size() * 4), d_dw(w.size() * 4);
    upload_grad(d_dw.as<void>(), dw0, dw_f32);
    const size_t sb = mf::cuda::lm_head_cross_entropy_scratch_bytes(s.chunk, s.V, logits_dtype);
    DeviceBuffer scratch(sb);
    scratch.poison();
    d_loss.poison();
    mf::cuda::lm_head_cross_entropy(handle, d_loss.as<float>(), with_grads ? d_dh.as<bf16>() : nullptr,
                                    with_grads ? d_dw.as<void>() : nullptr, dw_dtype, d_h.as<bf16>(), d_w.as<bf16>(),
                                    d_t.as<int32_t>(), s.N, s.C, s.V, grad_scale, scratch.as<void>(), sb, s.chunk,
                                    nullptr, logits_dtype);
    device_sync();
    CeOutputs out;
    out.loss = download<float>(d_loss.as<void>(), targets.size());
    if (with_grads) {
        out.dh = download_bf16(d_dh.as<void>(), h.size());
        out.dw = download_grad(d_dw.as<void>(), w.size(), dw_f32);
    }
    return out;
}

// GPU results against the CPU reference. Losses: fp32 logits, the same fp32 math in another order
// (tolerance from the fp32 scale alone). bf16 logits: besides that, a logit may round to the
// neighbouring bf16 value under another fp32 summation order, moving a loss by at most one bf16 step
// of the largest logit (2^-8 relative); every loss must also be that close to the fp64-then-bf16 one.
// dh and dw: the reduction rule against the naive computation.
void expect_ce_matches(const CeOutputs& gpu, const CeExpected& ref, bool bf16_logits, const std::string& name) {
    if (!bf16_logits) {
        expect_reduction(gpu.loss, ref.loss, ref.loss, name + " loss");
    } else {
        const double tol = std::ldexp(ref.max_logit, -8) + 1e-5;
        for (size_t i = 0; i < gpu.loss.size(); ++i) {
            EXPECT_LE(std::fabs(static_cast<double>(gpu.loss[i]) - ref.loss[i]), tol) << name << " loss " << i;
            EXPECT_LE(std::fabs(static_cast<double>(gpu.loss[i]) - ref.loss_naive[i]), tol) << name << " loss " << i;
        }
        std::printf("  %-48s n=%-9zu within one bf16 step of the largest logit (%.3g)\n", (name + " loss").c_str(),
                    gpu.loss.size(), tol);
    }
    expect_reduction(gpu.dh, ref.dh, ref.dh_naive, name + " dh");
    expect_reduction(gpu.dw, ref.dw, ref.dw_naive, name + " dw");
}

TEST(CudaCrossEntropy, LossAndGradientsMatchCpu) {
    std::mt19937 rng(30);
    CublasHandle handle;
    for (const CeCase& s :
         {CeCase{37, 64, 1000, 16}, CeCase{20, 40, 999, 64}, CeCase{64, 128, 4096, 64}, CeCase{5, 32, 8, 2},
          // one chunk of 300 rows
          CeCase{300, 32, 520, 300}}) {
        for (const auto& [dw_dtype, logits_dtype] :
             {std::pair{DType::f32, DType::f32}, std::pair{DType::bf16, DType::f32},
              std::pair{DType::bf16, DType::bf16}}) {
            const bool bf16_logits = logits_dtype == DType::bf16;
            const std::string name = std::string("cross_entropy logits ") + mf::dtype_name(logits_dtype) + " dw " +
                                     mf::dtype_name(dw_dtype) + " N=" + std::to_string(s.N) +
                                     " C=" + std::to_string(s.C) + " V=" + std::to_string(s.V) +
                                     " chunk=" + std::to_string(s.chunk);
            const std::vector<float> h = random_bf16(rng, static_cast<size_t>(s.N * s.C));
            const std::vector<float> w = random_bf16(rng, static_cast<size_t>(s.V * s.C));
            std::vector<int32_t> targets(static_cast<size_t>(s.N));
            int counted = 0;
            for (size_t n = 0; n < targets.size(); ++n) {
                targets[n] = n % 5 == 4 ? mf::cpu::kIgnoreIndex : static_cast<int32_t>(rng() % s.V);
                counted += targets[n] >= 0;
            }
            const float grad_scale = 1.0f / static_cast<float>(std::max(counted, 1));
            const std::vector<float> dh0 = random_bf16(rng, h.size(), -0.01f, 0.01f);
            std::vector<float> dw0 = random_f32(rng, w.size(), -0.01f, 0.01f);
            if (dw_dtype == DType::bf16) dw0 = round_bf16(dw0);

            const CeExpected ref = expected_ce(s, h, w, targets, dh0, dw0, dw_dtype, logits_dtype, grad_scale);
            const CeOutputs gpu = run_ce(handle.get(), s, h, w, targets, dh0, dw0, dw_dtype, logits_dtype, grad_scale);
            expect_ce_matches(gpu, ref, bf16_logits, name);
            // Loss only (no gradients): the same losses.
            const CeOutputs loss_only =
                run_ce(handle.get(), s, h, w, targets, dh0, dw0, dw_dtype, logits_dtype, grad_scale, false);
            expect_exact(loss_only.loss, gpu.loss, name + " loss-only run");
        }
    }
}

// A case's random bf16 h and w and its targets, every 7th from the 4th ignored (-100).
struct CeInputs {
    std::vector<float> h, w;
    std::vector<int32_t> targets;
    CeInputs(const CeCase& s, uint32_t seed) {
        std::mt19937 rng(seed);
        h = random_bf16(rng, static_cast<size_t>(s.N * s.C));
        w = random_bf16(rng, static_cast<size_t>(s.V * s.C));
        targets.resize(static_cast<size_t>(s.N));
        for (size_t n = 0; n < targets.size(); ++n)
            targets[n] = n % 7 == 3 ? mf::cpu::kIgnoreIndex : static_cast<int32_t>(rng() % s.V);
    }
};

// accumulate = false writes dh and dw: into poisoned (NaN) buffers it gives, bit for bit, what the
// accumulating form adds into zeroed ones (β = 0 never reads the old contents, over several chunks);
// with no rows it zero-fills dw.
TEST(CudaCrossEntropy, WriteModeEqualsAccumulatingIntoZeros) {
    CublasHandle handle;
    const CeCase s{37, 64, 1000, 16};
    const CeInputs in(s, 31);
    const std::vector<float>&h = in.h, &w = in.w;
    const std::vector<int32_t>& targets = in.targets;
    DeviceBuffer d_h = device_bf16(h), d_w = device_bf16(w), d_t = device_copy(targets), d_loss(targets.size() * 4);
    for (const DType dw_dtype : {DType::f32, DType::bf16}) {
        for (const DType logits_dtype : {DType::f32, DType::bf16}) {
            const std::string name =
                std::string("write mode, logits ") + mf::dtype_name(logits_dtype) + " dw " + mf::dtype_name(dw_dtype);
            const size_t dw_bytes = w.size() * mf::dtype_size(dw_dtype), dh_bytes = h.size() * 2;
            const size_t sb = mf::cuda::lm_head_cross_entropy_scratch_bytes(s.chunk, s.V, logits_dtype);
            DeviceBuffer scratch(sb), dh_a(dh_bytes), dw_a(dw_bytes), dh_w(dh_bytes), dw_w(dw_bytes);
            dh_a.zero();
            dw_a.zero();
            dh_w.poison();
            dw_w.poison();
            for (const bool accumulate : {true, false}) {
                mf::cuda::lm_head_cross_entropy(handle.get(), d_loss.as<float>(), (accumulate ? dh_a : dh_w).as<bf16>(),
                                                (accumulate ? dw_a : dw_w).as<void>(), dw_dtype, d_h.as<bf16>(),
                                                d_w.as<bf16>(), d_t.as<int32_t>(), s.N, s.C, s.V, 0.25f,
                                                scratch.as<void>(), sb, s.chunk, nullptr, logits_dtype, accumulate);
            }
            device_sync();
            EXPECT_EQ(download<uint16_t>(dh_w.as<void>(), h.size()), download<uint16_t>(dh_a.as<void>(), h.size()))
                << name << " dh";
            EXPECT_EQ(download<uint8_t>(dw_w.as<void>(), dw_bytes), download<uint8_t>(dw_a.as<void>(), dw_bytes))
                << name << " dw";
            // No rows: dw is written with zeros (the gradient of an empty sum).
            dw_w.poison();
            mf::cuda::lm_head_cross_entropy(handle.get(), d_loss.as<float>(), dh_w.as<bf16>(), dw_w.as<void>(),
                                            dw_dtype, d_h.as<bf16>(), d_w.as<bf16>(), d_t.as<int32_t>(), 0, s.C, s.V,
                                            0.25f, scratch.as<void>(), sb, s.chunk, nullptr, logits_dtype, false);
            device_sync();
            EXPECT_EQ(download<uint8_t>(dw_w.as<void>(), dw_bytes), std::vector<uint8_t>(dw_bytes, 0))
                << name << " dw, no rows";
        }
    }
}

// grad_scale_by, a device factor of grad_scale read by the kernel: the same bits as the host product.
TEST(CudaCrossEntropy, DeviceScaleEqualsHostProduct) {
    CublasHandle handle;
    const CeCase s{37, 64, 1000, 16};
    const CeInputs in(s, 29);
    const std::vector<float>&h = in.h, &w = in.w;
    const std::vector<int32_t>& targets = in.targets;
    const float by = 1.0f / 31.0f;  // (a reciprocal, as the 1 / count moeforge.hf passes; not a power of 2)
    DeviceBuffer d_h = device_bf16(h), d_w = device_bf16(w), d_t = device_copy(targets),
                 d_by = device_copy(std::vector<float>{by});
    for (const DType logits_dtype : {DType::f32, DType::bf16}) {
        const size_t sb = mf::cuda::lm_head_cross_entropy_scratch_bytes(s.chunk, s.V, logits_dtype);
        DeviceBuffer scratch(sb);
        std::vector<std::vector<uint8_t>> results;
        for (const bool on_device : {false, true}) {
            DeviceBuffer d_loss(targets.size() * 4), d_dh(h.size() * 2), d_dw(w.size() * 4);
            d_dh.poison();
            d_dw.poison();
            mf::cuda::lm_head_cross_entropy(handle.get(), d_loss.as<float>(), d_dh.as<bf16>(), d_dw.as<void>(),
                                            DType::f32, d_h.as<bf16>(), d_w.as<bf16>(), d_t.as<int32_t>(), s.N, s.C,
                                            s.V, on_device ? 0.5f : 0.5f * by, scratch.as<void>(), sb, s.chunk, nullptr,
                                            logits_dtype, false, on_device ? d_by.as<float>() : nullptr);
            device_sync();
            std::vector<uint8_t> all = download<uint8_t>(d_loss.as<void>(), targets.size() * 4);
            for (const DeviceBuffer* b : {&d_dh, &d_dw}) {
                const std::vector<uint8_t> part =
                    download<uint8_t>(b->as<void>(), b == &d_dh ? h.size() * 2 : w.size() * 4);
                all.insert(all.end(), part.begin(), part.end());
            }
            results.push_back(std::move(all));
        }
        EXPECT_EQ(results[0], results[1]) << "logits " << mf::dtype_name(logits_dtype);
    }
}

TEST(CudaCrossEntropy, OutOfRangeTargetGivesNanLossAndNoGradient) {
    std::mt19937 rng(31);
    CublasHandle handle;
    const int64_t N = 3, C = 16, V = 12;
    const std::vector<float> h = random_bf16(rng, N * C), w = random_bf16(rng, V * C);
    const std::vector<int32_t> targets = {12, -100, -7};
    DeviceBuffer d_h = device_bf16(h), d_w = device_bf16(w), d_t = device_copy(targets), d_loss(N * 4), d_dh(N * C * 2),
                 d_dw(V * C * 4);
    d_dh.zero();
    d_dw.zero();
    const size_t sb = mf::cuda::lm_head_cross_entropy_scratch_bytes(N, V);
    DeviceBuffer scratch(sb);
    mf::cuda::lm_head_cross_entropy(handle.get(), d_loss.as<float>(), d_dh.as<bf16>(), d_dw.as<void>(), DType::f32,
                                    d_h.as<bf16>(), d_w.as<bf16>(), d_t.as<int32_t>(), N, C, V, 1.0f,
                                    scratch.as<void>(), sb, N, nullptr);
    device_sync();
    const std::vector<float> loss = download<float>(d_loss.as<void>(), N);
    EXPECT_TRUE(std::isnan(loss[0]));
    EXPECT_EQ(loss[1], 0.0f);
    EXPECT_TRUE(std::isnan(loss[2]));
    expect_exact(download_bf16(d_dh.as<void>(), N * C), std::vector<float>(N * C, 0.0f), "ce invalid targets dh");
    expect_exact(download<float>(d_dw.as<void>(), V * C), std::vector<float>(V * C, 0.0f), "ce invalid targets dw");
}

// Sets MOEFORGE_CE_KERNEL (the loss kernel's override, cross_entropy.cuh) for a scope, nullptr
// unsetting it, and puts back what was there.
class ScopedCeKernel {
 public:
    explicit ScopedCeKernel(const char* value) {
        const char* old = std::getenv(kName);
        had_old_ = old != nullptr;
        if (had_old_) old_ = old;
        set(value);
    }
    ~ScopedCeKernel() { set(had_old_ ? old_.c_str() : nullptr); }
    ScopedCeKernel(const ScopedCeKernel&) = delete;
    ScopedCeKernel& operator=(const ScopedCeKernel&) = delete;

 private:
    static constexpr const char* kName = "MOEFORGE_CE_KERNEL";
    static void set(const char* value) {
        if (value != nullptr)
            setenv(kName, value, 1);
        else
            unsetenv(kName);
    }
    bool had_old_ = false;
    std::string old_;
};

mf::cuda::CrossEntropyLossKernel loss_kernel_for(const char* env, int64_t V, DType logits_dtype) {
    ScopedCeKernel scoped(env);
    return mf::cuda::cross_entropy_loss_kernel(V, logits_dtype);
}

// The staged loss kernel at every cluster size (1, 2, 4 and 8 slices a row, for bf16 and fp32
// logits; last slices shorter than the others where V allows) and the streaming kernel, each against
// the CPU reference, and against each other: the same logits (one deterministic GEMM), summed in
// another order, so losses within the fp32 reduction tolerance and dh / dw within the tolerance
// against the CPU. Targets: one ignored, the row's last logit, the first of the last slice, the last
// of the first slice, one at random; two chunks (4 rows and 1).
TEST(CudaCrossEntropy, StagedAndStreamingKernelsMatchCpuAndEachOther) {
    std::mt19937 rng(38);
    CublasHandle handle;
    struct SliceCase {
        DType logits_dtype;
        int64_t V;
        int num_slices;
    };
    for (const SliceCase& c :
         {SliceCase{DType::bf16, 20000, 1}, SliceCase{DType::bf16, 40000, 2}, SliceCase{DType::bf16, 79992, 4},
          SliceCase{DType::bf16, 150000, 8}, SliceCase{DType::f32, 10000, 1}, SliceCase{DType::f32, 20000, 2},
          SliceCase{DType::f32, 39996, 4}, SliceCase{DType::f32, 79996, 8}}) {
        const CeCase s{5, 32, c.V, 4};
        const bool bf16_logits = c.logits_dtype == DType::bf16;
        const DType dw_dtype = bf16_logits ? DType::bf16 : DType::f32;
        const mf::cuda::CrossEntropyLossKernel staged = loss_kernel_for("staged", c.V, c.logits_dtype);
        const std::string name = std::string("ce logits ") + mf::dtype_name(c.logits_dtype) +
                                 " V=" + std::to_string(c.V) + " slices=" + std::to_string(staged.num_slices);
        ASSERT_TRUE(staged.staged) << name;
        EXPECT_EQ(staged.num_slices, c.num_slices) << name;
        EXPECT_EQ(loss_kernel_for(nullptr, c.V, c.logits_dtype).staged, mf::cuda::kCrossEntropyStagedByDefault)
            << name << ": automatic choice";
        EXPECT_EQ(loss_kernel_for("", c.V, c.logits_dtype).staged, mf::cuda::kCrossEntropyStagedByDefault)
            << name << ": empty = automatic";
        EXPECT_FALSE(loss_kernel_for("streaming", c.V, c.logits_dtype).staged) << name;
        const int64_t slice = staged.slice_elements, last_begin = (staged.num_slices - 1) * slice;
        std::printf("  %s: slices of %lld logits, the last %lld\n", name.c_str(), static_cast<long long>(slice),
                    static_cast<long long>(c.V - last_begin));

        const std::vector<float> h = random_bf16(rng, static_cast<size_t>(s.N * s.C));
        const std::vector<float> w = random_bf16(rng, static_cast<size_t>(s.V * s.C));
        const std::vector<int32_t> targets = {
            mf::cpu::kIgnoreIndex, static_cast<int32_t>(c.V - 1), static_cast<int32_t>(last_begin),
            static_cast<int32_t>(std::min(slice, c.V) - 1), static_cast<int32_t>(rng() % c.V)};
        const float grad_scale = 0.25f;  // 1 / the four counted targets
        const std::vector<float> dh0 = random_bf16(rng, h.size(), -0.01f, 0.01f);
        std::vector<float> dw0 = random_f32(rng, w.size(), -0.01f, 0.01f);
        if (dw_dtype == DType::bf16) dw0 = round_bf16(dw0);
        const CeExpected ref = expected_ce(s, h, w, targets, dh0, dw0, dw_dtype, c.logits_dtype, grad_scale);

        std::vector<CeOutputs> outs;
        for (const char* kernel : {"streaming", "staged"}) {
            ScopedCeKernel scoped(kernel);
            const std::string run = name + " " + kernel;
            outs.push_back(run_ce(handle.get(), s, h, w, targets, dh0, dw0, dw_dtype, c.logits_dtype, grad_scale));
            expect_ce_matches(outs.back(), ref, bf16_logits, run);
            // The ignored row: loss 0 and a zero dlogits row (dh's row 0 is dh0's, bit for bit).
            EXPECT_EQ(outs.back().loss[0], 0.0f) << run;
            expect_exact(std::vector<float>(outs.back().dh.begin(), outs.back().dh.begin() + s.C),
                         std::vector<float>(dh0.begin(), dh0.begin() + s.C), run + " ignored row's dh");
            // Loss only (no gradients, the row never written): the same losses.
            const CeOutputs loss_only =
                run_ce(handle.get(), s, h, w, targets, dh0, dw0, dw_dtype, c.logits_dtype, grad_scale, false);
            expect_exact(loss_only.loss, outs.back().loss, run + " loss-only run");
        }
        expect_reduction(outs[1].loss, outs[0].loss, outs[0].loss, name + " staged vs streaming loss");
        expect_within(outs[1].dh, outs[0].dh, reduction_tolerance(ref.dh, ref.dh_naive),
                      name + " staged vs streaming dh");
        expect_within(outs[1].dw, outs[0].dw, reduction_tolerance(ref.dw, ref.dw_naive),
                      name + " staged vs streaming dw");
    }
}

// MOEFORGE_CE_KERNEL=staged where the staged kernel does not apply (V not a multiple of the 16-byte
// vector; rows longer than 8 slices of 47 KiB, as fp32 V = 151936 and bf16 V = 200000 are) runs the
// streaming kernel: a fallback, not an error. The same bits as MOEFORGE_CE_KERNEL=streaming, and the
// CPU reference's numbers.
TEST(CudaCrossEntropy, ForcedStagedFallsBackToStreamingWhereItDoesNotApply) {
    std::mt19937 rng(39);
    CublasHandle handle;
    for (const auto& [logits_dtype, V] :
         {std::pair{DType::bf16, int64_t{20001}}, std::pair{DType::f32, int64_t{10002}},
          std::pair{DType::f32, int64_t{151936}}, std::pair{DType::bf16, int64_t{200000}}}) {
        const CeCase s{3, 32, V, 3};
        const bool bf16_logits = logits_dtype == DType::bf16;
        const std::string name =
            std::string("ce forced staged, logits ") + mf::dtype_name(logits_dtype) + " V=" + std::to_string(V);
        EXPECT_FALSE(loss_kernel_for("staged", V, logits_dtype).staged) << name;
        EXPECT_FALSE(loss_kernel_for(nullptr, V, logits_dtype).staged) << name;
        const std::vector<float> h = random_bf16(rng, static_cast<size_t>(s.N * s.C));
        const std::vector<float> w = random_bf16(rng, static_cast<size_t>(s.V * s.C));
        const std::vector<int32_t> targets = {static_cast<int32_t>(V - 1), mf::cpu::kIgnoreIndex,
                                              static_cast<int32_t>(rng() % V)};
        const std::vector<float> dh0(h.size(), 0.0f), dw0(w.size(), 0.0f);
        const CeExpected ref = expected_ce(s, h, w, targets, dh0, dw0, DType::f32, logits_dtype, 0.5f);
        std::vector<CeOutputs> outs;
        for (const char* kernel : {"staged", "streaming"}) {
            ScopedCeKernel scoped(kernel);
            outs.push_back(run_ce(handle.get(), s, h, w, targets, dh0, dw0, DType::f32, logits_dtype, 0.5f));
        }
        expect_ce_matches(outs[0], ref, bf16_logits, name);
        expect_exact(outs[0].loss, outs[1].loss, name + " loss = streaming's");
        expect_exact(outs[0].dh, outs[1].dh, name + " dh = streaming's");
        expect_exact(outs[0].dw, outs[1].dw, name + " dw = streaming's");
    }
}

// cross_entropy_loss_rows on logits given directly (the entry the benchmark times), both kernels and
// an unaligned row start (which streams, one element at a time): the losses against fp64 on the host
// (the reduction rule), the bf16 dlogits over the rows' first bytes within 2^-7 relative of fp64 (half
// a bf16 step, at most 2^-8, plus the fp32 sums' error), an ignored and an out-of-range target (loss
// 0 / NaN, a zero dlogits row), and want_grad = false leaving the logits as they were, bit for bit.
TEST(CudaCrossEntropy, LossRowsEntryWritesDlogitsOverTheLogits) {
    std::mt19937 rng(40);
    const int64_t rows = 4;
    for (const auto& [logits_dtype, V] : {std::pair{DType::bf16, int64_t{40000}}, std::pair{DType::f32, int64_t{20000}},
                                          std::pair{DType::bf16, int64_t{1000}}}) {
        const size_t elem = mf::dtype_size(logits_dtype), n = static_cast<size_t>(rows * V);
        std::vector<float> x = random_f32(rng, n, -4.0f, 4.0f);
        if (logits_dtype == DType::bf16) x = round_bf16(x);
        const std::vector<int32_t> targets = {static_cast<int32_t>(V - 1), mf::cpu::kIgnoreIndex,
                                              static_cast<int32_t>(rng() % V), static_cast<int32_t>(V)};
        const float grad_scale = 0.5f;
        std::vector<double> loss_ref(rows, 0.0), dlogits_ref(n, 0.0);
        for (int64_t r = 0; r < rows; ++r) {
            const int32_t t = targets[static_cast<size_t>(r)];
            if (t < 0 || t >= V) continue;
            const float* row = x.data() + r * V;
            double m = -1e300, sum = 0.0;
            for (int64_t v = 0; v < V; ++v) m = std::max(m, static_cast<double>(row[v]));
            for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - m);
            loss_ref[static_cast<size_t>(r)] = m + std::log(sum) - row[t];
            for (int64_t v = 0; v < V; ++v)
                dlogits_ref[static_cast<size_t>(r * V + v)] =
                    grad_scale * (std::exp(row[v] - m) / sum - (v == t ? 1.0 : 0.0));
        }
        DeviceBuffer d_t = device_copy(targets), d_loss(rows * 4), d_x((n + 1) * elem);
        for (const auto& [kernel, offset] :
             {std::pair{"staged", 0}, std::pair{"streaming", 0}, std::pair{"staged", 1}}) {
            ScopedCeKernel scoped(kernel);
            const std::string name = std::string("ce loss rows ") + kernel + " logits " + mf::dtype_name(logits_dtype) +
                                     " V=" + std::to_string(V) + (offset != 0 ? " unaligned" : "");
            void* xp = static_cast<char*>(d_x.as<void>()) + offset * elem;
            upload_grad(xp, x, logits_dtype == DType::f32);
            const std::vector<uint8_t> before = download<uint8_t>(xp, n * elem);
            // Losses only: the logits untouched.
            d_loss.poison();
            mf::cuda::cross_entropy_loss_rows(d_loss.as<float>(), xp, logits_dtype, d_t.as<int32_t>(), rows, V,
                                              grad_scale, nullptr, false, nullptr);
            device_sync();
            const std::vector<float> loss_only = download<float>(d_loss.as<void>(), rows);
            EXPECT_EQ(download<uint8_t>(xp, n * elem), before) << name << ": want_grad = false wrote the logits";
            // With the gradient.
            d_loss.poison();
            mf::cuda::cross_entropy_loss_rows(d_loss.as<float>(), xp, logits_dtype, d_t.as<int32_t>(), rows, V,
                                              grad_scale, nullptr, true, nullptr);
            device_sync();
            const std::vector<float> loss = download<float>(d_loss.as<void>(), rows);
            expect_exact(loss_only, loss, name + " loss-only run");
            EXPECT_EQ(loss[1], 0.0f) << name;
            EXPECT_TRUE(std::isnan(loss[3])) << name;
            // The rows with a target: an fp32 sum against fp64 (naive = ref).
            const std::vector<float> counted = {loss[0], loss[2]},
                                     counted_ref = {static_cast<float>(loss_ref[0]), static_cast<float>(loss_ref[2])};
            expect_reduction(counted, counted_ref, counted_ref, name + " loss");
            const int64_t stride = V * static_cast<int64_t>(elem) / 2;  // bf16 elements between dlogits rows
            std::vector<float> dlogits, want;
            for (int64_t r = 0; r < rows; ++r) {
                const std::vector<float> row = download_bf16(static_cast<bf16*>(xp) + r * stride, V);
                dlogits.insert(dlogits.end(), row.begin(), row.end());
                for (int64_t v = 0; v < V; ++v) want.push_back(static_cast<float>(dlogits_ref[r * V + v]));
            }
            expect_elementwise(dlogits, want, 1e-12, 1.0 / 128, name + " dlogits");
        }
    }
}

// An unknown MOEFORGE_CE_KERNEL value is an error naming the variable and the value, from the
// choice, the loss entry and the fused op (before any work).
TEST(CudaCrossEntropy, UnknownKernelOverrideThrowsNamingIt) {
    ScopedCeKernel scoped("fastest");
    const auto expect_named = [](const std::function<void()>& call, const char* what) {
        try {
            call();
            ADD_FAILURE() << what << ": no error";
        } catch (const mf::Error& e) {
            const std::string message = e.what();
            EXPECT_NE(message.find("MOEFORGE_CE_KERNEL"), std::string::npos) << what << ": " << message;
            EXPECT_NE(message.find("fastest"), std::string::npos) << what << ": " << message;
        }
    };
    expect_named([] { mf::cuda::cross_entropy_loss_kernel(1000, DType::bf16); }, "cross_entropy_loss_kernel");
    const int64_t N = 2, C = 16, V = 64;
    DeviceBuffer h(N * C * 2), w(V * C * 2), t(N * 4), loss(N * 4), scratch(N * V * 4);
    h.zero();
    w.zero();
    t.zero();
    expect_named(
        [&] {
            mf::cuda::cross_entropy_loss_rows(loss.as<float>(), scratch.as<void>(), DType::f32, t.as<int32_t>(), N, V,
                                              1.0f, nullptr, true, nullptr);
        },
        "cross_entropy_loss_rows");
    CublasHandle handle;
    expect_named(
        [&] {
            mf::cuda::lm_head_cross_entropy(handle.get(), loss.as<float>(), nullptr, nullptr, DType::f32, h.as<bf16>(),
                                            w.as<bf16>(), t.as<int32_t>(), N, C, V, 1.0f, scratch.as<void>(),
                                            scratch.bytes(), N, nullptr);
        },
        "lm_head_cross_entropy");
}

// ---------------------------------------------------------------------------------------------
// AdamW

// The third multiplies the gradients by a host grad_scale (the fused clipping factor) first.
const mf::cpu::AdamWParams kAdamWConfigs[] = {{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1},
                                              {3e-2f, 0.3f, 0.95f, 1e-6f, 0.0f, 1},
                                              {2e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 0.61f}};

TEST(CudaAdamW, MixedPolicyMatchesCpuBitForBit) {
    std::mt19937 rng(32);
    for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000003}}) {
        for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
            for (const auto& config : kAdamWConfigs) {
                for (const DType grad_dtype : {DType::f32, DType::bf16}) {
                    for (const bool scaled : {false, true}) {
                        const std::string name = std::string("adamw mixed grads ") + mf::dtype_name(grad_dtype) +
                                                 (scaled ? " scaled" : "") + " n=" + std::to_string(n) +
                                                 " offset=" + std::to_string(offset) +
                                                 " beta1=" + std::to_string(config.beta1) +
                                                 " grad_scale=" + std::to_string(config.grad_scale);
                        const size_t sz = static_cast<size_t>(n);
                        std::vector<float> p = random_f32(rng, sz), m(sz, 0.0f), v(sz, 0.0f);
                        DeviceBuffer d_p((sz + 1) * 4), d_m((sz + 1) * 4), d_v((sz + 1) * 4), d_g((sz + 1) * 4),
                            d_copy((sz + 1) * 2), d_scale(4);
                        upload(d_p.as<float>(offset), p);
                        upload(d_m.as<float>(offset), m);
                        upload(d_v.as<float>(offset), v);
                        const float scale = 0.37f;
                        upload(d_scale.as<void>(), std::vector<float>{scale});
                        for (int64_t step = 1; step <= 3; ++step) {
                            std::vector<float> g = random_f32(rng, sz, -2.0f, 2.0f);
                            if (grad_dtype == DType::bf16) {
                                g = round_bf16(g);
                                upload_bf16(d_g.as<bf16>(offset), g);
                            } else {
                                upload(d_g.as<float>(offset), g);
                            }
                            // The GPU multiplies by the host grad_scale first, then by the device
                            // scale; the reference does the same two fp32 products in that order.
                            std::vector<float> g_cpu = g;
                            mf::cpu::AdamWParams cfg = config, cpu_cfg = config;
                            cfg.step = cpu_cfg.step = step;
                            if (scaled) {
                                for (float& x : g_cpu) x = (x * config.grad_scale) * scale;
                                cpu_cfg.grad_scale = 1.0f;
                            }
                            mf::cpu::adamw_update(p.data(), m.data(), v.data(), g_cpu.data(), n, cpu_cfg);
                            const void* grad = grad_dtype == DType::bf16
                                                   ? static_cast<const void*>(d_g.as<bf16>(offset))
                                                   : d_g.as<float>(offset);
                            d_copy.poison();
                            mf::cuda::adamw_update_mixed(
                                d_p.as<float>(offset), d_m.as<float>(offset), d_v.as<float>(offset), grad, grad_dtype,
                                d_copy.as<bf16>(offset), n, cfg, scaled ? d_scale.as<float>() : nullptr, nullptr);
                        }
                        device_sync();
                        expect_exact(download<float>(d_p.as<float>(offset), sz), p, name + " master");
                        expect_exact(download<float>(d_m.as<float>(offset), sz), m, name + " m");
                        expect_exact(download<float>(d_v.as<float>(offset), sz), v, name + " v");
                        expect_exact(download_bf16(d_copy.as<bf16>(offset), sz), round_bf16(p), name + " bf16 copy");
                    }
                }
            }
        }
    }
}

TEST(CudaAdamW, Bf16PolicyMatchesCpuBitForBit) {
    std::mt19937 rng(33);
    for (const int64_t n : {int64_t{1}, int64_t{13}, int64_t{1000003}}) {
        for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
            for (const auto& config : kAdamWConfigs) {
                const std::string name = "adamw bf16 n=" + std::to_string(n) + " offset=" + std::to_string(offset) +
                                         " beta1=" + std::to_string(config.beta1) +
                                         " grad_scale=" + std::to_string(config.grad_scale);
                const size_t sz = static_cast<size_t>(n);
                std::vector<float> p = random_bf16(rng, sz), m(sz, 0.0f), v(sz, 0.0f);
                DeviceBuffer d_p((sz + 1) * 2), d_m((sz + 1) * 2), d_v((sz + 1) * 2), d_g((sz + 1) * 2);
                upload_bf16(d_p.as<bf16>(offset), p);
                upload_bf16(d_m.as<bf16>(offset), m);
                upload_bf16(d_v.as<bf16>(offset), v);
                for (int64_t step = 1; step <= 3; ++step) {
                    const std::vector<float> g = random_bf16(rng, sz, -2.0f, 2.0f);
                    upload_bf16(d_g.as<bf16>(offset), g);
                    mf::cpu::AdamWParams cfg = config;
                    cfg.step = step;
                    mf::cpu::adamw_update(p.data(), m.data(), v.data(), g.data(), n, cfg);
                    p = round_bf16(p);  // the bf16 policy stores every state rounded
                    m = round_bf16(m);
                    v = round_bf16(v);
                    mf::cuda::adamw_update_bf16(d_p.as<bf16>(offset), d_m.as<bf16>(offset), d_v.as<bf16>(offset),
                                                d_g.as<bf16>(offset), n, cfg, nullptr, nullptr);
                }
                device_sync();
                expect_exact(download_bf16(d_p.as<bf16>(offset), sz), p, name + " param");
                expect_exact(download_bf16(d_m.as<bf16>(offset), sz), m, name + " m");
                expect_exact(download_bf16(d_v.as<bf16>(offset), sz), v, name + " v");
            }
        }
    }
}

TEST(CudaAdamW, RejectsBadArguments) {
    mf::cpu::AdamWParams cfg{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0};
    DeviceBuffer b(64);
    EXPECT_THROW(
        mf::cuda::adamw_update_bf16(b.as<bf16>(), b.as<bf16>(), b.as<bf16>(), b.as<bf16>(), 4, cfg, nullptr, nullptr),
        mf::Error);
    cfg.step = 1;
    EXPECT_THROW(mf::cuda::adamw_update_mixed(b.as<float>(), b.as<float>(), b.as<float>(), b.as<void>(), DType::i32,
                                              nullptr, 4, cfg, nullptr, nullptr),
                 mf::Error);
}

// ---------------------------------------------------------------------------------------------
// reductions

TEST(CudaReduce, SumSquaresAndSumMatchCpuInDouble) {
    std::mt19937 rng(34);
    DeviceBuffer scratch(mf::cuda::sum_squares_scratch_bytes()), d_out(8);
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{1000003}, int64_t{5000001}}) {
        for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
            for (const DType dtype : {DType::f32, DType::bf16}) {
                const std::string name = std::string("sum ") + mf::dtype_name(dtype) + " n=" + std::to_string(n) +
                                         " offset=" + std::to_string(offset);
                std::vector<float> x = random_f32(rng, static_cast<size_t>(n), -3.0f, 3.0f);
                if (dtype == DType::bf16) x = round_bf16(x);
                DeviceBuffer d_x((static_cast<size_t>(n) + 1) * 4);
                void* xp = dtype == DType::f32 ? static_cast<void*>(d_x.as<float>(offset))
                                               : static_cast<void*>(d_x.as<bf16>(offset));
                if (dtype == DType::f32) {
                    upload(xp, x);
                } else {
                    upload_bf16(xp, x);
                }
                const double ref_sq = mf::cpu::sum_squares(x.data(), n);
                double ref_sum = 0.0, abs_sum = 0.0;
                for (const float v : x) {
                    ref_sum += v;
                    abs_sum += std::fabs(v);
                }
                // fp64 summation in another order: |error| <= n · 2^-53 · Σ|terms| (+ a tiny floor).
                const double bound = static_cast<double>(n) * std::ldexp(1.0, -53);
                upload(d_out.as<void>(), std::vector<double>{123.0});
                mf::cuda::sum_squares(d_out.as<double>(), xp, dtype, n, false, scratch.as<void>(), nullptr);
                device_sync();
                const double sq = download<double>(d_out.as<void>(), 1)[0];
                EXPECT_LE(std::fabs(sq - ref_sq), bound * ref_sq + 1e-300) << name;
                // accumulate: adds to what is there
                mf::cuda::sum_squares(d_out.as<double>(), xp, dtype, n, true, scratch.as<void>(), nullptr);
                device_sync();
                EXPECT_LE(std::fabs(download<double>(d_out.as<void>(), 1)[0] - 2 * ref_sq), 2 * bound * ref_sq + 1e-300)
                    << name << " accumulate";
                mf::cuda::sum_values(d_out.as<double>(), xp, dtype, n, false, scratch.as<void>(), nullptr);
                device_sync();
                const double sum = download<double>(d_out.as<void>(), 1)[0];
                EXPECT_LE(std::fabs(sum - ref_sum), bound * abs_sum + 1e-300) << name;
                std::printf("  %-48s sumsq rel err %.3g, sum err %.3g\n", name.c_str(),
                            ref_sq > 0 ? std::fabs(sq - ref_sq) / ref_sq : 0.0, std::fabs(sum - ref_sum));
            }
        }
    }
}

// sum_squares_many gives every buffer the bits sum_squares gives it, across sizes either side of the
// block boundaries (one group, one block of groups, the full 1024-block grid and beyond), both
// alignments and dtypes, more items than one batch (kMaxSumItems), empty buffers included.
TEST(CudaReduce, SumSquaresManyEqualsOneAtATimeBitForBit) {
    std::mt19937 rng(36);
    const std::vector<int64_t> sizes = {0,    1,    7,       8,       9,       2047,    2048,    2049,
                                        5000, 8192, 2097151, 2097152, 2097160, 3000017, 9000001, 64};
    for (const DType dtype : {DType::f32, DType::bf16}) {
        const size_t elem = dtype == DType::f32 ? 4 : 2;
        std::vector<DeviceBuffer> bufs;
        std::vector<mf::cuda::SumSquaresItem> items;
        const int count = mf::cuda::kMaxSumItems + 13;
        DeviceBuffer outs(static_cast<size_t>(count) * 8), one(8), scratch(mf::cuda::sum_squares_scratch_bytes()),
            many_scratch(mf::cuda::sum_squares_many_scratch_bytes());
        for (int i = 0; i < count; ++i) {
            const int64_t n = sizes[static_cast<size_t>(i) % sizes.size()] + (i >= 16 ? i : 0);
            const int64_t offset = i % 3 == 1 ? 1 : 0;
            std::vector<float> x = random_f32(rng, static_cast<size_t>(n), -2.0f, 2.0f);
            bufs.emplace_back((static_cast<size_t>(n) + 1) * elem);
            char* p = static_cast<char*>(bufs.back().as<void>()) + offset * elem;
            if (dtype == DType::f32)
                upload(p, x);
            else
                upload_bf16(p, round_bf16(x));
            items.push_back({p, n, outs.as<double>() + i});
        }
        mf::cuda::sum_squares_many(items.data(), count, dtype, many_scratch.as<void>(), nullptr);
        device_sync();
        const std::vector<double> many = download<double>(outs.as<void>(), static_cast<size_t>(count));
        for (int i = 0; i < count; ++i) {
            mf::cuda::sum_squares(one.as<double>(), items[static_cast<size_t>(i)].x, dtype,
                                  items[static_cast<size_t>(i)].n, false, scratch.as<void>(), nullptr);
            device_sync();
            const double ref = download<double>(one.as<void>(), 1)[0];
            EXPECT_EQ(std::memcmp(&ref, &many[static_cast<size_t>(i)], sizeof ref), 0)
                << mf::dtype_name(dtype) << " item " << i << " n=" << items[static_cast<size_t>(i)].n << ": "
                << many[static_cast<size_t>(i)] << " vs " << ref;
        }
    }
}

TEST(CudaReduce, SumSquaresIsDeterministic) {
    std::mt19937 rng(35);
    const int64_t n = 3000017;
    const std::vector<float> x = random_f32(rng, static_cast<size_t>(n));
    DeviceBuffer d_x = device_copy(x), scratch(mf::cuda::sum_squares_scratch_bytes()), d_out(8);
    std::vector<double> results;
    for (int run = 0; run < 3; ++run) {
        mf::cuda::sum_squares(d_out.as<double>(), d_x.as<void>(), DType::f32, n, false, scratch.as<void>(), nullptr);
        device_sync();
        results.push_back(download<double>(d_out.as<void>(), 1)[0]);
    }
    expect_exact(results, std::vector<double>(3, results[0]), "sum_squares reruns");
}

TEST(CudaReduce, ClipScaleAndScaleInplace) {
    DeviceBuffer d_sumsq(8), d_scale(4), d_norm(4);
    struct Case {
        double sumsq;
        float max_norm;
    };
    for (const Case c : {Case{4.0, 1.0f}, Case{0.25, 1.0f}, Case{4.0, 0.0f}, Case{1e6, 0.5f}}) {
        upload(d_sumsq.as<void>(), std::vector<double>{c.sumsq});
        mf::cuda::clip_scale(d_scale.as<float>(), d_norm.as<float>(), d_sumsq.as<double>(), c.max_norm, nullptr);
        device_sync();
        const float norm = static_cast<float>(std::sqrt(c.sumsq));
        const float want = c.max_norm > 0.0f ? std::min(c.max_norm / (norm + 1e-6f), 1.0f) : 1.0f;
        EXPECT_EQ(download<float>(d_norm.as<void>(), 1)[0], norm);
        EXPECT_EQ(download<float>(d_scale.as<void>(), 1)[0], want) << "sumsq " << c.sumsq << " max " << c.max_norm;
    }
    std::mt19937 rng(36);
    const float s = 0.3f;
    upload(d_scale.as<void>(), std::vector<float>{s});
    for (const int64_t n : {int64_t{1}, int64_t{1001}}) {
        for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
            const std::vector<float> x = random_bf16(rng, static_cast<size_t>(n));
            std::vector<float> want_f = x, want_b = x;
            for (float& v : want_f) v *= s;
            for (float& v : want_b) v = round_bf16(v * s);
            DeviceBuffer d_f((x.size() + 1) * 4), d_b((x.size() + 1) * 2);
            upload(d_f.as<float>(offset), x);
            upload_bf16(d_b.as<bf16>(offset), x);
            mf::cuda::scale_inplace(d_f.as<float>(offset), DType::f32, d_scale.as<float>(), n, nullptr);
            mf::cuda::scale_inplace(d_b.as<bf16>(offset), DType::bf16, d_scale.as<float>(), n, nullptr);
            device_sync();
            expect_exact(download<float>(d_f.as<float>(offset), x.size()), want_f, "scale_inplace f32");
            expect_exact(download_bf16(d_b.as<bf16>(offset), x.size()), want_b, "scale_inplace bf16");
        }
    }
    // Longer than one pass of the grid (the launch caps its blocks): every element still scaled.
    {
        const int64_t n = 3'000'003;
        const std::vector<float> x = random_bf16(rng, static_cast<size_t>(n));
        std::vector<float> want = x;
        for (float& v : want) v = round_bf16(v * s);
        DeviceBuffer d_b = device_bf16(x);
        mf::cuda::scale_inplace(d_b.as<bf16>(), DType::bf16, d_scale.as<float>(), n, nullptr);
        device_sync();
        expect_exact(download_bf16(d_b.as<void>(), x.size()), want, "scale_inplace bf16, 3M elements");
    }
    // A scale of exactly 1 leaves the buffer as it was, bit for bit (NaN bit patterns included).
    upload(d_scale.as<void>(), std::vector<float>{1.0f});
    for (const DType dtype : {DType::f32, DType::bf16}) {
        DeviceBuffer d_x(4000 * 4);
        d_x.poison();
        mf::cuda::scale_inplace(d_x.as<void>(), dtype, d_scale.as<float>(), 4000, nullptr);
        device_sync();
        EXPECT_EQ(download<uint8_t>(d_x.as<void>(), 4000 * 4), std::vector<uint8_t>(4000 * 4, 0xFF))
            << "scale_inplace by 1, " << mf::dtype_name(dtype);
    }
}

// ---------------------------------------------------------------------------------------------
// benchmarks (MF_BENCH=1)

// The loss kernel alone at V = 151936 (cross_entropy_loss_rows), streaming and staged
// (MOEFORGE_CE_KERNEL), on chunks of logits as the fused op runs them: bf16 2731 and 8192 rows, fp32
// 1664 (where staged does not apply and the line says the streaming kernel ran). The logits are
// restored from a pristine copy before each timed run (the kernel overwrites them). GB/s counts one
// read of the logits and one write of the bf16 dlogits.
void bench_loss_kernel(std::mt19937& rng) {
    const int64_t V = 151936, max_rows = 8192;
    std::vector<int32_t> targets(static_cast<size_t>(max_rows));
    for (auto& t : targets) t = static_cast<int32_t>(rng() % V);
    DeviceBuffer d_t = device_copy(targets), loss(max_rows * 4);
    const size_t tile = size_t{1} << 22;  // logits: a random pattern in [-2, 2), repeated
    const std::vector<float> pattern = random_bf16(rng, tile, -2.0f, 2.0f);
    for (const auto& [rows, logits_type] :
         {std::pair{int64_t{2731}, DType::bf16}, std::pair{int64_t{8192}, DType::bf16},
          std::pair{int64_t{1664}, DType::f32}}) {
        const size_t n = static_cast<size_t>(rows * V), elem = mf::dtype_size(logits_type);
        DeviceBuffer pristine(n * elem), logits(n * elem);
        for (size_t at = 0; at < n; at += tile) {
            const std::vector<float> part(pattern.begin(),
                                          pattern.begin() + static_cast<ptrdiff_t>(std::min(tile, n - at)));
            upload_grad(pristine.as<char>(at * elem), part, logits_type == DType::f32);
        }
        double streaming_us = 0.0;
        for (const char* kernel : {"streaming", "staged"}) {
            ScopedCeKernel scoped(kernel);
            const mf::cuda::CrossEntropyLossKernel ran = mf::cuda::cross_entropy_loss_kernel(V, logits_type);
            const double us = time_us_after(
                [&] {
                    MF_CHECK_CUDA(
                        cudaMemcpyAsync(logits.as<void>(), pristine.as<void>(), n * elem, cudaMemcpyDeviceToDevice));
                },
                [&] {
                    mf::cuda::cross_entropy_loss_rows(loss.as<float>(), logits.as<void>(), logits_type,
                                                      d_t.as<int32_t>(), rows, V, 1.0f / static_cast<float>(rows),
                                                      nullptr, true, nullptr);
                });
            if (ran.staged) {
                std::printf(
                    "BENCH ce loss %-9s rows %5lld V %lld logits %-4s %10.1f us  %8.1f GB/s  (%d slices of %lld; %.2fx "
                    "streaming)\n",
                    ran.name(), static_cast<long long>(rows), static_cast<long long>(V), mf::dtype_name(logits_type),
                    us, static_cast<double>(n) * static_cast<double>(elem + 2) / (us * 1e-6) / 1e9, ran.num_slices,
                    static_cast<long long>(ran.slice_elements), streaming_us / us);
            } else {
                std::printf(
                    "BENCH ce loss %-9s rows %5lld V %lld logits %-4s %10.1f us  %8.1f GB/s  (MOEFORGE_CE_KERNEL=%s)\n",
                    ran.name(), static_cast<long long>(rows), static_cast<long long>(V), mf::dtype_name(logits_type),
                    us, static_cast<double>(n) * static_cast<double>(elem + 2) / (us * 1e-6) / 1e9, kernel);
            }
            if (std::string(kernel) == "streaming") streaming_us = us;
        }
    }
}

TEST(CudaLossOptimBench, Qwen3MoeShapes) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1 for the benchmark";
    std::mt19937 rng(37);
    CublasHandle handle;
    {
        // N = 8192 tokens (micro-batch 2 x 4096): chunks of 441 rows (a 256 MiB fp32 logits buffer),
        // 1664 (1 GiB) and 4096; then bf16 logits at 2048 tokens (4 chunks), 2731 (3 chunks of a 1 GiB
        // buffer, as the bf16 policy runs), 4096 and 8192 (one chunk).
        const int64_t N = 8192, C = 2048, V = 151936;
        DeviceBuffer h(static_cast<size_t>(N * C) * 2), w(static_cast<size_t>(V * C) * 2), dh(N * C * 2),
            dw(static_cast<size_t>(V * C) * 4), loss(N * 4);
        upload_bf16(h.as<void>(), random_bf16(rng, static_cast<size_t>(N * C)));
        upload_bf16(w.as<void>(), random_bf16(rng, static_cast<size_t>(V * C), -0.05f, 0.05f));
        std::vector<int32_t> targets(static_cast<size_t>(N));
        for (auto& t : targets) t = static_cast<int32_t>(rng() % V);
        DeviceBuffer d_t = device_copy(targets);
        dh.zero();
        dw.zero();
        const double flops = 2.0 * N * C * V;
        for (const auto& [chunk, logits_type] :
             {std::pair{int64_t{441}, DType::f32}, std::pair{int64_t{1664}, DType::f32},
              std::pair{int64_t{4096}, DType::f32}, std::pair{int64_t{2048}, DType::bf16},
              std::pair{int64_t{2731}, DType::bf16}, std::pair{int64_t{4096}, DType::bf16},
              std::pair{int64_t{8192}, DType::bf16}}) {
            const size_t sb = mf::cuda::lm_head_cross_entropy_scratch_bytes(chunk, V, logits_type);
            DeviceBuffer scratch(sb);
            for (const DType dw_type : {DType::f32, DType::bf16}) {
                const double us = time_us(
                    [&] {
                        mf::cuda::lm_head_cross_entropy(handle.get(), loss.as<float>(), dh.as<bf16>(), dw.as<void>(),
                                                        dw_type, h.as<bf16>(), w.as<bf16>(), d_t.as<int32_t>(), N, C, V,
                                                        1.0f / N, scratch.as<void>(), sb, chunk, nullptr, logits_type);
                    },
                    5);
                std::printf(
                    "BENCH lm_head_cross_entropy fwd+bwd N=8192 V=151936 chunk %5lld logits %-4s dw %-4s %10.1f us"
                    "  %8.1f TFLOP/s (3 GEMMs + loss kernel)\n",
                    static_cast<long long>(chunk), mf::dtype_name(logits_type), mf::dtype_name(dw_type), us,
                    3 * flops / (us * 1e-6) / 1e12);
            }
        }
    }
    bench_loss_kernel(rng);
    {
        const int64_t n = int64_t{1} << 28;
        const size_t sz = static_cast<size_t>(n);
        DeviceBuffer p(sz * 4), m(sz * 4), v(sz * 4), g(sz * 4), copy(sz * 2), scale(4);
        // Realistic values (zeros would send every division down its special-case path): a 2^24
        // random pattern repeated over the buffers; v >= 0.
        const size_t tile = size_t{1} << 24;
        const std::vector<float> signed_pattern = random_bf16(rng, tile),
                                 positive_pattern = random_bf16(rng, tile, 0.0f, 1e-4f);
        auto fill = [&](const DeviceBuffer& b, const std::vector<float>& pattern, bool as_bf16) {
            for (size_t at = 0; at < sz; at += tile) {
                if (as_bf16) {
                    upload_bf16(b.as<bf16>(at), pattern);
                } else {
                    upload(b.as<float>(at), pattern);
                }
            }
        };
        fill(p, signed_pattern, true);
        fill(m, signed_pattern, true);
        fill(v, positive_pattern, true);
        fill(g, signed_pattern, true);
        upload(scale.as<void>(), std::vector<float>{1.0f});
        mf::cpu::AdamWParams cfg{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 10};
        double us = time_us([&] {
            mf::cuda::adamw_update_bf16(p.as<bf16>(), m.as<bf16>(), v.as<bf16>(), g.as<bf16>(), n, cfg,
                                        scale.as<float>(), nullptr);
        });
        report_bandwidth("adamw_update_bf16 n=2^28 (14 B/param)", us, 14.0 * n);
        fill(p, signed_pattern, false);
        fill(m, signed_pattern, false);
        fill(v, positive_pattern, false);
        us = time_us([&] {
            mf::cuda::adamw_update_mixed(p.as<float>(), m.as<float>(), v.as<float>(), g.as<void>(), DType::bf16,
                                         copy.as<bf16>(), n, cfg, scale.as<float>(), nullptr);
        });
        report_bandwidth("adamw_update_mixed bf16 grads (28 B/param)", us, 28.0 * n);
        DeviceBuffer scratch(mf::cuda::sum_squares_scratch_bytes()), out(8), clip(4);
        us = time_us([&] {
            mf::cuda::sum_squares(out.as<double>(), g.as<void>(), DType::bf16, n, false, scratch.as<void>(), nullptr);
        });
        report_bandwidth("sum_squares bf16 n=2^28", us, 2.0 * n);
        us = time_us([&] {
            mf::cuda::sum_squares(out.as<double>(), g.as<void>(), DType::f32, n, false, scratch.as<void>(), nullptr);
        });
        report_bandwidth("sum_squares f32 n=2^28", us, 4.0 * n);
        us = time_us([&] {
            mf::cuda::clip_scale(clip.as<float>(), nullptr, out.as<double>(), 1.0f, nullptr);
            mf::cuda::scale_inplace(g.as<void>(), DType::bf16, clip.as<float>(), n, nullptr);
        });
        report_bandwidth("clip_scale + scale_inplace bf16 n=2^28", us, 4.0 * n);
    }
}

}  // namespace
