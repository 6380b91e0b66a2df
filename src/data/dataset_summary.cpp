// Dataset summary: truncation and empty-document accounting (see dataset_summary.h).
#include "data/dataset_summary.h"

#include <algorithm>
#include <cstdio>

#include "core/check.h"
#include "data/batch.h"

namespace mf::data {

namespace {

// Targets of a document cut to its first seq_len tokens (targets[t] = labels[t + 1]).
int64_t targets_within(const Document& d, int64_t seq_len) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(d.labels.size()), seq_len);
    int64_t n = 0;
    for (int64_t t = 1; t < len; ++t) n += d.labels[static_cast<size_t>(t)] != kIgnoreIndex;
    return n;
}

}  // namespace

DatasetSummary prepare_documents(TokenDataset& ds, int64_t seq_len, const std::string& source) {
    MF_CHECK(seq_len >= 2, "seq_len must be at least 2, got ", seq_len);
    DatasetSummary s;
    s.source = source;
    s.seq_len = seq_len;
    s.records_skipped = ds.skipped_lines;
    s.records_read = static_cast<int64_t>(ds.docs.size()) + ds.skipped_lines;
    std::vector<Document> kept;
    kept.reserve(ds.docs.size());
    for (Document& d : ds.docs) {
        const int64_t len = static_cast<int64_t>(d.input_ids.size());
        if (len > seq_len) ++s.records_truncated;
        const int64_t targets = targets_within(d, seq_len);
        if (targets == 0) {
            ++s.records_dropped;
            continue;
        }
        s.tokens += std::min(len, seq_len);
        s.target_tokens += targets;
        kept.push_back(std::move(d));
    }
    ds.docs = std::move(kept);
    if (ds.docs.empty())
        fail(source, ": none of the ", s.records_read - s.records_skipped,
             " records has a target token within its first ", seq_len,
             " tokens (train.seq_len); raise seq_len or check the loss mask (data.loss_on)");
    return s;
}

std::string DatasetSummary::describe() const {
    char pack[96] = "";
    if (packing.rows > 0)
        std::snprintf(pack, sizeof pack, "; packing %.1f%% (%lld rows x %lld)", 100.0 * packing.efficiency(seq_len),
                      static_cast<long long>(packing.rows), static_cast<long long>(seq_len));
    return "data " + source + ": " + std::to_string(records_read) + " records (" + std::to_string(records_skipped) +
           " skipped as bad), " + std::to_string(records_truncated) + " truncated at seq_len " +
           std::to_string(seq_len) + ", " + std::to_string(records_dropped) + " dropped with no target token left; " +
           std::to_string(tokens) + " tokens, " + std::to_string(target_tokens) + " targets" + pack;
}

}  // namespace mf::data
