// `moeforge plot OUT [--out FILE.svg]`: draws OUT/metrics.jsonl (training and validation loss,
// learning rate, gradient norm against the step) into OUT/loss.svg, written atomically.
#include <cstdio>
#include <filesystem>

#include "cli/args.h"
#include "cli/commands.h"
#include "io/file.h"
#include "train/loss_plot.h"
#include "train/metrics_log.h"

namespace mf::cli {

int cmd_plot(const Args& args) {
    const ParsedArgs a(args, {"out"}, {}, "plot");
    if (a.positional().size() != 1)
        fail("plot: expected one training output directory: moeforge plot OUT [--out FILE.svg]");
    const std::filesystem::path run_dir = a.positional()[0];
    const std::filesystem::path metrics = run_dir / "metrics.jsonl";
    const std::filesystem::path svg = a.has("out") ? std::filesystem::path(a.get("out")) : run_dir / "loss.svg";
    if (svg.empty()) fail("plot: --out is empty");
    const train::MetricsLog log = train::read_metrics_jsonl(metrics);
    io::atomic_write_file(svg, train::render_loss_svg(log, "moeforge: " + run_dir.string()));
    std::printf("wrote %s: %lld records, steps %lld-%lld%s%s\n", svg.string().c_str(),
                static_cast<long long>(log.num_records), static_cast<long long>(log.first_step),
                static_cast<long long>(log.last_step), log.val_loss.empty() ? "" : ", with validation loss",
                log.torn_last_line ? " (a torn last line was ignored)" : "");
    return 0;
}

}  // namespace mf::cli
