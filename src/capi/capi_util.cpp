// The C API's errors and descriptor checks (capi_util.h).
#include "capi/capi_util.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <new>
#include <string_view>

#include "io/file.h"
#include "ops/ops.h"

namespace mf::capi {

namespace {

thread_local std::string g_last_error;

static_assert(MF_F32 == static_cast<int>(DType::f32) && MF_BF16 == static_cast<int>(DType::bf16) &&
                  MF_I32 == static_cast<int>(DType::i32) && MF_I64 == static_cast<int>(DType::i64) &&
                  MF_F64 == static_cast<int>(DType::f64),
              "mf_dtype follows DType's order");

// The engine's own check macros prefix a failed device call's message with its library.
mf_status status_of(const Error& e) {
    const std::string_view what = e.what();
    for (const char* device_error : {"CUDA error", "cuBLAS error", "cuDNN", "NCCL error"})
        if (what.find(device_error) != std::string_view::npos) return MF_ERR_CUDA;
    if (what.find("built without CUDA") != std::string_view::npos) return MF_ERR_UNSUPPORTED;
    return MF_ERR_INVALID_ARGUMENT;
}

mf_status failed(mf_status status, const char* what) {
    g_last_error = what;
    return status;
}

// "cpu" or "cuda:N".
std::string placement(Device device, int32_t index) {
    return device == Device::cuda ? detail::concat("cuda:", index) : std::string("cpu");
}

const char* dtype_label(int32_t dtype) {
    switch (dtype) {
        case MF_F32:
            return "f32";
        case MF_BF16:
            return "bf16";
        case MF_I32:
            return "i32";
        case MF_I64:
            return "i64";
        case MF_F64:
            return "f64";
        default:
            return "an unknown dtype";
    }
}

}  // namespace

void copy_out(const std::string& text, char* dst, size_t bytes, size_t* needed) {
    if (needed != nullptr) *needed = text.size() + 1;
    if (dst == nullptr || bytes == 0) return;
    const size_t n = std::min(text.size(), bytes - 1);
    std::memcpy(dst, text.data(), n);
    dst[n] = '\0';
}

mf_status guarded(const std::function<void()>& body) {
    try {
        body();
        g_last_error.clear();
        return MF_OK;
    } catch (const ApiError& e) {
        return failed(e.status(), e.what());
    } catch (const io::IoError& e) {
        return failed(MF_ERR_IO, e.what());
    } catch (const Error& e) {
        return failed(status_of(e), e.what());
    } catch (const std::filesystem::filesystem_error& e) {
        return failed(MF_ERR_IO, e.what());
    } catch (const std::bad_alloc&) {
        return failed(MF_ERR_INTERNAL, "out of host memory");
    } catch (const std::exception& e) {
        return failed(MF_ERR_INTERNAL, e.what());
    } catch (...) {
        return failed(MF_ERR_INTERNAL, "an unknown exception");
    }
}

Tensor OpCall::tensor(const mf_tensor* t, const char* name, Want want, bool optional) {
    if (t == nullptr) {
        if (optional) return Tensor();
        refuse(op_, ": ", name, " is required (got NULL)");
    }
    if (t->device_type != MF_CPU && t->device_type != MF_CUDA)
        refuse(op_, ": ", name, " has device type ", t->device_type, " (expected MF_CPU or MF_CUDA)");
    const Device device = t->device_type == MF_CUDA ? Device::cuda : Device::cpu;
    if (!have_device_) {
        have_device_ = true;
        device_ = device;
        cuda_index_ = t->device_index;
    } else if (device != device_ || (device == Device::cuda && t->device_index != cuda_index_)) {
        refuse(op_, ": ", name, " is on ", placement(device, t->device_index), " but the tensors before it on ",
               placement(device_, cuda_index_));
    }
    if (t->dtype < MF_F32 || t->dtype > MF_F64) refuse(op_, ": ", name, " has dtype ", t->dtype, " (unknown)");
    const DType dtype = static_cast<DType>(t->dtype);  // mf_dtype follows DType's order
    const bool gpu = device == Device::cuda;
    bool ok = true;
    const char* expected = "";
    switch (want) {
        case Want::act:
            ok = dtype == (gpu ? DType::bf16 : DType::f32);
            expected = gpu ? "bf16 (activations on a GPU)" : "f32 (activations on the CPU)";
            break;
        case Want::param:
            ok = dtype == DType::f32 || (gpu && dtype == DType::bf16);
            expected = gpu ? "f32 or bf16" : "f32 (on the CPU)";
            break;
        case Want::f32:
            ok = dtype == DType::f32;
            expected = "f32";
            break;
        case Want::i32:
            ok = dtype == DType::i32;
            expected = "i32";
            break;
        case Want::any:
            break;
    }
    if (!ok) refuse(op_, ": ", name, " is ", dtype_label(t->dtype), ", expected ", expected);
    if (t->ndim < 0 || t->ndim > MF_MAX_DIMS)
        refuse(op_, ": ", name, " has ndim ", t->ndim, " (expected 0 .. ", MF_MAX_DIMS, ")");
    Shape shape(t->shape, t->shape + t->ndim);
    for (int64_t d : shape)
        if (d < 0) refuse(op_, ": ", name, " has a negative dimension: ", shape_str(shape));
    int64_t numel = 0;
    try {
        numel = shape_numel(shape);
    } catch (const Error&) {
        refuse(op_, ": ", name, " ", shape_str(shape), " has more elements than int64 holds");
    }
    if (t->strides != nullptr && numel > 0) {  // (an empty tensor has no layout to check)
        int64_t expect = 1;
        for (int i = t->ndim - 1; i >= 0; --i) {
            if (shape[static_cast<size_t>(i)] != 1 && t->strides[i] != expect)
                refuse(op_, ": ", name, " ", shape_str(shape), " is not contiguous (stride ", t->strides[i],
                       " of dimension ", i, ", expected ", expect, "); pass a contiguous copy");
            expect *= shape[static_cast<size_t>(i)];
        }
    }
    if (numel > 0 && t->data == nullptr) refuse(op_, ": ", name, " ", shape_str(shape), " has no data (NULL)");
    return Tensor(t->data, dtype, std::move(shape), device);
}

void OpCall::rows_of(const Tensor& t, const char* name, int64_t rows, int64_t cols) const {
    const bool ok = t.ndim() >= 1 && t.dim(-1) == cols && t.numel() == rows * cols;
    if (!ok) refuse(op_, ": ", name, " is ", shape_str(t.shape()), ", expected [", rows, ", ", cols, "]");
}

void OpCall::numel_of(const Tensor& t, const char* name, int64_t n) const {
    if (t.numel() != n)
        refuse(op_, ": ", name, " ", shape_str(t.shape()), " holds ", t.numel(), " elements, expected ", n);
}

void OpCall::positive(const char* name, int64_t value) const {
    if (value < 1) refuse(op_, ": ", name, " = ", value, " must be >= 1");
}

void OpCall::run(const std::function<void()>& f) const {
    if (device_ != Device::cuda) return f();
    ops::ExecContext context;
    context.device = ctx_ != nullptr && ctx_->device >= 0 ? ctx_->device : cuda_index_;
    if (ctx_ != nullptr && ctx_->device >= 0 && ctx_->device != cuda_index_)
        refuse(op_, ": the context's device ", ctx_->device, " is not the tensors' (cuda:", cuda_index_, ")");
    if (ctx_ != nullptr) {
        context.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(ctx_->stream));
        context.workspace = ctx_->workspace;
        context.workspace_bytes = ctx_->workspace_bytes;
    }
    const ops::ExecScope scope(context);
    f();
}

