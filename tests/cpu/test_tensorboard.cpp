// TensorBoardWriter's event files, read back with the format's own rules by a reader written here
// independently of the writer: TFRecord framing with both masked CRC-32Cs verified (a bitwise CRC,
// not the library's table), and a generic protobuf decoder for Event {wall_time = 1, step = 2,
// file_version = 3, summary = 5} and Summary {value = 1: {tag = 1, simple_value = 2}}.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>

#include "core/check.h"
#include "test_util.h"
#include "train/tensorboard.h"

namespace {

namespace fs = std::filesystem;

uint32_t bitwise_crc32c(const std::string& s) {
    uint32_t crc = 0xFFFFFFFFu;
    for (unsigned char c : s) {
        crc ^= c;
        for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

uint32_t mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t read_le(const std::string& s, size_t pos, int nbytes) {
    uint64_t v = 0;
    for (int k = 0; k < nbytes; ++k) v |= uint64_t{static_cast<unsigned char>(s[pos + k])} << (8 * k);
    return v;
}

// The records of a TFRecord file; a test failure when a CRC or a length does not match.
std::vector<std::string> read_records(const std::string& bytes) {
    std::vector<std::string> records;
    size_t pos = 0;
    while (pos < bytes.size()) {
        EXPECT_LE(pos + 12, bytes.size()) << "truncated record header at byte " << pos;
        if (pos + 12 > bytes.size()) break;
        const uint64_t length = read_le(bytes, pos, 8);
        EXPECT_EQ(read_le(bytes, pos + 8, 4), mask(bitwise_crc32c(bytes.substr(pos, 8)))) << "length CRC at " << pos;
        EXPECT_LE(pos + 12 + length + 4, bytes.size()) << "truncated record at byte " << pos;
        if (pos + 12 + length + 4 > bytes.size()) break;
        const std::string data = bytes.substr(pos + 12, length);
        EXPECT_EQ(read_le(bytes, pos + 12 + length, 4), mask(bitwise_crc32c(data))) << "data CRC at " << pos;
        records.push_back(data);
        pos += 12 + length + 4;
    }
    return records;
}

struct Field {
    uint32_t number = 0, wire_type = 0;
    uint64_t varint = 0;  // wire types 0, 1, 5
    std::string bytes;    // wire type 2
};

uint64_t read_varint(const std::string& s, size_t& pos) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (pos >= s.size()) throw std::runtime_error("truncated varint");
        const auto b = static_cast<unsigned char>(s[pos++]);
        v |= uint64_t{b & 0x7Fu} << shift;
        if ((b & 0x80u) == 0) return v;
    }
    throw std::runtime_error("varint longer than 10 bytes");
}

std::vector<Field> decode_message(const std::string& s) {
    std::vector<Field> fields;
    size_t pos = 0;
    while (pos < s.size()) {
        const uint64_t key = read_varint(s, pos);
        Field f;
        f.number = static_cast<uint32_t>(key >> 3);
        f.wire_type = static_cast<uint32_t>(key & 7);
        switch (f.wire_type) {
            case 0:
                f.varint = read_varint(s, pos);
                break;
            case 1:
                if (pos + 8 > s.size()) throw std::runtime_error("truncated fixed64");
                f.varint = read_le(s, pos, 8);
                pos += 8;
                break;
            case 2: {
                const uint64_t n = read_varint(s, pos);
                if (pos + n > s.size()) throw std::runtime_error("truncated bytes");
                f.bytes = s.substr(pos, n);
                pos += n;
                break;
            }
            case 5:
                if (pos + 4 > s.size()) throw std::runtime_error("truncated fixed32");
                f.varint = read_le(s, pos, 4);
                pos += 4;
                break;
            default:
                throw std::runtime_error("unexpected wire type " + std::to_string(f.wire_type));
        }
        fields.push_back(f);
    }
    return fields;
}

struct Event {
    double wall_time = 0;
    int64_t step = 0;
    std::string file_version;
    std::vector<std::pair<std::string, float>> values;
    bool has_summary = false;
};

Event decode_event(const std::string& data) {
    Event e;
    for (const Field& f : decode_message(data)) {
        if (f.number == 1) {
            EXPECT_EQ(f.wire_type, 1u);
            std::memcpy(&e.wall_time, &f.varint, 8);
        } else if (f.number == 2) {
            EXPECT_EQ(f.wire_type, 0u);
            e.step = static_cast<int64_t>(f.varint);
        } else if (f.number == 3) {
            EXPECT_EQ(f.wire_type, 2u);
            e.file_version = f.bytes;
        } else if (f.number == 5) {
            EXPECT_EQ(f.wire_type, 2u);
            e.has_summary = true;
            for (const Field& v : decode_message(f.bytes)) {
                EXPECT_EQ(v.number, 1u);
                std::string tag;
                float value = std::nanf("");
                bool has_value = false;
                for (const Field& vf : decode_message(v.bytes)) {
                    if (vf.number == 1) tag = vf.bytes;
                    if (vf.number == 2) {
                        EXPECT_EQ(vf.wire_type, 5u);
                        const auto bits = static_cast<uint32_t>(vf.varint);
                        std::memcpy(&value, &bits, 4);
                        has_value = true;
                    }
                }
                EXPECT_TRUE(has_value) << "Summary.Value without simple_value, tag " << tag;
                e.values.emplace_back(tag, value);
            }
        } else {
            ADD_FAILURE() << "unexpected Event field " << f.number;
        }
    }
    return e;
}

std::vector<Event> read_events(const fs::path& file) {
    std::vector<Event> events;
    for (const std::string& r : read_records(mf::test::read_file(file))) events.push_back(decode_event(r));
    return events;
}

fs::path only_event_file(const fs::path& dir) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
    EXPECT_EQ(files.size(), 1u);
    return files.empty() ? fs::path() : files[0];
}

