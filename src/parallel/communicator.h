// Communicator: the collectives the engine needs, on raw buffers (pointer, element count, DType),
// behind one interface with two implementations: TCP between CPU processes (tests, CI, machines
// without GPUs; tcp_communicator.h) and NCCL between GPUs (nccl_communicator.h).
//
// Invariants every implementation keeps:
//   - Every rank of a communicator calls the same collectives in the same order (an SPMD program).
//     A mismatch is detected where the transport can see it (TCP: each message carries its group and
//     operation sequence number) and raised as mf::Error, never silently mixed.
//   - all_reduce_sum is deterministic and bitwise identical on every rank: the reduction order is
//     fixed (TCP: fp32 sums in rank order 0, 1, ..., n-1 at the root, then a broadcast of that one
//     result). bf16 is summed in fp32 and rounded to bf16 once.
//   - No wait is unbounded: every blocking wait has a timeout (seconds; the recipe key
//     `dist.timeout_s`). On expiry, or when a peer's connection drops, the call throws mf::Error
//     naming this rank, the peer, the operation and its tag, e.g.
//       "rank 1: timed out after 5 s waiting for rank 0 in all_to_all_v (tag 17)".
//     Ranks are named by their world rank (the RANK of the process) even inside a sub-group.
//   - Counts and offsets are in elements of the given dtype, never bytes.
//
// Process groups for expert (EP) and data (DP) parallelism, on a world of W ranks and EP size E
// (E divides W), as built by make_process_groups():
//   EP groups are consecutive ranks:  {0..E-1}, {E..2E-1}, ...    (ep_rank = rank % E)
//   DP groups are strided by E:       {r, r+E, r+2E, ...}          (dp_rank = rank / E)
// Ranks of one EP group hold disjoint expert shards (dispatch/combine is an all-to-all inside it);
// ranks of one DP group hold the same expert shard, so expert gradients are reduced over the DP
// group, and non-expert (replicated everywhere) gradients over the world. Consecutive EP ranks keep
// the heavy all-to-all inside one node when E <= GPUs per node.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mf::parallel {

// broadcast_each's argument rule (size + 1 non-decreasing offsets from 0); throws mf::Error.
void check_broadcast_each_args(std::span<const int64_t> offsets, int size);

class Communicator {
 public:
    virtual ~Communicator() = default;

    // This process's index in the communicator, in [0, size()).
    virtual int rank() const = 0;
    virtual int size() const = 0;
    // This process's rank in the world communicator it was split from (== rank() for the world).
    virtual int world_rank() const = 0;
    // Seconds any single wait may last before the call throws.
    virtual double timeout_s() const = 0;
    // "tcp" or "nccl".
    virtual const char* backend() const = 0;

