#include "train/hf_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/bf16.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "model/arch/architecture.h"

namespace mf::train {

namespace fs = std::filesystem;

namespace {

constexpr size_t kMaxConfigBytes = 4u << 20;

bool is_stacked(const model::ParamSpec& s) { return !s.storage.expert_pieces.empty(); }

// "model.layers.3.mlp.experts.{}.gate_proj.weight" with the expert's index in place of "{}".
std::string expert_piece_name(const std::string& pattern, int64_t expert) {
    const size_t at = pattern.find("{}");
    MF_CHECK(at != std::string::npos, "expert storage pattern without {}: ", pattern);
    return pattern.substr(0, at) + std::to_string(expert) + pattern.substr(at + 2);
}

}  // namespace

const std::vector<std::string>& tokenizer_file_names() {
    static const std::vector<std::string> names = {
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
        "merges.txt",     "added_tokens.json",     "chat_template.jinja",     "generation_config.json",
        "tiktoken.model", "tokenization_kimi.py"};
    return names;
}

model::ModelSpec read_hf_config(const fs::path& dir, json::Value* raw) {
    const fs::path file = dir / "config.json";
    if (!fs::is_directory(dir)) fail(dir.string(), ": not a model directory (missing or not a directory)");
    const std::string text = io::read_text_file(file, kMaxConfigBytes);
    json::Value cfg = json::parse(text, file.string(), json::ParseOptions::hf_config());
    model::ModelSpec c = model::parse_model_config(cfg, file.string());
    if (raw != nullptr) *raw = std::move(cfg);
    return c;
}

namespace {

// One HF checkpoint tensor and where it lives in the flat parameter buffer.
struct HfTensor {
    std::string name;
    Shape shape;            // as stored (a reshaped stack: its local experts)
    int64_t offset;         // elements into the flat buffer
    size_t spec;            // the parameter it is (part of), an index into the table's specs()
    bool reshaped = false;  // a stacked tensor stored transposed / interleaved (ParamStorage)
};

// One expert's [R, C] slice between the engine's layout and a reshaped storage (ParamStorage):
// interleaved rows (gate row i at 2i, up row i at 2i + 1), then transposed to [C, R].
// Where element (r, c) of an expert's engine slice [R, C] lies in its reshaped storage.
int64_t disk_index(int64_t r, int64_t c, int64_t R, int64_t C, const model::ParamStorage& st) {
    const int64_t sr = st.interleaved ? (r < R / 2 ? 2 * r : 2 * (r - R / 2) + 1) : r;
    return st.transposed ? c * R + sr : sr * C + c;
}

void engine_to_disk(const float* engine, float* disk, int64_t R, int64_t C, const model::ParamStorage& st) {
    for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) disk[disk_index(r, c, R, C, st)] = engine[r * C + c];
}

void disk_to_engine(const float* disk, float* engine, int64_t R, int64_t C, const model::ParamStorage& st) {
    for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) engine[r * C + c] = disk[disk_index(r, c, R, C, st)];
}

// The stored shape of a reshaped stack of `experts` experts.
Shape reshaped_shape(const model::ParamSpec& s, int64_t experts) {
    return s.storage.transposed ? Shape{experts, s.shape[2], s.shape[1]} : Shape{experts, s.shape[1], s.shape[2]};
}

// The HF tensors of a table as checkpoints store them (ParamStorage), in parameter-table order. For
// a sharded table only the rank's experts appear (named by their global index, at local offsets).
std::vector<HfTensor> hf_layout(const model::ParamTable& table) {
    std::vector<HfTensor> out;
    for (size_t i = 0; i < table.specs().size(); ++i) {
        const model::ParamSpec& spec = table.specs()[i];
        if (spec.storage.reshaped()) {
            out.push_back({spec.disk_name(), reshaped_shape(spec, spec.shape[0]), spec.offset, i, true});
            continue;
        }
        if (!is_stacked(spec)) {
            out.push_back({spec.disk_name(), spec.shape, spec.offset, i});
            continue;
        }
        // Each expert's [rows, ...] slice is the pieces stacked along its rows, in order.
        const auto& pieces = spec.storage.expert_pieces;
        const int64_t per_expert = spec.numel / spec.shape[0];
        const int64_t num_pieces = static_cast<int64_t>(pieces.size());
        MF_CHECK(spec.shape.size() == 3 && spec.shape[1] % num_pieces == 0, spec.name, ": ", num_pieces,
                 " pieces do not split shape ", shape_str(spec.shape));
        const Shape piece_shape = {spec.shape[1] / num_pieces, spec.shape[2]};
        const int64_t piece_numel = shape_numel(piece_shape);
        for (int64_t j = 0; j < spec.shape[0]; ++j)
            for (int64_t k = 0; k < num_pieces; ++k)
                out.push_back({expert_piece_name(pieces[static_cast<size_t>(k)], spec.expert_first + j), piece_shape,
                               spec.offset + j * per_expert + k * piece_numel, i});
    }
    return out;
}

}  // namespace

