// The C API (include/moeforge/moeforge.h), driven as a C caller drives it:
//   errors    a bad call returns a typed status and mf_last_error() names the op, the argument and
//             the problem (NULL, wrong dtype, wrong shape, non-contiguous strides, mixed devices, a
//             CUDA tensor in a build without CUDA: unsupported, a missing recipe file: I/O); a
//             success clears the message; nothing is written by a refused call
//   ops       on the CPU each wrapped op gives exactly what the ops:: function gives (RMSNorm, the
//             grouped GEMM with an empty and a ragged group, gpt-oss's clamped SwiGLU, the whole
//             MoE block, forward and backward through one workspace, against model:: directly)
//   engine    the tiny demo model fine-tuned for a few steps through mf_engine_*: metrics per
//             step, parameter views by HF name, and the export byte-identical to `moeforge
//             finetune` of the same recipe.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/json.h"
#include "io/safetensors.h"
#include "model/ffn_blocks.h"
#include "moeforge/moeforge.h"
#include "ops/ops.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

mf_tensor desc(void* data, mf_dtype dtype, std::vector<int64_t> shape) {
    mf_tensor t{};
    t.data = data;
    t.dtype = dtype;
    t.device_type = MF_CPU;
    t.ndim = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
    return t;
}
mf_tensor desc(std::vector<float>& v, std::vector<int64_t> shape) { return desc(v.data(), MF_F32, std::move(shape)); }
mf_tensor desc(std::vector<int32_t>& v, std::vector<int64_t> shape) { return desc(v.data(), MF_I32, std::move(shape)); }
mf::Tensor view(std::vector<float>& v, mf::Shape shape) {
    return mf::Tensor(v.data(), mf::DType::f32, std::move(shape));
}
mf::Tensor view(std::vector<int32_t>& v, mf::Shape shape) {
    return mf::Tensor(v.data(), mf::DType::i32, std::move(shape));
}

std::vector<float> random_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
}

void expect_error(mf_status got, mf_status want, const std::vector<std::string>& words) {
    EXPECT_EQ(got, want) << mf_status_name(got) << ": " << mf_last_error();
    const std::string message = mf_last_error();
    for (const std::string& w : words) EXPECT_NE(message.find(w), std::string::npos) << "'" << w << "' in: " << message;
}

TEST(CApi, VersionAndStatusNames) {
    EXPECT_EQ(mf_api_version(), MF_API_VERSION);
    EXPECT_STREQ(mf_status_name(MF_ERR_IO), "MF_ERR_IO");
    EXPECT_EQ(mf_has_cuda(), mf::cuda_available() ? 1 : 0);
}

TEST(CApi, BadArgumentsComeBackAsStatusAndMessage) {
    std::vector<float> x(12, 1.0f), w(4, 1.0f), out(12, 7.0f), rstd(3);
    mf_tensor tx = desc(x, {3, 4}), tw = desc(w, {4}), tout = desc(out, {3, 4}), tr = desc(rstd, {3});
    expect_error(mf_rmsnorm_forward(nullptr, nullptr, &tr, &tx, &tw, 1e-6f), MF_ERR_INVALID_ARGUMENT,
                 {"mf_rmsnorm_forward", "out", "NULL"});
    mf_tensor bad_shape = desc(out, {4, 3});
    expect_error(mf_rmsnorm_forward(nullptr, &bad_shape, &tr, &tx, &tw, 1e-6f), MF_ERR_INVALID_ARGUMENT,
                 {"out", "[4, 3]", "expected [3, 4]"});
    mf_tensor as_int = desc(out.data(), MF_I32, {3, 4});
    expect_error(mf_rmsnorm_forward(nullptr, &as_int, &tr, &tx, &tw, 1e-6f), MF_ERR_INVALID_ARGUMENT,
                 {"out", "i32", "expected f32"});
    const int64_t transposed[2] = {1, 3};
    mf_tensor strided = desc(x, {3, 4});
    strided.strides = transposed;
    expect_error(mf_rmsnorm_forward(nullptr, &tout, &tr, &strided, &tw, 1e-6f), MF_ERR_INVALID_ARGUMENT,
                 {"inp", "not contiguous"});
    expect_error(mf_rmsnorm_forward(nullptr, &tout, &tr, &tx, &tw, NAN), MF_ERR_INVALID_ARGUMENT, {"eps"});
    for (float v : out) EXPECT_EQ(v, 7.0f) << "a refused call writes nothing";
    mf_tensor on_gpu = tx;
    on_gpu.device_type = MF_CUDA;
    expect_error(mf_rmsnorm_forward(nullptr, &tout, &tr, &on_gpu, &tw, 1e-6f), MF_ERR_INVALID_ARGUMENT,
                 {"inp", "cuda", "cpu"});
    if (!mf::cuda_available()) {  // with a GPU these made-up device pointers would be used
        mf_tensor gpu_out = tout, gpu_r = tr, gpu_w = tw;
        for (mf_tensor* t : {&gpu_out, &gpu_r, &on_gpu, &gpu_w}) t->device_type = MF_CUDA;
        on_gpu.dtype = gpu_out.dtype = MF_BF16;
        const mf_status got = mf_rmsnorm_forward(nullptr, &gpu_out, &gpu_r, &on_gpu, &gpu_w, 1e-6f);
        if (mf_built_with_cuda() == 0)
            expect_error(got, MF_ERR_UNSUPPORTED, {"without CUDA"});
        else
            expect_error(got, MF_ERR_CUDA, {"CUDA error"});  // a CUDA build on a machine without a GPU
    }
    // The engine's own checks come back too, with the C++ message.
    std::vector<float> y(4), h(8);
    mf_tensor ty = desc(y, {1, 4}), th = desc(h, {1, 6});
    expect_error(mf_clamped_swiglu_forward(nullptr, &ty, &th, 1.702f, 7.0f), MF_ERR_INVALID_ARGUMENT,
                 {"clamped_swiglu_forward", "must be [N, 2I]"});
    mf_engine* engine = reinterpret_cast<mf_engine*>(1);
    expect_error(mf_engine_open(&engine, "/nonexistent/recipe.yaml", 0, nullptr, nullptr, 0, nullptr, 0), MF_ERR_IO,
                 {"/nonexistent/recipe.yaml"});
    EXPECT_EQ(engine, nullptr);
    expect_error(mf_engine_open(&engine, "model: m\ndata: {train: d}\nout: o\ntrain: {steps: 1}\nbogus: 1\n", 1,
                                nullptr, nullptr, 0, nullptr, 0),
                 MF_ERR_INVALID_ARGUMENT, {"bogus"});
    ASSERT_EQ(mf_rmsnorm_forward(nullptr, &tout, &tr, &tx, &tw, 1e-6f), MF_OK);
    EXPECT_STREQ(mf_last_error(), "") << "a success clears the message";
}

