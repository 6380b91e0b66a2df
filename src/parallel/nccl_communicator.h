// NcclCommunicator: the GPU backend of Communicator. Buffers are device memory of the current GPU;
// built only where CUDA is on and NCCL is found (cmake/nccl.cmake defines MOEFORGE_WITH_NCCL).
//
// Semantics that differ from the TCP backend:
//   - Collectives are stream-ordered: each call enqueues on the communicator's stream and returns;
//     synchronize() waits for them. The stream must be the legacy default stream (nullptr) or a
//     blocking stream, so that ops:: kernels on the default stream are ordered with it.
//   - No wait is unbounded: the communicator is created nonblocking (ncclConfig_t.blocking = 0);
//     initialisation, enqueueing and synchronize() poll NCCL's async state and the stream, and after
//     timeout_s seconds print a diagnostic naming this rank, the operation and its tag, and end the
//     process with status 1 at once (no exception: unwinding would block in cudaFree behind kernels
//     stuck on the late peer). NCCL does not say which peer is late, so the message says so.
//     Besides, a process-wide watchdog thread watches every enqueued operation (an event after it):
//     one still not done timeout_s after it was enqueued ends the process with status 1 and the same
//     diagnostic, so a host call that blocks inside CUDA behind a stuck NCCL kernel (a device-to-host
//     copy, a cudaFree while unwinding) cannot hang the rank.
//   - all_reduce_sum of bf16 converts to a temporary fp32 buffer (ops::cast), reduces in fp32 and
//     rounds once, as the TCP backend does. NCCL's reduction order is fixed for a given world size,
//     topology and NCCL_ALGO/NCCL_PROTO, so results are run-to-run deterministic and identical on every
//     rank (ring and tree both finish by copying one reduced value to all).
//   - split() is ncclCommSplit; barrier() is a one-element all-reduce followed by synchronize().
//   - all_to_all_v and all_to_all_v_start bypass NCCL where every rank's GPU can map every other's
//     memory (one host, peer access): the pieces are copied into the peers' windows by the copy
//     engines and out into place there (parallel/peer_exchange.h; made at the first such call,
//     which every rank reaches at the same point; MOEFORGE_PEER_EXCHANGE=0 keeps NCCL's send/recv).
//     A piece that does not come within the timeout is reported by synchronize() with the late
//     peer's rank. (broadcast_each_async stays on NCCL: measured in P2, the copy engines, starved
//     by the memory-bound AdamW running beside it, took 11.5 ms for ZeRO-1's 387 MB pieces where
//     NCCL's kernels take ~4.6.)
#pragma once

#if defined(MOEFORGE_WITH_NCCL)

#include <cuda_runtime.h>
#include <nccl.h>

#include "parallel/communicator.h"
#include "parallel/peer_exchange.h"
#include "parallel/rendezvous.h"

namespace mf::parallel {

class NcclCommunicator final : public Communicator {
 public:
    // Collective over the ranks of `rendezvous`: selects GPU `device` (default: the local rank), rank 0
    // creates the NCCL unique id and shares it through the rendezvous, every rank joins.
    NcclCommunicator(Rendezvous& rendezvous, double timeout_s, cudaStream_t stream = nullptr, int device = -1);
    ~NcclCommunicator() override;

    int rank() const override { return rank_; }
    int size() const override { return size_; }
    int world_rank() const override { return world_rank_; }
    double timeout_s() const override { return timeout_s_; }
    const char* backend() const override { return "nccl"; }
    ncclComm_t handle() const { return comm_; }
    cudaStream_t stream() const { return stream_; }

    void all_reduce_sum(void* data, int64_t count, DType dtype) override;
    void broadcast(void* data, int64_t count, DType dtype, int root) override;
    void broadcast_each(void* data, std::span<const int64_t> offsets, DType dtype) override;
    void all_gather(const void* send, void* recv, int64_t count, DType dtype) override;
    void all_to_all_v(const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_offsets,
                      void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                      DType dtype) override;
    void barrier() override;
    void synchronize() override;
    // On a second NCCL communicator over the same ranks and a non-blocking side stream, ordered
    // after the default stream's work at the call (an event); bf16 summed in bf16 by NCCL.
    void all_reduce_sum_async(void* data, int64_t count, DType dtype) override;
    // Tickets are events on the side stream, kSideTickets of them reused round robin: joining a
    // ticket whose event was recorded again since waits for that later work too (the side stream
    // runs in order), never for less.
    static constexpr uint64_t kSideTickets = 256;
    uint64_t broadcast_each_async(void* data, std::span<const int64_t> offsets, DType dtype) override;
    void join_async(uint64_t ticket) override;
    void wait_async() override;
    std::unique_ptr<Communicator> split(int color, int key) override;

