// Safetensors reader/writer and HF model-directory loader (see io/safetensors.h for the format).
//
// Reading order: map the file, check the 8-byte length against the cap and the file size, check
// that the header is UTF-8, parse it as strict JSON, validate every entry field by field, then sort
// the byte ranges and require them to tile the data section. Only after all checks pass are
// StTensor records (pointers into the map) handed out. All size arithmetic is done in uint64
// with explicit overflow checks.
#include "io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <set>
#include <system_error>
#include <utility>

#include "core/bf16.h"
#include "core/json.h"

namespace mf::io {

namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; so must the host be");

namespace {

constexpr const char* kSingleFileName = "model.safetensors";
constexpr const char* kIndexFileName = "model.safetensors.index.json";
constexpr const char* kMetadataKey = "__metadata__";

struct DTypeInfo {
    StDType dtype;
    const char* name;
    size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {StDType::F64, "F64", 8}, {StDType::F32, "F32", 4},   {StDType::F16, "F16", 2}, {StDType::BF16, "BF16", 2},
    {StDType::I64, "I64", 8}, {StDType::I32, "I32", 4},   {StDType::I16, "I16", 2}, {StDType::I8, "I8", 1},
    {StDType::U8, "U8", 1},   {StDType::BOOL, "BOOL", 1},
};

bool parse_dtype(std::string_view name, StDType* out) {
    for (const DTypeInfo& info : kDTypes) {
        if (name == info.name) {
            *out = info.dtype;
            return true;
        }
    }
    return false;
}

std::string known_dtypes() {
    std::string s;
    for (const DTypeInfo& info : kDTypes) s += std::string(s.empty() ? "" : ", ") + info.name;
    return s;
}

// Returns the offset of the first byte that breaks UTF-8 (overlong forms, surrogates and code
// points above U+10FFFF included), or npos when the whole text is valid.
size_t find_invalid_utf8(std::string_view text) {
    const auto* s = reinterpret_cast<const unsigned char*>(text.data());
    const size_t n = text.size();
    size_t i = 0;
    while (i < n) {
        const unsigned char c = s[i];
        if (c < 0x80) {
            ++i;
            continue;
        }
        size_t len;
        unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
        if (c >= 0xC2 && c <= 0xDF) {
            len = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            if (c == 0xE0) lo = 0xA0;  // no overlong 3-byte forms
            if (c == 0xED) hi = 0x9F;  // no UTF-16 surrogates
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            if (c == 0xF0) lo = 0x90;  // no overlong 4-byte forms
            if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
        } else {
            return i;
        }
        if (n - i < len) return i;
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k < len; ++k)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
        i += len;
    }
    return std::string_view::npos;
}

// A printable rendering of a possibly hostile name for error messages: non-printable bytes as \xNN,
// long names cut.
std::string printable(std::string_view s) {
    std::string out;
    for (size_t i = 0; i < s.size() && i < 200; ++i) {
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c >= 0x20 && c < 0x7F) {
            out += static_cast<char>(c);
        } else {
            static const char* hex = "0123456789abcdef";
            out += "\\x";
            out += hex[c >> 4];
            out += hex[c & 15];
        }
    }
    if (s.size() > 200) out += "...";
    return out;
}

