// Helpers shared by the tests: temporary directories, file writing, running the CLI, GPU skip.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "core/tensor.h"

namespace mf::test {

inline std::filesystem::path temp_dir(const std::string& name) {
    const char* base = std::getenv("TMPDIR");
    std::filesystem::path dir = std::filesystem::path(base != nullptr ? base : "/tmp") /
                                ("moeforge_test_" + name + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    return dir;
}

inline void write_file(const std::filesystem::path& path, const std::string& content) {
    std::ofstream out(path, std::ios::binary);
    out << content;
}

inline std::string read_file(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs a shell command, returns its exit status and captures stdout+stderr into `output`.
inline int run_command(const std::string& cmd, std::string* output) {
    FILE* pipe = ::popen((cmd + " 2>&1").c_str(), "r");
    if (pipe == nullptr) return -1;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0)
        if (output != nullptr) output->append(buf, n);
    const int status = ::pclose(pipe);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline std::string fixtures_dir() { return MF_FIXTURES_DIR; }
inline std::string moeforge_binary() { return MF_BINARY; }

// Skips the whole binary (exit 77: ctest reports it as skipped) where no CUDA device exists.
inline void require_gpu() {
    if (!cuda_available()) {
        std::printf("SKIPPED: no CUDA device on this machine; GPU tests need one (run on the GPU machine)\n");
        std::exit(77);
    }
}

}  // namespace mf::test
