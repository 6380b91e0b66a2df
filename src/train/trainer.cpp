#include "train/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include "core/check.h"
#include "core/device_choice.h"
#include "core/interrupt.h"
#include "data/dataset_summary.h"
#include "data/loader.h"
#include "data/sft_dataset.h"
#include "data/token_dataset.h"
#include "io/file.h"
#include "model/causal_lm.h"
#include "text/tokenizer.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/evaluate.h"
#include "train/hf_checkpoint.h"
#include "train/lr_schedule.h"
#include "train/optimizer.h"
#include "train/output_dir.h"
#include "train/tensorboard.h"

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
    if (skipped) v.set("skipped", true);
    if (val_loss >= 0) v.set("val_loss", json::Value(val_loss));
    return v;
}

namespace {

Device resolve_device(const Recipe& r) { return pick_device(r.device, r.source + ": device:"); }

}  // namespace

data::TokenDataset read_dataset(const Recipe& recipe, const fs::path& model_dir, int64_t vocab_size,
                                const std::string& file) {
    // The tokenizer comes with the model directory; token-id data needs none (nor reads it, so a
    // tokenizer of a kind the engine does not read yet does not stop a tokens run).
    data::SftOptions opt;
    opt.format = data::parse_sft_format(recipe.data.format);
    std::optional<text::Tokenizer> tokenizer;
    if (opt.format != data::SftFormat::tokens && text::Tokenizer::found_in(model_dir))
        tokenizer = text::Tokenizer::load(model_dir);
    opt.chat_format = recipe.data.chat_format;
    opt.chat_template_kwargs = recipe.data.chat_template_kwargs;
    opt.tokenizer_dir = model_dir;
    opt.loss_on = text::parse_loss_on(recipe.data.loss_on);
    opt.skip_bad_lines = recipe.data.on_error == "skip";
    opt.vocab_size = vocab_size;
    return data::read_sft_jsonl(file.empty() ? recipe.data.train : file, tokenizer ? &*tokenizer : nullptr, opt);
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// "1h02m", "3m07s", "12s".
std::string duration_str(double s) {
    if (!std::isfinite(s) || s < 0) return "?";
    const long long t = static_cast<long long>(s + 0.5);
    char buf[32];
    if (t >= 3600)
        std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, (t / 60) % 60);
    else if (t >= 60)
        std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
    else
        std::snprintf(buf, sizeof buf, "%llds", t);
    return buf;
}

}  // namespace

// Everything a run holds from setup to export.
struct RunState {
    const Recipe recipe;
    Device device = Device::cpu;
    bool mixed = false;
    std::unique_ptr<DistContext> dist;
    bool is_main = true;
    bool logs = true;  // this rank prints
    std::string who;   // "[rank R] " when every rank prints
    fs::path model_dir, out, ckpt_root;
    json::Value raw_config;
    std::unique_ptr<io::DirLock> lock;  // rank 0: OUT, for the whole run
    std::unique_ptr<model::CausalLM> model;
    data::TokenDataset dataset;
    data::DatasetSummary data_summary;
    data::TokenDataset eval_dataset;  // eval.data, when set
    std::unique_ptr<data::Loader> loader;
    std::unique_ptr<AdamW> optimizer;
    CheckpointLayout layout;
    int64_t first_step = 0;  // the step this process started at (a resume's checkpoint step)
    int64_t steps_done = 0;  // optimizer steps done so far
    int64_t last_saved_step = -1;
    std::ofstream metrics_file;  // rank 0
    size_t device_mem0 = 0;      // device memory in use before the model (cuda)
    double state_bytes = 0;      // this rank's parameters, gradients and AdamW state
    double peak_mem_gib = 0;
    double best_val_loss = 0;                      // checkpoint.keep_best: the best evaluation so far,
    int64_t best_step = -1;                        // at this step (-1: none yet)
    std::optional<TensorBoardWriter> tensorboard;  // rank 0, log.tensorboard
    bool tty = false;
    Clock::time_point start = Clock::now();  // setup's start
    Clock::time_point loop_start;            // when the first step of this process began
    double first_loss = 0, last_loss = 0;    // of the steps this process ran
    int interrupted_by = 0;                  // the signal that stopped the run after its last step
    explicit RunState(Recipe r) : recipe(std::move(r)) {}
};

