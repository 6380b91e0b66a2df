// ops.h: argument checks and dispatch. CPU tensors run the reference kernels in kernels/cpu
// (f32 activations and parameters); CUDA tensors go to the op's entry of the cuda_ops() table
// (cuda_ops.h: bf16 activations), which a build without CUDA leaves empty.
#include "ops/ops.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/bias.h"
#include "kernels/cpu/clamped_swiglu.h"
#include "kernels/cpu/conv1d.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/ep_tokens.h"
#include "kernels/cpu/gated_rmsnorm.h"
#include "kernels/cpu/grouped_matmul.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/moe_permute.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/relu2.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/router_sigmoid.h"
#include "kernels/cpu/sigmoid_gate.h"
#include "kernels/cpu/ssd_scan.h"
#include "kernels/cpu/swiglu.h"
#include "ops/cuda_ops.h"

namespace mf::ops {

namespace {

// Calls an op's CUDA body (its entry of cuda_ops.h's table); a build without CUDA has none and refuses.
template <typename Fn, typename... Args>
decltype(auto) cuda_call(Fn CudaOps::*entry, Args&&... args) {
    const Fn body = cuda_ops().*entry;
    if (body == nullptr)
        fail("this moeforge was built without CUDA (MOEFORGE_CUDA=OFF): device tensors are not supported");
    return body(std::forward<Args>(args)...);
}

// All defined tensors on one device; returns it.
Device device_of(std::initializer_list<const Tensor*> ts) {
    Device d = Device::cpu;
    bool first = true;
    for (const Tensor* t : ts) {
        if (t == nullptr || t->data() == nullptr) continue;
        if (first) {
            d = t->device();
            first = false;
        }
        MF_CHECK(t->device() == d, "op mixes cpu and cuda tensors");
    }
    return d;
}

bool defined(const Tensor& t) { return t.data() != nullptr; }
float* f(const Tensor& t) { return defined(t) ? t.ptr<float>() : nullptr; }
const int32_t* i32(const Tensor& t) { return defined(t) ? t.ptr<int32_t>() : nullptr; }
int64_t rows(const Tensor& t) { return t.ndim() == 0 ? 1 : t.numel() / t.dim(-1); }

struct Profile {
    bool enabled = false;
    std::map<std::string, std::pair<double, int64_t>> totals;
};
Profile& profile() {
    static Profile p;
    return p;
}

// Times one op when profiling is on (device synchronised on both sides).
class OpScope {
 public:
    explicit OpScope(const char* name) : name_(name) {
        if (!profile().enabled) return;
        if (cuda_available()) cuda_call(&CudaOps::synchronize, Device::cuda);
        t0_ = std::chrono::steady_clock::now();
    }
    ~OpScope() {
        if (!profile().enabled) return;
        if (cuda_available()) cuda_call(&CudaOps::synchronize, Device::cuda);
        auto& e = profile().totals[name_];
        e.first += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
        e.second += 1;
    }

 private:
    const char* name_;
    std::chrono::steady_clock::time_point t0_;
};

}  // namespace

void set_profiling(bool enabled) { profile().enabled = enabled; }
void reset_profile() { profile().totals.clear(); }
std::vector<OpTime> profile_report() {
    std::vector<OpTime> out;
    for (const auto& [name, v] : profile().totals) out.push_back({name, v.first, v.second});
    std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
    return out;
}

BackgroundTicket background(Device device, const std::function<void()>& f) {
    static const bool enabled = [] {
        const char* env = std::getenv("MOEFORGE_BACKGROUND");
        return env == nullptr || std::string_view(env) != "0";
    }();
    if (device != Device::cuda || !enabled) {
        f();
        return 0;
    }
    cuda_call(&CudaOps::background_begin);
    struct Leave {
        bool ended = false;
        ~Leave() {
            if (!ended) cuda_call(&CudaOps::background_abandon);
        }
    } leave;
    f();
    leave.ended = true;
    return cuda_call(&CudaOps::background_end);
}

ExecScope::ExecScope(const ExecContext& context) {
    const bool engine_default = context.stream == nullptr && context.device < 0 && context.workspace == nullptr;
    if (engine_default && !cuda_available()) return;  // the CPU's context: nothing to switch
    cuda_call(&CudaOps::exec_enter, context, saved_);
    saved_.entered = true;
}

ExecScope::~ExecScope() {
    if (saved_.entered) cuda_ops().exec_leave(saved_);
}

void* current_stream(Device device) {
    if (device != Device::cuda || cuda_ops().current_stream == nullptr) return nullptr;
    return cuda_ops().current_stream();
}

void wait_background(Device device, BackgroundTicket ticket) {
    if (device == Device::cuda && ticket > 0) cuda_call(&CudaOps::wait_background, device, ticket);
}

namespace {
struct PhaseClock {
    bool on = false;
    Device device = Device::cpu;
    std::chrono::steady_clock::time_point t0;
    std::vector<std::pair<std::string, double>> span;  // (name, host ms) of this span's marks; [0] = start
    std::vector<std::string> order;
    std::map<std::string, std::array<double, 3>> totals;  // gpu ms, host ms, count
};
PhaseClock& phase_clock() {
    static PhaseClock c;
    return c;
}
double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

void phase_start(Device device) {
    auto& c = phase_clock();
    synchronize(device);
    c.on = true;
    c.device = device;
    c.span.clear();
    c.t0 = std::chrono::steady_clock::now();
    phase_mark("start");
}

bool phase_clock_on() { return phase_clock().on; }

void phase_mark(std::string_view name) {
    auto& c = phase_clock();
    if (!c.on) return;
    if (c.device == Device::cuda) cuda_call(&CudaOps::record_mark, static_cast<int>(c.span.size()));
    c.span.emplace_back(std::string(name), ms_since(c.t0));
}

void phase_stop() {
    auto& c = phase_clock();
    if (!c.on) return;
    c.on = false;
    const int n = static_cast<int>(c.span.size());
    std::vector<double> gpu(static_cast<size_t>(n));
    if (c.device == Device::cuda)
        gpu = cuda_call(&CudaOps::mark_times_ms, n);
    else
        for (int i = 0; i < n; ++i) gpu[static_cast<size_t>(i)] = c.span[static_cast<size_t>(i)].second;
    std::map<std::string, int> seen;  // a name marked again in the span becomes "name #2", ...
    for (int i = 1; i < n; ++i) {
        std::string name = c.span[static_cast<size_t>(i)].first;
        if (const int k = ++seen[name]; k > 1) name += " #" + std::to_string(k);
        auto [it, fresh] = c.totals.try_emplace(name, std::array<double, 3>{0, 0, 0});
        if (fresh) c.order.push_back(name);
        it->second[0] += gpu[static_cast<size_t>(i)];
        it->second[1] += c.span[static_cast<size_t>(i)].second;
        it->second[2] += 1;
    }
}

std::vector<PhaseTime> phase_report() {
    const auto& c = phase_clock();
    std::vector<PhaseTime> out;
    for (const auto& name : c.order) {
        const auto& t = c.totals.at(name);
        out.push_back({name, t[0] / t[2], t[1] / t[2], static_cast<int64_t>(t[2])});
    }
    return out;
}

// --- memory ----------------------------------------------------------------------------------------

void zero(const Tensor& t) {
    OpScope scope_("zero");
    if (!defined(t)) return;
    if (t.device() == Device::cuda) return cuda_call(&CudaOps::zero, t);
    std::memset(t.data(), 0, t.nbytes());
}

void copy(const Tensor& dst, const Tensor& src) {
    OpScope scope_("copy");
    MF_CHECK(dst.nbytes() == src.nbytes() && dst.dtype() == src.dtype(), "copy between different tensors");
    if (device_of({&dst, &src}) == Device::cuda) return cuda_call(&CudaOps::copy, dst, src);
    std::memmove(dst.data(), src.data(), dst.nbytes());
}

void copy_from_host(const Tensor& dst, const void* src) {
    if (dst.device() == Device::cuda) return cuda_call(&CudaOps::copy_from_host, dst, src);
    std::memcpy(dst.data(), src, dst.nbytes());
}

void copy_to_host(void* dst, const Tensor& src) {
    if (src.device() == Device::cuda) return cuda_call(&CudaOps::copy_to_host, dst, src);
    std::memcpy(dst, src.data(), src.nbytes());
}

void fill_normal(const Tensor& x, uint64_t seed, float mean, float std) {
    if (x.device() == Device::cuda) return cuda_call(&CudaOps::fill_normal, x, seed, mean, std);
    // The same counter-based draws as the CUDA kernel.
    float* p = f(x);
    for (int64_t i = 0; i < x.numel(); ++i) {
        uint64_t h = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i);
        h ^= h >> 30;
        h *= 0xbf58476d1ce4e5b9ull;
        h ^= h >> 27;
        h *= 0x94d049bb133111ebull;
        h ^= h >> 31;
        const float u1 = (static_cast<float>(h >> 40) + 1.0f) / 16777217.0f;
        const float u2 = static_cast<float>((h >> 16) & 0xFFFFFF) / 16777216.0f;
        p[i] = mean + std * std::sqrt(-2.0f * std::log(u1)) * std::cos(6.283185307179586f * u2);
    }
}

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
    OpScope scope_("add");
    MF_CHECK(out.numel() == a.numel() && a.numel() == b.numel(), "add of different sizes");
    if (device_of({&out, &a, &b}) == Device::cuda) return cuda_call(&CudaOps::add, out, a, b);
    float* o = f(out);
    const float *x = f(a), *y = f(b);
    for (int64_t i = 0; i < out.numel(); ++i) o[i] = x[i] + y[i];
}

void cast(const Tensor& dst, const Tensor& src) {
    MF_CHECK(dst.numel() == src.numel(), "cast of different sizes");
    if (device_of({&dst, &src}) == Device::cuda) return cuda_call(&CudaOps::cast, dst, src);
    if (dst.dtype() == src.dtype()) return copy(dst, src);
    MF_CHECK(false, "CPU tensors are f32 only");
}

void synchronize(Device device) {
    if (device == Device::cuda) cuda_call(&CudaOps::synchronize, device);
}

// --- dense -----------------------------------------------------------------------------------------

void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight) {
    OpScope scope_("matmul_forward");
    const int64_t N = rows(inp), C = inp.dim(-1), OC = weight.dim(0);
    MF_CHECK(weight.numel() == OC * C && out.numel() == N * OC, "matmul shapes: inp ", shape_str(inp.shape()),
             " weight ", shape_str(weight.shape()), " out ", shape_str(out.shape()));
    if (device_of({&out, &inp, &weight}) == Device::cuda) return cuda_call(&CudaOps::matmul_forward, out, inp, weight);
    cpu::matmul_forward(f(out), f(inp), f(weight), N, C, OC);
}

void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight, bool accumulate_dinp) {
    OpScope scope_("matmul_backward");
    const int64_t N = rows(inp), C = inp.dim(-1), OC = weight.dim(0);
    MF_CHECK(dout.numel() == N * OC, "matmul backward shapes");
    if (device_of({&dinp, &dweight, &dout, &inp, &weight}) == Device::cuda)
        return cuda_call(&CudaOps::matmul_backward, dinp, dweight, dout, inp, weight, accumulate_dinp);
    if (!accumulate_dinp) zero(dinp);
    cpu::matmul_backward(f(dinp), f(dweight), f(dout), f(inp), f(weight), N, C, OC);
}