uint64_t read_u64_le(const uint8_t* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

// Reads a JSON value that must be an integer in [0, INT64_MAX].
bool as_non_negative_int(const json::Value& v, uint64_t* out) {
    if (!v.is_int()) return false;
    const int64_t x = v.as_int();
    if (x < 0) return false;
    *out = static_cast<uint64_t>(x);
    return true;
}

struct RawEntry {
    std::string name;
    StDType dtype;
    Shape shape;
    uint64_t begin;
    uint64_t end;
};

// Validates one tensor entry of a header; `where` is "FILE: tensor 'NAME'".
RawEntry parse_entry(const std::string& name, const json::Value& v, const std::string& where, uint64_t data_size) {
    if (!v.is_object()) fail(where, ": entry is a JSON ", json::kind_name(v.kind()), ", expected an object");
    for (const auto& [key, unused] : v.as_object()) {
        if (key != "dtype" && key != "shape" && key != "data_offsets")
            fail(where, ": unexpected field '", printable(key), "' (allowed: dtype, shape, data_offsets)");
    }
    for (const char* field : {"dtype", "shape", "data_offsets"})
        if (v.find(field) == nullptr) fail(where, ": missing field '", field, "'");

    RawEntry e;
    e.name = name;
    const json::Value& dtype = *v.find("dtype");
    if (!dtype.is_string()) fail(where, ": dtype is a JSON ", json::kind_name(dtype.kind()), ", expected a string");
    if (!parse_dtype(dtype.as_string(), &e.dtype))
        fail(where, ": unknown dtype '", printable(dtype.as_string()), "' (known: ", known_dtypes(), ")");

    const json::Value& shape = *v.find("shape");
    if (!shape.is_array()) fail(where, ": shape is a JSON ", json::kind_name(shape.kind()), ", expected an array");
    uint64_t numel = 1;
    for (size_t i = 0; i < shape.as_array().size(); ++i) {
        const json::Value& d = shape.as_array()[i];
        uint64_t dim;
        if (!as_non_negative_int(d, &dim))
            fail(where, ": shape[", i, "] is ", d.dump(), ", expected a non-negative integer");
        if (dim != 0 && numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim)
            fail(where, ": element count of shape ", shape.dump(), " overflows");
        numel *= dim;
        e.shape.push_back(static_cast<int64_t>(dim));
    }
    const uint64_t elem = st_dtype_size(e.dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / elem)
        fail(where, ": byte size of shape ", shape.dump(), " overflows");
    const uint64_t nbytes = numel * elem;

    const json::Value& offsets = *v.find("data_offsets");
    if (!offsets.is_array() || offsets.as_array().size() != 2 ||
        !as_non_negative_int(offsets.as_array()[0], &e.begin) || !as_non_negative_int(offsets.as_array()[1], &e.end))
        fail(where, ": data_offsets is ", offsets.dump(), ", expected two non-negative integers [begin, end]");
    if (e.begin > e.end) fail(where, ": data_offsets begin ", e.begin, " > end ", e.end);
    if (e.end > data_size)
        fail(where, ": data_offsets end ", e.end, " is beyond the data section (", data_size, " bytes)");
    if (e.end - e.begin != nbytes)
        fail(where, ": byte size mismatch: data_offsets span ", e.end - e.begin, " bytes but ", st_dtype_name(e.dtype),
             " ", shape.dump(), " needs ", nbytes);
    return e;
}

// Checks that a shard name from an index is a plain file name and resolves it inside `dir` (or, for a
// Hugging Face hub cache snapshot, to a blob of the same cached repository).
fs::path resolve_in_dir(const fs::path& dir, const fs::path& dir_canonical, const std::string& name,
                        const std::string& where) {
    if (name.empty()) fail(where, ": empty file name");
    if (name.find('\0') != std::string::npos) fail(where, ": file name '", printable(name), "' contains a NUL byte");
    if (name.front() == '/' || fs::path(name).is_absolute())
        fail(where, ": '", printable(name), "' is an absolute path; expected a file name inside ", dir.string());
    size_t start = 0;
    while (start <= name.size()) {
        size_t slash = name.find_first_of("/\\", start);
        if (slash == std::string::npos) slash = name.size();
        if (name.compare(start, slash - start, "..") == 0)
            fail(where, ": '", printable(name), "' contains '..'; expected a file name inside ", dir.string());
        start = slash + 1;
    }
    if (name.find_first_of("/\\") != std::string::npos || name == ".")
        fail(where, ": '", printable(name), "' is not a plain file name");
    const fs::path full = dir / name;
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(full, ec)))
        fail(where, ": file '", printable(name), "' does not exist in ", dir.string());
    const fs::path canonical = fs::canonical(full, ec);
    if (ec) fail(where, ": cannot resolve ", full.string(), ": ", ec.message());
    // Inside the directory, or, for a Hugging Face hub cache snapshot (REPO/snapshots/REV/, whose files
    // are links to REPO/blobs/HASH), inside that repository's blobs/ directory.
    const bool in_dir = canonical.parent_path() == dir_canonical;
    const bool hub_blob = dir_canonical.parent_path().filename() == "snapshots" &&
                          canonical.parent_path() == dir_canonical.parent_path().parent_path() / "blobs";
    if (!in_dir && !hub_blob)
        fail(where, ": '", printable(name), "' resolves to ", canonical.string(), ", outside the model directory ",
             dir_canonical.string(), " (and not a blob of its Hugging Face hub cache repository)");
    if (!fs::is_regular_file(canonical, ec)) fail(where, ": ", full.string(), " is not a regular file");
    return full;
}