namespace {

// Runs `check` on rank 0 and makes every rank agree on its outcome: when it throws there, rank 0
// rethrows and the others stop too, instead of waiting for rank 0 in the next collective.
void on_main_agreed(RunState& run, const std::function<void()>& check) {
    std::exception_ptr error;
    if (run.is_main) {
        try {
            check();
        } catch (...) {
            error = std::current_exception();
        }
    }
    if (run.dist->distributed() && run.dist->sum_i64(error ? 1 : 0) > 0 && !error)
        fail("rank 0 refused the run (its log says why)");
    if (error) std::rethrow_exception(error);
}

// The checkpoint a resume starts from; an error when there is none (a resume that silently started
// over would train from step 0 and replace the finished model).
std::optional<fs::path> resume_checkpoint(const ResumeOptions& resume, const fs::path& ckpt_root) {
    if (resume.from.empty()) return std::nullopt;
    if (resume.from == "auto") {
        std::optional<fs::path> dir = latest_checkpoint(ckpt_root);
        if (!dir)
            fail("--resume: no checkpoint under ", ckpt_root.string(),
                 " (nothing to resume; run without --resume to start a new run)");
        return dir;
    }
    const fs::path dir = resume.from;
    if (!fs::is_regular_file(dir / "state.json"))
        fail("--resume ", dir.string(), ": not a training checkpoint directory (no state.json in it)");
    return dir;
}

// With OUT locked, no other run is writing there: temporaries of ours that a killed run left (a
// staging directory, a half-written metrics.jsonl or recipe.json) go.
void sweep_temporaries(const fs::path& out) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(out, ec)) {
        const std::string name = entry.path().filename().string();
        bool ours = name.rfind(io::StagedFiles::kStagingPrefix, 0) == 0;
        for (const char* file : {"metrics.jsonl", "recipe.json", kExportRecord})
            ours = ours || name.rfind(std::string(file) + ".tmp-", 0) == 0;
        if (ours) fs::remove_all(entry.path(), ec);
    }
}

// Rank 0: OUT checked (train/output_dir.h) and locked before anything is loaded or written.
void claim_output_dir(RunState& run, const model::ModelSpec& cfg, const ResumeOptions& resume) {
    const Recipe& r = run.recipe;
    on_main_agreed(run, [&] {
        OutputCheck check;
        check.model_dir = run.model_dir;
        check.inputs = {fs::path(r.data.train), fs::path(r.eval.data)};
        check.export_bytes = export_bytes(cfg);
        if (r.checkpoint.every > 0)
            check.checkpoint_bytes = static_cast<uint64_t>(r.checkpoint.keep + 1) *
                                     static_cast<uint64_t>(model::model_param_table(cfg).total()) * 12u;
        run.out = check_output_dir(r.out, check);
        if (resume.from == "auto" && !fs::is_directory(run.out))
            fail("--resume: ", r.out, " does not exist, so there is no checkpoint to resume from");
        std::error_code ec;
        fs::create_directories(run.out, ec);
        if (ec) fail("out ", r.out, ": cannot create the directory: ", ec.message());
        run.lock = std::make_unique<io::DirLock>(run.out);
        if (!run.lock->stale_holder().empty())
            std::fprintf(stderr, "warning: %s/%s was left by a run that no longer holds it (%s); taking it over\n",
                         run.out.string().c_str(), io::DirLock::kFileName, run.lock->stale_holder().c_str());
        if (!run.lock->unlocked_reason().empty())
            std::fprintf(stderr, "warning: %s cannot be locked (%s): nothing stops a second run from using it\n",
                         run.out.string().c_str(), run.lock->unlocked_reason().c_str());
        sweep_temporaries(run.out);
    });
    if (!run.is_main) run.out = r.out;  // every rank sees OUT (a shared file system); rank 0 alone writes it
    run.ckpt_root = run.out / "checkpoints";
}