void add_bias(const Tensor& out, const Tensor& bias) {
    OpScope scope_("add_bias");
    const int64_t C = bias.numel();
    MF_CHECK(C >= 1 && out.ndim() >= 1 && out.dim(-1) == C, "add_bias: out ", shape_str(out.shape()),
             " does not have rows of the bias's ", C, " >= 1 elements");
    if (device_of({&out, &bias}) == Device::cuda) return cuda_call(&CudaOps::add_bias, out, bias);
    cpu::add_bias(f(out), f(bias), rows(out), C);
}

void bias_backward(const Tensor& dbias, const Tensor& dout) {
    OpScope scope_("bias_backward");
    const int64_t C = dbias.numel();
    MF_CHECK(C >= 1 && dout.ndim() >= 1 && dout.dim(-1) == C, "bias_backward: dout ", shape_str(dout.shape()),
             " does not have rows of the bias's ", C, " >= 1 elements");
    if (device_of({&dbias, &dout}) == Device::cuda) return cuda_call(&CudaOps::bias_backward, dbias, dout);
    cpu::bias_backward(f(dbias), f(dout), rows(dout), C);
}

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte) {
    OpScope scope_("embedding_forward");
    MF_CHECK(out.numel() == ids.numel() * wte.dim(-1), "embedding shapes");
    if (device_of({&out, &ids, &wte}) == Device::cuda) return cuda_call(&CudaOps::embedding_forward, out, ids, wte);
    cpu::embedding_forward(f(out), i32(ids), f(wte), ids.numel(), wte.dim(-1));
}

void embedding_backward(const Tensor& dwte, const Tensor& dout, const Tensor& ids) {
    OpScope scope_("embedding_backward");
    if (device_of({&dwte, &dout, &ids}) == Device::cuda)
        return cuda_call(&CudaOps::embedding_backward, dwte, dout, ids);
    cpu::embedding_backward(f(dwte), f(dout), i32(ids), ids.numel(), dwte.dim(-1));
}

size_t embedding_backward_scratch_bytes(int64_t N, int64_t V, Device device) {
    MF_CHECK(N >= 0 && V >= 1, "embedding_backward_scratch_bytes: N = ", N, ", V = ", V);
    if (device == Device::cpu) return 0;
    return cuda_call(&CudaOps::embedding_backward_scratch_bytes, N, V, device);
}

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps) {
    OpScope scope_("rmsnorm_forward");
    const int64_t C = weight.numel(), N = inp.numel() / C;
    MF_CHECK(out.numel() == inp.numel() && rstd.numel() == N, "rmsnorm shapes");
    if (device_of({&out, &rstd, &inp, &weight}) == Device::cuda)
        return cuda_call(&CudaOps::rmsnorm_forward, out, rstd, inp, weight, eps);
    cpu::rmsnorm_forward(f(out), f(rstd), f(inp), f(weight), N, C, eps);
}

void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, bool accumulate_dinp) {
    OpScope scope_("rmsnorm_backward");
    const int64_t C = weight.numel(), N = inp.numel() / C;
    if (device_of({&dinp, &dweight, &dout, &inp, &weight, &rstd}) == Device::cuda)
        return cuda_call(&CudaOps::rmsnorm_backward, dinp, dweight, dout, inp, weight, rstd, accumulate_dinp);
    if (!accumulate_dinp) zero(dinp);  // (the reference adds into it)
    cpu::rmsnorm_backward(f(dinp), f(dweight), f(dout), f(inp), f(weight), f(rstd), N, C);
}

void qknorm_rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                         const Tensor& q_raw, const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                         const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, float eps, float theta) {
    OpScope scope_("qknorm_rope_forward");
    const int64_t D = q_weight.numel(), N = positions.numel();
    MF_CHECK(q_raw.numel() == N * num_heads * D && k_raw.numel() == N * num_kv_heads * D &&
                 q.numel() == q_raw.numel() && k.numel() == k_raw.numel() && q_rstd.numel() == N * num_heads &&
                 k_rstd.numel() == N * num_kv_heads,
             "qk-norm/rope shapes");
    if (device_of({&q, &k, &q_rstd, &k_rstd, &q_raw, &k_raw, &q_weight, &k_weight, &positions}) == Device::cuda)
        return cuda_call(&CudaOps::qknorm_rope_forward, q, k, q_rstd, k_rstd, q_raw, k_raw, q_weight, k_weight,
                         positions, num_heads, num_kv_heads, eps, theta);
    cpu::rmsnorm_forward(f(q), f(q_rstd), f(q_raw), f(q_weight), N * num_heads, D, eps);
    cpu::rope_forward(f(q), i32(positions), N, num_heads, D, theta);
    cpu::rmsnorm_forward(f(k), f(k_rstd), f(k_raw), f(k_weight), N * num_kv_heads, D, eps);
    cpu::rope_forward(f(k), i32(positions), N, num_kv_heads, D, theta);
}

void qknorm_rope_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq_weight, const Tensor& dk_weight,
                          const Tensor& dq, const Tensor& dk, const Tensor& q_raw, const Tensor& k_raw,
                          const Tensor& q_weight, const Tensor& k_weight, const Tensor& q_rstd, const Tensor& k_rstd,
                          const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, float theta) {
    OpScope scope_("qknorm_rope_backward");
    const int64_t D = q_weight.numel(), N = positions.numel();
    if (device_of({&dq_raw, &dk_raw, &dq_weight, &dk_weight, &dq, &dk, &q_raw, &k_raw, &q_weight, &k_weight, &q_rstd,
                   &k_rstd, &positions}) == Device::cuda)
        return cuda_call(&CudaOps::qknorm_rope_backward, dq_raw, dk_raw, dq_weight, dk_weight, dq, dk, q_raw, k_raw,
                         q_weight, k_weight, q_rstd, k_rstd, positions, num_heads, num_kv_heads, theta);
    zero(dq_raw);  // the CPU kernels below add into them
    zero(dk_raw);
    cpu::rope_backward(f(dq), i32(positions), N, num_heads, D, theta);
    cpu::rmsnorm_backward(f(dq_raw), f(dq_weight), f(dq), f(q_raw), f(q_weight), f(q_rstd), N * num_heads, D);
    cpu::rope_backward(f(dk), i32(positions), N, num_kv_heads, D, theta);
    cpu::rmsnorm_backward(f(dk_raw), f(dk_weight), f(dk), f(k_raw), f(k_weight), f(k_rstd), N * num_kv_heads, D);
}

namespace {
// The table variant's shapes: q/q_raw [N·Hq·D], k/k_raw [N·Hkv·D], rstd [N·H], cos and sin [N, D].
void check_qknorm_table_shapes(const char* op, const Tensor& q, const Tensor& k, const Tensor& q_raw,
                               const Tensor& k_raw, const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& q_weight,
                               const Tensor& k_weight, const Tensor& cos, const Tensor& sin, int64_t num_heads,
                               int64_t num_kv_heads) {
    const int64_t D = q_weight.numel();
    MF_CHECK(num_heads >= 0 && num_kv_heads >= 0 && D >= 2 && D % 2 == 0 && k_weight.numel() == D, op,
             ": q/k norm weights of ", D, " and ", k_weight.numel(), " (one even head dim) for ", num_heads, "/",
             num_kv_heads, " heads");
    MF_CHECK(cos.ndim() == 2 && cos.dim(1) == D && sin.shape() == cos.shape(), op, ": cos ", shape_str(cos.shape()),
             " and sin ", shape_str(sin.shape()), " must both be [N, D = ", D, "]");
    const int64_t N = cos.dim(0);
    MF_CHECK(q_raw.numel() == N * num_heads * D && q.numel() == q_raw.numel() && q_rstd.numel() == N * num_heads, op,
             ": q ", shape_str(q.shape()), ", q_raw ", shape_str(q_raw.shape()), " and q_rstd ",
             shape_str(q_rstd.shape()), " must hold N·Hq·D = ", N * num_heads * D, " and N·Hq elements (N = ", N,
             " rows of cos)");
    MF_CHECK(k_raw.numel() == N * num_kv_heads * D && k.numel() == k_raw.numel() && k_rstd.numel() == N * num_kv_heads,
             op, ": k ", shape_str(k.shape()), ", k_raw ", shape_str(k_raw.shape()), " and k_rstd ",
             shape_str(k_rstd.shape()), " must hold N·Hkv·D = ", N * num_kv_heads * D, " and N·Hkv elements (N = ", N,
             " rows of cos)");
}
}  // namespace

void qknorm_rope_table_forward(const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                               const Tensor& q_raw, const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                               const Tensor& cos, const Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                               float eps) {
    OpScope scope_("qknorm_rope_table_forward");
    check_qknorm_table_shapes("qknorm_rope_table_forward", q, k, q_raw, k_raw, q_rstd, k_rstd, q_weight, k_weight, cos,
                              sin, num_heads, num_kv_heads);
    const int64_t D = q_weight.numel(), N = cos.dim(0);
    if (device_of({&q, &k, &q_rstd, &k_rstd, &q_raw, &k_raw, &q_weight, &k_weight, &cos, &sin}) == Device::cuda)
        return cuda_call(&CudaOps::qknorm_rope_table_forward, q, k, q_rstd, k_rstd, q_raw, k_raw, q_weight, k_weight,
                         cos, sin, num_heads, num_kv_heads, eps);
    cpu::rmsnorm_forward(f(q), f(q_rstd), f(q_raw), f(q_weight), N * num_heads, D, eps);
    cpu::rope_table_forward(f(q), f(cos), f(sin), N, num_heads, D);
    cpu::rmsnorm_forward(f(k), f(k_rstd), f(k_raw), f(k_weight), N * num_kv_heads, D, eps);
    cpu::rope_table_forward(f(k), f(cos), f(sin), N, num_kv_heads, D);
}

void qknorm_rope_table_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq_weight,
                                const Tensor& dk_weight, const Tensor& dq, const Tensor& dk, const Tensor& q_raw,
                                const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                                const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& cos, const Tensor& sin,
                                int64_t num_heads, int64_t num_kv_heads) {
    OpScope scope_("qknorm_rope_table_backward");
    check_qknorm_table_shapes("qknorm_rope_table_backward", dq, dk, q_raw, k_raw, q_rstd, k_rstd, q_weight, k_weight,
                              cos, sin, num_heads, num_kv_heads);
    MF_CHECK(dq_raw.numel() == dq.numel() && dk_raw.numel() == dk.numel(),
             "qknorm_rope_table_backward: dq_raw / dk_raw must match dq / dk");
    MF_CHECK(dq_weight.numel() == q_weight.numel() && dk_weight.numel() == k_weight.numel(),
             "qknorm_rope_table_backward: dq_weight / dk_weight must match the weights");
    const int64_t D = q_weight.numel(), N = cos.dim(0);
    if (device_of({&dq_raw, &dk_raw, &dq_weight, &dk_weight, &dq, &dk, &q_raw, &k_raw, &q_weight, &k_weight, &q_rstd,
                   &k_rstd, &cos, &sin}) == Device::cuda)
        return cuda_call(&CudaOps::qknorm_rope_table_backward, dq_raw, dk_raw, dq_weight, dk_weight, dq, dk, q_raw,
                         k_raw, q_weight, k_weight, q_rstd, k_rstd, cos, sin, num_heads, num_kv_heads);
    // dn = the transposed rotation of each gradient (in a copy: dq and dk are only read), then the
    // RMSNorm backward, which adds into dq_raw / dk_raw (zeroed first) and the weight gradients.
    std::vector<float> dn(static_cast<size_t>(std::max(dq.numel(), dk.numel())));
    const auto one = [&](const Tensor& d_raw, const Tensor& d_weight, const Tensor& d, const Tensor& raw,
                         const Tensor& weight, const Tensor& rstd, int64_t heads) {
        std::copy_n(f(d), d.numel(), dn.data());
        cpu::rope_table_backward(dn.data(), f(cos), f(sin), N, heads, D);
        zero(d_raw);
        cpu::rmsnorm_backward(f(d_raw), f(d_weight), dn.data(), f(raw), f(weight), f(rstd), N * heads, D);
    };
    one(dq_raw, dq_weight, dq, q_raw, q_weight, q_rstd, num_heads);
    one(dk_raw, dk_weight, dk, k_raw, k_weight, k_rstd, num_kv_heads);
}

