// GPU parity of the row gather / scatter (kernels/cuda/rows.cuh) against the CPU reference
// (kernels/cpu/rows.h): exact, byte for byte, since both are permutations. Sweeps rows of bf16 and
// f32 of lengths that take every access width (16, 4, 2 and 1 bytes: odd lengths, a buffer offset
// by 2 bytes), random permutations, gathers with repeats, out-of-range indices (zero rows /
// skipped), scatters that leave rows untouched, zero rows, and the ops:: entries on device tensors.
// Outputs start poisoned (gather) or random (scatter, whose untouched rows must survive). The
// row-range copies (copy_row_pieces) are held to the same exactness.
// MF_BENCH=1 adds GB/s at the EP reorder shape: 131072 rows (16384 tokens · top-8) of 2048 bf16.
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

// `n` indices into [0, bound): a prefix of a random permutation (distinct) when `distinct`, else
// uniform draws (repeats); every 7th replaced by an out-of-range value (-1 or bound) when `bad`.
std::vector<int32_t> make_index(std::mt19937& rng, int64_t n, int64_t bound, bool distinct, bool bad) {
    std::vector<int32_t> idx(static_cast<size_t>(n));
    if (distinct) {
        std::vector<int32_t> perm(static_cast<size_t>(bound));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int64_t i = 0; i < n; ++i) idx[static_cast<size_t>(i)] = perm[static_cast<size_t>(i)];
    } else {
        for (auto& v : idx) v = bound > 0 ? static_cast<int32_t>(rng() % static_cast<uint32_t>(bound)) : -1;
    }
    if (bad)
        for (size_t i = 0; i < idx.size(); i += 7) idx[i] = (i / 7) % 2 == 0 ? -1 : static_cast<int32_t>(bound);
    return idx;
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

TEST(CudaRows, GatherMatchesCpuExactly) {
    std::mt19937 rng(7);
    for (const RowsCase& c : kCases) {
        for (const bool distinct : {true, false}) {
            for (const bool bad : {false, true}) {
                if (distinct && c.rows > c.other_rows) continue;  // a permutation prefix needs rows <= bound
                const auto src = random_bytes(rng, static_cast<size_t>(c.other_rows * c.row_bytes));
                const auto idx = make_index(rng, c.rows, c.other_rows, distinct, bad);
                std::vector<uint8_t> ref(static_cast<size_t>(c.rows * c.row_bytes), 0xAB);
                mf::cpu::gather_rows(ref.data(), src.data(), idx.data(), c.rows, c.other_rows, c.row_bytes);
                DeviceBuffer d_src(src.size() + 16), d_dst(ref.size() + 16), d_idx(idx.size() * 4);
                d_dst.poison();
                upload(d_src.as<uint8_t>(c.byte_offset), src);
                upload(d_idx.as<void>(), idx);
                mf::cuda::gather_rows(d_dst.as<uint8_t>(c.byte_offset), d_src.as<uint8_t>(c.byte_offset),
                                      d_idx.as<int32_t>(), c.rows, c.other_rows, c.row_bytes, nullptr);
                device_sync();
                const char* kind = distinct ? (bad ? "perm+bad" : "perm") : (bad ? "rep+bad" : "rep");
                expect_exact(download<uint8_t>(d_dst.as<uint8_t>(c.byte_offset), ref.size()), ref,
                             case_name("gather", c, kind));
            }
        }
    }
}

TEST(CudaRows, ScatterMatchesCpuExactly) {
    std::mt19937 rng(8);
    for (const RowsCase& c : kCases) {
        for (const bool bad : {false, true}) {
            // Scatter: c.rows source rows into c.other_rows destination rows, distinct targets.
            if (c.rows > c.other_rows) continue;
            const auto src = random_bytes(rng, static_cast<size_t>(c.rows * c.row_bytes));
            const auto idx = make_index(rng, c.rows, c.other_rows, true, bad);
            auto ref = random_bytes(rng, static_cast<size_t>(c.other_rows * c.row_bytes));  // untouched rows stay
            DeviceBuffer d_src(src.size() + 16), d_dst(ref.size() + 16), d_idx(idx.size() * 4);
            upload(d_dst.as<uint8_t>(c.byte_offset), ref);
            upload(d_src.as<uint8_t>(c.byte_offset), src);
            upload(d_idx.as<void>(), idx);
            mf::cpu::scatter_rows(ref.data(), src.data(), idx.data(), c.rows, c.other_rows, c.row_bytes);
            mf::cuda::scatter_rows(d_dst.as<uint8_t>(c.byte_offset), d_src.as<uint8_t>(c.byte_offset),
                                   d_idx.as<int32_t>(), c.rows, c.other_rows, c.row_bytes, nullptr);
            device_sync();
            expect_exact(download<uint8_t>(d_dst.as<uint8_t>(c.byte_offset), ref.size()), ref,
                         case_name("scatter", c, bad ? "perm+bad" : "perm"));
        }
    }
}

