// PeerExchange: all_to_all_v between the GPUs of one host by copies straight into each peer's memory
// (CUDA IPC), the path NcclCommunicator::all_to_all_v takes where it can (EP dispatch and combine).
//
// Each rank owns a window: one slot of slot_bytes per peer (what that peer sends here lands in it)
// and two counters per peer, arrived[p] (raised by p when it has filled its slot) and freed[p]
// (raised by p when it has copied out what this rank put in p's slot). A message larger than a slot
// travels in rounds; both ends of a pair know its size (the all_to_all_v contract: recv_counts[p]
// is p's send_counts[this rank]) and so number its rounds alike (one counter per pair and
// direction). Round q from s to d, all on the caller's stream, no host wait:
//   s: wait freed[d] >= q − 1 (d has emptied the slot) ; copy: send piece -> d's slot ;
//      signal d.arrived[s] = q
//   d: wait arrived[s] >= q ; copy the slot -> recv ; signal s.freed[d] = q
// Within a round every rank first posts its sends, then takes its receives, so no rank waits for a
// peer that is itself waiting (the pairs of round q only need round q − 1 done). The self entry is
// a local copy. Exchanges on different streams may interleave: the counters order every reuse of
// a slot. Bytes travel once over NVLink (no NCCL protocol buffers or proxy) plus one local copy out
// of the slot. The copies go to the copy engines by default (cudaMemcpyAsync; they take no SMs from
// the expert GEMMs computing beside the exchange) or are SM kernels (cuda::peer_copy; a round's
// sends and the self piece in one launch; MOEFORGE_PEER_COPY=sm). Measured on 2 H200s: EP dispatch
// + combine alone (MF_BENCH=1 test_nccl_ep, 16384 tokens per rank) SM copies 1.41 ms, copy engines
// 1.52, NCCL send/recv 1.50; in the P2 step (bench/p2_ab.sh, alternating rounds) copy engines
// 116.4 ms against SM copies with 16 SMs left to them 117.6 (and 117.9 / 118.8 on another machine),
// because the SM copies need SMs taken from the GEMMs (MoeDims::ep_comm_sms) while the engines
// do not. (The copy engines get a small share of memory bandwidth while the background AdamW runs:
// a ZeRO-1 parameter broadcast moved this way took 11.5 ms instead of NCCL's ~4.6, so broadcasts
// stay on NCCL.)
//
// Waits give up after the communicator's timeout on the device (peer_flags.cuh) and record which
// peer was late; late_peer() reports it, and NcclCommunicator::synchronize turns it into the
// diagnostic and the exit.
#pragma once

#if defined(MOEFORGE_WITH_NCCL)

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/cuda/peer_flags.cuh"

namespace mf::parallel {

class NcclCommunicator;

class PeerExchange {
 public:
    // The default slot: 64 MiB per peer, which carries one P2-sized message (8192 tokens of 2048
    // fp32 partial sums) in one round. MOEFORGE_PEER_SLOT_MB overrides it.
    static constexpr size_t kDefaultSlotBytes = size_t{64} << 20;

    // Collective over `comm`'s ranks (two all_gathers). Returns the exchange on every rank when every
    // rank's GPU is on the same host as every other's and can map its memory, nullptr on every rank
    // otherwise (or when MOEFORGE_PEER_EXCHANGE=0, or for more than 64 ranks). slot_bytes 0: the
    // default (or the variable).
    // copies: who moves the bytes; Copies::from_env reads MOEFORGE_PEER_COPY (unset or "ce": copy
    // engines, "sm": SM kernels).
    enum class Copies { from_env, engines, kernels };
    static std::unique_ptr<PeerExchange> create(NcclCommunicator& comm, size_t slot_bytes = 0,
                                                Copies copies = Copies::from_env);
    ~PeerExchange();
    PeerExchange(const PeerExchange&) = delete;
    PeerExchange& operator=(const PeerExchange&) = delete;

    // all_to_all_v in bytes (NcclCommunicator checked the arguments), enqueued on `stream`.
    void all_to_all_v(const char* send, std::span<const size_t> send_bytes, std::span<const size_t> send_offsets,
                      char* recv, std::span<const size_t> recv_bytes, std::span<const size_t> recv_offsets,
                      cudaStream_t stream);
    // The rank of the group whose piece did not come within the timeout, or -1.
    int late_peer() const;
    size_t slot_bytes() const { return slot_bytes_; }

 private:
    PeerExchange() = default;
    struct Flags {  // at the start of every window
        uint64_t arrived[64];
        uint64_t freed[64];
    };
    static constexpr int kMaxRanks = 64;
    static constexpr size_t kFlagBytes = 4096;  // Flags, rounded up so the slots stay aligned
    char* slot(char* window, int owner, int source) const;
    Flags* flags(char* window) const { return reinterpret_cast<Flags*>(window); }
    void copy(std::span<const cuda::CopySpan> spans, cudaStream_t stream) const;

    int rank_ = 0, size_ = 1;
    size_t slot_bytes_ = 0;
    uint64_t timeout_ns_ = 0;
    bool sm_copies_ = false;                 // copies by SM kernels (cuda::peer_copy), else by the copy engines
    char* window_ = nullptr;                 // this rank's window
    std::vector<char*> peers_;               // every rank's window as mapped here (peers_[rank_] = window_)
    std::vector<uint64_t> sent_, received_;  // rounds sent to / received from each rank so far
    int* error_host_ = nullptr;              // mapped host word: 0, or 1 + the late rank
    int* error_device_ = nullptr;
};

}  // namespace mf::parallel

#endif  // MOEFORGE_WITH_NCCL
