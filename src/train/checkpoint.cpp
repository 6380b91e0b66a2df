#include "train/checkpoint.h"

#include <algorithm>
#include <map>
#include <memory>
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

// "shard-00003-of-00008.safetensors": the tensors rank 3 of 8 wrote.
std::string shard_file_name(int64_t rank, int64_t world) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "shard-%05lld-of-%05lld.safetensors", static_cast<long long>(rank),
                  static_cast<long long>(world));
    return buf;
}

// "exp_avg/model.layers.0.mlp.experts.down_proj@1536" -> kind 1, the name, offset 1536.
struct PieceName {
    int kind = -1;
    std::string name;
    int64_t offset = -1;
};
PieceName parse_piece_name(const std::string& s) {
    PieceName p;
    for (int k = 0; k < 3; ++k)
        if (s.rfind(kStateTensors[k], 0) == 0) p.kind = k;
    const size_t at = s.rfind('@');
    if (p.kind < 0 || at == std::string::npos || at + 1 >= s.size() || at + 1 + 18 < s.size()) return {};
    int64_t v = 0;
    for (size_t i = at + 1; i < s.size(); ++i) {
        if (s[i] < '0' || s[i] > '9') return {};
        v = v * 10 + (s[i] - '0');
    }
    p.name = s.substr(kStateTensors[p.kind].size(), at - kStateTensors[p.kind].size());
    p.offset = v;
    return p;
}

}  // namespace

