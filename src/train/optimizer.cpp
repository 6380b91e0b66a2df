#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>

#include "ops/ops.h"
#include "train/distributed.h"

namespace mf::train {

namespace {

constexpr int64_t kChunkAlign = 64;  // elements; keeps every chunk boundary 128-byte aligned in bf16

// Elements [first, first + n) of a flat tensor's storage, as a 1-D tensor.
Tensor flat_range(const Tensor& flat, int64_t first, int64_t n) {
    char* base = static_cast<char*>(flat.data()) + static_cast<size_t>(first) * dtype_size(flat.dtype());
    return Tensor(base, flat.dtype(), {n}, flat.device());
}

void to_host_f32(float* out, const Tensor& t) {
    if (t.numel() == 0) return;
    if (t.dtype() == DType::f32) {
        ops::copy_to_host(out, t);
        return;
    }
    Buffer staging(static_cast<size_t>(t.numel()) * sizeof(float), t.device());
    const Tensor f32 = staging.as(DType::f32, {t.numel()});
    ops::cast(f32, t);
    ops::copy_to_host(out, f32);
}

void from_host_f32(const Tensor& t, const float* in) {
    if (t.numel() == 0) return;
    if (t.dtype() == DType::f32) {
        ops::copy_from_host(t, in);
        return;
    }
    Buffer staging(static_cast<size_t>(t.numel()) * sizeof(float), t.device());
    const Tensor f32 = staging.as(DType::f32, {t.numel()});
    ops::copy_from_host(f32, in);
    ops::cast(t, f32);
    ops::synchronize(t.device());
}

}  // namespace

AdamW::AdamW(model::CausalLM& model, const Recipe::Optim& optim, bool mixed, parallel::Communicator* replicated_group,
             parallel::Communicator* expert_group)
    : model_(model), optim_(optim), total_(model.num_params()) {
    const int64_t split = model.params().expert_offset();
    parallel::Communicator* groups[2] = {replicated_group, expert_group};
    for (int k = 0; k < 2; ++k)
        if (groups[k] != nullptr && groups[k]->size() > 1)
            regions_[k] = {groups[k], groups[k]->rank(), groups[k]->size()};
    // The segments: the parameters in buffer order, in runs of one stage within one region (a run
    // covers its parameters' padding, so padding never splits it).
    const auto& specs = model.params().specs();
    std::vector<size_t> order(specs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return specs[x].offset < specs[y].offset; });
    for (const size_t i : order) {
        const model::ParamSpec& spec = specs[i];
        if (spec.numel == 0) continue;
        const int region = spec.offset >= split ? 1 : 0;
        const int64_t stage = model.param_stage(spec);
        if (!segments_.empty() && segments_.back().end == spec.offset && segments_.back().stage == stage &&
            segments_.back().region == region) {
            segments_.back().end += spec.extent();
            segments_.back().specs.push_back(i);
            continue;
        }
        segments_.push_back(
            {.begin = spec.offset, .end = spec.offset + spec.extent(), .stage = stage, .region = region, .specs = {i}});
    }
    for (size_t s = 0; s < segments_.size(); ++s) {
        Segment& seg = segments_[s];
        const Region& r = regions_[seg.region];
        const int64_t per = (seg.end - seg.begin + r.size - 1) / r.size;
        seg.chunk = (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
        const int64_t lo = seg.lo(r.rank), hi = seg.hi(r.rank);
        if (lo >= hi) continue;
        owned_.push_back({lo, hi, seg.region, r.group != nullptr});
        owned_segment_.push_back(s);
        owned_elems_ += hi - lo;
    }
    const Device dev = model.device();
    const bool master = mixed && dev == Device::cuda;
    state_dtype_ = (dev == Device::cpu || master) ? DType::f32 : DType::bf16;
    const size_t bytes = static_cast<size_t>(owned_elems_) * dtype_size(state_dtype_);
    m_ = Buffer(bytes, dev);
    v_ = Buffer(bytes, dev);
    m_.zero();
    v_.zero();
    if (master) {
        master_ = Buffer(static_cast<size_t>(owned_elems_) * sizeof(float), dev);
        for_owned([&](const Range& r, int64_t at) {
            ops::cast(master_.as(DType::f32, {r.end - r.begin}, static_cast<size_t>(at) * sizeof(float)),
                      flat_range(model.params_tensor(), r.begin, r.end - r.begin));
        });
    }
    for (const auto& spec : model.params().specs()) {
        bool decay = spec.role != model::ParamRole::buffer;  // a buffer has no gradient: no update at all
        for (const auto& pattern : optim.no_decay)
            if (matches_pattern(pattern, spec.name)) decay = false;
        decay_.push_back(decay);
    }
}

template <typename F>
void AdamW::for_owned(F&& f) const {
    int64_t at = 0;
    for (const Range& r : owned_) {
        f(r, at);
        at += r.end - r.begin;
    }
}

size_t AdamW::state_bytes() const { return m_.nbytes() + v_.nbytes() + master_.nbytes(); }

void AdamW::step(double lr, double grad_scale) {
    ++step_;
    const auto& specs = model_.params().specs();
    const Tensor params = model_.params_tensor(), grads = model_.grads_tensor();
    const size_t es = dtype_size(state_dtype_);
    // The part of parameter i inside owned range r (its state at `at`), updated.
    auto update_spec = [&](size_t i, const Range& r, int64_t at) {
        const int64_t a = std::max(r.begin, specs[i].offset), b = std::min(r.end, specs[i].offset + specs[i].numel);
        if (a >= b) return;
        const int64_t n = b - a;
        const size_t off = static_cast<size_t>(at + a - r.begin);
        const Tensor m = m_.as(state_dtype_, {n}, off * es), v = v_.as(state_dtype_, {n}, off * es);
        const Tensor master = master_.data() != nullptr ? master_.as(DType::f32, {n}, off * sizeof(float)) : Tensor();
        const ops::AdamWHyper h{static_cast<float>(lr),
                                static_cast<float>(optim_.beta1),
                                static_cast<float>(optim_.beta2),
                                static_cast<float>(optim_.eps),
                                decay_[i] ? static_cast<float>(optim_.weight_decay) : 0.0f,
                                step_,
                                static_cast<float>(grad_scale)};
        ops::adamw_update(flat_range(params, a, n), master, m, v, flat_range(grads, a, n), h);
    };
    // Segment by segment, in the order the forward reads them (see the header): this rank's chunk is
    // updated, then, in a sharded region, the segment's chunks go from their owners to the group on
    // the side stream and the model's stage waits for that broadcast; in a region no other rank
    // takes part in, the update itself goes to the background stream and the stage waits for it.
    const Device dev = model_.device();
    size_t next = 0;  // the next owned range
    int64_t at = 0;   // its state's offset
    for (size_t s = 0; s < segments_.size(); ++s) {
        const Segment& seg = segments_[s];
        const Region& g = regions_[seg.region];
        const bool mine = next < owned_.size() && owned_segment_[next] == s;
        auto update = [&] {
            if (mine)
                for (const size_t i : seg.specs) update_spec(i, owned_[next], at);
        };
        if (g.group == nullptr) {
            if (!mine) continue;  // (an empty segment; owned ranges are never empty)
            const ops::BackgroundTicket t = ops::background(dev, update);
            if (t != 0) model_.params_pending(seg.stage, [dev, t] { ops::wait_background(dev, t); });
        } else {
            update();
            std::vector<int64_t> pieces(static_cast<size_t>(g.size) + 1);
            for (int r = 0; r <= g.size; ++r)
                pieces[static_cast<size_t>(r)] = (r < g.size ? seg.lo(r) : seg.end) - seg.begin;
            const uint64_t t = g.group->broadcast_each_async(flat_range(params, seg.begin, seg.end - seg.begin).data(),
                                                             pieces, model_.param_dtype());
            if (t != 0) model_.params_pending(seg.stage, [group = g.group, t] { group->join_async(t); });
        }
        if (mine) {
            at += owned_[next].end - owned_[next].begin;
            ++next;
        }
    }
}

AdamW::~AdamW() {
    // The model may outlive the groups whose broadcasts it still waits for: join them now.
    try {
        (void)model_.params_tensor();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "AdamW: %s\n", e.what());
    }
}