bool on_cpu(const Tensor& t) { return t.device() == Device::cpu; }

}  // namespace mf::capi

extern "C" {

int mf_api_version(void) { return MF_API_VERSION; }

const char* mf_last_error(void) { return mf::capi::g_last_error.c_str(); }

const char* mf_status_name(mf_status status) {
    switch (status) {
        case MF_OK:
            return "MF_OK";
        case MF_ERR_INVALID_ARGUMENT:
            return "MF_ERR_INVALID_ARGUMENT";
        case MF_ERR_UNSUPPORTED:
            return "MF_ERR_UNSUPPORTED";
        case MF_ERR_CUDA:
            return "MF_ERR_CUDA";
        case MF_ERR_IO:
            return "MF_ERR_IO";
        case MF_ERR_INTERNAL:
            return "MF_ERR_INTERNAL";
    }
    return "an unknown mf_status";
}

int mf_has_cuda(void) { return mf::cuda_available() ? 1 : 0; }

int mf_built_with_cuda(void) {
#ifdef MOEFORGE_WITH_CUDA
    return 1;
#else
    return 0;
#endif
}

mf_status mf_synchronize(const mf_context* ctx, int32_t device_type) {
    return mf::capi::guarded([&] {
        if (device_type != MF_CUDA) return;
        mf::ops::ExecContext context;
        if (ctx != nullptr) {
            context.device = ctx->device;
            context.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(ctx->stream));
        }
        const mf::ops::ExecScope scope(context);
        mf::ops::synchronize(mf::Device::cuda);
    });
}

}  // extern "C"
