// TcpCommunicator: the CPU backend of Communicator, between processes over TCP (IPv4). Buffers are
// host memory. Used by tests and CI, and by runs on machines without GPUs.
//
// Setup: Rendezvous (rendezvous.h) gives every rank the address of every other rank's listener;
// then rank j connects to every rank i < j and accepts from every rank i > j, giving a full mesh of
// nonblocking sockets (one per pair, FIFO in each direction).
//
// Every message is a 24-byte header {magic, group id, operation sequence number ("tag"), operation,
// payload bytes} followed by the payload. The receiver checks all of it, so two ranks that call
// different collectives, or disagree on all_to_all_v counts, get an mf::Error instead of garbage.
// All sends and receives of one communication round progress together under poll(), so no pattern
// deadlocks on full socket buffers; a round that makes no progress for timeout_s throws, naming the
// lowest-numbered peer still owed data. A peer that closes its socket (it exited) is reported at once.
//
// Algorithms (n ranks; the CPU backend favours determinism and simplicity over bandwidth):
//   all_reduce_sum  rank 0 of the group receives every rank's chunk and sums in rank order
//                   (fp32, also for bf16), then sends the result to everyone: bitwise identical on
//                   every rank and equal to the serial sum ((x0 + x1) + x2) + ...; chunks of 4 MiB
//                   bound rank 0's memory.
//   broadcast       root sends to every rank.
//   all_gather, all_to_all_v, barrier   every pair exchanges directly in one round.
//   split           an all_gather of (color, key), then a group over the same sockets.
#pragma once

#include <memory>

#include "parallel/communicator.h"
#include "parallel/rendezvous.h"

namespace mf::parallel {

struct TcpTransport;

class TcpCommunicator final : public Communicator {
 public:
    // The world communicator: runs the rendezvous and connects the mesh (collective over all ranks
    // of `env`). Every wait, setup included, throws after timeout_s seconds without progress.
    TcpCommunicator(const DistEnv& env, double timeout_s);
    ~TcpCommunicator() override;

    int rank() const override { return group_rank_; }
    int size() const override { return static_cast<int>(members_.size()); }
    int world_rank() const override;
    double timeout_s() const override;
    const char* backend() const override { return "tcp"; }

    void all_reduce_sum(void* data, int64_t count, DType dtype) override;
    void broadcast(void* data, int64_t count, DType dtype, int root) override;
    void all_gather(const void* send, void* recv, int64_t count, DType dtype) override;
    void all_to_all_v(const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_offsets,
                      void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                      DType dtype) override;
    void barrier() override;
    std::unique_ptr<Communicator> split(int color, int key) override;

    // World ranks of this group's members, in group-rank order.
    const std::vector<int>& members() const { return members_; }

 private:
    TcpCommunicator(std::shared_ptr<TcpTransport> transport, std::vector<int> members, uint32_t group_id);
    struct Transfer;
    // Runs one round of transfers to completion (see the header comment).
    void run_round(std::vector<Transfer>& transfers, const char* op);
    Transfer make_send(int peer, const char* op, const void* data, size_t nbytes) const;
    Transfer make_recv(int peer, void* data, size_t nbytes) const;
    static uint32_t op_code_for(const char* op);
    uint32_t next_tag() { return ++seq_; }

    std::shared_ptr<TcpTransport> transport_;
    std::vector<int> members_;
    int group_rank_ = 0;
    uint32_t group_id_ = 0;
    uint32_t seq_ = 0;
    uint32_t num_splits_ = 0;
};

}  // namespace mf::parallel
