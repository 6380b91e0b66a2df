// The help table of the `moeforge` binary (see help.h) and the texts printed from it.
#include "cli/help.h"

#include <algorithm>
#include <cstdio>

// The build may name the version and the commit (compile definitions of the moeforge target);
// without them the version is the one below and the commit is not printed.
#ifndef MOEFORGE_VERSION
#define MOEFORGE_VERSION "0.1.0"
#endif

namespace mf::cli {

namespace {

// NOTE: every option a subcommand's parser accepts must be listed here (test_cli_help checks it
// against the binary); the value placeholder is "" exactly for flags.
std::vector<CommandHelp> make_table() {
    return {
        {"init",
         "--out DIR [--arch MODEL_TYPE] [--preset tiny | --config CONFIG.json] [--seed S] [--tokenizer DIR]",
         "write a randomly initialised HF model directory",
         "Writes config.json, model.safetensors and generation_config.json (and the tokenizer's files with\n"
         "--tokenizer) into DIR, replacing only those files.",
         {{"out", "DIR", "the model directory to write (required)"},
          {"arch", "NAME", "architecture (model_type): qwen3_moe (default), mixtral, olmoe or qwen2_moe"},
          {"preset", "NAME", "built-in size when no --config is given; default tiny"},
          {"config", "FILE", "an HF config.json to take the sizes from instead of a preset"},
          {"seed", "S", "seed of the random initialisation; default 0"},
          {"vocab-size", "N", "override the vocabulary size (must cover the tokenizer's ids)"},
          {"init-std", "X", "standard deviation of the normal initialisation; default 0.02"},
          {"tokenizer", "DIR", "copy this HF tokenizer (tokenizer.json, tokenizer_config.json) into DIR"}}},
        {"info",
         "DIR [--seq-len T] [--world W --ep-size E --device cuda|cpu --precision bf16|mixed --no-zero1] [--json]",
         "parameters, FLOPs per token, memory per rank, layer plan of a model",
         "Reads DIR/config.json only (no weights). The memory per rank is what the trainer holds for\n"
         "parameters, gradients and AdamW state at the given world and EP size, before activations.",
         {{"seq-len", "T", "sequence length for the FLOPs per token; default 4096"},
          {"world", "W", "number of ranks for the memory estimate; default 1"},
          {"ep-size", "E", "expert-parallel group size for the memory estimate; default 1"},
          {"device", "cuda|cpu", "device of the memory estimate (sets the storage dtype); default cuda"},
          {"precision", "bf16|mixed", "storage policy of the memory estimate; default bf16"},
          {"no-zero1", "", "estimate without ZeRO-1 (every rank holds the whole AdamW state)"},
          {"json", "", "print one JSON object instead of text"}}},
        {"eval",
         "--model DIR --data FILE [--micro-batch N --seq-len T --no-packing --device auto|cpu|cuda --format F] "
         "[--json]",
         "per-token loss of a model on a dataset",
         "Streams FILE (JSONL, the formats of finetune's data) in micro-batches packed as in training and\n"
         "reports the loss per target token over the whole file, in bounded memory.",
         {{"model", "DIR", "HF model directory (required)"},
          {"data", "FILE", "JSONL dataset, or - for standard input (required)"},
          {"micro-batch", "N", "rows per forward pass; default 8"},
          {"seq-len", "T", "tokens per row; default 2048"},
          {"no-packing", "", "one document per row (truncated to --seq-len) instead of packing documents into rows"},
          {"device", "auto|cpu|cuda", "where to run; default auto (the GPU when there is one)"},
          {"format", "F", "record format: auto, tokens, messages, prompt_completion or text; default auto"},
          {"json", "", "print one JSON object (loss, ce_loss, aux_loss, tokens) instead of text"}}},
        {"finetune",
         "RECIPE.yaml [key.sub=value ...] [--resume [DIR|auto]] [--force-resume]",
         "train a model from a recipe and write an HF model directory",
         "Reads the recipe (`moeforge recipe --explain` lists its keys), applies the key=value overrides,\n"
         "trains, and writes the model, metrics.jsonl and recipe.json into the recipe's `out` directory,\n"
         "touching no other file there; `out` is checked and locked before step 1.\n"
         "SIGINT/SIGTERM: the step finishes, a checkpoint is saved, exit 130/143 (--resume continues);\n"
         "a second signal, a second or more later, stops at once.",
         {{"resume", "[DIR|auto]",
           "continue from a training checkpoint: DIR, or auto (the default) for the newest under OUT/checkpoints; "
           "an error when there is none"},
          {"force-resume", "", "resume even when the recipe changed in a way that matters for the checkpoint"}}},
        {"tokenize",
         "--tokenizer DIR [--json] [--special] | --tokenizer DIR --decode [--skip-special] | --tokenizer DIR --chat "
         "[--json]",
         "encode standard input with an HF tokenizer, decode a JSON id array, or render a chat",
         "Encoding: all of stdin (UTF-8) is one text; prints its ids, space-separated or as a JSON array.\n"
         "Decoding: stdin is a JSON array of ids; prints the text.\n"
         "Chat: stdin is {\"messages\": [...], \"tools\"?, \"add_generation_prompt\"?}; prints what DIR's chat\n"
         "template renders (as apply_chat_template); with --json {\"text\", \"ids\", \"assistant_mask\"}.",
         {{"tokenizer", "DIR", "directory holding tokenizer.json (required)"},
          {"json", "", "print the ids as a JSON array"},
          {"special", "", "parse special tokens written in the text (e.g. <|im_start|>) as their ids"},
          {"decode", "", "decode a JSON array of ids from stdin instead of encoding"},
          {"skip-special", "", "with --decode: leave special tokens out of the text"},
          {"chat", "", "render the conversation on stdin with the tokenizer's chat template (Jinja)"}}},
        {"bench",
         "--config CONFIG.json [--layers N --micro-batch B --seq-len T --steps S --warmup W --device cuda|cpu] "
         "[--ep-size N --ep-chunks C --no-zero1 --profile --phases]",
         "time the training step on synthetic data",
         "Builds a model from CONFIG.json with random weights and times the full training step (forward,\n"
         "backward, clipping, AdamW). Under `moeforge launch` every rank runs with EP/DP over the ranks.",
         {{"config", "FILE", "HF config.json of the model (required)"},
          {"layers", "N", "override the number of layers (all MoE)"},
          {"micro-batch", "B", "rows per step; default 2"},
          {"seq-len", "T", "tokens per row; default 4096"},
          {"steps", "S", "timed steps; default 5"},
          {"warmup", "W", "untimed steps first; default 2"},
          {"precision", "bf16|mixed", "storage policy; default bf16"},
          {"device", "auto|cuda|cpu",
           "where to run; default auto (the GPU; without one bench refuses: pass --device cpu to time the CPU)"},
          {"seed", "S", "seed of the random weights; default 0"},
          {"recompute", "none|moe|full", "activation recomputation; default none"},
          {"ep-size", "N", "expert-parallel group size under launch; default 1"},
          {"ep-chunks", "C", "pipeline the EP exchange in C chunks (1..64); default 1"},
          {"timeout", "SECONDS", "timeout of the distributed rendezvous and collectives; default 300"},
          {"profile", "", "print the time per op of the timed steps"},
          {"phases", "", "synchronise each timed step and print the time per phase"},
          {"no-zero1", "", "keep the whole AdamW state on every rank"}}},
        {"launch",
         "--nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] [--program PATH] "
         "-- SUBCOMMAND ARGS...",
         "start one process per GPU (or CPU rank), torchrun-style",
         "Each child runs SUBCOMMAND ARGS with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR\n"
         "and MASTER_PORT set. SIGINT/SIGTERM are forwarded; when a child fails the others are stopped; the\n"
         "exit status is the first non-zero one.",
         {{"nproc-per-node", "N", "processes on this node (required)"},
          {"nnodes", "M", "number of nodes; default 1"},
          {"node-rank", "R", "this node's index; default 0"},
          {"master-addr", "A", "address of rank 0's node; default 127.0.0.1"},
          {"master-port", "P", "rendezvous port; default MASTER_PORT, else a free port on one node, else 29500"},
          {"program", "PATH", "run PATH ARGS... instead of this binary's SUBCOMMAND ARGS..."}}},
        {"plot",
         "OUT [--out FILE.svg]",
         "draw a training run's loss, learning rate and grad norm as an SVG",
         "Reads OUT/metrics.jsonl (a running training's torn last line is ignored) and writes OUT/loss.svg:\n"
         "training and validation loss, learning rate and gradient norm against the step.",
         {{"out", "FILE", "where to write the SVG; default OUT/loss.svg"}}},
        {"generate",
         "--model DIR --prompt TEXT [--chat [--chat-format F]] [--max-new-tokens N --temperature T --top-p P "
         "--seed S --device auto|cpu|cuda] [--json]",
         "continue a prompt with a model (greedy or sampled), to sanity-check it",
         "Encodes the prompt with DIR's tokenizer (with --chat, as one user message through the chat template,\n"
         "with the generation prompt), generates with a KV cache until --max-new-tokens or an EOS id\n"
         "(generation_config.json's, else config.json's), and streams the new text to stdout.",
         {{"model", "DIR", "HF model directory with a tokenizer (required)"},
          {"prompt", "TEXT", "the text to continue (required)"},
          {"chat", "", "wrap the prompt as a user message with the model's chat template"},
          {"chat-format", "F",
           "with --chat: auto (from the template: a ChatML fast path, else the template itself), jinja (the "
           "template itself), chatml, chatml_system or chatml_think"},
          {"max-new-tokens", "N", "stop after N new tokens; default 64"},
          {"temperature", "T", "sampling temperature; default 0 (greedy)"},
          {"top-p", "P", "nucleus sampling: sample from the smallest set of tokens with probability >= P; default 1"},
          {"seed", "S", "seed of the sampler; default 0"},
          {"device", "auto|cpu|cuda", "where to run; default auto (the GPU when there is one)"},
          {"json", "", "print one JSON object (prompt and output ids, text, why it stopped, timings)"}}},
        {"recipe",
         "--explain [--json]",
         "describe the recipe format: every key, its type, default and meaning",
         "Prints every key a recipe (finetune's RECIPE.yaml, or a key.sub=value override) accepts, grouped by\n"
         "section, with its type, default and meaning.",
         {{"explain", "", "print every recipe key with its type, default and meaning"},
          {"json", "", "with --explain: print a JSON array of {key, type, default, meaning}"}}},
    };
}

// The options, aligned, then -h/--help.
void append_wrapped_options(std::string& out, const std::vector<OptionHelp>& options) {
    size_t width = 0;
    std::vector<std::string> heads;
    for (const OptionHelp& o : options) {
        std::string head = std::string("--") + o.name;
        if (o.value[0] != '\0') head += std::string(" ") + o.value;
        width = std::max(width, head.size());
        heads.push_back(std::move(head));
    }
    const std::string help_head = "-h, --help";
    width = std::max(width, help_head.size());
    for (size_t k = 0; k <= options.size(); ++k) {
        const std::string& head = k < options.size() ? heads[k] : help_head;
        out += "  " + head;
        out.append(width + 2 - head.size(), ' ');
        out += k < options.size() ? options[k].meaning : "this text";
        out += '\n';
    }
}

}  // namespace

const std::vector<CommandHelp>& command_table() {
    static const std::vector<CommandHelp> table = make_table();
    return table;
}

const CommandHelp* find_command(std::string_view name) {
    for (const CommandHelp& c : command_table())
        if (name == c.name) return &c;
    return nullptr;
}

std::string usage_text() {
    std::string out = "usage: moeforge <command> [options]\n\ncommands:\n";
    size_t width = 0;
    for (const CommandHelp& c : command_table()) width = std::max(width, std::string_view(c.name).size());
    for (const CommandHelp& c : command_table()) {
        out += "  ";
        out += c.name;
        out.append(width + 2 - std::string_view(c.name).size(), ' ');
        out += c.summary;
        out += "\n";
        out.append(width + 4, ' ');
        out += std::string("moeforge ") + c.name + " " + c.synopsis + "\n";
    }
    out += "  help";
    out.append(width - 2, ' ');
    out += "this text, or `moeforge help COMMAND` (or `moeforge COMMAND --help`) for one command's options\n";
    out += "  version";
    out.append(width > 5 ? width - 5 : 1, ' ');
    out += "the version, commit and compiled-in backends (also --version)\n";
    return out;
}

std::string command_help_text(const CommandHelp& command) {
    std::string out = std::string("usage: moeforge ") + command.name + " " + command.synopsis + "\n\n";
    out += command.summary;
    out += ".\n";
    if (command.details[0] != '\0') out += std::string("\n") + command.details + "\n";
    out += "\noptions:\n";
    append_wrapped_options(out, command.options);
    return out;
}

std::string version_text() {
    std::string out = "moeforge " MOEFORGE_VERSION;
#ifdef MOEFORGE_GIT_COMMIT
    if (std::string_view(MOEFORGE_GIT_COMMIT).size() > 0) out += " (commit " MOEFORGE_GIT_COMMIT ")";
#endif
    auto yes_no = [](bool on) { return on ? "yes" : "no"; };
#if defined(MOEFORGE_WITH_CUDA)
    constexpr bool kCuda = true;
#else
    constexpr bool kCuda = false;
#endif
#if defined(MOEFORGE_WITH_CUDNN)
    constexpr bool kCudnn = true;
#else
    constexpr bool kCudnn = false;
#endif
#if defined(MOEFORGE_WITH_NCCL)
    constexpr bool kNccl = true;
#else
    constexpr bool kNccl = false;
#endif
    out += std::string("\nbuilt with: CUDA ") + yes_no(kCuda) + ", cuDNN " + yes_no(kCudnn) + ", NCCL " +
           yes_no(kNccl) + "\n";
    return out;
}

bool wants_help(const Args& args) {
    for (const std::string& a : args) {
        if (a == "--") return false;
        if (a == "--help" || a == "-h") return true;
    }
    return false;
}

}  // namespace mf::cli
