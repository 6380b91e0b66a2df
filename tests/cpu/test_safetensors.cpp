// Tests of the model-file layer: bf16/f16 conversion, file helpers (bounded reads, maps, atomic
// files and directories), and safetensors reading/writing. Malformed inputs are built byte by
// byte here, so each one breaks exactly one rule of the format; every one must be refused with
// its own message that names the file (and the tensor, where there is one).
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <set>

#include "core/bf16.h"
#include "core/json.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using mf::io::ModelWeights;
using mf::io::SafetensorsFile;
using mf::io::StDType;
using mf::io::StWriteTensor;

namespace {

std::string le64(uint64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
    return s;
}

// A safetensors file: length prefix, header text as given, data bytes.
std::string st_bytes(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

std::string error_of(const std::function<void()>& fn) {
    try {
        fn();
    } catch (const mf::Error& e) {
        return e.what();
    }
    return "<no error>";
}

std::string open_error(const fs::path& dir) {
    return error_of([&] { ModelWeights::open(dir); });
}

// 8 bytes of data for an F32 [2] tensor.
std::string two_floats(float a, float b) {
    std::string s(8, '\0');
    std::memcpy(s.data(), &a, 4);
    std::memcpy(s.data() + 4, &b, 4);
    return s;
}

const std::string kOneTensorHeader = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

// Independent references for the conversions, from the definitions in double arithmetic.
double f16_reference(uint16_t h) {
    const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    double v;
    if (exponent == 31)
        v = mantissa == 0 ? INFINITY : NAN;
    else if (exponent == 0)
        v = std::ldexp(mantissa, -24);
    else
        v = std::ldexp(1024 + mantissa, exponent - 25);
    return sign ? -v : v;
}

uint16_t bf16_reference(float x) {
    // Candidates: x truncated toward zero (lo) and the next bf16 away from zero (hi); pick the
    // nearer in exact double arithmetic, ties to the even bit pattern.
    const uint32_t bits = std::bit_cast<uint32_t>(x);
    const uint16_t lo = static_cast<uint16_t>(bits >> 16);
    const uint16_t hi = static_cast<uint16_t>(lo + 1);
    const double dx = std::fabs(static_cast<double>(x));
    const double dlo = std::fabs(static_cast<double>(mf::bf16_to_f32(lo)));
    // hi may be infinity (lo is the largest finite): then its distance is that of 2^128.
    const double dhi =
        (hi & 0x7FFF) == 0x7F80 ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(mf::bf16_to_f32(hi)));
    const double below = dx - dlo, above = dhi - dx;
    if (below < above) return lo;
    if (above < below) return hi;
    return (lo & 1) == 0 ? lo : hi;
}

}  // namespace

// --- conversions --------------------------------------------------------------------------------

TEST(Bf16, RoundsToNearestEven) {
    auto from_bits = [](uint32_t b) { return std::bit_cast<float>(b); };
    EXPECT_EQ(mf::f32_to_bf16(1.0f), 0x3F80);
    EXPECT_EQ(mf::f32_to_bf16(-2.0f), 0xC000);
    EXPECT_EQ(mf::f32_to_bf16(from_bits(0x3F807FFF)), 0x3F80);  // below half: down
    EXPECT_EQ(mf::f32_to_bf16(from_bits(0x3F808001)), 0x3F81);  // above half: up
    EXPECT_EQ(mf::f32_to_bf16(from_bits(0x3F808000)), 0x3F80);  // tie, even below: down
    EXPECT_EQ(mf::f32_to_bf16(from_bits(0x3F818000)), 0x3F82);  // tie, odd below: up to even
    EXPECT_EQ(mf::f32_to_bf16(from_bits(0xBF818000)), 0xBF82);  // negative ties mirror
    EXPECT_EQ(mf::f32_to_bf16(from_bits(0x3FFF8000)), 0x4000);  // carry into the exponent
    EXPECT_EQ(mf::f32_to_bf16(from_bits(0x7F7FFFFF)), 0x7F80);  // largest float rounds to inf
    EXPECT_EQ(mf::f32_to_bf16(INFINITY), 0x7F80);
    EXPECT_EQ(mf::f32_to_bf16(-INFINITY), 0xFF80);
    EXPECT_EQ(mf::f32_to_bf16(from_bits(0x00000001)), 0x0000);  // smallest subnormal: down to 0
    EXPECT_EQ(mf::f32_to_bf16(-0.0f), 0x8000);
}

TEST(Bf16, NanStaysNan) {
    // A NaN whose payload sits only in the low 16 bits would truncate to infinity.
    for (uint32_t bits : {0x7F800001u, 0x7FC00000u, 0xFF800001u, 0x7FFFFFFFu, 0x7F80FFFFu}) {
        const uint16_t b = mf::f32_to_bf16(std::bit_cast<float>(bits));
        EXPECT_TRUE(std::isnan(mf::bf16_to_f32(b))) << std::hex << bits;
        EXPECT_EQ(b >> 15, bits >> 31) << "sign kept for " << std::hex << bits;
    }
}

