// Backend-neutral parts of the communicator: the EP/DP layout arithmetic and the group split.
#include "parallel/communicator.h"

#include <limits>

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
    MF_CHECK(send_counts.size() == n && send_offsets.size() == n && recv_counts.size() == n && recv_offsets.size() == n,
             op, ": counts and offsets need ", n, " entries each");
    for (size_t p = 0; p < n; ++p) {
        MF_CHECK(send_offsets[p] >= 0 && recv_offsets[p] >= 0, op, ": negative offset for peer ", p);
        checked_nbytes(send_counts[p], dtype, op);
        checked_nbytes(recv_counts[p], dtype, op);
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
    MF_CHECK(static_cast<uint64_t>(count) <= std::numeric_limits<size_t>::max() / elem, op, ": element count ", count,
             " overflows");
    return static_cast<size_t>(count) * elem;
}

}  // namespace mf::parallel
