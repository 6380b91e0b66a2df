// Rendezvous over TCP and the environment parsing behind it (see rendezvous.h for the protocol).
// Wire format: native-endian 32/64-bit integers behind a magic (all ranks run the same binary on
// the same architecture); IPv4 addresses travel in network order.
#include "parallel/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/check.h"

namespace mf::parallel {

namespace {

constexpr uint32_t kJoinMagic = 0x4D464A4E;   // "MFJN"
constexpr uint32_t kTableMagic = 0x4D465442;  // "MFTB"
constexpr uint64_t kMaxBlobBytes = 64ull << 20;

std::string seconds_str(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return buf;
}

int parse_int(const char* name, const char* value, int lo, int hi) {
    const std::string text = value;
    if (text.empty() || text.size() > 10 || text.find_first_not_of("0123456789") != std::string::npos)
        fail("environment variable ", name, "='", text, "': expected an integer in [", lo, ", ", hi, "]");
    const long long v = std::stoll(text);
    if (v < lo || v > hi)
        fail("environment variable ", name, "=", text, ": expected an integer in [", lo, ", ", hi, "]");
    return static_cast<int>(v);
}

// First of two variables that is set (and non-empty), with its name; nullptr when neither is.
const char* first_set(const std::function<const char*(const char*)>& getenv, const char* a, const char* b,
                      const char** which) {
    for (const char* name : {a, b}) {
        if (name == nullptr) continue;
        const char* v = getenv(name);
        if (v != nullptr && v[0] != '\0') {
            *which = name;
            return v;
        }
    }
    return nullptr;
}

// Splits at commas outside brackets.
std::vector<std::string> split_top_level(const std::string& list, const std::string& whole) {
    std::vector<std::string> items;
    std::string cur;
    int depth = 0;
    for (char c : list) {
        if (c == '[') ++depth;
        if (c == ']') --depth;
        if (depth < 0 || depth > 1) fail("SLURM node list '", whole, "': unbalanced brackets");
        if (c == ',' && depth == 0) {
            items.push_back(cur);
            cur.clear();
        } else {
            cur += c;
        }
    }
    if (depth != 0) fail("SLURM node list '", whole, "': unbalanced brackets");
    items.push_back(cur);
    return items;
}

void expand_item(const std::string& item, const std::string& whole, std::vector<std::string>& out) {
    const size_t open = item.find('[');
    if (open == std::string::npos) {
        if (item.find(']') != std::string::npos) fail("SLURM node list '", whole, "': unbalanced brackets");
        out.push_back(item);
        return;
    }
    const size_t close = item.find(']', open);
    if (close == std::string::npos) fail("SLURM node list '", whole, "': unbalanced brackets");
    const std::string prefix = item.substr(0, open), body = item.substr(open + 1, close - open - 1);
    const std::string rest = item.substr(close + 1);
    if (body.empty()) fail("SLURM node list '", whole, "': empty brackets");
    size_t start = 0;
    while (start <= body.size()) {
        size_t comma = body.find(',', start);
        if (comma == std::string::npos) comma = body.size();
        const std::string range = body.substr(start, comma - start);
        const size_t dash = range.find('-');
        const std::string lo_s = range.substr(0, dash),
                          hi_s = dash == std::string::npos ? lo_s : range.substr(dash + 1);
        auto digits = [](const std::string& s) {
            return !s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos;
        };
        if (!digits(lo_s) || !digits(hi_s)) fail("SLURM node list '", whole, "': bad range '", range, "'");
        const long lo = std::stol(lo_s), hi = std::stol(hi_s);
        if (hi < lo) fail("SLURM node list '", whole, "': descending range '", range, "'");
        if (hi - lo >= 1000000 || out.size() > 1000000) fail("SLURM node list '", whole, "': too many hosts");
        for (long v = lo; v <= hi; ++v) {
            std::string num = std::to_string(v);
            if (num.size() < lo_s.size()) num.insert(0, lo_s.size() - num.size(), '0');
            // A second bracket group later in the name ("r[1-2]n[1-2]") expands recursively.
            expand_item(prefix + num + rest, whole, out);
        }
        start = comma + 1;
    }
}

std::function<std::string()> rendezvous_peer(int peer, const DistEnv& env) {
    return [peer, env] {
        return detail::concat("rank ", peer, " in rendezvous (", env.master_addr, ":", env.master_port, ")");
    };
}

}  // namespace

// --- environment ----------------------------------------------------------------------------------

std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist) {
    std::vector<std::string> hosts;
    for (const std::string& item : split_top_level(nodelist, nodelist)) {
        if (item.empty()) fail("SLURM node list '", nodelist, "': empty host name");
        expand_item(item, nodelist, hosts);
    }
    return hosts;
}