void convert_to_f32(const StTensor& t, size_t numel, float* dst, size_t first = 0) {
    const uint8_t* src = t.data + first * st_dtype_size(t.dtype);
    switch (t.dtype) {
        case StDType::F32:
            if (numel > 0) std::memcpy(dst, src, numel * sizeof(float));
            return;
        case StDType::BF16:
            for (size_t i = 0; i < numel; ++i) {
                uint16_t b;
                std::memcpy(&b, src + 2 * i, 2);
                dst[i] = bf16_to_f32(b);
            }
            return;
        case StDType::F16:
            for (size_t i = 0; i < numel; ++i) {
                uint16_t h;
                std::memcpy(&h, src + 2 * i, 2);
                dst[i] = f16_to_f32(h);
            }
            return;
        case StDType::F64:
            for (size_t i = 0; i < numel; ++i) {
                double d;
                std::memcpy(&d, src + 8 * i, 8);
                dst[i] = static_cast<float>(d);
            }
            return;
        default:
            fail("tensor '", printable(t.name), "' in ", t.file, " has dtype ", st_dtype_name(t.dtype),
                 ", which cannot be read as fp32 (expected F32, BF16, F16 or F64)");
    }
}

struct PlannedTensor {
    const StWriteTensor* tensor;
    uint64_t nbytes;
};

// Validates the tensors to write and computes their sizes.
std::vector<PlannedTensor> plan_tensors(const std::vector<StWriteTensor>& tensors, const std::string& target) {
    std::vector<PlannedTensor> plan;
    plan.reserve(tensors.size());
    std::set<std::string_view> seen;
    for (const StWriteTensor& t : tensors) {
        const std::string where = target + ": tensor '" + printable(t.name) + "'";
        MF_CHECK(!t.name.empty(), target, ": empty tensor name");
        MF_CHECK(t.name != kMetadataKey, where, ": the name is reserved for metadata");
        MF_CHECK(find_invalid_utf8(t.name) == std::string_view::npos, where, ": name is not valid UTF-8");
        MF_CHECK(seen.insert(t.name).second, where, ": written twice");
        uint64_t numel = 1;
        for (int64_t d : t.shape) {
            MF_CHECK(d >= 0, where, ": negative dimension in shape ", shape_str(t.shape));
            const auto dim = static_cast<uint64_t>(d);
            MF_CHECK(dim == 0 || numel <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim, where,
                     ": shape ", shape_str(t.shape), " overflows");
            numel *= dim;
        }
        const uint64_t elem = st_dtype_size(t.dtype);
        MF_CHECK(numel <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / elem, where,
                 ": byte size overflows");
        const uint64_t nbytes = numel * elem;
        MF_CHECK(nbytes == 0 || t.data != nullptr || t.fill, where, ": no data and no fill for ", nbytes, " bytes");
        plan.push_back({&t, nbytes});
    }
    return plan;
}