// The permutation's and the aux statistics' scratch sizes: 0 on the CPU, refused arguments named; on a
// GPU the kernels' figures (growing with the rows), which moeforge.jax sizes its scratch results by.
TEST(CApi, PermuteAndAuxStatsWorkspaceBytes) {
    size_t bytes = 7;
    ASSERT_EQ(mf_moe_permute_indices_workspace_bytes(4096, 8, 128, MF_CPU, &bytes), MF_OK) << mf_last_error();
    EXPECT_EQ(bytes, 0u);
    bytes = 7;
    ASSERT_EQ(mf_moe_aux_stats_workspace_bytes(4096, 128, MF_CPU, &bytes), MF_OK) << mf_last_error();
    EXPECT_EQ(bytes, 0u);
    expect_error(mf_moe_permute_indices_workspace_bytes(-1, 8, 128, MF_CPU, &bytes), MF_ERR_INVALID_ARGUMENT,
                 {"mf_moe_permute_indices_workspace_bytes", "num_rows = -1"});
    expect_error(mf_moe_permute_indices_workspace_bytes(4, 0, 128, MF_CPU, &bytes), MF_ERR_INVALID_ARGUMENT,
                 {"top_k = 0"});
    expect_error(mf_moe_aux_stats_workspace_bytes(4, 0, MF_CPU, &bytes), MF_ERR_INVALID_ARGUMENT, {"num_experts = 0"});
    expect_error(mf_moe_aux_stats_workspace_bytes(4, 8, 5, &bytes), MF_ERR_INVALID_ARGUMENT, {"device_type"});
    expect_error(mf_moe_aux_stats_workspace_bytes(4, 8, MF_CPU, nullptr), MF_ERR_INVALID_ARGUMENT, {"bytes"});
    if (!mf::cuda_available()) {
        expect_error(mf_moe_permute_indices_workspace_bytes(4, 2, 8, MF_CUDA, &bytes), MF_ERR_UNSUPPORTED, {"CUDA"});
        return;
    }
    size_t small = 0, large = 0;
    ASSERT_EQ(mf_moe_permute_indices_workspace_bytes(64, 8, 128, MF_CUDA, &small), MF_OK) << mf_last_error();
    ASSERT_EQ(mf_moe_permute_indices_workspace_bytes(65536, 8, 128, MF_CUDA, &large), MF_OK) << mf_last_error();
    EXPECT_GT(small, 0u);
    EXPECT_GT(large, small);
    ASSERT_EQ(mf_moe_aux_stats_workspace_bytes(64, 128, MF_CUDA, &small), MF_OK) << mf_last_error();
    EXPECT_GT(small, 0u);
}

TEST(CApi, LossWorkspaceBytes) {
    size_t bytes = 7;
    ASSERT_EQ(mf_lm_head_cross_entropy_workspace_bytes(8192, 151936, MF_BF16, MF_CPU, &bytes), MF_OK)
        << mf_last_error();
    EXPECT_EQ(bytes, 0u) << "the CPU loss takes no scratch";
    expect_error(mf_lm_head_cross_entropy_workspace_bytes(-1, 16, MF_F32, MF_CPU, &bytes), MF_ERR_INVALID_ARGUMENT,
                 {"num_rows", "negative"});
    expect_error(mf_lm_head_cross_entropy_workspace_bytes(4, 0, MF_F32, MF_CPU, &bytes), MF_ERR_INVALID_ARGUMENT,
                 {"vocab"});
    expect_error(mf_lm_head_cross_entropy_workspace_bytes(4, 16, MF_I32, MF_CPU, &bytes), MF_ERR_INVALID_ARGUMENT,
                 {"logits_dtype"});
    expect_error(mf_lm_head_cross_entropy_workspace_bytes(4, 16, MF_F32, 9, &bytes), MF_ERR_INVALID_ARGUMENT,
                 {"device_type"});
    expect_error(mf_lm_head_cross_entropy_workspace_bytes(4, 16, MF_F32, MF_CPU, nullptr), MF_ERR_INVALID_ARGUMENT,
                 {"bytes"});
    if (!mf::cuda_available()) {
        expect_error(mf_lm_head_cross_entropy_workspace_bytes(4, 16, MF_F32, MF_CUDA, &bytes), MF_ERR_UNSUPPORTED,
                     {"CUDA"});
        return;
    }
    // On a GPU: the loss chunks its logits; more rows never take more than the 1 GiB budget's chunk.
    size_t small = 0, large = 0;
    ASSERT_EQ(mf_lm_head_cross_entropy_workspace_bytes(16, 151936, MF_BF16, MF_CUDA, &small), MF_OK);
    ASSERT_EQ(mf_lm_head_cross_entropy_workspace_bytes(1 << 20, 151936, MF_BF16, MF_CUDA, &large), MF_OK);
    EXPECT_GE(small, 16u * 151936 * 2);
    EXPECT_GT(large, small);
    EXPECT_LE(large, (size_t{1} << 30) + (size_t{64} << 20));
}