DistEnv dist_env_from(const std::function<const char*(const char*)>& getenv) {
    DistEnv env;
    const char* which = nullptr;
    if (const char* v = first_set(getenv, "WORLD_SIZE", "SLURM_NTASKS", &which))
        env.world_size = parse_int(which, v, 1, 1 << 20);
    if (const char* v = first_set(getenv, "RANK", "SLURM_PROCID", &which))
        env.rank = parse_int(which, v, 0, env.world_size - 1);
    if (const char* v = first_set(getenv, "LOCAL_RANK", "SLURM_LOCALID", &which))
        env.local_rank = parse_int(which, v, 0, env.world_size - 1);
    if (const char* v = first_set(getenv, "MASTER_ADDR", nullptr, &which)) {
        env.master_addr = v;
    } else if (const char* list = first_set(getenv, "SLURM_JOB_NODELIST", "SLURM_NODELIST", &which)) {
        const std::vector<std::string> hosts = expand_slurm_nodelist(list);
        env.master_addr = hosts.front();
    }
    if (const char* v = first_set(getenv, "MASTER_PORT", nullptr, &which))
        env.master_port = parse_int(which, v, 1, 65535);
    return env;
}

DistEnv dist_env_from(const std::map<std::string, std::string>& vars) {
    return dist_env_from([&vars](const char* name) -> const char* {
        auto it = vars.find(name);
        return it == vars.end() ? nullptr : it->second.c_str();
    });
}

DistEnv dist_env_from_process() {
    return dist_env_from([](const char* name) -> const char* { return std::getenv(name); });
}

// --- sockets --------------------------------------------------------------------------------------

namespace net {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void make_nonblocking(int fd) {
    const int flags = ::fcntl(fd, F_GETFL, 0);
    MF_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, "fcntl: ", std::strerror(errno));
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

namespace {
// Waits for `events` on fd; false on timeout.
bool wait_fd(int fd, short events, double timeout_s) {
    pollfd p{fd, events, 0};
    const int ms = timeout_s <= 0 ? 0 : static_cast<int>(timeout_s * 1000.0) + 1;
    for (;;) {
        const int r = ::poll(&p, 1, ms);
        if (r < 0 && errno == EINTR) continue;
        MF_CHECK(r >= 0, "poll: ", std::strerror(errno));
        return r > 0;
    }
}
}  // namespace

void send_all(int fd, const void* data, size_t n, double timeout_s, const std::function<std::string()>& describe) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
        const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
            p += w;
            n -= static_cast<size_t>(w);
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!wait_fd(fd, POLLOUT, timeout_s))
                fail("timed out after ", seconds_str(timeout_s), " s sending to ", describe());
            continue;
        }
        fail("connection lost (", std::strerror(errno), ") sending to ", describe());
    }
}

void recv_all(int fd, void* data, size_t n, double timeout_s, const std::function<std::string()>& describe) {
    char* p = static_cast<char*>(data);
    while (n > 0) {
        const ssize_t r = ::recv(fd, p, n, 0);
        if (r > 0) {
            p += r;
            n -= static_cast<size_t>(r);
            continue;
        }
        if (r == 0) fail("connection lost (peer exited or closed it) waiting for ", describe());
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (!wait_fd(fd, POLLIN, timeout_s))
                fail("timed out after ", seconds_str(timeout_s), " s waiting for ", describe());
            continue;
        }
        fail("connection lost (", std::strerror(errno), ") waiting for ", describe());
    }
}

std::string resolve_ipv4(const std::string& host) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
    if (rc != 0 || res == nullptr) fail("cannot resolve host '", host, "': ", ::gai_strerror(rc));
    char buf[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr, buf, sizeof buf);
    ::freeaddrinfo(res);
    return buf;
}

namespace {
sockaddr_in make_addr(const std::string& host, int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (host.empty()) {
        addr.sin_addr.s_addr = htonl(INADDR_ANY);
    } else if (::inet_pton(AF_INET, resolve_ipv4(host).c_str(), &addr.sin_addr) != 1) {
        fail("bad IPv4 address '", host, "'");
    }
    return addr;
}

std::string addr_host(const sockaddr_in& addr) {
    char buf[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof buf);
    return buf;
}
}  // namespace

