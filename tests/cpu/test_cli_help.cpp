// The help of the `moeforge` binary against its parsers, through the binary itself (the CLI is not
// part of moeforge_lib):
//   - `moeforge help`, `help SUB`, `SUB --help`, `SUB -h` and `--help` after other arguments all exit 0
//     and print the same entry; `--version` names the version and the backends.
//   - Every option a subcommand's help lists is accepted by its parser: `moeforge SUB --OPT VALUE`
//     does not answer "unknown option".
//   - Every option a subcommand's parser accepts is listed in its help. The candidates are every
//     option-like string literal in src/cli/cmd_*.cpp (the parsers' option sets are literals there);
//     each one not in SUB's help must be answered "unknown option" by `moeforge SUB --CAND VALUE`.
//     The binary decides, so the scan may over-collect freely.
#include <gtest/gtest.h>

#include <cctype>
#include <set>
#include <sstream>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;

// The subcommands the help must cover (issue 20, section 4).
const std::vector<std::string> kSubcommands = {"init",  "info",   "eval", "finetune", "tokenize",
                                               "bench", "launch", "plot", "generate", "recipe"};

struct CliRun {
    int status = -1;
    std::string output;
};

CliRun run(const std::string& args) {
    CliRun r;
    // stdin from /dev/null: a command that reads stdin (tokenize) never waits; `timeout` bounds any probe.
    r.status =
        mf::test::run_command("timeout 120 " + mf::test::moeforge_binary() + " " + args + " </dev/null", &r.output);
    return r;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

// The options of a help text: the lines "  --NAME ..." of its options section.
std::set<std::string> listed_options(const std::string& help) {
    std::set<std::string> names;
    std::istringstream in(help);
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("  --", 0) != 0) continue;
        const size_t end = line.find(' ', 4);
        names.insert(line.substr(4, end == std::string::npos ? std::string::npos : end - 4));
    }
    return names;
}

// An option-like string literal starting at source[at] (a '"'): "name", "--name" or "--name=" with
// name = [a-z][a-z0-9]*(-[a-z0-9]+)*. Returns the name and sets *end past the closing quote, or "".
// (Scanned by hand: std::regex trips GCC 12's maybe-uninitialized warning under the sanitizer build.)
std::string option_literal_at(const std::string& source, size_t at, size_t* end) {
    size_t i = at + 1;
    if (source.compare(i, 2, "--") == 0) i += 2;
    const size_t first = i;
    auto lower = [&](size_t k) { return k < source.size() && source[k] >= 'a' && source[k] <= 'z'; };
    auto lower_or_digit = [&](size_t k) {
        return lower(k) || (k < source.size() && source[k] >= '0' && source[k] <= '9');
    };
    if (!lower(i)) return "";
    while (lower_or_digit(i)) ++i;
    while (i + 1 < source.size() && source[i] == '-' && lower_or_digit(i + 1)) {
        ++i;
        while (lower_or_digit(i)) ++i;
    }
    const size_t last = i;
    if (i < source.size() && source[i] == '=') ++i;
    if (i >= source.size() || source[i] != '"') return "";
    *end = i + 1;
    return source.substr(first, last - first);
}

// Every option-like string literal of the subcommands' sources: "name", "--name" and "--name=".
std::set<std::string> candidate_options() {
    const fs::path cli = fs::path(mf::test::fixtures_dir()).parent_path().parent_path() / "src" / "cli";
    std::set<std::string> names;
    for (const auto& entry : fs::directory_iterator(cli)) {
        const std::string file = entry.path().filename().string();
        if (file.rfind("cmd_", 0) != 0 || entry.path().extension() != ".cpp") continue;
        const std::string source = mf::test::read_file(entry.path());
        for (size_t at = source.find('"'); at != std::string::npos;) {
            size_t end = at + 1;
            const std::string name = option_literal_at(source, at, &end);
            if (!name.empty()) names.insert(name);
            at = source.find('"', name.empty() ? at + 1 : end);
        }
    }
    EXPECT_GT(names.size(), 20u) << "no option literals found under " << cli;
    names.erase("help");
    names.erase("version");
    return names;
}

bool says_unknown_option(const CliRun& r) { return r.output.find("unknown option") != std::string::npos; }