// The ops:: entries on device tensors (bf16 [R, H] rows): gather then scatter by the same
// permutation is the identity, and the gather equals the CPU op on the same bytes.
TEST(CudaRows, OpsRoundTripOnDevice) {
    std::mt19937 rng(9);
    const int64_t R = 301, H = 72;
    const auto bytes = random_bytes(rng, static_cast<size_t>(R * H * 2));
    const auto idx = make_index(rng, R, R, true, false);
    DeviceBuffer d_src(bytes.size()), d_mid(bytes.size()), d_back(bytes.size()), d_idx(idx.size() * 4);
    upload(d_src.as<void>(), bytes);
    upload(d_idx.as<void>(), idx);
    d_mid.poison();
    d_back.poison();
    const mf::Tensor src(d_src.as<void>(), mf::DType::bf16, {R, H}, mf::Device::cuda);
    const mf::Tensor mid(d_mid.as<void>(), mf::DType::bf16, {R, H}, mf::Device::cuda);
    const mf::Tensor back(d_back.as<void>(), mf::DType::bf16, {R, H}, mf::Device::cuda);
    const mf::Tensor index(d_idx.as<void>(), mf::DType::i32, {R}, mf::Device::cuda);
    mf::ops::gather_rows(mid, src, index);
    mf::ops::scatter_rows(back, mid, index);
    device_sync();
    // The CPU op on f32 rows of the same byte length (H / 2 floats) as the reference.
    std::vector<uint8_t> ref(bytes.size());
    std::vector<int32_t> idx_copy = idx;
    mf::ops::gather_rows(mf::Tensor(ref.data(), mf::DType::f32, {R, H / 2}),
                         mf::Tensor(const_cast<uint8_t*>(bytes.data()), mf::DType::f32, {R, H / 2}),
                         mf::Tensor(idx_copy.data(), mf::DType::i32, {R}));
    expect_exact(download<uint8_t>(d_mid.as<void>(), bytes.size()), ref, "ops::gather_rows bf16 vs cpu");
    expect_exact(download<uint8_t>(d_back.as<void>(), bytes.size()), bytes, "ops::scatter_rows ∘ gather_rows = id");
}

TEST(CudaRows, Benchmark) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1";
    std::mt19937 rng(10);
    const int64_t R = 16384 * 8, H = 2048, row_bytes = H * 2;
    DeviceBuffer src(static_cast<size_t>(R * row_bytes)), dst(static_cast<size_t>(R * row_bytes));
    src.zero();
    std::vector<int32_t> perm(static_cast<size_t>(R));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const DeviceBuffer idx = device_copy(perm);
    const double bytes = 2.0 * static_cast<double>(R * row_bytes);
    const double g = time_us([&] {
        mf::cuda::gather_rows(dst.as<void>(), src.as<void>(), idx.as<int32_t>(), R, R, row_bytes, nullptr);
    });
    report_bandwidth("gather_rows 131072 x 2048 bf16 (random perm)", g, bytes);
    const double s = time_us([&] {
        mf::cuda::scatter_rows(dst.as<void>(), src.as<void>(), idx.as<int32_t>(), R, R, row_bytes, nullptr);
    });
    report_bandwidth("scatter_rows 131072 x 2048 bf16 (random perm)", s, bytes);
    const double c = time_us([&] {
        MF_CHECK_CUDA(cudaMemcpyAsync(dst.as<void>(), src.as<void>(), static_cast<size_t>(R * row_bytes),
                                      cudaMemcpyDeviceToDevice, nullptr));
    });
    report_bandwidth("cudaMemcpy of the same bytes (baseline)", c, bytes);
}

}  // namespace
