// Builds without CUDA: the table of CUDA bodies is empty, so ops.cpp refuses every device tensor
// with its one "built without CUDA" message.
#include "ops/cuda_ops.h"

namespace mf::ops {

const CudaOps& cuda_ops() {
    static constexpr CudaOps kNone{};
    return kNone;
}

}  // namespace mf::ops