double now_s() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

const char* kTags[] = {"train/loss", "train/ce_loss",      "train/aux_loss",    "train/grad_norm",
                       "train/lr",   "train/tokens_per_s", "train/peak_mem_gib"};

double value_of(int tag, int64_t step) { return 3.0 / static_cast<double>(step) + 0.125 * tag + 1e-7 * step; }

}  // namespace

TEST(TensorBoard, OwnCrcMatchesTheCheckValue) {
    // The reader's CRC must itself be right, or the round trip proves nothing.
    EXPECT_EQ(bitwise_crc32c("123456789"), 0xE3069283u);
}

TEST(TensorBoard, EveryScalarReadsBack) {
    const fs::path dir = mf::test::temp_dir("tb_roundtrip") / "tensorboard";  // created by the writer
    const double t0 = now_s();
    fs::path file;
    {
        mf::train::TensorBoardWriter tb(dir);
        file = tb.file();
        for (int64_t step = 1; step <= 20; ++step) {
            for (int tag = 0; tag < 7; ++tag) tb.scalar(kTags[tag], step, value_of(tag, step));
            if (step % 5 == 0) tb.scalar("val/loss", step, 2.5 - 0.01 * static_cast<double>(step));
            tb.flush();
        }
    }
    const double t1 = now_s();
    EXPECT_EQ(only_event_file(dir), file);
    const std::string name = file.filename().string();
    EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
    char pid_part[32];
    std::snprintf(pid_part, sizeof pid_part, ".%d.", static_cast<int>(::getpid()));
    EXPECT_NE(name.find(pid_part), std::string::npos) << name;

    const std::vector<Event> events = read_events(file);
    ASSERT_EQ(events.size(), 21u);
    EXPECT_EQ(events[0].file_version, "brain.Event:2");
    EXPECT_FALSE(events[0].has_summary);
    for (size_t k = 1; k < events.size(); ++k) {
        const Event& e = events[k];
        const auto step = static_cast<int64_t>(k);
        EXPECT_EQ(e.step, step);
        EXPECT_GE(e.wall_time, t0 - 1);
        EXPECT_LE(e.wall_time, t1 + 1);
        ASSERT_EQ(e.values.size(), step % 5 == 0 ? 8u : 7u) << "step " << step;
        for (int tag = 0; tag < 7; ++tag) {
            EXPECT_EQ(e.values[tag].first, kTags[tag]);
            EXPECT_EQ(e.values[tag].second, static_cast<float>(value_of(tag, step))) << kTags[tag] << " step " << step;
        }
        if (step % 5 == 0) {
            EXPECT_EQ(e.values[7].first, "val/loss");
            EXPECT_EQ(e.values[7].second, static_cast<float>(2.5 - 0.01 * static_cast<double>(step)));
        }
    }
}

