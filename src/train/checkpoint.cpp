#include "train/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <vector>

#include "io/file.h"
#include "io/safetensors.h"
#include "train/distributed.h"

namespace mf::train {

namespace fs = std::filesystem;

namespace {

std::string step_dir_name(int64_t step) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
    return buf;
}

// step-NNNNNNNN -> NNNNNNNN, or -1 for anything else (temporary directories included).
int64_t parse_step_dir(const std::string& name) {
    if (name.size() != 13 || name.rfind("step-", 0) != 0) return -1;
    int64_t v = 0;
    for (size_t i = 5; i < name.size(); ++i) {
        if (name[i] < '0' || name[i] > '9') return -1;
        v = v * 10 + (name[i] - '0');
    }
    return v;
}

std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& root) {
    std::vector<std::pair<int64_t, fs::path>> out;
    std::error_code ec;
    if (!fs::is_directory(root, ec)) return out;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
        const int64_t step = parse_step_dir(entry.path().filename().string());
        if (step >= 0 && entry.is_directory()) out.emplace_back(step, entry.path());
    }
    std::sort(out.begin(), out.end());
    return out;
}

std::string hex(uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
    return buf;
}

// The recipe keys a resume must keep: they decide which data each step sees and what is trained.
constexpr const char* kResumeKeys[][2] = {
    {"model", nullptr},       {"data", "train"},       {"data", "format"},     {"data", "packing"},
    {"data", "shuffle"},      {"train", "seq_len"},    {"train", "micro_batch"}, {"train", "grad_accum"},
    {"seed", nullptr},
};

const json::Value* lookup(const json::Value& v, const char* a, const char* b) {
    const json::Value* x = v.find(a);
    return (x != nullptr && b != nullptr) ? x->find(b) : x;
}

// Tensor name prefixes: the master parameters and AdamW's two moments.
const std::string kStateTensors[] = {"param/", "exp_avg/", "exp_avg_sq/"};

}  // namespace

void save_checkpoint(const fs::path& root, const CheckpointState& state, model::Qwen3Moe& model, AdamW& adam,
                     int64_t keep, const CheckpointLayout& layout, DistContext* dist) {
    // Collective part: this rank's state, whole over the ZeRO group, then over the EP group.
    std::vector<float> local[3];
    adam.get_state(local[0], local[1], local[2]);
    std::vector<float> full[3];
    for (int i = 0; i < 3; ++i) full[i] = dist != nullptr ? dist->gather_params(model, local[i]) : std::move(local[i]);
    if (dist != nullptr && !dist->is_main()) return;

    fs::create_directories(root);
    const fs::path final_dir = root / step_dir_name(state.step);
    {
        io::AtomicDir dir(final_dir);
        const model::ParamTable table = model::qwen3_moe_param_table(model.config());
        const int64_t P = table.total();
        std::vector<io::StWriteTensor> tensors;
        for (int i = 0; i < 3; ++i) {
            MF_CHECK(static_cast<int64_t>(full[i].size()) == P, "checkpoint: gathered state has the wrong size");
            for (const auto& spec : table.specs())
                tensors.push_back({kStateTensors[i] + spec.name, io::StDType::F32, spec.shape,
                                   full[i].data() + spec.offset});
        }
        io::write_safetensors(dir.tmp_path() / "tensors.safetensors", tensors, {{"format", "moeforge"}});
        json::Value s = json::Value::object();
        s.set("magic", kCheckpointMagic);
        s.set("format_version", kCheckpointFormatVersion);
        s.set("world_size", layout.world_size);
        s.set("ep_size", layout.ep_size);
        s.set("config_hash", hex(model.config().hash()));
        s.set("num_params", P);
        s.set("step", state.step);
        s.set("adam_step", state.adam_step);
        json::Value loader = json::Value::object();
        loader.set("epoch", state.loader.epoch);
        loader.set("cursor", state.loader.cursor);
        s.set("loader", std::move(loader));
        s.set("recipe", state.recipe);
        io::atomic_write_file(dir.tmp_path() / "state.json", s.dump(2) + "\n");
        dir.commit();
    }
    // Prune: the newest `keep` complete checkpoints stay; leftovers of crashed writes go.
    auto all = list_checkpoints(root);
    for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove_all(all[i].second);
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root, ec))
        if (entry.path().filename().string().find(".tmp-") != std::string::npos) fs::remove_all(entry.path(), ec);
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
    auto all = list_checkpoints(root);
    if (all.empty()) return std::nullopt;
    return all.back().second;
}

