// Line-by-line reading of a dataset file with bounded memory.
//
// A dataset is a regular file, or "-" for standard input. Directories, FIFOs, devices and sockets
// are refused when opened (the file is opened non-blocking and checked with fstat, so a FIFO never
// blocks the open and no race between a check and the open exists). A line is read into a buffer
// that never grows past the cap: the first byte over it stops the read with an error, so
// /dev/zero-like input (through "-") costs at most the cap in memory and that many bytes of time.
// A UTF-8 byte-order mark at the start of the first line is skipped (as Python's utf-8-sig does).
// Line ends are "\n" or "\r\n"; the last line may lack one.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

namespace mf::data {

inline constexpr size_t kMaxLineBytes = size_t{64} << 20;

class LineReader {
 public:
    // Errors (mf::Error) name the file: "FILE: is a directory, expected a JSONL file", "FILE: is not a
    // regular file (...)", "FILE: cannot open dataset: REASON".
    explicit LineReader(const std::filesystem::path& file, size_t max_line_bytes = kMaxLineBytes);
    ~LineReader();
    LineReader(const LineReader&) = delete;
    LineReader& operator=(const LineReader&) = delete;

    // The next line, without its line end; false at the end of the input. A line longer than the
    // cap is an mf::Error "FILE:LINE: line longer than CAP bytes ...", a read error "FILE: read
    // error after line N: REASON".
    bool next(std::string& line);
    int64_t line_no() const { return line_no_; }
    const std::string& name() const { return name_; }

 private:
    bool fill();  // refills buf_; false at end of input
    std::string name_;
    size_t max_line_bytes_;
    std::FILE* file_ = nullptr;
    bool owns_ = false;
    std::string buf_;
    size_t pos_ = 0, end_ = 0;
    int64_t line_no_ = 0;
};

}  // namespace mf::data