TEST(CApi, EmbeddingEqualsTheOpsFunctionsAndRefusesIdsOutsideTheTable) {
    std::mt19937 rng(8);
    const int64_t V = 9, C = 6, N = 14;
    std::vector<float> wte = random_vec(rng, V * C), dy = random_vec(rng, N * C);
    std::vector<int32_t> ids(N);
    for (int64_t n = 0; n < N; ++n) ids[n] = static_cast<int32_t>((n * 5) % 4);  // (ids repeat)
    std::vector<float> out(N * C), ref(N * C), dwte(V * C, 0.5f), ref_dwte(V * C, 0.5f);
    mf_tensor tout = desc(out, {N, C}), tids = desc(ids, {N}), twte = desc(wte, {V, C}), tdy = desc(dy, {N, C});
    mf_tensor tdwte = desc(dwte, {V, C});
    ASSERT_EQ(mf_embedding_forward(nullptr, &tout, &tids, &twte), MF_OK) << mf_last_error();
    mf::ops::embedding_forward(view(ref, {N, C}), view(ids, {N}), view(wte, {V, C}));
    EXPECT_EQ(out, ref);
    ASSERT_EQ(mf_embedding_backward(nullptr, &tdwte, &tdy, &tids), MF_OK) << mf_last_error();
    mf::ops::embedding_backward(view(ref_dwte, {V, C}), view(dy, {N, C}), view(ids, {N}));
    EXPECT_EQ(dwte, ref_dwte);
    size_t bytes = 1;
    ASSERT_EQ(mf_embedding_backward_workspace_bytes(N, V, MF_CPU, &bytes), MF_OK) << mf_last_error();
    EXPECT_EQ(bytes, 0u);
    EXPECT_EQ(mf_embedding_backward_workspace_bytes(N, V, MF_CPU, nullptr), MF_ERR_INVALID_ARGUMENT);
    // An id outside [0, V) is refused with its position, before anything is read or written.
    ids[3] = static_cast<int32_t>(V);
    const std::vector<float> before = dwte;
    EXPECT_EQ(mf_embedding_backward(nullptr, &tdwte, &tdy, &tids), MF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(mf_last_error()).find("ids[3] = 9 is outside"), std::string::npos) << mf_last_error();
    EXPECT_EQ(dwte, before);
    ids[3] = -2;
    EXPECT_EQ(mf_embedding_forward(nullptr, &tout, &tids, &twte), MF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(mf_last_error()).find("ids[3] = -2"), std::string::npos) << mf_last_error();
    ids[3] = 0;
    // Shapes: out's rows must be the ids', the table two-dimensional.
    mf_tensor tshort = desc(out, {N - 1, C}), tflat = desc(wte, {V * C});
    EXPECT_EQ(mf_embedding_forward(nullptr, &tshort, &tids, &twte), MF_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(mf_embedding_forward(nullptr, &tout, &tids, &tflat), MF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(mf_last_error()).find("wte"), std::string::npos) << mf_last_error();
}

TEST(CApi, OpsEqualTheOpsFunctions) {
    std::mt19937 rng(5);
    // RMSNorm forward and backward.
    const int64_t N = 5, C = 12;
    std::vector<float> x = random_vec(rng, N * C), w = random_vec(rng, C), dy = random_vec(rng, N * C);
    std::vector<float> out(N * C), rstd(N), ref(N * C), ref_rstd(N);
    mf_tensor tx = desc(x, {N, C}), tw = desc(w, {C}), tout = desc(out, {N, C}), tr = desc(rstd, {N});
    ASSERT_EQ(mf_rmsnorm_forward(nullptr, &tout, &tr, &tx, &tw, 1e-5f), MF_OK) << mf_last_error();
    mf::ops::rmsnorm_forward(view(ref, {N, C}), view(ref_rstd, {N}), view(x, {N, C}), view(w, {C}), 1e-5f);
    EXPECT_EQ(out, ref);
    EXPECT_EQ(rstd, ref_rstd);
    std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), ref_dx(N * C, 0.0f), ref_dw(C, 0.0f);
    mf_tensor tdx = desc(dx, {N, C}), tdw = desc(dw, {C}), tdy = desc(dy, {N, C});
    ASSERT_EQ(mf_rmsnorm_backward(nullptr, &tdx, &tdw, &tdy, &tx, &tw, &tr, 1), MF_OK) << mf_last_error();
    mf::ops::rmsnorm_backward(view(ref_dx, {N, C}), view(ref_dw, {C}), view(dy, {N, C}), view(x, {N, C}), view(w, {C}),
                              view(ref_rstd, {N}));
    EXPECT_EQ(dx, ref_dx);
    EXPECT_EQ(dw, ref_dw);
    // accumulate_dinp 0 writes dinp (its NaNs never read); 2 is refused by name.
    std::vector<float> dx_w(N * C, std::numeric_limits<float>::quiet_NaN()), dw_w(C, 0.0f);
    mf_tensor tdx_w = desc(dx_w, {N, C}), tdw_w = desc(dw_w, {C});
    ASSERT_EQ(mf_rmsnorm_backward(nullptr, &tdx_w, &tdw_w, &tdy, &tx, &tw, &tr, 0), MF_OK) << mf_last_error();
    EXPECT_EQ(dx_w, ref_dx);
    EXPECT_EQ(dw_w, ref_dw);
    EXPECT_EQ(mf_rmsnorm_backward(nullptr, &tdx_w, &tdw_w, &tdy, &tx, &tw, &tr, 2), MF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(mf_last_error()).find("accumulate_dinp"), std::string::npos) << mf_last_error();

    // Grouped GEMM: 3 experts, the middle one empty, ragged rows; and offsets past the rows refused.
    const int64_t E = 3, M = 7, IC = 6, OC = 4;
    std::vector<float> inp = random_vec(rng, M * IC), weight = random_vec(rng, E * OC * IC);
    std::vector<int32_t> offsets = {0, 4, 4, 7};
    std::vector<float> gout(M * OC), gref(M * OC);
    mf_tensor ti = desc(inp, {M, IC}), tgw = desc(weight, {E, OC, IC}), to = desc(offsets, {E + 1});
    mf_tensor tgo = desc(gout, {M, OC});
    ASSERT_EQ(mf_grouped_gemm_forward(nullptr, &tgo, &ti, &tgw, &to), MF_OK) << mf_last_error();
    mf::ops::grouped_matmul_forward(view(gref, {M, OC}), view(inp, {M, IC}), view(weight, {E, OC, IC}),
                                    view(offsets, {E + 1}));
    EXPECT_EQ(gout, gref);
    std::vector<float> gdw(E * OC * IC, 0.0f), gdw_ref(E * OC * IC, 0.0f);
    mf_tensor tgdw = desc(gdw, {E, OC, IC});
    ASSERT_EQ(mf_grouped_gemm_weight_grad(nullptr, &tgdw, &tgo, &ti, &to, 0), MF_OK) << mf_last_error();
    const mf::Tensor tables[1] = {view(offsets, {E + 1})};
    mf::ops::grouped_matmul_backward_weight(view(gdw_ref, {E, OC, IC}), view(gref, {M, OC}), view(inp, {M, IC}), tables,
                                            {}, false);
    EXPECT_EQ(gdw, gdw_ref);
    std::vector<int32_t> too_far = {0, 4, 4, 9};
    mf_tensor tfar = desc(too_far, {E + 1});
    expect_error(mf_grouped_gemm_forward(nullptr, &tgo, &ti, &tgw, &tfar), MF_ERR_INVALID_ARGUMENT,
                 {"offsets", "within [0, 7]"});

    // The SwiGLU MLP's fused pairs: the grouped product then the activation, and the input gradient
    // then the activation's gradient (bit for bit on the CPU, which composes the two ops).
    {
        const int64_t I2 = 2 * 3;  // I = 3
        std::vector<float> gu = random_vec(rng, E * I2 * IC), hs(M * I2), as(M * 3), h_ref(M * I2), a_ref2(M * 3);
        mf_tensor tgu = desc(gu, {E, I2, IC}), ths = desc(hs, {M, I2}), tas = desc(as, {M, 3});
        ASSERT_EQ(mf_grouped_gemm_swiglu_forward(nullptr, &ths, &tas, &ti, &tgu, &to), MF_OK) << mf_last_error();
        mf::ops::grouped_matmul_forward(view(h_ref, {M, I2}), view(inp, {M, IC}), view(gu, {E, I2, IC}),
                                        view(offsets, {E + 1}));
        mf::ops::swiglu_forward(view(a_ref2, {M, 3}), view(h_ref, {M, I2}));
        EXPECT_EQ(hs, h_ref);
        EXPECT_EQ(as, a_ref2);
        std::vector<float> dn = random_vec(rng, E * IC * 3), dys = random_vec(rng, M * IC), dh(M * I2), da(M * 3),
                           da_ref(M * 3), dh_ref(M * I2);
        mf_tensor tdn = desc(dn, {E, IC, 3}), tdys = desc(dys, {M, IC}), tdh = desc(dh, {M, I2}),
                  tda = desc(da, {M, 3});
        ASSERT_EQ(mf_grouped_gemm_swiglu_backward(nullptr, &tdh, &tda, &tdys, &tdn, &ths, &to), MF_OK)
            << mf_last_error();
        mf::ops::grouped_matmul_backward(view(da_ref, {M, 3}), mf::Tensor(), view(dys, {M, IC}), view(da_ref, {M, 3}),
                                         view(dn, {E, IC, 3}), view(offsets, {E + 1}), {}, false);
        mf::ops::swiglu_backward(view(dh_ref, {M, I2}), view(da_ref, {M, 3}), view(h_ref, {M, I2}));
        EXPECT_EQ(dh, dh_ref);
        mf_tensor todd = desc(gu, {E, 5, IC});  // an odd 2I
        expect_error(mf_grouped_gemm_swiglu_forward(nullptr, &ths, &tas, &ti, &todd, &to), MF_ERR_INVALID_ARGUMENT,
                     {"mf_grouped_gemm_swiglu_forward", "[E, 2I, C]"});
        expect_error(mf_grouped_gemm_swiglu_backward(nullptr, &tdh, &tda, &tdys, &tdn, &tas, &to),
                     MF_ERR_INVALID_ARGUMENT, {"mf_grouped_gemm_swiglu_backward", "h"});
    }

    // gpt-oss's clamped SwiGLU.
    std::vector<float> h = random_vec(rng, 3 * 8, -9.0f, 9.0f), a(3 * 4), a_ref(3 * 4);
    mf_tensor th = desc(h, {3, 8}), ta = desc(a, {3, 4});
    ASSERT_EQ(mf_clamped_swiglu_forward(nullptr, &ta, &th, 1.702f, 7.0f), MF_OK) << mf_last_error();
    mf::ops::clamped_swiglu_forward(view(a_ref, {3, 4}), view(h, {3, 8}));
    EXPECT_EQ(a, a_ref);

    // Nemotron-H's squared ReLU, forward and backward.
    std::vector<float> u = random_vec(rng, 3 * 4, -2.0f, 2.0f), r(3 * 4), r_ref(3 * 4), dr(3 * 4), du(3 * 4),
                       du_ref(3 * 4);
    dr = random_vec(rng, 3 * 4, -1.0f, 1.0f);
    mf_tensor tu = desc(u, {3, 4}), t_r2 = desc(r, {3, 4}), tdr = desc(dr, {3, 4}), tdu = desc(du, {3, 4});
    ASSERT_EQ(mf_relu2_forward(nullptr, &t_r2, &tu), MF_OK) << mf_last_error();
    ASSERT_EQ(mf_relu2_backward(nullptr, &tdu, &tdr, &tu), MF_OK) << mf_last_error();
    mf::ops::relu2_forward(view(r_ref, {3, 4}), view(u, {3, 4}));
    mf::ops::relu2_backward(view(du_ref, {3, 4}), view(dr, {3, 4}), view(u, {3, 4}));
    EXPECT_EQ(r, r_ref);
    EXPECT_EQ(du, du_ref);
    for (size_t i = 0; i < u.size(); ++i) EXPECT_EQ(r[i], u[i] > 0 ? u[i] * u[i] : 0.0f) << i;
    mf_tensor t_wide = desc(h, {3, 8});
    expect_error(mf_relu2_forward(nullptr, &t_r2, &t_wide), MF_ERR_INVALID_ARGUMENT, {"mf_relu2_forward", "inp"});
}

