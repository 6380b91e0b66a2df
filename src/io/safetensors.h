// Safetensors files and Hugging Face model directories: a validating reader and an atomic writer.
//
// File layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
//   {"__metadata__": {str: str} (optional), NAME: {"dtype": D, "shape": [d0, ...], "data_offsets": [b, e]}, ...}
// (possibly padded with trailing spaces), then the data section. Offsets are relative to the data
// section; the tensors' [b, e) ranges must tile it exactly (no overlap, no hole), and
// e - b == numel * dtype_size.
//
// A model directory holds either model.safetensors, or model.safetensors.index.json
// ({"metadata": {...}, "weight_map": {NAME: SHARD_FILE}}) plus the shards it names. The index wins
// when both exist. Shard names must be plain file names resolving inside the directory.
//
// Invariants of the reader: the file is untrusted. Every length, count and product is range- and
// overflow-checked before use; any violation throws mf::Error naming the file, the tensor (where
// there is one) and the problem. Tensor data stays in the memory map (zero copy); StTensor::data
// points into it and lives as long as the SafetensorsFile / ModelWeights that owns the map.
// NOTE: data pointers carry no alignment guarantee (offsets are byte offsets); read through memcpy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "io/file.h"

namespace mf::io {

enum class StDType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

const char* st_dtype_name(StDType dtype);  // "F64", "BF16", ... as spelled in the format
size_t st_dtype_size(StDType dtype);       // bytes per element

struct StTensor {
    std::string name;
    StDType dtype;
    Shape shape;
    const uint8_t* data;  // into the file's memory map; nullptr only when nbytes == 0 and the file is empty
    size_t nbytes;
    std::string file;  // path of the file holding it, for messages
};

// Largest header accepted, as the format's reference implementation does.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// One .safetensors file, memory-mapped and validated on open. Movable; tensor pointers stay valid.
class SafetensorsFile {
 public:
    static SafetensorsFile open(const std::filesystem::path& path);
    SafetensorsFile(SafetensorsFile&&) noexcept = default;
    SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;
    SafetensorsFile(const SafetensorsFile&) = delete;
    SafetensorsFile& operator=(const SafetensorsFile&) = delete;

    // Tensors in data-offset order.
    const std::vector<StTensor>& tensors() const { return tensors_; }
    const StTensor* find(std::string_view name) const;
    const std::map<std::string, std::string>& metadata() const { return metadata_; }
    const std::filesystem::path& path() const { return map_.path(); }

 private:
    SafetensorsFile() = default;
    MappedFile map_;
    std::vector<StTensor> tensors_;
    std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
    std::map<std::string, std::string> metadata_;
};

// The weights of a Hugging Face model directory (single file or sharded), validated as a whole.
class ModelWeights {
 public:
    static ModelWeights open(const std::filesystem::path& dir);
    ModelWeights(ModelWeights&&) noexcept = default;
    ModelWeights& operator=(ModelWeights&&) noexcept = default;
    ModelWeights(const ModelWeights&) = delete;
    ModelWeights& operator=(const ModelWeights&) = delete;

    const StTensor* find(std::string_view name) const;
    std::vector<std::string> names() const;  // sorted
    const std::vector<SafetensorsFile>& files() const { return files_; }
    const std::filesystem::path& dir() const { return dir_; }

    // Copies tensor `name` into dst (numel(expected) floats) as fp32, converting from F32, BF16,
    // F16 or F64. Throws naming the tensor and its file when it is missing, its shape differs
    // from `expected`, or its dtype is not a float type.
    void read_f32(std::string_view name, const Shape& expected, float* dst) const;
    // Rows [first_row, first_row + rows) of dimension 0 only (an EP rank's experts of a stacked tensor).
    void read_f32_rows(std::string_view name, const Shape& expected, int64_t first_row, int64_t rows, float* dst) const;

 private:
    ModelWeights() = default;
    std::filesystem::path dir_;
    std::vector<SafetensorsFile> files_;
    std::map<std::string, const StTensor*, std::less<>> by_name_;
};

// A tensor to write; `data` holds numel(shape) elements already in `dtype`, packed. With `data`
// null, `fill` produces them instead, into a buffer of the tensor's byte size, when the writer gets
// to the tensor (tensors are produced one at a time, in the order given, so a model far larger
// than memory can be written from a source that yields one tensor at a time).
struct StWriteTensor {
    std::string name;
    StDType dtype;
    Shape shape;
    const void* data;
    std::function<void(void* out)> fill = {};
};

// Writes one safetensors file atomically (file.h), tensors in the given order. Names must be
// unique, non-empty, valid UTF-8 and not "__metadata__". The header is padded with spaces to a
// multiple of 8 bytes so the data section starts aligned. Returns the file's CRC-32C (io/crc32c.h),
// computed as it was written.
uint32_t write_safetensors(const std::filesystem::path& file, const std::vector<StWriteTensor>& tensors,
                           const std::map<std::string, std::string>& metadata);

// Writes the weights of a model directory (created if missing): model.safetensors when the total
// data size is at most max_shard_bytes, otherwise model-0000i-of-0000n.safetensors shards (tensors
// packed in order, a new shard started before one would exceed max_shard_bytes; a tensor larger
// than that gets a shard of its own) and model.safetensors.index.json
// ({"metadata": {"total_size": BYTES}, "weight_map": {NAME: FILE}}), written last.
// A conflicting layout already in `dir` (index vs single file) is removed first, so a reader never
// picks a stale one. Each file is atomic; for an all-or-nothing directory, write into an AtomicDir.
void write_model_weights(const std::filesystem::path& dir, const std::vector<StWriteTensor>& tensors,
                         size_t max_shard_bytes);

}  // namespace mf::io