    // In place: data[i] = sum over ranks of data[i]. dtype f32 or bf16 (bf16: fp32 sum, one rounding).
    virtual void all_reduce_sum(void* data, int64_t count, DType dtype) = 0;
    // data[0, count) of rank `root` copied to every rank's data.
    virtual void broadcast(void* data, int64_t count, DType dtype, int root) = 0;
    // Every rank r's piece data[offsets[r], offsets[r + 1]) copied to every rank: an in-place
    // all-gather of uneven pieces (offsets: size() + 1 non-decreasing entries, the same on every
    // rank). This default broadcasts the pieces one after the other; NCCL sends each piece straight
    // to every peer (point to point) in one group, so they all travel at the same time.
    virtual void broadcast_each(void* data, std::span<const int64_t> offsets, DType dtype) {
        check_broadcast_each_args(offsets, size());
        for (int r = 0; r < size(); ++r)
            if (offsets[r + 1] > offsets[r])
                broadcast(static_cast<char*>(data) + offsets[r] * static_cast<int64_t>(dtype_size(dtype)),
                          offsets[r + 1] - offsets[r], dtype, r);
    }
    // recv[r * count + i] = send[i] of rank r; recv holds size() * count elements. send may not
    // alias recv.
    virtual void all_gather(const void* send, void* recv, int64_t count, DType dtype) = 0;
    // Variable all-to-all. For every peer p: the send_counts[p] elements at send + send_offsets[p]
    // go to p, which receives them at recv + its recv_offsets[this rank]; this rank receives
    // recv_counts[p] elements from p at recv + recv_offsets[p]. Each span holds size() entries;
    // counts may be zero; recv_counts[p] must equal p's send_counts[this rank] (checked by the TCP
    // backend, which sends a length with each message). The self entry is a local copy.
    virtual void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                              std::span<const int64_t> send_offsets, void* recv, std::span<const int64_t> recv_counts,
                              std::span<const int64_t> recv_offsets, DType dtype) = 0;
    // all_to_all_v that may overlap what follows: starts the exchange and returns a ticket;
    // all_to_all_v_join(ticket) orders later work after that exchange and every one started before it.
    // The buffers must stay untouched until joined. NCCL runs it on a side stream with its own
    // communicator (nccl_communicator.h); backends without concurrency (TCP) exchange at once and
    // return ticket 0, whose join is a no-op.
    virtual uint64_t all_to_all_v_start(const void* send, std::span<const int64_t> send_counts,
                                        std::span<const int64_t> send_offsets, void* recv,
                                        std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                                        DType dtype) {
        all_to_all_v(send, send_counts, send_offsets, recv, recv_counts, recv_offsets, dtype);
        return 0;
    }
    virtual void all_to_all_v_join(uint64_t ticket) { (void)ticket; }
    // Starts data[i] = sum over ranks of data[i] and returns without waiting for it. NCCL runs it on a
    // side stream with its own NCCL communicator, after the work already enqueued on the default
    // stream, so it overlaps whatever the default stream does next; bf16 is summed by NCCL in bf16
    // (for 2 ranks one rounding of the exact sum, like all_reduce_sum; for more, each hop rounds).
    // wait_async() completes every reduction started, with the timeout. Backends without
    // concurrency (TCP) reduce at once, exactly as all_reduce_sum. `data` must stay valid and
    // untouched by other work until wait_async() returns.
    virtual void all_reduce_sum_async(void* data, int64_t count, DType dtype) { all_reduce_sum(data, count, dtype); }
    // broadcast_each that overlaps what the default stream does next, in the same way (NCCL: on the
    // side stream, after the work enqueued so far); completed by wait_async(). It returns a ticket:
    // join_async(ticket) orders the default stream's later work after this broadcast (and every
    // asynchronous operation started before it) without a host wait, so a consumer of the data can
    // be enqueued before the broadcast has finished. Backends without concurrency broadcast at once
    // and return 0, whose join is a no-op.
    virtual uint64_t broadcast_each_async(void* data, std::span<const int64_t> offsets, DType dtype) {
        broadcast_each(data, offsets, dtype);
        return 0;
    }
    virtual void join_async(uint64_t ticket) { (void)ticket; }
    virtual void wait_async() {}
    // Returns once every rank has entered the barrier.
    virtual void barrier() = 0;
    // Completes all work enqueued by this communicator (NCCL: waits on its stream, with the
    // timeout). TCP collectives are complete on return, so this is a no-op there.
    virtual void synchronize() {}

    // Collective over this communicator: ranks with the same color form a new communicator, ordered
    // by (key, rank). A negative color takes no part and gets nullptr. The result shares this
    // communicator's connections and must not outlive it.
    virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
};

// The layout above as plain arithmetic (no communication), for planning and tests.
struct ParallelLayout {
    int world_size = 1;
    int ep_size = 1;

    // Throws mf::Error naming `source` unless 1 <= ep_size and ep_size divides world_size.
    static ParallelLayout make(int world_size, int ep_size, const std::string& source);
    int dp_size() const { return world_size / ep_size; }
    int ep_rank(int rank) const { return rank % ep_size; }
    int dp_rank(int rank) const { return rank / ep_size; }
    // World ranks of the EP group / DP group holding `rank`, ascending.
    std::vector<int> ep_group(int rank) const;
    std::vector<int> dp_group(int rank) const;
};

// The EP and DP sub-communicators of `world` (collective: every world rank calls it). ep->rank()
// equals layout.ep_rank(world.rank()) and dp->rank() equals layout.dp_rank(world.rank()).
struct ProcessGroups {
    ParallelLayout layout;
    std::unique_ptr<Communicator> ep;
    std::unique_ptr<Communicator> dp;
};
ProcessGroups make_process_groups(Communicator& world, int ep_size);

// The argument checks every all_to_all_v does: size entries per span, no negative offset, counts
// that fit in bytes (mf::Error naming `op` otherwise).
void check_all_to_all_v_args(int size, std::span<const int64_t> send_counts, std::span<const int64_t> send_offsets,
                             std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets, DType dtype,
                             const char* op);

// Number of bytes of `count` elements of `dtype`; throws on a negative count or overflow.
size_t checked_nbytes(int64_t count, DType dtype, const char* op);

}  // namespace mf::parallel