TEST(TensorBoard, ScalarOfANewStepWritesThePreviousOneAndNonFiniteValuesSurvive) {
    const fs::path dir = mf::test::temp_dir("tb_steps");
    mf::train::TensorBoardWriter tb(dir);
    tb.scalar("train/loss", 1, std::nan(""));
    tb.scalar("train/grad_norm", 1, HUGE_VAL);
    tb.scalar("train/loss", 2, 1.5);  // writes step 1, keeps step 2 pending
    std::vector<Event> events = read_events(tb.file());
    ASSERT_EQ(events.size(), 2u);
    ASSERT_EQ(events[1].values.size(), 2u);
    EXPECT_TRUE(std::isnan(events[1].values[0].second));
    EXPECT_TRUE(std::isinf(events[1].values[1].second));
    tb.flush();
    tb.flush();  // nothing pending: no empty event
    events = read_events(tb.file());
    ASSERT_EQ(events.size(), 3u);
    EXPECT_EQ(events[2].step, 2);
    EXPECT_EQ(events[2].values[0].second, 1.5f);
}

TEST(TensorBoard, AKilledRunKeepsWhatItFlushed) {
    const fs::path dir = mf::test::temp_dir("tb_killed");
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        // No destructor runs: the process dies by SIGKILL right after its last flush.
        auto* tb = new mf::train::TensorBoardWriter(dir);
        for (int64_t step = 1; step <= 3; ++step) {
            tb->scalar("train/loss", step, static_cast<double>(step));
            tb->flush();
        }
        tb->scalar("train/loss", 4, 4.0);  // never flushed
        ::kill(::getpid(), SIGKILL);
        ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status));
    const std::vector<Event> events = read_events(only_event_file(dir));
    ASSERT_EQ(events.size(), 4u);
    for (int64_t step = 1; step <= 3; ++step) {
        EXPECT_EQ(events[step].step, step);
        ASSERT_EQ(events[step].values.size(), 1u);
        EXPECT_EQ(events[step].values[0].second, static_cast<float>(step));
    }
}

TEST(TensorBoard, TwoWritersInOneDirectoryNeverShareAFile) {
    const fs::path dir = mf::test::temp_dir("tb_two");
    mf::train::TensorBoardWriter a(dir), b(dir);
    EXPECT_NE(a.file(), b.file());
    a.scalar("x", 1, 1.0);
    b.scalar("x", 1, 2.0);
    a.flush();
    b.flush();
    EXPECT_EQ(read_events(a.file()).back().values[0].second, 1.0f);
    EXPECT_EQ(read_events(b.file()).back().values[0].second, 2.0f);
}

TEST(TensorBoard, LargeStepsAndLongTagsEncode) {
    const fs::path dir = mf::test::temp_dir("tb_large");
    mf::train::TensorBoardWriter tb(dir);
    const std::string tag(300, 't');  // a length needing a two-byte varint
    const int64_t step = (int64_t{1} << 40) + 7;
    tb.scalar(tag, step, -0.25);
    tb.flush();
    const std::vector<Event> events = read_events(tb.file());
    ASSERT_EQ(events.size(), 2u);
    EXPECT_EQ(events[1].step, step);
    EXPECT_EQ(events[1].values[0].first, tag);
    EXPECT_EQ(events[1].values[0].second, -0.25f);
}

TEST(TensorBoard, ErrorsNameTheDirectoryOrFile) {
    const fs::path base = mf::test::temp_dir("tb_errors");
    mf::test::write_file(base / "plain_file", "x");
    try {
        mf::train::TensorBoardWriter tb(base / "plain_file");
        FAIL() << "a file as the TensorBoard directory was accepted";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("plain_file"), std::string::npos) << e.what();
    }
    mf::train::TensorBoardWriter tb(base / "tb");
    try {
        tb.scalar("", 1, 1.0);
        FAIL() << "an empty tag was accepted";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find("tag"), std::string::npos) << e.what();
    }
}
