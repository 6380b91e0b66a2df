// Tensor: a non-owning, contiguous, row-major view (pointer + dtype + device + shape).
// Memory is owned by a Buffer (one allocation) or handed out by an Arena (bump allocator over a
// Buffer, reset once per step). Views never free anything, so slicing a flat parameter buffer
// into per-tensor views is free and the whole model lives in a handful of allocations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/check.h"

namespace mf {

enum class DType : uint8_t { f32, bf16, i32, i64, f64 };
enum class Device : uint8_t { cpu, cuda };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* device_name(Device device);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);
// Product of the dimensions; throws on a negative dimension or int64 overflow.
int64_t shape_numel(const Shape& shape);

class Tensor {
 public:
    Tensor() = default;
    Tensor(void* data, DType dtype, Shape shape, Device device = Device::cpu)
        : data_(data), dtype_(dtype), device_(device), shape_(std::move(shape)), numel_(shape_numel(shape_)) {}

    void* data() const { return data_; }
    DType dtype() const { return dtype_; }
    Device device() const { return device_; }
    const Shape& shape() const { return shape_; }
    int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
    int ndim() const { return static_cast<int>(shape_.size()); }
    int64_t numel() const { return numel_; }
    size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
    bool defined() const { return data_ != nullptr || numel_ == 0; }

    template <typename T>
    T* ptr() const;

    // Same memory, new shape with the same element count.
    Tensor view(Shape shape) const;
    // Rows [begin, end) of the leading dimension.
    Tensor slice_rows(int64_t begin, int64_t end) const;

 private:
    void* data_ = nullptr;
    DType dtype_ = DType::f32;
    Device device_ = Device::cpu;
    Shape shape_;
    int64_t numel_ = 0;
};

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
    return DType::f32;
}
template <>
constexpr DType dtype_of<int32_t>() {
    return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
    return DType::i64;
}
template <>
constexpr DType dtype_of<double>() {
    return DType::f64;
}

template <typename T>
T* Tensor::ptr() const {
    MF_CHECK(dtype_ == dtype_of<T>(), "tensor has dtype ", dtype_name(dtype_), ", accessed as ",
             dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
}

// Owning allocation on one device, 256-byte aligned. Movable, not copyable.
class Buffer {
 public:
    Buffer() = default;
    Buffer(size_t nbytes, Device device);
    ~Buffer();
    Buffer(Buffer&& other) noexcept;
    Buffer& operator=(Buffer&& other) noexcept;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;

    void* data() const { return data_; }
    size_t nbytes() const { return nbytes_; }
    Device device() const { return device_; }
    void zero();
    Tensor as(DType dtype, Shape shape, size_t byte_offset = 0) const;

 private:
    void release();
    void* data_ = nullptr;
    size_t nbytes_ = 0;
    Device device_ = Device::cpu;
};

// Bump allocator for activations: alloc() hands out aligned views, reset() frees all at once.
// The high-water mark is the activation memory the step really needed.
class Arena {
 public:
    Arena() = default;
    Arena(size_t capacity, Device device)
        : buffer_(capacity, device), base_(static_cast<char*>(buffer_.data())), capacity_(capacity), device_(device) {}
    // An arena over memory someone else owns (a binding's workspace), which must outlive its views.
    static Arena borrowing(void* data, size_t capacity, Device device) {
        Arena a;
        a.base_ = static_cast<char*>(data);
        a.capacity_ = capacity;
        a.device_ = device;
        return a;
    }
    // An arena that hands out null views and only counts: running the real allocation sequence
    // against it gives the exact capacity a step needs (the activation memory plan).
    static Arena measuring(Device device) {
        Arena a;
        a.measuring_ = true;
        a.device_ = device;
        return a;
    }
    Tensor alloc(DType dtype, Shape shape);
    // Same as alloc, filled with zeros.
    Tensor zeros(DType dtype, Shape shape);
    void reset() { top_ = 0; }
    size_t used() const { return top_; }
    size_t high_water() const { return high_water_; }
    size_t capacity() const { return capacity_; }

 private:
    Buffer buffer_;  // empty when borrowing
    char* base_ = nullptr;
    size_t capacity_ = 0;
    Device device_ = Device::cpu;
    bool measuring_ = false;
    size_t top_ = 0;
    size_t high_water_ = 0;
};

// Device memory hooks, implemented in core/device_cuda.cu when CUDA is built, else they throw.
void* device_alloc(size_t nbytes);
void device_free(void* ptr);
void device_memset_zero(void* ptr, size_t nbytes);
bool cuda_available();
// Bytes of device memory in use on the current GPU (total − free), 0 without CUDA.
size_t device_memory_used();
// Waits on the host until the CUDA stream (a cudaStream_t; null: the legacy default stream) has
// finished its work. With a limit set (set_device_wait_limit, seconds > 0; a multi-process run sets
// dist.timeout_s) it polls instead of blocking, and past the limit prints that the device work is
// stuck (a collective waiting for a rank that stopped answering), naming `rank`, and ends the
// process with status 1: unwinding would block in cudaFree behind the stuck kernel. Without CUDA:
// nothing to wait for.
void wait_for_stream(void* stream);
void set_device_wait_limit(double seconds, int rank);

}  // namespace mf
