// Files: bounded text reads, read-only memory maps, and writes that are all-or-nothing.
//
// Invariants:
//   - Every failure throws io::IoError (an mf::Error) naming the path and the OS reason (strerror).
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
#include <vector>

#include "core/check.h"

namespace mf::io {

// What every failure here throws: an mf::Error (callers that catch Error see it), typed so that the
// C API can report it as an I/O error.
class IoError : public Error {
 public:
    using Error::Error;
};

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
    // CRC-32C (io/crc32c.h) of every byte written so far: the file's checksum once committed.
    uint32_t crc32c() const { return crc_; }

 private:
    std::filesystem::path path_;
    std::filesystem::path tmp_path_;
    int fd_ = -1;
    bool committed_ = false;
    uint32_t crc_ = 0;
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

// Writes a set of files into an existing directory and touches nothing else in it. The files are
// written into a staging directory inside it (DIR/.moeforge-staging-<pid>, so every rename stays on
// one file system); commit() fsyncs them, renames each onto DIR/<name> (atomic per file: a reader
// sees the old file or the new one, never a mix of bytes) with the names in `last` moved last,
// removes the files an earlier record listed that this set lacks (what an earlier commit wrote, e.g.
// the shards of a model that was sharded differently), and records the set in DIR/<record_name>.
// Before the first rename the record already lists this set and the earlier one, so a commit cut
// short at any point (a kill, a failed rename) leaves every file it or an earlier commit wrote listed.
// A file that neither record names is never removed. Destroyed without commit(), it removes the
// staging directory and leaves DIR as it was. Only plain files, no subdirectories.
class StagedFiles {
 public:
    StagedFiles(std::filesystem::path dir, std::string record_name);
    ~StagedFiles();
    StagedFiles(const StagedFiles&) = delete;
    StagedFiles& operator=(const StagedFiles&) = delete;

    const std::filesystem::path& staging() const { return staging_; }
    void commit(const std::vector<std::string>& last = {});
    // The staging directory's name is this prefix and the writer's pid.
    static constexpr const char* kStagingPrefix = ".moeforge-staging-";

    // The file names the record in `dir` lists (empty when there is none, or it is unreadable).
    static std::vector<std::string> recorded(const std::filesystem::path& dir, const std::string& record_name);

 private:
    std::filesystem::path dir_;
    std::string record_name_;
    std::filesystem::path staging_;
    bool committed_ = false;
};

// An exclusive lock on a directory for the lifetime of the object: the file DIR/.moeforge.lock,
// flock()ed and holding "pid <p> host <h> since <unix time>". A second DirLock on the same
// directory (from any process) fails at once, naming the holder. A lock file whose process died is
// free (the kernel dropped its flock): it is taken over and stale_holder() says whose it was, so the
// caller can warn. The file is removed on release. NOTE: flock needs a local or lock-aware network
// file system; where locking is unsupported the object holds nothing and unlocked_reason() says why.
class DirLock {
 public:
    explicit DirLock(const std::filesystem::path& dir);
    ~DirLock();
    DirLock(const DirLock&) = delete;
    DirLock& operator=(const DirLock&) = delete;

    const std::string& stale_holder() const { return stale_holder_; }
    // Non-empty when the file system cannot lock at all (ENOLCK, EOPNOTSUPP): the run goes on
    // unlocked and the caller warns with this reason.
    const std::string& unlocked_reason() const { return unlocked_reason_; }
    static constexpr const char* kFileName = ".moeforge.lock";

 private:
    std::filesystem::path path_;
    int fd_ = -1;
    std::string stale_holder_;
    std::string unlocked_reason_;
};

// Removes every temporary file and directory this process's atomic writers (AtomicFileWriter,
// AtomicDir, StagedFiles) have open right now. For an exit that cannot unwind (a second
// interruption signal, core/interrupt.h); never throws.
void remove_temporaries() noexcept;

}  // namespace mf::io