namespace {
// q[N, Hq·D], k[N, Hkv·D] and their partners of the same sizes (the raw projections or gradients);
// an even rotary_dim in [2, D].
void check_rope_shapes(const char* op, const Tensor& q, const Tensor& k, const Tensor& q_other, const Tensor& k_other,
                       int64_t N, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim) {
    MF_CHECK(num_heads >= 0 && num_kv_heads >= 0 && head_dim >= 1, op, ": ", num_heads, "/", num_kv_heads,
             " heads of dim ", head_dim);
    MF_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, op, ": rotary_dim ", rotary_dim,
             " must be even and in [2, head_dim = ", head_dim, "]");
    MF_CHECK(q.numel() == N * num_heads * head_dim && q_other.numel() == q.numel(), op, ": q ", shape_str(q.shape()),
             " and ", shape_str(q_other.shape()), " must hold N·Hq·D = ", N * num_heads * head_dim,
             " elements (N = ", N, " positions)");
    MF_CHECK(k.numel() == N * num_kv_heads * head_dim && k_other.numel() == k.numel(), op, ": k ", shape_str(k.shape()),
             " and ", shape_str(k_other.shape()), " must hold N·Hkv·D = ", N * num_kv_heads * head_dim,
             " elements (N = ", N, " positions)");
}
}  // namespace

void rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_raw, const Tensor& k_raw, const Tensor& positions,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, float theta) {
    OpScope scope_("rope_forward");
    const int64_t N = positions.numel();
    check_rope_shapes("rope_forward", q, k, q_raw, k_raw, N, num_heads, num_kv_heads, head_dim, rotary_dim);
    if (device_of({&q, &k, &q_raw, &k_raw, &positions}) == Device::cuda)
        return cuda_call(&CudaOps::rope_forward, q, k, q_raw, k_raw, positions, num_heads, num_kv_heads, head_dim,
                         rotary_dim, theta);
    if (q.data() != q_raw.data()) copy(q, q_raw);  // the CPU kernel rotates in place
    if (k.data() != k_raw.data()) copy(k, k_raw);
    cpu::rope_forward(f(q), i32(positions), N, num_heads, head_dim, rotary_dim, theta);
    cpu::rope_forward(f(k), i32(positions), N, num_kv_heads, head_dim, rotary_dim, theta);
}

void rope_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq, const Tensor& dk,
                   const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t rotary_dim, float theta) {
    OpScope scope_("rope_backward");
    const int64_t N = positions.numel();
    check_rope_shapes("rope_backward", dq_raw, dk_raw, dq, dk, N, num_heads, num_kv_heads, head_dim, rotary_dim);
    if (device_of({&dq_raw, &dk_raw, &dq, &dk, &positions}) == Device::cuda)
        return cuda_call(&CudaOps::rope_backward, dq_raw, dk_raw, dq, dk, positions, num_heads, num_kv_heads, head_dim,
                         rotary_dim, theta);
    if (dq_raw.data() != dq.data()) copy(dq_raw, dq);  // the CPU kernel rotates in place
    if (dk_raw.data() != dk.data()) copy(dk_raw, dk);
    cpu::rope_backward(f(dq_raw), i32(positions), N, num_heads, head_dim, rotary_dim, theta);
    cpu::rope_backward(f(dk_raw), i32(positions), N, num_kv_heads, head_dim, rotary_dim, theta);
}

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& doc_ids, int64_t B, int64_t T, int64_t num_heads, int64_t num_kv_heads) {
    OpScope scope_("attention_forward");
    const int64_t D = q.numel() / (B * T * num_heads);
    MF_CHECK(k.numel() == B * T * num_kv_heads * D && lse.numel() == B * num_heads * T, "attention shapes");
    if (device_of({&out, &lse, &q, &k, &v, &doc_ids}) == Device::cuda)
        return cuda_call(&CudaOps::attention_forward, out, lse, q, k, v, doc_ids, B, T, num_heads, num_kv_heads);
    cpu::attention_forward(f(out), f(lse), f(q), f(k), f(v), i32(doc_ids), {B, T, num_heads, num_kv_heads, D});
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& doc_ids,
                        int64_t B, int64_t T, int64_t num_heads, int64_t num_kv_heads) {
    OpScope scope_("attention_backward");
    const int64_t D = q.numel() / (B * T * num_heads);
    if (device_of({&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse, &doc_ids}) == Device::cuda)
        return cuda_call(&CudaOps::attention_backward, dq, dk, dv, dout, q, k, v, out, lse, doc_ids, B, T, num_heads,
                         num_kv_heads);
    for (const Tensor* t : {&dq, &dk, &dv}) zero(*t);  // the CPU kernel adds into them
    cpu::attention_backward(f(dq), f(dk), f(dv), f(dout), f(q), f(k), f(v), f(out), f(lse), i32(doc_ids),
                            {B, T, num_heads, num_kv_heads, D});
}

void swiglu_forward(const Tensor& out, const Tensor& inp) {
    OpScope scope_("swiglu_forward");
    const int64_t I = out.dim(-1), N = rows(out);
    MF_CHECK(inp.numel() == 2 * N * I, "swiglu shapes");
    if (device_of({&out, &inp}) == Device::cuda) return cuda_call(&CudaOps::swiglu_forward, out, inp);
    cpu::swiglu_forward(f(out), f(inp), N, I);
}

void swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp) {
    OpScope scope_("swiglu_backward");
    const int64_t I = dout.dim(-1), N = rows(dout);
    if (device_of({&dinp, &dout, &inp}) == Device::cuda) return cuda_call(&CudaOps::swiglu_backward, dinp, dout, inp);
    cpu::swiglu_backward(f(dinp), f(dout), f(inp), N, I);
}

namespace {
// The activation dtype of a device: f32 on the CPU, bf16 on the GPU.
void check_relu2(const char* op, Device device, std::initializer_list<const Tensor*> ts) {
    const DType want = device == Device::cuda ? DType::bf16 : DType::f32;
    const Tensor& first = **ts.begin();
    for (const Tensor* t : ts) {
        MF_CHECK(t->numel() == first.numel(), op, ": ", shape_str(t->shape()), " and ", shape_str(first.shape()),
                 " differ in size");
        MF_CHECK(t->numel() == 0 || t->dtype() == want, op, ": a ", dtype_name(t->dtype()), " tensor where ",
                 dtype_name(want), " activations are expected");
    }
}
}  // namespace

void relu2_forward(const Tensor& out, const Tensor& inp) {
    OpScope scope_("relu2_forward");
    const Device device = device_of({&out, &inp});
    check_relu2("relu2_forward", device, {&out, &inp});
    if (device == Device::cuda) return cuda_call(&CudaOps::relu2_forward, out, inp);
    cpu::relu2_forward(f(out), f(inp), inp.numel());
}

void relu2_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp) {
    OpScope scope_("relu2_backward");
    const Device device = device_of({&dinp, &dout, &inp});
    check_relu2("relu2_backward", device, {&dinp, &dout, &inp});
    if (device == Device::cuda) return cuda_call(&CudaOps::relu2_backward, dinp, dout, inp);
    cpu::relu2_backward(f(dinp), f(dout), f(inp), inp.numel());
}

namespace {
// out [N, I] and inp [N, 2I] (dinp like inp) of the device's activation dtype; alpha and limit
// finite. Returns {N, I}.
std::pair<int64_t, int64_t> check_clamped_swiglu(const char* op, Device device, const Tensor& out, const Tensor& inp,
                                                 float alpha, float limit) {
    MF_CHECK(std::isfinite(alpha) && std::isfinite(limit), op, ": alpha = ", alpha, " and limit = ", limit,
             " must be finite");
    MF_CHECK(out.ndim() >= 1 && inp.ndim() >= 1, op, ": out ", shape_str(out.shape()), " and inp ",
             shape_str(inp.shape()), " must be [N, I] and [N, 2I]");
    const int64_t I = out.dim(-1), N = rows(out);
    MF_CHECK(inp.dim(-1) == 2 * I && rows(inp) == N, op, ": inp ", shape_str(inp.shape()), " must be [N, 2I] = [", N,
             ", ", 2 * I, "] (out ", shape_str(out.shape()), ")");
    check_relu2(op, device, {&out});
    check_relu2(op, device, {&inp});
    return {N, I};
}
}  // namespace

void clamped_swiglu_forward(const Tensor& out, const Tensor& inp, float alpha, float limit) {
    OpScope scope_("clamped_swiglu_forward");
    const Device device = device_of({&out, &inp});
    const auto [N, I] = check_clamped_swiglu("clamped_swiglu_forward", device, out, inp, alpha, limit);
    if (device == Device::cuda) return cuda_call(&CudaOps::clamped_swiglu_forward, out, inp, alpha, limit);
    cpu::clamped_swiglu_forward(f(out), f(inp), N, I, alpha, limit);
}

void clamped_swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp, float alpha, float limit) {
    OpScope scope_("clamped_swiglu_backward");
    const char* op = "clamped_swiglu_backward";
    const Device device = device_of({&dinp, &dout, &inp});
    const auto [N, I] = check_clamped_swiglu(op, device, dout, inp, alpha, limit);
    check_relu2(op, device, {&dinp, &inp});
    if (device == Device::cuda) return cuda_call(&CudaOps::clamped_swiglu_backward, dinp, dout, inp, alpha, limit);
    cpu::clamped_swiglu_backward(f(dinp), f(dout), f(inp), N, I, alpha, limit);
}

namespace {
// value[N, H] with H >= 1 and the tensors of the gate sharing its shape; gate logits [N] or [N, 1].
// Returns {N, H}.
std::pair<int64_t, int64_t> check_sigmoid_gate(const char* op, const Tensor& value,
                                               std::initializer_list<const Tensor*> like_value,
                                               std::initializer_list<const Tensor*> per_row) {
    const int64_t H = value.ndim() >= 1 ? value.dim(-1) : 0;
    MF_CHECK(H >= 1, op, ": value ", shape_str(value.shape()), " does not have rows of >= 1 elements");
    const int64_t N = rows(value);
    for (const Tensor* t : like_value)
        MF_CHECK(t->numel() == value.numel() && t->ndim() >= 1 && t->dim(-1) == H, op, ": ", shape_str(t->shape()),
                 " differs from value ", shape_str(value.shape()));
    for (const Tensor* t : per_row)
        MF_CHECK(t->numel() == N && (t->ndim() <= 1 || t->dim(-1) == 1), op, ": gate logits ", shape_str(t->shape()),
                 " must be [N] or [N, 1] with N = ", N, " (value)");
    return {N, H};
}
}  // namespace