TEST(Bf16, MatchesReferenceRounding) {
    // Every bf16 value round-trips exactly.
    for (uint32_t b = 0; b < 65536; ++b) {
        const float f = mf::bf16_to_f32(static_cast<uint16_t>(b));
        EXPECT_EQ(std::bit_cast<uint32_t>(f), b << 16);
        if (!std::isnan(f)) {
            ASSERT_EQ(mf::f32_to_bf16(f), b);
        }
    }
    // Random finite floats, with a bias toward exact ties, against the reference.
    std::mt19937 rng(7);
    for (int i = 0; i < 200000; ++i) {
        uint32_t bits = rng();
        if (i % 4 == 0) bits = (bits & 0xFFFF0000u) | 0x8000u;
        const float x = std::bit_cast<float>(bits);
        if (!std::isfinite(x)) continue;
        ASSERT_EQ(mf::f32_to_bf16(x), bf16_reference(x)) << std::hex << bits;
    }
}

TEST(F16, SpecValuesAndExhaustive) {
    EXPECT_EQ(mf::f16_to_f32(0x3C00), 1.0f);
    EXPECT_EQ(mf::f16_to_f32(0xC000), -2.0f);
    EXPECT_EQ(mf::f16_to_f32(0x7BFF), 65504.0f);
    EXPECT_EQ(mf::f16_to_f32(0x0400), std::ldexp(1.0f, -14));     // smallest normal
    EXPECT_EQ(mf::f16_to_f32(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
    EXPECT_EQ(mf::f16_to_f32(0x03FF), std::ldexp(1023.0f, -24));  // largest subnormal
    EXPECT_EQ(mf::f16_to_f32(0x3555), 0.333251953125f);
    EXPECT_EQ(mf::f16_to_f32(0x7C00), INFINITY);
    EXPECT_EQ(mf::f16_to_f32(0xFC00), -INFINITY);
    EXPECT_TRUE(std::isnan(mf::f16_to_f32(0x7E00)));
    EXPECT_TRUE(std::isnan(mf::f16_to_f32(0x7C01)));
    EXPECT_EQ(std::bit_cast<uint32_t>(mf::f16_to_f32(0x8000)), 0x80000000u);  // -0 keeps its sign
    for (uint32_t h = 0; h < 65536; ++h) {
        const double want = f16_reference(static_cast<uint16_t>(h));
        const float got = mf::f16_to_f32(static_cast<uint16_t>(h));
        if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(got)) << h;
        } else {
            ASSERT_EQ(static_cast<double>(got), want) << h;
            ASSERT_EQ(std::signbit(got), (h >> 15) != 0) << h;
        }
    }
}

// --- file helpers -------------------------------------------------------------------------------

TEST(File, ReadTextFile) {
    const fs::path dir = mf::test::temp_dir("st_read");
    mf::test::write_file(dir / "a.txt", "hello");
    EXPECT_EQ(mf::io::read_text_file(dir / "a.txt", 5), "hello");
    std::string e = error_of([&] { mf::io::read_text_file(dir / "a.txt", 4); });
    EXPECT_NE(e.find("larger than the limit of 4"), std::string::npos) << e;
    EXPECT_NE(e.find("a.txt"), std::string::npos) << e;
    e = error_of([&] { mf::io::read_text_file(dir / "missing.txt", 100); });
    EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
    EXPECT_NE(e.find("missing.txt"), std::string::npos) << e;
    e = error_of([&] { mf::io::read_text_file(dir, 100); });
    EXPECT_NE(e.find("not a regular file"), std::string::npos) << e;
}

TEST(File, MappedFileMoves) {
    const fs::path dir = mf::test::temp_dir("st_map");
    mf::test::write_file(dir / "a.bin", "abcdef");
    mf::test::write_file(dir / "empty.bin", "");
    mf::io::MappedFile a(dir / "a.bin");
    ASSERT_EQ(a.size(), 6u);
    EXPECT_EQ(std::memcmp(a.data(), "abcdef", 6), 0);
    mf::io::MappedFile b(std::move(a));
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_EQ(a.size(), 0u);
    EXPECT_EQ(std::memcmp(b.data(), "abcdef", 6), 0);
    mf::io::MappedFile c(dir / "empty.bin");
    EXPECT_EQ(c.size(), 0u);
    c = std::move(b);
    EXPECT_EQ(std::memcmp(c.data(), "abcdef", 6), 0);
    EXPECT_THROW(mf::io::MappedFile(dir / "nope.bin"), mf::Error);
}

TEST(File, AtomicWriteReplacesAndLeavesNoTemporaries) {
    const fs::path dir = mf::test::temp_dir("st_atomic");
    mf::io::atomic_write_file(dir / "f.txt", "one");
    mf::io::atomic_write_file(dir / "f.txt", "two");
    EXPECT_EQ(mf::test::read_file(dir / "f.txt"), "two");
    {
        mf::io::AtomicFileWriter w(dir / "g.txt");
        w.write("partial");
        // destroyed without commit
    }
    EXPECT_FALSE(fs::exists(dir / "g.txt"));
    size_t count = 0;
    for (const auto& entry : fs::directory_iterator(dir)) {
        ++count;
        EXPECT_EQ(entry.path().filename(), "f.txt");
    }
    EXPECT_EQ(count, 1u);
}

