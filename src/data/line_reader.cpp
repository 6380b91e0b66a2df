// Bounded line reader for datasets (see line_reader.h).
#include "data/line_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/check.h"

namespace mf::data {

namespace {

constexpr size_t kChunkBytes = size_t{1} << 16;

const char* file_kind(mode_t mode) {
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "not a regular file";
}

}  // namespace

LineReader::LineReader(const std::filesystem::path& file, size_t max_line_bytes)
    : name_(file.string()), max_line_bytes_(max_line_bytes), buf_(kChunkBytes, '\0') {
    if (name_ == "-") {
        name_ = "<stdin>";
        file_ = stdin;
        return;
    }
    const int fd = ::open(name_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) fail(name_, ": cannot open dataset: ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int err = errno;
        ::close(fd);
        fail(name_, ": cannot open dataset: ", std::strerror(err));
    }
    if (S_ISDIR(st.st_mode)) {
        ::close(fd);
        fail(name_, ": is a directory, expected a JSONL file");
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        fail(name_, ": is ", file_kind(st.st_mode),
             ", expected a regular JSONL file (give '-' to read standard input)");
    }
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    file_ = ::fdopen(fd, "rb");
    if (file_ == nullptr) {
        const int err = errno;
        ::close(fd);
        fail(name_, ": cannot open dataset: ", std::strerror(err));
    }
    owns_ = true;
}

LineReader::~LineReader() {
    if (owns_) std::fclose(file_);
}

bool LineReader::fill() {
    end_ = std::fread(buf_.data(), 1, buf_.size(), file_);
    pos_ = 0;
    if (end_ == 0 && std::ferror(file_)) fail(name_, ": read error after line ", line_no_, ": ", std::strerror(errno));
    return end_ > 0;
}

bool LineReader::next(std::string& line) {
    line.clear();
    bool any = false;
    while (true) {
        if (pos_ == end_ && !fill()) break;
        any = true;
        const char* start = buf_.data() + pos_;
        const void* nl = std::memchr(start, '\n', end_ - pos_);
        const size_t take = nl ? static_cast<size_t>(static_cast<const char*>(nl) - start) : end_ - pos_;
        if (line.size() + take > max_line_bytes_ + 1)  // + 1: a '\r' of "\r\n" may end a line at the cap
            fail(name_, ":", line_no_ + 1, ": line longer than ", max_line_bytes_,
                 " bytes (a JSONL record per line is expected; is this a binary file?)");
        line.append(start, take);
        pos_ += take;
        if (nl) {
            ++pos_;
            break;
        }
    }
    if (!any) return false;
    ++line_no_;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.size() > max_line_bytes_)
        fail(name_, ":", line_no_, ": line longer than ", max_line_bytes_,
             " bytes (a JSONL record per line is expected; is this a binary file?)");
    if (line_no_ == 1 && line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);
    return true;
}

}  // namespace mf::data
