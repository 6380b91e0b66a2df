// Subcommands of the `moeforge` binary. Each takes its arguments (without the subcommand name)
// and returns the process exit code; errors are thrown as mf::Error and printed by main.
#pragma once

#include <string>
#include <vector>

namespace mf::cli {

using Args = std::vector<std::string>;

int cmd_init(const Args& args);
int cmd_info(const Args& args);
int cmd_eval(const Args& args);
int cmd_finetune(const Args& args);
int cmd_tokenize(const Args& args);
int cmd_bench(const Args& args);
int cmd_launch(const Args& args);
int cmd_recipe(const Args& args);
int cmd_generate(const Args& args);
int cmd_plot(const Args& args);

}  // namespace mf::cli