TEST(File, AtomicDirWithoutCommitLeavesNoTrace) {
    const fs::path root = mf::test::temp_dir("st_atomic_dir");
    const fs::path out = root / "out";
    // A fresh target: nothing appears.
    {
        mf::io::AtomicDir d(out);
        EXPECT_TRUE(fs::is_directory(d.tmp_path()));
        EXPECT_EQ(d.tmp_path().filename().string(), "out.tmp-" + std::to_string(::getpid()));
        mf::test::write_file(d.tmp_path() / "half.bin", "xx");
    }
    EXPECT_TRUE(fs::is_empty(root));
    // An existing target: untouched, also when the writer throws half-way.
    fs::create_directories(out);
    mf::test::write_file(out / "old.txt", "old");
    EXPECT_THROW(
        {
            mf::io::AtomicDir d(out);
            mf::test::write_file(d.tmp_path() / "new.txt", "new");
            throw mf::Error("writer failed");
        },
        mf::Error);
    EXPECT_EQ(mf::test::read_file(out / "old.txt"), "old");
    EXPECT_FALSE(fs::exists(out / "new.txt"));
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(root)) names.push_back(entry.path().filename().string());
    EXPECT_EQ(names, std::vector<std::string>{"out"});
}

TEST(File, AtomicDirCommitReplacesOldDirectory) {
    const fs::path root = mf::test::temp_dir("st_atomic_commit");
    const fs::path out = root / "out";
    fs::create_directories(out / "sub");
    mf::test::write_file(out / "old.txt", "old");
    {
        mf::io::AtomicDir d(root / "out/");  // trailing separator names the same directory
        fs::create_directories(d.tmp_path() / "nested");
        mf::test::write_file(d.tmp_path() / "new.txt", "new");
        mf::test::write_file(d.tmp_path() / "nested" / "x.txt", "x");
        d.commit();
        EXPECT_THROW(d.commit(), mf::Error);
    }
    EXPECT_EQ(mf::test::read_file(out / "new.txt"), "new");
    EXPECT_EQ(mf::test::read_file(out / "nested" / "x.txt"), "x");
    EXPECT_FALSE(fs::exists(out / "old.txt"));
    EXPECT_FALSE(fs::exists(out / "sub"));
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(root)) names.push_back(entry.path().filename().string());
    EXPECT_EQ(names, std::vector<std::string>{"out"});
}

// --- round trips --------------------------------------------------------------------------------

TEST(Safetensors, RoundTripSingleFile) {
    const fs::path dir = mf::test::temp_dir("st_single");
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    std::vector<float> f32(3 * 5);
    for (float& x : f32) x = normal(rng);
    std::vector<uint16_t> bf16(4 * 7);
    for (uint16_t& x : bf16) x = mf::f32_to_bf16(normal(rng));
    bf16[0] = 0x7FC1;  // a NaN pattern must survive byte for byte
    std::vector<int64_t> i64{-1, 0, 1LL << 40};
    std::vector<uint8_t> flags{1, 0, 1, 1};
    std::vector<uint16_t> f16{0x3C00, 0x0001, 0xFC00, 0x3555};
    std::vector<double> f64{0.1, -1e300, 3.0};
    const std::vector<StWriteTensor> tensors{
        {"model.embed.weight", StDType::F32, {3, 5}, f32.data()},
        {"layers.0.w", StDType::BF16, {4, 7}, bf16.data()},
        {"ids", StDType::I64, {3}, i64.data()},
        {"mask", StDType::BOOL, {2, 2}, flags.data()},
        {"half", StDType::F16, {4}, f16.data()},
        {"dbl", StDType::F64, {3}, f64.data()},
        {"empty", StDType::F32, {0, 4}, nullptr},
        {"scalar", StDType::F32, {}, f32.data()},
    };
    mf::io::write_model_weights(dir, tensors, size_t{1} << 30);
    ASSERT_TRUE(fs::exists(dir / "model.safetensors"));
    EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
    // The data section starts 8-aligned (header padded with spaces).
    const std::string raw = mf::test::read_file(dir / "model.safetensors");
    uint64_t header_len = 0;
    std::memcpy(&header_len, raw.data(), 8);
    EXPECT_EQ(header_len % 8, 0u);

    const ModelWeights w = ModelWeights::open(dir);
    std::vector<std::string> want_names;
    for (const auto& t : tensors) want_names.push_back(t.name);
    std::sort(want_names.begin(), want_names.end());
    EXPECT_EQ(w.names(), want_names);
    for (const auto& t : tensors) {
        const mf::io::StTensor* got = w.find(t.name);
        ASSERT_NE(got, nullptr) << t.name;
        EXPECT_EQ(got->dtype, t.dtype) << t.name;
        EXPECT_EQ(got->shape, t.shape) << t.name;
        ASSERT_EQ(got->nbytes, static_cast<size_t>(mf::shape_numel(t.shape)) * mf::io::st_dtype_size(t.dtype));
        if (got->nbytes > 0) {
            EXPECT_EQ(std::memcmp(got->data, t.data, got->nbytes), 0) << t.name;
        }
    }
    // read_f32 from each float dtype.
    std::vector<float> out(28);
    w.read_f32("model.embed.weight", {3, 5}, out.data());
    EXPECT_EQ(std::memcmp(out.data(), f32.data(), 15 * 4), 0);
    w.read_f32("layers.0.w", {4, 7}, out.data());
    for (size_t i = 0; i < bf16.size(); ++i)
        EXPECT_EQ(std::bit_cast<uint32_t>(out[i]), static_cast<uint32_t>(bf16[i]) << 16) << i;
    w.read_f32("half", {4}, out.data());
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[1], std::ldexp(1.0f, -24));
    EXPECT_EQ(out[2], -INFINITY);
    EXPECT_EQ(out[3], 0.333251953125f);
    w.read_f32("dbl", {3}, out.data());
    EXPECT_EQ(out[0], 0.1f);
    EXPECT_EQ(out[1], -INFINITY);
    EXPECT_EQ(out[2], 3.0f);
    w.read_f32("scalar", {}, out.data());
    EXPECT_EQ(out[0], f32[0]);
    w.read_f32("empty", {0, 4}, nullptr);

    std::string e = error_of([&] { w.read_f32("nope", {1}, out.data()); });
    EXPECT_NE(e.find("'nope' not found"), std::string::npos) << e;
    e = error_of([&] { w.read_f32("model.embed.weight", {5, 3}, out.data()); });
    EXPECT_NE(e.find("has shape [3, 5], expected [5, 3]"), std::string::npos) << e;
    EXPECT_NE(e.find("model.embed.weight"), std::string::npos) << e;
    EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
    e = error_of([&] { w.read_f32("ids", {3}, out.data()); });
    EXPECT_NE(e.find("dtype I64, which cannot be read as fp32"), std::string::npos) << e;
}

