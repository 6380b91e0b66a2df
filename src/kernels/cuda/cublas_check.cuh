// MF_CHECK_CUBLAS(expr): a cuBLAS / cuBLASLt status other than success becomes an mf::Error naming
// the expression, the file and line, and cuBLAS's own description of the status. Kept out of
// core/check.h so that code without CUDA never includes cuBLAS headers.
#pragma once

#include <cublas_v2.h>

#include "core/check.h"

#define MF_CHECK_CUBLAS(expr)                                                                                         \
    do {                                                                                                              \
        cublasStatus_t mf_status_ = (expr);                                                                           \
        if (mf_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                                         \
            ::mf::detail::throw_error(#expr, __FILE__, __LINE__, __func__,                                            \
                                      ::mf::detail::concat("cuBLAS error: ", cublasGetStatusString(mf_status_), " (", \
                                                           static_cast<int>(mf_status_), ")"));                       \
    } while (0)
