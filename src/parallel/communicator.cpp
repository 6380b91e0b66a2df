// Backend-neutral parts of the communicator: the EP/DP layout arithmetic, the group split and the
// host-staged all_to_all_pieces.
#include "parallel/communicator.h"

#include <cstring>
#include <limits>
#include <vector>

namespace mf::parallel {

ParallelLayout ParallelLayout::make(int world_size, int ep_size, const std::string& source) {
    if (world_size < 1) fail(source, ": world size must be >= 1, got ", world_size);
    if (ep_size < 1) fail(source, ": dist.ep_size must be >= 1, got ", ep_size);
    if (world_size % ep_size != 0)
        fail(source, ": dist.ep_size ", ep_size, " does not divide the world size ", world_size);
    ParallelLayout layout;
    layout.world_size = world_size;
    layout.ep_size = ep_size;
    return layout;
}

std::vector<int> ParallelLayout::ep_group(int rank) const {
    MF_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " outside world of ", world_size);
    std::vector<int> ranks;
    const int first = dp_rank(rank) * ep_size;
    for (int i = 0; i < ep_size; ++i) ranks.push_back(first + i);
    return ranks;
}

std::vector<int> ParallelLayout::dp_group(int rank) const {
    MF_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " outside world of ", world_size);
    std::vector<int> ranks;
    for (int r = ep_rank(rank); r < world_size; r += ep_size) ranks.push_back(r);
    return ranks;
}

ProcessGroups make_process_groups(Communicator& world, int ep_size) {
    ProcessGroups groups;
    groups.layout = ParallelLayout::make(world.size(), ep_size, "process groups");
    const int rank = world.rank();
    // Keys are the world rank, so group ranks follow world order (ep_rank / dp_rank above).
    groups.ep = world.split(groups.layout.dp_rank(rank), rank);
    groups.dp = world.split(groups.layout.ep_rank(rank), rank);
    MF_CHECK(groups.ep != nullptr && groups.dp != nullptr, "split returned no group");
    MF_CHECK(groups.ep->rank() == groups.layout.ep_rank(rank), "EP rank mismatch");
    MF_CHECK(groups.dp->rank() == groups.layout.dp_rank(rank), "DP rank mismatch");
    return groups;
}

void check_all_to_all_v_args(int size, std::span<const int64_t> send_counts, std::span<const int64_t> send_offsets,
                             std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets, DType dtype,
                             const char* op) {
    const size_t n = static_cast<size_t>(size);
    MF_CHECK(send_counts.size() == n && send_offsets.size() == n && recv_counts.size() == n &&
                 recv_offsets.size() == n,
             op, ": counts and offsets need ", n, " entries each");
    for (size_t p = 0; p < n; ++p) {
        MF_CHECK(send_offsets[p] >= 0 && recv_offsets[p] >= 0, op, ": negative offset for peer ", p);
        checked_nbytes(send_counts[p], dtype, op);
        checked_nbytes(recv_counts[p], dtype, op);
    }
}

void check_pieces(int size, std::span<const Communicator::Piece> pieces, DType dtype, const char* op) {
    for (const Communicator::Piece& piece : pieces) {
        MF_CHECK(piece.peer >= 0 && piece.peer < size, op, ": peer ", piece.peer, " outside a group of ", size);
        MF_CHECK(piece.offset >= 0, op, ": negative offset ", piece.offset);
        checked_nbytes(piece.count, dtype, op);
        checked_nbytes(piece.offset + piece.count, dtype, op);
    }
}

void Communicator::all_to_all_pieces(const void* send, std::span<const Piece> send_pieces, void* recv,
                                     std::span<const Piece> recv_pieces, DType dtype) {
    const char* op = "all_to_all_pieces";
    const int n = size();
    check_pieces(n, send_pieces, dtype, op);
    check_pieces(n, recv_pieces, dtype, op);
    const size_t elem = dtype_size(dtype);
    // Per peer: its pieces one after the other in the staging buffers, in the listed order.
    auto layout = [n](std::span<const Piece> pieces, std::vector<int64_t>& counts, std::vector<int64_t>& offsets) {
        counts.assign(static_cast<size_t>(n), 0);
        offsets.assign(static_cast<size_t>(n), 0);
        for (const Piece& p : pieces) counts[static_cast<size_t>(p.peer)] += p.count;
        for (int p = 1; p < n; ++p)
            offsets[static_cast<size_t>(p)] = offsets[static_cast<size_t>(p - 1)] + counts[static_cast<size_t>(p - 1)];
        return n > 0 ? offsets.back() + counts.back() : 0;
    };
    std::vector<int64_t> sc, so, rc, ro;
    std::vector<char> out(static_cast<size_t>(layout(send_pieces, sc, so)) * elem),
        in(static_cast<size_t>(layout(recv_pieces, rc, ro)) * elem);
    std::vector<int64_t> cursor = so;
    for (const Piece& p : send_pieces) {
        int64_t& at = cursor[static_cast<size_t>(p.peer)];
        std::memcpy(out.data() + static_cast<size_t>(at) * elem,
                    static_cast<const char*>(send) + static_cast<size_t>(p.offset) * elem,
                    static_cast<size_t>(p.count) * elem);
        at += p.count;
    }
    all_to_all_v(out.data(), sc, so, in.data(), rc, ro, dtype);
    cursor = ro;
    for (const Piece& p : recv_pieces) {
        int64_t& at = cursor[static_cast<size_t>(p.peer)];
        std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(p.offset) * elem,
                    in.data() + static_cast<size_t>(at) * elem, static_cast<size_t>(p.count) * elem);
        at += p.count;
    }
}

void check_broadcast_each_args(std::span<const int64_t> offsets, int size) {
    MF_CHECK(offsets.size() == static_cast<size_t>(size) + 1, "broadcast_each: ", offsets.size(),
             " offsets for a group of ", size, " (need size + 1)");
    MF_CHECK(offsets[0] >= 0, "broadcast_each: negative first offset ", offsets[0]);
    for (int r = 0; r < size; ++r)
        MF_CHECK(offsets[r + 1] >= offsets[r], "broadcast_each: offsets decrease at rank ", r);
}

size_t checked_nbytes(int64_t count, DType dtype, const char* op) {
    MF_CHECK(count >= 0, op, ": negative element count ", count);
    const size_t elem = dtype_size(dtype);
    MF_CHECK(static_cast<uint64_t>(count) <= std::numeric_limits<size_t>::max() / elem, op, ": element count ",
             count, " overflows");
    return static_cast<size_t>(count) * elem;
}

}  // namespace mf::parallel
