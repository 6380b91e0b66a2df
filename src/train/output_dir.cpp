#include "train/output_dir.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <system_error>

#include "core/check.h"
#include "io/file.h"
#include "train/hf_checkpoint.h"

namespace mf::train {

namespace fs = std::filesystem;

namespace {

fs::path real_path(const fs::path& p, const std::string& what) {
    std::error_code ec;
    fs::path r = fs::weakly_canonical(fs::absolute(p, ec), ec);
    if (ec) fail(what, " ", p.string(), ": cannot resolve the path: ", ec.message());
    return r;
}

// True when `inner` is `outer` or lies below it (both real, normalised paths).
bool within(const fs::path& inner, const fs::path& outer) {
    auto i = inner.begin();
    for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
        if (o->empty()) continue;  // a trailing separator
        if (i == inner.end() || *i != *o) return false;
    }
    return true;
}

std::string via(const fs::path& given, const fs::path& real) {
    return fs::absolute(given).lexically_normal() == real ? "" : " (it resolves to " + real.string() + ")";
}

// The deepest part of `p` that exists (for write access and free space of a directory to come).
fs::path existing_ancestor(fs::path p) {
    std::error_code ec;
    while (!p.empty() && !fs::exists(p, ec) && p.has_parent_path() && p != p.parent_path()) p = p.parent_path();
    return p;
}

std::string gib(uint64_t bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
    return buf;
}

}  // namespace

fs::path check_output_dir(const fs::path& out, const OutputCheck& check) {
    const std::string& field = check.field;
    if (out.empty()) fail(field, ": the output directory is empty");
    const fs::path real = real_path(out, field);
    const std::string named = field + " " + out.string() + via(out, real);
    std::error_code ec;
    const fs::path cwd = fs::canonical(fs::current_path(ec), ec);
    if (!ec && real == cwd)
        fail(named, " is the current directory; give the output a directory of its own (e.g. runs/sft)");
    if (real == real.root_path()) fail(named, " is the root directory; give the output a directory of its own");
    if (!check.model_dir.empty()) {
        const fs::path model = real_path(check.model_dir, "model");
        if (within(model, real))
            fail(named, model == real ? " is" : " contains", " the model directory ", check.model_dir.string(),
                 "; the export would write over the model it reads. Choose another output directory");
        if (within(real, model))
            fail(named, " lies inside the model directory ", check.model_dir.string(),
                 "; keep the output apart from the model it reads");
    }
    for (const fs::path& input : check.inputs) {
        if (input.empty() || input == "-") continue;
        const fs::path in = real_path(input, "input");
        if (within(in, real))
            fail(named, " contains the input ", input.string(), "; choose an output directory apart from the data");
    }
    const fs::file_status st = fs::status(real, ec);
    if (fs::exists(st) && !fs::is_directory(st)) fail(named, " exists and is not a directory");
    const fs::path base = existing_ancestor(real);
    if (!fs::is_directory(base, ec)) fail(named, ": ", base.string(), " is not a directory");
    if (::access(base.c_str(), W_OK | X_OK) != 0) fail(named, ": ", base.string(), " is not writable by this user");
    if (fs::is_directory(st)) {
        const std::vector<std::string> ours = io::StagedFiles::recorded(real, kExportRecord);
        for (const auto& entry : fs::directory_iterator(real, ec)) {
            const std::string name = entry.path().filename().string();
            const bool ours_by_name = name == "config.json" || name == "metrics.jsonl" || name == "recipe.json" ||
                                      is_weight_file_name(name) ||
                                      std::find(tokenizer_file_names().begin(), tokenizer_file_names().end(), name) !=
                                          tokenizer_file_names().end();
            if (ours_by_name && fs::is_directory(entry.symlink_status(ec)))
                fail(named, " holds a directory named ", name, ", where the export writes that file; move it away");
            if (!is_weight_file_name(name)) continue;
            if (std::find(ours.begin(), ours.end(), name) == ours.end())
                fail(named, " holds ", name, ", model weights that no moeforge export wrote there (no ", kExportRecord,
                     " lists it); the export would mix with them. Choose another output directory or move them away");
        }
    }
    const fs::space_info space = fs::space(base, ec);
    if (!ec && check.export_bytes > 0 && space.available < check.export_bytes)
        fail(named, ": the export needs about ", gib(check.export_bytes), " but ", base.string(), " has ",
             gib(space.available), " free");
    if (!ec && check.checkpoint_bytes > 0 && space.available < check.export_bytes + check.checkpoint_bytes)
        std::fprintf(stderr,
                     "warning: %s: the checkpoints kept at once may take about %s beyond the export's %s, and %s has "
                     "%s free\n",
                     named.c_str(), gib(check.checkpoint_bytes).c_str(), gib(check.export_bytes).c_str(),
                     base.string().c_str(), gib(space.available).c_str());
    return real;
}

}  // namespace mf::train
