// Implementation of io/file.h on POSIX: open/read/write/fsync/rename/mmap. Every system call
// that can fail is checked; errors carry the path and strerror(errno). EINTR is retried.
#include "io/file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <mutex>
#include <set>
#include <system_error>
#include <utility>

#include "core/check.h"
#include "core/json.h"
#include "io/crc32c.h"

namespace mf::io {

namespace fs = std::filesystem;

namespace {

// Every failure of this file is an IoError (file.h); found before mf::fail by unqualified calls here.
template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
    throw IoError(detail::concat(std::forward<Args>(args)...));
}

std::string os_error() { return std::strerror(errno); }

// Closes a file descriptor on scope exit.
class FdGuard {
 public:
    explicit FdGuard(int fd) : fd_(fd) {}
    ~FdGuard() {
        if (fd_ >= 0) ::close(fd_);
    }
    FdGuard(const FdGuard&) = delete;
    FdGuard& operator=(const FdGuard&) = delete;
    int get() const { return fd_; }

 private:
    int fd_;
};

int open_retry(const fs::path& path, int flags, mode_t mode = 0) {
    int fd;
    do {
        fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    } while (fd < 0 && errno == EINTR);
    return fd;
}

void write_all(int fd, const void* data, size_t nbytes, const fs::path& path) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (nbytes > 0) {
        // Linux writes at most ~2 GiB per call; ask for no more than 1 GiB at a time.
        const size_t chunk = nbytes < (size_t{1} << 30) ? nbytes : (size_t{1} << 30);
        const ssize_t n = ::write(fd, p, chunk);
        if (n < 0) {
            if (errno == EINTR) continue;
            fail("cannot write ", path.string(), ": ", os_error());
        }
        p += n;
        nbytes -= static_cast<size_t>(n);
    }
}

void fsync_fd(int fd, const fs::path& path) {
    int rc;
    do {
        rc = ::fsync(fd);
    } while (rc != 0 && errno == EINTR);
    // Some file systems cannot fsync a directory (EINVAL); that is not a failure of ours.
    if (rc != 0 && errno != EINVAL) fail("cannot fsync ", path.string(), ": ", os_error());
}

fs::path parent_or_dot(const fs::path& path) {
    const fs::path parent = path.parent_path();
    return parent.empty() ? fs::path(".") : parent;
}

// "out/" and "out" name the same directory; strip a trailing separator so that filename() works.
fs::path strip_trailing_separator(fs::path path) {
    while (!path.empty() && !path.has_filename() && path.has_parent_path() && path != path.root_path())
        path = path.parent_path();
    return path;
}

std::atomic<uint64_t> g_tmp_counter{0};

// The temporaries open right now, for remove_temporaries(). A path is added before it is created
// and dropped once it is renamed into place or removed.
std::mutex g_temporaries_mutex;
std::set<std::string> g_temporaries;

void add_temporary(const fs::path& path) {
    const std::lock_guard<std::mutex> lock(g_temporaries_mutex);
    g_temporaries.insert(path.string());
}

void drop_temporary(const fs::path& path) {
    const std::lock_guard<std::mutex> lock(g_temporaries_mutex);
    g_temporaries.erase(path.string());
}

void rename_or_fail(const fs::path& from, const fs::path& to) {
    if (::rename(from.c_str(), to.c_str()) != 0)
        fail("cannot rename ", from.string(), " to ", to.string(), ": ", os_error());
}

// fsyncs every regular file and directory under `root` (and root itself).
void fsync_tree(const fs::path& root) {
    std::error_code ec;
    for (fs::recursive_directory_iterator it(root, ec), end; it != end; it.increment(ec)) {
        if (ec) break;
        const fs::file_status st = it->symlink_status(ec);
        if (ec) break;
        if (fs::is_regular_file(st) || fs::is_directory(st)) fsync_path(it->path());
    }
    if (ec) fail("cannot list ", root.string(), ": ", ec.message());
    fsync_path(root);
}

}  // namespace

// --- reading ----------------------------------------------------------------------------------

