// Rendezvous: how the ranks of a run find each other.
//
// DistEnv is read from the environment of a process started by `moeforge launch`, torchrun, mpirun
// or SLURM:
//   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT      (torchrun / moeforge launch)
//   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST  (srun; used for each value the
//                                                                  first set does not give)
// MASTER_ADDR defaults to the first host of SLURM_JOB_NODELIST (compressed forms such as
// "node[01-04,07],gpu-a1" are expanded), MASTER_PORT to kDefaultMasterPort. Without any of these a
// process is rank 0 of a world of 1.
//
// Rendezvous (IPv4/TCP): rank 0 listens on MASTER_PORT; every other rank connects (retrying until the
// timeout, since rank 0 may start last), sends its rank, world size and the port of its own mesh
// listener; rank 0 checks that every rank came exactly once with the same world size and sends back
// the address table. The control connections to rank 0 stay open so that rank 0 can later share a
// blob with everyone (share_blob: the NCCL unique id). Rank 0's listener binds to MASTER_ADDR when
// that is a loopback address, else to all interfaces; mesh listeners bind to the address each rank
// uses to reach rank 0.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace mf::parallel {

constexpr int kDefaultMasterPort = 29500;

struct DistEnv {
    int rank = 0;
    int world_size = 1;
    int local_rank = 0;
    std::string master_addr = "127.0.0.1";
    int master_port = kDefaultMasterPort;
};

// Reads DistEnv through `getenv` (nullptr = unset). Errors name the variable and its value.
DistEnv dist_env_from(const std::function<const char*(const char*)>& getenv);
DistEnv dist_env_from(const std::map<std::string, std::string>& vars);
DistEnv dist_env_from_process();

// Expands a SLURM host list ("a,b[1-3,07],c[08-09]") into host names, zero padding kept.
// Throws mf::Error naming the list on a malformed form or a range of more than 1'000'000 hosts.
std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist);

// One peer's mesh endpoint as rank 0 saw it.
struct PeerAddress {
    std::string host;  // dotted IPv4
    int port = 0;
};

class Rendezvous {
 public:
    // Blocks until every rank has joined (or timeout_s passes: mf::Error naming the missing ranks,
    // or, on ranks > 0, rank 0). `mesh_listen_fd` receives a listening socket on an ephemeral port
    // (the caller owns it) whose address is in peers()[rank]; pass nullptr to skip it.
    Rendezvous(const DistEnv& env, double timeout_s, int* mesh_listen_fd);
    ~Rendezvous();
    Rendezvous(const Rendezvous&) = delete;
    Rendezvous& operator=(const Rendezvous&) = delete;

    const DistEnv& env() const { return env_; }
    const std::vector<PeerAddress>& peers() const { return peers_; }
    // Rank 0's `blob` is sent to every rank; on return every rank's `blob` equals rank 0's.
    void share_blob(std::string& blob);

 private:
    DistEnv env_;
    double timeout_s_;
    std::vector<PeerAddress> peers_;
    std::vector<int> control_fds_;  // rank 0: one per rank (index 0 unused, -1); others: [0] = rank 0
};

// Helpers shared with the TCP communicator. All throw mf::Error with `what` in the message.
namespace net {
// Monotonic seconds.
double now_s();
// Sets O_NONBLOCK and TCP_NODELAY.
void make_nonblocking(int fd);
// Writes/reads exactly n bytes on a nonblocking socket, polling with `timeout_s` of inactivity.
// `describe` produces the message prefix on failure ("rank 1: ... rank 0 in rendezvous").
void send_all(int fd, const void* data, size_t n, double timeout_s, const std::function<std::string()>& describe);
void recv_all(int fd, void* data, size_t n, double timeout_s, const std::function<std::string()>& describe);
// A listening IPv4 socket on host:port (port 0 = ephemeral); host "" = all interfaces.
int listen_on(const std::string& host, int port, int backlog);
int local_port(int fd);
std::string local_host(int fd);
std::string peer_host(int fd);
// Resolves host (name or dotted quad) to a dotted IPv4 address.
std::string resolve_ipv4(const std::string& host);
// Connects to host:port, retrying refused connections until `deadline` (now_s() scale).
int connect_to(const std::string& host, int port, double deadline, const std::function<std::string()>& describe);
// Accepts one connection, waiting until `deadline`; returns -1 on timeout.
int accept_until(int listen_fd, double deadline);
}  // namespace net

}  // namespace mf::parallel