void AdamW::get_owned(std::vector<float>& master, std::vector<float>& m, std::vector<float>& v) const {
    (void)model_.params_tensor();  // after any background update (it wrote m and v too)
    master.assign(static_cast<size_t>(owned_elems_), 0.0f);
    m.assign(static_cast<size_t>(owned_elems_), 0.0f);
    v.assign(static_cast<size_t>(owned_elems_), 0.0f);
    for_owned([&](const Range& r, int64_t at) {
        const int64_t n = r.end - r.begin;
        const size_t es = dtype_size(state_dtype_);
        if (master_.data() != nullptr)
            to_host_f32(master.data() + at, master_.as(DType::f32, {n}, static_cast<size_t>(at) * sizeof(float)));
        else
            to_host_f32(master.data() + at, flat_range(model_.params_tensor(), r.begin, n));
        to_host_f32(m.data() + at, m_.as(state_dtype_, {n}, static_cast<size_t>(at) * es));
        to_host_f32(v.data() + at, v_.as(state_dtype_, {n}, static_cast<size_t>(at) * es));
    });
}

void AdamW::set_state(const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v) {
    MF_CHECK(static_cast<int64_t>(master.size()) == total_ && static_cast<int64_t>(m.size()) == total_ &&
                 static_cast<int64_t>(v.size()) == total_,
             "optimizer state size mismatch");
    model_.set_params_from_host(master.data());  // the bf16 parameters are the rounded master (waits for a
                                                 // background update, which also writes m and v)
    const size_t es = dtype_size(state_dtype_);
    for_owned([&](const Range& r, int64_t at) {
        const int64_t n = r.end - r.begin;
        if (master_.data() != nullptr)
            from_host_f32(master_.as(DType::f32, {n}, static_cast<size_t>(at) * sizeof(float)),
                          master.data() + r.begin);
        from_host_f32(m_.as(state_dtype_, {n}, static_cast<size_t>(at) * es), m.data() + r.begin);
        from_host_f32(v_.as(state_dtype_, {n}, static_cast<size_t>(at) * es), v.data() + r.begin);
    });
}

