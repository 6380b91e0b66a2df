// TcpCommunicator: mesh setup, the poll()-driven round engine, and the collectives built on it
// (see tcp_communicator.h for the algorithms and the wire format).
#include "parallel/tcp_communicator.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/bf16.h"
#include "core/check.h"

namespace mf::parallel {

namespace {

constexpr uint32_t kMessageMagic = 0x4D464D47;  // "MFMG"
constexpr uint32_t kMeshMagic = 0x4D464D53;     // "MFMS"
constexpr size_t kReduceChunkBytes = 4u << 20;

enum OpCode : uint32_t { kAllReduce = 1, kBroadcast, kAllGather, kAllToAllV, kBarrier, kSplit };

const char* op_name(uint32_t op) {
    switch (op) {
        case kAllReduce:
            return "all_reduce_sum";
        case kBroadcast:
            return "broadcast";
        case kAllGather:
            return "all_gather";
        case kAllToAllV:
            return "all_to_all_v";
        case kBarrier:
            return "barrier";
        case kSplit:
            return "split";
        default:
            return "unknown operation";
    }
}

struct Header {
    uint32_t magic;
    uint32_t group;
    uint32_t tag;
    uint32_t op;
    uint64_t nbytes;
};
static_assert(sizeof(Header) == 24);

std::string seconds_str(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return buf;
}

template <typename T>
void sum_into(T* acc, const T* x, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] += x[i];
}

}  // namespace

struct TcpTransport {
    int world_rank = 0;
    double timeout_s = 0;
    std::vector<int> fds;  // by world rank; -1 for self
    ~TcpTransport() {
        for (int fd : fds)
            if (fd >= 0) ::close(fd);
    }
};

struct TcpCommunicator::Transfer {
    int peer = 0;  // group rank
    bool is_send = false;
    char* data = nullptr;
    size_t nbytes = 0;
    Header header{};  // sent, or received and checked
    size_t done = 0;  // bytes of header + payload moved so far
    bool complete() const { return done == sizeof(Header) + nbytes; }
};

// --- setup ----------------------------------------------------------------------------------------

