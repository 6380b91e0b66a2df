// Minimal option parsing for the subcommands: `--name value`, `--flag`, and positionals.
// Unknown options and missing values are errors naming the option.
#pragma once

#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/check.h"

namespace mf::cli {

class ParsedArgs {
 public:
    // `with_value`: options that take a value; `flags`: options that do not.
    ParsedArgs(const Args& args, const std::set<std::string>& with_value, const std::set<std::string>& flags,
               const char* command) {
        for (size_t i = 0; i < args.size(); ++i) {
            const std::string& a = args[i];
            if (a.rfind("--", 0) == 0) {
                std::string name = a.substr(2), value;
                const size_t eq = name.find('=');
                const bool inline_value = eq != std::string::npos;
                if (inline_value) {
                    value = name.substr(eq + 1);
                    name = name.substr(0, eq);
                }
                if (with_value.count(name)) {
                    if (!inline_value) {
                        if (i + 1 >= args.size()) fail(command, ": option --", name, " needs a value");
                        value = args[++i];
                    }
                    values_[name] = value;
                } else if (flags.count(name) && !inline_value) {
                    flags_.insert(name);
                } else {
                    fail(command, ": unknown option --", name);
                }
            } else {
                positional_.push_back(a);
            }
        }
    }
    bool has(const std::string& name) const { return values_.count(name) || flags_.count(name); }
    std::string get(const std::string& name, const std::string& fallback = "") const {
        auto it = values_.find(name);
        return it == values_.end() ? fallback : it->second;
    }
    std::string require(const std::string& name, const char* command) const {
        auto it = values_.find(name);
        if (it == values_.end()) fail(command, ": missing required option --", name);
        return it->second;
    }
    const std::vector<std::string>& positional() const { return positional_; }

 private:
    std::map<std::string, std::string> values_;
    std::set<std::string> flags_;
    std::vector<std::string> positional_;
};

// Runs a subcommand's body, turning a std::filesystem error about a user's path (a name too long,
// a component that cannot be searched, ...) into an mf::Error naming the command, the path and the
// problem, instead of an "internal error".
template <typename Body>
int with_path_errors(const char* command, Body&& body) {
    try {
        return body();
    } catch (const std::filesystem::filesystem_error& e) {
        std::string paths = e.path1().string();
        if (!e.path2().empty()) paths += " -> " + e.path2().string();
        fail(command, ": ", paths, ": ", e.code().message());
    }
}

// Parses a non-negative integer option value, naming the option when it is not one.
int64_t parse_int_option(const std::string& value, const char* option);
// An integer in [min, max]; anything else is an error naming the option and the range.
int64_t parse_int_option(const std::string& value, const char* option, int64_t min, int64_t max);
// A finite number in [min, max] (NaN, infinities, "1e30" past max and non-numbers refused by name).
double parse_number_option(const std::string& value, const char* option, double min, double max);

}  // namespace mf::cli
