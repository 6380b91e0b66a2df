// The device a user names (recipe `device`, the --device option of eval, bench and generate).
#pragma once

#include <string>

#include "core/tensor.h"

namespace mf {

// "cpu", "cuda", or "auto" (the GPU when there is one, else the CPU). Anything else, or "cuda"
// without a usable GPU, is an error led by `what` (the option or recipe key, e.g. "eval: --device").
Device pick_device(const std::string& want, const std::string& what);

// The calling thread's current CUDA device ordinal (0 without CUDA).
int current_cuda_device();

}  // namespace mf
