// Row gather and scatter by an index, CPU reference (spec: kernels/cpu/rows.h): one memcpy per row,
// in index order.
#include "kernels/cpu/rows.h"

#include <cstring>

#include "core/check.h"

namespace mf::cpu {

namespace {

// `direct`: the buffer with num_rows rows; `indexed`: the one the index points into (may be null
// when it has no rows: every index is then out of range).
void check_args(const char* op, const void* direct, const void* indexed, const int32_t* index, int64_t num_rows,
                int64_t indexed_rows, int64_t row_bytes) {
    MF_CHECK(num_rows >= 0 && indexed_rows >= 0 && row_bytes >= 0, op, ": bad shape rows=", num_rows,
             " indexed rows=", indexed_rows, " row bytes=", row_bytes);
    MF_CHECK(num_rows == 0 || row_bytes == 0 ||
                 (direct != nullptr && index != nullptr && (indexed != nullptr || indexed_rows == 0)),
             op, ": null buffer");
}

}  // namespace

void gather_rows(void* dst, const void* src, const int32_t* index, int64_t num_rows, int64_t num_src_rows,
                 int64_t row_bytes) {
    check_args("gather_rows", dst, src, index, num_rows, num_src_rows, row_bytes);
    const size_t n = static_cast<size_t>(row_bytes);
    char* out = static_cast<char*>(dst);
    const char* in = static_cast<const char*>(src);
    for (int64_t i = 0; i < num_rows; ++i) {
        const int64_t r = index[i];
        char* row = out + static_cast<size_t>(i) * n;
        if (r >= 0 && r < num_src_rows) std::memcpy(row, in + static_cast<size_t>(r) * n, n);
        else std::memset(row, 0, n);
    }
}

void scatter_rows(void* dst, const void* src, const int32_t* index, int64_t num_rows, int64_t num_dst_rows,
                  int64_t row_bytes) {
    check_args("scatter_rows", src, dst, index, num_rows, num_dst_rows, row_bytes);
    const size_t n = static_cast<size_t>(row_bytes);
    char* out = static_cast<char*>(dst);
    const char* in = static_cast<const char*>(src);
    for (int64_t i = 0; i < num_rows; ++i) {
        const int64_t r = index[i];
        if (r < 0 || r >= num_dst_rows) continue;
        std::memcpy(out + static_cast<size_t>(r) * n, in + static_cast<size_t>(i) * n, n);
    }
}

void check_row_pieces(const char* op, const void* dst, const void* src, const int64_t* pieces, int64_t num_pieces,
                      int64_t num_dst_rows, int64_t num_src_rows, int64_t row_bytes) {
    MF_CHECK(num_pieces >= 0 && num_dst_rows >= 0 && num_src_rows >= 0 && row_bytes >= 0, op, ": bad shape");
    for (int64_t p = 0; p < num_pieces; ++p) {
        const int64_t s = pieces[3 * p], d = pieces[3 * p + 1], n = pieces[3 * p + 2];
        MF_CHECK(n >= 0 && s >= 0 && d >= 0 && s <= num_src_rows - n && d <= num_dst_rows - n, op, ": piece ", p,
                 " (", n, " rows from ", s, " to ", d, ") leaves the buffers (", num_src_rows, " source rows, ",
                 num_dst_rows, " destination rows)");
        MF_CHECK(n == 0 || row_bytes == 0 || (dst != nullptr && src != nullptr), op, ": null buffer");
    }
}

void copy_row_pieces(void* dst, const void* src, const int64_t* pieces, int64_t num_pieces, int64_t num_dst_rows,
                     int64_t num_src_rows, int64_t row_bytes) {
    check_row_pieces("copy_row_pieces", dst, src, pieces, num_pieces, num_dst_rows, num_src_rows, row_bytes);
    const size_t n = static_cast<size_t>(row_bytes);
    for (int64_t p = 0; p < num_pieces; ++p)
        if (pieces[3 * p + 2] > 0)
            std::memcpy(static_cast<char*>(dst) + static_cast<size_t>(pieces[3 * p + 1]) * n,
                        static_cast<const char*>(src) + static_cast<size_t>(pieces[3 * p]) * n,
                        static_cast<size_t>(pieces[3 * p + 2]) * n);
}

}  // namespace mf::cpu
