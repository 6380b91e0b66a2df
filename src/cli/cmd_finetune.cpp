// `finetune RECIPE [key.sub=value ...]`
#include "cli/args.h"
#include "train/recipe.h"
#include "train/trainer.h"

namespace mf::cli {

int cmd_finetune(const Args& args) {
    if (args.empty() || args[0].rfind("--", 0) == 0) fail("finetune: expected a recipe file: moeforge finetune RECIPE.yaml [key=value ...]");
    const std::vector<std::string> overrides(args.begin() + 1, args.end());
    const train::Recipe recipe = train::load_recipe(args[0], overrides);
    train::finetune(recipe);
    return 0;
}

}  // namespace mf::cli