void sigmoid_gate_forward(const Tensor& y, const Tensor& value, const Tensor& gate_logits) {
    OpScope scope_("sigmoid_gate_forward");
    const auto [N, H] = check_sigmoid_gate("sigmoid_gate_forward", value, {&y}, {&gate_logits});
    if (device_of({&y, &value, &gate_logits}) == Device::cuda)
        return cuda_call(&CudaOps::sigmoid_gate_forward, y, value, gate_logits);
    cpu::sigmoid_gate_forward(f(y), f(value), f(gate_logits), N, H);
}

void sigmoid_gate_backward(const Tensor& dvalue, const Tensor& dgate_logits, const Tensor& dy, const Tensor& value,
                           const Tensor& gate_logits) {
    OpScope scope_("sigmoid_gate_backward");
    const auto [N, H] =
        check_sigmoid_gate("sigmoid_gate_backward", value, {&dvalue, &dy}, {&dgate_logits, &gate_logits});
    if (device_of({&dvalue, &dgate_logits, &dy, &value, &gate_logits}) == Device::cuda)
        return cuda_call(&CudaOps::sigmoid_gate_backward, dvalue, dgate_logits, dy, value, gate_logits);
    cpu::sigmoid_gate_backward(f(dvalue), f(dgate_logits), f(dy), f(value), f(gate_logits), N, H);
}

// --- MoE -------------------------------------------------------------------------------------------

void router_forward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_weight, const Tensor& logits,
                    bool norm_topk_prob) {
    OpScope scope_("router_forward");
    const int64_t N = logits.dim(0), E = logits.dim(1), K = topk_idx.dim(-1);
    MF_CHECK(logits.dtype() == DType::f32 && probs.dtype() == DType::f32, "router math is f32");
    if (device_of({&probs, &topk_idx, &topk_weight, &logits}) == Device::cuda)
        return cuda_call(&CudaOps::router_forward, probs, topk_idx, topk_weight, logits, norm_topk_prob);
    cpu::router_forward(f(probs), topk_idx.ptr<int32_t>(), f(topk_weight), f(logits), N, E, K, norm_topk_prob);
}

void router_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                     const Tensor& topk_idx, bool norm_topk_prob) {
    OpScope scope_("router_backward");
    const int64_t N = probs.dim(0), E = probs.dim(1), K = topk_idx.dim(-1);
    if (device_of({&dlogits, &dtopk_weight, &dprobs, &probs, &topk_idx}) == Device::cuda)
        return cuda_call(&CudaOps::router_backward, dlogits, dtopk_weight, dprobs, probs, topk_idx, norm_topk_prob);
    cpu::router_backward(f(dlogits), f(dtopk_weight), f(dprobs), f(probs), i32(topk_idx), N, E, K, norm_topk_prob);
}

namespace {
// t is [rows, cols] of dtype.
void check_matrix(const char* op, const char* name, const Tensor& t, DType dtype, int64_t rows, int64_t cols) {
    MF_CHECK(t.ndim() == 2 && t.dim(0) == rows && t.dim(1) == cols, op, ": ", name, " is ", shape_str(t.shape()),
             ", expected [", rows, ", ", cols, "]");
    MF_CHECK(t.dtype() == dtype, op, ": ", name, " is ", dtype_name(t.dtype()), ", expected ", dtype_name(dtype));
}
}  // namespace

void router_sigmoid_forward(const Tensor& scores, const Tensor& topk_idx, const Tensor& topk_weight,
                            const Tensor& logits, const Tensor& correction_bias, int64_t n_group, int64_t topk_group,
                            bool norm_topk_prob, float routed_scaling_factor, float masked_score) {
    OpScope scope_("router_sigmoid_forward");
    const char* op = "router_sigmoid_forward";
    MF_CHECK(logits.ndim() == 2, op, ": logits ", shape_str(logits.shape()), " must be [N, E]");
    MF_CHECK(topk_idx.ndim() == 2, op, ": topk_idx ", shape_str(topk_idx.shape()), " must be [N, K]");
    const int64_t N = logits.dim(0), E = logits.dim(1), K = topk_idx.dim(1);
    const cpu::RouterSigmoidParams p{n_group, topk_group, norm_topk_prob, routed_scaling_factor, masked_score};
    cpu::check_router_sigmoid(op, E, K, p);
    check_matrix(op, "logits", logits, DType::f32, N, E);
    check_matrix(op, "scores", scores, DType::f32, N, E);
    check_matrix(op, "topk_idx", topk_idx, DType::i32, N, K);
    check_matrix(op, "topk_weight", topk_weight, DType::f32, N, K);
    const Device device = device_of({&scores, &topk_idx, &topk_weight, &logits, &correction_bias});
    if (defined(correction_bias)) {
        MF_CHECK(correction_bias.ndim() == 1 && correction_bias.dim(0) == E, op, ": correction_bias ",
                 shape_str(correction_bias.shape()), " must be [E = ", E, "]");
        const DType dt = correction_bias.dtype();
        MF_CHECK(dt == DType::f32 || (device == Device::cuda && dt == DType::bf16), op, ": correction_bias is ",
                 dtype_name(dt), ", expected f32", device == Device::cuda ? " or bf16" : " on the CPU");
    }
    if (device == Device::cuda)
        return cuda_call(&CudaOps::router_sigmoid_forward, scores, topk_idx, topk_weight, logits, correction_bias,
                         n_group, topk_group, norm_topk_prob, routed_scaling_factor, masked_score);
    cpu::router_sigmoid_forward(f(scores), topk_idx.ptr<int32_t>(), f(topk_weight), f(logits), f(correction_bias), N, E,
                                K, p);
}

void router_sigmoid_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& scores,
                             const Tensor& topk_idx, bool norm_topk_prob, float routed_scaling_factor) {
    OpScope scope_("router_sigmoid_backward");
    const char* op = "router_sigmoid_backward";
    MF_CHECK(scores.ndim() == 2 && topk_idx.ndim() == 2, op, ": scores ", shape_str(scores.shape()), " and topk_idx ",
             shape_str(topk_idx.shape()), " must be [N, E] and [N, K]");
    const int64_t N = scores.dim(0), E = scores.dim(1), K = topk_idx.dim(1);
    MF_CHECK(E >= 1 && K >= 1 && K <= E, op, ": E = ", E, ", K = ", K, " (need 1 <= K <= E)");
    MF_CHECK(std::isfinite(routed_scaling_factor), op, ": routed_scaling_factor = ", routed_scaling_factor,
             " is not finite");
    check_matrix(op, "dlogits", dlogits, DType::f32, N, E);
    check_matrix(op, "dtopk_weight", dtopk_weight, DType::f32, N, K);
    check_matrix(op, "scores", scores, DType::f32, N, E);
    check_matrix(op, "topk_idx", topk_idx, DType::i32, N, K);
    if (device_of({&dlogits, &dtopk_weight, &scores, &topk_idx}) == Device::cuda)
        return cuda_call(&CudaOps::router_sigmoid_backward, dlogits, dtopk_weight, scores, topk_idx, norm_topk_prob,
                         routed_scaling_factor);
    cpu::router_sigmoid_backward(f(dlogits), f(dtopk_weight), f(scores), i32(topk_idx), N, E, K, norm_topk_prob,
                                 routed_scaling_factor);
}

void moe_aux_stats(const Tensor& counts, const Tensor& prob_sums, const Tensor& topk_idx, const Tensor& probs,
                   const Tensor& mask) {
    OpScope scope_("moe_aux_stats");
    if (device_of({&counts, &prob_sums, &topk_idx, &probs, &mask}) == Device::cuda)
        return cuda_call(&CudaOps::moe_aux_stats, counts, prob_sums, topk_idx, probs, mask);
    const int64_t N = probs.dim(0), E = probs.dim(1), K = topk_idx.dim(-1);
    float *c = f(counts), *ps = f(prob_sums);
    const float *p = f(probs), *m = f(mask);
    const int32_t* idx = i32(topk_idx);
    // Per-expert sums in token order, in double, then added once (deterministic).
    std::vector<double> cs(static_cast<size_t>(E), 0.0), pss(static_cast<size_t>(E), 0.0);
    for (int64_t t = 0; t < N; ++t) {
        if (m[t] == 0.0f) continue;
        for (int64_t k = 0; k < K; ++k) {  // (an index outside [0, E), an EP sentinel, counts nothing, as on the GPU)
            const int32_t e = idx[t * K + k];
            if (e >= 0 && e < E) cs[static_cast<size_t>(e)] += m[t];
        }
        for (int64_t e = 0; e < E; ++e) pss[static_cast<size_t>(e)] += static_cast<double>(m[t]) * p[t * E + e];
    }
    for (int64_t e = 0; e < E; ++e) {
        c[e] += static_cast<float>(cs[static_cast<size_t>(e)]);
        ps[e] += static_cast<float>(pss[static_cast<size_t>(e)]);
    }
}

void moe_aux_dprobs(const Tensor& dprobs, const Tensor& counts, const Tensor& mask, float scale) {
    OpScope scope_("moe_aux_dprobs");
    if (device_of({&dprobs, &counts, &mask}) == Device::cuda)
        return cuda_call(&CudaOps::moe_aux_dprobs, dprobs, counts, mask, scale);
    const int64_t N = dprobs.dim(0), E = dprobs.dim(1);
    float* dp = f(dprobs);
    const float *c = f(counts), *m = f(mask);
    for (int64_t t = 0; t < N; ++t)
        for (int64_t e = 0; e < E; ++e) dp[t * E + e] = scale * c[e] * m[t];
}

void moe_permute_indices(const Tensor& expert_offsets, const Tensor& sorted_pair, const Tensor& pair_row,
                         const Tensor& topk_idx, int64_t num_experts) {
    OpScope scope_("moe_permute_indices");
    MF_CHECK(expert_offsets.numel() == num_experts + 1, "expert_offsets must have E + 1 entries");
    if (device_of({&expert_offsets, &sorted_pair, &pair_row, &topk_idx}) == Device::cuda)
        return cuda_call(&CudaOps::moe_permute_indices, expert_offsets, sorted_pair, pair_row, topk_idx, num_experts);
    cpu::moe_permute_indices(expert_offsets.ptr<int32_t>(), sorted_pair.ptr<int32_t>(), pair_row.ptr<int32_t>(),
                             i32(topk_idx), topk_idx.dim(0), topk_idx.dim(-1), num_experts);
}

void moe_gather_forward(const Tensor& x_perm, const Tensor& x, const Tensor& sorted_pair, int64_t top_k) {
    OpScope scope_("moe_gather_forward");
    if (device_of({&x_perm, &x, &sorted_pair}) == Device::cuda)
        return cuda_call(&CudaOps::moe_gather_forward, x_perm, x, sorted_pair, top_k);
    cpu::moe_gather_forward(f(x_perm), f(x), i32(sorted_pair), rows(x), top_k, x.dim(-1));
}

void moe_gather_backward(const Tensor& dx, const Tensor& dx_perm, const Tensor& pair_row, int64_t top_k) {
    OpScope scope_("moe_gather_backward");
    if (device_of({&dx, &dx_perm, &pair_row}) == Device::cuda)
        return cuda_call(&CudaOps::moe_gather_backward, dx, dx_perm, pair_row, top_k);
    cpu::moe_gather_backward(f(dx), f(dx_perm), i32(pair_row), rows(dx), top_k, dx.dim(-1));
}