TEST(Safetensors, MetadataRoundTrip) {
    const fs::path dir = mf::test::temp_dir("st_meta");
    std::vector<float> x{1.5f, -2.0f};
    mf::io::write_safetensors(dir / "a.safetensors", {{"x", StDType::F32, {2}, x.data()}},
                              {{"format", "pt"}, {"note", "\xc3\xa9t\xc3\xa9 \"q\""}});
    const SafetensorsFile f = SafetensorsFile::open(dir / "a.safetensors");
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.metadata().at("note"), "\xc3\xa9t\xc3\xa9 \"q\"");
    ASSERT_EQ(f.tensors().size(), 1u);
    EXPECT_EQ(std::memcmp(f.find("x")->data, x.data(), 8), 0);
    EXPECT_EQ(f.find("y"), nullptr);
}

TEST(Safetensors, RoundTripSharded) {
    const fs::path dir = mf::test::temp_dir("st_sharded");
    std::mt19937 rng(2);
    std::vector<std::vector<uint16_t>> bf16_data;
    std::vector<std::vector<float>> f32_data;
    std::vector<StWriteTensor> tensors;
    bf16_data.reserve(10);
    f32_data.reserve(10);
    for (int i = 0; i < 10; ++i) {
        const int64_t rows = 1 + i % 3, cols = 3 + i;
        if (i % 2 == 0) {
            auto& v = bf16_data.emplace_back(static_cast<size_t>(rows * cols));
            for (auto& x : v) x = static_cast<uint16_t>(rng());
            tensors.push_back({"layers." + std::to_string(i) + ".w", StDType::BF16, {rows, cols}, v.data()});
        } else {
            auto& v = f32_data.emplace_back(static_cast<size_t>(rows * cols));
            for (auto& x : v) x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
            tensors.push_back({"layers." + std::to_string(i) + ".b", StDType::F32, {rows, cols}, v.data()});
        }
    }
    // One tensor larger than a shard: it must get a shard of its own.
    std::vector<float> big(64, 0.25f);
    tensors.push_back({"big", StDType::F32, {64}, big.data()});
    constexpr size_t kMaxShard = 100;

    // A stale single file from an earlier export must not shadow the new index.
    mf::io::write_model_weights(dir, {{"stale", StDType::F32, {2}, big.data()}}, kMaxShard);
    ASSERT_TRUE(fs::exists(dir / "model.safetensors"));
    mf::io::write_model_weights(dir, tensors, kMaxShard);
    EXPECT_FALSE(fs::exists(dir / "model.safetensors"));

    size_t total = 0;
    for (const auto& t : tensors) total += mf::shape_numel(t.shape) * mf::io::st_dtype_size(t.dtype);
    const auto index = mf::json::parse(mf::test::read_file(dir / "model.safetensors.index.json"), "index");
    EXPECT_EQ(index.find("metadata")->find("total_size")->as_int(), static_cast<int64_t>(total));
    const auto& weight_map = index.find("weight_map")->as_object();
    ASSERT_EQ(weight_map.size(), tensors.size());
    std::map<std::string, size_t> bytes_in_shard, tensors_in_shard;
    std::set<std::string> shards;
    for (const auto& t : tensors) {
        const auto* file = index.find("weight_map")->find(t.name);
        ASSERT_NE(file, nullptr) << t.name;
        shards.insert(file->as_string());
        bytes_in_shard[file->as_string()] += mf::shape_numel(t.shape) * mf::io::st_dtype_size(t.dtype);
        tensors_in_shard[file->as_string()] += 1;
    }
    ASSERT_GE(shards.size(), 3u);
    const std::string count = std::to_string(shards.size());
    for (size_t i = 1; i <= shards.size(); ++i) {
        char name[64];
        std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i, shards.size());
        EXPECT_TRUE(shards.count(name)) << name;
        EXPECT_TRUE(fs::exists(dir / name)) << name;
        EXPECT_TRUE(bytes_in_shard[name] <= kMaxShard || tensors_in_shard[name] == 1) << name;
    }
    EXPECT_EQ(tensors_in_shard[index.find("weight_map")->find("big")->as_string()], 1u);

    const ModelWeights w = ModelWeights::open(dir);
    EXPECT_EQ(w.files().size(), shards.size());
    EXPECT_EQ(w.names().size(), tensors.size());
    EXPECT_EQ(w.find("stale"), nullptr);
    for (const auto& t : tensors) {
        const mf::io::StTensor* got = w.find(t.name);
        ASSERT_NE(got, nullptr) << t.name;
        EXPECT_EQ(got->shape, t.shape);
        EXPECT_EQ(got->dtype, t.dtype);
        EXPECT_EQ(fs::path(got->file).filename().string(), index.find("weight_map")->find(t.name)->as_string());
        EXPECT_EQ(std::memcmp(got->data, t.data, got->nbytes), 0) << t.name;
    }
    // Writing a small model again goes back to one file and drops the index.
    mf::io::write_model_weights(dir, {{"small", StDType::F32, {2}, big.data()}}, kMaxShard);
    EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
    EXPECT_EQ(ModelWeights::open(dir).names(), std::vector<std::string>{"small"});
}