int listen_on(const std::string& host, int port, int backlog) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MF_CHECK(fd >= 0, "socket: ", std::strerror(errno));
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    const sockaddr_in addr = make_addr(host, port);
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, backlog) != 0) {
        const int err = errno;
        ::close(fd);
        fail("cannot listen on ", host.empty() ? "*" : host, ":", port, ": ", std::strerror(err));
    }
    make_nonblocking(fd);
    return fd;
}

int local_port(int fd) {
    sockaddr_in addr{};
    socklen_t len = sizeof addr;
    MF_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0, "getsockname: ", std::strerror(errno));
    return ntohs(addr.sin_port);
}

std::string local_host(int fd) {
    sockaddr_in addr{};
    socklen_t len = sizeof addr;
    MF_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0, "getsockname: ", std::strerror(errno));
    return addr_host(addr);
}

std::string peer_host(int fd) {
    sockaddr_in addr{};
    socklen_t len = sizeof addr;
    MF_CHECK(::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0, "getpeername: ", std::strerror(errno));
    return addr_host(addr);
}

int connect_to(const std::string& host, int port, double deadline, const std::function<std::string()>& describe) {
    const sockaddr_in addr = make_addr(host, port);
    std::string last_error = "no attempt";
    for (;;) {
        const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        MF_CHECK(fd >= 0, "socket: ", std::strerror(errno));
        make_nonblocking(fd);
        int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
        if (rc != 0 && errno == EINPROGRESS) {
            if (wait_fd(fd, POLLOUT, deadline - now_s())) {
                int err = 0;
                socklen_t len = sizeof err;
                ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
                rc = err == 0 ? 0 : -1;
                errno = err;
            } else {
                errno = ETIMEDOUT;
            }
        }
        if (rc == 0) return fd;
        last_error = std::strerror(errno);
        ::close(fd);
        if (now_s() >= deadline)
            fail("could not connect to ", describe(), " at ", host, ":", port, " (", last_error, ")");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

int accept_until(int listen_fd, double deadline) {
    for (;;) {
        const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) {
            make_nonblocking(fd);
            return fd;
        }
        if (errno == EINTR || errno == ECONNABORTED) continue;
        MF_CHECK(errno == EAGAIN || errno == EWOULDBLOCK, "accept: ", std::strerror(errno));
        const double left = deadline - now_s();
        if (left <= 0 || !wait_fd(listen_fd, POLLIN, left)) return -1;
    }
}

}  // namespace net

// --- rendezvous -----------------------------------------------------------------------------------

namespace {
struct JoinMessage {
    uint32_t magic;
    int32_t rank;
    int32_t world_size;
    int32_t mesh_port;
};

std::string prefixed(int rank, const std::string& msg) { return detail::concat("rank ", rank, ": ", msg); }
}  // namespace