// Writes the tensors plan[first, last) as one safetensors file.
uint32_t write_planned(const fs::path& file, const std::vector<PlannedTensor>& plan, size_t first, size_t last,
                       const std::map<std::string, std::string>& metadata) {
    json::Value::Object header;
    header.reserve(last - first + 1);
    if (!metadata.empty()) {
        json::Value::Object meta;
        for (const auto& [key, value] : metadata) {
            MF_CHECK(
                find_invalid_utf8(key) == std::string_view::npos && find_invalid_utf8(value) == std::string_view::npos,
                file.string(), ": metadata entry '", printable(key), "' is not valid UTF-8");
            meta.emplace_back(key, json::Value(value));
        }
        header.emplace_back(kMetadataKey, json::Value(std::move(meta)));
    }
    uint64_t offset = 0;
    for (size_t i = first; i < last; ++i) {
        const StWriteTensor& t = *plan[i].tensor;
        json::Value::Array shape;
        for (int64_t d : t.shape) shape.emplace_back(d);
        MF_CHECK(plan[i].nbytes <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - offset, file.string(),
                 ": data section overflows");
        const uint64_t end = offset + plan[i].nbytes;
        json::Value::Object entry;
        entry.emplace_back("dtype", json::Value(st_dtype_name(t.dtype)));
        entry.emplace_back("shape", json::Value(std::move(shape)));
        entry.emplace_back("data_offsets", json::Value(json::Value::Array{json::Value(static_cast<int64_t>(offset)),
                                                                          json::Value(static_cast<int64_t>(end))}));
        header.emplace_back(t.name, json::Value(std::move(entry)));
        offset = end;
    }
    std::string text = json::Value(std::move(header)).dump();
    // Pad with spaces (JSON whitespace) so that the data section starts at a multiple of 8.
    text.append((8 - text.size() % 8) % 8, ' ');
    MF_CHECK(text.size() <= kMaxSafetensorsHeaderBytes, file.string(), ": header of ", text.size(),
             " bytes exceeds the format's cap of ", kMaxSafetensorsHeaderBytes);

    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
    AtomicFileWriter writer(file);
    writer.write(length, sizeof length);
    writer.write(text);
    std::vector<uint8_t> produced;  // a filled tensor's bytes (reused)
    for (size_t i = first; i < last; ++i) {
        const StWriteTensor& t = *plan[i].tensor;
        if (plan[i].nbytes == 0) continue;
        if (t.data != nullptr) {
            writer.write(t.data, plan[i].nbytes);
            continue;
        }
        MF_CHECK(plan[i].nbytes <= std::numeric_limits<size_t>::max(), file.string(), ": tensor '", printable(t.name),
                 "' is too large for memory");
        produced.resize(static_cast<size_t>(plan[i].nbytes));
        t.fill(produced.data());
        writer.write(produced.data(), plan[i].nbytes);
    }
    writer.commit();
    return writer.crc32c();
}

void remove_if_present(const fs::path& path) {
    std::error_code ec;
    fs::remove(path, ec);
    if (ec) fail("cannot remove stale ", path.string(), ": ", ec.message());
}

std::string shard_file_name(size_t idx, size_t count) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", idx, count);
    return buf;
}

}  // namespace

const char* st_dtype_name(StDType dtype) {
    for (const DTypeInfo& info : kDTypes)
        if (info.dtype == dtype) return info.name;
    return "?";
}

size_t st_dtype_size(StDType dtype) {
    for (const DTypeInfo& info : kDTypes)
        if (info.dtype == dtype) return info.size;
    MF_FAIL("unknown StDType ", static_cast<int>(dtype));
}

