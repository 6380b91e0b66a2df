// DistContext: rendezvous, communicators and the trainer's collectives (see distributed.h).
// NOTE: NCCL collectives take device memory, so the scalar collectives stage their few bytes
// through a device buffer there; the TCP ones work on the host values directly.
#include "train/distributed.h"

#include <cstring>

#include "core/check.h"
#include "ops/ops.h"
#include "parallel/rendezvous.h"
#include "parallel/tcp_communicator.h"
#if defined(MOEFORGE_WITH_NCCL)
#include "parallel/nccl_communicator.h"
#endif

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
    ctx->layout_ = ctx->impl_->groups.layout;
    return ctx;
}

std::string DistContext::describe() const {
    if (!distributed()) return "";
    return "world " + std::to_string(world_size()) + " (dp " + std::to_string(layout_.dp_size()) + " x ep " +
           std::to_string(ep_size()) + ", " + impl_->world->backend() + ")";
}

std::vector<double> DistContext::sum_f64(std::span<const double> values) {
    std::vector<double> sums(values.begin(), values.end());
    if (!distributed()) return sums;
    // Doubles travel as their bit patterns (i64), exactly; the sum is done here in rank order.
    const int64_t n = static_cast<int64_t>(values.size());
    const int world = world_size();
    std::vector<int64_t> send(values.size()), recv(values.size() * static_cast<size_t>(world));
    std::memcpy(send.data(), values.data(), values.size() * sizeof(double));
    parallel::Communicator& comm = *impl_->world;
    if (device_ == Device::cuda) {
        const Buffer dsend(send.size() * sizeof(int64_t), Device::cuda);
        const Buffer drecv(recv.size() * sizeof(int64_t), Device::cuda);
        ops::copy_from_host(dsend.as(DType::i64, {n}), send.data());
        comm.all_gather(dsend.data(), drecv.data(), n, DType::i64);
        comm.synchronize();
        ops::copy_to_host(recv.data(), drecv.as(DType::i64, {n * world}));
    } else {
        comm.all_gather(send.data(), recv.data(), n, DType::i64);
    }
    for (size_t i = 0; i < sums.size(); ++i) {
        double s = 0;
        for (int r = 0; r < world; ++r) {
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
    const int world = world_size();
    std::vector<int64_t> recv(static_cast<size_t>(world));
    parallel::Communicator& comm = *impl_->world;
    if (device_ == Device::cuda) {
        const Buffer dsend(sizeof(int64_t), Device::cuda);
        const Buffer drecv(recv.size() * sizeof(int64_t), Device::cuda);
        ops::copy_from_host(dsend.as(DType::i64, {1}), &value);
        comm.all_gather(dsend.data(), drecv.data(), 1, DType::i64);
        comm.synchronize();
        ops::copy_to_host(recv.data(), drecv.as(DType::i64, {world}));
    } else {
        comm.all_gather(&value, recv.data(), 1, DType::i64);
    }
    int64_t s = 0;
    for (const int64_t x : recv) s += x;
    return s;
}

void DistContext::all_reduce_grads(model::Qwen3Moe& model) {
    if (!distributed()) return;
    const Tensor g = model.grads_tensor();
    impl_->world->all_reduce_sum(g.data(), model.params().total(), model.grad_dtype());
    impl_->world->synchronize();
}

parallel::Communicator* DistContext::ep_group() const { return impl_ ? impl_->groups.ep.get() : nullptr; }

void DistContext::barrier() {
    if (!distributed()) return;
    impl_->world->barrier();
}

}  // namespace mf::train
