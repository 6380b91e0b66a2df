// `moeforge recipe --explain`: every recipe key with its type, default and meaning, from the
// recipe's key table (train/recipe.h: recipe_key_docs), so this list cannot drift from the parser.
//
//   moeforge recipe --explain          one block per key, grouped by section
//   moeforge recipe --explain --json   [{"key", "type", "default", "meaning"}, ...]
#include <cstdio>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/json.h"
#include "train/recipe.h"

namespace mf::cli {

int cmd_recipe(const Args& args) {
    const ParsedArgs a(args, {}, {"explain", "json"}, "recipe");
    if (!a.positional().empty()) fail("recipe: unexpected argument \"", a.positional()[0], "\" (expected --explain)");
    if (!a.has("explain"))
        fail("recipe: expected --explain (prints every recipe key with its type, default and meaning)");
    const std::vector<train::RecipeKeyDoc> docs = train::recipe_key_docs();
    if (a.has("json")) {
        json::Value list = json::Value::array();
        for (const auto& d : docs) {
            json::Value v = json::Value::object();
            v.set("key", d.path);
            v.set("type", d.type);
            v.set("default", d.default_value);
            v.set("meaning", d.meaning);
            list.push_back(std::move(v));
        }
        std::printf("%s\n", list.dump(2).c_str());
        return 0;
    }
    std::printf(
        "Recipe keys (YAML; nested as section: {key: value}, or key.sub=value on the command line).\n"
        "Relative paths in the recipe file resolve from its directory; on the command line, from the current one.\n");
    std::string section = "\x01";
    for (const auto& d : docs) {
        const size_t dot = d.path.find('.');
        const std::string s = dot == std::string::npos ? "" : d.path.substr(0, dot);
        if (s != section) {
            std::printf("\n%s\n", s.empty() ? "(top level)" : (s + ":").c_str());
            section = s;
        }
        std::printf("  %-22s %s; default %s\n  %-22s %s\n", d.path.c_str(), d.type.c_str(), d.default_value.c_str(), "",
                    d.meaning.c_str());
    }
    return 0;
}

}  // namespace mf::cli