// --- SafetensorsFile ----------------------------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
    SafetensorsFile f;
    f.map_ = MappedFile(path);
    const std::string file = path.string();
    const uint8_t* bytes = f.map_.data();
    const uint64_t size = f.map_.size();

    if (size < 8) fail(file, ": file is ", size, " bytes, shorter than the 8-byte header length");
    const uint64_t header_len = read_u64_le(bytes);
    if (header_len == 0) fail(file, ": header length is 0");
    if (header_len > kMaxSafetensorsHeaderBytes)
        fail(file, ": header length ", header_len, " exceeds the cap of ", kMaxSafetensorsHeaderBytes, " bytes");
    if (header_len > size - 8)
        fail(file, ": header length ", header_len, " runs past the end of the file (", size, " bytes)");
    const std::string_view header(reinterpret_cast<const char*>(bytes + 8), header_len);
    if (const size_t bad = find_invalid_utf8(header); bad != std::string_view::npos) {
        // Show the bytes around the bad one, escaped, so the reader can find the entry.
        fail(file, ": header is not valid UTF-8 at header byte ", bad, " (near \"",
             printable(header.substr(bad >= 40 ? bad - 40 : 0, std::min<size_t>(bad, 40) + 8)), "\")");
    }
    const json::Value root = json::parse(header, file + " (safetensors header)");
    if (!root.is_object()) fail(file, ": header is a JSON ", json::kind_name(root.kind()), ", expected an object");

    const uint64_t data_start = 8 + header_len;
    const uint64_t data_size = size - data_start;
    std::vector<RawEntry> entries;
    entries.reserve(root.as_object().size());
    for (const auto& [name, value] : root.as_object()) {
        if (name == kMetadataKey) {
            if (!value.is_object())
                fail(file, ": __metadata__ is a JSON ", json::kind_name(value.kind()),
                     ", expected an object of strings");
            for (const auto& [key, v] : value.as_object()) {
                if (!v.is_string())
                    fail(file, ": __metadata__ value of '", printable(key), "' is a JSON ", json::kind_name(v.kind()),
                         ", expected a string");
                f.metadata_.emplace(key, v.as_string());
            }
            continue;
        }
        if (name.empty()) fail(file, ": a tensor has an empty name");
        entries.push_back(parse_entry(name, value, file + ": tensor '" + printable(name) + "'", data_size));
    }

    // The ranges must tile [0, data_size): sorted by (begin, end), each begins where the last ended.
    std::sort(entries.begin(), entries.end(), [](const RawEntry& a, const RawEntry& b) {
        return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t cursor = 0;
    const RawEntry* previous = nullptr;
    for (const RawEntry& e : entries) {
        if (e.begin < cursor)
            fail(file, ": tensor '", printable(e.name), "' bytes [", e.begin, ", ", e.end, ") overlap tensor '",
                 printable(previous->name), "' bytes [", previous->begin, ", ", previous->end, ")");
        if (e.begin > cursor)
            fail(file, ": hole in the data section: bytes [", cursor, ", ", e.begin,
                 ") belong to no tensor (before tensor '", printable(e.name), "')");
        cursor = e.end;
        previous = &e;
    }
    if (cursor != data_size)
        fail(file, ": hole in the data section: bytes [", cursor, ", ", data_size, ") at its end belong to no tensor");

    f.tensors_.reserve(entries.size());
    for (RawEntry& e : entries) {
        StTensor t;
        t.name = std::move(e.name);
        t.dtype = e.dtype;
        t.shape = std::move(e.shape);
        t.nbytes = static_cast<size_t>(e.end - e.begin);
        t.data = bytes + data_start + e.begin;
        t.file = file;
        f.index_.emplace(t.name, f.tensors_.size());
        f.tensors_.push_back(std::move(t));
    }
    return f;
}

const StTensor* SafetensorsFile::find(std::string_view name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
}

// --- ModelWeights -------------------------------------------------------------------------------

ModelWeights ModelWeights::open(const fs::path& dir) {
    ModelWeights w;
    w.dir_ = dir;
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) fail("model directory ", dir.string(), " does not exist or is not a directory");
    const fs::path dir_canonical = fs::canonical(dir, ec);
    if (ec) fail("cannot resolve model directory ", dir.string(), ": ", ec.message());
    const fs::path index_path = dir / kIndexFileName;
    const fs::path single_path = dir / kSingleFileName;

    if (fs::exists(fs::symlink_status(index_path, ec))) {
        const std::string index_name = index_path.string();
        const std::string text = read_text_file(index_path, kMaxSafetensorsHeaderBytes);
        if (const size_t bad = find_invalid_utf8(text); bad != std::string::npos)
            fail(index_name, ": not valid UTF-8 at byte ", bad);
        const json::Value root = json::parse(text, index_name);
        if (!root.is_object())
            fail(index_name, ": top level is a JSON ", json::kind_name(root.kind()), ", expected an object");
        if (const json::Value* meta = root.find("metadata"); meta != nullptr && !meta->is_object() && !meta->is_null())
            fail(index_name, ": metadata is a JSON ", json::kind_name(meta->kind()), ", expected an object");
        const json::Value* weight_map = root.find("weight_map");
        if (weight_map == nullptr) fail(index_name, ": missing field 'weight_map'");
        if (!weight_map->is_object())
            fail(index_name, ": weight_map is a JSON ", json::kind_name(weight_map->kind()), ", expected an object");
        if (weight_map->as_object().empty()) fail(index_name, ": weight_map is empty");

        std::map<std::string, std::string, std::less<>> shard_of;        // tensor -> shard file name
        std::map<std::string, std::vector<std::string>> names_in_shard;  // shard -> tensors listed
        for (const auto& [name, value] : weight_map->as_object()) {
            if (!value.is_string())
                fail(index_name, ": weight_map entry for tensor '", printable(name), "' is a JSON ",
                     json::kind_name(value.kind()), ", expected a shard file name");
            shard_of.emplace(name, value.as_string());
            names_in_shard[value.as_string()].push_back(name);
        }
        w.files_.reserve(names_in_shard.size());
        for (const auto& [shard, listed] : names_in_shard) {
            const fs::path shard_path =
                resolve_in_dir(dir, dir_canonical, shard,
                               index_name + ": weight_map shard of tensor '" + printable(listed.front()) + "'");
            w.files_.push_back(SafetensorsFile::open(shard_path));
            const SafetensorsFile& f = w.files_.back();
            for (const std::string& name : listed)
                if (f.find(name) == nullptr)
                    fail(index_name, ": tensor '", printable(name), "' is listed in shard ", shard,
                         " but is missing from ", shard_path.string());
            for (const StTensor& t : f.tensors()) {
                const auto it = shard_of.find(t.name);
                if (it == shard_of.end())
                    fail(shard_path.string(), ": tensor '", printable(t.name), "' is not listed in the index ",
                         index_name);
                if (it->second != shard)
                    fail(shard_path.string(), ": tensor '", printable(t.name), "' is also in shard ", it->second,
                         ", which the index ", index_name, " names for it (a tensor name in two shards)");
            }
        }
    } else if (fs::exists(fs::symlink_status(single_path, ec))) {
        const fs::path path = resolve_in_dir(dir, dir_canonical, kSingleFileName, dir.string());
        w.files_.push_back(SafetensorsFile::open(path));
    } else {
        fail("no safetensors weights in ", dir.string(), ": looked for ", kIndexFileName, " (sharded) and ",
             kSingleFileName);
    }
    // Pointers into files_ are stable from here on: the vector is not touched again.
    for (const SafetensorsFile& f : w.files_) {
        for (const StTensor& t : f.tensors()) {
            const auto [it, inserted] = w.by_name_.emplace(t.name, &t);
            if (!inserted) fail("tensor '", printable(t.name), "' is in both ", it->second->file, " and ", t.file);
        }
    }
    return w;
}

