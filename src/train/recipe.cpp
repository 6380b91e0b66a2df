// Recipe loading: YAML -> flat table of "section.key" entries (each remembering where it was
// written) -> overrides replace entries -> each field converted and range-checked into Recipe.
// Unknown keys are refused before any value is looked at, so a typo never silently falls back to
// a default. No partially filled Recipe escapes: every error throws before returning.
#include "train/recipe.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <system_error>

#include "core/check.h"
#include "train/yaml.h"

namespace mf::train {

namespace {

using json::Value;

constexpr std::string_view kSections[] = {"data", "train", "optim", "checkpoint", "dist"};

constexpr std::string_view kKnownKeys[] = {
    "model",
    "data.train",
    "data.format",
    "data.shuffle",
    "data.packing",
    "data.on_error",
    "data.chat_format",
    "data.loss_on",
    "train.steps",
    "train.micro_batch",
    "train.seq_len",
    "train.grad_accum",
    "train.grad_clip",
    "train.log_every",
    "train.recompute",
    "train.on_nonfinite",
    "optim.lr",
    "optim.betas",
    "optim.eps",
    "optim.weight_decay",
    "optim.no_decay",
    "optim.schedule",
    "optim.warmup_steps",
    "optim.min_lr_ratio",
    "checkpoint.every",
    "checkpoint.keep",
    "dist.ep_size",
    "dist.ep_chunks",
    "dist.timeout_s",
    "dist.shard_optimizer",
    "dist.log_ranks",
    "seed",
    "device",
    "precision",
    "out",
};

// Names other tools use for our keys (HF TrainingArguments and friends), for suggestions only.
constexpr std::pair<std::string_view, std::string_view> kAliases[] = {
    {"learning_rate", "optim.lr"},
    {"max_steps", "train.steps"},
    {"num_steps", "train.steps"},
    {"batch_size", "train.micro_batch"},
    {"per_device_train_batch_size", "train.micro_batch"},
    {"gradient_accumulation_steps", "train.grad_accum"},
    {"max_grad_norm", "train.grad_clip"},
    {"max_seq_length", "train.seq_len"},
    {"max_length", "train.seq_len"},
    {"lr_scheduler_type", "optim.schedule"},
    {"scheduler", "optim.schedule"},
    {"warmup", "optim.warmup_steps"},
    {"adam_beta1", "optim.betas"},
    {"adam_beta2", "optim.betas"},
    {"adam_epsilon", "optim.eps"},
    {"model_name_or_path", "model"},
    {"output_dir", "out"},
    {"dataset", "data.train"},
    {"bf16", "precision"},
    {"gradient_checkpointing", "train.recompute"},
};

bool is_section(std::string_view name) {
    return std::find(std::begin(kSections), std::end(kSections), name) != std::end(kSections);
}

bool is_known_key(std::string_view path) {
    return std::find(std::begin(kKnownKeys), std::end(kKnownKeys), path) != std::end(kKnownKeys);
}

std::string_view leaf_of(std::string_view path) {
    const size_t dot = path.rfind('.');
    return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

size_t edit_distance(std::string_view a, std::string_view b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
        size_t diagonal = row[0];
        row[0] = i;
        for (size_t j = 1; j <= b.size(); ++j) {
            const size_t up = row[j];
            row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
            diagonal = up;
        }
    }
    return row[b.size()];
}

// The known key closest to `path`: an alias match first, then the same leaf name in another
// section (`train.lr` -> `optim.lr`), else the smallest edit distance among the keys of the same
// section (top level: the top-level keys and section names).
std::string closest_key(std::string_view path) {
    const std::string_view leaf = leaf_of(path);
    for (const auto& [alias, key] : kAliases)
        if (alias == leaf) return std::string(key);
    for (const std::string_view key : kKnownKeys)
        if (leaf_of(key) == leaf) return std::string(key);
    const size_t dot = path.find('.');
    const std::string_view scope = dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
    std::string best;
    size_t best_distance = SIZE_MAX;
    auto consider = [&](std::string_view candidate) {
        const size_t distance = edit_distance(leaf, leaf_of(candidate));
        if (distance < best_distance) {
            best_distance = distance;
            best = std::string(candidate);
        }
    };
    for (const std::string_view key : kKnownKeys) {
        const size_t key_dot = key.find('.');
        const std::string_view key_scope =
            key_dot == std::string_view::npos ? std::string_view() : key.substr(0, key_dot);
        if (key_scope == scope) consider(key);
    }
    if (scope.empty())
        for (const std::string_view section : kSections) consider(section);
    return best;
}

std::string keys_of_section(std::string_view section) {
    std::string out;
    for (const std::string_view key : kKnownKeys) {
        if (key.substr(0, section.size() + 1) != std::string(section) + ".") continue;
        if (!out.empty()) out += ", ";
        out += leaf_of(key);
    }
    return out;
}

[[noreturn]] void unknown_key(const std::string& origin, const std::string& path) {
    std::string msg = origin + ": unknown key '" + path + "'; did you mean '" + closest_key(path) + "'?";
    const size_t dot = path.find('.');
    if (dot != std::string::npos && is_section(std::string_view(path).substr(0, dot)))
        msg += " (keys of " + path.substr(0, dot) + ": " + keys_of_section(path.substr(0, dot)) + ")";
    else
        msg += " (top-level keys: model, data, train, optim, seed, device, precision, out)";
    fail(msg);
}

std::string describe(const Value& v) {
    switch (v.kind()) {
        case json::Kind::null:
            return "an empty value (null)";
        case json::Kind::boolean:
            return v.as_bool() ? "true" : "false";
        case json::Kind::number:
            return (v.is_int() ? "the integer " : "the number ") + v.dump();
        case json::Kind::string: {
            std::string s = v.as_string();
            if (s.size() > 60) s = s.substr(0, 60) + "...";
            return "the string " + json::quote(s);
        }
        case json::Kind::array:
            return "a list";
        case json::Kind::object:
            return "a mapping";
    }
    return "?";
}

// One key's value and where it came from ("recipe.yaml:12" or "command line ('k=v')").
struct Entry {
    Value value;
    std::string origin;
};

class Converter {
 public:
    Converter(std::map<std::string, Entry> entries, std::string source)
        : entries_(std::move(entries)), source_(std::move(source)) {}

