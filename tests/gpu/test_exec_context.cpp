// ops::ExecScope on the GPU: ops issued inside a scope go to the scope's stream (and nowhere else),
// give the bits they give on the engine's stream, use the caller's workspace when it is large
// enough, have a background stream of their own, and the scope before (or the engine's stream) is
// restored when a scope ends. The streams here are non-blocking, as a framework's side streams are,
// so nothing orders them with the engine's stream behind the test's back.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/tensor.h"
#include "ops/ops.h"
#include "test_cuda_common.h"

namespace {

using mf::Buffer;
using mf::Device;
using mf::DType;
using mf::Tensor;
using mf::ops::ExecContext;
using mf::ops::ExecScope;

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new mf::test::GpuEnvironment);

class OwnStream {
 public:
    OwnStream() { MF_CHECK_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
    ~OwnStream() { cudaStreamDestroy(s_); }
    cudaStream_t get() const { return s_; }
    void* handle() const { return s_; }

 private:
    cudaStream_t s_ = nullptr;
};

std::vector<uint16_t> bits_of(const Tensor& t) {
    std::vector<uint16_t> v(static_cast<size_t>(t.nbytes() / 2));
    mf::ops::copy_to_host(v.data(), t);
    return v;
}

TEST(ExecContext, ScopesSetAndRestoreTheStream) {
    OwnStream a, b;
    void* engine = mf::ops::current_stream(Device::cuda);
    ASSERT_NE(engine, nullptr) << "the engine runs on a stream of its own, not the legacy default stream";
    EXPECT_EQ(mf::ops::current_stream(Device::cpu), nullptr);
    {
        ExecScope outer(ExecContext{.stream = a.handle()});
        EXPECT_EQ(mf::ops::current_stream(Device::cuda), a.handle());
        {
            ExecScope inner(ExecContext{.stream = b.handle()});
            EXPECT_EQ(mf::ops::current_stream(Device::cuda), b.handle());
            ExecScope engine_again(ExecContext{});
            EXPECT_EQ(mf::ops::current_stream(Device::cuda), engine);
        }
        EXPECT_EQ(mf::ops::current_stream(Device::cuda), a.handle());
    }
    EXPECT_EQ(mf::ops::current_stream(Device::cuda), engine);
    int device = -1;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    {
        ExecScope on_device(ExecContext{.device = device, .stream = a.handle()});
        EXPECT_EQ(mf::ops::current_stream(Device::cuda), a.handle());
    }
    int after = -1;
    MF_CHECK_CUDA(cudaGetDevice(&after));
    EXPECT_EQ(after, device);
}

// A long fill issued in a scope is pending on the scope's stream while the engine's stream is idle.
TEST(ExecContext, OpsGoToTheScopesStreamOnly) {
    OwnStream s;
    const int64_t n = int64_t{1} << 27;  // 256 MiB of bf16
    Buffer xb(static_cast<size_t>(n) * 2, Device::cuda), sums(sizeof(double), Device::cuda);
    Tensor x = xb.as(DType::bf16, {n});
    mf::ops::synchronize(Device::cuda);
    const auto engine = static_cast<cudaStream_t>(mf::ops::current_stream(Device::cuda));
    {
        ExecScope scope(ExecContext{.stream = s.handle()});
        for (int i = 0; i < 4; ++i) mf::ops::fill_normal(x, 7 + static_cast<uint64_t>(i), 0.0f, 1.0f);
        mf::ops::sum_squares_to(sums.as(DType::f64, {1}), 0, x);
        EXPECT_EQ(cudaStreamQuery(s.get()), cudaErrorNotReady) << "the scope's stream holds the work";
        EXPECT_EQ(cudaStreamQuery(engine), cudaSuccess) << "the engine's stream got none of it";
        mf::ops::synchronize(Device::cuda);  // the scope's stream
        EXPECT_EQ(cudaStreamQuery(s.get()), cudaSuccess);
    }
    double v = 0;
    MF_CHECK_CUDA(cudaMemcpy(&v, sums.data(), sizeof v, cudaMemcpyDeviceToHost));
    EXPECT_NEAR(v / static_cast<double>(n), 1.0, 0.01) << "Σ x² of the last fill, N(0, 1)";
}

// matmul (cuBLASLt), bias_backward (scratch) and a background Σ x² give the engine stream's bits on
// a framework's stream, with a caller workspace prefilled with garbage that the op must overwrite.
TEST(ExecContext, SameBitsOnAnyStreamWithTheCallersWorkspace) {
    const int64_t N = 300, C = 96, OC = 80;
    Buffer inp_b(N * C * 2, Device::cuda), w_b(OC * C * 2, Device::cuda);
    Tensor inp = inp_b.as(DType::bf16, {N, C}), w = w_b.as(DType::bf16, {OC, C});
    mf::ops::fill_normal(inp, 1, 0.0f, 1.0f);
    mf::ops::fill_normal(w, 2, 0.0f, 0.1f);
    struct Outputs {
        Buffer out_b, dbias_b, sums_b;
        Tensor out, dbias, sums;
        Outputs()
            : out_b(N * OC * 2, Device::cuda),
              dbias_b(OC * 4, Device::cuda),
              sums_b(8, Device::cuda),
              out(out_b.as(DType::bf16, {N, OC})),
              dbias(dbias_b.as(DType::f32, {OC})),
              sums(sums_b.as(DType::f64, {1})) {}
    };
    auto run = [&](Outputs& o) {
        mf::ops::matmul_forward(o.out, inp, w);
        mf::ops::zero(o.dbias);
        mf::ops::bias_backward(o.dbias, o.out);
        const auto ticket = mf::ops::background(Device::cuda, [&] { mf::ops::sum_squares_to(o.sums, 0, o.out); });
        mf::ops::wait_background(Device::cuda, ticket);
        mf::ops::synchronize(Device::cuda);
    };
    Outputs engine, framework;
    run(engine);

    OwnStream s;
    const size_t ws_bytes = size_t{16} << 20;
    Buffer ws(ws_bytes, Device::cuda);
    std::vector<uint8_t> garbage(ws_bytes, 0xff);
    MF_CHECK_CUDA(cudaMemcpy(ws.data(), garbage.data(), ws_bytes, cudaMemcpyHostToDevice));
    {
        ExecScope scope(ExecContext{.stream = s.handle(), .workspace = ws.data(), .workspace_bytes = ws_bytes});
        run(framework);
    }
    EXPECT_EQ(bits_of(engine.out), bits_of(framework.out));
    EXPECT_EQ(bits_of(engine.dbias), bits_of(framework.dbias));
    EXPECT_EQ(bits_of(engine.sums), bits_of(framework.sums));
    std::vector<uint8_t> after(ws_bytes);
    MF_CHECK_CUDA(cudaMemcpy(after.data(), ws.data(), ws_bytes, cudaMemcpyDeviceToHost));
    EXPECT_NE(after, garbage) << "bias_backward's scratch came from the caller's workspace";
}

}  // namespace
