// A training run's curves as a standalone SVG (no dependency): three stacked panels against the
// step: loss (training, and validation when present), learning rate, gradient norm. Each panel
// has a frame, "nice" ticks (1, 2 or 5 times a power of ten) with labels, grid lines and a title.
//
// Each curve is one <polyline class="series" data-series="NAME" ...> whose attributes also carry
// the panel's data-to-pixel map (data-x0/x1: the step axis' range, data-y0/y1: the value axis',
// data-left/right/top/bottom: the plot area in pixels), so a reader (the tests) can map every point
// back to its (step, value). Names: train-loss, val-loss, lr, grad-norm. A curve of at most
// kMarkerMaxPoints points also gets a <circle class="marker"> per point (a one-step run shows a dot).
// Points come from DecimatedSeries, so a curve has at most 2 x its bucket count points.
#pragma once

#include <string>

#include "train/metrics_log.h"

namespace mf::train {

constexpr size_t kMarkerMaxPoints = 64;

// The SVG document; `title` is shown at the top (escaped).
std::string render_loss_svg(const MetricsLog& log, const std::string& title);

}  // namespace mf::train