    // Exchanges that overlap the default stream's work (EP dispatch/combine pipelining,
    // model/ep_exchange.cpp). all_to_all_v_start is all_to_all_v on a third NCCL communicator over the
    // same ranks (made on first use, which every rank reaches at the same point) and its own
    // non-blocking stream, ordered after the work enqueued on this communicator's stream so far (an
    // event); it returns a ticket. all_to_all_v_join(ticket) makes this communicator's stream wait on
    // the device (no host wait) until that exchange and every one started before it are done.
    // The buffers must stay untouched until joined. Only the last kExchangeTickets tickets can be
    // joined (an EP block with C chunks starts up to 4·C before joining the oldest: C <= 64 fits);
    // a hung peer surfaces at the next synchronize() of this communicator (its timeout).
    static constexpr uint64_t kExchangeTickets = 256;
    uint64_t all_to_all_v_start(const void* send, std::span<const int64_t> send_counts,
                                std::span<const int64_t> send_offsets, void* recv, std::span<const int64_t> recv_counts,
                                std::span<const int64_t> recv_offsets, DType dtype) override;
    void all_to_all_v_join(uint64_t ticket) override;
    // Whether all_to_all_v runs over the peer exchange (after the first all_to_all_v; false before).
    bool uses_peer_exchange() const { return peer_ != nullptr; }

 private:
    NcclCommunicator(ncclComm_t comm, int world_rank, double timeout_s, cudaStream_t stream, const char* what);
    // Waits until the (nonblocking) communicator has finished the last NCCL call, with the timeout.
    void wait_nccl(const char* op);
    // Prints "rank R: WHY in OP (tag N)" and ends the process with status 1 (see the .cpp).
    [[noreturn]] void abort_with(const char* op, const std::string& why);
    uint32_t begin(const char* op);

    static constexpr int64_t kWideChunk = int64_t{1} << 25;  // fp32 elements of the bf16 all-reduce workspace
    Buffer wide_;
    // The side stream's communicator (all_reduce_sum_async, broadcast_each_async), made on first use;
    // side() makes it and orders the side stream after the default stream's work so far.
    NcclCommunicator& side(const char* op);
    std::unique_ptr<NcclCommunicator> side_;
    cudaStream_t side_stream_ = nullptr;
    cudaEvent_t ready_ = nullptr;
    bool async_pending_ = false;
    cudaEvent_t side_done_[kSideTickets] = {};
    uint64_t side_tickets_ = 0;
    // The exchange stream's communicator, made on first use; exchange() makes it and orders the
    // exchange stream after the default stream's work so far, record_exchange() returns the ticket.
    NcclCommunicator& exchange(const char* op);
    void order_exchange_stream();  // makes the exchange stream and its events; waits for stream_
    uint64_t record_exchange();
    // The peer exchange, made by the first all_to_all_v (null where it cannot run).
    PeerExchange* peer_exchange();
    void peer_all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                           std::span<const int64_t> send_offsets, void* recv, std::span<const int64_t> recv_counts,
                           std::span<const int64_t> recv_offsets, DType dtype, cudaStream_t stream);
    std::unique_ptr<PeerExchange> peer_;
    bool peer_decided_ = false;
    // Ends the process with the diagnostic when a peer-exchange wait gave up (see synchronize).
    void check_peer(const char* op);
    std::unique_ptr<NcclCommunicator> exchange_;
    cudaStream_t exchange_stream_ = nullptr;
    cudaEvent_t exchange_ready_ = nullptr;
    cudaEvent_t exchange_done_[kExchangeTickets] = {};
    uint64_t exchange_tickets_ = 0;

    ncclComm_t comm_ = nullptr;
    cudaStream_t stream_ = nullptr;
    int rank_ = 0, size_ = 1, world_rank_ = 0;
    double timeout_s_ = 0;
    uint32_t seq_ = 0;
    const char* last_op_ = "init";
    void* scratch_ = nullptr;  // 16 bytes of device memory for barrier()
};

}  // namespace mf::parallel

#endif  // MOEFORGE_WITH_NCCL
