// CUDA error checks, kept apart from check.h so host-only code never includes CUDA headers.
#pragma once

#include <cuda_runtime.h>

#include "core/check.h"

#define MF_CHECK_CUDA(expr)                                                                                  \
    do {                                                                                                     \
        cudaError_t mf_status_ = (expr);                                                                     \
        if (mf_status_ != cudaSuccess) [[unlikely]]                                                          \
            ::mf::detail::throw_error(#expr, __FILE__, __LINE__, __func__,                                   \
                                      ::mf::detail::concat("CUDA error: ", cudaGetErrorString(mf_status_))); \
    } while (0)
