#include "core/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace mf {

namespace {
constexpr size_t kAlignment = 256;
size_t round_up(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }
}  // namespace

size_t dtype_size(DType dtype) {
    switch (dtype) {
        case DType::f32:
            return 4;
        case DType::bf16:
            return 2;
        case DType::i32:
            return 4;
        case DType::i64:
            return 8;
        case DType::f64:
            return 8;
    }
    return 0;
}

const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::f32:
            return "f32";
        case DType::bf16:
            return "bf16";
        case DType::i32:
            return "i32";
        case DType::i64:
            return "i64";
        case DType::f64:
            return "f64";
    }
    return "?";
}

const char* device_name(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

std::string shape_str(const Shape& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

int64_t shape_numel(const Shape& shape) {
    int64_t n = 1;
    for (int64_t d : shape) {
        MF_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
        MF_CHECK(d == 0 || n <= std::numeric_limits<int64_t>::max() / d, "shape ", shape_str(shape),
                 " overflows int64");
        n *= d;
    }
    return n;
}

Tensor Tensor::view(Shape shape) const {
    MF_CHECK(shape_numel(shape) == numel_, "cannot view ", shape_str(shape_), " as ", shape_str(shape));
    return Tensor(data_, dtype_, std::move(shape), device_);
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
    MF_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "bad row slice [", begin, ", ", end,
             ") of ", shape_str(shape_));
    Shape s = shape_;
    s[0] = end - begin;
    const size_t row_bytes = shape_[0] == 0 ? 0 : nbytes() / static_cast<size_t>(shape_[0]);
    return Tensor(static_cast<char*>(data_) + row_bytes * static_cast<size_t>(begin), dtype_, std::move(s), device_);
}

Buffer::Buffer(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
    if (nbytes == 0) return;
    if (device == Device::cpu) {
        data_ = std::aligned_alloc(kAlignment, round_up(nbytes));
        MF_CHECK(data_ != nullptr, "out of host memory allocating ", nbytes, " bytes");
    } else {
        data_ = device_alloc(nbytes);
    }
}

Buffer::~Buffer() { release(); }

void Buffer::release() {
    if (data_ == nullptr) return;
    if (device_ == Device::cpu)
        std::free(data_);
    else
        device_free(data_);
    data_ = nullptr;
}

Buffer::Buffer(Buffer&& other) noexcept : data_(other.data_), nbytes_(other.nbytes_), device_(other.device_) {
    other.data_ = nullptr;
    other.nbytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
    if (this != &other) {
        release();
        data_ = other.data_;
        nbytes_ = other.nbytes_;
        device_ = other.device_;
        other.data_ = nullptr;
        other.nbytes_ = 0;
    }
    return *this;
}

void Buffer::zero() {
    if (data_ == nullptr) return;
    if (device_ == Device::cpu)
        std::memset(data_, 0, nbytes_);
    else
        device_memset_zero(data_, nbytes_);
}

Tensor Buffer::as(DType dtype, Shape shape, size_t byte_offset) const {
    Tensor t(static_cast<char*>(data_) + byte_offset, dtype, std::move(shape), device_);
    MF_CHECK(byte_offset + t.nbytes() <= nbytes_, "view of ", t.nbytes(), " bytes at offset ", byte_offset,
             " exceeds buffer of ", nbytes_, " bytes");
    return t;
}

Tensor Arena::alloc(DType dtype, Shape shape) {
    const int64_t n = shape_numel(shape);
    const size_t bytes = round_up(static_cast<size_t>(n) * dtype_size(dtype));
    if (measuring_) {
        top_ += bytes;
        high_water_ = std::max(high_water_, top_);
        return Tensor(nullptr, dtype, std::move(shape), device_);
    }
    MF_CHECK(top_ + bytes <= capacity_, "activation arena exhausted: need ", top_ + bytes, " bytes, have ", capacity_);
    Tensor t(base_ + top_, dtype, std::move(shape), device_);
    top_ += bytes;
    if (top_ > high_water_) high_water_ = top_;
    return t;
}

Tensor Arena::zeros(DType dtype, Shape shape) {
    Tensor t = alloc(dtype, std::move(shape));
    if (measuring_) return t;
    if (t.device() == Device::cpu)
        std::memset(t.data(), 0, t.nbytes());
    else
        device_memset_zero(t.data(), t.nbytes());
    return t;
}

}  // namespace mf