TcpCommunicator::TcpCommunicator(const DistEnv& env, double timeout_s) {
    MF_CHECK(timeout_s > 0, "communicator timeout must be positive, got ", timeout_s);
    auto transport = std::make_shared<TcpTransport>();
    transport->world_rank = env.rank;
    transport->timeout_s = timeout_s;
    transport->fds.assign(env.world_size, -1);
    const int n = env.world_size, me = env.rank;
    int listen_fd = -1;
    Rendezvous rendezvous(env, timeout_s, &listen_fd);
    try {
        const double deadline = net::now_s() + timeout_s;
        for (int peer = 0; peer < me; ++peer) {
            auto describe = [peer] { return detail::concat("rank ", peer, " in mesh setup"); };
            const PeerAddress& addr = rendezvous.peers()[peer];
            const int fd = net::connect_to(addr.host, addr.port, deadline, describe);
            transport->fds[peer] = fd;
            const uint32_t hello[3] = {kMeshMagic, static_cast<uint32_t>(me), static_cast<uint32_t>(n)};
            net::send_all(fd, hello, sizeof hello, timeout_s, describe);
        }
        for (int accepted = 0; accepted < n - 1 - me; ++accepted) {
            const int fd = net::accept_until(listen_fd, deadline);
            if (fd < 0) {
                std::string missing;
                for (int r = me + 1; r < n; ++r)
                    if (transport->fds[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
                fail("timed out after ", seconds_str(timeout_s), " s in mesh setup waiting for rank(s) ", missing);
            }
            uint32_t hello[3] = {};
            try {
                net::recv_all(fd, hello, sizeof hello, timeout_s, [] { return std::string("a peer in mesh setup"); });
            } catch (...) {
                ::close(fd);
                throw;
            }
            const int peer = static_cast<int>(hello[1]);
            if (hello[0] != kMeshMagic || hello[2] != static_cast<uint32_t>(n) || peer <= me || peer >= n ||
                transport->fds[peer] >= 0) {
                ::close(fd);
                fail("malformed or duplicate mesh handshake (claims rank ", hello[1], " of ", hello[2], ")");
            }
            transport->fds[peer] = fd;
        }
    } catch (const Error& e) {
        if (listen_fd >= 0) ::close(listen_fd);
        const std::string what = e.what();
        throw Error(what.rfind("rank ", 0) == 0 ? what : detail::concat("rank ", me, ": ", what));
    }
    if (listen_fd >= 0) ::close(listen_fd);
    transport_ = std::move(transport);
    for (int r = 0; r < n; ++r) members_.push_back(r);
    group_rank_ = me;
    group_id_ = 0;
}

TcpCommunicator::TcpCommunicator(std::shared_ptr<TcpTransport> transport, std::vector<int> members, uint32_t group_id)
    : transport_(std::move(transport)), members_(std::move(members)), group_id_(group_id) {
    const auto it = std::find(members_.begin(), members_.end(), transport_->world_rank);
    MF_CHECK(it != members_.end(), "this rank is not a member of the group");
    group_rank_ = static_cast<int>(it - members_.begin());
}

TcpCommunicator::~TcpCommunicator() = default;

int TcpCommunicator::world_rank() const { return transport_->world_rank; }
double TcpCommunicator::timeout_s() const { return transport_->timeout_s; }

// --- the round engine -----------------------------------------------------------------------------

void TcpCommunicator::run_round(std::vector<Transfer>& transfers, const char* op) {
    const int me = transport_->world_rank;
    const double timeout = transport_->timeout_s;
    auto where = [&](uint32_t tag) {
        return group_id_ == 0 ? detail::concat(op, " (tag ", tag, ")")
                              : detail::concat(op, " (group ", group_id_, ", tag ", tag, ")");
    };
    double last_progress = net::now_s();
    std::vector<pollfd> fds;
    std::vector<std::pair<int, int>> owners;  // per pollfd: indices of its send and recv transfer (-1: none)
    for (;;) {
        fds.clear();
        owners.clear();
        for (size_t i = 0; i < transfers.size(); ++i) {
            const Transfer& t = transfers[i];
            if (t.complete()) continue;
            const int fd = transport_->fds[members_[t.peer]];
            size_t slot = 0;
            while (slot < fds.size() && fds[slot].fd != fd) ++slot;
            if (slot == fds.size()) {
                fds.push_back({fd, 0, 0});
                owners.emplace_back(-1, -1);
            }
            fds[slot].events |= t.is_send ? POLLOUT : POLLIN;
            (t.is_send ? owners[slot].first : owners[slot].second) = static_cast<int>(i);
        }
        if (fds.empty()) return;
        const double left = last_progress + timeout - net::now_s();
        int ready = 0;
        if (left > 0) {
            ready = ::poll(fds.data(), fds.size(), static_cast<int>(left * 1000.0) + 1);
            if (ready < 0 && errno == EINTR) continue;
            MF_CHECK(ready >= 0, "poll: ", std::strerror(errno));
        }
        if (ready == 0) {
            if (net::now_s() < last_progress + timeout) continue;
            // Name the lowest-numbered peer that still owes or is owed data.
            int peer = -1;
            for (const Transfer& t : transfers)
                if (!t.complete() && (peer < 0 || members_[t.peer] < peer)) peer = members_[t.peer];
            fail("rank ", me, ": timed out after ", seconds_str(timeout), " s waiting for rank ", peer, " in ",
                 where(seq_));
        }
        bool progressed = false;
        for (size_t s = 0; s < fds.size(); ++s) {
            if (fds[s].revents == 0) continue;
            for (const int idx : {owners[s].first, owners[s].second}) {
                if (idx < 0) continue;
                Transfer& t = transfers[idx];
                const int peer = members_[t.peer];
                const int fd = fds[s].fd;
                auto lost = [&](const char* why) {
                    fail("rank ", me, ": connection to rank ", peer, " lost (", why, ") in ", where(seq_));
                };
                while (!t.complete()) {
                    const bool in_header = t.done < sizeof(Header);
                    char* base =
                        in_header ? reinterpret_cast<char*>(&t.header) + t.done : t.data + (t.done - sizeof(Header));
                    const size_t want = in_header ? sizeof(Header) - t.done : t.nbytes - (t.done - sizeof(Header));
                    const ssize_t got = t.is_send ? ::send(fd, base, want, MSG_NOSIGNAL) : ::recv(fd, base, want, 0);
                    if (got < 0) {
                        if (errno == EINTR) continue;
                        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
                        lost(std::strerror(errno));
                    }
                    if (got == 0) lost("it exited or closed the connection");
                    t.done += static_cast<size_t>(got);
                    progressed = true;
                    if (!t.is_send && t.done == sizeof(Header)) {
                        // A complete header: check it against what this rank is doing.
                        const Header& h = t.header;
                        if (h.magic != kMessageMagic)
                            fail("rank ", me, ": corrupt message from rank ", peer, " in ", where(seq_));
                        if (h.group != group_id_ || h.tag != seq_ || h.op != op_code_for(op))
                            fail("rank ", me, ": rank ", peer, " sent ", op_name(h.op), " (group ", h.group, ", tag ",
                                 h.tag, ") while this rank is in ", op, " (group ", group_id_, ", tag ", seq_,
                                 "): the ranks called collectives in different orders");
                        if (h.nbytes != t.nbytes)
                            fail("rank ", me, ": rank ", peer, " sent ", h.nbytes, " bytes in ", where(seq_),
                                 ", this rank expected ", t.nbytes, " (counts disagree between the ranks)");
                    }
                }
            }
        }
        if (progressed) last_progress = net::now_s();
    }
}

uint32_t TcpCommunicator::op_code_for(const char* op) {
    for (uint32_t code = kAllReduce; code <= kSplit; ++code)
        if (std::strcmp(op, op_name(code)) == 0) return code;
    MF_FAIL("unknown operation ", op);
}

TcpCommunicator::Transfer TcpCommunicator::make_send(int peer, const char* op, const void* data, size_t nbytes) const {
    Transfer t;
    t.peer = peer;
    t.is_send = true;
    t.data = static_cast<char*>(const_cast<void*>(data));  // only read from
    t.nbytes = nbytes;
    t.header = {kMessageMagic, group_id_, seq_, op_code_for(op), nbytes};
    return t;
}

TcpCommunicator::Transfer TcpCommunicator::make_recv(int peer, void* data, size_t nbytes) const {
    Transfer t;
    t.peer = peer;
    t.data = static_cast<char*>(data);
    t.nbytes = nbytes;
    return t;
}

// --- collectives ----------------------------------------------------------------------------------

void TcpCommunicator::all_reduce_sum(void* data, int64_t count, DType dtype) {
    const char* op = "all_reduce_sum";
    const size_t nbytes = checked_nbytes(count, dtype, op);
    MF_CHECK(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::i32 || dtype == DType::i64, op,
             ": unsupported dtype ", dtype_name(dtype));
    next_tag();
    const int n = size();
    if (n == 1 || nbytes == 0) return;
    const size_t elem = dtype_size(dtype);
    const size_t chunk_elems = kReduceChunkBytes / elem;
    char* bytes = static_cast<char*>(data);
    std::vector<char> scratch;
    std::vector<float> acc;
    std::vector<Transfer> round;
    for (size_t begin = 0; begin < static_cast<size_t>(count); begin += chunk_elems) {
        const size_t num = std::min(chunk_elems, static_cast<size_t>(count) - begin);
        char* chunk = bytes + begin * elem;
        const size_t chunk_bytes = num * elem;
        round.clear();
        if (group_rank_ == 0) {
            scratch.resize(static_cast<size_t>(n - 1) * chunk_bytes);
            for (int r = 1; r < n; ++r)
                round.push_back(make_recv(r, scratch.data() + (r - 1) * chunk_bytes, chunk_bytes));
            run_round(round, op);
            // The fixed order: rank 0's values, then + rank 1, + rank 2, ... each step in fp32 (or the
            // integer type), so the result equals the serial sum and is the same on every rank.
            if (dtype == DType::f32) {
                for (int r = 1; r < n; ++r)
                    sum_into(reinterpret_cast<float*>(chunk),
                             reinterpret_cast<const float*>(scratch.data() + (r - 1) * chunk_bytes), num);
            } else if (dtype == DType::i32) {
                for (int r = 1; r < n; ++r)
                    sum_into(reinterpret_cast<int32_t*>(chunk),
                             reinterpret_cast<const int32_t*>(scratch.data() + (r - 1) * chunk_bytes), num);
            } else if (dtype == DType::i64) {
                for (int r = 1; r < n; ++r)
                    sum_into(reinterpret_cast<int64_t*>(chunk),
                             reinterpret_cast<const int64_t*>(scratch.data() + (r - 1) * chunk_bytes), num);
            } else {
                uint16_t* out = reinterpret_cast<uint16_t*>(chunk);
                acc.resize(num);
                for (size_t i = 0; i < num; ++i) acc[i] = bf16_to_f32(out[i]);
                for (int r = 1; r < n; ++r) {
                    const uint16_t* x = reinterpret_cast<const uint16_t*>(scratch.data() + (r - 1) * chunk_bytes);
                    for (size_t i = 0; i < num; ++i) acc[i] += bf16_to_f32(x[i]);
                }
                for (size_t i = 0; i < num; ++i) out[i] = f32_to_bf16(acc[i]);
            }
            round.clear();
            for (int r = 1; r < n; ++r) round.push_back(make_send(r, op, chunk, chunk_bytes));
            run_round(round, op);
        } else {
            round.push_back(make_send(0, op, chunk, chunk_bytes));
            run_round(round, op);
            round.clear();
            round.push_back(make_recv(0, chunk, chunk_bytes));
            run_round(round, op);
        }
    }
}

void TcpCommunicator::broadcast(void* data, int64_t count, DType dtype, int root) {
    const char* op = "broadcast";
    const size_t nbytes = checked_nbytes(count, dtype, op);
    MF_CHECK(root >= 0 && root < size(), op, ": root ", root, " outside group of ", size());
    next_tag();
    std::vector<Transfer> round;
    if (group_rank_ == root) {
        for (int r = 0; r < size(); ++r)
            if (r != root) round.push_back(make_send(r, op, data, nbytes));
    } else {
        round.push_back(make_recv(root, data, nbytes));
    }
    run_round(round, op);
}

void TcpCommunicator::all_gather(const void* send, void* recv, int64_t count, DType dtype) {
    const char* op = "all_gather";
    const size_t nbytes = checked_nbytes(count, dtype, op);
    next_tag();
    char* out = static_cast<char*>(recv);
    if (nbytes > 0) std::memcpy(out + group_rank_ * nbytes, send, nbytes);
    std::vector<Transfer> round;
    for (int r = 0; r < size(); ++r) {
        if (r == group_rank_) continue;
        round.push_back(make_send(r, op, send, nbytes));
        round.push_back(make_recv(r, out + r * nbytes, nbytes));
    }
    run_round(round, op);
}

void TcpCommunicator::all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                                   std::span<const int64_t> send_offsets, void* recv,
                                   std::span<const int64_t> recv_counts, std::span<const int64_t> recv_offsets,
                                   DType dtype) {
    const char* op = "all_to_all_v";
    check_all_to_all_v_args(size(), send_counts, send_offsets, recv_counts, recv_offsets, dtype, op);
    MF_CHECK(send_counts[group_rank_] == recv_counts[group_rank_], op, ": this rank sends ", send_counts[group_rank_],
             " elements to itself but expects ", recv_counts[group_rank_]);
    next_tag();
    const size_t elem = dtype_size(dtype);
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    if (send_counts[group_rank_] > 0)
        std::memmove(out + recv_offsets[group_rank_] * elem, in + send_offsets[group_rank_] * elem,
                     send_counts[group_rank_] * elem);
    std::vector<Transfer> round;
    for (int r = 0; r < size(); ++r) {
        if (r == group_rank_) continue;
        // Zero-count messages still travel (a header): they check the counts and keep the ranks in step.
        round.push_back(make_send(r, op, in + send_offsets[r] * elem, send_counts[r] * elem));
        round.push_back(make_recv(r, out + recv_offsets[r] * elem, recv_counts[r] * elem));
    }
    run_round(round, op);
}

void TcpCommunicator::barrier() {
    const char* op = "barrier";
    next_tag();
    std::vector<Transfer> round;
    for (int r = 0; r < size(); ++r) {
        if (r == group_rank_) continue;
        round.push_back(make_send(r, op, nullptr, 0));
        round.push_back(make_recv(r, nullptr, 0));
    }
    run_round(round, op);
}

std::unique_ptr<Communicator> TcpCommunicator::split(int color, int key) {
    const char* op = "split";
    next_tag();
    const int n = size();
    const int32_t mine[2] = {color, key};
    std::vector<int32_t> all(2 * static_cast<size_t>(n));
    std::memcpy(all.data() + 2 * group_rank_, mine, sizeof mine);
    std::vector<Transfer> round;
    for (int r = 0; r < n; ++r) {
        if (r == group_rank_) continue;
        round.push_back(make_send(r, op, mine, sizeof mine));
        round.push_back(make_recv(r, all.data() + 2 * r, sizeof mine));
    }
    run_round(round, op);
    const uint32_t split_idx = ++num_splits_;
    if (color < 0) return nullptr;
    std::vector<int> chosen;  // group ranks with my color
    for (int r = 0; r < n; ++r)
        if (all[2 * r] == color) chosen.push_back(r);
    std::stable_sort(chosen.begin(), chosen.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
    std::vector<int> members;
    for (int r : chosen) members.push_back(members_[r]);
    // Same inputs on every member, so the same id; it only labels messages and diagnostics.
    uint32_t id = 2166136261u;
    for (uint32_t v : {group_id_, split_idx, static_cast<uint32_t>(color)}) id = (id ^ v) * 16777619u;
    if (id == 0) id = 1;
    return std::unique_ptr<Communicator>(new TcpCommunicator(transport_, std::move(members), id));
}

}  // namespace mf::parallel
