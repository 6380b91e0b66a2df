// Expert-parallel token exchange, CPU reference (spec: ep_tokens.h).
//   positions  per destination, a running count over the tokens in order: a token is bound for v
//              when one of its valid slots has expert_dest[e] == v.
//   pack       block v's row off(v) + send_pos[v, t] takes token t's row / meta.
//   owner ops  per received row, its K slots in k order.
//   sum        per token, its destinations in v order.
// Every sum starts from 0 on one thread and runs k (or v) ascending, so results are deterministic.
// Invalid indices are skipped, never used (the header lists them).
#include "kernels/cpu/ep_tokens.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/lane_dot.h"

namespace mf::cpu {

namespace {

void check_sizes(const char* op, int64_t N, int64_t K, int64_t V, int64_t H) {
    MF_CHECK(N >= 0 && K >= 1 && V >= 1 && H >= 0, op, ": bad shape N=", N, " K=", K, " V=", V, " H=", H);
    MF_CHECK(N <= std::numeric_limits<int32_t>::max() / K, op, ": N·K = ", N, "·", K, " does not fit int32 indices");
}

// off[v] = Σ_{v' < v} max(counts[v'], 0).
std::vector<int64_t> block_offsets(const int32_t* counts, int64_t V) {
    std::vector<int64_t> off(static_cast<size_t>(V));
    int64_t at = 0;
    for (int64_t v = 0; v < V; ++v) {
        off[v] = at;
        at += std::max<int32_t>(counts[v], 0);
    }
    return off;
}

// Block row of token t for destination v, or -1 when send_pos, counts or the buffer rule it out.
int64_t block_row(const int32_t* send_pos, const int32_t* counts, const std::vector<int64_t>& off, int64_t N, int64_t v,
                  int64_t t, int64_t num_rows) {
    const int32_t pos = send_pos[v * N + t];
    if (pos < 0 || pos >= counts[v]) return -1;
    const int64_t row = off[v] + pos;
    return row < num_rows ? row : -1;
}

// The destination of slot p, or -1.
int64_t slot_dest(const int32_t* topk_idx, const int32_t* expert_dest, int64_t p, int64_t E, int64_t V) {
    const int32_t e = topk_idx[p];
    if (e < 0 || e >= E) return -1;
    const int32_t v = expert_dest[e];
    return v >= 0 && v < V ? v : -1;
}

float weight_of(const int32_t* meta_row, int64_t K, int64_t k) {
    float w;
    std::memcpy(&w, meta_row + K + k, sizeof w);
    return w;
}

}  // namespace

void ep_token_positions(int32_t* send_pos, int32_t* counts, const int32_t* topk_idx, const int32_t* expert_dest,
                        int64_t N, int64_t K, int64_t E, int64_t V) {
    check_sizes("ep_token_positions", N, K, V, 0);
    MF_CHECK(E >= 1, "ep_token_positions: need at least one expert, got E=", E);
    std::fill(counts, counts + V, 0);
    std::vector<bool> bound(static_cast<size_t>(V));
    for (int64_t t = 0; t < N; ++t) {
        std::fill(bound.begin(), bound.end(), false);
        for (int64_t k = 0; k < K; ++k) {
            const int64_t v = slot_dest(topk_idx, expert_dest, t * K + k, E, V);
            if (v >= 0) bound[v] = true;
        }
        for (int64_t v = 0; v < V; ++v) send_pos[v * N + t] = bound[v] ? counts[v]++ : -1;
    }
}

void ep_pack_rows(float* rows, int64_t num_rows, const float* src, const int32_t* send_pos, const int32_t* counts,
                  int64_t N, int64_t V, int64_t H) {
    check_sizes("ep_pack_rows", N, 1, V, H);
    const std::vector<int64_t> off = block_offsets(counts, V);
    for (int64_t v = 0; v < V; ++v) {
        for (int64_t t = 0; t < N; ++t) {
            const int64_t row = block_row(send_pos, counts, off, N, v, t, num_rows);
            if (row >= 0) std::copy_n(src + t * H, H, rows + row * H);
        }
    }
}

void ep_pack_meta(int32_t* meta, int64_t num_rows, const int32_t* send_pos, const int32_t* counts,
                  const int32_t* topk_idx, const float* topk_weight, const int32_t* pair_row,
                  const int32_t* expert_offsets, const int32_t* row_base, const int32_t* expert_dest, int64_t N,
                  int64_t K, int64_t E, int64_t V) {
    check_sizes("ep_pack_meta", N, K, V, 0);
    MF_CHECK(E >= 1, "ep_pack_meta: need at least one expert, got E=", E);
    const std::vector<int64_t> off = block_offsets(counts, V);
    for (int64_t v = 0; v < V; ++v) {
        for (int64_t t = 0; t < N; ++t) {
            const int64_t row = block_row(send_pos, counts, off, N, v, t, num_rows);
            if (row < 0) continue;
            int32_t* m = meta + row * 2 * K;
            for (int64_t k = 0; k < K; ++k) {
                const int64_t p = t * K + k;
                int32_t local = -1;
                float w = 0.0f;
                if (slot_dest(topk_idx, expert_dest, p, E, V) == v) {
                    const int32_t e = topk_idx[p];
                    if (pair_row[p] >= expert_offsets[e] && pair_row[p] < expert_offsets[e + 1]) {
                        const int64_t d = int64_t{row_base[e]} + pair_row[p] - expert_offsets[e];
                        if (d >= 0 && d <= std::numeric_limits<int32_t>::max()) {
                            local = static_cast<int32_t>(d);
                            w = topk_weight[p];
                        }
                    }
                }
                m[k] = local;
                std::memcpy(m + K + k, &w, sizeof w);
            }
        }
    }
}

void ep_scatter_rows(float* local, int64_t num_local, const float* rows, const int32_t* meta, int64_t M, int64_t K,
                     int64_t H) {
    check_sizes("ep_scatter_rows", M, K, 1, H);
    for (int64_t i = 0; i < M; ++i) {
        for (int64_t k = 0; k < K; ++k) {
            const int32_t d = meta[i * 2 * K + k];
            if (d >= 0 && d < num_local) std::copy_n(rows + i * H, H, local + d * H);
        }
    }
}

void ep_scatter_grad(float* dlocal, float* dweight, const float* drows, const int32_t* meta, const float* y_local,
                     int64_t num_local, int64_t M, int64_t K, int64_t H) {
    check_sizes("ep_scatter_grad", M, K, 1, H);
    for (int64_t i = 0; i < M; ++i) {
        const int32_t* m = meta + i * 2 * K;
        const float* g = drows + i * H;
        for (int64_t k = 0; k < K; ++k) {
            const int32_t d = m[k];
            if (d < 0 || d >= num_local) {
                dweight[i * K + k] = 0.0f;
                continue;
            }
            const float w = weight_of(m, K, k);
            float* dl = dlocal + d * H;
            for (int64_t h = 0; h < H; ++h) dl[h] = w * g[h];
            dweight[i * K + k] = lane_dot(g, y_local + d * H, H);
        }
    }
}

void ep_reduce_rows(float* out, const float* local, int64_t num_local, const int32_t* meta, int64_t M, int64_t K,
                    int64_t H, bool weighted) {
    check_sizes("ep_reduce_rows", M, K, 1, H);
    for (int64_t i = 0; i < M; ++i) {
        const int32_t* m = meta + i * 2 * K;
        float* o = out + i * H;
        std::fill(o, o + H, 0.0f);
        for (int64_t k = 0; k < K; ++k) {
            const int32_t d = m[k];
            if (d < 0 || d >= num_local) continue;
            const float* y = local + d * H;
            if (weighted) {
                const float w = weight_of(m, K, k);
                for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
            } else {
                for (int64_t h = 0; h < H; ++h) o[h] += y[h];
            }
        }
    }
}

void ep_sum_blocks(float* out, bool accumulate, const float* rows, int64_t num_rows, const int32_t* send_pos,
                   const int32_t* counts, int64_t N, int64_t V, int64_t H) {
    check_sizes("ep_sum_blocks", N, 1, V, H);
    const std::vector<int64_t> off = block_offsets(counts, V);
    std::vector<float> acc(static_cast<size_t>(H));
    for (int64_t t = 0; t < N; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t v = 0; v < V; ++v) {
            const int64_t row = block_row(send_pos, counts, off, N, v, t, num_rows);
            if (row < 0) continue;
            const float* r = rows + row * H;
            for (int64_t h = 0; h < H; ++h) acc[h] += r[h];
        }
        float* o = out + t * H;
        for (int64_t h = 0; h < H; ++h) o[h] = accumulate ? o[h] + acc[h] : acc[h];
    }
}

void ep_gather_slots(float* dtopk_weight, const float* dweight_rows, int64_t num_rows, const int32_t* send_pos,
                     const int32_t* counts, const int32_t* topk_idx, const int32_t* expert_dest, int64_t N, int64_t K,
                     int64_t E, int64_t V) {
    check_sizes("ep_gather_slots", N, K, V, 0);
    MF_CHECK(E >= 1, "ep_gather_slots: need at least one expert, got E=", E);
    const std::vector<int64_t> off = block_offsets(counts, V);
    for (int64_t t = 0; t < N; ++t) {
        for (int64_t k = 0; k < K; ++k) {
            const int64_t v = slot_dest(topk_idx, expert_dest, t * K + k, E, V);
            const int64_t row = v >= 0 ? block_row(send_pos, counts, off, N, v, t, num_rows) : -1;
            dtopk_weight[t * K + k] = row >= 0 ? dweight_rows[row * K + k] : 0.0f;
        }
    }
}

}  // namespace mf::cpu