// Tensors produced by `fill` when the writer reaches them: called once each, in the given order,
// across shards, and the files equal those written from data.
TEST(Safetensors, FilledTensorsWriteLikeData) {
    const fs::path from_data = mf::test::temp_dir("st_fill_data"), filled = mf::test::temp_dir("st_fill");
    std::mt19937 rng(5);
    std::vector<std::vector<float>> values;
    for (int i = 0; i < 7; ++i) {
        auto& v = values.emplace_back(static_cast<size_t>(3 + 2 * i));
        for (auto& x : v) x = std::bit_cast<float>(static_cast<uint32_t>(rng()) & 0x7f7fffffu);
    }
    std::vector<StWriteTensor> plain, lazy;
    std::vector<int> calls;
    for (size_t i = 0; i < values.size(); ++i) {
        const std::string name = "t." + std::to_string(i);
        const mf::Shape shape{static_cast<int64_t>(values[i].size())};
        plain.push_back({name, StDType::F32, shape, values[i].data()});
        StWriteTensor t{name, StDType::F32, shape, nullptr};
        t.fill = [&, i](void* out) {
            calls.push_back(static_cast<int>(i));
            std::memcpy(out, values[i].data(), values[i].size() * sizeof(float));
        };
        lazy.push_back(std::move(t));
    }
    constexpr size_t kMaxShard = 64;  // several shards
    mf::io::write_model_weights(from_data, plain, kMaxShard);
    mf::io::write_model_weights(filled, lazy, kMaxShard);
    EXPECT_EQ(calls, (std::vector<int>{0, 1, 2, 3, 4, 5, 6}));
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(from_data)) files.push_back(e.path().filename().string());
    ASSERT_GE(files.size(), 3u);
    for (const auto& f : files) EXPECT_EQ(mf::test::read_file(from_data / f), mf::test::read_file(filled / f)) << f;
    // Neither data nor fill: refused before anything is written.
    const fs::path none = mf::test::temp_dir("st_fill_none");
    EXPECT_THROW(mf::io::write_model_weights(none, {{"x", StDType::F32, {2}, nullptr}}, kMaxShard), mf::Error);
    EXPECT_TRUE(fs::is_empty(none));
}

TEST(Safetensors, WriterRejectsBadInput) {
    const fs::path dir = mf::test::temp_dir("st_write_bad");
    float x[2] = {1, 2};
    EXPECT_THROW(mf::io::write_safetensors(dir / "a.safetensors",
                                           {{"x", StDType::F32, {2}, x}, {"x", StDType::F32, {2}, x}}, {}),
                 mf::Error);
    EXPECT_THROW(mf::io::write_safetensors(dir / "a.safetensors", {{"__metadata__", StDType::F32, {2}, x}}, {}),
                 mf::Error);
    EXPECT_THROW(mf::io::write_safetensors(dir / "a.safetensors", {{"x", StDType::F32, {-2}, x}}, {}), mf::Error);
    EXPECT_THROW(mf::io::write_safetensors(dir / "a.safetensors", {{"x", StDType::F32, {2}, nullptr}}, {}), mf::Error);
    EXPECT_TRUE(fs::is_empty(dir));
}

// --- crafted files ------------------------------------------------------------------------------

