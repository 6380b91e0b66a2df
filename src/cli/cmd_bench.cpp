// `bench`: moeforge's side of a BENCHMARKS.md workload without an HF directory on disk.
// A model is built from a config (random weights, drawn on the device), fed synthetic token ids
// (labels = inputs, one document per row), and trained with the full step: forward, backward,
// global-norm clipping and AdamW. Warm-up steps are not timed. The timed steps run back to back, as
// in training (an optimizer update on the background stream overlaps the next step's forward): the
// device, both streams, is synchronised before the first and after the last timed step, and the step
// time is that span over the steps. The per-step lines on stderr are host times between step ends
// (each step ends with host reads of the loss and the gradient norm, which wait for the op stream
// only). With --phases every step is synchronised on its own (no overlap across steps).
// Under `moeforge launch` (WORLD_SIZE > 1) every rank runs the step on its own micro-batch with
// expert parallelism of --ep-size (default 1: pure data parallelism) and ZeRO-1 over the DP group
// (--no-zero1 to keep whole AdamW state), exactly as the trainer does; rank 0 prints the line with
// tokens/s per GPU (one rank's tokens over the step time) and the largest peak memory of any rank.
// Without a GPU it refuses unless --device cpu is given.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>

#include "cli/args.h"
#include "core/device_choice.h"
#include "core/json.h"
#include "data/batch.h"
#include "io/file.h"
#include "model/arch/architecture.h"
#include "model/causal_lm.h"
#include "ops/ops.h"
#include "train/distributed.h"
#include "train/optimizer.h"

