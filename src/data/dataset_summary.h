// What a run's data turned into, for one line before step 1 (and the end-of-run report).
//
// prepare_documents() takes the documents as read and the seq_len the loader cuts them at: it
// counts the records longer than seq_len (the loader keeps their first seq_len tokens) and drops
// those left with no target token after that cut (a prompt longer than seq_len, say), since they
// would only add rows that teach nothing; an error when no document is left. The packing figure
// is the loader's (Loader::measure_epoch()): real tokens / (rows x seq_len) of one epoch.
#pragma once

#include <cstdint>
#include <string>

#include "data/loader.h"
#include "data/token_dataset.h"

namespace mf::data {

struct DatasetSummary {
    std::string source;  // the dataset file
    int64_t seq_len = 0;
    int64_t records_read = 0;       // records that were not blank lines: kept + skipped
    int64_t records_skipped = 0;    // malformed, skipped (data.on_error: skip)
    int64_t records_truncated = 0;  // longer than seq_len: cut to their first seq_len tokens
    int64_t records_dropped = 0;    // no target token left after the cut: removed from the data
    int64_t tokens = 0;             // tokens of the kept records, after the cut
    int64_t target_tokens = 0;      // tokens that count in the loss, after the cut
    PackingStats packing;           // one epoch of the loader's rows (all ranks); rows == 0: not measured

    // One line: "data FILE: 30 records (0 skipped as bad), 19 truncated at seq_len 64, 2 dropped
    // with no target token left; 1860 tokens, 1203 targets; packing 93.8% (31 rows x 64)".
    std::string describe() const;
};

// Counts and drops as described above; `ds` keeps the documents that have a target left.
DatasetSummary prepare_documents(TokenDataset& ds, int64_t seq_len, const std::string& source);

}  // namespace mf::data