class CliHelp : public ::testing::Test {
 protected:
    fs::path probe_value() { return dir_ / ("probe-" + std::to_string(counter_++)); }
    fs::path dir_ = mf::test::temp_dir("cli_help");
    int counter_ = 0;
};

}  // namespace

TEST_F(CliHelp, TopLevelHelpUsageAndVersion) {
    const CliRun help = run("help");
    ASSERT_EQ(help.status, 0) << help.output;
    for (const std::string& sub : kSubcommands)
        EXPECT_NE(help.output.find("moeforge " + sub + " "), std::string::npos) << sub << " missing in:\n"
                                                                                << help.output;
    EXPECT_EQ(run("--help").output, help.output);
    EXPECT_EQ(run("-h").output, help.output);
    const CliRun bare = run("");
    EXPECT_EQ(bare.status, 2);
    EXPECT_EQ(bare.output, help.output) << "the usage without arguments (on stderr) is the same text";
    const CliRun unknown = run("no-such-command");
    EXPECT_EQ(unknown.status, 2);
    EXPECT_NE(unknown.output.find("unknown command 'no-such-command'"), std::string::npos) << unknown.output;
    EXPECT_EQ(run("help no-such-command").status, 2);

    const CliRun version = run("--version");
    ASSERT_EQ(version.status, 0) << version.output;
    // "moeforge X.Y.Z": three dot-separated numbers after the name.
    ASSERT_EQ(version.output.rfind("moeforge ", 0), 0u) << version.output;
    int dots = 0;
    size_t i = 9;
    for (; i < version.output.size() &&
           (std::isdigit(static_cast<unsigned char>(version.output[i])) || (version.output[i] == '.' && ++dots > 0));
         ++i) {
    }
    EXPECT_TRUE(dots == 2 && i > 13 && std::isdigit(static_cast<unsigned char>(version.output[i - 1])))
        << version.output;
    for (const char* backend : {"CUDA ", "cuDNN ", "NCCL "})
        EXPECT_NE(version.output.find(backend), std::string::npos) << version.output;
    EXPECT_EQ(run("version").output, version.output);
}

TEST_F(CliHelp, EverySubcommandHasHelpEverywhere) {
    for (const std::string& sub : kSubcommands) {
        const CliRun entry = run("help " + sub);
        ASSERT_EQ(entry.status, 0) << sub << ": " << entry.output;
        EXPECT_EQ(entry.output.rfind("usage: moeforge " + sub + " ", 0), 0u) << entry.output;
        EXPECT_FALSE(listed_options(entry.output).empty()) << sub << " lists no options";
        for (const std::string& args : {sub + " --help", sub + " -h", sub + " --no-such-option --help",
                                        sub + " " + quote(probe_value().string()) + " -h"}) {
            const CliRun r = run(args);
            EXPECT_EQ(r.status, 0) << args << ": " << r.output;
            EXPECT_EQ(r.output, entry.output) << args;
        }
    }
    // What follows "--" belongs to the command launch starts: no help there, launch's own parse runs.
    const CliRun r = run("launch --no-such-option x -- finetune --help");
    EXPECT_NE(r.status, 0);
    EXPECT_TRUE(says_unknown_option(r)) << r.output;
}

TEST_F(CliHelp, HelpListsExactlyTheOptionsEachParserAccepts) {
    const std::set<std::string> candidates = candidate_options();
    for (const std::string& sub : kSubcommands) {
        const std::set<std::string> listed = listed_options(run("help " + sub).output);
        // The probes only mean something when the command reports unknown options as such.
        const CliRun sanity = run(sub + " --no-such-option-probe " + quote(probe_value().string()));
        ASSERT_TRUE(says_unknown_option(sanity))
            << sub << " is not dispatched by main.cpp or does not report an unknown option as \"unknown option\": "
            << sanity.output;
        for (const std::string& opt : listed) {
            const CliRun r = run(sub + " --" + opt + " " + quote(probe_value().string()));
            EXPECT_FALSE(says_unknown_option(r))
                << "moeforge help " << sub << " lists --" << opt << ", which its parser refuses: " << r.output;
        }
        for (const std::string& cand : candidates) {
            if (listed.count(cand)) continue;
            const CliRun r = run(sub + " --" + cand + " " + quote(probe_value().string()));
            EXPECT_TRUE(says_unknown_option(r)) << "moeforge " << sub << " accepts --" << cand
                                                << ", which `moeforge help " << sub << "` does not list: " << r.output;
        }
    }
}
