// Shared pieces of the libFuzzer targets: the verdict rule and a per-process scratch directory.
//
// The rule every target enforces: any input either succeeds or throws mf::Error. Anything else is
// a finding, reported by aborting so that libFuzzer saves the input: another exception type
// (std::bad_alloc, std::out_of_range, ...), a violated invariant of an accepted input
// (MF_FUZZ_REQUIRE), and whatever AddressSanitizer / UndefinedBehaviorSanitizer report.
// Targets that read files write the input into ScratchDir: one directory per fuzzing process,
// created on first use under $TMPDIR (or /tmp) and removed at exit.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "core/check.h"

namespace mf::fuzz {

[[noreturn]] inline void finding(const std::string& what) {
    std::fprintf(stderr, "\nFUZZ FINDING: %s\n", what.c_str());
    std::fflush(stderr);
    std::abort();
}

// Runs `body`; mf::Error is an accepted outcome, every other exception is a finding.
template <typename Body>
void run_one(Body&& body) {
    try {
        body();
    } catch (const mf::Error&) {
        // refused with a message: fine
    } catch (const std::exception& e) {
        finding(std::string("exception other than mf::Error: ") + e.what());
    } catch (...) {
        finding("exception of a non-std type");
    }
}

#define MF_FUZZ_REQUIRE(cond, what)                                                                  \
    do {                                                                                             \
        if (!(cond)) ::mf::fuzz::finding(std::string("invariant failed: ") + #cond + ": " + (what)); \
    } while (0)

class ScratchDir {
 public:
    static const std::filesystem::path& get() {
        static ScratchDir dir;
        return dir.path_;
    }
    ~ScratchDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }

 private:
    ScratchDir() {
        const char* base = std::getenv("TMPDIR");
        std::string tmpl = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/moeforge_fuzz_XXXXXX";
        if (::mkdtemp(tmpl.data()) == nullptr) finding("cannot create a scratch directory under " + tmpl);
        path_ = tmpl;
    }
    std::filesystem::path path_;
};

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) finding("cannot write " + path.string());
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
    return {reinterpret_cast<const char*>(data), size};
}

}  // namespace mf::fuzz