std::vector<double> gradient_square_sums(model::CausalLM& model, const Tensor& sums, const std::vector<bool>& done) {
    const auto& specs = model.params().specs();
    const int64_t n = static_cast<int64_t>(specs.size());
    Buffer own;
    Tensor slots = sums;
    if (slots.data() == nullptr) {
        own = Buffer(static_cast<size_t>(n) * sizeof(double), model.device());
        slots = own.as(DType::f64, {n});
    }
    MF_CHECK(slots.numel() == n && slots.dtype() == DType::f64 && (done.empty() || done.size() == specs.size()),
             "gradient_square_sums: ", slots.numel(), " slots and ", done.size(), " flags for ", n, " parameters");
    std::vector<size_t> which;
    for (size_t i = 0; i < specs.size(); ++i)
        if (done.empty() || !done[i]) which.push_back(i);
    gradient_square_sums_to(slots, model.grads_tensor(), specs, which);
    std::vector<double> out(static_cast<size_t>(n));
    ops::copy_to_host(out.data(), slots);
    return out;
}

void gradient_square_sums_to(const Tensor& sums, const Tensor& grads, const std::vector<model::ParamSpec>& specs,
                             std::span<const size_t> which) {
    std::vector<int64_t> slots;
    std::vector<Tensor> parts;
    for (const size_t i : which) {
        slots.push_back(static_cast<int64_t>(i));
        parts.push_back(flat_range(grads, specs[i].offset, specs[i].numel));
    }
    ops::sum_squares_to(sums, slots, parts);
}

double grad_norm(model::CausalLM& model, DistContext* dist) {
    const std::vector<double> sums = dist != nullptr ? dist->gradient_square_sums(model) : gradient_square_sums(model);
    const auto& specs = model.params().specs();
    double replicated = 0, experts = 0;
    for (size_t i = 0; i < specs.size(); ++i) (specs[i].is_expert ? experts : replicated) += sums[i];
    if (dist != nullptr && dist->ep_size() > 1) {
        // Replicated region: the same on every rank, counted once; experts: summed over the EP group.
        const double one[1] = {experts};
        experts = dist->sum_f64(one, Group::ep)[0];
    }
    return std::sqrt(replicated + experts);
}

double clip_coefficient(double norm, double max_norm) {
    if (max_norm <= 0 || !std::isfinite(norm)) return 1.0;
    return std::min(1.0, max_norm / (norm + 1e-6));
}

}  // namespace mf::train
