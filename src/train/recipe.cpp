// Recipe loading: YAML -> flat table of "section.key" entries (each remembering where it was
// written) -> overrides replace entries -> each key of the key table converted and range-checked
// into Recipe -> checks between keys and defaults that follow other keys.
// Unknown keys are refused before any value is looked at, so a typo never silently falls back to
// a default. No partially filled Recipe escapes: every error throws before returning.
#include "train/recipe.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <system_error>

#include "core/check.h"
#include "io/file.h"
#include "train/yaml.h"

namespace mf::train {

namespace {

using json::Value;

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

// Forward: the key table below (after the Converter it uses).
const std::vector<std::string>& known_keys();
const std::vector<std::string>& sections();

bool is_section(std::string_view name) {
    const auto& all = sections();
    return std::find(all.begin(), all.end(), name) != all.end();
}

bool is_known_key(std::string_view path) {
    const auto& all = known_keys();
    return std::find(all.begin(), all.end(), path) != all.end();
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
    for (const std::string_view key : known_keys())
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
    for (const std::string_view key : known_keys()) {
        const size_t key_dot = key.find('.');
        const std::string_view key_scope =
            key_dot == std::string_view::npos ? std::string_view() : key.substr(0, key_dot);
        if (key_scope == scope) consider(key);
    }
    if (scope.empty())
        for (const std::string_view section : sections()) consider(section);
    return best;
}

std::string keys_of_section(std::string_view section) {
    std::string out;
    for (const std::string_view key : known_keys()) {
        if (key.substr(0, section.size() + 1) != std::string(section) + ".") continue;
        if (!out.empty()) out += ", ";
        out += leaf_of(key);
    }
    return out;
}

std::string top_level_keys() {
    std::vector<std::string> names;
    for (const std::string& key : known_keys()) {
        const std::string top = key.substr(0, key.find('.'));
        if (std::find(names.begin(), names.end(), top) == names.end()) names.push_back(top);
    }
    std::string out;
    for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
}

[[noreturn]] void unknown_key(const std::string& origin, const std::string& path) {
    std::string msg = origin + ": unknown key '" + path + "'; did you mean '" + closest_key(path) + "'?";
    const size_t dot = path.find('.');
    if (dot != std::string::npos && is_section(std::string_view(path).substr(0, dot)))
        msg += " (keys of " + path.substr(0, dot) + ": " + keys_of_section(path.substr(0, dot)) + ")";
    else
        msg += " (top-level keys: " + top_level_keys() + ")";
    fail(msg);
}

std::string describe(const Value& v) {
    switch (v.kind()) {
        case json::Kind::null:
            return "an empty value (null)";
        case json::Kind::boolean:
            return v.as_bool() ? "true" : "false";
        case json::Kind::number:
            if (!v.is_int() && std::isnan(v.as_double())) return "NaN (not a number; NaN is not allowed)";
            if (!v.is_int() && std::isinf(v.as_double()))
                return std::string(v.as_double() > 0 ? "" : "minus ") + "infinity (infinities are not allowed)";
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
    bool from_file = false;  // written in the recipe file (relative paths resolve from its directory)
};

class Converter {
 public:
    Converter(std::map<std::string, Entry> entries, std::string source, std::filesystem::path base_dir)
        : entries_(std::move(entries)), source_(std::move(source)), base_dir_(std::move(base_dir)) {}

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
    bool has(const std::string& path) const { return find(path) != nullptr; }
    bool is_null(const std::string& path) const { return find(path) == nullptr || find(path)->value.is_null(); }

    // A path: a non-empty string; relative ones from the file resolve from its directory.
    void get_path(const std::string& path, std::string& out) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        get_string(path, out);
        if (e->from_file && !base_dir_.empty() && std::filesystem::path(out).is_relative() && out != "-")
            out = (base_dir_ / out).string();
    }

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

    void get_choice(const std::string& path, const std::vector<std::string>& choices, std::string& out) const {
        const Entry* e = find(path);
        if (e == nullptr) return;
        std::string expected = "one of";
        for (size_t i = 0; i < choices.size(); ++i) expected += (i > 0 ? ", " : " ") + choices[i];
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

    void get_mapping(const std::string& path, Value& out) const {
        const Entry* e = find(path);
        if (e == nullptr || e->value.is_null()) return;
        if (!e->value.is_object()) bad(path, "a mapping of template variables, e.g. {enable_thinking: false}");
        out = e->value;
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
    std::filesystem::path base_dir_;
};

// --- the key table: every recipe key, declared once ------------------------------------------

std::string int_expected(int64_t min, int64_t max) {
    return max == std::numeric_limits<int64_t>::max()
               ? "an integer >= " + std::to_string(min)
               : "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
}

std::string choice_expected(const std::vector<std::string>& choices) {
    std::string out = "one of";
    for (size_t i = 0; i < choices.size(); ++i) out += (i > 0 ? ", " : " ") + choices[i];
    return out;
}  // NOTE: Converter::get_choice words it the same way

// One key: where it lives, what it holds, how it is read from the entries and written back.
struct KeyDecl {
    std::string path;
    std::string type;  // what a value must be, as error messages and --explain say it
    std::string meaning;
    std::string default_text;   // "" = derived from a default-constructed Recipe
    std::string required_what;  // non-empty: a required key, and what it names
    std::function<void(const Converter&, Recipe&)> read;
    std::function<Value(const Recipe&)> write;
};

// `field` is a generic lambda returning a reference to the key's member of a (const) Recipe.
template <class Field>
KeyDecl int_key(std::string path, int64_t min, int64_t max, Field field, std::string meaning) {
    KeyDecl k{path, int_expected(min, max), std::move(meaning), "", "", nullptr, nullptr};
    k.read = [=](const Converter& c, Recipe& r) { c.get_int(path, min, max, field(r)); };
    k.write = [=](const Recipe& r) { return Value(field(r)); };
    return k;
}

template <class Field>
KeyDecl number_key(std::string path, double min, double max, bool min_open, bool max_open, std::string expected,
                   Field field, std::string meaning) {
    KeyDecl k{path, expected, std::move(meaning), "", "", nullptr, nullptr};
    k.read = [=](const Converter& c, Recipe& r) {
        c.get_number(path, min, max, min_open, max_open, expected, field(r));
    };
    k.write = [=](const Recipe& r) { return Value(field(r)); };
    return k;
}

template <class Field>
KeyDecl choice_key(std::string path, std::vector<std::string> choices, Field field, std::string meaning) {
    KeyDecl k{path, choice_expected(choices), std::move(meaning), "", "", nullptr, nullptr};
    k.read = [=](const Converter& c, Recipe& r) { c.get_choice(path, choices, field(r)); };
    k.write = [=](const Recipe& r) { return Value(field(r)); };
    return k;
}

template <class Field>
KeyDecl bool_key(std::string path, Field field, std::string meaning) {
    KeyDecl k{path, "true or false", std::move(meaning), "", "", nullptr, nullptr};
    k.read = [=](const Converter& c, Recipe& r) { c.get_bool(path, field(r)); };
    k.write = [=](const Recipe& r) { return Value(field(r)); };
    return k;
}

// A path (relative ones from the recipe file resolve from its directory).
template <class Field>
KeyDecl path_key(std::string path, Field field, std::string meaning) {
    KeyDecl k{path,   "a path (relative: from the recipe file's directory)", std::move(meaning), "", "", nullptr,
              nullptr};
    k.read = [=](const Converter& c, Recipe& r) { c.get_path(path, field(r)); };
    k.write = [=](const Recipe& r) { return Value(field(r)); };
    return k;
}

KeyDecl required(KeyDecl k, std::string what) {
    k.required_what = std::move(what);
    k.default_text = "(required)";
    return k;
}

KeyDecl default_text(KeyDecl k, std::string text) {
    k.default_text = std::move(text);
    return k;
}

#define MF_FIELD(member) \
    [](auto& r) -> auto& { return r.member; }

std::vector<KeyDecl> make_key_table() {
    constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();
    constexpr double kInf = std::numeric_limits<double>::infinity();
    std::vector<KeyDecl> t;
    t.push_back(required(path_key("model", MF_FIELD(model), "the Hugging Face model directory to fine-tune"),
                         "the HF model directory"));

    t.push_back(
        required(path_key("data.train", MF_FIELD(data.train), "the training dataset, JSONL (data/sft_dataset.h)"),
                 "the training dataset"));
    t.push_back(choice_key("data.format", {"tokens", "auto", "messages", "prompt_completion", "text"},
                           MF_FIELD(data.format), "record kind; auto: the kind of the first valid line"));
    t.push_back(
        bool_key("data.shuffle", MF_FIELD(data.shuffle), "visit documents in an order shuffled from seed and epoch"));
    t.push_back(bool_key("data.packing", MF_FIELD(data.packing),
                         "pack consecutive documents into one row of seq_len tokens (attention stays inside each)"));
    t.push_back(choice_key("data.on_error", {"stop", "skip"}, MF_FIELD(data.on_error),
                           "a malformed record stops the run, or is skipped and counted"));
    t.push_back(choice_key("data.chat_format", {"auto", "jinja", "chatml", "chatml_system", "chatml_think"},
                           MF_FIELD(data.chat_format),
                           "chat rendering; auto: the tokenizer's chat template (ChatML ones on the fast path), "
                           "jinja: always through the template interpreter"));
    KeyDecl kwargs{"data.chat_template_kwargs",
                   "a mapping of template variables",
                   "extra variables for the model's chat template, e.g. {enable_thinking: false}",
                   "",
                   "",
                   nullptr,
                   nullptr};
    kwargs.read = [](const Converter& c, Recipe& r) {
        c.get_mapping("data.chat_template_kwargs", r.data.chat_template_kwargs);
    };
    kwargs.write = [](const Recipe& r) { return r.data.chat_template_kwargs; };
    t.push_back(kwargs);
    t.push_back(choice_key("data.loss_on", {"assistant", "all"}, MF_FIELD(data.loss_on),
                           "which chat tokens count in the loss"));
    t.push_back(choice_key("data.on_empty", {"stop", "warn"}, MF_FIELD(data.on_empty),
                           "an optimizer step (all its micro-batches on all ranks) with no target token: stop the "
                           "run, or warn and skip it"));

    t.push_back(required(int_key("train.steps", 1, kMaxInt, MF_FIELD(train.steps), "optimizer steps to run"),
                         "the number of optimizer steps"));
    t.push_back(int_key("train.micro_batch", 1, int64_t{1} << 20, MF_FIELD(train.micro_batch),
                        "rows (sequences) per forward pass on each rank"));
    t.push_back(int_key("train.seq_len", 2, int64_t{1} << 24, MF_FIELD(train.seq_len),
                        "tokens per row; longer documents are truncated (a row needs 2 tokens for one target)"));
    t.push_back(int_key("train.grad_accum", 1, int64_t{1} << 20, MF_FIELD(train.grad_accum),
                        "micro-batches per optimizer step"));
    t.push_back(number_key("train.grad_clip", 0, kInf, false, false, "a finite number >= 0 (0 disables clipping)",
                           MF_FIELD(train.grad_clip), "clip the global gradient norm to this; 0 disables clipping"));
    t.push_back(int_key("train.log_every", 1, kMaxInt, MF_FIELD(train.log_every), "steps between log lines"));
    t.push_back(choice_key("train.recompute", {"none", "moe", "full"}, MF_FIELD(train.recompute),
                           "activation recomputation in the backward (less memory, more compute)"));
    t.push_back(choice_key("train.on_nonfinite", {"stop", "skip"}, MF_FIELD(train.on_nonfinite),
                           "a NaN/Inf loss or gradient stops the run, or skips the update"));

    t.push_back(number_key("optim.lr", 0, kInf, false, false, "a finite number >= 0", MF_FIELD(optim.lr),
                           "peak learning rate"));
    KeyDecl betas{
        "optim.betas", "a list of two numbers [beta1, beta2], each in [0, 1)", "AdamW's betas", "", "", nullptr,
        nullptr};
    betas.read = [](const Converter& c, Recipe& r) { c.get_betas("optim.betas", r.optim.beta1, r.optim.beta2); };
    betas.write = [](const Recipe& r) { return Value(Value::Array{r.optim.beta1, r.optim.beta2}); };
    t.push_back(betas);
    t.push_back(
        number_key("optim.eps", 0, kInf, true, false, "a finite number > 0", MF_FIELD(optim.eps), "AdamW's epsilon"));
    t.push_back(number_key("optim.weight_decay", 0, kInf, false, false, "a finite number >= 0",
                           MF_FIELD(optim.weight_decay), "decoupled weight decay (AdamW)"));
    KeyDecl no_decay{"optim.no_decay",
                     "a list of non-empty strings (glob patterns such as \"*norm*\")",
                     "HF parameter names (globs, * and ?) that get no weight decay",
                     "",
                     "",
                     nullptr,
                     nullptr};
    no_decay.read = [](const Converter& c, Recipe& r) { c.get_string_list("optim.no_decay", r.optim.no_decay); };
    no_decay.write = [](const Recipe& r) {
        Value::Array list;
        for (const std::string& p : r.optim.no_decay) list.emplace_back(p);
        return Value(std::move(list));
    };
    t.push_back(no_decay);
    t.push_back(choice_key("optim.schedule", {"constant", "cosine", "linear"}, MF_FIELD(optim.schedule),
                           "learning-rate schedule after the warm-up"));
    t.push_back(int_key("optim.warmup_steps", 0, kMaxInt, MF_FIELD(optim.warmup_steps),
                        "linear warm-up steps, at most train.steps"));
    t.push_back(number_key("optim.min_lr_ratio", 0, 1, false, false, "a number in [0, 1]", MF_FIELD(optim.min_lr_ratio),
                           "floor of the decay, as a fraction of lr"));

    KeyDecl eval_data = path_key("eval.data", MF_FIELD(eval.data), "held-out dataset evaluated during training");
    eval_data.type += "; null: none";
    eval_data.default_text = "null";
    eval_data.read = [](const Converter& c, Recipe& r) {
        if (!c.is_null("eval.data")) c.get_path("eval.data", r.eval.data);
    };
    eval_data.write = [](const Recipe& r) { return r.eval.data.empty() ? Value() : Value(r.eval.data); };
    t.push_back(eval_data);
    t.push_back(int_key("eval.every", 0, kMaxInt, MF_FIELD(eval.every),
                        "optimizer steps between evaluations; 0 = never (> 0 needs eval.data)"));
    t.push_back(default_text(int_key("eval.micro_batch", 1, int64_t{1} << 20, MF_FIELD(eval.micro_batch),
                                     "rows per evaluation forward pass"),
                             "train.micro_batch"));
    t.push_back(
        default_text(int_key("eval.seq_len", 2, int64_t{1} << 24, MF_FIELD(eval.seq_len), "tokens per evaluation row"),
                     "train.seq_len"));

    t.push_back(int_key("checkpoint.every", 0, kMaxInt, MF_FIELD(checkpoint.every),
                        "optimizer steps between resumable checkpoints; 0 = none"));
    t.push_back(int_key("checkpoint.keep", 1, 1 << 20, MF_FIELD(checkpoint.keep), "newest checkpoints kept"));
    t.push_back(bool_key("checkpoint.keep_best", MF_FIELD(checkpoint.keep_best),
                         "also keep the checkpoint with the best eval loss (needs eval.data and eval.every > 0)"));

    t.push_back(
        bool_key("log.tensorboard", MF_FIELD(log.tensorboard), "write TensorBoard event files under OUT/tensorboard"));
    t.push_back(default_text(int_key("log.every", 1, kMaxInt, MF_FIELD(log.every), "steps between TensorBoard scalars"),
                             "train.log_every"));

    t.push_back(int_key("dist.ep_size", 1, 1 << 20, MF_FIELD(dist.ep_size),
                        "expert-parallel group size; divides the world size and the expert count"));
    t.push_back(int_key("dist.ep_chunks", 1, 64, MF_FIELD(dist.ep_chunks),
                        "EP pipeline chunks whose all-to-alls overlap the other chunks' GEMMs"));
    t.push_back(number_key("dist.timeout_s", 0, kInf, true, false, "a finite number of seconds > 0",
                           MF_FIELD(dist.timeout_s),
                           "longest any single collective wait may last before the run fails"));
    t.push_back(bool_key("dist.shard_optimizer", MF_FIELD(dist.shard_optimizer),
                         "ZeRO-1: AdamW state sharded over each replica group"));
    t.push_back(choice_key("dist.log_ranks", {"main", "all"}, MF_FIELD(dist.log_ranks),
                           "main: rank 0 alone logs; all: every rank prints its lines"));

    t.push_back(int_key("seed", 0, kMaxInt, MF_FIELD(seed), "seed of the data order"));
    t.push_back(choice_key("device", {"auto", "cpu", "cuda"}, MF_FIELD(device), "auto: the GPU when there is one"));
    t.push_back(choice_key("precision", {"bf16", "mixed"}, MF_FIELD(precision),
                           "bf16: bf16 parameters, gradients and AdamW state; mixed: fp32 master weights and state"));
    t.push_back(required(path_key("out", MF_FIELD(out), "output directory of the fine-tuned HF model"),
                         "the output directory"));
    return t;
}

#undef MF_FIELD

const std::vector<KeyDecl>& key_table() {
    static const std::vector<KeyDecl> table = make_key_table();
    return table;
}

const std::vector<std::string>& known_keys() {
    static const std::vector<std::string> keys = [] {
        std::vector<std::string> out;
        for (const KeyDecl& k : key_table()) out.push_back(k.path);
        return out;
    }();
    return keys;
}

const std::vector<std::string>& sections() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> out;
        for (const KeyDecl& k : key_table()) {
            const size_t dot = k.path.find('.');
            if (dot == std::string::npos) continue;
            const std::string s = k.path.substr(0, dot);
            if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
        }
        return out;
    }();
    return names;
}

// Checks between keys, and the defaults that follow other keys (eval.*, log.every).
void check_relations(const Converter& conv, Recipe& r) {
    if (r.optim.warmup_steps > r.train.steps)
        fail(conv.origin("optim.warmup_steps"), ": optim.warmup_steps: expected at most train.steps (", r.train.steps,
             "), got ", r.optim.warmup_steps);
    if (r.data.train == "-")
        fail(conv.origin("data.train"), ": data.train: expected a file; '-' (standard input) cannot be read by every ",
             "rank and again for each epoch");
    if (r.eval.data == "-")
        fail(conv.origin("eval.data"), ": eval.data: expected a file; '-' (standard input) cannot be read by every ",
             "rank and again for each evaluation");
    if (!conv.has("eval.micro_batch")) r.eval.micro_batch = r.train.micro_batch;
    if (!conv.has("eval.seq_len")) r.eval.seq_len = r.train.seq_len;
    if (!conv.has("log.every")) r.log.every = r.train.log_every;
    if (r.eval.every > 0 && r.eval.data.empty())
        fail(conv.origin("eval.every"), ": eval.every: ", r.eval.every, " needs eval.data, the held-out dataset");
    if (r.checkpoint.keep_best && (r.eval.data.empty() || r.eval.every == 0))
        fail(conv.origin("checkpoint.keep_best"),
             ": checkpoint.keep_best: true needs evaluation during training (eval.data and eval.every > 0)");
    // Tokens of one micro-batch: its host buffers, and the activations, grow with this product.
    auto check_tokens = [&](const char* section, int64_t micro_batch, int64_t seq_len) {
        const std::string mb = std::string(section) + ".micro_batch", sl = std::string(section) + ".seq_len";
        if (micro_batch * seq_len <= kMaxMicroBatchTokens) return;  // both <= 2^24: no overflow
        const std::string& where = conv.has(mb) ? conv.origin(mb) : conv.has(sl) ? conv.origin(sl) : conv.origin(mb);
        fail(where, ": ", mb, " x ", sl, " = ", micro_batch, " x ", seq_len, " = ", micro_batch * seq_len,
             " tokens per micro-batch; at most ", kMaxMicroBatchTokens,
             " are allowed (the batch buffers alone would take ", micro_batch * seq_len * 17 / (1 << 20),
             " MiB, and the activations ~hidden_size x layers x tens of bytes per token more); lower ", mb,
             " and raise train.grad_accum instead");
    };
    check_tokens("train", r.train.micro_batch, r.train.seq_len);
    check_tokens("eval", r.eval.micro_batch, r.eval.seq_len);
}

std::string default_of(const KeyDecl& k) {
    if (!k.default_text.empty()) return k.default_text;
    const Value v = k.write(Recipe{});
    if (v.is_string()) return v.as_string().empty() ? "\"\"" : v.as_string();
    return v.dump();
}

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
                entries[path] = Entry{sub_value, origin_of(path), true};
            }
        } else {
            const size_t dot = key.find('.');
            if (dot != std::string::npos && is_known_key(key))
                fail(origin_of(key), ": '", key, "': in a recipe file write nested keys ('", key.substr(0, dot),
                     ":' then '  ", key.substr(dot + 1),
                     ": ...' on the next line); the dotted form is for "
                     "command-line overrides");
            if (!is_known_key(key)) unknown_key(origin_of(key), key);
            entries[key] = Entry{value, origin_of(key), true};
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
    entries[key] = Entry{std::move(value), origin, false};
}

}  // namespace

