#include "train/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "io/crc32c.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "train/distributed.h"
#include "train/lr_schedule.h"

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
    {"model", nullptr},   {"data", "train"},        {"data", "format"},      {"data", "packing"}, {"data", "shuffle"},
    {"train", "seq_len"}, {"train", "micro_batch"}, {"train", "grad_accum"}, {"seed", nullptr},
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

// state.json ends with its own checksum: `{..., "state_checksum": "crc32c:X"}` where X is the CRC of
// the text as it would read without that last member (`{...}` + newline).
constexpr const char* kStateChecksumKey = ",\n  \"state_checksum\": \"";

std::string with_state_checksum(const std::string& dumped) {
    const std::string body = dumped + "\n";
    const uint32_t crc = io::crc32c(0, body.data(), body.size());
    MF_CHECK(dumped.size() > 2 && dumped.ends_with("\n}"), "state.json must be a non-empty JSON object");
    return dumped.substr(0, dumped.size() - 2).append(kStateChecksumKey).append(io::crc32c_string(crc)) + "\"\n}\n";
}

// Verifies the checksum written by with_state_checksum (format 3 and later).
void verify_state_checksum(const std::string& text, const std::string& where) {
    const size_t at = text.rfind(kStateChecksumKey);
    if (at == std::string::npos) fail(where, ": the state's checksum (\"state_checksum\") is missing");
    const std::string body = text.substr(0, at) + "\n}\n";
    const std::string want = io::crc32c_string(io::crc32c(0, body.data(), body.size()));
    const size_t value_at = at + std::strlen(kStateChecksumKey);
    const std::string stored = text.substr(value_at, text.find('"', value_at) - value_at);
    if (stored != want)
        fail(where, ": checksum mismatch (stored ", stored, ", the file's content gives ", want,
             "): the file is damaged");
}

// A shard's bytes against the CRC state.json recorded for it.
void verify_shard_checksum(const fs::path& file, const json::Value& checksums, const std::string& where) {
    const std::string name = file.filename().string();
    const json::Value* want = checksums.find(name);
    if (want == nullptr || !want->is_string()) fail(where, ": field \"checksums\" has no entry for ", name);
    const io::MappedFile map(file);
    const std::string got = io::crc32c_string(io::crc32c(0, map.data(), map.size()));
    if (got != want->as_string())
        fail(file.string(), ": checksum mismatch (state.json records ", want->as_string(), ", the file gives ", got,
             "): the checkpoint is damaged; resume from an older one (--resume DIR)");
}

// The schedule is defined by train.steps (lr_schedule.h): a resume whose recipe gives the next step
// another learning rate than the run that wrote the checkpoint would have used jumps, e.g. back to
// the peak when train.steps grows under a cosine decay. Refused unless forced.
void check_schedule(const json::Value& s, const std::string& where, const Recipe& recipe, int64_t step, bool force) {
    const json::Value* recorded = s.find("next_lr");
    if (recorded == nullptr || !recorded->is_number() || force || step > recipe.train.steps) return;
    const double then = recorded->as_double(), now = lr_at(recipe.optim, step, recipe.train.steps);
    if (std::fabs(now - then) <= 1e-12 + 1e-6 * std::fabs(then)) return;
    const json::Value* old_train = s.find("recipe") != nullptr ? s.find("recipe")->find("train") : nullptr;
    const json::Value* old_steps = old_train != nullptr ? old_train->find("steps") : nullptr;
    fail(where, ": resuming at step ", step, " would change the learning rate of the next step from ", then, " to ",
         now, " (train.steps ", old_steps != nullptr ? old_steps->dump() : "?", " -> ", recipe.train.steps, "; the ",
         recipe.optim.schedule,
         " schedule is defined by train.steps, optim.lr and optim.warmup_steps, so changing them restarts or "
         "bends the schedule). Keep them as they were, or pass --force-resume to accept the jump");
}

}  // namespace