std::unique_ptr<model::CausalLM> load_hf_model(const fs::path& dir, json::Value* raw_config,
                                               model::ModelPlacement placement) {
    return load_hf_weights(dir, read_hf_config(dir, raw_config), placement);
}

std::unique_ptr<model::CausalLM> load_hf_weights(const fs::path& dir, model::ModelSpec spec,
                                                 model::ModelPlacement placement) {
    const io::ModelWeights weights = io::ModelWeights::open(dir);
    const model::ParamTable table = model::model_param_table(spec);
    // First a count: the per-expert layout below has an entry per expert and layer, each needing at
    // least one value, so a config naming millions of tiny experts over a small file is refused here
    // instead of costing minutes and gigabytes before the first missing tensor is noticed.
    uint64_t held = 0, entries = 0;
    for (const io::SafetensorsFile& f : weights.files())
        for (const io::StTensor& t : f.tensors()) held += t.nbytes / io::st_dtype_size(t.dtype);
    for (const auto& s : table.specs())
        entries += !is_stacked(s) ? 1 : static_cast<uint64_t>(s.experts_total) * s.storage.expert_pieces.size();
    if (entries > held)
        fail(dir.string(), ": config.json describes ", entries, " tensors (", spec.num_experts(), " experts in ",
             spec.num_layers(), " layers) but the weights hold only ", held, " values");

    // Every tensor is located and shape-checked before anything of the model's size is allocated,
    // so a config describing a huge model over small files fails with the tensor named.
    struct Source {
        std::string name;  // the checkpoint's name
        Shape shape;
    };
    std::vector<Source> sources;
    std::set<std::string> used;
    // Stacked parameters in the v5 spelling (one tensor under the engine's name), and parameters of a
    // renamed module under the engine's name, are read as such; everything else as the layout says.
    std::vector<std::string> whole;  // engine names read whole
    for (const auto& s : table.specs())
        if ((is_stacked(s) || s.disk_name() != s.name) && !(s.storage.reshaped() && s.disk_name() == s.name) &&
            weights.find(s.name) != nullptr)
            whole.push_back(s.name);
    auto read_whole = [&whole](const std::string& name) {
        return std::find(whole.begin(), whole.end(), name) != whole.end();
    };
    for (const auto& s : table.specs())
        if (read_whole(s.name)) sources.push_back({s.name, s.global_shape()});
    for (const auto& t : hf_layout(table))
        if (!read_whole(table.specs()[t.spec].name)) sources.push_back({t.name, t.shape});  // the whole model
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
        if (name == "lm_head.weight" && spec.tie_word_embeddings) continue;
        fail(dir.string(), ": tensor \"", name, "\" is not a parameter of this ", spec.model_type, " model (",
             spec.num_layers(), " layers, ", spec.num_experts(), " experts)");
    }

    // Everything checked against the whole model; now read what this rank holds (its experts).
    auto m = std::make_unique<model::CausalLM>(std::move(spec), placement);
    const model::ParamTable& local = m->params();
    std::vector<float> host(static_cast<size_t>(m->num_params()));
    for (const auto& s : local.specs()) {
        if (!read_whole(s.name)) continue;
        if (s.is_expert)  // v5 spelling: the rank's rows of it
            weights.read_f32_rows(s.name, s.global_shape(), s.expert_first, s.shape[0], host.data() + s.offset);
        else
            weights.read_f32(s.name, s.shape, host.data() + s.offset);
    }
    std::vector<float> stored;  // one reshaped stack's rows of this rank, as stored
    for (const auto& t : hf_layout(local)) {
        const model::ParamSpec& s = local.specs()[t.spec];
        if (read_whole(s.name)) continue;
        if (!t.reshaped) {
            weights.read_f32(t.name, t.shape, host.data() + t.offset);
            continue;
        }
        stored.resize(static_cast<size_t>(s.numel));
        weights.read_f32_rows(t.name, reshaped_shape(s, s.experts_total), s.expert_first, s.shape[0], stored.data());
        const int64_t per = s.numel / s.shape[0];
        for (int64_t j = 0; j < s.shape[0]; ++j)
            disk_to_engine(stored.data() + j * per, host.data() + s.offset + j * per, s.shape[1], s.shape[2],
                           s.storage);
    }
    m->set_params_from_host(host.data());
    return m;
}

io::StDType export_dtype(const model::ModelSpec& cfg) {
    if (cfg.dtype == "bfloat16") return io::StDType::BF16;
    if (cfg.dtype == "float16") return io::StDType::F16;
    return io::StDType::F32;
}