    [[noreturn]] void bad(const std::string& path, const std::string& expected) const {
        const Entry& e = entries_.at(path);
        fail(e.origin, ": ", path, ": expected ", expected, ", got ", describe(e.value));
    }

    const Entry* find(const std::string& path) const {
        const auto it = entries_.find(path);
        return it == entries_.end() ? nullptr : &it->second;
    }

    void require(const std::string& path, const std::string& what) const {
        if (find(path) == nullptr) fail(source_, ": missing required key '", path, "' (", what, ")");
    }

    const std::string& origin(const std::string& path) const { return entries_.at(path).origin; }

    void get_string(const std::string& path, std::string& out) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        if (!e->value.is_string()) {
            if (e->value.is_number() || e->value.is_bool())
                bad(path, "a string (quote it: \"" + e->value.dump() + "\")");
            bad(path, "a string");
        }
        if (e->value.as_string().empty()) bad(path, "a non-empty string");
        out = e->value.as_string();
    }

    void get_choice(const std::string& path, std::initializer_list<std::string_view> choices, std::string& out) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        std::string expected = "one of";
        for (const std::string_view c : choices) {
            if (c != *choices.begin()) expected += ',';
            expected += ' ';
            expected.append(c);
        }
        if (!e->value.is_string()) bad(path, expected);
        const std::string& s = e->value.as_string();
        if (std::find(choices.begin(), choices.end(), s) == choices.end()) bad(path, expected);
        out = s;
    }