void group_offsets(const Tensor& offsets, const Tensor& group_sizes, int64_t num_rows) {
    OpScope scope_("group_offsets");
    MF_CHECK(offsets.numel() == group_sizes.numel() + 1, "group_offsets: offsets holds ", offsets.numel(),
             " values for ", group_sizes.numel(), " groups (expected one more)");
    if (device_of({&offsets, &group_sizes}) == Device::cuda)
        return cuda_call(&CudaOps::group_offsets, offsets, group_sizes, num_rows);
    cpu::group_offsets(offsets.ptr<int32_t>(), i32(group_sizes), group_sizes.numel(), num_rows);
}

void zero_rows_past_groups(const Tensor& x, const Tensor& offsets) {
    OpScope scope_("zero_rows_past_groups");
    MF_CHECK(offsets.numel() >= 1, "zero_rows_past_groups: offsets is empty");
    if (device_of({&x, &offsets}) == Device::cuda) return cuda_call(&CudaOps::zero_rows_past_groups, x, offsets);
    cpu::zero_rows_past_groups(f(x), i32(offsets), offsets.numel() - 1, rows(x), x.dim(-1));
}

void moe_unpermute_forward(const Tensor& out, const Tensor& y_perm, const Tensor& topk_weight, const Tensor& pair_row) {
    OpScope scope_("moe_unpermute_forward");
    if (device_of({&out, &y_perm, &topk_weight, &pair_row}) == Device::cuda)
        return cuda_call(&CudaOps::moe_unpermute_forward, out, y_perm, topk_weight, pair_row);
    cpu::moe_unpermute_forward(f(out), f(y_perm), f(topk_weight), i32(pair_row), rows(out), topk_weight.dim(-1),
                               out.dim(-1));
}

void moe_unpermute_backward(const Tensor& dy_perm, const Tensor& dtopk_weight, const Tensor& dout, const Tensor& y_perm,
                            const Tensor& topk_weight, const Tensor& pair_row) {
    OpScope scope_("moe_unpermute_backward");
    if (device_of({&dy_perm, &dtopk_weight, &dout, &y_perm, &topk_weight, &pair_row}) == Device::cuda)
        return cuda_call(&CudaOps::moe_unpermute_backward, dy_perm, dtopk_weight, dout, y_perm, topk_weight, pair_row);
    cpu::moe_unpermute_backward(f(dy_perm), f(dtopk_weight), f(dout), f(y_perm), f(topk_weight), i32(pair_row),
                                rows(dout), topk_weight.dim(-1), dout.dim(-1));
}

// --- expert-parallel token exchange --------------------------------------------------------------
// The host checks what it can see without reading device memory: dtypes, ranks and the dimensions
// the tensors share. Values (expert ids, send positions, meta rows, Σ counts against the rows of a
// buffer) are range-checked by the kernels, which skip what is out of range.

namespace {

constexpr int64_t kEpMaxTopK = 32;  // the GPU kernels hold one slot per lane

DType ep_row_dtype(Device device) { return device == Device::cuda ? DType::bf16 : DType::f32; }

void ep_check_dtype(const char* op, const Tensor& t, const char* name, DType want) {
    MF_CHECK(t.dtype() == want, op, ": ", name, " is ", dtype_name(t.dtype()), ", expected ", dtype_name(want));
    MF_CHECK(t.numel() == 0 || defined(t), op, ": ", name, " ", shape_str(t.shape()), " has no data");
}

// A row tensor [rows, H] (leading dimensions flattened) of the device's row dtype.
// Rows of the device's activation dtype; with `fp32_ok` also f32 (the combine's unrounded partials).
void ep_check_rows(const char* op, const Tensor& t, const char* name, Device device, int64_t H, bool fp32_ok = false) {
    if (!(fp32_ok && t.dtype() == DType::f32)) ep_check_dtype(op, t, name, ep_row_dtype(device));
    MF_CHECK(t.ndim() >= 1 && H >= 1 && t.dim(-1) == H, op, ": ", name, " ", shape_str(t.shape()),
             " does not have rows of ", H, " >= 1 elements");
}

// send_pos [V, N] and counts [V] (i32); returns {V, N}.
std::pair<int64_t, int64_t> ep_check_positions(const char* op, const Tensor& send_pos, const Tensor& counts) {
    ep_check_dtype(op, send_pos, "send_pos", DType::i32);
    ep_check_dtype(op, counts, "counts", DType::i32);
    const int64_t V = counts.numel();
    MF_CHECK(V >= 1 && counts.ndim() == 1, op, ": counts ", shape_str(counts.shape()), " must be [V] with V >= 1");
    MF_CHECK(send_pos.ndim() == 2 && send_pos.dim(0) == V, op, ": send_pos ", shape_str(send_pos.shape()),
             " must be [V, N] with V = ", V, " (counts)");
    return {V, send_pos.dim(1)};
}

// topk_idx [N, K] (i32, 1 <= K <= 32); returns K.
int64_t ep_check_topk(const char* op, const Tensor& topk_idx, int64_t N) {
    ep_check_dtype(op, topk_idx, "topk_idx", DType::i32);
    MF_CHECK(topk_idx.ndim() == 2 && topk_idx.dim(0) == N, op, ": topk_idx ", shape_str(topk_idx.shape()),
             " must be [N, K] with N = ", N, " (send_pos)");
    const int64_t K = topk_idx.dim(1);
    MF_CHECK(K >= 1 && K <= kEpMaxTopK, op, ": K = ", K, " outside [1, ", kEpMaxTopK, "]");
    return K;
}

// expert_dest [E] (i32, E >= 1); returns E.
int64_t ep_check_expert_dest(const char* op, const Tensor& expert_dest) {
    ep_check_dtype(op, expert_dest, "expert_dest", DType::i32);
    MF_CHECK(expert_dest.ndim() == 1 && expert_dest.numel() >= 1, op, ": expert_dest ", shape_str(expert_dest.shape()),
             " must be [E] with E >= 1");
    return expert_dest.numel();
}

// meta [M, 2K] (i32, 1 <= K <= 32); returns K.
int64_t ep_check_meta(const char* op, const Tensor& meta, int64_t M) {
    ep_check_dtype(op, meta, "meta", DType::i32);
    MF_CHECK(meta.ndim() == 2 && meta.dim(0) == M && meta.dim(1) % 2 == 0 && meta.dim(1) >= 2 &&
                 meta.dim(1) <= 2 * kEpMaxTopK,
             op, ": meta ", shape_str(meta.shape()), " must be [M, 2K] with M = ", M, " and 1 <= K <= ", kEpMaxTopK);
    return meta.dim(1) / 2;
}

}  // namespace

void ep_token_positions(const Tensor& send_pos, const Tensor& counts, const Tensor& topk_idx,
                        const Tensor& expert_dest) {
    OpScope scope_("ep_token_positions");
    const char* op = "ep_token_positions";
    const auto [V, N] = ep_check_positions(op, send_pos, counts);
    const int64_t K = ep_check_topk(op, topk_idx, N);
    const int64_t E = ep_check_expert_dest(op, expert_dest);
    if (device_of({&send_pos, &counts, &topk_idx, &expert_dest}) == Device::cuda)
        return cuda_call(&CudaOps::ep_token_positions, send_pos, counts, topk_idx, expert_dest);
    cpu::ep_token_positions(send_pos.ptr<int32_t>(), counts.ptr<int32_t>(), i32(topk_idx), i32(expert_dest), N, K, E,
                            V);
}

void ep_pack_rows(const Tensor& rows, const Tensor& src, const Tensor& send_pos, const Tensor& counts) {
    OpScope scope_("ep_pack_rows");
    const char* op = "ep_pack_rows";
    const auto [V, N] = ep_check_positions(op, send_pos, counts);
    const Device device = device_of({&rows, &src, &send_pos, &counts});
    const int64_t H = src.ndim() >= 1 ? src.dim(-1) : 0;
    ep_check_rows(op, src, "src", device, H);
    ep_check_rows(op, rows, "rows", device, H);
    MF_CHECK(mf::ops::rows(src) == N, op, ": src ", shape_str(src.shape()), " must have N = ", N, " rows (send_pos)");
    if (device == Device::cuda) return cuda_call(&CudaOps::ep_pack_rows, rows, src, send_pos, counts);
    cpu::ep_pack_rows(f(rows), mf::ops::rows(rows), f(src), i32(send_pos), i32(counts), N, V, H);
}

void ep_pack_meta(const Tensor& meta, const Tensor& send_pos, const Tensor& counts, const Tensor& topk_idx,
                  const Tensor& topk_weight, const Tensor& pair_row, const Tensor& expert_offsets,
                  const Tensor& row_base, const Tensor& expert_dest) {
    OpScope scope_("ep_pack_meta");
    const char* op = "ep_pack_meta";
    const auto [V, N] = ep_check_positions(op, send_pos, counts);
    const int64_t K = ep_check_topk(op, topk_idx, N);
    const int64_t E = ep_check_expert_dest(op, expert_dest);
    ep_check_dtype(op, meta, "meta", DType::i32);
    MF_CHECK(meta.ndim() == 2 && meta.dim(1) == 2 * K, op, ": meta ", shape_str(meta.shape()),
             " must be [M, 2K] with K = ", K, " (topk_idx)");
    ep_check_dtype(op, topk_weight, "topk_weight", DType::f32);
    MF_CHECK(topk_weight.numel() == N * K, op, ": topk_weight ", shape_str(topk_weight.shape()), " must be [N, K] = [",
             N, ", ", K, "]");
    ep_check_dtype(op, pair_row, "pair_row", DType::i32);
    MF_CHECK(pair_row.numel() == N * K, op, ": pair_row ", shape_str(pair_row.shape()), " must hold N·K = ", N * K,
             " entries");
    ep_check_dtype(op, expert_offsets, "expert_offsets", DType::i32);
    MF_CHECK(expert_offsets.numel() == E + 1, op, ": expert_offsets ", shape_str(expert_offsets.shape()),
             " must be [E + 1] with E = ", E, " (expert_dest)");
    ep_check_dtype(op, row_base, "row_base", DType::i32);
    MF_CHECK(row_base.numel() == E, op, ": row_base ", shape_str(row_base.shape()), " must be [E] with E = ", E,
             " (expert_dest)");
    if (device_of({&meta, &send_pos, &counts, &topk_idx, &topk_weight, &pair_row, &expert_offsets, &row_base,
                   &expert_dest}) == Device::cuda)
        return cuda_call(&CudaOps::ep_pack_meta, meta, send_pos, counts, topk_idx, topk_weight, pair_row,
                         expert_offsets, row_base, expert_dest);
    cpu::ep_pack_meta(meta.ptr<int32_t>(), meta.dim(0), i32(send_pos), i32(counts), i32(topk_idx), f(topk_weight),
                      i32(pair_row), i32(expert_offsets), i32(row_base), i32(expert_dest), N, K, E, V);
}

void ep_scatter_rows(const Tensor& local, const Tensor& rows, const Tensor& meta) {
    OpScope scope_("ep_scatter_rows");
    const char* op = "ep_scatter_rows";
    const Device device = device_of({&local, &rows, &meta});
    const int64_t H = rows.ndim() >= 1 ? rows.dim(-1) : 0;
    ep_check_rows(op, rows, "rows", device, H);
    const int64_t M = mf::ops::rows(rows);
    ep_check_rows(op, local, "local", device, H);
    const int64_t K = ep_check_meta(op, meta, M);
    if (device == Device::cuda) return cuda_call(&CudaOps::ep_scatter_rows, local, rows, meta);
    cpu::ep_scatter_rows(f(local), mf::ops::rows(local), f(rows), i32(meta), M, K, H);
}

