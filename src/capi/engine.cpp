// The C API's engine (include/moeforge/moeforge.h): a train::Trainer, the object `moeforge finetune`
// steps (train/trainer.h), opened from a recipe as the CLI opens one, so the API's job and the CLI's
// are one code path. Interruption: the CLI installs the signal handlers of core/interrupt.h; the
// API leaves the process's handlers to its host (an interpreter has its own), so a step is never
// cut short by the engine; a host that wants the CLI's behaviour calls the interrupt hooks itself.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "capi/capi_util.h"
#include "core/device_choice.h"
#include "model/causal_lm.h"
#include "train/recipe.h"
#include "train/trainer.h"

struct mf_engine {
    std::unique_ptr<mf::train::Trainer> trainer;
};

using mf::capi::copy_out;
using mf::capi::guarded;
using mf::capi::refuse;

namespace {

mf::train::Trainer& trainer_of(const char* op, const mf_engine* engine) {
    if (engine == nullptr || engine->trainer == nullptr) refuse(op, ": engine is NULL (open one with mf_engine_open)");
    return *engine->trainer;
}

void fill_descriptor(const mf::Tensor& t, mf_tensor* out) {
    *out = mf_tensor{};
    out->data = t.data();
    out->dtype = static_cast<int32_t>(t.dtype());
    out->device_type = t.device() == mf::Device::cuda ? MF_CUDA : MF_CPU;
    out->device_index = t.device() == mf::Device::cuda ? mf::current_cuda_device() : 0;
    out->ndim = t.ndim();
    for (int i = 0; i < t.ndim(); ++i) out->shape[i] = t.dim(i);
    out->strides = nullptr;
}

}  // namespace

extern "C" {

mf_status mf_engine_open(mf_engine** engine, const char* recipe, int is_text, const char* base_dir,
                         const char* const* overrides, int64_t num_overrides, const char* resume, int force_resume) {
    return guarded([&] {
        const char* op = "mf_engine_open";
        if (engine == nullptr) refuse(op, ": engine (the handle's address) is NULL");
        *engine = nullptr;
        if (recipe == nullptr) refuse(op, ": recipe is NULL (a recipe file's path, or YAML text with is_text)");
        if (num_overrides < 0 || (num_overrides > 0 && overrides == nullptr))
            refuse(op, ": ", num_overrides, " overrides at ", overrides == nullptr ? "NULL" : "an array");
        std::vector<std::string> list;
        for (int64_t i = 0; i < num_overrides; ++i) {
            if (overrides[i] == nullptr) refuse(op, ": overrides[", i, "] is NULL");
            list.emplace_back(overrides[i]);
        }
        mf::train::Recipe r =
            is_text != 0 ? mf::train::parse_recipe(recipe, "recipe text", list, base_dir != nullptr ? base_dir : "")
                         : mf::train::load_recipe(recipe, list);
        mf::train::ResumeOptions options;
        options.from = resume != nullptr ? resume : "";
        options.force = force_resume != 0;
        auto handle = std::make_unique<mf_engine>();
        handle->trainer = std::make_unique<mf::train::Trainer>(std::move(r), options);
        *engine = handle.release();
    });
}

mf_status mf_engine_step(mf_engine* engine, mf_step_metrics* metrics) {
    return guarded([&] {
        const mf::train::StepMetrics m = trainer_of("mf_engine_step", engine).step();
        if (metrics == nullptr) return;
        *metrics = mf_step_metrics{};
        metrics->step = m.step;
        metrics->loss = m.loss;
        metrics->ce_loss = m.ce_loss;
        metrics->aux_loss = m.aux_loss;
        metrics->grad_norm = m.grad_norm;
        metrics->lr = m.lr;
        metrics->tokens = m.tokens;
        metrics->tokens_per_s = m.tokens_per_s;
        metrics->peak_mem_gib = m.peak_mem_gib;
        metrics->step_seconds = m.step_seconds;
        metrics->skipped = m.skipped ? 1 : 0;
        metrics->val_loss = m.val_loss;
    });
}

mf_status mf_engine_progress(const mf_engine* engine, int64_t* steps_done, int64_t* total_steps,
                             int32_t* interrupted_by) {
    return guarded([&] {
        const mf::train::Trainer& t = trainer_of("mf_engine_progress", engine);
        if (steps_done != nullptr) *steps_done = t.steps_done();
        if (total_steps != nullptr) *total_steps = t.recipe().train.steps;
        if (interrupted_by != nullptr) *interrupted_by = t.interrupted_by();
    });
}

mf_status mf_engine_save_checkpoint(mf_engine* engine) {
    return guarded([&] { trainer_of("mf_engine_save_checkpoint", engine).save_checkpoint(); });
}

mf_status mf_engine_export(mf_engine* engine, char* out_dir, size_t out_dir_bytes) {
    return guarded([&] {
        const std::string out = trainer_of("mf_engine_export", engine).export_model();
        copy_out(out, out_dir, out_dir_bytes, nullptr);
    });
}

mf_status mf_engine_recipe_json(const mf_engine* engine, char* json, size_t json_bytes, size_t* needed) {
    return guarded([&] {
        const mf::train::Trainer& t = trainer_of("mf_engine_recipe_json", engine);
        copy_out(t.recipe().to_json().dump(2), json, json_bytes, needed);
    });
}

mf_status mf_engine_num_params(const mf_engine* engine, int64_t* count) {
    return guarded([&] {
        mf::train::Trainer& t = trainer_of("mf_engine_num_params", engine);
        if (count == nullptr) refuse("mf_engine_num_params: count is NULL");
        *count = static_cast<int64_t>(t.model().params().specs().size());
    });
}

mf_status mf_engine_param_name(const mf_engine* engine, int64_t index, char* name, size_t name_bytes, size_t* needed) {
    return guarded([&] {
        mf::train::Trainer& t = trainer_of("mf_engine_param_name", engine);
        const auto& specs = t.model().params().specs();
        if (index < 0 || index >= static_cast<int64_t>(specs.size()))
            refuse("mf_engine_param_name: index ", index, " outside [0, ", specs.size(), ")");
        copy_out(specs[static_cast<size_t>(index)].name, name, name_bytes, needed);
    });
}

mf_status mf_engine_param(const mf_engine* engine, const char* name, int gradient, mf_tensor* out) {
    return guarded([&] {
        mf::train::Trainer& t = trainer_of("mf_engine_param", engine);
        if (name == nullptr || out == nullptr) refuse("mf_engine_param: name and out are required (got NULL)");
        const mf::model::CausalLM& model = t.model();
        if (model.params().find(name) == nullptr)
            refuse("mf_engine_param: the model has no parameter named '", name, "' (mf_engine_param_name lists them)");
        fill_descriptor(gradient != 0 ? model.grad(name) : model.param(name), out);
    });
}

void mf_engine_free(mf_engine* engine) { delete engine; }

}  // extern "C"
