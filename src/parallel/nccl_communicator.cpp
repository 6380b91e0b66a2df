// NcclCommunicator (see nccl_communicator.h). The whole file is empty unless MOEFORGE_WITH_NCCL is
// defined, because CMake globs every src/parallel/*.cpp into the library.
#if defined(MOEFORGE_WITH_NCCL)

#include "parallel/nccl_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/cuda_check.h"
#include "core/poll.h"
#include "ops/ops.h"
#include "parallel/nccl_check.h"

namespace mf::parallel {

namespace {

ncclDataType_t nccl_type(DType dtype) {
    switch (dtype) {
        case DType::f32:
            return ncclFloat32;
        case DType::bf16:
            return ncclBfloat16;
        case DType::i32:
            return ncclInt32;
        case DType::i64:
            return ncclInt64;
        case DType::f64:
            return ncclFloat64;
    }
    MF_FAIL("no NCCL type for dtype ", dtype_name(dtype));
}

std::string seconds_str(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return buf;
}

// The watchdog: a thread that watches every enqueued NCCL operation (an event recorded after it on
// its stream). The communicator's own waits poll with the timeout, but a host call that blocks in
// CUDA (a cudaFree, which synchronises the device, behind an NCCL kernel whose peer never comes)
// would hang forever. So when an operation is still not done timeout_s after it was enqueued, the
// watchdog prints who and what timed out and ends the process at once with status 1 (_exit: no
// destructor may block on the stuck kernel); the peers' own watchdogs or waits end theirs.
// The watchdog's own event queries can block too, behind a main thread stuck inside such a CUDA
// call (the runtime serialises them), so a second thread that makes no CUDA call at all ends the
// process when one of the watchdog's CUDA calls (set device, query, destroy) has been in progress
// for longer than the smallest timeout watched.
class Watchdog {
 public:
    static Watchdog& get() {
        static Watchdog* w = new Watchdog();  // never destroyed: its thread outlives static teardown
        return *w;
    }
    void watch(cudaStream_t stream, double timeout_s, int world_rank, const char* op, uint32_t tag) {
        int device = 0;
        if (cudaGetDevice(&device) != cudaSuccess) return;
        cudaEvent_t ev = nullptr;
        if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) return;
        if (cudaEventRecord(ev, stream) != cudaSuccess) {
            cudaEventDestroy(ev);
            return;
        }
        const std::lock_guard<std::mutex> lock(mu_);
        pending_.push_back({ev, net::now_s() + timeout_s, timeout_s, world_rank, device, op, tag});
        const double limit = limit_s_.load();
        if (limit <= 0 || timeout_s < limit) limit_s_.store(timeout_s);
        rank_.store(world_rank);
    }

