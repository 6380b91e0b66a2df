// Turns documents into batches, deterministically from the seed.
//
// Each epoch visits every document once, in an order shuffled from (seed, epoch) when shuffling
// is on. With packing, consecutive documents share a row of seq_len tokens while they fit; each
// keeps its own positions (restarting at 0) and doc id (attention stays inside it), and its last
// token has no target, so nothing is learned across a document boundary. Without packing, one
// document per row. Documents longer than seq_len are truncated; the rest of a row is padding,
// which never counts in the loss or token counts. The state (epoch, cursor) restores a run exactly.
//
// Data parallelism: rank r of w builds the same global micro-batch of w * micro_batch rows from the
// same document order, and keeps rows [r * micro_batch, (r + 1) * micro_batch). The ranks' batches,
// stacked in rank order, are therefore exactly the batch one rank with micro_batch * w would see,
// and every rank's state (epoch, cursor: a position in the shared order) is the same, so a run
// restores exactly, and the state does not depend on the rank.
//
// Single pass (evaluation): the documents once, in order, and no further epoch; the last batch holds
// only the rows that received a document (its B may be smaller than micro_batch), done() tells
// when every document was used. stats() counts what next() produced for this rank's rows, and
// measure_epoch() the packing of one whole epoch (every rank's rows) without moving the loader.
#pragma once

#include <cstdint>
#include <vector>

#include "data/batch.h"
#include "data/token_dataset.h"

namespace mf::data {

struct LoaderState {
    int64_t epoch = 0;
    int64_t cursor = 0;  // next document within the epoch's order
};

struct LoaderShard {
    int64_t rank = 0;   // 0 <= rank < world
    int64_t world = 1;  // data-parallel ranks
};

// Rows, real (non-padding) tokens and target tokens of the rows produced.
struct PackingStats {
    int64_t rows = 0;
    int64_t real_tokens = 0;
    int64_t target_tokens = 0;
    // real tokens / (rows x seq_len): how much of the rows is documents rather than padding
    double efficiency(int64_t seq_len) const {
        return rows > 0 ? static_cast<double>(real_tokens) / (static_cast<double>(rows) * static_cast<double>(seq_len))
                        : 0.0;
    }
};

class Loader {
 public:
    Loader(const std::vector<Document>* docs, int64_t seq_len, int64_t micro_batch, bool packing, bool shuffle,
           uint64_t seed, int32_t pad_id = 0, LoaderShard shard = {});
    Batch next();
    const LoaderState& state() const { return state_; }
    void restore(const LoaderState& s);

    void set_single_pass(bool on) { single_pass_ = on; }
    bool done() const;  // single pass: every document has been used
    const PackingStats& stats() const { return stats_; }
    // The rows of the epoch this loader is in, from its first document to its last, over all ranks.
    PackingStats measure_epoch() const;
    int64_t seq_len() const { return seq_len_; }

 private:
    const Document& next_doc();
    void build_order();
    // row < 0: consume the row's documents without writing them. Returns the row's real tokens and
    // targets (zero tokens: single pass and no document left).
    PackingStats fill_row(Batch* b, int64_t row);
    const std::vector<Document>* docs_;
    int64_t seq_len_, micro_batch_;
    LoaderShard shard_;
    bool packing_, shuffle_;
    uint64_t seed_;
    int32_t pad_id_;
    std::vector<int64_t> order_;
    LoaderState state_;
    bool single_pass_ = false;
    PackingStats stats_;
};

}  // namespace mf::data
