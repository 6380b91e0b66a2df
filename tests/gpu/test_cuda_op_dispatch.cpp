// The ops of ops.h on CUDA tensors against the same ops on CPU tensors (the reference kernels), fed
// the same bf16-rounded inputs: the dispatch, the argument checks and the CUDA glue of cuda_ops.cu
// (which tensor goes to which kernel argument, scratch, undefined tensors), for the ops of the newer
// model families: row bias, RoPE alone with partial rotary, the sigmoid gate. Shapes are ragged
// (odd widths, single rows, leading dimensions that flatten into rows); tolerances: the rules of
// test_cuda_common.h. The kernels' own parity sweeps are in test_cuda_ops.cpp.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdlib>
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

// One tensor's values on both devices: f32 on the CPU, bf16 (or f32) on the GPU.
struct Pair {
    Buffer host, device;
    Tensor cpu, gpu;
};

Pair both_devices(const std::vector<float>& v, const Shape& shape, DType gpu_dtype = DType::bf16) {
    Pair p{Buffer(v.size() * 4, Device::cpu), Buffer(v.size() * mf::dtype_size(gpu_dtype), Device::cuda), {}, {}};
    p.cpu = p.host.as(DType::f32, shape);
    p.gpu = p.device.as(gpu_dtype, shape);
    if (v.empty()) return p;  // no memory to fill (the tensors have no data)
    std::memcpy(p.host.data(), v.data(), v.size() * 4);
    if (gpu_dtype == DType::bf16) {
        std::vector<uint16_t> bits(v.size());
        for (size_t i = 0; i < v.size(); ++i) bits[i] = mf::f32_to_bf16(v[i]);
        mf::ops::copy_from_host(p.gpu, bits.data());
    } else {
        mf::ops::copy_from_host(p.gpu, v.data());
    }
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

// ---------------------------------------------------------------------------------------------
// bias

TEST(CudaOpDispatch, BiasOverFlattenedRows) {
    std::mt19937 rng(1);
    for (const Shape& shape : {Shape{2, 3, 7}, Shape{1, 64}, Shape{5, 1}, Shape{3, 11, 40}}) {
        const int64_t C = shape.back(), n = mf::shape_numel(shape);
        const std::string name = "bias " + mf::shape_str(shape);
        Pair out = both_devices(random_bf16(rng, static_cast<size_t>(n), -3.0f, 3.0f), shape);
        Pair bias = both_devices(random_bf16(rng, static_cast<size_t>(C)), {C});
        mf::ops::add_bias(out.cpu, bias.cpu);
        mf::ops::add_bias(out.gpu, bias.gpu);
        expect_exact(host_values(out.gpu), round_bf16(host_values(out.cpu)), name + " add_bias");

        for (const DType dtype : {DType::f32, DType::bf16}) {
            const std::vector<float> dout_values = random_bf16(rng, static_cast<size_t>(n));
            std::vector<float> db0 = random_f32(rng, static_cast<size_t>(C));
            if (dtype == DType::bf16) db0 = round_bf16(db0);
            Pair dout = both_devices(dout_values, shape), dbias = both_devices(db0, {C}, dtype);
            mf::ops::bias_backward(dbias.cpu, dout.cpu);
            mf::ops::bias_backward(dbias.gpu, dout.gpu);
            const std::vector<float> ref = host_values(dbias.cpu), gpu = host_values(dbias.gpu);
            if (dtype == DType::f32)
                expect_reduction(gpu, ref, ref, name + " bias_backward f32");
            else
                expect_reduction_bf16_out(gpu, ref, name + " bias_backward bf16");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// rope

TEST(CudaOpDispatch, RopeOutOfPlaceAndInPlace) {
    std::mt19937 rng(2);
    struct Case {
        int64_t N, Hq, Hkv, D, R;
    };
    for (const Case& s : {Case{9, 4, 2, 64, 32}, Case{1, 3, 1, 36, 36}, Case{5, 2, 0, 128, 16}, Case{7, 2, 2, 9, 6}}) {
        const std::string name = "rope N=" + std::to_string(s.N) + " H=" + std::to_string(s.Hq) + "/" +
                                 std::to_string(s.Hkv) + " D=" + std::to_string(s.D) + " R=" + std::to_string(s.R);
        const float theta = 1e4f;
        const int64_t nq = s.N * s.Hq * s.D, nk = s.N * s.Hkv * s.D;
        std::vector<int32_t> pos(static_cast<size_t>(s.N));
        for (auto& p : pos) p = static_cast<int32_t>(rng() % 4096);
        Buffer pos_host(pos.size() * 4, Device::cpu), pos_device(pos.size() * 4, Device::cuda);
        const Tensor pos_cpu = pos_host.as(DType::i32, {s.N}), pos_gpu = pos_device.as(DType::i32, {s.N});
        std::memcpy(pos_host.data(), pos.data(), pos.size() * 4);
        mf::ops::copy_from_host(pos_gpu, pos.data());

        for (const bool forward : {true, false}) {
            const std::vector<float> qv = random_bf16(rng, static_cast<size_t>(nq), -2.0f, 2.0f);
            const std::vector<float> kv = random_bf16(rng, static_cast<size_t>(nk), -2.0f, 2.0f);
            Pair q_in = both_devices(qv, {s.N, s.Hq * s.D}), k_in = both_devices(kv, {s.N, s.Hkv * s.D});
            Pair q_out = both_devices(std::vector<float>(static_cast<size_t>(nq)), {s.N, s.Hq * s.D});
            Pair k_out = both_devices(std::vector<float>(static_cast<size_t>(nk)), {s.N, s.Hkv * s.D});
            auto run = [&](const Tensor& q, const Tensor& k, const Tensor& q_raw, const Tensor& k_raw,
                           const Tensor& positions) {
                if (forward)
                    mf::ops::rope_forward(q, k, q_raw, k_raw, positions, s.Hq, s.Hkv, s.D, s.R, theta);
                else
                    mf::ops::rope_backward(q, k, q_raw, k_raw, positions, s.Hq, s.Hkv, s.D, s.R, theta);
            };
            const std::string what = name + (forward ? " forward" : " backward");
            run(q_out.cpu, k_out.cpu, q_in.cpu, k_in.cpu, pos_cpu);
            run(q_out.gpu, k_out.gpu, q_in.gpu, k_in.gpu, pos_gpu);
            const std::vector<float> q_ref = host_values(q_out.cpu), k_ref = host_values(k_out.cpu);
            expect_close_bf16(host_values(q_out.gpu), q_ref, what + " q");
            expect_close_bf16(host_values(k_out.gpu), k_ref, what + " k");
            // Out of place leaves the input alone; in place gives the same values.
            expect_exact(host_values(q_in.cpu), qv, what + " cpu input kept");
            expect_exact(host_values(q_in.gpu), qv, what + " gpu input kept");
            const std::vector<float> q_gpu = host_values(q_out.gpu), k_gpu = host_values(k_out.gpu);
            run(q_in.cpu, k_in.cpu, q_in.cpu, k_in.cpu, pos_cpu);
            run(q_in.gpu, k_in.gpu, q_in.gpu, k_in.gpu, pos_gpu);
            expect_exact(host_values(q_in.cpu), q_ref, what + " cpu in place");
            expect_exact(host_values(k_in.cpu), k_ref, what + " cpu in place k");
            expect_exact(host_values(q_in.gpu), q_gpu, what + " gpu in place");
            expect_exact(host_values(k_in.gpu), k_gpu, what + " gpu in place k");
        }
    }
}

TEST(CudaOpDispatch, RopeWithoutKeyTensors) {
    // No key heads: the key tensors may be undefined on both devices.
    std::mt19937 rng(3);
    const int64_t N = 4, H = 2, D = 32;
    const std::vector<int32_t> pos = {0, 5, 9, 100};
    Buffer pos_device(16, Device::cuda);
    const Tensor pos_gpu = pos_device.as(DType::i32, {N});
    mf::ops::copy_from_host(pos_gpu, pos.data());
    const Tensor pos_cpu(const_cast<int32_t*>(pos.data()), DType::i32, {N});
    Pair q = both_devices(random_bf16(rng, static_cast<size_t>(N * H * D)), {N, H * D});
    mf::ops::rope_forward(q.cpu, Tensor(), q.cpu, Tensor(), pos_cpu, H, 0, D, D, 1e4f);
    mf::ops::rope_forward(q.gpu, Tensor(), q.gpu, Tensor(), pos_gpu, H, 0, D, D, 1e4f);
    expect_close_bf16(host_values(q.gpu), host_values(q.cpu), "rope without keys");
}

// ---------------------------------------------------------------------------------------------
// sigmoid gate

TEST(CudaOpDispatch, SigmoidGateWithColumnLogits) {
    std::mt19937 rng(4);
    for (const Shape& shape : {Shape{6, 13}, Shape{1, 64}, Shape{33, 2048}, Shape{2, 1}}) {
        const int64_t N = shape[0], H = shape[1], n = N * H;
        const std::string name = "sigmoid gate " + mf::shape_str(shape);
        for (const Shape& gate_shape : {Shape{N}, Shape{N, 1}}) {
            const std::vector<float> value_values = random_bf16(rng, static_cast<size_t>(n), -2.0f, 2.0f);
            const std::vector<float> dy_values = random_bf16(rng, static_cast<size_t>(n));
            Pair y = both_devices(random_bf16(rng, static_cast<size_t>(n)), shape),
                 value = both_devices(value_values, shape);
            Pair g = both_devices(random_bf16(rng, static_cast<size_t>(N), -5.0f, 5.0f), gate_shape);
            mf::ops::sigmoid_gate_forward(y.cpu, value.cpu, g.cpu);
            mf::ops::sigmoid_gate_forward(y.gpu, value.gpu, g.gpu);
            const std::string what = name + " gate " + mf::shape_str(gate_shape);
            expect_close_bf16(host_values(y.gpu), host_values(y.cpu), what + " forward");

            Pair dy = both_devices(dy_values, shape),
                 dvalue = both_devices(std::vector<float>(static_cast<size_t>(n)), shape);
            Pair dg = both_devices(std::vector<float>(static_cast<size_t>(N)), gate_shape);
            mf::ops::sigmoid_gate_backward(dvalue.cpu, dg.cpu, dy.cpu, value.cpu, g.cpu);
            mf::ops::sigmoid_gate_backward(dvalue.gpu, dg.gpu, dy.gpu, value.gpu, g.gpu);
            expect_close_bf16(host_values(dvalue.gpu), host_values(dvalue.cpu), what + " dvalue");
            expect_reduction_bf16_out(host_values(dg.gpu), host_values(dg.cpu), what + " dgate_logits");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// argument checks: the same refusal on both devices, before any kernel runs

// The experts' products that the sm90 kernels serve whole read their offsets on the device (no host
// copy, no sync); a shape one of them refuses goes to cuBLAS, which needs host offsets.
TEST(CudaOpDispatch, HostOffsetsOnlyWhereCublasServes) {
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    const char* path = std::getenv("MOEFORGE_GROUPED_GEMM");
    if (prop.major != 9 || (path != nullptr && std::string(path) != "sm90"))
        GTEST_SKIP() << "the sm90 grouped GEMM path needs an sm_90 GPU and MOEFORGE_GROUPED_GEMM unset or sm90";
    for (const auto& [E, C, OC] :
         {std::array<int64_t, 3>{128, 2048, 1536}, {128, 768, 2048}, {128, 2688, 1856}, {128, 1856, 2688}})
        EXPECT_FALSE(mf::ops::grouped_matmul_uses_host_offsets(Device::cuda, E, C, OC)) << E << " " << C << " " << OC;
    EXPECT_TRUE(mf::ops::grouped_matmul_uses_host_offsets(Device::cuda, 8, 100, 64)) << "C % 64 != 0: cuBLAS";
    EXPECT_TRUE(mf::ops::grouped_matmul_uses_host_offsets(Device::cuda, 8, 64, 36)) << "OC % 8 != 0: cuBLAS";
    EXPECT_TRUE(mf::ops::grouped_matmul_uses_host_offsets(Device::cpu, 8, 64, 64)) << "the CPU checks them";
}

TEST(CudaOpDispatch, BadShapesAreRefusedOnTheGpuToo) {
    Pair x = both_devices(std::vector<float>(24), {4, 6}), b = both_devices(std::vector<float>(5), {5});
    Pair g = both_devices(std::vector<float>(3), {3});
    EXPECT_THROW(mf::ops::add_bias(x.gpu, b.gpu), mf::Error);
    EXPECT_THROW(mf::ops::bias_backward(b.gpu, x.gpu), mf::Error);
    EXPECT_THROW(mf::ops::sigmoid_gate_forward(x.gpu, x.gpu, g.gpu), mf::Error);
    Pair b6 = both_devices(std::vector<float>(6), {6});
    EXPECT_THROW(mf::ops::add_bias(x.gpu, b6.cpu), mf::Error) << "mixed devices";
    Pair pos = both_devices(std::vector<float>(4), {4}, DType::f32);
    EXPECT_THROW(mf::ops::rope_forward(x.gpu, Tensor(), x.gpu, Tensor(), pos.gpu, 1, 0, 5, 4, 1e4f), mf::Error)
        << "q holds 24 values, not N·H·D = 20";
}

}  // namespace