 private:
    struct Pending {
        cudaEvent_t ev;
        double deadline, timeout_s;
        int world_rank;
        int device;  // the GPU the event belongs to: the watchdog thread makes it current
        const char* op;
        uint32_t tag;
    };
    Watchdog() {
        std::thread([this] { loop(); }).detach();
        std::thread([this] { deadman(); }).detach();
    }
    void deadman() {  // no CUDA calls here
        for (;;) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            const double since = query_since_.load(), limit = limit_s_.load();
            if (since > 0 && limit > 0 && net::now_s() - since > limit) {
                std::fprintf(stderr,
                             "rank %d: timed out after %s s: the NCCL watchdog is blocked inside CUDA behind a "
                             "collective whose peer stopped answering; ending this process\n",
                             rank_.load(), seconds_str(limit).c_str());
                std::fflush(nullptr);
                ::_exit(1);
            }
        }
    }
    void loop() {
        for (;;) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            // The events are queried outside the lock, so watch() never waits on a CUDA call.
            std::deque<Pending> mine;
            {
                const std::lock_guard<std::mutex> lock(mu_);
                mine.swap(pending_);
            }
            const double now = net::now_s();
            for (auto it = mine.begin(); it != mine.end();) {
                query_since_.store(net::now_s());
                cudaSetDevice(it->device);
                const cudaError_t st = cudaEventQuery(it->ev);
                query_since_.store(0.0);
                if (st == cudaErrorNotReady) {
                    if (now > it->deadline) {
                        std::fprintf(stderr,
                                     "rank %d: timed out after %s s waiting for the other ranks in %s (tag %u; NCCL "
                                     "does not name the late peer); the NCCL watchdog ends this process\n",
                                     it->world_rank, seconds_str(it->timeout_s).c_str(), it->op, it->tag);
                        std::fflush(nullptr);
                        ::_exit(1);
                    }
                    ++it;
                    continue;
                }
                query_since_.store(net::now_s());  // the destroy can block behind the main thread too
                cudaEventDestroy(it->ev);          // done (or the context is gone: nothing left to watch)
                query_since_.store(0.0);
                it = mine.erase(it);
            }
            const std::lock_guard<std::mutex> lock(mu_);
            pending_.insert(pending_.begin(), mine.begin(), mine.end());  // older ones first
        }
    }
    std::mutex mu_;
    std::deque<Pending> pending_;
    std::atomic<double> query_since_{0.0};  // when the CUDA call in progress started; 0: none
    std::atomic<double> limit_s_{0.0};      // the smallest timeout watched so far
    std::atomic<int> rank_{-1};
};

ncclConfig_t nonblocking_config() {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    return config;
}

}  // namespace

NcclCommunicator::NcclCommunicator(Rendezvous& rendezvous, double timeout_s, cudaStream_t stream, int device)
    : stream_(stream), timeout_s_(timeout_s) {
    const DistEnv& env = rendezvous.env();
    MF_CHECK(timeout_s > 0, "communicator timeout must be positive, got ", timeout_s);
    rank_ = env.rank;
    size_ = env.world_size;
    world_rank_ = env.rank;
    const int want = device >= 0 ? device : env.local_rank;
    int count = 0;
    MF_CHECK_CUDA(cudaGetDeviceCount(&count));
    if (want >= count)
        fail("rank ", env.rank, " (local rank ", env.local_rank, ") needs CUDA device ", want,
             ", but this machine has ", count, ": start at most ", count,
             " ranks per node (--nproc-per-node) or set device=cpu");
    MF_CHECK_CUDA(cudaSetDevice(want));
    std::string blob;
    if (rank_ == 0) {
        ncclUniqueId id;
        MF_CHECK_NCCL(ncclGetUniqueId(&id));
        blob.assign(reinterpret_cast<const char*>(&id), sizeof id);
    }
    rendezvous.share_blob(blob);
    if (blob.size() != sizeof(ncclUniqueId))
        fail("rank ", rank_, ": NCCL unique id from rank 0 has ", blob.size(), " bytes");
    ncclUniqueId id;
    std::memcpy(&id, blob.data(), sizeof id);
    ncclConfig_t config = nonblocking_config();
    MF_CHECK_NCCL(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config));
    wait_nccl("init");
    MF_CHECK_CUDA(cudaMalloc(&scratch_, 16));
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int world_rank, double timeout_s, cudaStream_t stream,
                                   const char* what)
    : comm_(comm), stream_(stream), world_rank_(world_rank), timeout_s_(timeout_s) {
    wait_nccl(what);  // a nonblocking child may still be initialising
    MF_CHECK_NCCL(ncclCommUserRank(comm_, &rank_));
    MF_CHECK_NCCL(ncclCommCount(comm_, &size_));
    MF_CHECK_CUDA(cudaMalloc(&scratch_, 16));
}

