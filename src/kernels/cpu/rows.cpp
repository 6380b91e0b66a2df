// Row-range copies, CPU reference (spec: kernels/cpu/rows.h): one memcpy per piece, in order.
#include "kernels/cpu/rows.h"

#include <cstring>

#include "core/check.h"

namespace mf::cpu {

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