    void get_bool(const std::string& path, bool& out) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        if (!e->value.is_bool()) bad(path, "true or false");
        out = e->value.as_bool();
    }

    void get_int(const std::string& path, int64_t min, int64_t max, int64_t& out) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        const std::string expected = max == std::numeric_limits<int64_t>::max()
                                         ? "an integer >= " + std::to_string(min)
                                         : "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
        const Value& v = e->value;
        if (!v.is_number()) bad(path, expected);
        int64_t n = 0;
        if (v.is_int()) {
            n = v.as_int();
        } else {
            // Integral floats (1e3) are accepted; 1.5 is not an integer.
            const double d = v.as_double();
            if (!(std::floor(d) == d && std::fabs(d) <= 9007199254740992.0)) bad(path, expected);
            n = static_cast<int64_t>(d);
        }
        if (n < min || n > max) bad(path, expected);
        out = n;
    }

    // A finite number in [min, max] (or [min, max) when `max_open`); integers accepted.
    double number_in_range(const std::string& path, const Value& v, double min, double max, bool min_open,
                           bool max_open, const std::string& expected) const {
        if (!v.is_number()) bad(path, expected);
        const double d = v.as_double();
        const bool ok = std::isfinite(d) && (min_open ? d > min : d >= min) && (max_open ? d < max : d <= max);
        if (!ok) bad(path, expected);
        return d;
    }

    void get_number(const std::string& path, double min, double max, bool min_open, bool max_open,
                    const std::string& expected, double& out) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        out = number_in_range(path, e->value, min, max, min_open, max_open, expected);
    }

    void get_betas(const std::string& path, double& beta1, double& beta2) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        const std::string expected = "a list of two numbers [beta1, beta2], each in [0, 1)";
        if (!e->value.is_array() || e->value.size() != 2) bad(path, expected);
        const auto& arr = e->value.as_array();
        for (const Value& b : arr) {
            if (!b.is_number() || !std::isfinite(b.as_double()) || b.as_double() < 0 || b.as_double() >= 1)
                fail(e->origin, ": ", path, ": expected ", expected, ", got ", describe(b), " in the list");
        }
        beta1 = arr[0].as_double();
        beta2 = arr[1].as_double();
    }

    void get_string_list(const std::string& path, std::vector<std::string>& out) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        const std::string expected = "a list of non-empty strings (glob patterns such as \"*norm*\")";
        if (!e->value.is_array()) bad(path, expected);
        std::vector<std::string> items;
        for (const Value& item : e->value.as_array()) {
            if (!item.is_string() || item.as_string().empty())
                fail(e->origin, ": ", path, ": expected ", expected, ", got ", describe(item), " in the list");
            items.push_back(item.as_string());
        }
        out = std::move(items);
    }

 private:
    std::map<std::string, Entry> entries_;
    std::string source_;
};

// Flattens the parsed file into "section.key" entries, refusing unknown keys and malformed sections.
std::map<std::string, Entry> flatten_file(const YamlDocument& doc, const std::string& source) {
    std::map<std::string, Entry> entries;
    auto origin_of = [&](const std::string& path) {
        const int line = doc.line_of(path);
        return line > 0 ? source + ":" + std::to_string(line) : source;
    };
    for (const auto& [key, value] : doc.root.as_object()) {
        if (is_section(key)) {
            if (value.is_null()) continue;  // "optim:" with everything commented out
            if (!value.is_object())
                fail(origin_of(key), ": ", key, ": expected a mapping of ", key, ".* keys (", keys_of_section(key),
                     "), got ", describe(value));
            for (const auto& [sub, sub_value] : value.as_object()) {
                const std::string path = key + "." + sub;
                if (!is_known_key(path)) unknown_key(origin_of(path), path);
                entries[path] = Entry{sub_value, origin_of(path)};
            }
        } else {
            const size_t dot = key.find('.');
            if (dot != std::string::npos && is_known_key(key))
                fail(origin_of(key), ": '", key, "': in a recipe file write nested keys ('", key.substr(0, dot),
                     ":' then '  ", key.substr(dot + 1),
                     ": ...' on the next line); the dotted form is for "
                     "command-line overrides");
            if (!is_known_key(key)) unknown_key(origin_of(key), key);
            entries[key] = Entry{value, origin_of(key)};
        }
    }
    return entries;
}

void apply_override(std::map<std::string, Entry>& entries, const std::string& override_text) {
    const std::string origin = "command line ('" + override_text + "')";
    const size_t eq = override_text.find('=');
    if (eq == std::string::npos)
        fail(origin, ": an override needs '=': expected key=value, e.g. optim.lr=1e-4 or optim.betas=[0.9,0.95]");
    std::string key = override_text.substr(0, eq);
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    while (!key.empty() && (key.front() == ' ' || key.front() == '\t')) key.erase(key.begin());
    if (key.empty()) fail(origin, ": missing key before '=': expected key=value, e.g. optim.lr=1e-4");
    if (is_section(key))
        fail(origin, ": '", key, "' is a section; override one of its keys at a time, e.g. ", key,
             ".KEY=VALUE (keys of ", key, ": ", keys_of_section(key), ")");
    if (!is_known_key(key)) unknown_key(origin, key);
    Value value = parse_yaml_value(std::string_view(override_text).substr(eq + 1), origin, true);
    entries[key] = Entry{std::move(value), origin};
}

}  // namespace

