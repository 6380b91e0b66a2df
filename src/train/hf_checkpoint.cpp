#include "train/hf_checkpoint.h"

#include <cstring>
#include <set>

#include "core/bf16.h"
#include "io/file.h"
#include "io/safetensors.h"

namespace mf::train {

namespace fs = std::filesystem;

namespace {

constexpr size_t kMaxConfigBytes = 4u << 20;

// "model.layers.7.mlp.experts.gate_up_proj" -> "model.layers.7.mlp.experts."
bool is_stacked(const model::ParamSpec& s) { return s.is_expert; }

std::string expert_prefix(const std::string& stacked_name) {
    return stacked_name.substr(0, stacked_name.rfind('.') + 1);
}

}  // namespace

const std::vector<std::string>& tokenizer_file_names() {
    static const std::vector<std::string> names = {"tokenizer.json",  "tokenizer_config.json", "special_tokens_map.json",
                                                   "vocab.json",      "merges.txt",            "added_tokens.json",
                                                   "chat_template.jinja", "generation_config.json"};
    return names;
}

model::Qwen3MoeConfig read_hf_config(const fs::path& dir, json::Value* raw) {
    const fs::path file = dir / "config.json";
    if (!fs::is_directory(dir)) fail(dir.string(), ": not a model directory (missing or not a directory)");
    const std::string text = io::read_text_file(file, kMaxConfigBytes);
    json::Value cfg = json::parse(text, file.string());
    model::Qwen3MoeConfig c = model::Qwen3MoeConfig::from_json(cfg, file.string());
    if (raw != nullptr) *raw = std::move(cfg);
    return c;
}

namespace {

// One HF checkpoint tensor and where it lives in the flat parameter buffer.
struct HfTensor {
    std::string name;
    Shape shape;
    int64_t offset;  // elements into the flat buffer
};

// The HF tensors of a table, per-expert (what transformers writes), in parameter-table order. For
// a sharded table only the rank's experts appear (named by their global index, at local offsets).
std::vector<HfTensor> hf_layout(const model::Qwen3MoeConfig& cfg, const model::ParamTable& table) {
    std::vector<HfTensor> out;
    const int64_t I = cfg.moe_intermediate_size, H = cfg.hidden_size;
    for (const auto& spec : table.specs()) {
        if (!is_stacked(spec)) {
            out.push_back({spec.name, spec.shape, spec.offset});
            continue;
        }
        const std::string prefix = expert_prefix(spec.name);
        const bool gate_up = spec.name.ends_with("gate_up_proj");
        for (int64_t j = 0; j < spec.shape[0]; ++j) {
            const std::string ep = prefix + std::to_string(spec.expert_first + j) + ".";
            if (gate_up) {
                out.push_back({ep + "gate_proj.weight", {I, H}, spec.offset + j * 2 * I * H});
                out.push_back({ep + "up_proj.weight", {I, H}, spec.offset + j * 2 * I * H + I * H});
            } else {
                out.push_back({ep + "down_proj.weight", {H, I}, spec.offset + j * H * I});
            }
        }
    }
    return out;
}

}  // namespace

std::unique_ptr<model::Qwen3Moe> load_hf_model(const fs::path& dir, json::Value* raw_config,
                                               model::ModelPlacement placement) {
    model::Qwen3MoeConfig cfg = read_hf_config(dir, raw_config);
    const io::ModelWeights weights = io::ModelWeights::open(dir);
    const model::ParamTable table = model::qwen3_moe_param_table(cfg);
    // First a count: the per-expert layout below has an entry per expert and layer, each needing at
    // least one value, so a config naming millions of tiny experts over a small file is refused here
    // instead of costing minutes and gigabytes before the first missing tensor is noticed.
    uint64_t held = 0, entries = 0;
    for (const io::SafetensorsFile& f : weights.files())
        for (const io::StTensor& t : f.tensors()) held += t.nbytes / io::st_dtype_size(t.dtype);
    const uint64_t num_experts = static_cast<uint64_t>(cfg.num_experts);
    for (const auto& spec : table.specs())
        entries += !is_stacked(spec) ? 1 : num_experts * (spec.name.ends_with("gate_up_proj") ? 2 : 1);
    if (entries > held)
        fail(dir.string(), ": config.json describes ", entries, " tensors (", cfg.num_experts, " experts in ",
             cfg.num_hidden_layers, " layers) but the weights hold only ", held, " values");

    // Every tensor is located and shape-checked before anything of the model's size is allocated,
    // so a config describing a huge model over small files fails with the tensor named.
    struct Source {
        const HfTensor* dst;
        std::string name;  // the checkpoint's name (per-expert, or the v5 stacked spelling)
        Shape shape;
    };
    std::vector<Source> sources;
    std::set<std::string> used;
    const std::vector<HfTensor> layout = hf_layout(cfg, table);
    std::vector<HfTensor> stacked;  // v5 spelling: one tensor per stacked parameter
    for (const auto& spec : table.specs())
        if (is_stacked(spec) && weights.find(spec.name) != nullptr) stacked.push_back({spec.name, spec.shape, spec.offset});
    for (const auto& t : stacked) sources.push_back({&t, t.name, t.shape});
    for (const auto& t : layout) {
        bool covered = false;
        for (const auto& st : stacked)
            covered = covered || (t.offset >= st.offset && t.offset < st.offset + shape_numel(st.shape));
        if (!covered) sources.push_back({&t, t.name, t.shape});
    }
    for (const auto& src : sources) {
        const io::StTensor* t = weights.find(src.name);
        if (t == nullptr) fail(dir.string(), ": tensor \"", src.name, "\" is missing (needed by config.json)");
        if (t->shape != src.shape)
            fail(t->file, ": tensor \"", src.name, "\" has shape ", shape_str(t->shape), ", config.json implies ",
                 shape_str(src.shape));
        used.insert(src.name);
    }
    for (const auto& name : weights.names()) {
        if (used.count(name)) continue;
        // HF drops a tied lm_head on save, but a checkpoint that still has it is fine.
        if (name == "lm_head.weight" && cfg.tie_word_embeddings) continue;
        fail(dir.string(), ": tensor \"", name, "\" is not a parameter of this qwen3_moe model (",
             cfg.num_hidden_layers, " layers, ", cfg.num_experts, " experts)");
    }

    // Everything checked against the whole model; now read what this rank holds (its experts).
    auto m = std::make_unique<model::Qwen3Moe>(std::move(cfg), placement);
    const model::ParamTable& local = m->params();
    std::vector<float> host(static_cast<size_t>(m->num_params()));
    for (const auto& spec : local.specs()) {
        if (is_stacked(spec) && weights.find(spec.name) != nullptr)  // v5 spelling: the rank's rows of it
            weights.read_f32_rows(spec.name, spec.global_shape(), spec.expert_first, spec.shape[0],
                                  host.data() + spec.offset);
    }
    for (const auto& t : hf_layout(m->config(), local)) {
        if (weights.find(t.name) == nullptr) continue;  // inside a stacked tensor read above
        weights.read_f32(t.name, t.shape, host.data() + t.offset);
    }
    m->set_params_from_host(host.data());
    return m;
}

io::StDType export_dtype(const model::Qwen3MoeConfig& cfg) {
    if (cfg.dtype == "bfloat16") return io::StDType::BF16;
    if (cfg.dtype == "float16") return io::StDType::F16;
    return io::StDType::F32;
}

uint64_t export_bytes(const model::Qwen3MoeConfig& cfg) {
    return static_cast<uint64_t>(model::qwen3_moe_param_table(cfg).total()) *
           static_cast<uint64_t>(io::st_dtype_size(export_dtype(cfg)));
}

bool is_weight_file_name(const std::string& name) {
    if (name == "model.safetensors" || name == "model.safetensors.index.json") return true;
    // model-00001-of-00003.safetensors
    return name.size() == 32 && name.rfind("model-", 0) == 0 && name.ends_with(".safetensors") &&
           name.substr(11, 4) == "-of-";
}

void save_hf_model(const fs::path& dir, model::Qwen3Moe& m, const json::Value* raw_config, const fs::path& tokenizer_dir,
                   size_t max_shard_bytes) {
    MF_CHECK(!m.expert_shard().sharded(), "save_hf_model: this model holds one expert shard; gather the full "
                                          "model through a ParamSource (DistContext::export_source)");
    std::vector<float> host(static_cast<size_t>(m.num_params()));
    m.get_params_to_host(host.data());
    save_hf_model(dir, m.config(), host, raw_config, tokenizer_dir, max_shard_bytes);
}

void save_hf_model(const fs::path& dir, const model::Qwen3MoeConfig& cfg, const std::vector<float>& host,
                   const json::Value* raw_config, const fs::path& tokenizer_dir, size_t max_shard_bytes) {
    const int64_t total = model::qwen3_moe_param_table(cfg).total();
    MF_CHECK(static_cast<int64_t>(host.size()) == total, "save_hf_model: ", host.size(), " parameters given, the model has ",
             total);
    const ParamSource source = [&host](int64_t offset, int64_t n, float* out) {
        std::memcpy(out, host.data() + offset, static_cast<size_t>(n) * sizeof(float));
    };
    save_hf_model(dir, cfg, source, raw_config, tokenizer_dir, max_shard_bytes);
}

void save_hf_model(const fs::path& dir, const model::Qwen3MoeConfig& cfg, const ParamSource& source,
                   const json::Value* raw_config, const fs::path& tokenizer_dir, size_t max_shard_bytes) {
    json::Value config = raw_config != nullptr ? *raw_config : cfg.to_json();
    const io::StDType dtype = export_dtype(cfg);
    const model::ParamTable table = model::qwen3_moe_param_table(cfg);

    // Each tensor is produced when the writer reaches it (in this order): fetched as f32 from the
    // source, converted into the writer's buffer.
    std::vector<float> f32;  // staging for bf16 output (reused)
    std::vector<io::StWriteTensor> tensors;
    for (const auto& t : hf_layout(cfg, table)) {
        const int64_t n = shape_numel(t.shape), offset = t.offset;
        io::StWriteTensor w{t.name, dtype, t.shape, nullptr};
        w.fill = [&source, &f32, dtype, offset, n](void* out) {
            if (dtype == io::StDType::F32) {
                source(offset, n, static_cast<float*>(out));
                return;
            }
            f32.resize(static_cast<size_t>(n));
            source(offset, n, f32.data());
            auto* o = static_cast<uint16_t*>(out);
            if (dtype == io::StDType::BF16)
                for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(f32[static_cast<size_t>(i)]);
            else
                for (int64_t i = 0; i < n; ++i) o[i] = f32_to_f16(f32[static_cast<size_t>(i)]);
        };
        tensors.push_back(std::move(w));
    }
    io::write_model_weights(dir, tensors, max_shard_bytes);
    io::atomic_write_file(dir / "config.json", config.dump(2) + "\n");
    if (!tokenizer_dir.empty()) {
        for (const auto& name : tokenizer_file_names()) {
            const fs::path src = tokenizer_dir / name;
            if (fs::is_regular_file(src)) io::atomic_write_file(dir / name, io::read_text_file(src, size_t{256} << 20));
        }
    }
}

}  // namespace mf::train
