// Expert-parallel token exchange, CPU reference (the spec of ops.h, "expert-parallel token
// exchange"). A token travels once to every destination v (one chunk of one EP rank's experts,
// V of them, expert_dest[e] in [0, V)) that owns at least one of its top-k experts:
//   send_pos[V, N]  the token's position among the tokens bound for v (token order), or -1
//   counts[V]       tokens bound for v
//   block buffer    destination v's tokens at rows [off(v), off(v) + counts[v]), off(v) = Σ_{v'<v}
//                   counts[v'] (a negative count counts as 0), in send-position order
//   meta[M, 2K]     per sent row: columns [0, K) the destination's local row of slot k (-1 when the
//                   slot is not the destination's), columns [K, 2K) the slot's weight (f32 bits, 0)
// Indices read from memory are never trusted: an expert outside [0, E), a destination outside
// [0, V), a send position outside [0, counts[v]), a block row outside the row buffer, a local row
// outside [0, num_local) is skipped (contributes nothing, writes nothing), as on the GPU. Sums are
// fp32 in a fixed order (k ascending, v ascending), starting from 0; "with accumulate" adds the
// old value after the sum. Rows of f32, H elements each.
#pragma once

#include <cstdint>

namespace mf::cpu {

// send_pos [V, N], counts [V] (written) from topk_idx [N, K] and expert_dest [E].
void ep_token_positions(int32_t* send_pos, int32_t* counts, const int32_t* topk_idx, const int32_t* expert_dest,
                        int64_t N, int64_t K, int64_t E, int64_t V);

// rows [num_rows, H]: block v's row send_pos[v, t] = src[t] (src [N, H]); other rows untouched.
void ep_pack_rows(float* rows, int64_t num_rows, const float* src, const int32_t* send_pos, const int32_t* counts,
                  int64_t N, int64_t V, int64_t H);

// meta [num_rows, 2K], the rows of ep_pack_rows: slot k of token t (expert e = topk_idx[t, k]) in v's
// block row holds row_base[e] + pair_row[t·K + k] − expert_offsets[e] and the bits of
// topk_weight[t, k] when expert_dest[e] == v, else -1 and 0. A pair_row outside
// [expert_offsets[e], expert_offsets[e + 1]) (expert_offsets has E + 1 entries) or a local row outside
// [0, 2^31) gives -1 and 0 as well. Rows of no (v, t) untouched.
void ep_pack_meta(int32_t* meta, int64_t num_rows, const int32_t* send_pos, const int32_t* counts,
                  const int32_t* topk_idx, const float* topk_weight, const int32_t* pair_row,
                  const int32_t* expert_offsets, const int32_t* row_base, const int32_t* expert_dest, int64_t N,
                  int64_t K, int64_t E, int64_t V);

// local [num_local, H]: local[d] = rows[i] for every slot k of row i < M with d = meta[i, k] valid;
// other local rows untouched. NOTE: a local row named twice is written twice (the last one wins
// here, an unspecified one on the GPU); the exchange names each local row once.
void ep_scatter_rows(float* local, int64_t num_local, const float* rows, const int32_t* meta, int64_t M, int64_t K,
                     int64_t H);

// dlocal [num_local, H]: dlocal[d] = w[i, k] · drows[i] (written, rows of valid slots only);
// dweight [M, K] (written) = <drows[i], y_local[d]> (fp32 dot, lane_dot's order), 0 for slots without
// a valid local row. y_local [num_local, H].
void ep_scatter_grad(float* dlocal, float* dweight, const float* drows, const int32_t* meta, const float* y_local,
                     int64_t num_local, int64_t M, int64_t K, int64_t H);

// out [M, H] (written) = Σ_k (weighted ? w[i, k] : 1) · local[meta[i, k]], k ascending, valid slots.
void ep_reduce_rows(float* out, const float* local, int64_t num_local, const int32_t* meta, int64_t M, int64_t K,
                    int64_t H, bool weighted);

// out [N, H] = (accumulate ? old + : ) Σ_v rows[off(v) + send_pos[v, t]], v ascending, valid entries.
void ep_sum_blocks(float* out, bool accumulate, const float* rows, int64_t num_rows, const int32_t* send_pos,
                   const int32_t* counts, int64_t N, int64_t V, int64_t H);

// dtopk_weight [N, K] (written): slot k of token t = dweight_rows[off(v) + send_pos[v, t], k] with
// v = expert_dest[topk_idx[t, k]]; 0 where any index on the way is invalid. dweight_rows [num_rows, K].
void ep_gather_slots(float* dtopk_weight, const float* dweight_rows, int64_t num_rows, const int32_t* send_pos,
                     const int32_t* counts, const int32_t* topk_idx, const int32_t* expert_dest, int64_t N, int64_t K,
                     int64_t E, int64_t V);

}  // namespace mf::cpu