// jax.lax.ragged_dot's group sizes: offsets by a running sum clamped to the rows (a negative size
// counting as nothing), and the rows past the last group zeroed.
TEST(CApi, GroupSizesToOffsetsAndTheRowsPastTheGroups) {
    const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> cases = {
        {{3, 0, 4}, {0, 3, 3, 7}},
        {{5, -2, 9, 1}, {0, 5, 5, 10, 10}},
        {{2147483647, 2147483647}, {0, 10, 10}},  // (sums past int32 before the clamp)
        {{}, {0}},
    };
    for (const auto& [sizes_in, want] : cases) {
        std::vector<int32_t> sizes = sizes_in, offsets(sizes.size() + 1, -7);
        mf_tensor ts = desc(sizes, {static_cast<int64_t>(sizes.size())});
        mf_tensor to = desc(offsets, {static_cast<int64_t>(offsets.size())});
        ASSERT_EQ(mf_group_offsets(nullptr, &to, &ts, 10), MF_OK) << mf_last_error();
        EXPECT_EQ(offsets, want);
    }
    {  // An empty array may carry any stride (numpy 2 gives stride 0): it has no layout to refuse.
        std::vector<int32_t> none, offsets(1, -7);
        const int64_t zero_stride[1] = {0};
        mf_tensor ts = desc(none, {0}), to = desc(offsets, {1});
        ts.strides = zero_stride;
        ASSERT_EQ(mf_group_offsets(nullptr, &to, &ts, 10), MF_OK) << mf_last_error();
        EXPECT_EQ(offsets, std::vector<int32_t>{0});
    }
    std::vector<float> x(10 * 3, 1.0f);
    std::vector<int32_t> offsets = {0, 3, 3, 7};
    mf_tensor tx = desc(x, {10, 3}), to = desc(offsets, {4});
    ASSERT_EQ(mf_zero_rows_past_groups(nullptr, &tx, &to), MF_OK) << mf_last_error();
    for (int64_t i = 0; i < 30; ++i) EXPECT_EQ(x[i], i < 21 ? 1.0f : 0.0f) << i;
    std::vector<int32_t> sizes = {1, 2, 3}, short_offsets(3);
    mf_tensor ts = desc(sizes, {3}), tshort = desc(short_offsets, {3});
    expect_error(mf_group_offsets(nullptr, &tshort, &ts, 10), MF_ERR_INVALID_ARGUMENT, {"mf_group_offsets", "offsets"});
    expect_error(mf_group_offsets(nullptr, &to, &ts, -1), MF_ERR_INVALID_ARGUMENT, {"num_rows = -1"});
    expect_error(mf_group_offsets(nullptr, &to, &ts, int64_t{1} << 31), MF_ERR_INVALID_ARGUMENT, {"num_rows"});
    mf_tensor tf = desc(x, {3});
    expect_error(mf_group_offsets(nullptr, &to, &tf, 10), MF_ERR_INVALID_ARGUMENT, {"group_sizes"});
}

