// Helpers shared by the tests: temporary directories, file writing, running the CLI, GPU skip, the
// token batch of an HF parity fixture.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/json.h"
#include "core/tensor.h"
#include "data/batch.h"
#include "io/file.h"

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

// The batch of an HF parity fixture (fixtures/hf/<case>/batch.json, written by
// scripts/make_hf_fixtures.py: {"input_ids": [[...]], "labels": [[...]]}), one document per row with
// HF's label shift (data::make_row_batch), T = the length of the first row.
inline data::Batch load_fixture_batch(const std::filesystem::path& dir) {
    const json::Value b = json::parse(io::read_text_file(dir / "batch.json", 1 << 20), "batch.json");
    std::vector<std::vector<int32_t>> ids, labels;
    for (const auto& row : b.find("input_ids")->as_array()) {
        ids.emplace_back();
        for (const auto& v : row.as_array()) ids.back().push_back(static_cast<int32_t>(v.as_int()));
    }
    for (const auto& row : b.find("labels")->as_array()) {
        labels.emplace_back();
        for (const auto& v : row.as_array()) labels.back().push_back(static_cast<int32_t>(v.as_int()));
    }
    return data::make_row_batch(ids, labels, static_cast<int64_t>(ids[0].size()), 0);
}
inline std::string moeforge_binary() { return MF_BINARY; }

// Skips the whole binary (exit 77: ctest reports it as skipped) where no CUDA device exists.
inline void require_gpu() {
    if (!cuda_available()) {
        std::printf("SKIPPED: no CUDA device on this machine; GPU tests need one (run on the GPU machine)\n");
        std::exit(77);
    }
}

}  // namespace mf::test
