// `finetune RECIPE [key.sub=value ...] [--resume [DIR|auto]] [--force-resume]`
#include "cli/args.h"
#include "core/interrupt.h"
#include "io/file.h"
#include "train/recipe.h"
#include "train/trainer.h"

namespace mf::cli {

int cmd_finetune(const Args& args) {
    std::vector<std::string> rest;
    train::ResumeOptions resume;
    for (size_t i = 0; i < args.size(); ++i) {
        const std::string& a = args[i];
        if (a == "--resume") {
            // Optional value: a checkpoint directory, or "auto" (the default).
            if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0 && args[i + 1].find('=') == std::string::npos &&
                !args[i + 1].ends_with(".yaml") && !args[i + 1].ends_with(".yml"))
                resume.from = args[++i];
            else
                resume.from = "auto";
        } else if (a.rfind("--resume=", 0) == 0) {
            resume.from = a.substr(9);
            if (resume.from.empty()) fail("finetune: --resume= needs a value: a checkpoint directory or auto");
        } else if (a == "--force-resume") {
            resume.force = true;
        } else if (a.rfind("--", 0) == 0) {
            fail("finetune: unknown option ", a);
        } else {
            rest.push_back(a);
        }
    }
    if (rest.empty())
        fail("finetune: expected a recipe file: moeforge finetune RECIPE.yaml [key=value ...] [--resume [DIR|auto]]");
    const std::vector<std::string> overrides(rest.begin() + 1, rest.end());
    const train::Recipe recipe = train::load_recipe(rest[0], overrides);
    // SIGINT/SIGTERM: finish the step, save, exit 128 + signal (a second one: at once, temporaries removed).
    const interrupt::Scope interruptible(&io::remove_temporaries);
    const train::TrainSummary summary = train::finetune(recipe, resume);
    return summary.interrupted_by != 0 ? 128 + summary.interrupted_by : 0;
}

}  // namespace mf::cli