NcclCommunicator::~NcclCommunicator() {
    peer_.reset();  // waits (bounded) until the peers have taken what this rank sent them
    exchange_.reset();
    for (cudaEvent_t e : exchange_done_)
        if (e != nullptr) cudaEventDestroy(e);
    if (exchange_ready_ != nullptr) cudaEventDestroy(exchange_ready_);
    if (exchange_stream_ != nullptr) cudaStreamDestroy(exchange_stream_);
    side_.reset();  // its communicator and stream first
    for (cudaEvent_t e : side_done_)
        if (e != nullptr) cudaEventDestroy(e);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (comm_ != nullptr) {
        // Finalize flushes outstanding work; if it cannot finish in time, abort instead of hanging.
        ncclCommFinalize(comm_);
        const double deadline = net::now_s() + timeout_s_;
        ncclResult_t state = ncclInProgress;
        while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
               net::now_s() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (state == ncclSuccess)
            ncclCommDestroy(comm_);
        else
            ncclCommAbort(comm_);
    }
}

void NcclCommunicator::abort_with(const char* op, const std::string& why) {
    // Fatal for the process: kernels of this or another communicator may be stuck waiting for the
    // late peer, and unwinding (cudaFree, communicator destructors) would block behind them. So the
    // rank reports itself, the operation and its tag, and ends at once with status 1.
    std::fprintf(stderr, "rank %d: %s in %s (tag %u); ending this process\n", world_rank_, why.c_str(), op, seq_);
    std::fflush(nullptr);
    ::_exit(1);
}

void NcclCommunicator::wait_nccl(const char* op) {
    const double start = net::now_s(), deadline = start + timeout_s_;
    for (;;) {
        ncclResult_t state = ncclSuccess;
        MF_CHECK_NCCL(ncclCommGetAsyncError(comm_, &state));
        if (state == ncclSuccess) {
            // Enqueued: from here the watchdog bounds how long its kernels may wait for the peers.
            Watchdog::get().watch(stream_, timeout_s_, world_rank_, op, seq_);
            return;
        }
        if (state != ncclInProgress) abort_with(op, detail::concat("NCCL error: ", ncclGetErrorString(state)));
        if (net::now_s() > deadline)
            abort_with(op, detail::concat("timed out after ", seconds_str(timeout_s_),
                                          " s waiting for the other ranks (NCCL does not name the late peer)"));
        poll_pause(net::now_s() - start);
    }
}

uint32_t NcclCommunicator::begin(const char* op) {
    MF_CHECK(comm_ != nullptr, "rank ", world_rank_, ": ", op, " on an aborted NCCL communicator");
    last_op_ = op;
    return ++seq_;
}

void NcclCommunicator::check_peer(const char* op) {
    if (peer_ == nullptr) return;
    const int late = peer_->late_peer();
    if (late >= 0)
        abort_with(op, detail::concat("timed out after ", seconds_str(timeout_s_), " s waiting for rank ", late,
                                      " of this group (peer exchange)"));
}

void NcclCommunicator::synchronize() {
    if (comm_ == nullptr) return;
    const double start = net::now_s(), deadline = start + timeout_s_;
    for (;;) {
        check_peer(last_op_);
        const cudaError_t status = cudaStreamQuery(stream_);
        if (status == cudaSuccess) {
            check_peer(last_op_);  // a wait that gave up lets the stream finish
            return;
        }
        if (status != cudaErrorNotReady) MF_CHECK_CUDA(status);
        ncclResult_t state = ncclSuccess;
        MF_CHECK_NCCL(ncclCommGetAsyncError(comm_, &state));
        if (state != ncclSuccess && state != ncclInProgress)
            abort_with(last_op_, detail::concat("NCCL error: ", ncclGetErrorString(state)));
        // With a peer exchange, a little grace: its device waits (started before this call) give up
        // after the same timeout and name the late peer.
        if (net::now_s() > deadline + (peer_ != nullptr ? 1.0 : 0.0))
            abort_with(last_op_, detail::concat("timed out after ", seconds_str(timeout_s_),
                                                " s waiting for the other ranks (NCCL does not name the late peer)"));
        poll_pause(net::now_s() - start);
    }
}

