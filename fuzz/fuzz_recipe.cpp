// libFuzzer target: the training recipe parser (train::parse_recipe over train/yaml.h).
// Input layout: the recipe YAML, optionally followed by a NUL byte and command-line overrides,
// one per line ("key.sub=value"). Any input is accepted or refused with mf::Error; an accepted
// recipe must satisfy the ranges recipe.h promises and serialise (to_json) without error.
#include <vector>

#include "fuzz_util.h"
#include "train/recipe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view input = mf::fuzz::as_text(data, size);
    const size_t nul = input.find('\0');
    const std::string_view yaml = input.substr(0, nul);
    std::vector<std::string> overrides;
    if (nul != std::string_view::npos) {
        std::string_view rest = input.substr(nul + 1);
        while (!rest.empty()) {
            const size_t eol = rest.find('\n');
            overrides.emplace_back(rest.substr(0, eol));
            rest = eol == std::string_view::npos ? std::string_view{} : rest.substr(eol + 1);
        }
    }
    mf::fuzz::run_one([&] {
        const mf::train::Recipe r = mf::train::parse_recipe(yaml, "fuzz/recipe.yaml", overrides);
        MF_FUZZ_REQUIRE(r.train.steps >= 1, "train.steps < 1 accepted");
        MF_FUZZ_REQUIRE(r.train.micro_batch >= 1 && r.train.seq_len >= 1 && r.train.grad_accum >= 1,
                        "a batch dimension < 1 accepted");
        MF_FUZZ_REQUIRE(r.optim.warmup_steps >= 0 && r.optim.warmup_steps <= r.train.steps,
                        "warmup_steps outside [0, train.steps] accepted");
        MF_FUZZ_REQUIRE(r.optim.beta1 >= 0 && r.optim.beta1 < 1 && r.optim.beta2 >= 0 && r.optim.beta2 < 1,
                        "betas outside [0, 1) accepted");
        MF_FUZZ_REQUIRE(r.optim.eps > 0 && r.optim.lr >= 0, "eps <= 0 or lr < 0 accepted");
        (void)r.to_json().dump();
    });
    return 0;
}