std::string read_text_file(const fs::path& path, size_t max_bytes) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below); no effect
    // on regular files.
    const int raw_fd = open_retry(path, O_RDONLY | O_NONBLOCK);
    if (raw_fd < 0) fail("cannot open ", path.string(), ": ", os_error());
    FdGuard fd(raw_fd);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) fail("cannot stat ", path.string(), ": ", os_error());
    if (!S_ISREG(st.st_mode)) fail(path.string(), " is not a regular file");
    if (static_cast<uint64_t>(st.st_size) > max_bytes)
        fail(path.string(), " is ", st.st_size, " bytes, larger than the limit of ", max_bytes, " bytes");
    std::string out;
    out.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    // Read until EOF; the file may have changed size since fstat, so stay within max_bytes.
    while (true) {
        if (got == out.size()) {
            if (out.size() > max_bytes) fail(path.string(), " is larger than the limit of ", max_bytes, " bytes");
            out.resize(out.size() + 4096);
        }
        const ssize_t n = ::read(fd.get(), out.data() + got, out.size() - got);
        if (n < 0) {
            if (errno == EINTR) continue;
            fail("cannot read ", path.string(), ": ", os_error());
        }
        if (n == 0) break;
        got += static_cast<size_t>(n);
    }
    out.resize(got);
    if (got > max_bytes) fail(path.string(), " is larger than the limit of ", max_bytes, " bytes");
    return out;
}

MappedFile::MappedFile(const fs::path& path) : path_(path) {
    const int raw_fd = open_retry(path, O_RDONLY | O_NONBLOCK);  // a FIFO must not block (see above)
    if (raw_fd < 0) fail("cannot open ", path.string(), ": ", os_error());
    FdGuard fd(raw_fd);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) fail("cannot stat ", path.string(), ": ", os_error());
    if (!S_ISREG(st.st_mode)) fail(path.string(), " is not a regular file");
    size_ = static_cast<size_t>(st.st_size);
    if (size_ == 0) return;
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (p == MAP_FAILED) {
        size_ = 0;
        fail("cannot map ", path.string(), ": ", os_error());
    }
    data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() { release(); }

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), path_(std::move(other.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
    if (this != &other) {
        release();
        data_ = std::exchange(other.data_, nullptr);
        size_ = std::exchange(other.size_, 0);
        path_ = std::move(other.path_);
    }
    return *this;
}

void MappedFile::release() noexcept {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
    data_ = nullptr;
    size_ = 0;
}

// --- atomic writes ----------------------------------------------------------------------------

void fsync_path(const fs::path& path) {
    const int raw_fd = open_retry(path, O_RDONLY);
    if (raw_fd < 0) fail("cannot open ", path.string(), " to fsync it: ", os_error());
    FdGuard fd(raw_fd);
    fsync_fd(fd.get(), path);
}

AtomicFileWriter::AtomicFileWriter(fs::path path) : path_(std::move(path)) {
    MF_CHECK(path_.has_filename(), "atomic write target '", path_.string(), "' has no file name");
    tmp_path_ = path_;
    tmp_path_ += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(g_tmp_counter.fetch_add(1));
    add_temporary(tmp_path_);
    fd_ = open_retry(tmp_path_, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd_ < 0) {
        drop_temporary(tmp_path_);
        fail("cannot create ", tmp_path_.string(), " (to write ", path_.string(), "): ", os_error());
    }
}

AtomicFileWriter::~AtomicFileWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_path_.c_str());
    drop_temporary(tmp_path_);
}

void AtomicFileWriter::write(const void* data, size_t nbytes) {
    MF_CHECK(fd_ >= 0 && !committed_, "write to ", path_.string(), " after commit");
    write_all(fd_, data, nbytes, tmp_path_);
    crc_ = io::crc32c(crc_, data, nbytes);
}

void AtomicFileWriter::commit() {
    MF_CHECK(fd_ >= 0 && !committed_, "commit of ", path_.string(), " twice");
    fsync_fd(fd_, tmp_path_);
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) fail("cannot close ", tmp_path_.string(), ": ", os_error());
    rename_or_fail(tmp_path_, path_);
    committed_ = true;
    drop_temporary(tmp_path_);
    fsync_path(parent_or_dot(path_));
}

void atomic_write_file(const fs::path& path, std::string_view bytes) {
    AtomicFileWriter writer(path);
    writer.write(bytes);
    writer.commit();
}

// --- atomic directories -----------------------------------------------------------------------

fs::path AtomicDir::temp_path_for(const fs::path& dir, const std::string& tmp_tag) {
    fs::path tmp = strip_trailing_separator(dir);
    tmp += ".tmp-" + (tmp_tag.empty() ? std::to_string(::getpid()) : tmp_tag);
    return tmp;
}