Recipe parse_recipe(std::string_view yaml_text, const std::string& source, const std::vector<std::string>& overrides) {
    const YamlDocument doc = parse_yaml_document(yaml_text, source);
    std::map<std::string, Entry> entries = flatten_file(doc, source);
    for (const std::string& o : overrides) apply_override(entries, o);

    const Converter conv(std::move(entries), source);
    conv.require("model", "the HF model directory");
    conv.require("data.train", "the training dataset");
    conv.require("train.steps", "the number of optimizer steps");
    conv.require("out", "the output directory");

    constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();
    constexpr double kInf = std::numeric_limits<double>::infinity();
    Recipe r;
    r.source = source;
    conv.get_string("model", r.model);

    conv.get_string("data.train", r.data.train);
    conv.get_choice("data.format", {"tokens", "auto", "messages", "prompt_completion", "text"}, r.data.format);
    conv.get_bool("data.shuffle", r.data.shuffle);
    conv.get_bool("data.packing", r.data.packing);
    conv.get_choice("data.on_error", {"stop", "skip"}, r.data.on_error);
    conv.get_choice("data.chat_format", {"auto", "chatml", "chatml_qwen2", "chatml_qwen2_5", "chatml_qwen3"},
                    r.data.chat_format);
    conv.get_choice("data.loss_on", {"assistant", "all"}, r.data.loss_on);

    conv.get_int("train.steps", 1, kMaxInt, r.train.steps);
    conv.get_int("train.micro_batch", 1, int64_t{1} << 20, r.train.micro_batch);
    conv.get_int("train.seq_len", 1, int64_t{1} << 24, r.train.seq_len);
    conv.get_int("train.grad_accum", 1, int64_t{1} << 20, r.train.grad_accum);
    conv.get_number("train.grad_clip", 0, kInf, false, false, "a finite number >= 0 (0 disables clipping)",
                    r.train.grad_clip);
    conv.get_int("train.log_every", 1, kMaxInt, r.train.log_every);
    conv.get_choice("train.recompute", {"none", "moe", "full"}, r.train.recompute);
    conv.get_choice("train.on_nonfinite", {"stop", "skip"}, r.train.on_nonfinite);

    conv.get_number("optim.lr", 0, kInf, false, false, "a finite number >= 0", r.optim.lr);
    conv.get_betas("optim.betas", r.optim.beta1, r.optim.beta2);
    conv.get_number("optim.eps", 0, kInf, true, false, "a finite number > 0", r.optim.eps);
    conv.get_number("optim.weight_decay", 0, kInf, false, false, "a finite number >= 0", r.optim.weight_decay);
    conv.get_string_list("optim.no_decay", r.optim.no_decay);
    conv.get_choice("optim.schedule", {"constant", "cosine", "linear"}, r.optim.schedule);
    conv.get_int("optim.warmup_steps", 0, kMaxInt, r.optim.warmup_steps);
    conv.get_number("optim.min_lr_ratio", 0, 1, false, false, "a number in [0, 1]", r.optim.min_lr_ratio);
    if (r.optim.warmup_steps > r.train.steps)
        fail(conv.origin("optim.warmup_steps"), ": optim.warmup_steps: expected at most train.steps (", r.train.steps,
             "), got ", r.optim.warmup_steps);

    conv.get_int("checkpoint.every", 0, kMaxInt, r.checkpoint.every);
    conv.get_int("checkpoint.keep", 1, 1 << 20, r.checkpoint.keep);

    conv.get_int("dist.ep_size", 1, 1 << 20, r.dist.ep_size);
    conv.get_int("dist.ep_chunks", 1, 64, r.dist.ep_chunks);
    conv.get_number("dist.timeout_s", 0, kInf, true, false, "a finite number of seconds > 0", r.dist.timeout_s);
    conv.get_bool("dist.shard_optimizer", r.dist.shard_optimizer);
    conv.get_choice("dist.log_ranks", {"main", "all"}, r.dist.log_ranks);

    conv.get_int("seed", 0, kMaxInt, r.seed);
    conv.get_choice("device", {"auto", "cpu", "cuda"}, r.device);
    conv.get_choice("precision", {"bf16", "mixed"}, r.precision);
    conv.get_string("out", r.out);
    return r;
}