void save_checkpoint(const fs::path& root, const CheckpointState& state, model::CausalLM& model, AdamW& adam,
                     int64_t keep, const CheckpointLayout& layout, DistContext* dist) {
    const bool main = dist == nullptr || dist->is_main();
    const int64_t world = dist != nullptr ? dist->world_size() : 1, rank = dist != nullptr ? dist->rank() : 0;
    const fs::path final_dir = root / step_dir_name(state.step);
    // Rank 0 makes the temporary directory; every rank writes its shard into it; rank 0 adds
    // state.json and renames it into place once all shards are there.
    std::unique_ptr<io::AtomicDir> dir;
    uint32_t shard_crc = 0;
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
                    tensors.push_back({kStateTensors[k] + spec.name + "@" + std::to_string(global),
                                       io::StDType::F32,
                                       {b - a},
                                       owned[k].data() + at + (a - r.begin)});
                }
                at += r.end - r.begin;
            }
        }
        shard_crc =
            io::write_safetensors(io::AtomicDir::temp_path_for(final_dir, "shards") / shard_file_name(rank, world),
                                  tensors, {{"format", "moeforge"}});
    }
    // Rank 0 learns every shard's checksum (each rank fills its slot; a CRC is exact in a double).
    std::vector<double> crcs(static_cast<size_t>(world), 0.0);
    crcs[static_cast<size_t>(rank)] = static_cast<double>(shard_crc);
    if (dist != nullptr) crcs = dist->sum_f64(crcs);
    if (!main) return;
    json::Value s = json::Value::object();
    s.set("magic", kCheckpointMagic);
    s.set("format_version", kCheckpointFormatVersion);
    s.set("world_size", layout.world_size);
    s.set("ep_size", layout.ep_size);
    s.set("config_hash", hex(model.spec().hash()));
    s.set("num_params", model.num_params_total());
    s.set("shards", world);
    json::Value checksums = json::Value::object();
    for (int64_t r = 0; r < world; ++r)
        checksums.set(shard_file_name(r, world),
                      io::crc32c_string(static_cast<uint32_t>(crcs[static_cast<size_t>(r)])));
    s.set("checksums", std::move(checksums));
    s.set("step", state.step);
    if (state.next_lr >= 0) s.set("next_lr", json::Value(state.next_lr));
    if (state.best_step >= 0) {
        s.set("best_step", state.best_step);
        s.set("best_val_loss", json::Value(state.best_val_loss));
    }
    s.set("adam_step", state.adam_step);
    json::Value loader = json::Value::object();
    loader.set("epoch", state.loader.epoch);
    loader.set("cursor", state.loader.cursor);
    s.set("loader", std::move(loader));
    s.set("recipe", state.recipe);
    io::atomic_write_file(dir->tmp_path() / "state.json", with_state_checksum(s.dump(2)));
    dir->commit();
    // Prune: the newest `keep` complete checkpoints stay; leftovers of crashed writes go.
    auto all = list_checkpoints(root);
    for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i)
        if (all[i].first != state.best_step) fs::remove_all(all[i].second);
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root, ec))
        if (entry.path().filename().string().find(".tmp-") != std::string::npos) fs::remove_all(entry.path(), ec);
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
    auto all = list_checkpoints(root);
    if (all.empty()) return std::nullopt;
    return all.back().second;
}