AtomicDir::AtomicDir(fs::path dir, const std::string& tmp_tag) : dir_(strip_trailing_separator(std::move(dir))) {
    MF_CHECK(dir_.has_filename(), "cannot build directory '", dir_.string(), "' atomically: it has no name");
    tmp_path_ = temp_path_for(dir_, tmp_tag);
    add_temporary(tmp_path_);
    std::error_code ec;
    fs::create_directories(parent_or_dot(dir_), ec);
    if (ec) fail("cannot create ", parent_or_dot(dir_).string(), ": ", ec.message());
    fs::remove_all(tmp_path_, ec);
    if (ec) fail("cannot remove stale ", tmp_path_.string(), ": ", ec.message());
    if (!fs::create_directory(tmp_path_, ec) || ec)
        fail("cannot create ", tmp_path_.string(), ": ", ec ? ec.message() : "already exists");
}

AtomicDir::~AtomicDir() {
    if (!committed_) {
        std::error_code ec;
        fs::remove_all(tmp_path_, ec);  // best effort: a destructor must not throw
    }
    drop_temporary(tmp_path_);
}

void AtomicDir::commit() {
    MF_CHECK(!committed_, "commit of ", dir_.string(), " twice");
    fsync_tree(tmp_path_);
    std::error_code ec;
    const fs::file_status old_status = fs::symlink_status(dir_, ec);
    const bool old_exists = fs::exists(old_status);
    fs::path old_path = dir_;
    old_path += ".old-" + std::to_string(::getpid());
    if (old_exists) {
        if (!fs::is_directory(old_status)) fail("cannot replace ", dir_.string(), ": it exists and is not a directory");
        fs::remove_all(old_path, ec);
        if (ec) fail("cannot remove stale ", old_path.string(), ": ", ec.message());
        rename_or_fail(dir_, old_path);
    }
    rename_or_fail(tmp_path_, dir_);
    committed_ = true;
    drop_temporary(tmp_path_);
    fsync_path(parent_or_dot(dir_));
    if (old_exists) {
        fs::remove_all(old_path, ec);
        if (ec)
            fail("replaced ", dir_.string(), " but cannot remove the old copy at ", old_path.string(), ": ",
                 ec.message());
    }
}

// --- staged files -----------------------------------------------------------------------------

namespace {

constexpr size_t kMaxRecordBytes = 1u << 20;

// A name a record may hold: one path component, not hidden, not "." or "..".
bool plain_file_name(const std::string& name) {
    return !name.empty() && name[0] != '.' && name.find('/') == std::string::npos &&
           name.find('\0') == std::string::npos;
}

}  // namespace

StagedFiles::StagedFiles(fs::path dir, std::string record_name)
    : dir_(std::move(dir)), record_name_(std::move(record_name)) {
    std::error_code ec;
    if (!fs::is_directory(dir_, ec)) fail("cannot write into ", dir_.string(), ": not a directory");
    staging_ = dir_ / (kStagingPrefix + std::to_string(::getpid()));
    add_temporary(staging_);
    fs::remove_all(staging_, ec);
    if (ec) fail("cannot remove stale ", staging_.string(), ": ", ec.message());
    if (!fs::create_directory(staging_, ec) || ec)
        fail("cannot create ", staging_.string(), ": ", ec ? ec.message() : "already exists");
}

StagedFiles::~StagedFiles() {
    std::error_code ec;
    fs::remove_all(staging_, ec);  // best effort: a destructor must not throw
    drop_temporary(staging_);
}

std::vector<std::string> StagedFiles::recorded(const fs::path& dir, const std::string& record_name) {
    std::vector<std::string> names;
    try {
        const fs::path file = dir / record_name;
        std::error_code ec;
        if (!fs::is_regular_file(fs::symlink_status(file, ec))) return names;
        const json::Value v = json::parse(read_text_file(file, kMaxRecordBytes), file.string());
        const json::Value* files = v.is_object() ? v.find("files") : nullptr;
        if (files == nullptr || !files->is_array()) return names;
        for (const json::Value& f : files->as_array())
            if (f.is_string() && plain_file_name(f.as_string())) names.push_back(f.as_string());
    } catch (const Error&) {
        names.clear();  // an unreadable record names nothing: nothing is removed on its word
    }
    return names;
}