void NcclCommunicator::all_reduce_sum(void* data, int64_t count, DType dtype) {
    const char* op = "all_reduce_sum";
    const size_t nbytes = checked_nbytes(count, dtype, op);
    begin(op);
    if (nbytes == 0) return;
    if (dtype != DType::bf16) {
        MF_CHECK_NCCL(ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(dtype), ncclSum, comm_, stream_));
        wait_nccl(op);
        return;
    }
    // bf16: sum in fp32, round once (the default stream orders the casts with stream_, see header),
    // through one fp32 workspace of at most kWideChunk elements, kept for the next call, so a large
    // gradient all-reduce costs no allocation and no transient memory of its size.
    const int64_t chunk = std::min<int64_t>(count, kWideChunk);
    if (wide_.nbytes() < static_cast<size_t>(chunk) * sizeof(float))
        wide_ = Buffer(static_cast<size_t>(chunk) * sizeof(float), Device::cuda);
    for (int64_t first = 0; first < count; first += chunk) {
        const int64_t n = std::min(chunk, count - first);
        const Tensor narrow(static_cast<uint16_t*>(data) + first, DType::bf16, {n}, Device::cuda);
        const Tensor f32 = wide_.as(DType::f32, {n});
        ops::cast(f32, narrow);
        MF_CHECK_NCCL(
            ncclAllReduce(f32.data(), f32.data(), static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, stream_));
        wait_nccl(op);
        ops::cast(narrow, f32);
    }
}

void NcclCommunicator::broadcast(void* data, int64_t count, DType dtype, int root) {
    const char* op = "broadcast";
    checked_nbytes(count, dtype, op);
    MF_CHECK(root >= 0 && root < size_, op, ": root ", root, " outside group of ", size_);
    begin(op);
    MF_CHECK_NCCL(ncclBroadcast(data, data, static_cast<size_t>(count), nccl_type(dtype), root, comm_, stream_));
    wait_nccl(op);
}

void NcclCommunicator::broadcast_each(void* data, std::span<const int64_t> offsets, DType dtype) {
    const char* op = "broadcast_each";
    check_broadcast_each_args(offsets, size_);
    const size_t elem = dtype_size(dtype);
    begin(op);
    // Point to point: this rank's piece goes straight to every peer and every peer's piece comes
    // straight here, one group. (ncclBroadcast per piece ran its LL protocol at ~130 GB/s for the
    // 780 MB of P2's ZeRO-1 parameters; large sends and receives run the Simple protocol.)
    MF_CHECK_NCCL(ncclGroupStart());
    for (int r = 0; r < size_; ++r) {
        const int64_t count = offsets[r + 1] - offsets[r];
        if (count == 0 || r == rank_) continue;
        checked_nbytes(count, dtype, op);
        char* piece = static_cast<char*>(data) + static_cast<size_t>(offsets[r]) * elem;
        MF_CHECK_NCCL(ncclRecv(piece, static_cast<size_t>(count), nccl_type(dtype), r, comm_, stream_));
    }
    const int64_t mine = offsets[rank_ + 1] - offsets[rank_];
    if (mine > 0) {
        checked_nbytes(mine, dtype, op);
        const char* piece = static_cast<const char*>(data) + static_cast<size_t>(offsets[rank_]) * elem;
        for (int r = 0; r < size_; ++r)
            if (r != rank_)
                MF_CHECK_NCCL(ncclSend(piece, static_cast<size_t>(mine), nccl_type(dtype), r, comm_, stream_));
    }
    MF_CHECK_NCCL(ncclGroupEnd());
    wait_nccl(op);
}

void NcclCommunicator::all_gather(const void* send, void* recv, int64_t count, DType dtype) {
    const char* op = "all_gather";
    checked_nbytes(count, dtype, op);
    begin(op);
    MF_CHECK_NCCL(ncclAllGather(send, recv, static_cast<size_t>(count), nccl_type(dtype), comm_, stream_));
    wait_nccl(op);
}

