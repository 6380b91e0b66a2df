// Files: bounded text reads, read-only memory maps, and writes that are all-or-nothing.
//
// Invariants:
//   - Every failure throws mf::Error naming the path and the OS reason (strerror).
//   - A reader never sees a half-written output: atomic_write_file / AtomicFileWriter write a
//     temporary file in the destination's directory, fsync it, rename it over the destination
//     and fsync the directory; AtomicDir does the same for a whole directory. Until commit(),
//     nothing at the destination changes; an object destroyed without commit() removes its
//     temporary file or directory.
//   - MappedFile is read-only (PROT_READ, MAP_PRIVATE). NOTE: if another process truncates a
//     mapped file, touching the lost pages raises SIGBUS; model files must not change while
//     they are open.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace mf::io {

// Reads a whole file. Throws, naming the file, when it is missing, not a regular file,
// unreadable, or larger than max_bytes.
std::string read_text_file(const std::filesystem::path& path, size_t max_bytes);

// A read-only memory map of a whole regular file. An empty file maps to data() == nullptr,
// size() == 0. Movable, not copyable; unmaps on destruction.
class MappedFile {
 public:
    MappedFile() = default;
    explicit MappedFile(const std::filesystem::path& path);
    ~MappedFile();
    MappedFile(MappedFile&& other) noexcept;
    MappedFile& operator=(MappedFile&& other) noexcept;
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;

    const uint8_t* data() const { return data_; }
    size_t size() const { return size_; }
    const std::filesystem::path& path() const { return path_; }

 private:
    void release() noexcept;
    const uint8_t* data_ = nullptr;
    size_t size_ = 0;
    std::filesystem::path path_;
};

// Streams bytes into `path` atomically: the bytes go to a temporary file beside `path`
// ("<name>.tmp-<pid>-<n>"); commit() fsyncs it, renames it onto `path` and fsyncs the directory.
// The destructor removes the temporary file when commit() was never called.
class AtomicFileWriter {
 public:
    explicit AtomicFileWriter(std::filesystem::path path);
    ~AtomicFileWriter();
    AtomicFileWriter(const AtomicFileWriter&) = delete;
    AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

    void write(const void* data, size_t nbytes);
    void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
    void commit();
    const std::filesystem::path& path() const { return path_; }

 private:
    std::filesystem::path path_;
    std::filesystem::path tmp_path_;
    int fd_ = -1;
    bool committed_ = false;
};

// Writes `bytes` to `path` atomically (see AtomicFileWriter).
void atomic_write_file(const std::filesystem::path& path, std::string_view bytes);

// fsyncs a file or directory; throws naming it on failure.
void fsync_path(const std::filesystem::path& path);

// Builds a directory atomically. The constructor creates an empty sibling "<DIR>.tmp-<pid>"
// (removing a stale one left by a crashed run with the same pid, creating DIR's parent if
// needed); the caller writes files into tmp_path(). commit() fsyncs every file and directory
// under it, moves an existing DIR aside to "<DIR>.old-<pid>", renames the temporary directory
// onto DIR, fsyncs the parent and then removes the old copy. So at every instant DIR is either
// the complete old directory, absent (between the two renames), or the complete new one.
// Destroyed without commit(), it removes the temporary directory and leaves DIR untouched.
// `tmp_tag` replaces the pid in the temporary name when several processes fill one directory (the
// ranks of a run writing their checkpoint shards: rank 0 builds and commits, the others only write
// into tmp_path(), which they can name themselves with temp_path_for()).
class AtomicDir {
 public:
    explicit AtomicDir(std::filesystem::path dir, const std::string& tmp_tag = "");
    static std::filesystem::path temp_path_for(const std::filesystem::path& dir, const std::string& tmp_tag);
    ~AtomicDir();
    AtomicDir(const AtomicDir&) = delete;
    AtomicDir& operator=(const AtomicDir&) = delete;

    const std::filesystem::path& tmp_path() const { return tmp_path_; }
    const std::filesystem::path& final_path() const { return dir_; }
    void commit();

 private:
    std::filesystem::path dir_;
    std::filesystem::path tmp_path_;
    bool committed_ = false;
};

}  // namespace mf::io
