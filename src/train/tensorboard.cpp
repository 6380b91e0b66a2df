// TensorBoard event files (see tensorboard.h): TFRecord framing and the few Event/Summary protobuf
// fields a scalar needs, encoded by hand.
#include "train/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "core/check.h"
#include "io/crc32c.h"

namespace mf::train {

namespace {

// --- protobuf wire format (https://protobuf.dev/programming-guides/encoding/) -------------------
// A field is a varint key (field_number << 3 | wire_type) and a payload: wire type 0 a varint,
// 1 eight little-endian bytes, 2 a varint length and that many bytes, 5 four little-endian bytes.
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
    while (v >= 0x80) {
        out += static_cast<char>((v & 0x7F) | 0x80);
        v >>= 7;
    }
    out += static_cast<char>(v);
}

void put_key(std::string& out, uint32_t field, WireType type) { put_varint(out, (uint64_t{field} << 3) | type); }

void put_le(std::string& out, uint64_t v, int nbytes) {
    for (int k = 0; k < nbytes; ++k) out += static_cast<char>((v >> (8 * k)) & 0xFF);
}

void put_double(std::string& out, uint32_t field, double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    put_key(out, field, kFixed64);
    put_le(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    put_key(out, field, kFixed32);
    put_le(out, bits, 4);
}

void put_int64(std::string& out, uint32_t field, int64_t v) {
    put_key(out, field, kVarint);
    put_varint(out, static_cast<uint64_t>(v));  // int64: two's complement, ten bytes when negative
}

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
    put_key(out, field, kLengthDelimited);
    put_varint(out, bytes.size());
    out += bytes;
}

// Field numbers of event.proto and summary.proto.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
constexpr uint32_t kSummaryValue = 1;
constexpr uint32_t kValueTag = 1, kValueSimpleValue = 2;

// --- TFRecord framing --------------------------------------------------------------------------

uint32_t masked_crc32c(const void* data, size_t nbytes) {
    const uint32_t crc = io::crc32c(0, data, nbytes);
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& data) {
    std::string length;
    put_le(length, data.size(), 8);
    std::string out = length;
    put_le(out, masked_crc32c(length.data(), length.size()), 4);
    out += data;
    put_le(out, masked_crc32c(data.data(), data.size()), 4);
    return out;
}

double unix_time_now() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string hostname() {
    char name[256] = {};
    if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
    std::string out = name;
    for (char& c : out)
        if (c == '/') c = '_';
    return out;
}

std::atomic<int> g_file_counter{0};

// Creates a new event file in `dir` (never an existing one) and returns its descriptor.
int create_event_file(const std::filesystem::path& dir, std::filesystem::path& file) {
    const long long seconds = static_cast<long long>(unix_time_now());
    const std::string host = hostname();
    for (int attempt = 0; attempt < 1000; ++attempt) {
        char name[512];
        std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s.%d.%d", seconds, host.c_str(),
                      static_cast<int>(::getpid()), g_file_counter.fetch_add(1));
        file = dir / name;
        const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd >= 0) return fd;
        if (errno != EEXIST) fail(file.string(), ": cannot create the TensorBoard event file: ", std::strerror(errno));
    }
    fail(dir.string(), ": cannot find a free TensorBoard event file name");
}

}  // namespace

// --- TensorBoardWriter -------------------------------------------------------------------------

TensorBoardWriter::TensorBoardWriter(const std::filesystem::path& dir) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec || !std::filesystem::is_directory(dir))
        fail(dir.string(), ": cannot create the TensorBoard directory",
             ec ? ": " + ec.message() : std::string(" (it exists and is not a directory)"));
    fd_ = create_event_file(dir, file_);
    std::string first;
    put_double(first, kEventWallTime, unix_time_now());
    put_bytes(first, kEventFileVersion, "brain.Event:2");
    write_event(first);
}

TensorBoardWriter::~TensorBoardWriter() {
    try {
        write_pending();
    } catch (const Error& e) {
        std::fprintf(stderr, "warning: %s\n", e.what());
    }
    if (fd_ >= 0) {
        (void)::fsync(fd_);
        ::close(fd_);
    }
}

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value) {
    if (tag.empty()) fail(file_.string(), ": a TensorBoard scalar needs a non-empty tag");
    if (has_pending_ && step != pending_step_) write_pending();
    std::string v;
    put_bytes(v, kValueTag, tag);
    put_float(v, kValueSimpleValue, static_cast<float>(value));
    put_bytes(pending_values_, kSummaryValue, v);
    pending_step_ = step;
    has_pending_ = true;
}

void TensorBoardWriter::flush() { write_pending(); }

void TensorBoardWriter::write_pending() {
    if (!has_pending_) return;
    std::string event;
    put_double(event, kEventWallTime, unix_time_now());
    put_int64(event, kEventStep, pending_step_);
    put_bytes(event, kEventSummary, pending_values_);
    has_pending_ = false;
    pending_values_.clear();
    write_event(event);
}

void TensorBoardWriter::write_event(const std::string& event) {
    const std::string record = tfrecord(event);
    size_t done = 0;
    while (done < record.size()) {
        const ssize_t n = ::write(fd_, record.data() + done, record.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail(file_.string(), ": cannot write the TensorBoard event file: ", std::strerror(errno));
        done += static_cast<size_t>(n);
    }
}

}  // namespace mf::train