TEST(Safetensors, AcceptsCraftedValidFile) {
    const fs::path dir = mf::test::temp_dir("st_valid");
    // Metadata first, tensors listed out of offset order, a zero-size tensor, header padded.
    const std::string header =
        R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},)"
        R"("z":{"dtype":"I8","shape":[0,3],"data_offsets":[12,12]},)"
        R"("a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}}    )";
    mf::test::write_file(dir / "model.safetensors",
                         st_bytes(header, two_floats(1.0f, -3.5f) + std::string("\x80\x3f\x00\xc0", 4)));
    const ModelWeights w = ModelWeights::open(dir);
    EXPECT_EQ(w.names(), (std::vector<std::string>{"a", "b", "z"}));
    EXPECT_EQ(w.files()[0].metadata().at("format"), "pt");
    float out[2];
    w.read_f32("a", {1, 2}, out);
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[1], -3.5f);
    w.read_f32("b", {2}, out);
    EXPECT_EQ(out[0], 1.0f);
    EXPECT_EQ(out[1], -2.0f);
    EXPECT_EQ(w.find("z")->nbytes, 0u);
}

TEST(Safetensors, PrefersIndexOverSingleFile) {
    const fs::path dir = mf::test::temp_dir("st_prefer");
    mf::test::write_file(dir / "model.safetensors", st_bytes(kOneTensorHeader, two_floats(1, 2)));
    mf::test::write_file(dir / "s1.safetensors",
                         st_bytes(R"({"v":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", two_floats(3, 4)));
    mf::test::write_file(dir / "model.safetensors.index.json",
                         R"({"metadata":{},"weight_map":{"v":"s1.safetensors"}})");
    const ModelWeights w = ModelWeights::open(dir);
    EXPECT_EQ(w.names(), std::vector<std::string>{"v"});
}

TEST(Safetensors, AcceptsSymlinkInsideDirectory) {
    const fs::path dir = mf::test::temp_dir("st_symlink_in");
    mf::test::write_file(dir / "real.bin", st_bytes(kOneTensorHeader, two_floats(1, 2)));
    fs::create_symlink("real.bin", dir / "model.safetensors");
    EXPECT_EQ(ModelWeights::open(dir).names(), std::vector<std::string>{"w"});
}

struct MalformedCase {
    const char* label;
    std::function<void(const fs::path&)> make;  // fills the model directory
    const char* expect;                         // distinctive part of the message
    const char* names;                          // the file or tensor the message must name
};

// Writes a single-file model with the given header and data.
std::function<void(const fs::path&)> single(const std::string& header, const std::string& data) {
    return [=](const fs::path& dir) { mf::test::write_file(dir / "model.safetensors", st_bytes(header, data)); };
}

// Writes an index plus shards (file name -> bytes).
std::function<void(const fs::path&)> sharded(const std::string& index,
                                             const std::vector<std::pair<std::string, std::string>>& shards) {
    return [=](const fs::path& dir) {
        mf::test::write_file(dir / "model.safetensors.index.json", index);
        for (const auto& [name, bytes] : shards) mf::test::write_file(dir / name, bytes);
    };
}

std::string tensor_entry(const std::string& name, const std::string& dtype, const std::string& shape,
                         const std::string& offsets) {
    return "\"" + name + R"(":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}