// The load-balancing statistics and gradient through the C API equal mf::ops' (the engine's aux loss).
TEST(CApi, LoadBalancingStatisticsEqualTheOps) {
    std::mt19937 rng(31);
    const int64_t N = 6, E = 4, K = 2;
    std::vector<float> probs = random_vec(rng, N * E, 0.0f, 1.0f), mask = {1, 1, 0, 1, 1, 0};
    std::vector<int32_t> idx = {0, 1, 2, 3, 1, 1, 3, 0, 2, 9, 0, 2};  // (9: an expert elsewhere, counted by no one)
    std::vector<float> counts(E, 0.5f), sums(E, 0.25f), counts_ref = counts, sums_ref = sums;
    mf_tensor tc = desc(counts, {E}), ts = desc(sums, {E}), ti = desc(idx, {N, K}), tp = desc(probs, {N, E});
    mf_tensor tm = desc(mask, {N});
    ASSERT_EQ(mf_moe_aux_stats(nullptr, &tc, &ts, &ti, &tp, &tm), MF_OK) << mf_last_error();
    mf::ops::moe_aux_stats(view(counts_ref, {E}), view(sums_ref, {E}), view(idx, {N, K}), view(probs, {N, E}),
                           view(mask, {N}));
    EXPECT_EQ(counts, counts_ref);
    EXPECT_EQ(sums, sums_ref);
    EXPECT_EQ(counts[0], 0.5f + 2.0f);  // rows 0 and 3 (row 5 is padding)
    EXPECT_EQ(counts[2], 0.5f + 2.0f);  // rows 1 and 4 (row 5 is padding; the 9 beside row 4's 2 counts nowhere)
    std::vector<float> dprobs(N * E), dprobs_ref(N * E);
    mf_tensor td = desc(dprobs, {N, E});
    ASSERT_EQ(mf_moe_aux_dprobs(nullptr, &td, &tc, &tm, 0.125f), MF_OK) << mf_last_error();
    mf::ops::moe_aux_dprobs(view(dprobs_ref, {N, E}), view(counts, {E}), view(mask, {N}), 0.125f);
    EXPECT_EQ(dprobs, dprobs_ref);
    mf_tensor tshort = desc(mask.data(), MF_F32, {N - 1});
    expect_error(mf_moe_aux_stats(nullptr, &tc, &ts, &ti, &tp, &tshort), MF_ERR_INVALID_ARGUMENT,
                 {"mf_moe_aux_stats", "mask"});
}