void save_checkpoint(const fs::path& root, const CheckpointState& state, model::Qwen3Moe& model, AdamW& adam,
                     int64_t keep, const CheckpointLayout& layout, DistContext* dist) {
    const bool main = dist == nullptr || dist->is_main();
    const int64_t world = dist != nullptr ? dist->world_size() : 1, rank = dist != nullptr ? dist->rank() : 0;
    const fs::path final_dir = root / step_dir_name(state.step);
    // Rank 0 makes the temporary directory; every rank writes its shard into it; rank 0 adds
    // state.json and renames it into place once all shards are there.
    std::unique_ptr<io::AtomicDir> dir;
    if (main) {
        fs::create_directories(root);
        dir = std::make_unique<io::AtomicDir>(final_dir, "shards");
    }
    if (dist != nullptr) dist->barrier();
    {
        // This rank's pieces: the state it owns (its ZeRO-1 chunks of the replicated region and of
        // its experts), each parameter's part named by its offset in the whole tensor. A region
        // that is not sharded is owned whole by each of its replicas, so only the first replica
        // writes it (world rank 0 the replicated region, DP rank 0 its experts): the pieces of
        // all ranks then tile the model exactly once.
        const bool first_replica[2] = {dist == nullptr || dist->rank() == 0,
                                       dist == nullptr || dist->rank() / dist->ep_size() == 0};
        std::vector<float> owned[3];
        adam.get_owned(owned[0], owned[1], owned[2]);
        std::vector<io::StWriteTensor> tensors;
        for (int k = 0; k < 3; ++k) {
            int64_t at = 0;
            for (const AdamW::Range& r : adam.owned()) {
                const bool writes = r.sharded || first_replica[r.region];
                for (const auto& spec : model.params().specs()) {
                    if (!writes) break;
                    const int64_t a = std::max(r.begin, spec.offset), b = std::min(r.end, spec.offset + spec.numel);
                    if (a >= b) continue;
                    const int64_t row = spec.is_expert ? spec.numel / spec.shape[0] : 0;
                    const int64_t global = (spec.is_expert ? spec.expert_first * row : 0) + (a - spec.offset);
                    tensors.push_back({kStateTensors[k] + spec.name + "@" + std::to_string(global), io::StDType::F32,
                                       {b - a}, owned[k].data() + at + (a - r.begin)});
                }
                at += r.end - r.begin;
            }
        }
        io::write_safetensors(io::AtomicDir::temp_path_for(final_dir, "shards") / shard_file_name(rank, world), tensors,
                              {{"format", "moeforge"}});
    }
    if (dist != nullptr) dist->barrier();
    if (!main) return;
    json::Value s = json::Value::object();
    s.set("magic", kCheckpointMagic);
    s.set("format_version", kCheckpointFormatVersion);
    s.set("world_size", layout.world_size);
    s.set("ep_size", layout.ep_size);
    s.set("config_hash", hex(model.config().hash()));
    s.set("num_params", model.num_params_total());
    s.set("shards", world);
    s.set("step", state.step);
    s.set("adam_step", state.adam_step);
    json::Value loader = json::Value::object();
    loader.set("epoch", state.loader.epoch);
    loader.set("cursor", state.loader.cursor);
    s.set("loader", std::move(loader));
    s.set("recipe", state.recipe);
    io::atomic_write_file(dir->tmp_path() / "state.json", s.dump(2) + "\n");
    dir->commit();
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

    // Every shard's pieces are indexed and checked against the whole model (each tensor tiled
    // exactly, no gap, no overlap, nothing unknown) before anything is restored; this rank then
    // copies the parts it holds (its experts) out of the memory-mapped shards.
    const json::Value& shards_field = field("shards");
    if (!shards_field.is_int() || shards_field.as_int() < 1 || shards_field.as_int() > (int64_t{1} << 20))
        fail(where, ": field \"shards\" must be a positive integer");
    const int64_t num_shards = shards_field.as_int();
    std::vector<io::SafetensorsFile> files;
    for (int64_t r = 0; r < num_shards; ++r) files.push_back(io::SafetensorsFile::open(dir / shard_file_name(r, num_shards)));
    const model::ParamTable full = model::qwen3_moe_param_table(model.config());
    struct Piece {
        int64_t offset, length;
        const uint8_t* data;
        const std::string* file;
    };
    std::map<std::string, std::vector<Piece>> pieces[3];  // kind -> tensor -> pieces
    for (const io::SafetensorsFile& f : files) {
        for (const io::StTensor& t : f.tensors()) {
            const PieceName p = parse_piece_name(t.name);
            const model::ParamSpec* spec = p.kind >= 0 ? full.find(p.name) : nullptr;
            if (spec == nullptr)
                fail(t.file, ": tensor \"", t.name, "\" is not a piece of this model's state (KIND/NAME@OFFSET)");
            if (t.dtype != io::StDType::F32 || t.shape.size() != 1 || p.offset + t.shape[0] > spec->numel)
                fail(t.file, ": tensor \"", t.name, "\" has the wrong dtype or shape (F32, 1-D, inside the ",
                     spec->numel, " elements of ", p.name, ")");
            pieces[p.kind][p.name].push_back({p.offset, t.shape[0], t.data, &t.file});
        }
    }
    for (int k = 0; k < 3; ++k) {
        for (const auto& spec : full.specs()) {
            auto& list = pieces[k][spec.name];
            std::sort(list.begin(), list.end(), [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
            int64_t covered = 0;
            for (const Piece& pc : list) {
                if (pc.offset != covered)
                    fail(dir.string(), ": ", kStateTensors[k], spec.name, " has ",
                         pc.offset > covered ? "a gap" : "overlapping pieces", " at element ", std::min(pc.offset, covered),
                         " (", *pc.file, ")");
                covered += pc.length;
            }
            if (covered != spec.numel)
                fail(dir.string(), ": missing tensor \"", kStateTensors[k], spec.name, "\" (", covered, " of ",
                     spec.numel, " elements in the shards)");
        }
    }
    const model::ParamTable& mine = model.params();
    std::vector<float> local[3];
    for (int k = 0; k < 3; ++k) {
        local[k].resize(static_cast<size_t>(mine.total()));
        for (const auto& spec : mine.specs()) {
            const int64_t first = spec.is_expert ? spec.expert_first * (spec.numel / spec.shape[0]) : 0;
            for (const Piece& pc : pieces[k][spec.name]) {
                const int64_t a = std::max(first, pc.offset), b = std::min(first + spec.numel, pc.offset + pc.length);
                if (a >= b) continue;
                std::memcpy(local[k].data() + spec.offset + (a - first),
                            pc.data + static_cast<size_t>(a - pc.offset) * sizeof(float),
                            static_cast<size_t>(b - a) * sizeof(float));
            }
        }
    }
    adam.set_state(local[0], local[1], local[2]);

    adam.set_step_count(state.adam_step);
    return state;
}

}  // namespace mf::train
