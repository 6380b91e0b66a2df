// PeerExchange (see peer_exchange.h). Empty unless MOEFORGE_WITH_NCCL is defined (CMake globs every
// src/parallel/*.cpp into the library).
#if defined(MOEFORGE_WITH_NCCL)

#include "parallel/peer_exchange.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/check.h"
#include "core/cuda_check.h"
#include "kernels/cuda/peer_flags.cuh"
#include "parallel/nccl_communicator.h"

namespace mf::parallel {

namespace {

// What every rank tells the others, twice: first where it is and what it wants, then its window.
struct Info {
    char host[64];
    char bus_id[32];
    int32_t wanted;  // MOEFORGE_PEER_EXCHANGE is not 0
    int32_t reach;   // (second round) this rank can map every peer's memory
    uint64_t slot_bytes;
    cudaIpcMemHandle_t window;
};
static_assert(sizeof(Info) % 4 == 0);

// Every rank's Info, through the communicator (device buffers, NCCL all_gather).
std::vector<Info> gather(NcclCommunicator& comm, const Info& mine) {
    const size_t n = static_cast<size_t>(comm.size());
    void* dev = nullptr;
    MF_CHECK_CUDA(cudaMalloc(&dev, sizeof(Info) * (n + 1)));
    std::vector<Info> all(n);
    try {
        MF_CHECK_CUDA(cudaMemcpy(dev, &mine, sizeof(Info), cudaMemcpyHostToDevice));
        comm.all_gather(dev, static_cast<char*>(dev) + sizeof(Info), sizeof(Info) / 4, DType::i32);
        comm.synchronize();
        MF_CHECK_CUDA(
            cudaMemcpy(all.data(), static_cast<char*>(dev) + sizeof(Info), sizeof(Info) * n, cudaMemcpyDeviceToHost));
    } catch (...) {
        cudaFree(dev);
        throw;
    }
    cudaFree(dev);
    return all;
}

size_t slot_from_env(size_t requested) {
    if (requested != 0) return requested;
    const char* env = std::getenv("MOEFORGE_PEER_SLOT_MB");
    if (env == nullptr || *env == '\0') return PeerExchange::kDefaultSlotBytes;
    char* end = nullptr;
    const long long mb = std::strtoll(env, &end, 10);
    MF_CHECK(end != env && *end == '\0' && mb > 0 && mb <= (1 << 20),
             "MOEFORGE_PEER_SLOT_MB: expected a positive "
             "number of MiB, got '",
             env, "'");
    return static_cast<size_t>(mb) << 20;
}

PeerExchange::Copies copies_from_env() {
    const char* env = std::getenv("MOEFORGE_PEER_COPY");
    if (env == nullptr || *env == '\0' || std::strcmp(env, "ce") == 0) return PeerExchange::Copies::engines;
    MF_CHECK(std::strcmp(env, "sm") == 0,
             "MOEFORGE_PEER_COPY: expected 'ce' (copy engines) or 'sm' (SM kernels), got '", env, "'");
    return PeerExchange::Copies::kernels;
}

}  // namespace

std::unique_ptr<PeerExchange> PeerExchange::create(NcclCommunicator& comm, size_t slot_bytes, Copies copies) {
    const int n = comm.size();
    if (n > kMaxRanks) return nullptr;  // the same answer on every rank: NCCL serves larger groups
    Info mine{};
    gethostname(mine.host, sizeof mine.host - 1);
    int device = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    MF_CHECK_CUDA(cudaDeviceGetPCIBusId(mine.bus_id, sizeof mine.bus_id, device));
    const char* env = std::getenv("MOEFORGE_PEER_EXCHANGE");
    mine.wanted = n > 1 && !(env != nullptr && std::strcmp(env, "0") == 0);
    mine.slot_bytes = slot_from_env(slot_bytes);
    const std::vector<Info> first = gather(comm, mine);

    // Can this rank map every peer's memory? Same host, the peer's GPU visible here, peer access.
    bool wanted = true, reach = true;
    uint64_t slot = mine.slot_bytes;
    for (int p = 0; p < n; ++p) {
        const Info& o = first[static_cast<size_t>(p)];
        wanted = wanted && o.wanted != 0;
        slot = std::min(slot, o.slot_bytes);  // one size for all: senders place pieces by it
        if (p == comm.rank()) continue;
        int other = -1, can = 0;
        reach = reach && std::strncmp(o.host, mine.host, sizeof mine.host) == 0 &&
                cudaDeviceGetByPCIBusId(&other, o.bus_id) == cudaSuccess && other != device &&
                cudaDeviceCanAccessPeer(&can, device, other) == cudaSuccess && can == 1;
    }
    cudaGetLastError();  // a failed lookup above is an answer, not an error to keep
    if (!wanted) return nullptr;

    std::unique_ptr<PeerExchange> x(new PeerExchange());
    x->rank_ = comm.rank();
    x->size_ = n;
    x->slot_bytes_ = slot;
    x->sm_copies_ = (copies == Copies::from_env ? copies_from_env() : copies) == Copies::kernels;
    x->timeout_ns_ = static_cast<uint64_t>(std::min(comm.timeout_s(), 1e9) * 1e9);
    if (reach) {
        MF_CHECK_CUDA(
            cudaMalloc(reinterpret_cast<void**>(&x->window_), kFlagBytes + static_cast<size_t>(n - 1) * slot));
        MF_CHECK_CUDA(cudaMemset(x->window_, 0, kFlagBytes));  // the legacy stream: before the gather below
        MF_CHECK_CUDA(cudaIpcGetMemHandle(&mine.window, x->window_));
    }
    mine.reach = reach;
    const std::vector<Info> second = gather(comm, mine);
    for (const Info& o : second)
        if (o.reach == 0) return nullptr;  // the destructor frees the window

    // The counters before the mappings: a failed open leaves the destructor a consistent object.
    x->sent_.assign(static_cast<size_t>(n), 0);
    x->received_.assign(static_cast<size_t>(n), 0);
    MF_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&x->error_host_), sizeof(int), cudaHostAllocMapped));
    *x->error_host_ = 0;
    MF_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&x->error_device_), x->error_host_, 0));
    x->peers_.assign(static_cast<size_t>(n), nullptr);
    x->peers_[static_cast<size_t>(x->rank_)] = x->window_;
    for (int p = 0; p < n; ++p) {
        if (p == x->rank_) continue;
        void* mapped = nullptr;
        MF_CHECK_CUDA(
            cudaIpcOpenMemHandle(&mapped, second[static_cast<size_t>(p)].window, cudaIpcMemLazyEnablePeerAccess));
        x->peers_[static_cast<size_t>(p)] = static_cast<char*>(mapped);
    }
    return x;
}

