#include "data/loader.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "core/check.h"

namespace mf::data {

Loader::Loader(const std::vector<Document>* docs, int64_t seq_len, int64_t micro_batch, bool packing, bool shuffle,
               uint64_t seed, int32_t pad_id, LoaderShard shard)
    : docs_(docs),
      seq_len_(seq_len),
      micro_batch_(micro_batch),
      shard_(shard),
      packing_(packing),
      shuffle_(shuffle),
      seed_(seed),
      pad_id_(pad_id) {
    MF_CHECK(docs != nullptr && !docs->empty(), "loader needs at least one document");
    MF_CHECK(seq_len >= 2 && micro_batch >= 1, "bad loader shape");
    MF_CHECK(shard.world >= 1 && shard.rank >= 0 && shard.rank < shard.world, "bad loader shard: rank ", shard.rank,
             " of world ", shard.world);
    build_order();
}

void Loader::build_order() {
    order_.resize(docs_->size());
    std::iota(order_.begin(), order_.end(), 0);
    if (shuffle_) {
        // Fisher-Yates with our own draws: std::shuffle's algorithm differs between libraries.
        std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(state_.epoch) + 1);
        for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[rng() % i]);
    }
}

void Loader::restore(const LoaderState& s) {
    if (s.epoch < 0 || s.cursor < 0 || s.cursor > static_cast<int64_t>(docs_->size()))
        fail("data-loader state (epoch ", s.epoch, ", cursor ", s.cursor, ") does not fit a dataset of ", docs_->size(),
             " documents");
    state_ = s;
    build_order();
}

const Document& Loader::next_doc() {
    if (state_.cursor >= static_cast<int64_t>(order_.size())) {
        ++state_.epoch;
        state_.cursor = 0;
        build_order();
    }
    return (*docs_)[static_cast<size_t>(order_[static_cast<size_t>(state_.cursor++)])];
}

bool Loader::done() const { return state_.cursor >= static_cast<int64_t>(order_.size()); }

Batch Loader::next() {
    MF_CHECK(!(single_pass_ && done()), "single-pass loader: every document was already used");
    Batch b;
    b.B = micro_batch_;
    b.T = seq_len_;
    const size_t n = static_cast<size_t>(micro_batch_ * seq_len_);
    b.input_ids.assign(n, pad_id_);
    b.targets.assign(n, kIgnoreIndex);
    b.positions.assign(n, 0);
    b.doc_ids.assign(n, -1);
    b.is_pad.assign(n, 1);
    // Every rank walks the whole global micro-batch so the cursor moves alike everywhere.
    const int64_t first_row = shard_.rank * micro_batch_;
    int64_t filled = 0;  // rows of mine that hold a document (all of them, except at a single pass's end)
    for (int64_t g = 0; g < shard_.world * micro_batch_; ++g) {
        const bool mine = g >= first_row && g < first_row + micro_batch_;
        const PackingStats row = fill_row(&b, mine ? g - first_row : -1);
        if (!mine || row.real_tokens == 0) continue;
        ++filled;
        ++stats_.rows;
        stats_.real_tokens += row.real_tokens;
        stats_.target_tokens += row.target_tokens;
    }
    if (filled < micro_batch_) {  // single pass: the rows after the last document are left out
        b.B = std::max<int64_t>(filled, 1);
        const size_t m = static_cast<size_t>(b.B * seq_len_);
        b.input_ids.resize(m);
        b.targets.resize(m);
        b.positions.resize(m);
        b.doc_ids.resize(m);
        b.is_pad.resize(m);
    }
    return b;
}

PackingStats Loader::measure_epoch() const {
    Loader walk = *this;
    walk.single_pass_ = true;
    walk.state_.cursor = 0;
    PackingStats total;
    while (!walk.done()) {
        const PackingStats row = walk.fill_row(nullptr, -1);
        ++total.rows;
        total.real_tokens += row.real_tokens;
        total.target_tokens += row.target_tokens;
    }
    return total;
}

PackingStats Loader::fill_row(Batch* b, int64_t r) {
    PackingStats row;
    int64_t used = 0;
    int32_t doc_idx = 0;
    while (used < seq_len_) {
        if (single_pass_ && done()) break;
        const Document& d = next_doc();
        const int64_t len = std::min<int64_t>(static_cast<int64_t>(d.input_ids.size()), seq_len_);
        if (used > 0 && used + len > seq_len_) {  // does not fit: put it back, it opens the next row
            --state_.cursor;
            break;
        }
        for (int64_t t = 0; t + 1 < len; ++t) row.target_tokens += d.labels[static_cast<size_t>(t + 1)] != kIgnoreIndex;
        if (r >= 0) {
            for (int64_t t = 0; t < len; ++t) {
                const size_t i = static_cast<size_t>(r * seq_len_ + used + t);
                b->input_ids[i] = d.input_ids[static_cast<size_t>(t)];
                b->positions[i] = static_cast<int32_t>(t);
                b->doc_ids[i] = doc_idx;
                b->is_pad[i] = 0;
                if (t + 1 < len) b->targets[i] = d.labels[static_cast<size_t>(t + 1)];
            }
        }
        used += len;
        ++doc_idx;
        if (!packing_) break;
    }
    row.real_tokens = used;
    if (r < 0) return row;
    // Padding: its own document, positions counting from 0, no targets.
    for (int64_t t = used; t < seq_len_; ++t) {
        const size_t i = static_cast<size_t>(r * seq_len_ + t);
        b->doc_ids[i] = doc_idx;
        b->positions[i] = static_cast<int32_t>(t - used);
    }
    return row;
}

}  // namespace mf::data