// metrics.jsonl holds exactly the steps done so far: on resume, the lines past the checkpoint go.
void open_metrics(RunState& run) {
    const fs::path file = run.out / "metrics.jsonl";
    std::string kept;
    if (run.first_step > 0 && fs::exists(file)) {
        const std::string old = io::read_text_file(file, size_t{1} << 30);
        size_t pos = 0;
        while (pos < old.size()) {
            size_t end = old.find('\n', pos);
            if (end == std::string::npos) break;  // a torn last line is dropped
            const std::string line = old.substr(pos, end - pos);
            pos = end + 1;
            try {
                const json::Value v = json::parse(line, "metrics.jsonl");
                if (v.find("step") != nullptr && v.find("step")->as_int() <= run.first_step) kept += line + "\n";
            } catch (const Error&) {
            }
        }
    }
    io::atomic_write_file(file, kept);
    run.metrics_file.open(file, std::ios::app);
    if (!run.metrics_file) fail(file.string(), ": cannot open for writing");
}

void setup(RunState& run, const ResumeOptions& resume) {
    const Recipe& recipe = run.recipe;
    run.device = resolve_device(recipe);
    run.mixed = recipe.precision == "mixed";
    // Before the model: on cuda the NCCL communicator selects this rank's GPU.
    run.dist = DistContext::from_environment(recipe, run.device);
    DistContext& dist = *run.dist;
    run.is_main = dist.is_main();
    // Who prints: rank 0, or with dist.log_ranks = all every rank, each line led by its rank.
    run.logs = run.is_main || recipe.dist.log_ranks == "all";
    run.who = dist.distributed() && recipe.dist.log_ranks == "all" ? "[rank " + std::to_string(dist.rank()) + "] " : "";
    run.model_dir = recipe.model;
    const model::ModelSpec cfg = read_hf_config(run.model_dir);
    if (dist.ep_size() > 1 && (cfg.num_experts() == 0 || cfg.num_experts() % dist.ep_size() != 0))
        fail(recipe.source, ": dist.ep_size = ", dist.ep_size(), " must divide the model's ", cfg.num_experts(),
             " experts");
    claim_output_dir(run, cfg, resume);
    const std::optional<fs::path> ckpt = resume_checkpoint(resume, run.ckpt_root);

    if (run.device == Device::cuda) run.device_mem0 = device_memory_used();
    model::ModelPlacement placement{run.device, run.device == Device::cuda && !run.mixed ? DType::bf16 : DType::f32,
                                    dist.expert_shard()};
    run.model = load_hf_model(run.model_dir, &run.raw_config, placement);
    model::CausalLM& model = *run.model;
    model.set_recompute(model::parse_recompute(recipe.train.recompute));
    if (dist.ep_size() > 1) model.set_expert_parallel(dist.ep_group(), recipe.dist.ep_chunks);
    dist.gather_embedding_grads(model);

    run.dataset = read_dataset(recipe, run.model_dir, model.spec().vocab_size);
    run.data_summary = data::prepare_documents(run.dataset, recipe.train.seq_len, recipe.data.train);
    run.loader = std::make_unique<data::Loader>(
        &run.dataset.docs, recipe.train.seq_len, recipe.train.micro_batch, recipe.data.packing, recipe.data.shuffle,
        static_cast<uint64_t>(recipe.seed), 0, data::LoaderShard{dist.rank(), dist.world_size()});
    run.data_summary.packing = run.loader->measure_epoch();
    if (!recipe.eval.data.empty())
        run.eval_dataset = read_dataset(recipe, run.model_dir, model.spec().vocab_size, recipe.eval.data);
    run.layout = CheckpointLayout{dist.world_size(), dist.ep_size(), dist.rank()};
    run.optimizer = std::make_unique<AdamW>(model, recipe.optim, run.mixed,
                                            recipe.dist.shard_optimizer ? dist.group(Group::world) : nullptr,
                                            recipe.dist.shard_optimizer ? dist.dp_group() : nullptr);
    if (ckpt) {
        const CheckpointState st = load_checkpoint(*ckpt, recipe, model, *run.optimizer, resume.force, run.layout);
        if (st.step > recipe.train.steps)
            fail(ckpt->string(), ": checkpoint is at step ", st.step, ", beyond train.steps = ", recipe.train.steps);
        run.loader->restore(st.loader);
        run.first_step = st.step;
        run.steps_done = st.step;
        run.last_saved_step = st.step;
        run.best_step = st.best_step;
        run.best_val_loss = st.best_val_loss;
        if (run.logs)
            std::printf("%sresumed from %s (step %lld)\n", run.who.c_str(), ckpt->string().c_str(),
                        static_cast<long long>(st.step));
    }
    // Only rank 0 writes files; the other ranks' metrics_file stays closed.
    if (run.is_main) {
        io::atomic_write_file(run.out / "recipe.json", recipe.to_json().dump(2) + "\n");
        open_metrics(run);
        if (recipe.log.tensorboard) run.tensorboard.emplace(run.out / "tensorboard");
    }
    // This rank's bytes of parameters, gradients and optimizer state (EP shard, ZeRO-1 chunk).
    run.state_bytes = static_cast<double>(model.num_params()) *
                          static_cast<double>(dtype_size(model.param_dtype()) + dtype_size(model.grad_dtype())) +
                      static_cast<double>(run.optimizer->state_bytes());
    run.tty = run.is_main && isatty(fileno(stdout)) != 0;
}