Rendezvous::Rendezvous(const DistEnv& env, double timeout_s, int* mesh_listen_fd) : env_(env), timeout_s_(timeout_s) {
    MF_CHECK(timeout_s > 0, "rendezvous timeout must be positive, got ", timeout_s);
    MF_CHECK(env.rank >= 0 && env.rank < env.world_size, "rank ", env.rank, " outside world of ", env.world_size);
    const int n = env.world_size, me = env.rank;
    peers_.resize(n);
    if (mesh_listen_fd != nullptr) *mesh_listen_fd = -1;
    const double deadline = net::now_s() + timeout_s;
    int mesh_fd = -1;
    try {
        if (me == 0) {
            control_fds_.assign(n, -1);
            if (n > 1) {
                // Bind to a loopback MASTER_ADDR itself (tests never open a port to the network).
                const std::string master_ip = net::resolve_ipv4(env.master_addr);
                const int listen_fd =
                    net::listen_on(master_ip.rfind("127.", 0) == 0 ? master_ip : "", env.master_port, n + 16);
                std::vector<PeerAddress> table(n);
                int joined = 0;
                try {
                    while (joined < n - 1) {
                        const int fd = net::accept_until(listen_fd, deadline);
                        if (fd < 0) {
                            std::string missing;
                            for (int r = 1; r < n; ++r)
                                if (control_fds_[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
                            fail("timed out after ", seconds_str(timeout_s), " s in rendezvous on ", env.master_addr,
                                 ":", env.master_port, " waiting for rank(s) ", missing, " (", joined, " of ", n - 1,
                                 " joined)");
                        }
                        JoinMessage join{};
                        try {
                            net::recv_all(fd, &join, sizeof join, deadline - net::now_s(),
                                          [] { return std::string("a joining rank in rendezvous"); });
                        } catch (...) {
                            ::close(fd);
                            throw;
                        }
                        if (join.magic != kJoinMagic || join.rank < 1 || join.rank >= n || join.world_size != n ||
                            control_fds_[join.rank] >= 0) {
                            ::close(fd);
                            if (join.magic != kJoinMagic)
                                fail("rendezvous: a connection sent a malformed join message");
                            if (join.world_size != n)
                                fail("rendezvous: rank ", join.rank, " has WORLD_SIZE ", join.world_size,
                                     ", rank 0 has ", n);
                            fail("rendezvous: rank ", join.rank, " joined twice or is outside the world of ", n);
                        }
                        control_fds_[join.rank] = fd;
                        table[join.rank] = {net::peer_host(fd), join.mesh_port};
                        ++joined;
                    }
                } catch (...) {
                    ::close(listen_fd);
                    throw;
                }
                ::close(listen_fd);
                if (mesh_listen_fd != nullptr) {
                    mesh_fd = net::listen_on(net::local_host(control_fds_[1]), 0, n + 16);
                    table[0] = {net::local_host(control_fds_[1]), net::local_port(mesh_fd)};
                }
                std::vector<uint32_t> wire(1 + 2 * static_cast<size_t>(n));
                wire[0] = kTableMagic;
                for (int r = 0; r < n; ++r) {
                    in_addr a{};
                    ::inet_pton(AF_INET, table[r].host.c_str(), &a);
                    wire[1 + 2 * r] = a.s_addr;
                    wire[2 + 2 * r] = static_cast<uint32_t>(table[r].port);
                }
                for (int r = 1; r < n; ++r)
                    net::send_all(control_fds_[r], wire.data(), wire.size() * 4, timeout_s, rendezvous_peer(r, env));
                peers_ = table;
            }
        } else {
            control_fds_.assign(1, -1);
            control_fds_[0] = net::connect_to(env.master_addr, env.master_port, deadline, rendezvous_peer(0, env));
            if (mesh_listen_fd != nullptr) mesh_fd = net::listen_on(net::local_host(control_fds_[0]), 0, n + 16);
            const JoinMessage join{kJoinMagic, me, n, mesh_fd >= 0 ? net::local_port(mesh_fd) : 0};
            net::send_all(control_fds_[0], &join, sizeof join, timeout_s, rendezvous_peer(0, env));
            std::vector<uint32_t> wire(1 + 2 * static_cast<size_t>(n));
            net::recv_all(control_fds_[0], wire.data(), wire.size() * 4, std::max(deadline - net::now_s(), 0.001),
                          rendezvous_peer(0, env));
            if (wire[0] != kTableMagic) fail("rendezvous: malformed address table from rank 0");
            for (int r = 0; r < n; ++r) {
                char buf[INET_ADDRSTRLEN] = {};
                in_addr a{};
                a.s_addr = wire[1 + 2 * r];
                ::inet_ntop(AF_INET, &a, buf, sizeof buf);
                peers_[r] = {buf, static_cast<int>(wire[2 + 2 * r])};
            }
        }
    } catch (const Error& e) {
        for (int fd : control_fds_)
            if (fd >= 0) ::close(fd);
        control_fds_.clear();
        if (mesh_fd >= 0) ::close(mesh_fd);
        throw Error(prefixed(me, e.what()));
    }
    if (mesh_listen_fd != nullptr) *mesh_listen_fd = mesh_fd;
}

Rendezvous::~Rendezvous() {
    for (int fd : control_fds_)
        if (fd >= 0) ::close(fd);
}

void Rendezvous::share_blob(std::string& blob) {
    const int n = env_.world_size, me = env_.rank;
    if (n == 1) return;
    try {
        if (me == 0) {
            MF_CHECK(blob.size() <= kMaxBlobBytes, "blob of ", blob.size(), " bytes is too large");
            const uint64_t len = blob.size();
            for (int r = 1; r < n; ++r) {
                net::send_all(control_fds_[r], &len, sizeof len, timeout_s_, rendezvous_peer(r, env_));
                net::send_all(control_fds_[r], blob.data(), blob.size(), timeout_s_, rendezvous_peer(r, env_));
            }
        } else {
            uint64_t len = 0;
            net::recv_all(control_fds_[0], &len, sizeof len, timeout_s_, rendezvous_peer(0, env_));
            if (len > kMaxBlobBytes) fail("rank 0 announced a blob of ", len, " bytes (limit ", kMaxBlobBytes, ")");
            blob.assign(static_cast<size_t>(len), '\0');
            net::recv_all(control_fds_[0], blob.data(), blob.size(), timeout_s_, rendezvous_peer(0, env_));
        }
    } catch (const Error& e) {
        throw Error(prefixed(me, e.what()));
    }
}

}  // namespace mf::parallel