uint64_t export_bytes(const model::ModelSpec& cfg) {
    return static_cast<uint64_t>(model::model_param_table(cfg).total()) *
           static_cast<uint64_t>(io::st_dtype_size(export_dtype(cfg)));
}

bool is_weight_file_name(const std::string& name) {
    if (name == "model.safetensors" || name == "model.safetensors.index.json") return true;
    // model-00001-of-00003.safetensors
    return name.size() == 32 && name.rfind("model-", 0) == 0 && name.ends_with(".safetensors") &&
           name.substr(11, 4) == "-of-";
}

void save_hf_model(const fs::path& dir, model::CausalLM& m, const json::Value* raw_config,
                   const fs::path& tokenizer_dir, size_t max_shard_bytes) {
    MF_CHECK(!m.expert_shard().sharded(),
             "save_hf_model: this model holds one expert shard; gather the full "
             "model through a ParamSource (DistContext::export_source)");
    std::vector<float> host(static_cast<size_t>(m.num_params()));
    m.get_params_to_host(host.data());
    save_hf_model(dir, m.spec(), host, raw_config, tokenizer_dir, max_shard_bytes);
}

void save_hf_model(const fs::path& dir, const model::ModelSpec& cfg, const std::vector<float>& host,
                   const json::Value* raw_config, const fs::path& tokenizer_dir, size_t max_shard_bytes) {
    const int64_t total = model::model_param_table(cfg).total();
    MF_CHECK(static_cast<int64_t>(host.size()) == total, "save_hf_model: ", host.size(),
             " parameters given, the model has ", total);
    const ParamSource source = [&host](int64_t offset, int64_t n, float* out) {
        std::memcpy(out, host.data() + offset, static_cast<size_t>(n) * sizeof(float));
    };
    save_hf_model(dir, cfg, source, raw_config, tokenizer_dir, max_shard_bytes);
}

void save_hf_model(const fs::path& dir, const model::ModelSpec& cfg, const ParamSource& source,
                   const json::Value* raw_config, const fs::path& tokenizer_dir, size_t max_shard_bytes) {
    json::Value config = raw_config != nullptr ? *raw_config : cfg.to_json();
    const io::StDType dtype = export_dtype(cfg);
    const model::ParamTable table = model::model_param_table(cfg);

    // Each tensor is produced when the writer reaches it (in this order): fetched as f32 from the
    // source, converted into the writer's buffer.
    std::vector<float> f32;  // staging for bf16 output (reused)
    std::vector<io::StWriteTensor> tensors;
    std::vector<float> engine;  // a reshaped stack in the engine's layout (reused)
    for (const auto& t : hf_layout(table)) {
        const int64_t n = shape_numel(t.shape), offset = t.offset;
        const model::ParamSpec* reshaped = t.reshaped ? &table.specs()[t.spec] : nullptr;
        io::StWriteTensor w{t.name, dtype, t.shape, nullptr};
        // The tensor's values as stored, as f32 (a reshaped stack converted expert by expert).
        auto fetch = [&source, &engine, reshaped, offset, n](float* dst) {
            if (reshaped == nullptr) return source(offset, n, dst);
            engine.resize(static_cast<size_t>(n));
            source(offset, n, engine.data());
            const int64_t per = n / reshaped->shape[0];
            for (int64_t j = 0; j < reshaped->shape[0]; ++j)
                engine_to_disk(engine.data() + j * per, dst + j * per, reshaped->shape[1], reshaped->shape[2],
                               reshaped->storage);
        };
        w.fill = [fetch, &f32, dtype, n](void* out) {
            if (dtype == io::StDType::F32) {
                fetch(static_cast<float*>(out));
                return;
            }
            f32.resize(static_cast<size_t>(n));
            fetch(f32.data());
            auto* o = static_cast<uint16_t*>(out);
            if (dtype == io::StDType::BF16)
                for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(f32[static_cast<size_t>(i)]);
            else
                for (int64_t i = 0; i < n; ++i) o[i] = f32_to_f16(f32[static_cast<size_t>(i)]);
        };
        tensors.push_back(std::move(w));
    }
    io::write_model_weights(dir, tensors, max_shard_bytes);
    // Non-finite values as transformers 5.x writes them ({"__float__": "Infinity"}): strict JSON.
    io::atomic_write_file(dir / "config.json", config.dump(2, json::NonFinite::hf_tagged) + "\n");
    if (!tokenizer_dir.empty()) {
        for (const auto& name : tokenizer_file_names()) {
            const fs::path src = tokenizer_dir / name;
            if (fs::is_regular_file(src)) io::atomic_write_file(dir / name, io::read_text_file(src, size_t{256} << 20));
        }
    }
}

}  // namespace mf::train