const StTensor* ModelWeights::find(std::string_view name) const {
    const auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
}

std::vector<std::string> ModelWeights::names() const {
    std::vector<std::string> out;
    out.reserve(by_name_.size());
    for (const auto& [name, unused] : by_name_) out.push_back(name);
    return out;
}

void ModelWeights::read_f32(std::string_view name, const Shape& expected, float* dst) const {
    const StTensor* t = find(name);
    if (t == nullptr) fail("tensor '", printable(name), "' not found in the weights of ", dir_.string());
    if (t->shape != expected)
        fail("tensor '", printable(name), "' in ", t->file, " has shape ", shape_str(t->shape), ", expected ",
             shape_str(expected));
    // The shape was validated on open, so numel * dtype size == nbytes without overflow.
    const size_t numel = t->nbytes / st_dtype_size(t->dtype);
    MF_CHECK(numel == 0 || dst != nullptr, "read_f32 of '", printable(name), "' into a null buffer");
    convert_to_f32(*t, numel, dst);
}

void ModelWeights::read_f32_rows(std::string_view name, const Shape& expected, int64_t first_row, int64_t rows,
                                 float* dst) const {
    const StTensor* t = find(name);
    if (t == nullptr) fail("tensor '", printable(name), "' not found in the weights of ", dir_.string());
    if (t->shape != expected || expected.empty())
        fail("tensor '", printable(name), "' in ", t->file, " has shape ", shape_str(t->shape), ", expected ",
             shape_str(expected));
    if (first_row < 0 || rows < 0 || first_row + rows > expected[0])
        fail("tensor '", printable(name), "': rows [", first_row, ", ", first_row + rows, ") outside its ", expected[0],
             " rows");
    const size_t row = static_cast<size_t>(shape_numel(expected) / std::max<int64_t>(expected[0], 1));
    MF_CHECK(rows == 0 || dst != nullptr, "read_f32_rows of '", printable(name), "' into a null buffer");
    convert_to_f32(*t, static_cast<size_t>(rows) * row, dst, static_cast<size_t>(first_row) * row);
}