void ep_scatter_grad(const Tensor& dlocal, const Tensor& dweight, const Tensor& drows, const Tensor& meta,
                     const Tensor& y_local) {
    OpScope scope_("ep_scatter_grad");
    const char* op = "ep_scatter_grad";
    const Device device = device_of({&dlocal, &dweight, &drows, &meta, &y_local});
    const int64_t H = drows.ndim() >= 1 ? drows.dim(-1) : 0;
    ep_check_rows(op, drows, "drows", device, H);
    const int64_t M = mf::ops::rows(drows);
    ep_check_rows(op, dlocal, "dlocal", device, H);
    ep_check_rows(op, y_local, "y_local", device, H);
    MF_CHECK(mf::ops::rows(y_local) == mf::ops::rows(dlocal), op, ": y_local ", shape_str(y_local.shape()),
             " and dlocal ", shape_str(dlocal.shape()), " differ in rows");
    const int64_t K = ep_check_meta(op, meta, M);
    ep_check_dtype(op, dweight, "dweight", DType::f32);
    MF_CHECK(dweight.numel() == M * K && dweight.dim(-1) == K, op, ": dweight ", shape_str(dweight.shape()),
             " must be [M, K] = [", M, ", ", K, "]");
    if (device == Device::cuda) return cuda_call(&CudaOps::ep_scatter_grad, dlocal, dweight, drows, meta, y_local);
    cpu::ep_scatter_grad(f(dlocal), f(dweight), f(drows), i32(meta), f(y_local), mf::ops::rows(dlocal), M, K, H);
}

void ep_reduce_rows(const Tensor& out, const Tensor& local, const Tensor& meta, bool weighted) {
    OpScope scope_("ep_reduce_rows");
    const char* op = "ep_reduce_rows";
    const Device device = device_of({&out, &local, &meta});
    const int64_t H = out.ndim() >= 1 ? out.dim(-1) : 0;
    ep_check_rows(op, out, "out", device, H, true);
    const int64_t M = mf::ops::rows(out);
    ep_check_rows(op, local, "local", device, H);
    const int64_t K = ep_check_meta(op, meta, M);
    if (device == Device::cuda) return cuda_call(&CudaOps::ep_reduce_rows, out, local, meta, weighted);
    cpu::ep_reduce_rows(f(out), f(local), mf::ops::rows(local), i32(meta), M, K, H, weighted);
}

void ep_sum_blocks(const Tensor& out, const Tensor& rows, const Tensor& send_pos, const Tensor& counts,
                   bool accumulate) {
    OpScope scope_("ep_sum_blocks");
    const char* op = "ep_sum_blocks";
    const auto [V, N] = ep_check_positions(op, send_pos, counts);
    const Device device = device_of({&out, &rows, &send_pos, &counts});
    const int64_t H = out.ndim() >= 1 ? out.dim(-1) : 0;
    ep_check_rows(op, out, "out", device, H);
    ep_check_rows(op, rows, "rows", device, H, true);
    MF_CHECK(mf::ops::rows(out) == N, op, ": out ", shape_str(out.shape()), " must have N = ", N, " rows (send_pos)");
    if (device == Device::cuda) return cuda_call(&CudaOps::ep_sum_blocks, out, rows, send_pos, counts, accumulate);
    cpu::ep_sum_blocks(f(out), accumulate, f(rows), mf::ops::rows(rows), i32(send_pos), i32(counts), N, V, H);
}

void ep_gather_slots(const Tensor& dtopk_weight, const Tensor& dweight_rows, const Tensor& send_pos,
                     const Tensor& counts, const Tensor& topk_idx, const Tensor& expert_dest) {
    OpScope scope_("ep_gather_slots");
    const char* op = "ep_gather_slots";
    const auto [V, N] = ep_check_positions(op, send_pos, counts);
    const int64_t K = ep_check_topk(op, topk_idx, N);
    const int64_t E = ep_check_expert_dest(op, expert_dest);
    ep_check_dtype(op, dtopk_weight, "dtopk_weight", DType::f32);
    MF_CHECK(dtopk_weight.numel() == N * K && dtopk_weight.ndim() >= 1 && dtopk_weight.dim(-1) == K, op,
             ": dtopk_weight ", shape_str(dtopk_weight.shape()), " must be [N, K] = [", N, ", ", K, "]");
    ep_check_dtype(op, dweight_rows, "dweight_rows", DType::f32);
    MF_CHECK(dweight_rows.ndim() == 2 && dweight_rows.dim(1) == K, op, ": dweight_rows ",
             shape_str(dweight_rows.shape()), " must be [rows, K] with K = ", K, " (topk_idx)");
    if (device_of({&dtopk_weight, &dweight_rows, &send_pos, &counts, &topk_idx, &expert_dest}) == Device::cuda)
        return cuda_call(&CudaOps::ep_gather_slots, dtopk_weight, dweight_rows, send_pos, counts, topk_idx,
                         expert_dest);
    cpu::ep_gather_slots(f(dtopk_weight), f(dweight_rows), dweight_rows.dim(0), i32(send_pos), i32(counts),
                         i32(topk_idx), i32(expert_dest), N, K, E, V);
}

namespace {
// On the CPU the offsets tensor is host memory: a caller's host copy must equal it.
void check_host_offsets(const Tensor& offsets, std::span<const int32_t> host_offsets) {
    if (host_offsets.empty()) return;
    MF_CHECK(static_cast<int64_t>(host_offsets.size()) == offsets.numel() &&
                 std::equal(host_offsets.begin(), host_offsets.end(), i32(offsets)),
             "grouped matmul: the host offsets differ from the offsets tensor");
}
}  // namespace

bool grouped_matmul_uses_host_offsets(Device device, int64_t E, int64_t C, int64_t OC) {
    if (device == Device::cpu) return true;
    // Without CUDA there is no GPU path to feed: false, not a refusal.
    const auto uses = cuda_ops().grouped_matmul_uses_host_offsets;
    return uses != nullptr && uses(device, E, C, OC);
}

void set_grouped_matmul_reserved_sms(Device device, int sms) {
    if (device == Device::cuda) cuda_call(&CudaOps::set_grouped_matmul_reserved_sms, device, sms);
}

void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets,
                            std::span<const int32_t> host_offsets) {
    OpScope scope_("grouped_matmul_forward");
    const int64_t E = weight.dim(0), OC = weight.dim(1), C = weight.dim(2);
    MF_CHECK(inp.dim(-1) == C && out.dim(-1) == OC && rows(out) == rows(inp) && offsets.numel() == E + 1,
             "grouped matmul shapes");
    if (device_of({&out, &inp, &weight, &offsets}) == Device::cuda)
        return cuda_call(&CudaOps::grouped_matmul_forward, out, inp, weight, offsets, host_offsets);
    check_host_offsets(offsets, host_offsets);
    cpu::grouped_matmul_forward(f(out), f(inp), f(weight), i32(offsets), E, C, OC);
}

void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& offsets, std::span<const int32_t> host_offsets,
                             bool accumulate_dinp, bool accumulate_dweight) {
    OpScope scope_("grouped_matmul_backward");
    const int64_t E = weight.dim(0), OC = weight.dim(1), C = weight.dim(2);
    if (device_of({&dinp, &dweight, &dout, &inp, &weight, &offsets}) == Device::cuda)
        return cuda_call(&CudaOps::grouped_matmul_backward, dinp, dweight, dout, inp, weight, offsets, host_offsets,
                         accumulate_dinp, accumulate_dweight);
    check_host_offsets(offsets, host_offsets);
    if (!accumulate_dinp && defined(dinp) && E > 0) {  // written: clear the groups' rows, then add
        const int32_t* off = i32(offsets);
        MF_CHECK(off[0] >= 0 && off[0] <= off[E] && off[E] <= rows(dinp), "grouped_matmul_backward: offsets [", off[0],
                 ", ", off[E], ") outside the ", rows(dinp), " rows of dinp");
        std::fill(f(dinp) + off[0] * C, f(dinp) + off[E] * C, 0.0f);
    }
    if (!accumulate_dweight && defined(dweight)) std::fill(f(dweight), f(dweight) + dweight.numel(), 0.0f);
    cpu::grouped_matmul_backward(f(dinp), f(dweight), f(dout), f(inp), f(weight), i32(offsets), E, C, OC);
}

void grouped_matmul_swiglu_forward(const Tensor& h, const Tensor& a, const Tensor& inp, const Tensor& weight,
                                   const Tensor& offsets, std::span<const int32_t> host_offsets) {
    OpScope scope_("grouped_matmul_swiglu_forward");
    const int64_t E = weight.dim(0), two_i = weight.dim(1), C = weight.dim(2);
    MF_CHECK(two_i % 2 == 0 && inp.dim(-1) == C && h.dim(-1) == two_i && a.dim(-1) == two_i / 2 &&
                 rows(h) == rows(inp) && rows(a) == rows(inp) && offsets.numel() == E + 1,
             "grouped_matmul_swiglu_forward: h ", shape_str(h.shape()), ", a ", shape_str(a.shape()), ", inp ",
             shape_str(inp.shape()), ", weight ", shape_str(weight.shape()),
             " (expected [M, 2I], [M, I], [M, C], [E, 2I, C])");
    if (device_of({&h, &a, &inp, &weight, &offsets}) == Device::cuda)
        return cuda_call(&CudaOps::grouped_matmul_swiglu_forward, h, a, inp, weight, offsets, host_offsets);
    grouped_matmul_forward(h, inp, weight, offsets, host_offsets);
    swiglu_forward(a, h);
}

void grouped_matmul_swiglu_backward(const Tensor& dh, const Tensor& da, const Tensor& dout, const Tensor& weight,
                                    const Tensor& h, const Tensor& offsets, std::span<const int32_t> host_offsets) {
    OpScope scope_("grouped_matmul_swiglu_backward");
    const int64_t E = weight.dim(0), OC = weight.dim(1), I = weight.dim(2);
    MF_CHECK(dout.dim(-1) == OC && da.dim(-1) == I && dh.dim(-1) == 2 * I && h.dim(-1) == 2 * I &&
                 rows(da) == rows(dout) && rows(dh) == rows(dout) && rows(h) == rows(dout) && offsets.numel() == E + 1,
             "grouped_matmul_swiglu_backward: dh ", shape_str(dh.shape()), ", da ", shape_str(da.shape()), ", dout ",
             shape_str(dout.shape()), ", weight ", shape_str(weight.shape()), ", h ", shape_str(h.shape()),
             " (expected [M, 2I], [M, I], [M, OC], [E, OC, I], [M, 2I])");
    if (device_of({&dh, &da, &dout, &weight, &h, &offsets}) == Device::cuda)
        return cuda_call(&CudaOps::grouped_matmul_swiglu_backward, dh, da, dout, weight, h, offsets, host_offsets);
    // (The input gradient reads no input: da stands in for inp's rows.)
    grouped_matmul_backward(da, Tensor(), dout, da, weight, offsets, host_offsets, false);
    swiglu_backward(dh, da, h);
}