TEST(CApi, MoeBlockThroughOneWorkspaceEqualsTheModelBlock) {
    std::mt19937 rng(6);
    mf_moe_dims dims{};
    dims.hidden = 8;
    dims.intermediate = 4;
    dims.num_experts = 4;
    dims.top_k = 2;
    dims.norm_topk_prob = 1;
    dims.activation = MF_ACT_SWIGLU;
    dims.router = MF_ROUTER_SOFTMAX;
    dims.n_group = dims.topk_group = 1;
    dims.routed_scaling_factor = 1.0f;
    dims.masked_score = -INFINITY;
    const int64_t N = 6, H = 8, I = 4, E = 4;
    std::vector<float> x = random_vec(rng, N * H), router = random_vec(rng, E * H);
    std::vector<float> gate_up = random_vec(rng, E * 2 * I * H, -0.5f, 0.5f), down = random_vec(rng, E * H * I);
    std::vector<float> dy = random_vec(rng, N * H);
    size_t bytes = 0;
    ASSERT_EQ(mf_moe_block_workspace_bytes(&dims, N, MF_CPU, &bytes), MF_OK) << mf_last_error();
    std::vector<double> workspace((bytes + 7) / 8 + 32);  // 256-byte alignment by hand below
    char* base = reinterpret_cast<char*>(workspace.data());
    char* aligned = base + (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256;
    mf_tensor tws = desc(aligned, MF_F32, {static_cast<int64_t>(bytes / 4)});
    std::vector<float> y(N * H), dx(N * H, 0.0f), drouter(E * H, 0.0f), dgu(gate_up.size(), 0.0f), ddown(down.size());
    mf_tensor tx = desc(x, {N, H}), tr = desc(router, {E, H}), tgu = desc(gate_up, {E, 2 * I, H});
    mf_tensor tdn = desc(down, {E, H, I}), ty = desc(y, {N, H}), tdy = desc(dy, {N, H}), tdx = desc(dx, {N, H});
    mf_tensor tdr = desc(drouter, {E, H}), tdgu = desc(dgu, {E, 2 * I, H}), tddn = desc(ddown, {E, H, I});
    ASSERT_EQ(mf_moe_block_forward(nullptr, &dims, &ty, &tx, &tr, &tgu, &tdn, nullptr, &tws), MF_OK) << mf_last_error();
    ASSERT_EQ(mf_moe_block_backward(nullptr, &dims, &tdx, &tdr, &tdgu, &tddn, &tdy, nullptr, &tx, &tr, &tgu, &tdn,
                                    nullptr, &tws, nullptr, 0),
              MF_OK)
        << mf_last_error();

    namespace model = mf::model;
    model::MoeDims d{H, I, E, 2, true};
    mf::Arena arena(1 << 20, mf::Device::cpu);
    model::MoeActs acts;
    acts.alloc(arena, d, N, mf::DType::f32);
    model::MoeScratch scratch;
    scratch.alloc(arena, d, N, mf::DType::f32);
    const model::MoeWeights w{view(router, {E, H}), view(gate_up, {E, 2 * I, H}), view(down, {E, H, I})};
    std::vector<float> y_ref(N * H), dx_ref(N * H, 0.0f), dr_ref(E * H, 0.0f), dgu_ref(dgu.size()),
        ddn_ref(ddown.size());
    model::moe_block_forward(view(y_ref, {N, H}), acts, view(x, {N, H}), w, d);
    const model::MoeWeights g{view(dr_ref, {E, H}), view(dgu_ref, {E, 2 * I, H}), view(ddn_ref, {E, H, I})};
    model::moe_block_backward(view(dx_ref, {N, H}), g, scratch, view(dy, {N, H}), mf::Tensor(), view(x, {N, H}), acts,
                              w, d, false);
    EXPECT_EQ(y, y_ref);
    EXPECT_EQ(dx, dx_ref);
    EXPECT_EQ(drouter, dr_ref);
    EXPECT_EQ(dgu, dgu_ref);
    EXPECT_EQ(ddown, ddn_ref);

    // The activations in their own workspace and the backward's scratch in another: the same results.
    size_t act_bytes = 0;
    ASSERT_EQ(mf_moe_block_activation_bytes(&dims, N, MF_CPU, &act_bytes), MF_OK) << mf_last_error();
    ASSERT_GT(act_bytes, 0u);
    ASSERT_LT(act_bytes, bytes);
    ASSERT_EQ(act_bytes % 256, 0u);
    std::vector<double> second((bytes + 7) / 8 + 32);
    char* base2 = reinterpret_cast<char*>(second.data());
    char* aligned2 = base2 + (256 - reinterpret_cast<uintptr_t>(base2) % 256) % 256;
    mf_tensor tacts = desc(aligned, MF_F32, {static_cast<int64_t>(act_bytes / 4)});
    mf_tensor tscratch = desc(aligned2, MF_F32, {static_cast<int64_t>((bytes - act_bytes) / 4)});
    std::fill(workspace.begin(), workspace.end(), 0.0);
    std::vector<float> y2(N * H), dx2(N * H, 0.0f), dr2(E * H, 0.0f), dgu2(gate_up.size()), ddn2(down.size());
    mf_tensor ty2 = desc(y2, {N, H}), tdx2 = desc(dx2, {N, H}), tdr2 = desc(dr2, {E, H});
    mf_tensor tdgu2 = desc(dgu2, {E, 2 * I, H}), tddn2 = desc(ddn2, {E, H, I});
    ASSERT_EQ(mf_moe_block_forward(nullptr, &dims, &ty2, &tx, &tr, &tgu, &tdn, nullptr, &tacts), MF_OK)
        << mf_last_error();
    ASSERT_EQ(mf_moe_block_backward(nullptr, &dims, &tdx2, &tdr2, &tdgu2, &tddn2, &tdy, nullptr, &tx, &tr, &tgu, &tdn,
                                    nullptr, &tacts, &tscratch, 0),
              MF_OK)
        << mf_last_error();
    EXPECT_EQ(y2, y_ref);
    EXPECT_EQ(dx2, dx_ref);
    EXPECT_EQ(dr2, dr_ref);
    EXPECT_EQ(dgu2, dgu_ref);
    EXPECT_EQ(ddn2, ddn_ref);

    // Buffers one element short are refused, naming the buffer and the size asked for.
    mf_tensor small = desc(aligned, MF_F32, {static_cast<int64_t>(act_bytes / 4) - 1});
    expect_error(mf_moe_block_forward(nullptr, &dims, &ty, &tx, &tr, &tgu, &tdn, nullptr, &small),
                 MF_ERR_INVALID_ARGUMENT, {"workspace", "mf_moe_block_activation_bytes"});
    mf_tensor partial = desc(aligned, MF_F32, {static_cast<int64_t>(bytes / 4) - 1});
    expect_error(mf_moe_block_backward(nullptr, &dims, &tdx2, &tdr2, &tdgu2, &tddn2, &tdy, nullptr, &tx, &tr, &tgu,
                                       &tdn, nullptr, &partial, nullptr, 0),
                 MF_ERR_INVALID_ARGUMENT, {"workspace", "mf_moe_block_workspace_bytes"});
    mf_tensor short_scratch = desc(aligned2, MF_F32, {static_cast<int64_t>((bytes - act_bytes) / 4) - 1});
    expect_error(mf_moe_block_backward(nullptr, &dims, &tdx2, &tdr2, &tdgu2, &tddn2, &tdy, nullptr, &tx, &tr, &tgu,
                                       &tdn, nullptr, &tacts, &short_scratch, 0),
                 MF_ERR_INVALID_ARGUMENT, {"scratch", "mf_moe_block_activation_bytes"});
}

// --- the engine ------------------------------------------------------------------------------------

class CApiEngine : public ::testing::Test {
 protected:
    static void SetUpTestSuite() {
        dir_ = mf::test::temp_dir("capi_engine");
        std::string out;
        ASSERT_EQ(
            mf::test::run_command(mf::test::moeforge_binary() + " init --arch qwen3_moe --preset tiny --seed 7 --out " +
                                      (dir_ / "base").string(),
                                  &out),
            0)
            << out;
    }
    static std::vector<std::string> overrides(const std::string& out) {
        const std::string repo = (fs::path(mf::test::fixtures_dir()) / ".." / "..").lexically_normal().string();
        return {"model=" + (dir_ / "base").string(),
                "data.train=" + repo + "/demo/data/tokens.jsonl",
                "out=" + (dir_ / out).string(),
                "train.steps=4",
                "train.seq_len=64",
                "train.micro_batch=2",
                "optim.warmup_steps=1"};
    }
    static std::string recipe() {
        const std::string repo = (fs::path(mf::test::fixtures_dir()) / ".." / "..").lexically_normal().string();
        return repo + "/demo/tiny_tokens.yaml";
    }
    static fs::path dir_;
};
fs::path CApiEngine::dir_;

TEST_F(CApiEngine, FineTunesTheTinyModelAsTheCliDoes) {
    const std::vector<std::string> list = overrides("api");
    std::vector<const char*> argv;
    for (const std::string& s : list) argv.push_back(s.c_str());
    mf_engine* engine = nullptr;
    ASSERT_EQ(mf_engine_open(&engine, recipe().c_str(), 0, nullptr, argv.data(), static_cast<int64_t>(argv.size()),
                             nullptr, 0),
              MF_OK)
        << mf_last_error();
    int64_t count = 0;
    ASSERT_EQ(mf_engine_num_params(engine, &count), MF_OK);
    ASSERT_GT(count, 0);
    char name[256];
    size_t needed = 0;
    ASSERT_EQ(mf_engine_param_name(engine, 0, name, sizeof name, &needed), MF_OK);
    EXPECT_EQ(needed, std::strlen(name) + 1);
    mf_tensor param{};
    ASSERT_EQ(mf_engine_param(engine, "model.embed_tokens.weight", 0, &param), MF_OK) << mf_last_error();
    EXPECT_EQ(param.dtype, MF_F32);
    EXPECT_EQ(param.ndim, 2);
    const float before = static_cast<const float*>(param.data)[5];
    expect_error(mf_engine_param(engine, "no.such.weight", 0, &param), MF_ERR_INVALID_ARGUMENT, {"no.such.weight"});

    std::vector<mf_step_metrics> steps;
    int64_t done = 0, total = 0;
    int32_t interrupted = -1;
    for (;;) {
        ASSERT_EQ(mf_engine_progress(engine, &done, &total, &interrupted), MF_OK);
        if (done == total) break;
        mf_step_metrics m{};
        ASSERT_EQ(mf_engine_step(engine, &m), MF_OK) << mf_last_error();
        steps.push_back(m);
    }
    EXPECT_EQ(total, 4);
    EXPECT_EQ(interrupted, 0);
    ASSERT_EQ(steps.size(), 4u);
    for (size_t i = 0; i < steps.size(); ++i) {
        EXPECT_EQ(steps[i].step, static_cast<int64_t>(i + 1));
        EXPECT_TRUE(std::isfinite(steps[i].loss) && steps[i].loss > 0);
        EXPECT_GT(steps[i].tokens, 0);
        EXPECT_GT(steps[i].grad_norm, 0);
        EXPECT_GE(steps[i].step_seconds, 0);
        EXPECT_EQ(steps[i].val_loss, -1);
    }
    EXPECT_NE(static_cast<const float*>(param.data)[5], before) << "the view is the live parameter";
    expect_error(mf_engine_step(engine, nullptr), MF_ERR_INVALID_ARGUMENT, {"no step is left"});
    char out_dir[512];
    ASSERT_EQ(mf_engine_export(engine, out_dir, sizeof out_dir), MF_OK) << mf_last_error();
    EXPECT_EQ(fs::path(out_dir), dir_ / "api");
    mf_engine_free(engine);

    // The CLI on the same recipe and overrides writes the same bytes and logs the same losses.
    std::string cmd = mf::test::moeforge_binary() + " finetune " + recipe();
    for (const std::string& s : overrides("cli")) cmd += " " + s;
    std::string log;
    ASSERT_EQ(mf::test::run_command(cmd, &log), 0) << log;
    EXPECT_EQ(mf::test::read_file(dir_ / "api" / "model.safetensors"),
              mf::test::read_file(dir_ / "cli" / "model.safetensors"));
    std::istringstream api_lines(mf::test::read_file(dir_ / "api" / "metrics.jsonl"));
    std::istringstream cli_lines(mf::test::read_file(dir_ / "cli" / "metrics.jsonl"));
    std::string a, c;
    int lines = 0;
    while (std::getline(api_lines, a) && std::getline(cli_lines, c)) {
        const mf::json::Value va = mf::json::parse(a, "api"), vc = mf::json::parse(c, "cli");
        for (const char* key : {"step", "loss", "grad_norm", "lr", "tokens"})
            EXPECT_EQ(va.find(key)->dump(), vc.find(key)->dump()) << key << " at line " << lines;
        ++lines;
    }
    EXPECT_EQ(lines, 4);
}

}  // namespace

