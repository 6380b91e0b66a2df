// DistContext: rendezvous, communicators and the trainer's collectives (see distributed.h).
// NOTE: NCCL collectives take device memory, so the scalar collectives stage their few bytes
// through a device buffer there; the TCP ones work on the host values directly.
#include "train/distributed.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "ops/ops.h"
#include "parallel/rendezvous.h"
#include "parallel/tcp_communicator.h"
#if defined(MOEFORGE_WITH_NCCL)
#include "parallel/nccl_communicator.h"
#endif
#include "train/optimizer.h"

namespace mf::train {

struct DistContext::Impl {
    std::unique_ptr<parallel::Rendezvous> rendezvous;  // kept alive for NCCL (share_blob)
    std::unique_ptr<parallel::Communicator> world;
    parallel::ProcessGroups groups;
};

DistContext::~DistContext() = default;

std::unique_ptr<DistContext> DistContext::from_environment(const Recipe& recipe, Device device) {
    auto ctx = std::make_unique<DistContext>();
    ctx->device_ = device;
    const parallel::DistEnv env = parallel::dist_env_from_process();
    if (env.world_size <= 1) {
        if (recipe.dist.ep_size != 1)
            fail(recipe.source, ": dist.ep_size is ", recipe.dist.ep_size,
                 " but this is a single process (WORLD_SIZE unset or 1); start the run with moeforge launch");
        return ctx;
    }
    if (recipe.dist.ep_size > env.world_size || env.world_size % recipe.dist.ep_size != 0)
        fail(recipe.source, ": dist.ep_size (", recipe.dist.ep_size, ") must divide the world size (", env.world_size,
             ")");
    ctx->rank_ = env.rank;
    ctx->impl_ = std::make_unique<Impl>();
    if (device == Device::cuda) {
#if defined(MOEFORGE_WITH_NCCL)
        ctx->impl_->rendezvous = std::make_unique<parallel::Rendezvous>(env, recipe.dist.timeout_s, nullptr);
        ctx->impl_->world =
            std::make_unique<parallel::NcclCommunicator>(*ctx->impl_->rendezvous, recipe.dist.timeout_s);
#else
        fail(recipe.source,
             ": a multi-process run on the cuda device needs NCCL, and this build has none "
             "(set device: cpu for the TCP backend)");
#endif
    } else {
        ctx->impl_->world = std::make_unique<parallel::TcpCommunicator>(env, recipe.dist.timeout_s);
    }
    ctx->impl_->groups = parallel::make_process_groups(*ctx->impl_->world, static_cast<int>(recipe.dist.ep_size));
    // Host waits on the GPU are bounded too: a stuck collective ends the rank, never hangs it.
    if (device == Device::cuda) set_device_wait_limit(recipe.dist.timeout_s, ctx->rank_);
    ctx->layout_ = ctx->impl_->groups.layout;
    return ctx;
}

std::string DistContext::describe() const {
    if (!distributed()) return "";
    return "world " + std::to_string(world_size()) + " (dp " + std::to_string(layout_.dp_size()) + " x ep " +
           std::to_string(ep_size()) + ", " + impl_->world->backend() + ")";
}

namespace {

// all_gather of `count` host elements per rank through `comm`: direct for TCP, staged through
// device buffers for NCCL (whose collectives take device memory). recv holds size() * count.
void all_gather_host(parallel::Communicator& comm, Device device, const void* send, void* recv, int64_t count,
                     DType dtype) {
    const int64_t n = static_cast<int64_t>(comm.size());
    if (device != Device::cuda) {
        comm.all_gather(send, recv, count, dtype);
        return;
    }
    const Buffer dsend(static_cast<size_t>(count) * dtype_size(dtype), Device::cuda);
    const Buffer drecv(static_cast<size_t>(count * n) * dtype_size(dtype), Device::cuda);
    ops::copy_from_host(dsend.as(dtype, {count}), send);
    comm.all_gather(dsend.data(), drecv.data(), count, dtype);
    comm.synchronize();
    ops::copy_to_host(recv, drecv.as(dtype, {count * n}));
}

}  // namespace

std::vector<double> DistContext::sum_f64(std::span<const double> values, Group g) {
    std::vector<double> sums(values.begin(), values.end());
    if (!distributed()) return sums;
    // Doubles travel as their bit patterns (i64), exactly; the sum is done here in rank order.
    parallel::Communicator& comm = *group(g);
    const int64_t n = static_cast<int64_t>(values.size());
    const int size = comm.size();
    std::vector<int64_t> send(values.size()), recv(values.size() * static_cast<size_t>(size));
    std::memcpy(send.data(), values.data(), values.size() * sizeof(double));
    all_gather_host(comm, device_, send.data(), recv.data(), n, DType::i64);
    for (size_t i = 0; i < sums.size(); ++i) {
        double s = 0;
        for (int r = 0; r < size; ++r) {
            double x;
            std::memcpy(&x, &recv[static_cast<size_t>(r) * values.size() + i], sizeof x);
            s += x;
        }
        sums[i] = s;
    }
    return sums;
}

int64_t DistContext::sum_i64(int64_t value) {
    if (!distributed()) return value;
    std::vector<int64_t> recv(static_cast<size_t>(world_size()));
    all_gather_host(*impl_->world, device_, &value, recv.data(), 1, DType::i64);
    int64_t s = 0;
    for (const int64_t x : recv) s += x;
    return s;
}

// Starts the reduction of the given specs' gradients (merged into contiguous ranges per region):
// the replicated region over the world, the expert region over the DP group (the world without EP).
void DistContext::reduce_specs(model::CausalLM& model, const std::vector<size_t>& which) {
    const auto& specs = model.params().specs();
    const DType dt = model.grad_dtype();
    char* base = static_cast<char*>(model.grads_tensor_in_backward().data());
    std::vector<std::pair<int64_t, int64_t>> ranges[2];  // [replicated, expert] (first, end)
    for (const size_t i : which) {
        if (reduced_[i]) continue;
        reduced_[i] = true;
        auto& r = ranges[specs[i].is_expert ? 1 : 0];
        const int64_t a = specs[i].offset, b = a + specs[i].extent();  // padding included: ranges merge
        if (!r.empty() && r.back().second == a)
            r.back().second = b;
        else if (!r.empty() && r.back().first == b)
            r.back().first = a;
        else
            r.emplace_back(a, b);
    }
    for (int region = 0; region < 2; ++region) {
        parallel::Communicator* comm = region == 1 && ep_size() > 1 ? impl_->groups.dp.get() : impl_->world.get();
        if (comm->size() == 1) continue;
        for (const auto& [a, b] : ranges[region])
            comm->all_reduce_sum_async(base + static_cast<size_t>(a) * dtype_size(dt), b - a, dt);
    }
}

void DistContext::begin_grad_sync(model::CausalLM& model) {
    const auto& specs = model.params().specs();
    const bool dist = distributed();
    if (dist) reduced_.assign(specs.size(), false);
    if (!squares_done_.empty()) squares_done_.assign(specs.size(), false);  // sums of an earlier step are stale
    // Gradients final as the backward stores them have their square sums formed then: the stacked
    // expert ones by the MoE blocks' weight-gradient GEMMs (CausalLM::set_grad_square_sums), the
    // others by start_square_sums as their block finishes.
    std::vector<bool> experts(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) experts[i] = specs[i].is_expert && final_in_backward(specs[i]);
    if (std::find(experts.begin(), experts.end(), true) != experts.end()) {
        ensure_square_sums(model);
        const std::vector<bool> filled =
            model.set_grad_square_sums(square_sums_.as(DType::f64, {static_cast<int64_t>(specs.size())}), experts);
        for (size_t i = 0; i < filled.size(); ++i)
            if (filled[i]) squares_done_[i] = true;
    }
    // The specs each hook call completes: layer l's, the head's and the embedding's (by role).
    const int64_t L = model.spec().num_layers();
    std::vector<std::vector<size_t>> by_layer(static_cast<size_t>(L));
    std::vector<size_t> head, embedding;
    for (size_t i = 0; i < specs.size(); ++i) {
        const bool is_embedding = specs[i].role == model::ParamRole::embedding;
        if (dist && embedding_gathered_ && is_embedding) {
            reduced_[i] = true;  // complete on every rank already (gather_embedding_grads)
            continue;
        }
        if (specs[i].layer >= 0) {
            by_layer[static_cast<size_t>(specs[i].layer)].push_back(i);
        } else if (is_embedding) {
            embedding.push_back(i);
        } else {
            head.push_back(i);  // the final norm, the untied head
        }
    }
    model.set_grad_hook([this, &model, dist, by_layer, head, embedding](int64_t id) {
        const bool with_head = id == model::CausalLM::kGradsHead || id == model::CausalLM::kGradsEmbeddingAndHead;
        const bool with_embedding =
            id == model::CausalLM::kGradsEmbedding || id == model::CausalLM::kGradsEmbeddingAndHead;
        if (dist) {
            if (id >= 0) reduce_specs(model, by_layer[static_cast<size_t>(id)]);
            if (with_head) reduce_specs(model, head);
            if (with_embedding) reduce_specs(model, embedding);
        }
        if (id >= 0) start_square_sums(model, by_layer[static_cast<size_t>(id)]);
        if (with_head) start_square_sums(model, head);
        if (with_embedding) start_square_sums(model, embedding);
    });
}

void DistContext::finish_grad_sync(model::CausalLM& model) {
    model.set_grad_hook({});
    model.set_grad_square_sums(Tensor(), {});
    if (!distributed()) return;
    std::vector<size_t> rest;
    for (size_t i = 0; i < reduced_.size(); ++i)
        if (!reduced_[i]) rest.push_back(i);
    if (!rest.empty()) reduce_specs(model, rest);
    impl_->world->wait_async();
    if (impl_->groups.dp) impl_->groups.dp->wait_async();
    reduced_.clear();
}

void DistContext::gather_embedding_grads(model::CausalLM& model) {
    if (!distributed() || model.spec().tie_word_embeddings) return;
    parallel::Communicator* world = impl_->world.get();
    model.set_embedding_row_gather(
        [world](const Tensor& all, const Tensor& mine) {
            MF_CHECK(all.numel() == mine.numel() * world->size() && all.dtype() == mine.dtype(),
                     "embedding row gather: ", all.numel(), " slots for ", world->size(), " x ", mine.numel());
            world->all_gather(mine.data(), all.data(), mine.numel(), mine.dtype());
        },
        world->size());
    embedding_gathered_ = true;
}

bool DistContext::final_in_backward(const model::ParamSpec& spec) const {
    if (!distributed()) return true;
    // The replicated gradients wait for their all-reduce (another stream); the expert ones are final
    // when no other rank holds the same experts.
    return spec.is_expert && ep_size() > 1 && impl_->groups.dp && impl_->groups.dp->size() == 1;
}

void DistContext::ensure_square_sums(const model::CausalLM& model) {
    const size_t n = model.params().specs().size();
    if (squares_done_.size() == n) return;
    squares_done_.assign(n, false);
    square_sums_ = Buffer(n * sizeof(double), model.device());
}

void DistContext::start_square_sums(model::CausalLM& model, const std::vector<size_t>& which) {
    const auto& specs = model.params().specs();
    std::vector<size_t> todo;
    for (const size_t i : which)
        if (final_in_backward(specs[i]) && (squares_done_.size() != specs.size() || !squares_done_[i]))
            todo.push_back(i);
    if (todo.empty()) return;
    ensure_square_sums(model);
    const Tensor g = model.grads_tensor_in_backward(),
                 sums = square_sums_.as(DType::f64, {static_cast<int64_t>(specs.size())});
    squares_ticket_ = ops::background(model.device(), [&] { gradient_square_sums_to(sums, g, specs, todo); });
    for (const size_t i : todo) squares_done_[i] = true;
}

std::vector<double> DistContext::gradient_square_sums(model::CausalLM& model) {
    const auto& specs = model.params().specs();
    if (squares_done_.size() != specs.size()) return train::gradient_square_sums(model);
    if (squares_ticket_ != 0) ops::wait_background(model.device(), squares_ticket_);
    squares_ticket_ = 0;
    std::vector<double> out = train::gradient_square_sums(
        model, square_sums_.as(DType::f64, {static_cast<int64_t>(specs.size())}), squares_done_);
    squares_done_.assign(specs.size(), false);
    return out;
}

model::ExpertShard DistContext::expert_shard() const { return {layout_.ep_rank(rank_), layout_.ep_size}; }

namespace {

// One stacked expert tensor of the whole model (`full_spec`), gathered over the EP group onto its
// rank 0 (`out`: S · n floats there, ignored elsewhere) from each rank's slice of n floats.
void gather_expert_tensor(parallel::Communicator& ep, Device device, const float* mine, int64_t n, float* out) {
    const int64_t S = ep.size();
    const bool root = ep.rank() == 0;
    std::vector<int64_t> send_counts(static_cast<size_t>(S), 0), send_offsets(static_cast<size_t>(S), 0);
    std::vector<int64_t> recv_counts(static_cast<size_t>(S), 0), recv_offsets(static_cast<size_t>(S), 0);
    send_counts[0] = n;
    for (int64_t p = 0; p < S; ++p) {
        recv_counts[static_cast<size_t>(p)] = root ? n : 0;
        recv_offsets[static_cast<size_t>(p)] = root ? p * n : 0;  // rank p's experts at p·n
    }
    if (device != Device::cuda) {
        std::vector<float> dummy(1);
        ep.all_to_all_v(mine, send_counts, send_offsets, root ? out : dummy.data(), recv_counts, recv_offsets,
                        DType::f32);
        return;
    }
    const Buffer dsend(static_cast<size_t>(n) * sizeof(float), Device::cuda);
    const Buffer drecv(static_cast<size_t>(root ? S * n : 1) * sizeof(float), Device::cuda);
    ops::copy_from_host(dsend.as(DType::f32, {n}), mine);
    ep.all_to_all_v(dsend.data(), send_counts, send_offsets, drecv.data(), recv_counts, recv_offsets, DType::f32);
    ep.synchronize();
    if (root) ops::copy_to_host(out, drecv.as(DType::f32, {S * n}));
}

}  // namespace

bool DistContext::serves_export() const { return layout_.ep_size > 1 && layout_.dp_rank(rank_) == 0 && rank_ != 0; }

train::ParamSource DistContext::export_source(const model::CausalLM& model, const std::vector<float>& local) {
    const model::ParamTable& mine = model.params();
    MF_CHECK(static_cast<int64_t>(local.size()) == mine.total(), "export_source: ", local.size(),
             " values, the model holds ", mine.total());
    MF_CHECK(rank_ == 0, "export_source: the export is written by world rank 0, not rank ", rank_);
    if (!model.expert_shard().sharded())
        return [&local](int64_t offset, int64_t n, float* out) {
            std::copy(local.begin() + offset, local.begin() + offset + n, out);
        };
    // The stacked tensor last gathered, whole; the writer asks for its experts one after the other.
    struct Cache {
        std::string name;
        std::vector<float> values;
    };
    auto cache = std::make_shared<Cache>();
    auto full = std::make_shared<model::ParamTable>(model::model_param_table(model.spec()));
    parallel::Communicator* ep = ep_group();
    const Device device = device_;
    return [&model, &local, cache, full, ep, device](int64_t offset, int64_t n, float* out) {
        const model::ParamSpec* spec = nullptr;
        for (const auto& s : full->specs())
            if (offset >= s.offset && offset < s.offset + s.numel) spec = &s;
        MF_CHECK(spec != nullptr && offset + n <= spec->offset + spec->numel, "export_source: range [", offset, ", ",
                 offset + n, ") is not inside one parameter");
        const model::ParamSpec& local_spec = model.params().get(spec->name);
        if (!spec->is_expert) {
            const float* src = local.data() + local_spec.offset + (offset - spec->offset);
            std::copy(src, src + n, out);
            return;
        }
        if (cache->name != spec->name) {
            cache->values.assign(static_cast<size_t>(spec->numel), 0.0f);
            gather_expert_tensor(*ep, device, local.data() + local_spec.offset, local_spec.numel, cache->values.data());
            cache->name = spec->name;
        }
        const float* src = cache->values.data() + (offset - spec->offset);
        std::copy(src, src + n, out);
    };
}

void DistContext::serve_export(const model::CausalLM& model, const std::vector<float>& local) {
    MF_CHECK(serves_export(), "serve_export: rank ", rank_, " takes no part in the export");
    MF_CHECK(static_cast<int64_t>(local.size()) == model.params().total(), "serve_export: ", local.size(),
             " values, the model holds ", model.params().total());
    // The writer reaches the stacked tensors in table order (save_hf_model), so the gathers pair up.
    for (const auto& spec : model.params().specs())
        if (spec.is_expert) gather_expert_tensor(*ep_group(), device_, local.data() + spec.offset, spec.numel, nullptr);
}

parallel::Communicator* DistContext::ep_group() const { return impl_ ? impl_->groups.ep.get() : nullptr; }
parallel::Communicator* DistContext::dp_group() const { return impl_ ? impl_->groups.dp.get() : nullptr; }
parallel::Communicator* DistContext::group(Group g) const {
    if (!impl_) return nullptr;
    switch (g) {
        case Group::ep:
            return impl_->groups.ep.get();
        case Group::dp:
            return impl_->groups.dp.get();
        case Group::world:
            break;
    }
    return impl_->world.get();
}

void DistContext::barrier() {
    if (!distributed()) return;
    impl_->world->barrier();
}

}  // namespace mf::train
