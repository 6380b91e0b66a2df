#include "data/batch.h"

#include "core/check.h"

namespace mf::data {

Batch make_row_batch(const std::vector<std::vector<int32_t>>& input_ids,
                     const std::vector<std::vector<int32_t>>& labels, int64_t T, int32_t pad_id) {
    MF_CHECK(labels.empty() || labels.size() == input_ids.size(), "labels and input_ids differ in row count");
    Batch b;
    b.B = static_cast<int64_t>(input_ids.size());
    b.T = T;
    const size_t n = static_cast<size_t>(b.B * T);
    b.input_ids.assign(n, pad_id);
    b.targets.assign(n, kIgnoreIndex);
    b.positions.assign(n, 0);
    b.doc_ids.assign(n, 0);
    b.is_pad.assign(n, 1);
    for (int64_t r = 0; r < b.B; ++r) {
        const auto& ids = input_ids[r];
        const auto& lab = labels.empty() ? ids : labels[r];
        MF_CHECK(static_cast<int64_t>(ids.size()) <= T, "row ", r, " longer than T");
        MF_CHECK(lab.size() == ids.size(), "row ", r, ": labels and input_ids differ in length");
        for (size_t t = 0; t < ids.size(); ++t) {
            const size_t i = static_cast<size_t>(r * T) + t;
            b.input_ids[i] = ids[t];
            b.positions[i] = static_cast<int32_t>(t);
            b.is_pad[i] = 0;
            if (t + 1 < ids.size()) b.targets[i] = lab[t + 1];
        }
        // Padding forms its own "document" so real tokens never attend to it.
        for (int64_t t = static_cast<int64_t>(ids.size()); t < T; ++t) {
            const size_t i = static_cast<size_t>(r * T + t);
            b.doc_ids[i] = 1;
            b.positions[i] = static_cast<int32_t>(t - static_cast<int64_t>(ids.size()));
        }
    }
    return b;
}

}  // namespace mf::data