void print_start(const RunState& run) {
    const Recipe& recipe = run.recipe;
    const model::CausalLM& model = *run.model;
    if (run.is_main)
        std::printf(
            "moeforge finetune: %s | %lld params (%lld active) | %lld steps x %lld x %lld tokens x %lld accum | "
            "%s%s%s\n",
            run.model_dir.string().c_str(), static_cast<long long>(model.num_params_total()),
            static_cast<long long>(model.num_active_params()), static_cast<long long>(recipe.train.steps),
            static_cast<long long>(recipe.train.micro_batch), static_cast<long long>(recipe.train.seq_len),
            static_cast<long long>(recipe.train.grad_accum), device_name(run.device),
            run.dist->distributed() ? " | " : "", run.dist->describe().c_str());
    if (run.is_main) {
        std::printf("%s\n", run.data_summary.describe().c_str());
        if (recipe.train.grad_accum > 1)
            std::printf("each step: %lld micro-batches of %lld x %lld tokens%s\n",
                        static_cast<long long>(recipe.train.grad_accum),
                        static_cast<long long>(recipe.train.micro_batch), static_cast<long long>(recipe.train.seq_len),
                        run.dist->distributed() ? " per rank" : "");
        if (!recipe.eval.data.empty())
            std::printf("eval: %s every %lld steps (%zu records)\n", recipe.eval.data.c_str(),
                        static_cast<long long>(recipe.eval.every), run.eval_dataset.docs.size());
    }
    if (run.logs && run.dist->distributed())
        std::printf("%sthis rank holds %lld parameters (%s), AdamW state %.1f MiB%s\n", run.who.c_str(),
                    static_cast<long long>(model.params().count()),
                    run.dist->ep_size() > 1 ? "replicated + its expert shard" : "all",
                    static_cast<double>(run.optimizer->state_bytes()) / (1024.0 * 1024.0),
                    recipe.dist.shard_optimizer ? " (ZeRO-1 shard)" : "");
}