void grouped_matmul_backward_weight(const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                                    std::span<const Tensor> offsets,
                                    std::span<const std::span<const int32_t>> host_offsets, bool accumulate,
                                    const Tensor& square_sum) {
    OpScope scope_("grouped_matmul_backward");
    MF_CHECK(offsets.size() == 1 || offsets.size() == 2, "grouped_matmul_backward_weight: 1 or 2 row tables, got ",
             offsets.size());
    MF_CHECK(host_offsets.empty() || host_offsets.size() == offsets.size(),
             "grouped_matmul_backward_weight: one host copy per row table");
    MF_CHECK(!defined(square_sum) || (square_sum.dtype() == DType::f64 && square_sum.numel() == 1),
             "grouped_matmul_backward_weight: square_sum must be one f64");
    if (device_of({&dweight, &dout, &inp, &offsets[0], &square_sum}) == Device::cuda)
        return cuda_call(&CudaOps::grouped_matmul_backward_weight, dweight, dout, inp, offsets, host_offsets,
                         accumulate, square_sum);
    const int64_t E = dweight.dim(0), OC = dweight.dim(1), C = dweight.dim(2);
    if (!accumulate) std::fill(f(dweight), f(dweight) + dweight.numel(), 0.0f);
    for (size_t p = 0; p < offsets.size(); ++p) {
        check_host_offsets(offsets[p], host_offsets.empty() ? std::span<const int32_t>() : host_offsets[p]);
        cpu::grouped_matmul_backward(nullptr, f(dweight), f(dout), f(inp), nullptr, i32(offsets[p]), E, C, OC);
    }
    if (defined(square_sum)) square_sum.ptr<double>()[0] += cpu::sum_squares(f(dweight), dweight.numel());
}

// --- Mamba-2 ---------------------------------------------------------------------------------------
// The host checks shapes, dtypes and that the tensors share a device; it never reads doc_ids (device
// memory on the GPU). Activations: the device's activation dtype; parameters and their gradients:
// f32, or f32 or bf16 on the GPU; rstd and the chunk states: f32.

namespace {

DType mamba_act_dtype(Device device) { return device == Device::cuda ? DType::bf16 : DType::f32; }

// An activation [rows, cols] (leading dimensions flattened into rows).
void mamba_check_act(const char* op, const Tensor& t, const char* name, Device device, int64_t num_rows, int64_t cols) {
    const DType want = mamba_act_dtype(device);
    MF_CHECK(t.dtype() == want, op, ": ", name, " is ", dtype_name(t.dtype()), ", expected ", dtype_name(want));
    MF_CHECK(t.ndim() >= 1 && t.dim(-1) == cols && t.numel() == num_rows * cols, op, ": ", name, " ",
             shape_str(t.shape()), " must be [", num_rows, ", ", cols, "]");
    MF_CHECK(t.numel() == 0 || defined(t), op, ": ", name, " ", shape_str(t.shape()), " has no data");
}

// A parameter or a parameter gradient of `numel` elements.
void mamba_check_param(const char* op, const Tensor& t, const char* name, Device device, int64_t numel) {
    const bool dtype_ok = t.dtype() == DType::f32 || (device == Device::cuda && t.dtype() == DType::bf16);
    MF_CHECK(dtype_ok, op, ": ", name, " is ", dtype_name(t.dtype()), ", expected f32",
             device == Device::cuda ? " or bf16" : "");
    MF_CHECK(t.numel() == numel && defined(t), op, ": ", name, " ", shape_str(t.shape()), " must hold ", numel,
             " elements");
}

void mamba_check_f32(const char* op, const Tensor& t, const char* name, int64_t numel) {
    MF_CHECK(t.dtype() == DType::f32, op, ": ", name, " is ", dtype_name(t.dtype()), ", expected f32");
    MF_CHECK(t.numel() == numel && (numel == 0 || defined(t)), op, ": ", name, " ", shape_str(t.shape()), " must hold ",
             numel, " elements");
}

// doc_ids: undefined (every row one document) or [N] i32.
void mamba_check_doc_ids(const char* op, const Tensor& doc_ids, int64_t N) {
    if (!defined(doc_ids) && doc_ids.numel() == 0) return;
    MF_CHECK(doc_ids.dtype() == DType::i32, op, ": doc_ids is ", dtype_name(doc_ids.dtype()), ", expected i32");
    MF_CHECK(doc_ids.numel() == N && defined(doc_ids), op, ": doc_ids ", shape_str(doc_ids.shape()), " must be [", N,
             "] (one id per token)");
}

void mamba_check_rows(const char* op, int64_t N, int64_t T) {
    MF_CHECK(T >= 1 && N % T == 0, op, ": T = ", T, " tokens per row does not divide the N = ", N, " tokens");
}

struct ConvGeometry {
    int64_t N, C, K;
};

// inp [N, C] with N = B·T, weight [C, K] or [C, 1, K] (K >= 1), bias [C] or undefined, doc_ids.
ConvGeometry check_conv1d(const char* op, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                          const Tensor& doc_ids, int64_t T, Device device) {
    const int64_t C = inp.ndim() >= 1 ? inp.dim(-1) : 0;
    MF_CHECK(C >= 1, op, ": inp ", shape_str(inp.shape()), " does not have rows of >= 1 channels");
    const int64_t N = rows(inp);
    mamba_check_rows(op, N, T);
    const bool weight_shape =
        (weight.ndim() == 2 || (weight.ndim() == 3 && weight.dim(1) == 1)) && weight.dim(0) == C && weight.dim(-1) >= 1;
    MF_CHECK(weight_shape, op, ": weight ", shape_str(weight.shape()), " must be [C, K] or [C, 1, K] with C = ", C,
             " (inp) and K >= 1");
    const int64_t K = weight.dim(-1);
    mamba_check_param(op, weight, "weight", device, C * K);
    if (defined(bias)) mamba_check_param(op, bias, "bias", device, C);
    mamba_check_doc_ids(op, doc_ids, N);
    return {N, C, K};
}

void check_ssd_dims(const char* op, const SsdDims& d) {
    MF_CHECK(d.num_heads >= 1 && d.head_dim >= 1 && d.num_groups >= 1 && d.state_size >= 1 && d.chunk_size >= 1, op,
             ": SsdDims needs num_heads, head_dim, num_groups, state_size, chunk_size >= 1 (got H = ", d.num_heads,
             ", P = ", d.head_dim, ", G = ", d.num_groups, ", S = ", d.state_size, ", chunk = ", d.chunk_size, ")");
    MF_CHECK(d.num_heads % d.num_groups == 0, op, ": num_heads H = ", d.num_heads,
             " is not a multiple of num_groups G = ", d.num_groups);
    MF_CHECK(d.dt_min <= d.dt_max, op, ": dt clamp [", d.dt_min, ", ", d.dt_max, "] is empty");
}

struct SsdGeometry {
    int64_t N, I, width;
};

// xbc [N, I + 2GS], dt [N, H], dt_bias / A_log / D [H], states, doc_ids.
SsdGeometry check_ssd(const char* op, const SsdDims& d, const Tensor& xbc, const Tensor& dt, const Tensor& dt_bias,
                      const Tensor& A_log, const Tensor& D, const Tensor& states, const Tensor& doc_ids,
                      Device device) {
    check_ssd_dims(op, d);
    const int64_t H = d.num_heads, I = H * d.head_dim, width = I + 2 * d.num_groups * d.state_size;
    MF_CHECK(xbc.ndim() >= 1 && xbc.dim(-1) == width, op, ": xbc ", shape_str(xbc.shape()),
             " does not have rows of I + 2·G·S = ", width, " (H = ", H, ", P = ", d.head_dim, ", G = ", d.num_groups,
             ", S = ", d.state_size, ")");
    const int64_t N = rows(xbc);
    mamba_check_rows(op, N, d.T);
    mamba_check_act(op, xbc, "xbc", device, N, width);
    mamba_check_act(op, dt, "dt", device, N, H);
    mamba_check_param(op, dt_bias, "dt_bias", device, H);
    mamba_check_param(op, A_log, "A_log", device, H);
    mamba_check_param(op, D, "D", device, H);
    mamba_check_f32(op, states, "states", ssd_chunk_states_numel(N, d));
    mamba_check_doc_ids(op, doc_ids, N);
    return {N, I, width};
}

cpu::SsdShape ssd_shape(const SsdDims& d, int64_t N) {
    return {N, d.T, d.num_heads, d.head_dim, d.num_groups, d.state_size, d.dt_min, d.dt_max};
}

// x [N, I] with I = weight's elements, group_size dividing I; returns N.
int64_t check_gated_rmsnorm(const char* op, const Tensor& x, const Tensor& weight, int64_t group_size, Device device) {
    const int64_t I = weight.numel();
    MF_CHECK(I >= 1 && group_size >= 1 && I % group_size == 0, op, ": group_size ", group_size,
             " does not divide the weight's I = ", I, " channels");
    mamba_check_param(op, weight, "weight", device, I);
    MF_CHECK(x.ndim() >= 1 && x.dim(-1) == I, op, ": x ", shape_str(x.shape()), " does not have rows of I = ", I,
             " (weight)");
    const int64_t N = rows(x);
    mamba_check_act(op, x, "x", device, N, I);
    return N;
}

}  // namespace

void conv1d_silu_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                         const Tensor& doc_ids, int64_t T) {
    OpScope scope_("conv1d_silu_forward");
    const char* op = "conv1d_silu_forward";
    const Device device = device_of({&out, &inp, &weight, &bias, &doc_ids});
    const auto [N, C, K] = check_conv1d(op, inp, weight, bias, doc_ids, T, device);
    mamba_check_act(op, inp, "inp", device, N, C);
    mamba_check_act(op, out, "out", device, N, C);
    if (device == Device::cuda) return cuda_call(&CudaOps::conv1d_silu_forward, out, inp, weight, bias, doc_ids, T);
    cpu::conv1d_silu_forward(f(out), f(inp), f(weight), f(bias), i32(doc_ids), {N, T, C, K});
}

void conv1d_silu_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                          const Tensor& inp, const Tensor& weight, const Tensor& bias, const Tensor& doc_ids,
                          int64_t T) {
    OpScope scope_("conv1d_silu_backward");
    const char* op = "conv1d_silu_backward";
    const Device device = device_of({&dinp, &dweight, &dbias, &dout, &inp, &weight, &bias, &doc_ids});
    const auto [N, C, K] = check_conv1d(op, inp, weight, bias, doc_ids, T, device);
    for (const auto& [t, name] : {std::pair{&inp, "inp"}, {&dinp, "dinp"}, {&dout, "dout"}})
        mamba_check_act(op, *t, name, device, N, C);
    mamba_check_param(op, dweight, "dweight", device, C * K);
    MF_CHECK(defined(bias) || !defined(dbias), op, ": dbias given for a conv without a bias");
    if (defined(dbias)) mamba_check_param(op, dbias, "dbias", device, C);
    if (device == Device::cuda)
        return cuda_call(&CudaOps::conv1d_silu_backward, dinp, dweight, dbias, dout, inp, weight, bias, doc_ids, T);
    cpu::conv1d_silu_backward(f(dinp), f(dweight), f(dbias), f(dout), f(inp), f(weight), f(bias), i32(doc_ids),
                              {N, T, C, K});
}

int64_t ssd_chunk_states_numel(int64_t N, const SsdDims& d) {
    const char* op = "ssd_chunk_states_numel";
    check_ssd_dims(op, d);
    mamba_check_rows(op, N, d.T);
    const int64_t chunks = (d.T + d.chunk_size - 1) / d.chunk_size;
    return N / d.T * chunks * d.num_heads * d.head_dim * d.state_size;
}