// --- writing ------------------------------------------------------------------------------------

uint32_t write_safetensors(const fs::path& file, const std::vector<StWriteTensor>& tensors,
                           const std::map<std::string, std::string>& metadata) {
    const std::vector<PlannedTensor> plan = plan_tensors(tensors, file.string());
    return write_planned(file, plan, 0, plan.size(), metadata);
}

void write_model_weights(const fs::path& dir, const std::vector<StWriteTensor>& tensors, size_t max_shard_bytes) {
    MF_CHECK(max_shard_bytes > 0, "max_shard_bytes must be positive");
    const std::vector<PlannedTensor> plan = plan_tensors(tensors, dir.string());
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) fail("cannot create ", dir.string(), ": ", ec.message());

    uint64_t total = 0;
    for (const PlannedTensor& p : plan) {
        MF_CHECK(p.nbytes <= std::numeric_limits<uint64_t>::max() - total, dir.string(), ": total size overflows");
        total += p.nbytes;
    }
    if (total <= max_shard_bytes) {
        remove_if_present(dir / kIndexFileName);
        write_planned(dir / kSingleFileName, plan, 0, plan.size(), {});
        return;
    }

    // Greedy packing in the given order: [shard_begin[i], shard_begin[i + 1]) is shard i.
    std::vector<size_t> shard_begin{0};
    uint64_t in_shard = 0;
    for (size_t i = 0; i < plan.size(); ++i) {
        if (i > shard_begin.back() && plan[i].nbytes > max_shard_bytes - in_shard) {
            shard_begin.push_back(i);
            in_shard = 0;
        }
        in_shard += std::min<uint64_t>(plan[i].nbytes, max_shard_bytes);
    }
    const size_t num_shards = shard_begin.size();
    shard_begin.push_back(plan.size());
    MF_CHECK(num_shards <= 99999, dir.string(), ": ", num_shards, " shards exceed the 5-digit naming scheme");

    remove_if_present(dir / kSingleFileName);
    std::vector<std::pair<std::string, std::string>> weight_map;  // (tensor, file)
    weight_map.reserve(plan.size());
    for (size_t s = 0; s < num_shards; ++s) {
        const std::string name = shard_file_name(s + 1, num_shards);
        write_planned(dir / name, plan, shard_begin[s], shard_begin[s + 1], {});
        for (size_t i = shard_begin[s]; i < shard_begin[s + 1]; ++i)
            weight_map.emplace_back(plan[i].tensor->name, name);
    }
    std::sort(weight_map.begin(), weight_map.end());
    json::Value::Object map_object;
    map_object.reserve(weight_map.size());
    for (auto& [tensor, file] : weight_map) map_object.emplace_back(std::move(tensor), json::Value(std::move(file)));
    MF_CHECK(total <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), dir.string(),
             ": total size overflows");
    json::Value::Object meta;
    meta.emplace_back("total_size", json::Value(static_cast<int64_t>(total)));
    json::Value::Object index;
    index.emplace_back("metadata", json::Value(std::move(meta)));
    index.emplace_back("weight_map", json::Value(std::move(map_object)));
    atomic_write_file(dir / kIndexFileName, json::Value(std::move(index)).dump(2) + "\n");
}

}  // namespace mf::io