TEST(Safetensors, RejectsMalformedModelDirectories) {
    const std::string good_shard = st_bytes(kOneTensorHeader, two_floats(1, 2));
    const std::string shard_a = st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", two_floats(1, 2));
    const std::string shard_b = st_bytes(R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", two_floats(3, 4));
    const std::string shard_ab = st_bytes(
        R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
        two_floats(1, 2) + two_floats(3, 4));
    const std::string data8 = two_floats(1, 2);

    const std::vector<MalformedCase> cases = {
        {"file shorter than 8 bytes", [](const fs::path& d) { mf::test::write_file(d / "model.safetensors", "abc"); },
         "shorter than the 8-byte header length", "model.safetensors"},
        {"header length 0", [](const fs::path& d) { mf::test::write_file(d / "model.safetensors", le64(0) + "{}"); },
         "header length is 0", "model.safetensors"},
        {"header length above the cap",
         [](const fs::path& d) { mf::test::write_file(d / "model.safetensors", le64(1ULL << 62) + "{}"); },
         "exceeds the cap of 100000000", "model.safetensors"},
        {"header length past the end of the file",
         [](const fs::path& d) { mf::test::write_file(d / "model.safetensors", le64(1000) + "{}"); },
         "runs past the end of the file", "model.safetensors"},
        {"truncated header JSON", single(R"({"w":{"dtype":"F32","shape":[2])", ""), "invalid JSON",
         "model.safetensors"},
        {"header not an object", single("[1, 2]", ""), "header is a JSON array, expected an object",
         "model.safetensors"},
        {"entry not an object", single(R"({"w": 5})", ""), "entry is a JSON number", "'w'"},
        {"missing field", single(R"({"w":{"dtype":"F32","shape":[2]}})", data8), "missing field 'data_offsets'", "'w'"},
        {"extra field", single(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"foo":1}})", data8),
         "unexpected field 'foo'", "'w'"},
        {"unknown dtype", single("{" + tensor_entry("w", "Q4", "[2]", "[0,8]") + "}", data8), "unknown dtype 'Q4'",
         "'w'"},
        {"negative dimension", single("{" + tensor_entry("w", "F32", "[-2]", "[0,8]") + "}", data8),
         "shape[0] is -2, expected a non-negative integer", "'w'"},
        {"fractional dimension", single("{" + tensor_entry("w", "F32", "[1, 2.5]", "[0,8]") + "}", data8),
         "shape[1] is 2.5", "'w'"},
        {"shape not an array", single("{" + tensor_entry("w", "F32", "\"2\"", "[0,8]") + "}", data8),
         "shape is a JSON string", "'w'"},
        {"element count overflow",
         single("{" + tensor_entry("w", "F32", "[4294967296, 4294967296, 4]", "[0,8]") + "}", data8),
         "element count of shape", "'w'"},
        {"byte size overflow", single("{" + tensor_entry("w", "F64", "[4611686018427387904]", "[0,8]") + "}", data8),
         "byte size of shape", "'w'"},
        {"data_offsets not two integers", single("{" + tensor_entry("w", "F32", "[2]", "[0]") + "}", data8),
         "data_offsets is [0], expected two non-negative integers", "'w'"},
        {"data_offsets begin > end", single("{" + tensor_entry("w", "F32", "[0]", "[8,4]") + "}", data8),
         "data_offsets begin 8 > end 4", "'w'"},
        {"data_offsets beyond data", single("{" + tensor_entry("w", "F32", "[100]", "[0,400]") + "}", data8),
         "end 400 is beyond the data section (8 bytes)", "'w'"},
        {"byte size mismatch", single("{" + tensor_entry("w", "F32", "[3]", "[0,8]") + "}", data8),
         "byte size mismatch: data_offsets span 8 bytes but F32 [3] needs 12", "'w'"},
        {"overlapping tensors",
         single("{" + tensor_entry("a", "F32", "[2]", "[0,8]") + "," + tensor_entry("b", "F32", "[2]", "[4,12]") + "}",
                data8 + "1234"),
         "overlap tensor 'a'", "'b'"},
        {"hole between tensors",
         single("{" + tensor_entry("a", "F32", "[1]", "[0,4]") + "," + tensor_entry("b", "F32", "[1]", "[8,12]") + "}",
                data8 + "1234"),
         "bytes [4, 8) belong to no tensor (before tensor 'b')", "model.safetensors"},
        {"hole at the end", single("{" + tensor_entry("a", "F32", "[1]", "[0,4]") + "}", data8),
         "bytes [4, 8) at its end belong to no tensor", "model.safetensors"},
        {"metadata value not a string", single(R"({"__metadata__":{"format":1}})", ""),
         "__metadata__ value of 'format' is a JSON number", "model.safetensors"},
        {"metadata not an object", single(R"({"__metadata__":["pt"]})", ""), "__metadata__ is a JSON array",
         "model.safetensors"},
        {"invalid UTF-8 in a name", single("{" + tensor_entry("w\xff\xfe", "F32", "[2]", "[0,8]") + "}", data8),
         "header is not valid UTF-8 at header byte 3", "model.safetensors"},
        {"overlong UTF-8 in a name", single("{" + tensor_entry("w\xc0\xaf", "F32", "[2]", "[0,8]") + "}", data8),
         "not valid UTF-8 at header byte 3 (near \"{\"w\\xc0\\xaf", "model.safetensors"},
        {"duplicate key in header",
         single("{" + tensor_entry("w", "F32", "[2]", "[0,8]") + "," + tensor_entry("w", "F32", "[2]", "[0,8]") + "}",
                data8),
         "duplicate key \"w\"", "model.safetensors"},
        // --- sharded ---
        {"shard path with '..'", sharded(R"({"weight_map":{"w":"../outside.safetensors"}})", {}), "contains '..'",
         "model.safetensors.index.json"},
        {"absolute shard path", sharded(R"({"weight_map":{"w":"/tmp/model.safetensors"}})", {}), "is an absolute path",
         "model.safetensors.index.json"},
        {"shard path in a subdirectory",
         [&](const fs::path& d) {
             fs::create_directories(d / "sub");
             sharded(R"({"weight_map":{"w":"sub/x.safetensors"}})", {{"sub/x.safetensors", good_shard}})(d);
         },
         "is not a plain file name", "model.safetensors.index.json"},
        {"symlink out of the directory",
         [&](const fs::path& d) {
             const fs::path outside = d.parent_path() / (d.filename().string() + "_outside.safetensors");
             mf::test::write_file(outside, good_shard);
             fs::create_symlink(outside, d / "evil.safetensors");
             sharded(R"({"weight_map":{"w":"evil.safetensors"}})", {})(d);
         },
         "outside the model directory", "evil.safetensors"},
        {"index names a missing shard", sharded(R"({"weight_map":{"w":"gone.safetensors"}})", {}),
         "file 'gone.safetensors' does not exist", "model.safetensors.index.json"},
        {"tensor missing from its shard",
         sharded(R"({"weight_map":{"a":"s1.safetensors","b":"s1.safetensors"}})", {{"s1.safetensors", shard_a}}),
         "tensor 'b' is listed in shard s1.safetensors but is missing from", "s1.safetensors"},
        {"tensor in a shard but not in the index",
         sharded(R"({"weight_map":{"a":"s1.safetensors"}})", {{"s1.safetensors", shard_ab}}),
         "tensor 'b' is not listed in the index", "s1.safetensors"},
        {"tensor in two shards",
         sharded(R"({"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})",
                 {{"s1.safetensors", shard_a}, {"s2.safetensors", shard_ab}}),
         "tensor 'a' is also in shard s1.safetensors", "s2.safetensors"},
        {"index not valid JSON", sharded(R"({"weight_map":{"a":"s1.safetensors",}})", {{"s1.safetensors", shard_a}}),
         "invalid JSON", "model.safetensors.index.json"},
        {"index without weight_map", sharded(R"({"metadata":{}})", {}), "missing field 'weight_map'",
         "model.safetensors.index.json"},
        {"weight_map value not a string", sharded(R"({"weight_map":{"a":3}})", {}),
         "weight_map entry for tensor 'a' is a JSON number", "model.safetensors.index.json"},
        {"weight_map not an object", sharded(R"({"weight_map":["a"]})", {}), "weight_map is a JSON array",
         "model.safetensors.index.json"},
        {"bad shard file", sharded(R"({"weight_map":{"b":"s2.safetensors"}})", {{"s2.safetensors", "xyz"}}),
         "shorter than the 8-byte header length", "s2.safetensors"},
        {"no safetensors at all", [](const fs::path& d) { mf::test::write_file(d / "config.json", "{}"); },
         "looked for model.safetensors.index.json (sharded) and model.safetensors", "no safetensors weights in"},
    };
    ASSERT_GE(cases.size(), 15u);
    std::set<std::string> messages;
    const fs::path root = mf::test::temp_dir("st_malformed");
    for (size_t i = 0; i < cases.size(); ++i) {
        const MalformedCase& c = cases[i];
        const fs::path dir = root / ("case" + std::to_string(i));
        fs::create_directories(dir);
        c.make(dir);
        const std::string e = open_error(dir);
        EXPECT_NE(e.find(c.expect), std::string::npos) << c.label << ": " << e;
        EXPECT_NE(e.find(c.names), std::string::npos) << c.label << " should name " << c.names << ": " << e;
        EXPECT_TRUE(messages.insert(e).second) << c.label << ": message not distinct: " << e;
    }
}

