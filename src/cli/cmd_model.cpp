// `init`, `info` and `eval`: create, describe and evaluate HF model directories.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>

#include "cli/args.h"
#include "core/device_choice.h"
#include "data/sft_dataset.h"
#include "data/token_dataset.h"
#include "io/file.h"
#include "model/arch/architecture.h"
#include "model/causal_lm.h"
#include "text/tokenizer.h"
#include "train/evaluate.h"
#include "train/hf_checkpoint.h"
#include "train/output_dir.h"
#include "train/recipe.h"

namespace mf::cli {

namespace fs = std::filesystem;

namespace {}  // namespace

int cmd_init(const Args& args) {
    return with_path_errors("init", [&] {
        const ParsedArgs a(args, {"arch", "preset", "config", "seed", "out", "vocab-size", "init-std", "tokenizer"}, {},
                           "init");
        json::Value config;
        std::string source;
        if (a.has("config")) {
            const fs::path file = a.get("config");
            source = file.string();
            config = json::parse(io::read_text_file(file, 4u << 20), source, json::ParseOptions::hf_config());
            if (a.has("arch")) fail("init: pass --arch or --config, not both (the config names its model_type)");
        } else {
            const std::string arch = a.get("arch", "qwen3_moe");
            const std::string preset = a.get("preset", "tiny");
            if (preset != "tiny")
                fail("init: unknown --preset \"", preset, "\" (supported: tiny; or pass --config FILE)");
            source = "init: --arch " + arch + " --preset " + preset;
            config = model::find_architecture(arch, "init: --arch").tiny_preset();
        }
        // Token ids are int32 (data/batch.h).
        if (a.has("vocab-size") && config.is_object())
            config.set("vocab_size",
                       parse_int_option(a.get("vocab-size"), "vocab-size", 1, std::numeric_limits<int32_t>::max()));
        model::ModelSpec cfg = model::parse_model_config(config, source);
        // A new model is written in float32, or bfloat16 where the config asks for it.
        if (cfg.dtype != "bfloat16") cfg.dtype = "float32";
        const fs::path out = a.require("out", "init");
        // A tokenizer shipped with the model: its files are copied, and its ids must fit the vocabulary.
        const fs::path tokenizer_dir = a.get("tokenizer");
        if (!tokenizer_dir.empty()) {
            const text::Tokenizer tok = text::Tokenizer::load(tokenizer_dir);
            if (static_cast<int64_t>(tok.vocab_size()) > cfg.vocab_size)
                fail("init: the tokenizer in ", tokenizer_dir.string(), " has ", tok.vocab_size(),
                     " ids, more than the model's vocab_size ", cfg.vocab_size, " (pass --vocab-size)");
        }
        const uint64_t seed = static_cast<uint64_t>(parse_int_option(a.get("seed", "0"), "seed"));
        // HF's initializer_range is 0.02; past 1 the logits of a deep model overflow float.
        const float std_dev = static_cast<float>(parse_number_option(a.get("init-std", "0.02"), "init-std", 0.0, 1.0));
        // OUT gets the model's files and nothing else changes there (train/output_dir.h), as for an export.
        train::OutputCheck check;
        check.field = "init: --out";
        if (!tokenizer_dir.empty()) check.inputs.push_back(tokenizer_dir);
        if (a.has("config")) check.inputs.push_back(a.get("config"));
        check.export_bytes = train::export_bytes(cfg);
        const fs::path real_out = train::check_output_dir(out, check);
        model::CausalLM m(cfg);
        m.init_random(seed, std_dev);
        std::error_code ec;
        fs::create_directories(real_out, ec);
        if (ec) fail("init: --out ", out.string(), ": cannot create the directory: ", ec.message());
        const io::DirLock lock(real_out);
        io::StagedFiles staged(real_out, train::kExportRecord);
        train::save_hf_model(staged.staging(), m, nullptr, tokenizer_dir);
        staged.commit({"config.json"});
        std::printf("wrote %s: %s, %lld parameters (%lld active per token), seed %llu\n", out.string().c_str(),
                    cfg.model_type.c_str(), static_cast<long long>(m.num_params_total()),
                    static_cast<long long>(m.num_active_params()), static_cast<unsigned long long>(seed));
        return 0;
    });
}

namespace {

// What one rank holds at a world size and EP size, as the trainer lays it out: the replicated
// parameters plus its E/EP experts, gradients alike, and the AdamW state of what it owns under
// ZeRO-1 (train/optimizer.h: the replicated region's state over the world, the experts' over the
// DP group, in chunks rounded up to 64 elements; rank 0 owns full chunks, so this is the largest).
struct RankPlan {
    int64_t world = 1, ep = 1;
    std::string device, precision;
    bool zero1 = true;
    int64_t params = 0, param_grad_bytes = 0, optimizer_bytes = 0;
};

RankPlan plan_rank_memory(const model::ModelSpec& cfg, const ParsedArgs& a) {
    RankPlan p;
    p.world = parse_int_option(a.get("world", "1"), "world");
    p.ep = parse_int_option(a.get("ep-size", "1"), "ep-size");
    p.device = a.get("device", "cuda");
    p.precision = a.get("precision", "bf16");
    p.zero1 = !a.has("no-zero1");
    if (p.world < 1 || p.ep < 1 || p.world % p.ep != 0) fail("info: --ep-size must divide --world");
    if (p.ep > 1 && (cfg.num_experts() == 0 || cfg.num_experts() % p.ep != 0))
        fail("info: --ep-size ", p.ep, " must divide the ", cfg.num_experts(), " experts");
    if (p.device != "cpu" && p.device != "cuda") fail("info: --device must be cpu or cuda");
    if (p.precision != "bf16" && p.precision != "mixed") fail("info: --precision must be bf16 or mixed");
    const model::ParamTable mine = model::model_param_table(cfg, model::ExpertShard{0, p.ep});
    p.params = mine.total();
    // bytes per element: parameter, gradient, optimizer state (m, v and the fp32 master if any)
    int64_t param_b = 2, grad_b = 2, state_b = 4;
    if (p.device == "cpu")
        param_b = 4, grad_b = 4, state_b = 8;
    else if (p.precision == "mixed")
        grad_b = 4, state_b = 12;
    p.param_grad_bytes = p.params * (param_b + grad_b);
    auto owned = [](int64_t n, int64_t ranks) {  // rank 0's chunk of n elements over `ranks`
        if (ranks <= 1) return n;
        const int64_t per = (n + ranks - 1) / ranks;
        return std::min(n, (per + 63) / 64 * 64);
    };
    const int64_t rep = mine.expert_offset(), experts = mine.total() - rep;
    const int64_t owned_elems = p.zero1 ? owned(rep, p.world) + owned(experts, p.world / p.ep) : mine.total();
    p.optimizer_bytes = owned_elems * state_b;
    return p;
}

}  // namespace

int cmd_info(const Args& args) {
    return with_path_errors("info", [&] {
        const ParsedArgs a(args, {"seq-len", "world", "ep-size", "device", "precision"}, {"json", "no-zero1"}, "info");
        if (a.positional().size() != 1) fail("info: expected one model directory");
        const fs::path dir = a.positional()[0];
        const model::ModelSpec cfg = train::read_hf_config(dir);
        const model::ParamTable table = model::model_param_table(cfg);
        const int64_t T = parse_int_option(a.get("seq-len", "4096"), "seq-len");
        const int64_t total = table.count(), active = model::model_active_params(cfg, table);
        const double flops = model::model_flops_per_token(cfg, T);
        const RankPlan plan = plan_rank_memory(cfg, a);
        if (a.has("json")) {
            json::Value v = json::Value::object();
            v.set("model_type", cfg.model_type);
            v.set("params", total);
            v.set("active_params", active);
            v.set("flops_per_token", json::Value(flops));
            v.set("seq_len", T);
            json::Value layers = json::Value::array();
            for (int64_t l = 0; l < cfg.num_layers(); ++l)
                layers.push_back(json::Value(cfg.is_moe_layer(l) ? "moe" : "dense"));
            v.set("layers", std::move(layers));
            json::Value per = json::Value::object();
            per.set("world", plan.world);
            per.set("ep_size", plan.ep);
            per.set("device", plan.device);
            per.set("precision", plan.precision);
            per.set("zero1", plan.zero1);
            per.set("params", plan.params);
            per.set("param_grad_bytes", plan.param_grad_bytes);
            per.set("optimizer_bytes", plan.optimizer_bytes);
            v.set("per_rank", std::move(per));
            std::printf("%s\n", v.dump().c_str());
            return 0;
        }
        std::printf("%s: %s\n", dir.string().c_str(), cfg.model_type.c_str());
        std::printf("  parameters       %lld total, %lld active per token (%.1f%%)\n", static_cast<long long>(total),
                    static_cast<long long>(active), 100.0 * static_cast<double>(active) / static_cast<double>(total));
        std::printf("  FLOPs per token  %.4g (training, seq_len %lld)\n", flops, static_cast<long long>(T));
        const double gib = 1024.0 * 1024.0 * 1024.0;
        std::printf(
            "  per rank (world %lld, EP %lld, %s %s%s): %lld parameters; parameters + gradients %.2f GiB, "
            "AdamW state %.2f GiB (before activations)\n",
            static_cast<long long>(plan.world), static_cast<long long>(plan.ep), plan.device.c_str(),
            plan.precision.c_str(), plan.zero1 ? ", ZeRO-1" : "", static_cast<long long>(plan.params),
            static_cast<double>(plan.param_grad_bytes) / gib, static_cast<double>(plan.optimizer_bytes) / gib);
        std::printf("  hidden %lld, vocab %lld, %s embeddings, final rms eps %g\n",
                    static_cast<long long>(cfg.hidden_size), static_cast<long long>(cfg.vocab_size),
                    cfg.tie_word_embeddings ? "tied" : "untied", cfg.final_norm_eps);
        std::printf("  layer plan:\n");
        for (int64_t l = 0; l < cfg.num_layers(); ++l) {
            std::string line;
            for (const model::Branch& b : cfg.layers[static_cast<size_t>(l)].branches)
                line += (line.empty() ? "" : "  +  ") + model::describe_branch(b);
            std::printf("    %3lld  %s\n", static_cast<long long>(l), line.c_str());
        }
        return 0;
    });
}

namespace {

// eval --device: auto takes the GPU when there is one. On the GPU the model is loaded as the
// trainer's bf16 policy does (ModelPlacement with bf16 gradients and logits), on the CPU in fp32.
model::ModelPlacement eval_placement(const std::string& device) {
    const bool gpu = pick_device(device, "eval: --device") == Device::cuda;
    return model::ModelPlacement{gpu ? Device::cuda : Device::cpu, gpu ? DType::bf16 : DType::f32, {}};
}

bool has_tokenizer(const fs::path& model_dir) {
    std::error_code ec;
    const bool found = fs::is_regular_file(model_dir / "tokenizer.json", ec);
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
        fail((model_dir / "tokenizer.json").string(), ": cannot be read: ", ec.message());
    return found || text::Tokenizer::found_in(model_dir);  // or a tiktoken ranks file (Kimi)
}

}  // namespace

int cmd_eval(const Args& args) {
    return with_path_errors("eval", [&] {
        const ParsedArgs a(args, {"model", "data", "format", "micro-batch", "seq-len", "device"},
                           {"json", "no-packing"}, "eval");
        const fs::path model_dir = a.require("model", "eval");
        const fs::path data_file = a.require("data", "eval");  // "-": standard input
        train::EvalOptions eo;
        eo.micro_batch = parse_int_option(a.get("micro-batch", "8"), "micro-batch", 1, int64_t{1} << 20);
        eo.seq_len = parse_int_option(a.get("seq-len", "2048"), "seq-len", 2, int64_t{1} << 24);
        eo.packing = !a.has("no-packing");
        if (eo.micro_batch * eo.seq_len > train::kMaxMicroBatchTokens)
            fail("eval: --micro-batch x --seq-len = ", eo.micro_batch, " x ", eo.seq_len, " = ",
                 eo.micro_batch * eo.seq_len, " tokens per forward pass; at most ", train::kMaxMicroBatchTokens,
                 " are allowed");
        const model::ModelPlacement placement = eval_placement(a.get("device", "auto"));
        auto m = train::load_hf_model(model_dir, nullptr, placement);
        const auto& cfg = m->spec();
        data::SftOptions opt;
        opt.format = data::parse_sft_format(a.get("format", "auto"));
        std::optional<text::Tokenizer> tokenizer;  // token-id data needs none
        if (opt.format != data::SftFormat::tokens && has_tokenizer(model_dir))
            tokenizer = text::Tokenizer::load(model_dir);
        opt.tokenizer_dir = model_dir;
        opt.vocab_size = cfg.vocab_size;
        const data::TokenDataset ds = data::read_sft_jsonl(data_file, tokenizer ? &*tokenizer : nullptr, opt);
        const train::EvalResult r = train::evaluate(*m, ds, eo);
        if (a.has("json")) {
            json::Value v = json::Value::object();
            v.set("loss", json::Value(r.loss));
            v.set("ce_loss", json::Value(r.ce_loss));
            v.set("aux_loss", json::Value(r.aux_loss));
            v.set("tokens", r.targets);
            v.set("real_tokens", r.tokens);
            v.set("documents", r.documents);
            v.set("truncated", r.truncated);
            v.set("batches", r.batches);
            v.set("micro_batch", eo.micro_batch);
            v.set("seq_len", eo.seq_len);
            v.set("device", device_name(placement.device));
            std::printf("%s\n", v.dump().c_str());
        } else {
            std::printf(
                "loss %.6f | ce %.6f | aux %.6f | %lld tokens | %lld documents (%lld truncated at seq_len %lld) | "
                "%lld batches on %s\n",
                r.loss, r.ce_loss, r.aux_loss, static_cast<long long>(r.targets), static_cast<long long>(r.documents),
                static_cast<long long>(r.truncated), static_cast<long long>(eo.seq_len),
                static_cast<long long>(r.batches), device_name(placement.device));
        }
        return 0;
    });
}

}  // namespace mf::cli