// The measured peak: on a GPU the device memory this run holds (the arenas' high-water mark plus
// cuBLAS/cuDNN workspaces: what `bench` reports); on the CPU the parameters, gradients, AdamW state
// and the activation arena's high-water mark.
double peak_mem_gib(RunState& run) {
    double bytes = run.state_bytes + static_cast<double>(run.model->activation_bytes());
    if (run.device == Device::cuda) bytes = static_cast<double>(device_memory_used() - run.device_mem0);
    run.peak_mem_gib = std::max(run.peak_mem_gib, bytes / (1024.0 * 1024.0 * 1024.0));
    return run.peak_mem_gib;
}

void save_run_checkpoint(RunState& run, int64_t step) {
    CheckpointState st;
    st.step = step;
    st.adam_step = run.optimizer->step_count();
    st.loader = run.loader->state();
    st.recipe = run.recipe.to_json();
    st.best_step = run.best_step;
    st.best_val_loss = run.best_val_loss;
    st.next_lr = lr_at(run.recipe.optim, step, run.recipe.train.steps);
    save_checkpoint(run.ckpt_root, st, *run.model, *run.optimizer, run.recipe.checkpoint.keep, run.layout,
                    run.dist.get());
    run.last_saved_step = step;
    if (run.logs)
        std::printf("%scheckpoint saved: %s/step-%08lld\n", run.who.c_str(), run.ckpt_root.string().c_str(),
                    static_cast<long long>(step));
}

// One optimizer step: grad_accum micro-batches, each built as it is consumed. The loss is HF's over
// the union of every rank's micro-batches: CE summed everywhere over the global target count, aux
// the mean over all grad_accum x world micro-batches. The target count must be known before the
// first backward, so a copy of the loader counts the step's targets first. `stop` is this rank's
// interruption request in, and whether any rank asked for one out (every rank then stops after
// this same step).
StepMetrics train_step(RunState& run, int64_t step, bool* stop) {
    const Recipe& recipe = run.recipe;
    model::CausalLM& model = *run.model;
    DistContext& dist = *run.dist;
    const auto& cfg = model.spec();
    const bool add_aux = cfg.adds_aux_loss();
    const auto t0 = Clock::now();
    int64_t local_targets = 0;
    {
        data::Loader counter = *run.loader;
        for (int64_t a = 0; a < recipe.train.grad_accum; ++a) local_targets += counter.next().num_targets();
    }
    const int64_t targets = dist.sum_i64(local_targets);
    if (targets == 0) {
        const std::string what = "step " + std::to_string(step + 1) +
                                 " has no target token: every label of its micro-batches is masked or cut at "
                                 "train.seq_len, so its loss would read 0 and teach nothing";
        if (recipe.data.on_empty == "stop")
            fail(what, " (data.on_empty: stop; raise train.seq_len or check data.loss_on)");
        if (run.logs) std::printf("%swarning: %s (data.on_empty: warn)\n", run.who.c_str(), what.c_str());
    }
    const double num_micro = static_cast<double>(recipe.train.grad_accum) * static_cast<double>(dist.world_size());
    model::LossScales scales;
    scales.ce = targets > 0 ? 1.0 / static_cast<double>(targets) : 0.0;
    scales.aux = add_aux ? cfg.router_aux_loss_coef / num_micro : 0.0;
    double local_ce = 0, local_aux = 0, local_tokens = 0;
    for (int64_t a = 0; a < recipe.train.grad_accum; ++a) {
        const data::Batch batch = run.loader->next();
        local_tokens += static_cast<double>(batch.num_real_tokens());
        // The gradient reduction overlaps the last micro-batch's backward (train/distributed.h).
        if (a + 1 == recipe.train.grad_accum) dist.begin_grad_sync(model);
        const model::StepStats s = model.step(batch, &scales);
        local_ce += s.ce_sum;
        local_aux += s.aux;
    }
    dist.finish_grad_sync(model);
    const double local_sums[4] = {local_ce, local_aux, local_tokens, *stop ? 1.0 : 0.0};
    const std::vector<double> sums = dist.sum_f64(local_sums);
    *stop = sums[3] > 0;
    StepMetrics m;
    m.step = step + 1;
    m.ce_loss = targets > 0 ? sums[0] / static_cast<double>(targets) : 0.0;
    m.aux_loss = sums[1] / num_micro;
    m.loss = m.ce_loss + (add_aux ? cfg.router_aux_loss_coef * m.aux_loss : 0.0);
    m.tokens = static_cast<int64_t>(sums[2]);
    // The gradients are identical on every rank, so this global norm is too.
    m.grad_norm = grad_norm(model, &dist);
    m.lr = lr_at(recipe.optim, step, recipe.train.steps);
    if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
        const std::string where =
            !std::isfinite(m.loss)
                ? "loss " + std::to_string(m.loss) + ", first in " + model.locate_nonfinite_activation()
                : "gradient norm, first in the gradient of " + model.locate_nonfinite_gradient();
        if (recipe.train.on_nonfinite == "stop") {
            if (run.is_main) run.metrics_file << m.to_json().dump() << "\n" << std::flush;
            fail("step ", m.step, ": non-finite ", where, " (train.on_nonfinite: stop)");
        }
        if (run.logs)
            std::printf("%sstep %lld: non-finite %s; update skipped (train.on_nonfinite: skip)\n", run.who.c_str(),
                        static_cast<long long>(m.step), where.c_str());
        m.skipped = true;
    } else {
        run.optimizer->step(m.lr, clip_coefficient(m.grad_norm, recipe.train.grad_clip));
    }
    model.zero_grads();
    const double dt = seconds_since(t0);
    m.step_seconds = dt;
    m.tokens_per_s = dt > 0 ? static_cast<double>(m.tokens) / dt : 0.0;
    m.peak_mem_gib = peak_mem_gib(run);
    return m;
}

