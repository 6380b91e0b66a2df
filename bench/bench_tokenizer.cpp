// Tokenizer encoding speed on one core, in MB/s of UTF-8 input, over mixed-language documents.
//
// The documents are built deterministically from bench/tokenizer_bench_text.txt (English, Arabic,
// Kazakh, Russian, Chinese, Japanese, Korean, Greek, Vietnamese, German, French, code, JSON,
// emoji, whitespace runs): each document is 1-6 random lines, each followed by a random number,
// drawn by a 64-bit LCG. bench/bench_tokenizer_hf.py builds the same documents for HF `tokenizers`.
// The first pass runs with an empty word cache ("cold"); the reported figure is the median of the
// following passes, in wall time (mb_per_s) and in this thread's CPU time (cpu_mb_per_s, steadier on
// a shared machine). Output: one JSON line.
//
//   bench_tokenizer [--tokenizer DIR] [--mb N] [--reps N] [--text FILE]
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/json.h"
#include "text/tokenizer.h"

namespace {

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) mf::fail(path, ": cannot open");
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// The same generator as bench_tokenizer_hf.py: keep the two in step.
std::vector<std::string> make_documents(const std::string& seed_text, size_t target_bytes) {
    std::vector<std::string> lines;
    std::istringstream in(seed_text);
    std::string line;
    while (std::getline(in, line))
        if (!line.empty()) lines.push_back(line);
    if (lines.empty()) mf::fail("bench text has no lines");
    uint64_t x = 0x9E3779B97F4A7C15ull;
    auto next = [&x] {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        return x;
    };
    std::vector<std::string> docs;
    size_t total = 0;
    while (total < target_bytes) {
        std::string doc;
        const uint64_t num_lines = 1 + (next() >> 33) % 6;
        for (uint64_t i = 0; i < num_lines; ++i) {
            doc += lines[(next() >> 33) % lines.size()];
            doc += ' ';
            doc += std::to_string((next() >> 40) % 100000);
            doc += '\n';
        }
        total += doc.size();
        docs.push_back(std::move(doc));
    }
    return docs;
}

// CPU time of this thread: on a shared machine it moves less than wall time.
double thread_cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

int main(int argc, char** argv) {
    std::string tokenizer_dir = std::string(MF_SOURCE_DIR) + "/tests/fixtures/tokenizer";
    std::string text_path = std::string(MF_SOURCE_DIR) + "/bench/tokenizer_bench_text.txt";
    double mb = 8;
    int reps = 5;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) mf::fail("option ", a, " needs a value");
            return argv[++i];
        };
        if (a == "--tokenizer")
            tokenizer_dir = value();
        else if (a == "--text")
            text_path = value();
        else if (a == "--mb")
            mb = std::stod(value());
        else if (a == "--reps")
            reps = std::max(1, std::stoi(value()));
        else {
            std::fprintf(stderr, "usage: bench_tokenizer [--tokenizer DIR] [--mb N] [--reps N] [--text FILE]\n");
            return 2;
        }
    }
    try {
        const auto docs = make_documents(read_file(text_path), static_cast<size_t>(mb * 1e6));
        size_t bytes = 0;
        for (const auto& d : docs) bytes += d.size();
        const mf::text::Tokenizer tok = mf::text::Tokenizer::load(tokenizer_dir);

        using Clock = std::chrono::steady_clock;
        size_t tokens = 0;
        std::vector<double> seconds, cpu_seconds;
        for (int r = 0; r <= reps; ++r) {  // pass 0 is the cold one
            size_t n = 0;
            const auto t0 = Clock::now();
            const double c0 = thread_cpu_seconds();
            for (const auto& d : docs) n += tok.encode(d).size();
            cpu_seconds.push_back(thread_cpu_seconds() - c0);
            seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
            tokens = n;
        }
        auto median_of_warm = [](std::vector<double> v) {
            v.erase(v.begin());
            std::sort(v.begin(), v.end());
            return v[v.size() / 2];
        };
        const double cold = seconds[0];
        const double median = median_of_warm(seconds), cpu_median = median_of_warm(cpu_seconds);
        std::printf(
            "{\"bench\": \"tokenizer_encode\", \"impl\": \"moeforge\", \"tokenizer\": %s, \"vocab_size\": %zu, "
            "\"documents\": %zu, \"bytes\": %zu, \"tokens\": %zu, \"reps\": %d, \"median_s\": %.4f, "
            "\"mb_per_s\": %.2f, \"cpu_mb_per_s\": %.2f, \"cold_mb_per_s\": %.2f, \"tokens_per_s\": %.0f, "
            "\"threads\": 1}\n",
            mf::json::quote(tokenizer_dir).c_str(), tok.vocab_size(), docs.size(), bytes, tokens, reps, median,
            bytes / 1e6 / median, bytes / 1e6 / cpu_median, bytes / 1e6 / cold, tokens / median);
    } catch (const mf::Error& e) {
        std::fprintf(stderr, "bench_tokenizer: error: %s\n", e.what());
        return 1;
    }
    return 0;
}
