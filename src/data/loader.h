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

class Loader {
 public:
    Loader(const std::vector<Document>* docs, int64_t seq_len, int64_t micro_batch, bool packing, bool shuffle,
           uint64_t seed, int32_t pad_id = 0, LoaderShard shard = {});
    Batch next();
    const LoaderState& state() const { return state_; }
    void restore(const LoaderState& s);

 private:
    const Document& next_doc();
    void build_order();
    void fill_row(Batch* b, int64_t row);  // row < 0: consume the row's documents without writing them
    const std::vector<Document>* docs_;
    int64_t seq_len_, micro_batch_;
    LoaderShard shard_;
    bool packing_, shuffle_;
    uint64_t seed_;
    int32_t pad_id_;
    std::vector<int64_t> order_;
    LoaderState state_;
};

}  // namespace mf::data