void StagedFiles::commit(const std::vector<std::string>& last) {
    MF_CHECK(!committed_, "commit of ", staging_.string(), " twice");
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(staging_, ec)) {
        if (!entry.is_regular_file()) fail(entry.path().string(), ": only plain files can be staged");
        names.push_back(entry.path().filename().string());
    }
    if (ec) fail("cannot list ", staging_.string(), ": ", ec.message());
    fsync_tree(staging_);
    // Sorted, with the `last` names (in their order) at the end: e.g. config.json after the weights.
    std::sort(names.begin(), names.end());
    for (const std::string& l : last) {
        const auto it = std::find(names.begin(), names.end(), l);
        if (it != names.end()) std::rotate(it, it + 1, names.end());
    }
    const std::vector<std::string> before = recorded(dir_, record_name_);
    const auto write_record = [&](const std::vector<std::string>& listed) {
        json::Value::Array files;
        for (const std::string& n : listed) files.emplace_back(n);
        json::Value record = json::Value::object();
        record.set("written_by", "moeforge");
        record.set("files", json::Value(std::move(files)));
        atomic_write_file(dir_ / record_name_, record.dump(2) + "\n");
    };
    // The record lists every file this commit or the one before wrote *before* the first rename, so
    // that a process killed at any point leaves no file of ours unlisted (a later export would refuse
    // to touch it); names listed but absent are harmless. The stale files go before the final record.
    std::vector<std::string> both = before;
    for (const std::string& n : names)
        if (std::find(both.begin(), both.end(), n) == both.end()) both.push_back(n);
    write_record(both);
    for (const std::string& n : names) {
        const fs::path dst = dir_ / n;
        if (fs::is_directory(fs::symlink_status(dst, ec)))
            fail("cannot write ", dst.string(), ": a directory of that name is in the way");
        rename_or_fail(staging_ / n, dst);
    }
    fsync_path(dir_);
    for (const std::string& old : before) {
        if (std::find(names.begin(), names.end(), old) != names.end()) continue;
        const fs::path stale = dir_ / old;
        if (fs::is_regular_file(fs::symlink_status(stale, ec))) fs::remove(stale, ec);
    }
    write_record(names);
    fs::remove_all(staging_, ec);
    committed_ = true;
    drop_temporary(staging_);
}

// --- directory lock ---------------------------------------------------------------------------

DirLock::DirLock(const fs::path& dir) : path_(dir / kFileName) {
    // Retry when the file we locked was unlinked by a releasing holder between our open and flock.
    for (int attempt = 0; attempt < 100; ++attempt) {
        const int fd = open_retry(path_, O_RDWR | O_CREAT, 0644);
        if (fd < 0) fail("cannot create the lock file ", path_.string(), ": ", os_error());
        if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
            const int err = errno;
            char buf[256] = {};
            const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
            ::close(fd);
            if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS) {
                // A file system without locks (some network mounts): run unlocked, and say so.
                unlocked_reason_ = std::strerror(err);
                return;
            }
            if (err == EWOULDBLOCK) {
                std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "another process";
                while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
                fail(dir.string(), " is in use by another moeforge run (", holder, ", lock file ", path_.string(),
                     "); wait for it to finish or choose another output directory");
            }
            fail("cannot lock ", path_.string(), ": ", std::strerror(err));
        }
        struct stat held {
        }, named{};
        if (::fstat(fd, &held) != 0 || ::stat(path_.c_str(), &named) != 0 || held.st_ino != named.st_ino ||
            held.st_dev != named.st_dev) {
            ::close(fd);
            continue;
        }
        char buf[256] = {};
        const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
        if (n > 0) {
            stale_holder_.assign(buf, static_cast<size_t>(n));
            while (!stale_holder_.empty() && (stale_holder_.back() == '\n' || stale_holder_.back() == ' '))
                stale_holder_.pop_back();
        }
        char host[256] = {};
        ::gethostname(host, sizeof host - 1);
        const std::string me = "pid " + std::to_string(::getpid()) + " host " + host + " since " +
                               std::to_string(static_cast<long long>(std::time(nullptr))) + "\n";
        if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
            const std::string reason = os_error();
            ::close(fd);
            fail("cannot write the lock file ", path_.string(), ": ", reason);
        }
        fd_ = fd;
        return;
    }
    fail("cannot lock ", path_.string(), ": it keeps being replaced");
}

DirLock::~DirLock() {
    if (fd_ < 0) return;      // never locked (unlocked_reason_), or moved from
    ::unlink(path_.c_str());  // while still held: no one can lock the name we are removing
    ::close(fd_);
}

void remove_temporaries() noexcept {
    std::set<std::string> paths;
    {
        const std::lock_guard<std::mutex> lock(g_temporaries_mutex);
        paths.swap(g_temporaries);
    }
    for (const std::string& p : paths) {
        std::error_code ec;
        fs::remove_all(p, ec);
    }
}

}  // namespace mf::io