void NcclCommunicator::all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                    std::span<const int64_t> send_offsets, void* recv,
                                    std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                                    DType dtype) {
    const char* op = "all_to_all_v";
    check_all_to_all_v_args(size(), send_counts, send_offsets, recv_counts, recv_offsets, dtype, op);
    const size_t n = static_cast<size_t>(size());
    begin(op);
    if (peer_exchange() != nullptr) {
        peer_all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dtype, stream_);
        return;
    }
    const size_t elem = dtype_size(dtype);
    const ncclDataType_t type = nccl_type(dtype);
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    MF_CHECK_NCCL(ncclGroupStart());
    for (size_t p = 0; p < n; ++p) {
        const int peer = static_cast<int>(p);
        if (send_counts[p] > 0)
            MF_CHECK_NCCL(
                ncclSend(in + send_offsets[p] * elem, static_cast<size_t>(send_counts[p]), type, peer, comm_, stream_));
        if (recv_counts[p] > 0)
            MF_CHECK_NCCL(ncclRecv(out + recv_offsets[p] * elem, static_cast<size_t>(recv_counts[p]), type, peer, comm_,
                                   stream_));
    }
    MF_CHECK_NCCL(ncclGroupEnd());
    wait_nccl(op);
}

void NcclCommunicator::barrier() {
    const char* op = "barrier";
    begin(op);
    MF_CHECK_NCCL(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_));
    wait_nccl(op);
    synchronize();
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
    const char* op = "split";
    begin(op);
    ncclConfig_t config = nonblocking_config();
    ncclComm_t child = nullptr;
    MF_CHECK_NCCL(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config));
    wait_nccl(op);
    if (color < 0 || child == nullptr) return nullptr;
    return std::unique_ptr<Communicator>(new NcclCommunicator(child, world_rank_, timeout_s_, stream_, op));
}

