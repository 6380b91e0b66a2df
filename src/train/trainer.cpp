#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/check.h"
#include "data/loader.h"
#include "data/sft_dataset.h"
#include "data/token_dataset.h"
#include "text/tokenizer.h"
#include "io/file.h"
#include "model/qwen3_moe.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/hf_checkpoint.h"
#include "train/lr_schedule.h"
#include "train/optimizer.h"

namespace mf::train {

namespace fs = std::filesystem;

json::Value StepMetrics::to_json() const {
    json::Value v = json::Value::object();
    v.set("step", step);
    v.set("loss", json::Value(loss));
    v.set("ce_loss", json::Value(ce_loss));
    v.set("aux_loss", json::Value(aux_loss));
    v.set("grad_norm", json::Value(grad_norm));
    v.set("lr", json::Value(lr));
    v.set("tokens", tokens);
    v.set("tokens_per_s", json::Value(tokens_per_s));
    v.set("peak_mem_gib", json::Value(peak_mem_gib));
    return v;
}

namespace {

Device resolve_device(const Recipe& r) {
    if (r.device == "cpu") return Device::cpu;
    if (cuda_available()) return Device::cuda;
    if (r.device == "cuda") fail(r.source, ": device: cuda, but no CUDA device is available (or this build has no CUDA)");
    return Device::cpu;
}

}  // namespace

data::TokenDataset read_dataset(const Recipe& recipe, const fs::path& model_dir, int64_t vocab_size) {
    // The tokenizer comes with the model directory; token-id data needs none.
    std::optional<text::Tokenizer> tokenizer;
    if (fs::exists(model_dir / "tokenizer.json")) tokenizer = text::Tokenizer::load(model_dir);
    data::SftOptions opt;
    opt.format = data::parse_sft_format(recipe.data.format);
    opt.chat_format = recipe.data.chat_format;
    opt.tokenizer_dir = model_dir;
    opt.loss_on = text::parse_loss_on(recipe.data.loss_on);
    opt.skip_bad_lines = recipe.data.on_error == "skip";
    opt.vocab_size = vocab_size;
    return data::read_sft_jsonl(recipe.data.train, tokenizer ? &*tokenizer : nullptr, opt);
}

namespace {

void print_progress(int64_t step, int64_t total, bool tty) {
    if (!tty) return;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * step / std::max<int64_t>(total, 1));
    std::printf("\r[%.*s%*s] %lld/%lld", filled, "##############################", kWidth - filled, "",
                static_cast<long long>(step), static_cast<long long>(total));
    std::fflush(stdout);
}

}  // namespace

