// The C API's shared machinery (include/moeforge/moeforge.h): calls that catch everything and turn
// it into a status and this thread's last error, and descriptors checked into Tensor views.
//
//   guarded(f)       runs f; MF_OK, or the status of what it threw, its message kept for
//                    mf_last_error(): ApiError (the API's own checks, typed), io::IoError (MF_ERR_IO),
//                    mf::Error (MF_ERR_CUDA when it comes from the CUDA/cuBLAS/cuDNN/NCCL check macros,
//                    MF_ERR_UNSUPPORTED for the "built without CUDA" refusal, else invalid argument),
//                    std::bad_alloc and anything else (MF_ERR_INTERNAL).
//   OpCall           one op's tensors: each descriptor checked (dtype, device, shape, contiguity, a
//                    data pointer for a non-empty tensor) and viewed as a Tensor; all on one device;
//                    run() enters the caller's execution context (ops::ExecScope) for CUDA tensors.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

#include "core/check.h"
#include "core/tensor.h"
#include "moeforge/moeforge.h"

namespace mf::capi {

// An error the API itself detects, with its status.
class ApiError : public Error {
 public:
    ApiError(mf_status status, const std::string& what) : Error(what), status_(status) {}
    mf_status status() const { return status_; }

 private:
    mf_status status_;
};

template <typename... Args>
[[noreturn]] void refuse(Args&&... args) {
    throw ApiError(MF_ERR_INVALID_ARGUMENT, detail::concat(std::forward<Args>(args)...));
}

mf_status guarded(const std::function<void()>& body);

// Copies `text` with its NUL into dst[0, bytes) when it fits (truncated otherwise); *needed = size + 1
// (needed and dst optional): the API's string results.
void copy_out(const std::string& text, char* dst, size_t bytes, size_t* needed);

// What a tensor's dtype must be.
enum class Want {
    act,    // the device's activation dtype: f32 on the CPU, bf16 on a GPU
    param,  // f32, or bf16 too on a GPU
    f32,
    i32,
    any,
};

class OpCall {
 public:
    OpCall(const char* op, const mf_context* ctx) : op_(op), ctx_(ctx) {}

    // The descriptor as a Tensor of dtype `want`; a NULL descriptor is refused unless `optional`
    // (then an undefined Tensor).
    Tensor tensor(const mf_tensor* t, const char* name, Want want, bool optional = false);
    // Checks of shapes, naming the op and the tensor: rows × cols elements with rows of cols (any
    // leading dimensions), or n elements (any shape).
    void rows_of(const Tensor& t, const char* name, int64_t rows, int64_t cols) const;
    void numel_of(const Tensor& t, const char* name, int64_t n) const;
    // A scalar argument's range.
    void positive(const char* name, int64_t value) const;

    Device device() const { return device_; }
    const char* op() const { return op_; }
    // Runs f in the caller's context (its device, stream and workspace) when the tensors are CUDA's.
    void run(const std::function<void()>& f) const;

 private:
    const char* op_;
    const mf_context* ctx_;
    bool have_device_ = false;
    Device device_ = Device::cpu;
    int32_t cuda_index_ = -1;
};

// Host copies of i32 tensors on the CPU, for the checks of index values that the CPU kernels read
// without range checks (on a GPU the values stay on the device, unchecked).
bool on_cpu(const Tensor& t);

}  // namespace mf::capi