TEST(Safetensors, SafetensorsFileOpenNamesFile) {
    const fs::path dir = mf::test::temp_dir("st_open");
    mf::test::write_file(dir / "x.safetensors", le64(16) + "{}");
    const std::string e = error_of([&] { SafetensorsFile::open(dir / "x.safetensors"); });
    EXPECT_NE(e.find("x.safetensors"), std::string::npos) << e;
    EXPECT_NE(e.find("runs past the end"), std::string::npos) << e;
    // An empty header object with no data is a valid, empty file.
    mf::test::write_file(dir / "empty.safetensors", le64(2) + "{}");
    EXPECT_TRUE(SafetensorsFile::open(dir / "empty.safetensors").tensors().empty());
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
    // Mutations of a valid file must be either accepted with in-bounds tensors or refused with
    // mf::Error; with sanitizers on this also checks that no byte outside the map is read.
    const fs::path dir = mf::test::temp_dir("st_fuzz");
    const std::string header = R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                               R"("b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}})";
    const std::string valid = st_bytes(header, two_floats(1, 2) + "abcd");
    std::mt19937 rng(3);
    int accepted = 0, refused = 0;
    for (int iter = 0; iter < 3000; ++iter) {
        std::string bytes = valid;
        const int kind = iter % 3;
        if (kind == 0) {
            for (int k = 1 + static_cast<int>(rng() % 3); k > 0; --k)
                bytes[rng() % bytes.size()] = static_cast<char>(rng());
        } else if (kind == 1) {
            bytes.resize(rng() % bytes.size());
        } else {
            // Replace a digit or punctuation of the header with another such character.
            const char pool[] = "0123456789[]{},:\"-. eE";
            const size_t pos = 8 + rng() % header.size();
            bytes[pos] = pool[rng() % (sizeof pool - 1)];
        }
        const fs::path path = dir / "f.safetensors";
        mf::test::write_file(path, bytes);
        try {
            const SafetensorsFile f = SafetensorsFile::open(path);
            ++accepted;
            for (const auto& t : f.tensors()) {
                EXPECT_EQ(t.nbytes, static_cast<size_t>(mf::shape_numel(t.shape)) * mf::io::st_dtype_size(t.dtype));
                volatile uint8_t sink = 0;
                for (size_t i = 0; i < t.nbytes; ++i) sink = sink + t.data[i];
            }
        } catch (const mf::Error& e) {
            ++refused;
            EXPECT_NE(std::string(e.what()).find("f.safetensors"), std::string::npos) << e.what();
        }
    }
    EXPECT_GT(refused, 0);
    EXPECT_EQ(accepted + refused, 3000);
}