// A log line per train.log_every steps; on a terminal one status line (elapsed, ETA, loss, tokens/s)
// rewritten in place between them.
void report_step(RunState& run, const StepMetrics& m) {
    const Recipe& recipe = run.recipe;
    if (!run.logs) return;
    const double elapsed = seconds_since(run.loop_start);
    const double done = static_cast<double>(m.step - run.first_step);
    const double eta = done > 0 ? elapsed / done * static_cast<double>(recipe.train.steps - m.step) : 0.0;
    if (m.step % recipe.train.log_every == 0 || m.step == recipe.train.steps || m.step == 1) {
        if (run.tty) std::printf("\r\033[K");
        std::printf(
            "%sstep %4lld/%lld | loss %.4f | ce %.4f | aux %.4f | grad_norm %.3f | lr %.3e | %.0f tok/s | %.2f GiB | "
            "%s elapsed, ETA %s\n",
            run.who.c_str(), static_cast<long long>(m.step), static_cast<long long>(recipe.train.steps), m.loss,
            m.ce_loss, m.aux_loss, m.grad_norm, m.lr, m.tokens_per_s, m.peak_mem_gib, duration_str(elapsed).c_str(),
            duration_str(eta).c_str());
    } else if (run.tty) {
        std::printf("\r\033[Kstep %lld/%lld | loss %.4f | %.0f tok/s | %s elapsed, ETA %s",
                    static_cast<long long>(m.step), static_cast<long long>(recipe.train.steps), m.loss, m.tokens_per_s,
                    duration_str(elapsed).c_str(), duration_str(eta).c_str());
    }
    std::fflush(stdout);
}

