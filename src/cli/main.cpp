// moeforge: fine-tune Hugging Face Mixture-of-Experts checkpoints.
//
// Dispatches to the subcommands of cli/commands.h. Help comes from the one table of cli/help.cpp:
// `moeforge help [COMMAND]`, and `--help`/`-h` anywhere in a subcommand's arguments (before a
// "--"), which prints that entry and runs nothing.
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>

#include "cli/commands.h"
#include "cli/help.h"
#include "core/check.h"

namespace {

int run_command(const std::string& command, const mf::cli::Args& args) {
    if (command == "init") return mf::cli::cmd_init(args);
    if (command == "info") return mf::cli::cmd_info(args);
    if (command == "eval") return mf::cli::cmd_eval(args);
    if (command == "finetune") return mf::cli::cmd_finetune(args);
    if (command == "tokenize") return mf::cli::cmd_tokenize(args);
    if (command == "bench") return mf::cli::cmd_bench(args);
    if (command == "launch") return mf::cli::cmd_launch(args);
    if (command == "generate") return mf::cli::cmd_generate(args);
    if (command == "recipe") return mf::cli::cmd_recipe(args);
    if (command == "plot") return mf::cli::cmd_plot(args);
    std::fprintf(stderr, "moeforge: unknown command '%s'\n\n%s", command.c_str(), mf::cli::usage_text().c_str());
    return 2;
}

// `moeforge help [COMMAND]`.
int print_help(const mf::cli::Args& args) {
    if (args.empty()) {
        std::fputs(mf::cli::usage_text().c_str(), stdout);
        return 0;
    }
    const mf::cli::CommandHelp* entry = mf::cli::find_command(args[0]);
    if (entry == nullptr) {
        std::fprintf(stderr, "moeforge help: unknown command '%s'\n\n%s", args[0].c_str(),
                     mf::cli::usage_text().c_str());
        return 2;
    }
    std::fputs(mf::cli::command_help_text(*entry).c_str(), stdout);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    // Lines reach a redirected stdout as they are written: a killed run keeps its log.
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    if (argc < 2) {
        std::fputs(mf::cli::usage_text().c_str(), stderr);
        return 2;
    }
    const std::string command = argv[1];
    const mf::cli::Args args(argv + 2, argv + argc);
    if (command == "-h" || command == "--help") return print_help({});
    if (command == "help") return print_help(args);
    if (command == "--version" || command == "version") {
        std::fputs(mf::cli::version_text().c_str(), stdout);
        return 0;
    }
    if (const mf::cli::CommandHelp* entry = mf::cli::find_command(command);
        entry != nullptr && mf::cli::wants_help(args)) {
        std::fputs(mf::cli::command_help_text(*entry).c_str(), stdout);
        return 0;
    }
    try {
        return run_command(command, args);
    } catch (const mf::Error& e) {
        std::fprintf(stderr, "moeforge %s: error: %s\n", command.c_str(), e.what());
        return 1;
    } catch (const std::filesystem::filesystem_error& e) {
        // A path the user gave that the file system refused: name it and the reason.
        std::fprintf(stderr, "moeforge %s: error: %s: %s\n", command.c_str(), e.path1().string().c_str(),
                     e.code().message().c_str());
        return 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "moeforge %s: internal error: %s\n", command.c_str(), e.what());
        return 1;
    }
}