Recipe load_recipe(const std::filesystem::path& file, const std::vector<std::string>& overrides) {
    const std::string source = file.string();
    std::error_code ec;
    if (!std::filesystem::exists(file, ec)) fail(source, ": recipe file not found");
    if (!std::filesystem::is_regular_file(file, ec)) fail(source, ": the recipe is not a regular file");
    const auto size = std::filesystem::file_size(file, ec);
    if (ec) fail(source, ": cannot read the recipe: ", ec.message());
    if (size > kMaxYamlBytes)
        fail(source, ":1: the file is ", size, " bytes; recipes are limited to ", kMaxYamlBytes, " bytes");
    std::ifstream in(file, std::ios::binary);
    if (!in) fail(source, ": cannot open the recipe for reading");
    std::string text(static_cast<size_t>(size), '\0');
    in.read(text.data(), static_cast<std::streamsize>(size));
    if (in.gcount() != static_cast<std::streamsize>(size)) fail(source, ": short read of the recipe");
    return parse_recipe(text, source, overrides);
}

json::Value Recipe::to_json() const {
    Value::Array no_decay_list;
    for (const std::string& p : optim.no_decay) no_decay_list.emplace_back(p);
    return Value(Value::Object{
        {"model", model},
        {"data", Value(Value::Object{{"train", data.train},
                                     {"format", data.format},
                                     {"shuffle", data.shuffle},
                                     {"packing", data.packing},
                                     {"on_error", data.on_error},
                                     {"chat_format", data.chat_format},
                                     {"loss_on", data.loss_on}})},
        {"train", Value(Value::Object{{"steps", train.steps},
                                      {"micro_batch", train.micro_batch},
                                      {"seq_len", train.seq_len},
                                      {"grad_accum", train.grad_accum},
                                      {"grad_clip", train.grad_clip},
                                      {"log_every", train.log_every},
                                      {"recompute", train.recompute},
                                      {"on_nonfinite", train.on_nonfinite}})},
        {"optim", Value(Value::Object{{"lr", optim.lr},
                                      {"betas", Value(Value::Array{optim.beta1, optim.beta2})},
                                      {"eps", optim.eps},
                                      {"weight_decay", optim.weight_decay},
                                      {"no_decay", Value(std::move(no_decay_list))},
                                      {"schedule", optim.schedule},
                                      {"warmup_steps", optim.warmup_steps},
                                      {"min_lr_ratio", optim.min_lr_ratio}})},
        {"checkpoint", Value(Value::Object{{"every", checkpoint.every}, {"keep", checkpoint.keep}})},
        {"dist", Value(Value::Object{{"ep_size", dist.ep_size},
                                     {"ep_chunks", dist.ep_chunks},
                                     {"timeout_s", dist.timeout_s},
                                     {"shard_optimizer", dist.shard_optimizer},
                                     {"log_ranks", dist.log_ranks}})},
        {"seed", seed},
        {"device", device},
        {"precision", precision},
        {"out", out},
    });
}

bool matches_pattern(std::string_view pattern, std::string_view name) {
    // Greedy match with one backtrack point: on a mismatch after a '*', let that '*' swallow one
    // more character. O(|pattern| * |name|) at worst, no recursion.
    size_t p = 0, n = 0;
    size_t star_p = std::string_view::npos, star_n = 0;
    while (n < name.size()) {
        if (p < pattern.size() && pattern[p] == '*') {
            star_p = p++;
            star_n = n;
        } else if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
            ++p;
            ++n;
        } else if (star_p != std::string_view::npos) {
            p = star_p + 1;
            n = ++star_n;
        } else {
            return false;
        }
    }
    while (p < pattern.size() && pattern[p] == '*') ++p;
    return p == pattern.size();
}

}  // namespace mf::train