void ssd_scan_forward(const Tensor& y, const Tensor& states, const Tensor& xbc, const Tensor& dt, const Tensor& dt_bias,
                      const Tensor& A_log, const Tensor& D, const Tensor& doc_ids, const SsdDims& d) {
    OpScope scope_("ssd_scan_forward");
    const char* op = "ssd_scan_forward";
    const Device device = device_of({&y, &states, &xbc, &dt, &dt_bias, &A_log, &D, &doc_ids});
    const auto [N, I, width] = check_ssd(op, d, xbc, dt, dt_bias, A_log, D, states, doc_ids, device);
    mamba_check_act(op, y, "y", device, N, I);
    if (device == Device::cuda)
        return cuda_call(&CudaOps::ssd_scan_forward, y, states, xbc, dt, dt_bias, A_log, D, doc_ids, d);
    // The sequential reference needs no chunk states: `states` is left as it is.
    cpu::ssd_scan_forward(f(y), f(xbc), f(dt), f(dt_bias), f(A_log), f(D), i32(doc_ids), ssd_shape(d, N));
}

void ssd_scan_backward(const Tensor& dxbc, const Tensor& ddt, const Tensor& ddt_bias, const Tensor& dA_log,
                       const Tensor& dD, const Tensor& dy, const Tensor& xbc, const Tensor& dt, const Tensor& dt_bias,
                       const Tensor& A_log, const Tensor& D, const Tensor& states, const Tensor& doc_ids,
                       const SsdDims& d) {
    OpScope scope_("ssd_scan_backward");
    const char* op = "ssd_scan_backward";
    const Device device =
        device_of({&dxbc, &ddt, &ddt_bias, &dA_log, &dD, &dy, &xbc, &dt, &dt_bias, &A_log, &D, &states, &doc_ids});
    const auto [N, I, width] = check_ssd(op, d, xbc, dt, dt_bias, A_log, D, states, doc_ids, device);
    mamba_check_act(op, dxbc, "dxbc", device, N, width);
    mamba_check_act(op, ddt, "ddt", device, N, d.num_heads);
    mamba_check_act(op, dy, "dy", device, N, I);
    for (const auto& [t, name] : {std::pair{&ddt_bias, "ddt_bias"}, {&dA_log, "dA_log"}, {&dD, "dD"}})
        mamba_check_param(op, *t, name, device, d.num_heads);
    if (device == Device::cuda)
        return cuda_call(&CudaOps::ssd_scan_backward, dxbc, ddt, ddt_bias, dA_log, dD, dy, xbc, dt, dt_bias, A_log, D,
                         states, doc_ids, d);
    cpu::ssd_scan_backward(f(dxbc), f(ddt), f(ddt_bias), f(dA_log), f(dD), f(dy), f(xbc), f(dt), f(dt_bias), f(A_log),
                           f(D), i32(doc_ids), ssd_shape(d, N));
}

void gated_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& z,
                           const Tensor& weight, int64_t group_size, float eps) {
    OpScope scope_("gated_rmsnorm_forward");
    const char* op = "gated_rmsnorm_forward";
    const Device device = device_of({&out, &rstd, &x, &z, &weight});
    const int64_t N = check_gated_rmsnorm(op, x, weight, group_size, device), I = weight.numel();
    mamba_check_act(op, z, "z", device, N, I);
    mamba_check_act(op, out, "out", device, N, I);
    mamba_check_f32(op, rstd, "rstd", N * (I / group_size));
    MF_CHECK(std::isfinite(eps) && eps >= 0.0f, op, ": eps ", eps, " must be finite and >= 0");
    if (device == Device::cuda)
        return cuda_call(&CudaOps::gated_rmsnorm_forward, out, rstd, x, z, weight, group_size, eps);
    cpu::gated_rmsnorm_forward(f(out), f(rstd), f(x), f(z), f(weight), N, I, group_size, eps);
}

void gated_rmsnorm_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight, const Tensor& dout,
                            const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& rstd,
                            int64_t group_size) {
    OpScope scope_("gated_rmsnorm_backward");
    const char* op = "gated_rmsnorm_backward";
    const Device device = device_of({&dx, &dz, &dweight, &dout, &x, &z, &weight, &rstd});
    const int64_t N = check_gated_rmsnorm(op, x, weight, group_size, device), I = weight.numel();
    for (const auto& [t, name] : {std::pair{&z, "z"}, {&dx, "dx"}, {&dz, "dz"}, {&dout, "dout"}})
        mamba_check_act(op, *t, name, device, N, I);
    mamba_check_param(op, dweight, "dweight", device, I);
    mamba_check_f32(op, rstd, "rstd", N * (I / group_size));
    if (device == Device::cuda)
        return cuda_call(&CudaOps::gated_rmsnorm_backward, dx, dz, dweight, dout, x, z, weight, rstd, group_size);
    cpu::gated_rmsnorm_backward(f(dx), f(dz), f(dweight), f(dout), f(x), f(z), f(weight), f(rstd), N, I, group_size);
}

// --- loss ------------------------------------------------------------------------------------------

void lm_head_cross_entropy(const Tensor& losses, const Tensor& dh, const Tensor& dw, const Tensor& h, const Tensor& w,
                           const Tensor& targets, float grad_scale, DType logits_dtype, bool accumulate,
                           const Tensor& grad_scale_by) {
    OpScope scope_("lm_head_cross_entropy");
    const int64_t N = rows(h), C = h.dim(-1), V = w.dim(0);
    MF_CHECK(losses.numel() == N && targets.numel() == N && w.dim(1) == C, "lm head shapes");
    MF_CHECK(logits_dtype == DType::f32 || logits_dtype == DType::bf16, "lm_head_cross_entropy: logits dtype ",
             dtype_name(logits_dtype), " (f32 or bf16)");
    MF_CHECK(!defined(grad_scale_by) || (grad_scale_by.dtype() == DType::f32 && grad_scale_by.numel() == 1),
             "lm_head_cross_entropy: grad_scale_by must be one f32 element");
    if (device_of({&losses, &dh, &dw, &h, &w, &targets, &grad_scale_by}) == Device::cuda)
        return cuda_call(&CudaOps::lm_head_cross_entropy, losses, dh, dw, h, w, targets, grad_scale, logits_dtype,
                         accumulate, grad_scale_by);
    if (!accumulate) {  // (the reference adds into its outputs)
        zero(dh);
        zero(dw);
    }
    if (defined(grad_scale_by)) grad_scale *= *f(grad_scale_by);  // (the same fp32 product as the kernel's)
    cpu::lm_head_cross_entropy(f(losses), f(dh), f(dw), f(h), f(w), i32(targets), N, C, V, grad_scale,
                               logits_dtype == DType::bf16);
}

size_t lm_head_cross_entropy_scratch_bytes(int64_t N, int64_t V, DType logits_dtype, Device device) {
    MF_CHECK(N >= 0 && V >= 1, "lm_head_cross_entropy_scratch_bytes: N = ", N, ", V = ", V);
    if (device == Device::cpu) return 0;
    return cuda_call(&CudaOps::lm_head_cross_entropy_scratch_bytes, N, V, logits_dtype, device);
}

size_t moe_permute_indices_scratch_bytes(int64_t N, int64_t K, int64_t num_experts, Device device) {
    MF_CHECK(N >= 0 && K >= 1 && num_experts >= 1, "moe_permute_indices_scratch_bytes: N = ", N, ", K = ", K,
             ", num_experts = ", num_experts);
    if (device == Device::cpu) return 0;
    return cuda_call(&CudaOps::moe_permute_indices_scratch_bytes, N, K, num_experts, device);
}

size_t moe_aux_stats_scratch_bytes(int64_t N, int64_t num_experts, Device device) {
    MF_CHECK(N >= 0 && num_experts >= 1, "moe_aux_stats_scratch_bytes: N = ", N, ", num_experts = ", num_experts);
    if (device == Device::cpu) return 0;
    return cuda_call(&CudaOps::moe_aux_stats_scratch_bytes, N, num_experts, device);
}

// --- optimizer -------------------------------------------------------------------------------------

void adamw_update(const Tensor& param, const Tensor& master, const Tensor& m, const Tensor& v, const Tensor& grad,
                  const AdamWHyper& h) {
    OpScope scope_("adamw_update");
    MF_CHECK(param.numel() == m.numel() && m.numel() == v.numel() && v.numel() == grad.numel(), "adamw sizes differ");
    if (device_of({&param, &master, &m, &v, &grad}) == Device::cuda)
        return cuda_call(&CudaOps::adamw_update, param, master, m, v, grad, h);
    MF_CHECK(!defined(master), "CPU parameters are their own master copy");
    cpu::adamw_update(f(param), f(m), f(v), f(grad), param.numel(),
                      cpu::AdamWParams{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.grad_scale});
}

// --- reductions ------------------------------------------------------------------------------------

double sum(const Tensor& x) {
    if (x.device() == Device::cuda) return cuda_call(&CudaOps::sum, x);
    double s = 0;
    const float* p = f(x);
    for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
    return s;
}

void scale_by(const Tensor& x, const Tensor& scale) {
    OpScope scope_("scale_by");
    MF_CHECK(scale.numel() == 1 && scale.dtype() == DType::f32, "scale_by: the scale is ", dtype_name(scale.dtype()),
             " ", shape_str(scale.shape()), ", expected one f32");
    if (device_of({&x, &scale}) == Device::cuda) return cuda_call(&CudaOps::scale_by, x, scale);
    const float s = scale.ptr<float>()[0];
    if (s != 1.0f) cpu::scale_inplace(f(x), s, x.numel());
}

double sum_squares(const Tensor& x) {
    OpScope scope_("sum_squares");
    if (x.device() == Device::cuda) return cuda_call(&CudaOps::sum_squares, x);
    return cpu::sum_squares(f(x), x.numel());
}

void sum_squares_to(const Tensor& sums, int64_t slot, const Tensor& x) {
    const int64_t slots[1] = {slot};
    sum_squares_to(sums, slots, std::span<const Tensor>(&x, 1));
}

void sum_squares_to(const Tensor& sums, std::span<const int64_t> slots, std::span<const Tensor> xs) {
    OpScope scope_("sum_squares");
    MF_CHECK(slots.size() == xs.size(), "sum_squares_to: ", slots.size(), " slots for ", xs.size(), " tensors");
    MF_CHECK(sums.dtype() == DType::f64, "sum_squares_to: ", dtype_name(sums.dtype()), " sums (f64 expected)");
    for (size_t i = 0; i < xs.size(); ++i) {
        (void)device_of({&sums, &xs[i]});
        MF_CHECK(slots[i] >= 0 && slots[i] < sums.numel(), "sum_squares_to: slot ", slots[i], " of ", sums.numel(),
                 " sums");
        MF_CHECK(xs[i].dtype() == xs[0].dtype(), "sum_squares_to: tensors of ", dtype_name(xs[0].dtype()), " and ",
                 dtype_name(xs[i].dtype()));
    }
    if (xs.empty()) return;
    if (sums.device() == Device::cuda) return cuda_call(&CudaOps::sum_squares_to, sums, slots, xs);
    for (size_t i = 0; i < xs.size(); ++i) sums.ptr<double>()[slots[i]] = cpu::sum_squares(f(xs[i]), xs[i].numel());
}

bool all_finite(const Tensor& x) {
    if (x.device() == Device::cuda) return cuda_call(&CudaOps::all_finite, x);
    return cpu::all_finite(f(x), x.numel());
}

}  // namespace mf::ops
