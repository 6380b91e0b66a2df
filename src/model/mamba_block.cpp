#include "model/mamba_block.h"

#include "core/check.h"

namespace mf::model {

void declare_mamba_params(ParamTable& table, const std::string& p, const MambaBranch& m, int64_t H) {
    const int64_t I = m.inner(), C = m.conv_dim(), Hm = m.num_heads;
    table.add(p + "in_proj.weight", {I + C + Hm, H}, ParamRole::weight);
    table.add(p + "conv1d.weight", {C, 1, m.conv_kernel}, ParamRole::weight);
    if (m.conv_bias) table.add(p + "conv1d.bias", {C}, ParamRole::bias);
    table.add(p + "dt_bias", {Hm}, ParamRole::weight, {}, {}, ParamInit::dt_bias);
    table.add(p + "A_log", {Hm}, ParamRole::weight, {}, {}, ParamInit::a_log);
    table.add(p + "D", {Hm}, ParamRole::weight, {}, {}, ParamInit::ones);
    table.add(p + "norm.weight", {I}, ParamRole::norm);
    table.add(p + "out_proj.weight", {H, I}, ParamRole::weight);
}

MambaWeights mamba_weights(const ParamLookup& at, const std::string& p, const MambaBranch& m, int64_t H) {
    const int64_t I = m.inner(), C = m.conv_dim(), Hm = m.num_heads;
    const Tensor in = at(p + "in_proj.weight");
    const size_t row = static_cast<size_t>(H) * dtype_size(in.dtype());
    char* base = static_cast<char*>(in.data());
    MambaWeights w;
    w.in_z = Tensor(base, in.dtype(), {I, H}, in.device());
    w.in_xbc = Tensor(base + static_cast<size_t>(I) * row, in.dtype(), {C, H}, in.device());
    w.in_dt = Tensor(base + static_cast<size_t>(I + C) * row, in.dtype(), {Hm, H}, in.device());
    w.conv_w = at(p + "conv1d.weight");
    if (m.conv_bias) w.conv_b = at(p + "conv1d.bias");
    w.dt_bias = at(p + "dt_bias");
    w.A_log = at(p + "A_log");
    w.D = at(p + "D");
    w.norm = at(p + "norm.weight");
    w.out = at(p + "out_proj.weight");
    return w;
}

ops::SsdDims ssd_dims(const MambaBranch& m, int64_t T) {
    ops::SsdDims d;
    d.T = T;
    d.num_heads = m.num_heads;
    d.head_dim = m.head_dim;
    d.num_groups = m.num_groups;
    d.state_size = m.state_size;
    d.chunk_size = m.chunk_size;
    d.dt_min = static_cast<float>(m.dt_min);
    d.dt_max = static_cast<float>(m.dt_max);
    return d;
}

void MambaActs::alloc(Arena& arena, const MambaBranch& m, int64_t B, int64_t T, DType act) {
    const int64_t N = B * T, I = m.inner(), C = m.conv_dim();
    z = arena.alloc(act, {N, I});
    xbc_raw = arena.alloc(act, {N, C});
    xbc = arena.alloc(act, {N, C});
    dt = arena.alloc(act, {N, m.num_heads});
    y = arena.alloc(act, {N, I});
    normed = arena.alloc(act, {N, I});
    rstd = arena.alloc(DType::f32, {N * m.num_groups});
    states = arena.alloc(DType::f32, {ops::ssd_chunk_states_numel(N, ssd_dims(m, T))});
}

void MambaScratch::alloc(Arena& arena, const MambaBranch& m, int64_t N, DType act) {
    const int64_t I = m.inner(), C = m.conv_dim();
    d_normed = arena.alloc(act, {N, I});
    dy = arena.alloc(act, {N, I});
    dz = arena.alloc(act, {N, I});
    dxbc = arena.alloc(act, {N, C});
    dxbc_raw = arena.alloc(act, {N, C});
    ddt = arena.alloc(act, {N, m.num_heads});
}

void mamba_block_forward(const Tensor& out, MambaActs& a, const Tensor& x, const MambaWeights& w, const MambaBranch& m,
                         int64_t T, const Tensor& doc_ids) {
    ops::matmul_forward(a.z, x, w.in_z);
    ops::matmul_forward(a.xbc_raw, x, w.in_xbc);
    ops::matmul_forward(a.dt, x, w.in_dt);
    ops::conv1d_silu_forward(a.xbc, a.xbc_raw, w.conv_w, w.conv_b, doc_ids, T);
    ops::ssd_scan_forward(a.y, a.states, a.xbc, a.dt, w.dt_bias, w.A_log, w.D, doc_ids, ssd_dims(m, T));
    ops::gated_rmsnorm_forward(a.normed, a.rstd, a.y, a.z, w.norm, m.inner() / m.num_groups,
                               static_cast<float>(m.norm_eps));
    ops::matmul_forward(out, a.normed, w.out);
}

void mamba_block_backward(const Tensor& dx, const MambaWeights& g, MambaScratch& s, const Tensor& dout, const Tensor& x,
                          const MambaActs& a, const MambaWeights& w, const MambaBranch& m, int64_t T,
                          const Tensor& doc_ids) {
    // Every scratch gradient below is written, not added to.
    ops::matmul_backward(s.d_normed, g.out, dout, a.normed, w.out, false);
    ops::gated_rmsnorm_backward(s.dy, s.dz, g.norm, s.d_normed, a.y, a.z, w.norm, a.rstd, m.inner() / m.num_groups);
    ops::ssd_scan_backward(s.dxbc, s.ddt, g.dt_bias, g.A_log, g.D, s.dy, a.xbc, a.dt, w.dt_bias, w.A_log, w.D, a.states,
                           doc_ids, ssd_dims(m, T));
    ops::conv1d_silu_backward(s.dxbc_raw, g.conv_w, g.conv_b, s.dxbc, a.xbc_raw, w.conv_w, w.conv_b, doc_ids, T);
    ops::matmul_backward(dx, g.in_z, s.dz, x, w.in_z);
    ops::matmul_backward(dx, g.in_xbc, s.dxbc_raw, x, w.in_xbc);
    ops::matmul_backward(dx, g.in_dt, s.ddt, x, w.in_dt);
}

}  // namespace mf::model