Recipe parse_recipe(std::string_view yaml_text, const std::string& source, const std::vector<std::string>& overrides,
                    const std::filesystem::path& base_dir) {
    const YamlDocument doc = parse_yaml_document(yaml_text, source);
    std::map<std::string, Entry> entries = flatten_file(doc, source);
    for (const std::string& o : overrides) apply_override(entries, o);

    const Converter conv(std::move(entries), source, base_dir);
    for (const KeyDecl& k : key_table())
        if (!k.required_what.empty()) conv.require(k.path, k.required_what);
    Recipe r;
    r.source = source;
    for (const KeyDecl& k : key_table()) k.read(conv, r);
    check_relations(conv, r);
    return r;
}

Recipe load_recipe(const std::filesystem::path& file, const std::vector<std::string>& overrides) {
    const std::string source = file.string();
    std::error_code ec;
    // A file that is not there or cannot be read is an I/O error (io::IoError); its content, a recipe's.
    if (!std::filesystem::exists(file, ec)) throw io::IoError(source + ": recipe file not found");
    if (!std::filesystem::is_regular_file(file, ec)) throw io::IoError(source + ": the recipe is not a regular file");
    const auto size = std::filesystem::file_size(file, ec);
    if (ec) throw io::IoError(source + ": cannot read the recipe: " + ec.message());
    if (size > kMaxYamlBytes)
        fail(source, ":1: the file is ", size, " bytes; recipes are limited to ", kMaxYamlBytes, " bytes");
    std::ifstream in(file, std::ios::binary);
    if (!in) fail(source, ": cannot open the recipe for reading");
    std::string text(static_cast<size_t>(size), '\0');
    in.read(text.data(), static_cast<std::streamsize>(size));
    if (in.gcount() != static_cast<std::streamsize>(size)) fail(source, ": short read of the recipe");
    return parse_recipe(text, source, overrides, file.parent_path());
}

json::Value Recipe::to_json() const {
    Value root = Value::object();
    for (const KeyDecl& k : key_table()) {
        const size_t dot = k.path.find('.');
        if (dot == std::string::npos) {
            root.set(k.path, k.write(*this));
            continue;
        }
        const std::string section = k.path.substr(0, dot);
        if (root.find(section) == nullptr) root.set(section, Value::object());
        for (auto& [name, value] : root.as_object())
            if (name == section) value.set(k.path.substr(dot + 1), k.write(*this));
    }
    return root;
}

std::vector<RecipeKeyDoc> recipe_key_docs() {
    std::vector<RecipeKeyDoc> out;
    for (const KeyDecl& k : key_table()) out.push_back({k.path, k.type, default_of(k), k.meaning});
    return out;
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