CheckpointState load_checkpoint(const fs::path& dir, const Recipe& recipe, model::Qwen3Moe& model, AdamW& adam,
                                bool force, const CheckpointLayout& layout) {
    const fs::path state_file = dir / "state.json";
    const std::string where = state_file.string();
    const json::Value s = json::parse(io::read_text_file(state_file, 64u << 20), where);
    auto field = [&](const char* key) -> const json::Value& {
        const json::Value* v = s.find(key);
        if (v == nullptr) fail(where, ": missing field \"", key, "\"");
        return *v;
    };
    if (!field("magic").is_string() || field("magic").as_string() != kCheckpointMagic)
        fail(where, ": not a moeforge training checkpoint (bad magic)");
    if (!field("format_version").is_int() || field("format_version").as_int() != kCheckpointFormatVersion)
        fail(where, ": checkpoint format version ", field("format_version").dump(), ", this build reads version ",
             kCheckpointFormatVersion);
    if (!field("world_size").is_int() || !field("ep_size").is_int())
        fail(where, ": \"world_size\" and \"ep_size\" must be integers");
    if (field("config_hash").as_string() != hex(model.config().hash()))
        fail(where, ": the checkpoint was written for a different model config (hash ", field("config_hash").as_string(),
             ", this model ", hex(model.config().hash()), ")");
    if (field("num_params").as_int() != model.num_params_total())
        fail(where, ": checkpoint has ", field("num_params").as_int(), " parameters, the model ",
             model.num_params_total());
    if ((field("world_size").as_int() != layout.world_size || field("ep_size").as_int() != layout.ep_size) &&
        layout.rank == 0)
        std::printf("resume: checkpoint written at world size %lld (EP %lld), continuing at world size %lld (EP %lld); "
                    "the global batch is now %lld rows per micro-step\n",
                    static_cast<long long>(field("world_size").as_int()), static_cast<long long>(field("ep_size").as_int()),
                    static_cast<long long>(layout.world_size), static_cast<long long>(layout.ep_size),
                    static_cast<long long>(layout.world_size * recipe.train.micro_batch));

    const json::Value now = recipe.to_json();
    const json::Value& then = field("recipe");
    std::string diffs;
    for (const auto& key : kResumeKeys) {
        const json::Value* a = lookup(then, key[0], key[1]);
        const json::Value* b = lookup(now, key[0], key[1]);
        const std::string av = a != nullptr ? a->dump() : "(absent)", bv = b != nullptr ? b->dump() : "(absent)";
        if (av != bv) diffs += std::string(diffs.empty() ? "" : "; ") + key[0] + (key[1] ? std::string(".") + key[1] : "") +
                               " was " + av + ", now " + bv;
    }
    if (!diffs.empty() && !force)
        fail(dir.string(), ": the recipe changed since this checkpoint (", diffs,
             "); resuming would not continue the same run. Pass --force-resume to resume anyway");

    CheckpointState state;
    state.step = field("step").as_int();
    state.adam_step = field("adam_step").as_int();
    const json::Value& loader = field("loader");
    if (!loader.is_object() || loader.find("epoch") == nullptr || loader.find("cursor") == nullptr)
        fail(where, ": field \"loader\" must hold epoch and cursor");
    state.loader.epoch = loader.find("epoch")->as_int();
    state.loader.cursor = loader.find("cursor")->as_int();
    if (state.step < 0 || state.adam_step < 0 || state.loader.epoch < 0 || state.loader.cursor < 0)
        fail(where, ": negative step or loader position");
    state.recipe = then;

    // Every tensor of the whole model is checked before anything is restored; this rank reads its
    // slice (its experts).
    const fs::path file = dir / "tensors.safetensors";
    const io::SafetensorsFile tensors = io::SafetensorsFile::open(file);
    const model::ParamTable& mine = model.params();
    std::vector<float> local[3];
    for (int i = 0; i < 3; ++i) {
        local[i].resize(static_cast<size_t>(mine.total()));
        for (const auto& spec : mine.specs()) {
            const std::string name = kStateTensors[i] + spec.name;
            const io::StTensor* t = tensors.find(name);
            if (t == nullptr) fail(file.string(), ": missing tensor \"", name, "\"");
            if (t->dtype != io::StDType::F32 || t->shape != spec.global_shape())
                fail(file.string(), ": tensor \"", name, "\" has the wrong dtype or shape (expected F32 ",
                     shape_str(spec.global_shape()), ")");
            const int64_t first = spec.is_expert ? spec.expert_first * (spec.numel / spec.shape[0]) : 0;
            std::memcpy(local[i].data() + spec.offset, t->data + static_cast<size_t>(first) * sizeof(float),
                        static_cast<size_t>(spec.numel) * sizeof(float));
        }
    }
    if (tensors.tensors().size() != 3 * mine.specs().size())
        fail(file.string(), ": holds ", tensors.tensors().size(), " tensors, expected ", 3 * mine.specs().size());
    adam.set_state(local[0], local[1], local[2]);

    adam.set_step_count(state.adam_step);
    return state;
}

}  // namespace mf::train
