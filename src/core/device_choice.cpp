#include "core/device_choice.h"

#include "core/check.h"

namespace mf {

Device pick_device(const std::string& want, const std::string& what) {
    if (want != "auto" && want != "cpu" && want != "cuda")
        fail(what, ": expected auto, cpu or cuda, got \"", want, "\"");
    if (want == "cpu") return Device::cpu;
    if (cuda_available()) return Device::cuda;
    if (want == "cuda") fail(what, " cuda, but no CUDA device is available (or this build has no CUDA)");
    return Device::cpu;
}

}  // namespace mf
