// moeforge: fine-tune Hugging Face Mixture-of-Experts checkpoints.
#include <cstdio>
#include <cstring>
#include <exception>

#include "cli/commands.h"
#include "core/check.h"

namespace {

constexpr const char* kUsage =
    "usage: moeforge <command> [options]\n"
    "\n"
    "commands:\n"
    "  init      --arch qwen3_moe --preset tiny --seed S --out DIR   random-initialised HF model directory\n"
    "  info      DIR                                                parameters, FLOPs per token, layer plan\n"
    "            [--world W --ep-size E --device cuda|cpu --precision bf16|mixed --no-zero1]  (memory per rank)\n"
    "  eval      --model DIR --data FILE [--json]                   loss of a dataset as one batch\n"
    "  finetune  RECIPE.yaml [key.sub=value ...]                    train and write an HF directory\n"
    "  tokenize  --tokenizer DIR [--json | --decode]                encode stdin (or decode a JSON id array)\n"
    "  bench     --config CONFIG.json [--layers N --micro-batch B --seq-len T --steps S --profile]\n"
    "            [--ep-size N --ep-chunks C --no-zero1]  (under moeforge launch: EP/DP over the ranks)\n"
    "                                                               time the training step on synthetic data\n"
    "  launch    --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] -- COMMAND ...\n";

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2 || std::strcmp(argv[1], "-h") == 0 || std::strcmp(argv[1], "--help") == 0) {
        std::fputs(kUsage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const std::string command = argv[1];
    const mf::cli::Args args(argv + 2, argv + argc);
    try {
        if (command == "init") return mf::cli::cmd_init(args);
        if (command == "info") return mf::cli::cmd_info(args);
        if (command == "eval") return mf::cli::cmd_eval(args);
        if (command == "finetune") return mf::cli::cmd_finetune(args);
        if (command == "tokenize") return mf::cli::cmd_tokenize(args);
        if (command == "bench") return mf::cli::cmd_bench(args);
        if (command == "launch") return mf::cli::cmd_launch(args);
        std::fprintf(stderr, "moeforge: unknown command '%s'\n\n%s", command.c_str(), kUsage);
        return 2;
    } catch (const mf::Error& e) {
        std::fprintf(stderr, "moeforge %s: error: %s\n", command.c_str(), e.what());
        return 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "moeforge %s: internal error: %s\n", command.c_str(), e.what());
        return 1;
    }
}
