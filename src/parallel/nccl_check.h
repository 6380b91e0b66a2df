// NCCL error check, kept apart from check.h so that host-only code never includes NCCL headers.
//   MF_CHECK_NCCL(ncclAllReduce(...));   throws mf::Error with the call, file, line and NCCL's reason.
// ncclInProgress (a nonblocking communicator still working) is not an error here; callers that use
// nonblocking communicators wait for completion themselves (nccl_communicator.cpp).
#pragma once

#include <nccl.h>

#include "core/check.h"

#define MF_CHECK_NCCL(expr)                                                                                       \
    do {                                                                                                          \
        const ncclResult_t mf_nccl_status_ = (expr);                                                              \
        if (mf_nccl_status_ != ncclSuccess && mf_nccl_status_ != ncclInProgress) [[unlikely]]                     \
            ::mf::detail::throw_error(#expr, __FILE__, __LINE__, __func__,                                        \
                                      ::mf::detail::concat("NCCL error: ", ncclGetErrorString(mf_nccl_status_))); \
    } while (0)
