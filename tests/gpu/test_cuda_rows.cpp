// GPU parity of the row-range copies (kernels/cuda/rows.cuh) against the CPU reference
// (kernels/cpu/rows.h): exact, byte for byte, since both are copies. Sweeps rows of bf16 and f32 of
// lengths that take every access width (16, 4, 2 and 1 bytes: odd lengths, a buffer offset by 2
// bytes), random pieces (empty ones, more than one launch takes), destination rows no piece names
// (which must keep their content), refused out-of-range pieces, and the ops:: entry on device
// tensors. MF_BENCH=1 adds GB/s at the EP placement shape: 131072 rows of 2048 bf16 in 64 pieces.
#include <gtest/gtest.h>

#include <numeric>

#include "kernels/cpu/rows.h"
#include "kernels/cuda/rows.cuh"
#include "ops/ops.h"
#include "test_cuda_common.h"

namespace {

using namespace mf::test;

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

struct RowsCase {
    int64_t rows, other_rows, row_bytes, byte_offset;  // byte_offset: where both buffers start
};

// Row lengths: 2048 bf16 (16-byte units), 768 bf16, 5 f32 (4-byte units), 3 bf16 (2-byte units),
// 7 bytes (1-byte units), a 16-byte multiple on buffers shifted by 2 bytes (2-byte units).
const RowsCase kCases[] = {{1000, 1000, 4096, 0}, {333, 517, 1536, 0}, {250, 100, 20, 0}, {97, 97, 6, 0},
                           {64, 80, 7, 0},        {129, 130, 64, 2},   {0, 5, 32, 0},     {5, 0, 32, 0},
                           {1, 1, 16, 0}};

std::vector<uint8_t> random_bytes(std::mt19937& rng, size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    return v;
}

std::string case_name(const char* op, const RowsCase& c, const char* kind) {
    return std::string(op) + " " + kind + " rows=" + std::to_string(c.rows) + "/" + std::to_string(c.other_rows) +
           " bytes=" + std::to_string(c.row_bytes) + (c.byte_offset != 0 ? " +2B" : "");
}

// Row-range copies (the EP exchange's placement): random disjoint destination ranges from random
// source ranges, more pieces than one launch takes, empty pieces, every access width; the rows no
// piece names keep their content. Out-of-range pieces are refused before anything is copied.
TEST(CudaRows, PiecesMatchCpuExactly) {
    std::mt19937 rng(11);
    for (const RowsCase& c : kCases) {
        if (c.rows == 0 || c.other_rows == 0) continue;
        for (const int64_t num_pieces : {int64_t{1}, int64_t{7}, mf::cuda::kMaxRowPieces + 5}) {
            // Destination: consecutive ranges over a shuffled order of row blocks; sources anywhere.
            std::vector<int64_t> pieces;
            int64_t at = 0;
            for (int64_t p = 0; p < num_pieces && at < c.rows; ++p) {
                const int64_t n = std::min<int64_t>(c.rows - at, static_cast<int64_t>(rng() % 5));  // 0..4 rows
                const int64_t n_src = std::min<int64_t>(n, c.other_rows);
                const int64_t src = static_cast<int64_t>(rng() % static_cast<uint32_t>(c.other_rows - n_src + 1));
                for (const int64_t v : {src, at, n_src}) pieces.push_back(v);
                at += n;
            }
            const auto src = random_bytes(rng, static_cast<size_t>(c.other_rows * c.row_bytes));
            auto ref = random_bytes(rng, static_cast<size_t>(c.rows * c.row_bytes));
            DeviceBuffer d_src(src.size() + 16), d_dst(ref.size() + 16);
            upload(d_src.as<uint8_t>(c.byte_offset), src);
            upload(d_dst.as<uint8_t>(c.byte_offset), ref);
            const int64_t np = static_cast<int64_t>(pieces.size() / 3);
            mf::cpu::copy_row_pieces(ref.data(), src.data(), pieces.data(), np, c.rows, c.other_rows, c.row_bytes);
            mf::cuda::copy_row_pieces(d_dst.as<uint8_t>(c.byte_offset), d_src.as<uint8_t>(c.byte_offset),
                                      pieces.data(), np, c.rows, c.other_rows, c.row_bytes, nullptr);
            device_sync();
            expect_exact(download<uint8_t>(d_dst.as<uint8_t>(c.byte_offset), ref.size()), ref,
                         case_name("pieces", c, std::to_string(np).c_str()));
        }
    }
    DeviceBuffer a(4096), b(4096);
    const int64_t outside[] = {0, 30, 4};  // rows 30..33 of a 32-row destination
    EXPECT_THROW(mf::cuda::copy_row_pieces(a.as<void>(), b.as<void>(), outside, 1, 32, 32, 16, nullptr), mf::Error);
    const int64_t negative[] = {-1, 0, 1};
    EXPECT_THROW(mf::cuda::copy_row_pieces(a.as<void>(), b.as<void>(), negative, 1, 32, 32, 16, nullptr), mf::Error);
}

// The ops:: entry on device tensors (bf16 [R, H]): pieces that reverse the row order in blocks,
// against the same op on the CPU over the same bytes (viewed as f32 rows of the same length).
TEST(CudaRows, OpsPiecesOnDevice) {
    std::mt19937 rng(9);
    const int64_t R = 301, H = 72, block = 7;
    const auto bytes = random_bytes(rng, static_cast<size_t>(R * H * 2));
    std::vector<int64_t> pieces;
    for (int64_t at = 0; at < R; at += block) {
        const int64_t n = std::min(block, R - at);
        for (const int64_t v : {at, R - at - n, n}) pieces.push_back(v);
    }
    DeviceBuffer d_src(bytes.size()), d_dst(bytes.size());
    upload(d_src.as<void>(), bytes);
    d_dst.poison();
    mf::ops::copy_row_pieces(mf::Tensor(d_dst.as<void>(), mf::DType::bf16, {R, H}, mf::Device::cuda),
                             mf::Tensor(d_src.as<void>(), mf::DType::bf16, {R, H}, mf::Device::cuda), pieces);
    device_sync();
    std::vector<uint8_t> ref(bytes.size());
    mf::ops::copy_row_pieces(mf::Tensor(ref.data(), mf::DType::f32, {R, H / 2}),
                             mf::Tensor(const_cast<uint8_t*>(bytes.data()), mf::DType::f32, {R, H / 2}), pieces);
    expect_exact(download<uint8_t>(d_dst.as<void>(), bytes.size()), ref, "ops::copy_row_pieces bf16 vs cpu");
    // Mismatched row lengths and triples that do not divide are refused.
    EXPECT_THROW(mf::ops::copy_row_pieces(mf::Tensor(ref.data(), mf::DType::f32, {R, H / 2}),
                                          mf::Tensor(const_cast<uint8_t*>(bytes.data()), mf::DType::f32, {R / 2, H}),
                                          pieces),
                 mf::Error);
    EXPECT_THROW(mf::ops::copy_row_pieces(mf::Tensor(ref.data(), mf::DType::f32, {R, H / 2}),
                                          mf::Tensor(const_cast<uint8_t*>(bytes.data()), mf::DType::f32, {R, H / 2}),
                                          std::span<const int64_t>(pieces).first(4)),
                 mf::Error);
}

TEST(CudaRows, Benchmark) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1";
    const int64_t R = 16384 * 8, H = 2048, row_bytes = H * 2, P = 64;
    DeviceBuffer src(static_cast<size_t>(R * row_bytes)), dst(static_cast<size_t>(R * row_bytes));
    src.zero();
    // 64 equal pieces, placed in reverse order.
    std::vector<int64_t> pieces;
    for (int64_t p = 0; p < P; ++p)
        for (const int64_t v : {p * (R / P), (P - 1 - p) * (R / P), R / P}) pieces.push_back(v);
    const double bytes = 2.0 * static_cast<double>(R * row_bytes);
    const double t = time_us([&] {
        mf::cuda::copy_row_pieces(dst.as<void>(), src.as<void>(), pieces.data(), P, R, R, row_bytes, nullptr);
    });
    report_bandwidth("copy_row_pieces 131072 x 2048 bf16 in 64 pieces", t, bytes);
    const double c = time_us([&] {
        MF_CHECK_CUDA(cudaMemcpyAsync(dst.as<void>(), src.as<void>(), static_cast<size_t>(R * row_bytes),
                                      cudaMemcpyDeviceToDevice, nullptr));
    });
    report_bandwidth("cudaMemcpy of the same bytes (baseline)", c, bytes);
}

}  // namespace