// mf_weights_*: a model directory written by the engine's writer, listed, described and read as f32
// (bf16 converted); an unknown name, a wrong out shape, a missing directory and NULLs refused.
TEST(CApi, WeightsListDescribeAndRead) {
    namespace fs = std::filesystem;
    const fs::path dir = mf::test::temp_dir("capi_weights");
    std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -0.5f};
    std::vector<uint16_t> bf16 = {mf::f32_to_bf16(0.5f), mf::f32_to_bf16(-4.0f), mf::f32_to_bf16(1.0f)};
    mf::io::write_model_weights(
        dir,
        {{"b.weight", mf::io::StDType::F32, {2, 3}, f32.data()}, {"a.weight", mf::io::StDType::BF16, {3}, bf16.data()}},
        size_t{1} << 30);
    mf_weights* w = nullptr;
    ASSERT_EQ(mf_weights_open(&w, dir.string().c_str()), MF_OK) << mf_last_error();
    int64_t count = 0;
    ASSERT_EQ(mf_weights_count(w, &count), MF_OK);
    EXPECT_EQ(count, 2);
    char name[16];
    size_t needed = 0;
    ASSERT_EQ(mf_weights_name(w, 0, name, sizeof(name), &needed), MF_OK);
    EXPECT_STREQ(name, "a.weight");  // sorted
    EXPECT_EQ(needed, 9u);
    expect_error(mf_weights_name(w, 2, name, sizeof(name), &needed), MF_ERR_INVALID_ARGUMENT, {"index 2"});
    char dtype[8];
    int32_t ndim = 0;
    int64_t shape[MF_MAX_DIMS] = {};
    ASSERT_EQ(mf_weights_info(w, "b.weight", dtype, sizeof(dtype), &ndim, shape), MF_OK);
    EXPECT_STREQ(dtype, "F32");
    EXPECT_EQ(ndim, 2);
    EXPECT_EQ(shape[0], 2);
    EXPECT_EQ(shape[1], 3);
    std::vector<float> out(3, 9.0f);
    mf_tensor tout = desc(out, {3});
    ASSERT_EQ(mf_weights_read_f32(w, "a.weight", &tout), MF_OK) << mf_last_error();
    EXPECT_EQ(out, (std::vector<float>{0.5f, -4.0f, 1.0f}));
    expect_error(mf_weights_read_f32(w, "b.weight", &tout), MF_ERR_INVALID_ARGUMENT, {"out is [3]", "[2, 3]"});
    expect_error(mf_weights_read_f32(w, "c.weight", &tout), MF_ERR_INVALID_ARGUMENT, {"no tensor named 'c.weight'"});
    expect_error(mf_weights_info(nullptr, "a.weight", dtype, sizeof(dtype), &ndim, shape), MF_ERR_INVALID_ARGUMENT,
                 {"NULL"});
    mf_weights_free(w);
    mf_weights* missing = nullptr;
    EXPECT_NE(mf_weights_open(&missing, (dir / "nope").string().c_str()), MF_OK);
    EXPECT_NE(std::string(mf_last_error()).find("nope"), std::string::npos) << mf_last_error();
    EXPECT_EQ(missing, nullptr);
    fs::remove_all(dir);
}
