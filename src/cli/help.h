// The help of the `moeforge` binary: one table, one entry per subcommand (synopsis, description,
// every option with its meaning). `moeforge help`, `moeforge help SUBCOMMAND`,
// `moeforge SUBCOMMAND --help` and the top-level usage are all printed from it, and
// tests/cpu/test_cli_help.cpp checks, against the binary, that every option a subcommand's parser
// accepts is listed here and that every option listed here is accepted.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "cli/commands.h"

namespace mf::cli {

struct OptionHelp {
    const char* name;     // without the leading "--", e.g. "micro-batch"
    const char* value;    // the value's placeholder ("N", "DIR", "[DIR|auto]"), or "" for a flag
    const char* meaning;  // one line: what it does and its default
};

struct CommandHelp {
    const char* name;      // the subcommand, e.g. "eval"
    const char* synopsis;  // after "moeforge NAME": positionals and the main options
    const char* summary;   // one line for the top-level usage
    const char* details;   // a paragraph or two for `moeforge help NAME` ("" for none)
    std::vector<OptionHelp> options;
};

// Every subcommand, in the order of the top-level usage.
const std::vector<CommandHelp>& command_table();

// The entry of a subcommand, or nullptr when there is none.
const CommandHelp* find_command(std::string_view name);

// The top-level usage (every subcommand's synopsis and summary) and one subcommand's full help.
std::string usage_text();
std::string command_help_text(const CommandHelp& command);

// "moeforge X.Y.Z (commit C)" and the compiled-in backends (CUDA, cuDNN, NCCL).
std::string version_text();

// True when `args` ask for help: "--help" or "-h" before any "--" (what follows "--" belongs to
// the command `launch` starts).
bool wants_help(const Args& args);

}  // namespace mf::cli