TrainSummary finetune(const Recipe& recipe, const ResumeOptions& resume) {
    const auto t_start = std::chrono::steady_clock::now();
    const Device device = resolve_device(recipe);
    const bool mixed = recipe.precision == "mixed";
    // Before the model: on cuda the NCCL communicator selects this rank's GPU.
    const std::unique_ptr<DistContext> dist = DistContext::from_environment(recipe, device);
    const bool is_main = dist->is_main();
    // Who prints: rank 0, or with dist.log_ranks = all every rank, each line led by its rank.
    const bool logs = is_main || recipe.dist.log_ranks == "all";
    const std::string who =
        dist->distributed() && recipe.dist.log_ranks == "all" ? "[rank " + std::to_string(dist->rank()) + "] " : "";
    model::ModelPlacement placement{device, device == Device::cuda && !mixed ? DType::bf16 : DType::f32,
                                    dist->expert_shard()};
    const fs::path model_dir = recipe.model;
    json::Value raw_config;
    if (dist->ep_size() > 1) {
        const model::Qwen3MoeConfig c = read_hf_config(model_dir);
        if (c.num_experts == 0 || c.num_experts % dist->ep_size() != 0)
            fail(recipe.source, ": dist.ep_size = ", dist->ep_size(), " must divide the model's ", c.num_experts,
                 " experts");
    }
    auto model = load_hf_model(model_dir, &raw_config, placement);
    model->set_recompute(model::parse_recompute(recipe.train.recompute));
    const auto& cfg = model->config();
    if (dist->ep_size() > 1) model->set_expert_parallel(dist->ep_group(), recipe.dist.ep_chunks);
    dist->gather_embedding_grads(*model);

    const data::TokenDataset dataset = read_dataset(recipe, model_dir, cfg.vocab_size);
    data::Loader loader(&dataset.docs, recipe.train.seq_len, recipe.train.micro_batch, recipe.data.packing,
                        recipe.data.shuffle, static_cast<uint64_t>(recipe.seed), 0,
                        data::LoaderShard{dist->rank(), dist->world_size()});
    const CheckpointLayout layout{dist->world_size(), dist->ep_size(), dist->rank()};

    const fs::path out = recipe.out;
    if (is_main) {
        fs::create_directories(out);
        io::atomic_write_file(out / "recipe.json", recipe.to_json().dump(2) + "\n");
    }
    AdamW optimizer(*model, recipe.optim, mixed, recipe.dist.shard_optimizer ? dist->group(Group::world) : nullptr,
                    recipe.dist.shard_optimizer ? dist->dp_group() : nullptr);
    const fs::path ckpt_root = out / "checkpoints";
    int64_t first_step = 0;
    if (!resume.from.empty()) {
        std::optional<fs::path> dir;
        if (resume.from == "auto") dir = latest_checkpoint(ckpt_root);
        else dir = fs::path(resume.from);
        if (!dir) {
            if (logs)
                std::printf("%sresume: no checkpoint under %s, starting from step 0\n", who.c_str(),
                            ckpt_root.string().c_str());
        } else {
            const CheckpointState st = load_checkpoint(*dir, recipe, *model, optimizer, resume.force, layout);
            if (st.step > recipe.train.steps)
                fail(dir->string(), ": checkpoint is at step ", st.step, ", beyond train.steps = ", recipe.train.steps);
            loader.restore(st.loader);
            first_step = st.step;
            if (logs)
                std::printf("%sresumed from %s (step %lld)\n", who.c_str(), dir->string().c_str(),
                            static_cast<long long>(st.step));
        }
    }
    // metrics.jsonl holds exactly the steps done so far: on resume, the lines past the checkpoint go.
    // Only rank 0 writes files; the other ranks' metrics_file stays closed.
    std::ofstream metrics_file;
    if (is_main) {
        std::string kept;
        if (first_step > 0 && fs::exists(out / "metrics.jsonl")) {
            const std::string old = io::read_text_file(out / "metrics.jsonl", size_t{1} << 30);
            size_t pos = 0;
            while (pos < old.size()) {
                size_t end = old.find('\n', pos);
                if (end == std::string::npos) break;  // a torn last line is dropped
                const std::string line = old.substr(pos, end - pos);
                pos = end + 1;
                try {
                    const json::Value v = json::parse(line, "metrics.jsonl");
                    if (v.find("step") != nullptr && v.find("step")->as_int() <= first_step) kept += line + "\n";
                } catch (const Error&) {
                }
            }
        }
        io::atomic_write_file(out / "metrics.jsonl", kept);
        metrics_file.open(out / "metrics.jsonl", std::ios::app);
        if (!metrics_file) fail(out.string(), "/metrics.jsonl: cannot open for writing");
    }

    // This rank's bytes of parameters, gradients and optimizer state (EP shard, ZeRO-1 chunk).
    const double state_bytes =
        static_cast<double>(model->num_params()) * static_cast<double>(dtype_size(model->param_dtype()) +
                                                                       dtype_size(model->grad_dtype())) +
        static_cast<double>(optimizer.state_bytes());
    const bool add_aux = cfg.output_router_logits && cfg.num_experts > 0;
    const bool tty = is_main && isatty(fileno(stdout)) != 0;
    if (is_main)
        std::printf(
            "moeforge finetune: %s | %lld params (%lld active) | %lld steps x %lld x %lld tokens x %lld accum | "
            "%s%s%s\n",
            model_dir.string().c_str(), static_cast<long long>(model->num_params_total()),
            static_cast<long long>(model->num_active_params()),
            static_cast<long long>(recipe.train.steps), static_cast<long long>(recipe.train.micro_batch),
            static_cast<long long>(recipe.train.seq_len), static_cast<long long>(recipe.train.grad_accum),
            device_name(device), dist->distributed() ? " | " : "", dist->describe().c_str());

    if (logs && dist->distributed())
        std::printf("%sthis rank holds %lld parameters (%s), AdamW state %.1f MiB%s\n", who.c_str(),
                    static_cast<long long>(model->num_params()),
                    dist->ep_size() > 1 ? "replicated + its expert shard" : "all",
                    static_cast<double>(optimizer.state_bytes()) / (1024.0 * 1024.0),
                    recipe.dist.shard_optimizer ? " (ZeRO-1 shard)" : "");
    TrainSummary summary;
    summary.out_dir = out.string();
    for (int64_t step = first_step; step < recipe.train.steps; ++step) {
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<data::Batch> micro;
        int64_t local_targets = 0, local_tokens = 0;
        for (int64_t a = 0; a < recipe.train.grad_accum; ++a) {
            micro.push_back(loader.next());
            local_targets += micro.back().num_targets();
            local_tokens += micro.back().num_real_tokens();
        }
        // The loss is HF's over the union of every rank's micro-batches: CE summed everywhere over
        // the global target count, aux the mean over all grad_accum x world micro-batches.
        const int64_t targets = dist->sum_i64(local_targets);
        const double num_micro = static_cast<double>(micro.size()) * static_cast<double>(dist->world_size());
        model::LossScales scales;
        scales.ce = targets > 0 ? 1.0 / static_cast<double>(targets) : 0.0;
        scales.aux = add_aux ? cfg.router_aux_loss_coef / num_micro : 0.0;
        double local_ce = 0, local_aux = 0;
        for (size_t i = 0; i < micro.size(); ++i) {
            // The gradient reduction overlaps the last micro-batch's backward (train/distributed.h).
            if (i + 1 == micro.size()) dist->begin_grad_sync(*model);
            const model::StepStats s = model->step(micro[i], &scales);
            local_ce += s.ce_sum;
            local_aux += s.aux;
        }
        dist->finish_grad_sync(*model);
        const double local_sums[3] = {local_ce, local_aux, static_cast<double>(local_tokens)};
        const std::vector<double> sums = dist->sum_f64(local_sums);
        const double ce_sum = sums[0], aux_sum = sums[1];
        const int64_t tokens = static_cast<int64_t>(sums[2]);
        StepMetrics m;
        m.step = step + 1;
        m.ce_loss = targets > 0 ? ce_sum / static_cast<double>(targets) : 0.0;
        m.aux_loss = aux_sum / num_micro;
        m.loss = m.ce_loss + (add_aux ? cfg.router_aux_loss_coef * m.aux_loss : 0.0);
        // The gradients are identical on every rank, so this global norm is too.
        m.grad_norm = grad_norm(*model, dist.get());
        m.lr = lr_at(recipe.optim, step, recipe.train.steps);
        bool skipped = false;
        if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
            const std::string where = !std::isfinite(m.loss) ? "loss " + std::to_string(m.loss) + ", first in " +
                                                                   model->locate_nonfinite_activation()
                                                             : "gradient norm, first in the gradient of " +
                                                                   model->locate_nonfinite_gradient();
            if (recipe.train.on_nonfinite == "stop") {
                if (is_main) metrics_file << m.to_json().dump() << "\n";
                fail("step ", m.step, ": non-finite ", where, " (train.on_nonfinite: stop)");
            }
            if (logs)
                std::printf("%sstep %lld: non-finite %s; update skipped (train.on_nonfinite: skip)\n", who.c_str(),
                            static_cast<long long>(m.step), where.c_str());
            skipped = true;
        } else {
            optimizer.step(m.lr, clip_coefficient(m.grad_norm, recipe.train.grad_clip));
        }
        model->zero_grads();
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        m.tokens = tokens;
        m.tokens_per_s = dt > 0 ? static_cast<double>(tokens) / dt : 0.0;
        // params + grads + AdamW state (per the policy) + the activation arena's high-water mark.
        m.peak_mem_gib = (state_bytes + static_cast<double>(model->activation_bytes())) / (1024.0 * 1024.0 * 1024.0);
        if (step == first_step) summary.first_loss = m.loss;
        summary.last_loss = m.loss;
        if (is_main) {  // every rank's m is the same; rank 0 records it
            json::Value line = m.to_json();
            if (skipped) line.set("skipped", true);
            metrics_file << line.dump() << "\n";
            metrics_file.flush();
        }
        if (recipe.checkpoint.every > 0 && m.step % recipe.checkpoint.every == 0) {
            CheckpointState st;
            st.step = m.step;
            st.adam_step = optimizer.step_count();
            st.loader = loader.state();
            st.recipe = recipe.to_json();
            save_checkpoint(ckpt_root, st, *model, optimizer, recipe.checkpoint.keep, layout, dist.get());
        }
        if (!logs) continue;
        if (m.step % recipe.train.log_every == 0 || m.step == recipe.train.steps || m.step == 1) {
            if (tty) std::printf("\r\033[K");
            std::printf("%sstep %4lld/%lld | loss %.4f | ce %.4f | aux %.4f | grad_norm %.3f | lr %.3e | %.0f tok/s | "
                        "%.2f GiB\n",
                        who.c_str(), static_cast<long long>(m.step), static_cast<long long>(recipe.train.steps), m.loss,
                        m.ce_loss, m.aux_loss, m.grad_norm, m.lr, m.tokens_per_s, m.peak_mem_gib);
        }
        print_progress(m.step, recipe.train.steps, tty);
    }
    if (tty) std::printf("\r\033[K");
    summary.steps = recipe.train.steps;
    // Rank 0 writes the export; under EP its EP group's ranks hand over their experts tensor by
    // tensor as the writer reaches them (DistContext::export_source / serve_export).
    std::vector<float> local_params;
    if (is_main || dist->serves_export()) {
        local_params.resize(static_cast<size_t>(model->num_params()));
        model->get_params_to_host(local_params.data());
    }
    if (!is_main) {
        if (dist->serves_export()) dist->serve_export(*model, local_params);
        // Returning only after rank 0 has written keeps every rank's exit status meaningful (a
        // failed export on rank 0 makes this barrier fail here too).
        dist->barrier();
        summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
        return summary;
    }
    metrics_file.close();
    if (dataset.skipped_lines > 0)
        std::printf("skipped %lld bad dataset lines; first: %s\n", static_cast<long long>(dataset.skipped_lines),
                    dataset.first_skip_reason.c_str());

    // Export: everything into a temporary sibling directory, then one rename into place.
    {
        io::AtomicDir dir(out);
        save_hf_model(dir.tmp_path(), cfg, dist->export_source(*model, local_params), &raw_config, model_dir);
        for (const char* name : {"metrics.jsonl", "recipe.json"})
            io::atomic_write_file(dir.tmp_path() / name, io::read_text_file(out / name, size_t{1} << 30));
        // Checkpoints move along as hard links: until the commit the old OUT still has them.
        if (fs::is_directory(ckpt_root)) {
            for (const auto& ckpt : fs::directory_iterator(ckpt_root)) {
                if (!ckpt.is_directory() || ckpt.path().filename().string().find(".tmp-") != std::string::npos) continue;
                const fs::path dst = dir.tmp_path() / "checkpoints" / ckpt.path().filename();
                fs::create_directories(dst);
                for (const auto& f : fs::directory_iterator(ckpt.path())) fs::create_hard_link(f.path(), dst / f.path().filename());
            }
        }
        dir.commit();
    }
    dist->barrier();
    summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::printf("wrote %s (HF model directory) in %.1f s; loss %.4f -> %.4f\n", out.string().c_str(), summary.seconds,
                summary.first_loss, summary.last_loss);
    return summary;
}

}  // namespace mf::train
