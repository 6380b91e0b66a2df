// libFuzzer target: the safetensors reader and model-directory loader (io/safetensors.h),
// through real files in a scratch model directory.
//
// Byte 0 bit 0 picks the mode; the rest of the input is
//   0: DIR/model.safetensors (single-file model),
//   1: DIR/model.safetensors.index.json, beside two fixed valid shards (s1: a, b F32 [2];
//      s2: c BF16 [2]), a subdirectory, a non-safetensors file and a symlink to a valid shard
//      outside DIR, so shard names can try to escape.
// Any input is accepted or refused with mf::Error. For an accepted single file the tensors must
// tile the data section exactly and point at the bytes the input holds there (proves every read is
// in bounds: the memory map itself is invisible to AddressSanitizer). For an accepted index every
// file opened must lie inside DIR. Float tensors are also converted with read_f32.
#include <cstring>
#include <vector>

#include "core/tensor.h"
#include "fuzz_util.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;

namespace {

std::string le64(uint64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xFF);
    return s;
}

std::string st_bytes(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

// The scratch model directory with the fixed files of mode 1; created once per process.
const fs::path& model_dir() {
    static const fs::path dir = [] {
        const fs::path root = mf::fuzz::ScratchDir::get();
        const fs::path d = root / "model";
        fs::create_directories(d / "sub");
        const std::string f32x2(8, '\x01'), bf16x2(4, '\x02');
        mf::fuzz::write_bytes(
            d / "s1.safetensors",
            st_bytes(
                R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                f32x2 + f32x2));
        mf::fuzz::write_bytes(d / "s2.safetensors",
                              st_bytes(R"({"c":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})", bf16x2));
        mf::fuzz::write_bytes(d / "sub" / "s3.safetensors",
                              st_bytes(R"({"d":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2));
        mf::fuzz::write_bytes(d / "notes.txt", "not a safetensors file");
        mf::fuzz::write_bytes(root / "outside.safetensors",
                              st_bytes(R"({"e":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f32x2));
        fs::create_symlink("../outside.safetensors", d / "link.safetensors");
        return d;
    }();
    return dir;
}

bool is_float(mf::io::StDType t) {
    using mf::io::StDType;
    return t == StDType::F32 || t == StDType::BF16 || t == StDType::F16 || t == StDType::F64;
}

// Reads every tensor of `w` (converting float ones) so that an out-of-bounds pointer shows.
void touch_all(const mf::io::ModelWeights& w) {
    for (const std::string& name : w.names()) {
        const mf::io::StTensor* t = w.find(name);
        MF_FUZZ_REQUIRE(t != nullptr, "names() lists a tensor find() does not know: " + name);
        const int64_t numel = mf::shape_numel(t->shape);
        MF_FUZZ_REQUIRE(static_cast<size_t>(numel) * mf::io::st_dtype_size(t->dtype) == t->nbytes,
                        "nbytes disagrees with shape and dtype for " + name);
        if (is_float(t->dtype)) {
            std::vector<float> out(static_cast<size_t>(numel));
            w.read_f32(name, t->shape, out.data());
        }
    }
}

void check_single(const mf::io::ModelWeights& w, std::string_view file) {
    MF_FUZZ_REQUIRE(w.files().size() == 1, "a single-file model opened several files");
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(file[static_cast<size_t>(i)]);
    const size_t data_begin = 8 + static_cast<size_t>(header_len);
    size_t offset = 0;
    for (const mf::io::StTensor& t : w.files()[0].tensors()) {
        MF_FUZZ_REQUIRE(data_begin + offset + t.nbytes <= file.size(), "tensor " + t.name + " runs past the file");
        if (t.nbytes > 0)
            MF_FUZZ_REQUIRE(std::memcmp(t.data, file.data() + data_begin + offset, t.nbytes) == 0,
                            "tensor " + t.name + " does not point at its bytes");
        offset += t.nbytes;
    }
    MF_FUZZ_REQUIRE(data_begin + offset == file.size(), "the tensors do not tile the data section");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    const bool index_mode = (data[0] & 1) != 0;
    const std::string_view body = mf::fuzz::as_text(data + 1, size - 1);
    const fs::path& dir = model_dir();
    std::error_code ec;
    if (index_mode) {
        fs::remove(dir / "model.safetensors", ec);
        mf::fuzz::write_bytes(dir / "model.safetensors.index.json", body);
    } else {
        fs::remove(dir / "model.safetensors.index.json", ec);
        mf::fuzz::write_bytes(dir / "model.safetensors", body);
    }
    mf::fuzz::run_one([&] {
        const mf::io::ModelWeights w = mf::io::ModelWeights::open(dir);
        if (index_mode) {
            const fs::path dir_canonical = fs::canonical(dir);
            for (const mf::io::SafetensorsFile& f : w.files())
                MF_FUZZ_REQUIRE(fs::canonical(f.path()).parent_path() == dir_canonical,
                                "opened a file outside the model directory: " + f.path().string());
        } else {
            check_single(w, body);
        }
        touch_all(w);
    });
    return 0;
}