namespace mf::cli {

namespace {

// --device auto takes the GPU; without one, bench refuses rather than silently timing the CPU
// (a BENCHMARKS.md workload there takes tens of GB of host memory and hours): the CPU only when
// asked for by name.
Device bench_device(const std::string& dev) {
    const Device d = dev == "cuda" ? Device::cuda : pick_device(dev, "bench: --device");
    if (d == Device::cuda ? cuda_available() : dev == "cpu") return d;
    fail("bench: --device ", dev,
         ", but no CUDA device is available (or this build has no CUDA); bench measures the GPU step. To time "
         "the CPU reference instead, pass --device cpu explicitly (slow; a full-size config needs tens of GB of "
         "host memory)");
}

}  // namespace

int cmd_bench(const Args& args) {
    return with_path_errors("bench", [&] {
        const ParsedArgs a(args,
                           {"config", "layers", "micro-batch", "seq-len", "steps", "warmup", "precision", "device",
                            "seed", "recompute", "ep-size", "ep-chunks", "timeout"},
                           {"profile", "phases", "no-zero1"}, "bench");
        const std::filesystem::path cfg_file = a.require("config", "bench");
        json::Value config =
            json::parse(io::read_text_file(cfg_file, 4u << 20), cfg_file.string(), json::ParseOptions::hf_config());
        if (a.has("layers") && config.is_object()) {
            // The first N layers of the geometry (dense layers by index dropped: every layer as the rule says).
            const int64_t layers = parse_int_option(a.get("layers"), "layers");
            config.set("num_hidden_layers", layers);
            if (config.find("mlp_only_layers") != nullptr) config.set("mlp_only_layers", json::Value::array());
            // A hybrid's layer plan (Nemotron-H) is cut to its first N entries.
            if (const json::Value* p = config.find("hybrid_override_pattern"); p != nullptr && p->is_string())
                config.set("hybrid_override_pattern", p->as_string().substr(0, static_cast<size_t>(layers)));
            if (const json::Value* p = config.find("layers_block_type"); p != nullptr && p->is_array()) {
                json::Value::Array kept(p->as_array().begin(),
                                        p->as_array().begin() + std::min<int64_t>(layers, p->size()));
                config.set("layers_block_type", json::Value(std::move(kept)));
            }
        }
        const model::ModelSpec cfg = model::parse_model_config(config, cfg_file.string());
        const int64_t B = parse_int_option(a.get("micro-batch", "2"), "micro-batch");
        const int64_t T = parse_int_option(a.get("seq-len", "4096"), "seq-len");
        const int64_t steps = parse_int_option(a.get("steps", "5"), "steps");
        const int64_t warmup = parse_int_option(a.get("warmup", "2"), "warmup");
        const std::string precision = a.get("precision", "bf16");
        if (precision != "bf16" && precision != "mixed") fail("bench: --precision must be bf16 or mixed");
        const Device device = bench_device(a.get("device", "auto"));
        const bool mixed = precision == "mixed";
        train::Recipe run;  // the distributed part of a recipe, from the options
        run.source = "bench";
        run.dist.ep_size = parse_int_option(a.get("ep-size", "1"), "ep-size");
        run.dist.ep_chunks = parse_int_option(a.get("ep-chunks", "1"), "ep-chunks");
        if (run.dist.ep_chunks < 1 || run.dist.ep_chunks > 64) fail("bench: --ep-chunks must be in [1, 64]");
        run.dist.timeout_s = static_cast<double>(parse_int_option(a.get("timeout", "300"), "timeout"));
        const auto dist = train::DistContext::from_environment(run, device);  // before the model: picks the GPU
        if (cfg.num_experts() % run.dist.ep_size != 0)
            fail("bench: --ep-size ", run.dist.ep_size, " must divide the ", cfg.num_experts(), " experts");

        const size_t mem0 = device_memory_used();
        model::CausalLM m(cfg,
                          {device, device == Device::cuda && !mixed ? DType::bf16 : DType::f32, dist->expert_shard()});
        if (dist->ep_size() > 1) m.set_expert_parallel(dist->ep_group(), run.dist.ep_chunks);
        dist->gather_embedding_grads(m);
        uint64_t seed = static_cast<uint64_t>(parse_int_option(a.get("seed", "0"), "seed"));
        for (const auto& s : m.params().specs()) {
            // Replicated tensors: the same draws on every rank; expert shards: each rank its own.
            const uint64_t sd = (seed++) * 1000003u + (s.is_expert ? static_cast<uint64_t>(s.expert_first) : 0u);
            if (s.role == model::ParamRole::norm || s.role == model::ParamRole::bias)  // norms: ones; biases: zeros
                ops::fill_normal(m.param(s.name), sd, s.role == model::ParamRole::norm ? 1.0f : 0.0f, 0.0f);
            else
                ops::fill_normal(m.param(s.name), sd, 0.0f, 0.02f);
        }
        m.set_recompute(model::parse_recompute(a.get("recompute", "none")));
        train::Recipe::Optim optim;
        optim.lr = 1e-5;
        optim.weight_decay = 0.01;
        train::AdamW adamw(m, optim, mixed, a.has("no-zero1") ? nullptr : dist->group(train::Group::world),
                           a.has("no-zero1") ? nullptr : dist->dp_group());

        std::mt19937 rng(1234u + static_cast<unsigned>(dist->rank()));
        std::vector<std::vector<int32_t>> rows(static_cast<size_t>(B));
        for (auto& r : rows)
            for (int64_t t = 0; t < T; ++t)
                r.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(cfg.vocab_size)));
        const data::Batch batch = data::make_row_batch(rows, {}, T, 0);
        const int64_t targets = dist->sum_i64(batch.num_targets());
        const model::LossScales scales{1.0 / static_cast<double>(targets),
                                       cfg.output_router_logits ? cfg.router_aux_loss_coef / dist->world_size() : 0.0};

        double last_loss = 0, timed = 0;
        auto span_start = std::chrono::steady_clock::now();
        auto last_end = span_start;
        for (int64_t i = 0; i < warmup + steps; ++i) {
            if (i == warmup && a.has("profile")) {
                ops::reset_profile();
                ops::set_profiling(true);
            }
            const bool phases = i >= warmup && a.has("phases");
            // Everything of the steps before, the optimizer's writes still pending included (AdamW::step
            // returns with its broadcasts running beside the next forward), is done before a timed span
            // starts, and the last timed step's are done before it ends.
            auto settle = [&] {
                (void)m.params_tensor();
                ops::synchronize(device);
            };
            if (i == warmup || phases) {
                settle();
                span_start = last_end = std::chrono::steady_clock::now();
            }
            if (phases) ops::phase_start(device);
            dist->begin_grad_sync(m);
            const model::StepStats s = m.step(batch, &scales);
            dist->finish_grad_sync(m);
            ops::phase_mark("grad sync");
            const double clip = train::clip_coefficient(train::grad_norm(m, dist.get()), 1.0);
            ops::phase_mark("grad norm");
            adamw.step(optim.lr, clip);
            ops::phase_mark("adamw");
            m.zero_grads();
            ops::phase_mark("zero grads");
            const double sums[2] = {s.ce_sum, s.aux};
            const std::vector<double> total = dist->sum_f64(sums);
            last_loss = total[0] / static_cast<double>(targets) + scales.aux * total[1];  // aux: the mean over ranks
            if (phases) {
                (void)m.params_tensor();
                ops::phase_stop();  // synchronises
            } else if (i + 1 == warmup + steps && i >= warmup) {
                settle();
            }
            const auto now = std::chrono::steady_clock::now();
            const double dt = std::chrono::duration<double>(now - last_end).count();
            last_end = now;
            if (phases)
                timed += std::chrono::duration<double>(now - span_start).count();
            else if (i + 1 == warmup + steps && i >= warmup)
                timed = std::chrono::duration<double>(now - span_start).count();
            if (dist->is_main())
                std::fprintf(stderr, "bench step %lld: %.1f ms, loss %.4f\n", static_cast<long long>(i + 1), dt * 1e3,
                             last_loss);
        }
        const double step_s = timed / static_cast<double>(std::max<int64_t>(steps, 1));
        const double tps = static_cast<double>(B * T) / step_s;
        const double flops = m.flops_per_token(T);
        // The largest of the ranks' peaks (each rank puts its own value in its slot of a sum).
        std::vector<double> mems(static_cast<size_t>(dist->world_size()), 0.0);
        mems[static_cast<size_t>(dist->rank())] =
            device == Device::cuda ? static_cast<double>(device_memory_used() - mem0) : 0.0;
        mems = dist->sum_f64(mems);
        const double mem = *std::max_element(mems.begin(), mems.end());
        json::Value v = json::Value::object();
        v.set("system", "moeforge");
        v.set("device", device_name(device));
        v.set("precision", precision);
        v.set("recompute", a.get("recompute", "none"));
        v.set("layers", cfg.num_layers());
        v.set("micro_batch", B);
        v.set("seq_len", T);
        v.set("params", m.num_params_total());
        v.set("world_size", static_cast<int64_t>(dist->world_size()));
        v.set("ep_size", static_cast<int64_t>(dist->ep_size()));
        if (dist->ep_size() > 1) v.set("ep_chunks", run.dist.ep_chunks);
        v.set("zero1", !a.has("no-zero1") && dist->world_size() > 1);
        v.set("flops_per_token", json::Value(flops));
        v.set("step_ms", json::Value(step_s * 1e3));
        v.set("tokens_per_s_per_gpu", json::Value(tps));
        v.set("tflops_per_gpu", json::Value(tps * flops / 1e12));
        v.set("peak_gib", json::Value(mem / (1024.0 * 1024.0 * 1024.0)));
        v.set("activation_gib", json::Value(static_cast<double>(m.activation_bytes()) / (1024.0 * 1024.0 * 1024.0)));
        v.set("last_loss", json::Value(last_loss));
        if (a.has("profile")) {
            ops::set_profiling(false);
            json::Value prof = json::Value::object();
            for (const auto& op : ops::profile_report())
                prof.set(op.name, json::Value(op.seconds * 1e3 / static_cast<double>(std::max<int64_t>(steps, 1))));
            v.set("ms_per_step_by_op", std::move(prof));
        }
        if (a.has("phases") && dist->is_main()) {
            // Rank 0's timeline: when the device reached each mark, the phase's own share, and when the
            // host had enqueued it (host ahead of the device = positive slack).
            std::fprintf(stderr, "%-24s %10s %10s %10s %10s\n", "phase (rank 0)", "device_ms", "phase_ms", "host_ms",
                         "slack_ms");
            double prev = 0;
            for (const auto& p : ops::phase_report()) {
                std::fprintf(stderr, "%-24s %10.3f %10.3f %10.3f %10.3f\n", p.name.c_str(), p.gpu_ms, p.gpu_ms - prev,
                             p.host_ms, p.gpu_ms - p.host_ms);
                prev = p.gpu_ms;
            }
        }
        if (dist->is_main()) std::printf("%s\n", v.dump().c_str());
        return 0;
    });
}

}  // namespace mf::cli