PeerExchange::~PeerExchange() {
    if (!peers_.empty()) {
        // Every piece this rank sent must be copied out by its receiver before the windows go: the
        // receiver's last signal lands in this window. (The waits give up after the timeout.)
        for (int p = 0; p < size_; ++p)
            if (p != rank_ && sent_[static_cast<size_t>(p)] > 0)
                cuda::peer_wait(&flags(window_)->freed[p], sent_[static_cast<size_t>(p)], timeout_ns_, error_device_,
                                p + 1, nullptr);
        cudaDeviceSynchronize();
        for (int p = 0; p < size_; ++p)
            if (p != rank_ && peers_[static_cast<size_t>(p)] != nullptr)
                cudaIpcCloseMemHandle(peers_[static_cast<size_t>(p)]);
    }
    if (window_ != nullptr) cudaFree(window_);
    if (error_host_ != nullptr) cudaFreeHost(error_host_);
}

char* PeerExchange::slot(char* window, int owner, int source) const {
    const int index = source < owner ? source : source - 1;
    return window + kFlagBytes + static_cast<size_t>(index) * slot_bytes_;
}

void PeerExchange::copy(std::span<const cuda::CopySpan> spans, cudaStream_t stream) const {
    if (sm_copies_) {
        cuda::peer_copy(spans, stream);
        return;
    }
    for (const cuda::CopySpan& c : spans)
        if (c.bytes > 0) MF_CHECK_CUDA(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream));
}

int PeerExchange::late_peer() const {
    const int e = error_host_ != nullptr ? *reinterpret_cast<volatile int*>(error_host_) : 0;
    return e - 1;
}

void PeerExchange::all_to_all_v(const char* send, std::span<const size_t> send_bytes,
                                std::span<const size_t> send_offsets, char* recv, std::span<const size_t> recv_bytes,
                                std::span<const size_t> recv_offsets, cudaStream_t stream) {
    const size_t me = static_cast<size_t>(rank_);
    MF_CHECK(send_bytes[me] == recv_bytes[me], "all_to_all_v: rank ", rank_, " sends itself ", send_bytes[me],
             " bytes but expects ", recv_bytes[me]);
    size_t longest = 0;
    for (int p = 0; p < size_; ++p)
        if (p != rank_)
            longest = std::max({longest, send_bytes[static_cast<size_t>(p)], recv_bytes[static_cast<size_t>(p)]});
    Flags* own = flags(window_);
    std::vector<cuda::CopySpan> spans;
    std::vector<std::pair<int, uint64_t>> posted;  // (peer, round) of this round's sends
    size_t at = 0;
    do {
        // This round's sends first (see the header), in one copy launch with the self piece (first
        // round): the local copy runs beside the transfer.
        spans.clear();
        posted.clear();
        if (at == 0) spans.push_back({recv + recv_offsets[me], send + send_offsets[me], send_bytes[me]});
        for (int p = 0; p < size_; ++p) {
            const size_t i = static_cast<size_t>(p);
            if (p == rank_ || send_bytes[i] <= at) continue;
            const uint64_t q = ++sent_[i];
            if (q > 1) cuda::peer_wait(&own->freed[p], q - 1, timeout_ns_, error_device_, p + 1, stream);
            spans.push_back(
                {slot(peers_[i], p, rank_), send + send_offsets[i] + at, std::min(slot_bytes_, send_bytes[i] - at)});
            posted.emplace_back(p, q);
        }
        copy(spans, stream);
        for (const auto& [p, q] : posted)
            cuda::peer_signal(&flags(peers_[static_cast<size_t>(p)])->arrived[rank_], q, stream);
        for (int p = 0; p < size_; ++p) {
            const size_t i = static_cast<size_t>(p);
            if (p == rank_ || recv_bytes[i] <= at) continue;
            const uint64_t q = ++received_[i];
            cuda::peer_wait(&own->arrived[p], q, timeout_ns_, error_device_, p + 1, stream);
            const cuda::CopySpan out{recv + recv_offsets[i] + at, slot(window_, rank_, p),
                                     std::min(slot_bytes_, recv_bytes[i] - at)};
            copy({&out, 1}, stream);
            cuda::peer_signal(&flags(peers_[i])->freed[rank_], q, stream);
        }
        at += slot_bytes_;
    } while (at < longest);
}

}  // namespace mf::parallel

#endif  // MOEFORGE_WITH_NCCL