CheckpointState load_checkpoint(const fs::path& dir, const Recipe& recipe, model::CausalLM& model, AdamW& adam,
                                bool force, const CheckpointLayout& layout) {
    const fs::path state_file = dir / "state.json";
    const std::string where = state_file.string();
    const std::string text = io::read_text_file(state_file, 64u << 20);
    const json::Value s = json::parse(text, where);
    if (!s.is_object()) fail(where, ": expected a JSON object");
    auto field = [&](const char* key) -> const json::Value& {
        const json::Value* v = s.find(key);
        if (v == nullptr) fail(where, ": missing field \"", key, "\"");
        return *v;
    };
    auto int_field = [&](const char* key) {
        const json::Value& v = field(key);
        if (!v.is_int()) fail(where, ": field \"", key, "\" must be an integer, got ", v.dump());
        return v.as_int();
    };
    auto string_field = [&](const char* key) -> const std::string& {
        const json::Value& v = field(key);
        if (!v.is_string()) fail(where, ": field \"", key, "\" must be a string, got ", v.dump());
        return v.as_string();
    };
    if (!field("magic").is_string() || field("magic").as_string() != kCheckpointMagic)
        fail(where, ": not a moeforge training checkpoint (bad magic)");
    const int64_t version = int_field("format_version");
    if (version != kCheckpointFormatVersion && version != 2)
        fail(where, ": checkpoint format version ", version, ", this build reads versions 2 and ",
             kCheckpointFormatVersion);
    if (version >= 3)
        verify_state_checksum(text, where);
    else if (layout.rank == 0)
        std::printf("resume: %s is a format-2 checkpoint: it carries no checksums, so its files are not verified\n",
                    dir.string().c_str());
    const int64_t then_world = int_field("world_size"), then_ep = int_field("ep_size");
    if (string_field("config_hash") != hex(model.spec().hash()))
        fail(where, ": the checkpoint was written for a different model config (hash ", string_field("config_hash"),
             ", this model ", hex(model.spec().hash()), ")");
    if (int_field("num_params") != model.num_params_total())
        fail(where, ": checkpoint has ", int_field("num_params"), " parameters, the model ", model.num_params_total());
    if ((then_world != layout.world_size || then_ep != layout.ep_size) && layout.rank == 0)
        std::printf(
            "resume: checkpoint written at world size %lld (EP %lld), continuing at world size %lld (EP %lld); "
            "the global batch is now %lld rows per micro-step\n",
            static_cast<long long>(then_world), static_cast<long long>(then_ep),
            static_cast<long long>(layout.world_size), static_cast<long long>(layout.ep_size),
            static_cast<long long>(layout.world_size * recipe.train.micro_batch));

    const json::Value now = recipe.to_json();
    const json::Value& then = field("recipe");
    std::string diffs;
    for (const auto& key : kResumeKeys) {
        const json::Value* a = lookup(then, key[0], key[1]);
        const json::Value* b = lookup(now, key[0], key[1]);
        const std::string av = a != nullptr ? a->dump() : "(absent)", bv = b != nullptr ? b->dump() : "(absent)";
        if (av != bv)
            diffs += std::string(diffs.empty() ? "" : "; ") + key[0] + (key[1] ? std::string(".") + key[1] : "") +
                     " was " + av + ", now " + bv;
    }
    if (!diffs.empty() && !force)
        fail(dir.string(), ": the recipe changed since this checkpoint (", diffs,
             "); resuming would not continue the same run. Pass --force-resume to resume anyway");

    CheckpointState state;
    state.step = int_field("step");
    state.adam_step = int_field("adam_step");
    const json::Value& loader = field("loader");
    if (!loader.is_object() || loader.find("epoch") == nullptr || loader.find("cursor") == nullptr ||
        !loader.find("epoch")->is_int() || !loader.find("cursor")->is_int())
        fail(where, ": field \"loader\" must hold the integers epoch and cursor");
    state.loader.epoch = loader.find("epoch")->as_int();
    state.loader.cursor = loader.find("cursor")->as_int();
    if (state.step < 0 || state.adam_step < 0 || state.loader.epoch < 0 || state.loader.cursor < 0)
        fail(where, ": negative step or loader position");
    state.recipe = then;
    if (const json::Value* best = s.find("best_step"); best != nullptr) {
        const json::Value* loss = s.find("best_val_loss");
        if (!best->is_int() || loss == nullptr || !loss->is_number())
            fail(where, ": fields \"best_step\" and \"best_val_loss\" must be an integer and a number");
        state.best_step = best->as_int();
        state.best_val_loss = loss->as_double();
    }
    check_schedule(s, where, recipe, state.step, force);

    // Every shard's pieces are indexed and checked against the whole model (each tensor tiled
    // exactly, no gap, no overlap, nothing unknown) before anything is restored; this rank then
    // copies the parts it holds (its experts) out of the memory-mapped shards.
    const json::Value& shards_field = field("shards");
    if (!shards_field.is_int() || shards_field.as_int() < 1 || shards_field.as_int() > (int64_t{1} << 20))
        fail(where, ": field \"shards\" must be a positive integer");
    const int64_t num_shards = shards_field.as_int();
    const json::Value* checksums = version >= 3 ? &field("checksums") : nullptr;
    if (checksums != nullptr && !checksums->is_object()) fail(where, ": field \"checksums\" must be an object");
    std::vector<io::SafetensorsFile> files;
    for (int64_t r = 0; r < num_shards; ++r) {
        const fs::path shard = dir / shard_file_name(r, num_shards);
        if (checksums != nullptr) verify_shard_checksum(shard, *checksums, where);
        files.push_back(io::SafetensorsFile::open(shard));
    }
    const model::ParamTable full = model::model_param_table(model.spec());
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
                         pc.offset > covered ? "a gap" : "overlapping pieces", " at element ",
                         std::min(pc.offset, covered), " (", *pc.file, ")");
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