// The held-out loss (eval.data) every eval.every steps and at the last step, on every rank (the
// forward passes of an EP model are collective); -1 when none is due.
double maybe_evaluate(RunState& run, int64_t step) {
    const Recipe& recipe = run.recipe;
    if (recipe.eval.every <= 0 || (step % recipe.eval.every != 0 && step != recipe.train.steps)) return -1;
    EvalOptions opt;
    opt.micro_batch = recipe.eval.micro_batch;
    opt.seq_len = recipe.eval.seq_len;
    opt.packing = recipe.data.packing;
    const EvalResult r = evaluate(*run.model, run.eval_dataset, opt);
    if (run.logs)
        std::printf("%seval at step %lld: loss %.4f | ce %.4f | %lld target tokens in %lld batches\n", run.who.c_str(),
                    static_cast<long long>(step), r.loss, r.ce_loss, static_cast<long long>(r.targets),
                    static_cast<long long>(r.batches));
    return r.loss;
}

void log_tensorboard(RunState& run, const StepMetrics& m, double val_loss) {
    if (!run.tensorboard) return;
    const bool due = m.step % run.recipe.log.every == 0 || m.step == run.recipe.train.steps || val_loss >= 0;
    if (!due) return;
    TensorBoardWriter& tb = *run.tensorboard;
    tb.scalar("train/loss", m.step, m.loss);
    tb.scalar("train/ce_loss", m.step, m.ce_loss);
    tb.scalar("train/aux_loss", m.step, m.aux_loss);
    tb.scalar("train/grad_norm", m.step, m.grad_norm);
    tb.scalar("train/lr", m.step, m.lr);
    tb.scalar("train/tokens_per_s", m.step, m.tokens_per_s);
    tb.scalar("train/peak_mem_gib", m.step, m.peak_mem_gib);
    if (val_loss >= 0) tb.scalar("val/loss", m.step, val_loss);
    tb.flush();
}

// checkpoint.keep_best: a better evaluation makes this step's checkpoint the best one, which
// pruning keeps (train/checkpoint.h).
bool improves_best(RunState& run, int64_t step, double val_loss) {
    if (!run.recipe.checkpoint.keep_best || val_loss < 0) return false;
    if (run.best_step >= 0 && !(val_loss < run.best_val_loss)) return false;
    run.best_step = step;
    run.best_val_loss = val_loss;
    return true;
}

// One step of the loop: the step, then all that is recorded after it. After an interruption
// request on any rank, a checkpoint of this step (whatever checkpoint.every says) and
// run.interrupted_by: the signal, or SIGTERM on a rank that got none (what launchers and SLURM send).
StepMetrics loop_step(RunState& run) {
    const Recipe& recipe = run.recipe;
    const int64_t step = run.steps_done;
    if (step == run.first_step) run.loop_start = Clock::now();
    bool stop = interrupt::requested_signal() != 0;
    StepMetrics m = train_step(run, step, &stop);
    run.steps_done = m.step;
    if (step == run.first_step) run.first_loss = m.loss;
    run.last_loss = m.loss;
    m.val_loss = maybe_evaluate(run, m.step);
    if (run.is_main) run.metrics_file << m.to_json().dump() << "\n" << std::flush;  // every rank's m is the same
    log_tensorboard(run, m, m.val_loss);
    const bool best = improves_best(run, m.step, m.val_loss);
    if ((recipe.checkpoint.every > 0 && m.step % recipe.checkpoint.every == 0) || best) {
        save_run_checkpoint(run, m.step);
        if (best && run.logs)
            std::printf("%sbest eval loss so far (%.4f): step %lld's checkpoint is kept\n", run.who.c_str(), m.val_loss,
                        static_cast<long long>(m.step));
    }
    report_step(run, m);
    if (stop) {
        if (run.last_saved_step != m.step) save_run_checkpoint(run, m.step);
        const int sig = interrupt::requested_signal();
        run.interrupted_by = sig != 0 ? sig : SIGTERM;
        if (run.tty) std::printf("\r\033[K");
        if (run.logs)
            std::printf("%sstopped by %s after step %lld: checkpoint saved; continue with --resume\n", run.who.c_str(),
                        interrupt::signal_name(run.interrupted_by), static_cast<long long>(m.step));
        std::fflush(stdout);
    }
    return m;
}