NcclCommunicator& NcclCommunicator::side(const char* op) {
    if (side_ == nullptr) {
        // First use (every rank reaches it at the same point of the program): a second NCCL
        // communicator over the same ranks, driven on a non-blocking stream so that it runs
        // concurrently with the default stream instead of being serialised behind it.
        MF_CHECK_CUDA(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
        MF_CHECK_CUDA(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
        ncclConfig_t config = nonblocking_config();
        ncclComm_t child = nullptr;
        MF_CHECK_NCCL(ncclCommSplit(comm_, 0, rank_, &child, &config));
        wait_nccl(op);
        side_.reset(new NcclCommunicator(child, world_rank_, timeout_s_, side_stream_, op));
    }
    // After everything enqueued on the default stream so far (the data being produced).
    MF_CHECK_CUDA(cudaEventRecord(ready_, stream_));
    MF_CHECK_CUDA(cudaStreamWaitEvent(side_stream_, ready_, 0));
    return *side_;
}

void NcclCommunicator::all_reduce_sum_async(void* data, int64_t count, DType dtype) {
    const char* op = "all_reduce_sum_async";
    checked_nbytes(count, dtype, op);
    begin(op);
    NcclCommunicator& s = side(op);
    if (count == 0) return;
    s.begin(op);
    MF_CHECK_NCCL(
        ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(dtype), ncclSum, s.comm_, side_stream_));
    s.wait_nccl(op);
    async_pending_ = true;
}

uint64_t NcclCommunicator::broadcast_each_async(void* data, std::span<const int64_t> offsets, DType dtype) {
    const char* op = "broadcast_each_async";
    check_broadcast_each_args(offsets, size_);
    begin(op);
    side(op).broadcast_each(data, offsets, dtype);  // the side communicator issues on the side stream
    async_pending_ = true;
    const uint64_t ticket = ++side_tickets_;
    cudaEvent_t& done = side_done_[ticket % kSideTickets];
    if (done == nullptr) MF_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    MF_CHECK_CUDA(cudaEventRecord(done, side_stream_));
    return ticket;
}

void NcclCommunicator::join_async(uint64_t ticket) {
    if (ticket == 0) return;
    MF_CHECK(ticket <= side_tickets_, "rank ", world_rank_, ": join_async: ticket ", ticket, " was not issued (",
             side_tickets_, " so far)");
    MF_CHECK_CUDA(cudaStreamWaitEvent(stream_, side_done_[ticket % kSideTickets], 0));
}

void NcclCommunicator::wait_async() {
    if (!async_pending_) return;
    side_->synchronize();  // polls the side stream with the timeout
    async_pending_ = false;
}

void NcclCommunicator::order_exchange_stream() {
    if (exchange_stream_ == nullptr) {
        MF_CHECK_CUDA(cudaStreamCreateWithFlags(&exchange_stream_, cudaStreamNonBlocking));
        MF_CHECK_CUDA(cudaEventCreateWithFlags(&exchange_ready_, cudaEventDisableTiming));
        for (cudaEvent_t& e : exchange_done_) MF_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    MF_CHECK_CUDA(cudaEventRecord(exchange_ready_, stream_));
    MF_CHECK_CUDA(cudaStreamWaitEvent(exchange_stream_, exchange_ready_, 0));
}

PeerExchange* NcclCommunicator::peer_exchange() {
    if (!peer_decided_) {
        peer_decided_ = true;
        peer_ = PeerExchange::create(*this);
    }
    return peer_.get();
}

void NcclCommunicator::peer_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                         std::span<const int64_t> send_offsets, void* recv,
                                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                                         DType dtype, cudaStream_t stream) {
    const size_t n = static_cast<size_t>(size_), elem = dtype_size(dtype);
    std::vector<size_t> sb(n), so(n), rb(n), ro(n);
    for (size_t p = 0; p < n; ++p) {
        sb[p] = static_cast<size_t>(send_counts[p]) * elem;
        so[p] = static_cast<size_t>(send_offsets[p]) * elem;
        rb[p] = static_cast<size_t>(recv_counts[p]) * elem;
        ro[p] = static_cast<size_t>(recv_offsets[p]) * elem;
    }
    peer_->all_to_all_v(static_cast<const char*>(send), sb, so, static_cast<char*>(recv), rb, ro, stream);
}

NcclCommunicator& NcclCommunicator::exchange(const char* op) {
    order_exchange_stream();
    if (exchange_ == nullptr) {
        ncclConfig_t config = nonblocking_config();
        ncclComm_t child = nullptr;
        MF_CHECK_NCCL(ncclCommSplit(comm_, 0, rank_, &child, &config));
        wait_nccl(op);
        exchange_.reset(new NcclCommunicator(child, world_rank_, timeout_s_, exchange_stream_, op));
    }
    return *exchange_;
}

uint64_t NcclCommunicator::record_exchange() {
    const uint64_t ticket = ++exchange_tickets_;
    MF_CHECK_CUDA(cudaEventRecord(exchange_done_[ticket % kExchangeTickets], exchange_stream_));
    return ticket;
}

uint64_t NcclCommunicator::all_to_all_v_start(const void* send, std::span<const int64_t> send_counts,
                                              std::span<const int64_t> send_offsets, void* recv,
                                              std::span<const int64_t> recv_counts,
                                              std::span<const int64_t> recv_offsets, DType dtype) {
    const char* op = "all_to_all_v_start";
    begin(op);
    if (peer_exchange() != nullptr) {
        check_all_to_all_v_args(size(), send_counts, send_offsets, recv_counts, recv_offsets, dtype, op);
        order_exchange_stream();
        peer_all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dtype, exchange_stream_);
        return record_exchange();
    }
    exchange(op).all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dtype);
    return record_exchange();
}

void NcclCommunicator::all_to_all_v_join(uint64_t ticket) {
    MF_CHECK(ticket >= 1 && ticket <= exchange_tickets_ && exchange_tickets_ - ticket < kExchangeTickets, "rank ",
             world_rank_, ": all_to_all_v_join: ticket ", ticket, " is not one of the last ", kExchangeTickets,
             " exchanges started (", exchange_tickets_, ")");
    MF_CHECK_CUDA(cudaStreamWaitEvent(stream_, exchange_done_[ticket % kExchangeTickets], 0));
}

}  // namespace mf::parallel

#endif  // MOEFORGE_WITH_NCCL