// Rank 0 writes the export into OUT (its own files only, io::StagedFiles); under EP its EP group's
// ranks hand over their experts tensor by tensor as the writer reaches them
// (DistContext::export_source / serve_export).
void export_run(RunState& run) {
    model::CausalLM& model = *run.model;
    DistContext& dist = *run.dist;
    std::vector<float> local_params;
    if (run.is_main || dist.serves_export()) {
        local_params.resize(static_cast<size_t>(model.num_params()));
        model.get_params_to_host(local_params.data());
    }
    if (!run.is_main) {
        if (dist.serves_export()) dist.serve_export(model, local_params);
        // Returning only after rank 0 has written keeps every rank's exit status meaningful (a
        // failed export on rank 0 makes this barrier fail here too).
        dist.barrier();
        return;
    }
    run.metrics_file.flush();
    if (run.dataset.skipped_lines > 0)
        std::printf("skipped %lld bad dataset lines; first: %s\n", static_cast<long long>(run.dataset.skipped_lines),
                    run.dataset.first_skip_reason.c_str());
    {
        io::StagedFiles staged(run.out, kExportRecord);
        save_hf_model(staged.staging(), model.spec(), dist.export_source(model, local_params), &run.raw_config,
                      run.model_dir);
        staged.commit({"config.json"});
    }
    dist.barrier();
}

}  // namespace

Trainer::Trainer(Recipe recipe, const ResumeOptions& resume) : run_(std::make_unique<RunState>(std::move(recipe))) {
    setup(*run_, resume);
    print_start(*run_);
}

Trainer::~Trainer() = default;

const Recipe& Trainer::recipe() const { return run_->recipe; }
int64_t Trainer::steps_done() const { return run_->steps_done; }
int Trainer::interrupted_by() const { return run_->interrupted_by; }
bool Trainer::finished() const { return run_->steps_done >= run_->recipe.train.steps || run_->interrupted_by != 0; }
model::CausalLM& Trainer::model() { return *run_->model; }
const fs::path& Trainer::out_dir() const { return run_->out; }

StepMetrics Trainer::step() {
    if (finished())
        fail("the run is ", run_->interrupted_by != 0 ? "interrupted" : "finished", " after step ", run_->steps_done,
             " of train.steps = ", run_->recipe.train.steps, ": no step is left to run");
    return loop_step(*run_);
}

void Trainer::save_checkpoint() {
    if (run_->last_saved_step != run_->steps_done) save_run_checkpoint(*run_, run_->steps_done);
}

std::string Trainer::export_model() {
    RunState& run = *run_;
    if (run.tty) std::printf("\r\033[K");
    export_run(run);
    if (run.is_main)
        std::printf("wrote %s (HF model directory) in %.1f s; loss %.4f -> %.4f\n", run.out.string().c_str(),
                    seconds_since(run.start), run.first_loss, run.last_loss);
    return run.out.string();
}

TrainSummary finetune(const Recipe& recipe, const ResumeOptions& resume) {
    const auto t_start = Clock::now();
    Trainer trainer(recipe, resume);
    TrainSummary summary;
    summary.out_dir = trainer.out_dir().string();
    while (!trainer.finished()) {
        const StepMetrics m = trainer.step();
        if (summary.steps == 0) summary.first_loss = m.loss;
        summary.last_loss = m.loss;
        summary.steps = m.step;
    }
    summary.steps = trainer.steps_done();
    summary.interrupted_by = trainer.interrupted_by();
    if (summary.interrupted_by == 0) summary.out_dir = trainer.export_model();
    summary.seconds = seconds_since(t_start);
    return summary;
}

}  // namespace mf::train
