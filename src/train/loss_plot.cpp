// The SVG of a run's curves (see loss_plot.h). Axis arithmetic is in long double so that values
// near the limits of double (a diverged run's gradient norm) still give finite ranges.
#include "train/loss_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace mf::train {

namespace {

// --- layout (pixels) ---------------------------------------------------------------------------
constexpr double kWidth = 900;
constexpr double kPlotLeft = 90, kPlotRight = 880;
constexpr double kHeaderHeight = 44;  // the document title
constexpr double kPanelHeight = 250;  // one panel: its title row, the plot area, the x labels
constexpr double kPlotOffset = 30;    // from a panel's top to its plot area
constexpr double kPlotHeight = 180;

struct Axis {
    long double lo = 0, hi = 1, step = 1;
    std::vector<long double> ticks;
};

// A range [lo, hi] widened to multiples of a "nice" step (1, 2 or 5 x 10^k), about five steps long.
// An empty range (one point) is widened around its value first; `integer` axes step by >= 1.
Axis nice_axis(long double lo, long double hi, bool integer) {
    if (!(hi > lo)) {
        long double pad = lo == 0 ? 1.0L : std::fabs(lo) * 0.1L;
        if (integer) pad = std::max(pad, 1.0L);
        lo -= pad;
        hi += pad;
    }
    const long double raw = (hi - lo) / 5.0L;
    const long double mag = std::pow(10.0L, std::floor(std::log10(raw)));
    const long double norm = raw / mag;
    long double step = (norm < 1.5L ? 1.0L : norm < 3.0L ? 2.0L : norm < 7.0L ? 5.0L : 10.0L) * mag;
    if (integer) step = std::max(step, 1.0L);
    Axis a;
    a.step = step;
    a.lo = std::floor(lo / step) * step;
    a.hi = std::ceil(hi / step) * step;
    const long long n = std::llround((a.hi - a.lo) / step);
    for (long long k = 0; k <= n; ++k) a.ticks.push_back(a.lo + static_cast<long double>(k) * step);
    return a;
}

// Tick labels: fixed-point with as many decimals as the step needs, or scientific notation when the
// axis' values are very small or very large. One style per axis.
std::string format_tick(long double v, const Axis& axis) {
    if (std::fabs(v) < axis.step * 1e-6L) return "0";
    const long double extent = std::max(std::fabs(axis.lo), std::fabs(axis.hi));
    char buf[64];
    if (extent >= 1e-3L && extent < 1e7L) {
        const int decimals = std::clamp(static_cast<int>(std::ceil(-std::log10(axis.step) - 1e-9L)), 0, 9);
        std::snprintf(buf, sizeof buf, "%.*f", decimals, static_cast<double>(v));
    } else {
        const int digits = std::clamp(
            static_cast<int>(std::floor(std::log10(std::fabs(v))) - std::floor(std::log10(axis.step))), 0, 6);
        std::snprintf(buf, sizeof buf, "%.*e", digits, static_cast<double>(v));
    }
    return buf;
}

std::string num(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", v);
    return buf;
}

std::string exact(long double v) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%.17g", static_cast<double>(v));
    return buf;
}

std::string escape_xml(const std::string& s) {
    std::string out;
    for (char c : s) {
        switch (c) {
            case '&':
                out += "&amp;";
                break;
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '"':
                out += "&quot;";
                break;
            default:
                // Control characters are not allowed in XML 1.0 text.
                if (static_cast<unsigned char>(c) < 0x20 && c != '\t')
                    out += ' ';
                else
                    out += c;
        }
    }
    return out;
}

struct Curve {
    const char* name;   // data-series
    const char* label;  // legend
    const char* color;
    const DecimatedSeries* series;
};

struct PlotArea {
    double left, right, top, bottom;
    Axis x, y;
    double px(long double step) const {
        return left + static_cast<double>((step - x.lo) / (x.hi - x.lo)) * (right - left);
    }
    double py(long double value) const {
        return bottom - static_cast<double>((value - y.lo) / (y.hi - y.lo)) * (bottom - top);
    }
};

void draw_axes(std::string& out, const PlotArea& a) {
    out += "<g class=\"axes\" font-size=\"11\" fill=\"#333\">\n";
    for (long double t : a.y.ticks) {
        const std::string y = num(a.py(t));
        out += "<line class=\"grid\" x1=\"" + num(a.left) + "\" y1=\"" + y + "\" x2=\"" + num(a.right) + "\" y2=\"" +
               y + "\" stroke=\"#e4e4e4\"/>\n";
        out += "<text x=\"" + num(a.left - 6) + "\" y=\"" + num(a.py(t) + 4) + "\" text-anchor=\"end\">" +
               format_tick(t, a.y) + "</text>\n";
    }
    for (long double t : a.x.ticks) {
        const std::string x = num(a.px(t));
        out += "<line class=\"tick\" x1=\"" + x + "\" y1=\"" + num(a.bottom) + "\" x2=\"" + x + "\" y2=\"" +
               num(a.bottom + 5) + "\" stroke=\"#333\"/>\n";
        out += "<text x=\"" + x + "\" y=\"" + num(a.bottom + 18) + "\" text-anchor=\"middle\">" + format_tick(t, a.x) +
               "</text>\n";
    }
    out += "<rect class=\"frame\" x=\"" + num(a.left) + "\" y=\"" + num(a.top) + "\" width=\"" + num(a.right - a.left) +
           "\" height=\"" + num(a.bottom - a.top) + "\" fill=\"none\" stroke=\"#333\"/>\n";
    out += "<text x=\"" + num((a.left + a.right) / 2) + "\" y=\"" + num(a.bottom + 34) +
           "\" text-anchor=\"middle\">step</text>\n";
    out += "</g>\n";
}

void draw_curve(std::string& out, const PlotArea& a, const Curve& c) {
    const std::vector<MetricsPoint> points = c.series->points();
    out += "<polyline class=\"series\" data-series=\"" + std::string(c.name) + "\" data-points=\"" +
           std::to_string(points.size()) + "\" data-x0=\"" + exact(a.x.lo) + "\" data-x1=\"" + exact(a.x.hi) +
           "\" data-y0=\"" + exact(a.y.lo) + "\" data-y1=\"" + exact(a.y.hi) + "\" data-left=\"" + exact(a.left) +
           "\" data-right=\"" + exact(a.right) + "\" data-top=\"" + exact(a.top) + "\" data-bottom=\"" +
           exact(a.bottom) + "\" fill=\"none\" stroke=\"" + c.color + "\" stroke-width=\"1.5\" points=\"";
    for (size_t k = 0; k < points.size(); ++k) {
        if (k > 0) out += ' ';
        out += num(a.px(points[k].step)) + "," + num(a.py(points[k].value));
    }
    out += "\"/>\n";
    if (points.size() > kMarkerMaxPoints) return;
    for (const MetricsPoint& p : points)
        out += "<circle class=\"marker\" cx=\"" + num(a.px(p.step)) + "\" cy=\"" + num(a.py(p.value)) +
               "\" r=\"2.5\" fill=\"" + c.color + "\"/>\n";
}

// One panel: its title and legend, axes, and curves (the non-empty ones).
void draw_panel(std::string& out, int index, const char* title, const std::vector<Curve>& curves, const Axis& x_axis) {
    const double top = kHeaderHeight + kPanelHeight * index;
    PlotArea a{kPlotLeft, kPlotRight, top + kPlotOffset, top + kPlotOffset + kPlotHeight, x_axis, {}};
    bool any = false;
    long double lo = 0, hi = 0;
    for (const Curve& c : curves) {
        if (c.series->empty()) continue;
        lo = any ? std::min<long double>(lo, c.series->min_value()) : c.series->min_value();
        hi = any ? std::max<long double>(hi, c.series->max_value()) : c.series->max_value();
        any = true;
    }
    a.y = nice_axis(lo, hi, false);
    out += "<g class=\"panel\" data-panel=\"" + std::string(title) + "\">\n";
    out += "<text x=\"" + num(a.left) + "\" y=\"" + num(top + 20) + "\" font-size=\"14\" font-weight=\"bold\">" +
           title + "</text>\n";
    double legend_x = a.right;
    for (auto it = curves.rbegin(); it != curves.rend(); ++it) {
        if (it->series->empty() || curves.size() < 2) continue;
        legend_x -= 110;
        out += "<line x1=\"" + num(legend_x) + "\" y1=\"" + num(top + 16) + "\" x2=\"" + num(legend_x + 20) +
               "\" y2=\"" + num(top + 16) + "\" stroke=\"" + it->color + "\" stroke-width=\"2\"/>\n";
        out += "<text x=\"" + num(legend_x + 26) + "\" y=\"" + num(top + 20) + "\" font-size=\"12\">" + it->label +
               "</text>\n";
    }
    draw_axes(out, a);
    if (!any)
        out += "<text x=\"" + num((a.left + a.right) / 2) + "\" y=\"" + num((a.top + a.bottom) / 2) +
               "\" text-anchor=\"middle\" fill=\"#888\">no finite values</text>\n";
    for (const Curve& c : curves)
        if (!c.series->empty()) draw_curve(out, a, c);
    out += "</g>\n";
}

}  // namespace

std::string render_loss_svg(const MetricsLog& log, const std::string& title) {
    const Axis x_axis = nice_axis(log.first_step, log.last_step, true);
    std::vector<std::vector<Curve>> panels = {
        {{"train-loss", "training", "#1f77b4", &log.loss}},
        {{"lr", "learning rate", "#2ca02c", &log.lr}},
        {{"grad-norm", "grad norm", "#d62728", &log.grad_norm}},
    };
    if (!log.val_loss.empty()) panels[0].push_back({"val-loss", "validation", "#ff7f0e", &log.val_loss});
    const char* titles[] = {"loss", "learning rate", "gradient norm"};
    const double height = kHeaderHeight + kPanelHeight * static_cast<double>(panels.size()) + 10;

    std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
    out += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(kWidth) + "\" height=\"" + num(height) +
           "\" viewBox=\"0 0 " + num(kWidth) + " " + num(height) + "\" font-family=\"sans-serif\">\n";
    out += "<rect x=\"0\" y=\"0\" width=\"" + num(kWidth) + "\" height=\"" + num(height) + "\" fill=\"white\"/>\n";
    std::string subtitle = std::to_string(log.num_records) + " records, steps " + std::to_string(log.first_step) + "-" +
                           std::to_string(log.last_step);
    if (log.num_skipped > 0)
        subtitle +=
            ", " + std::to_string(log.num_skipped) + (log.num_skipped == 1 ? " update" : " updates") + " skipped";
    out += "<text x=\"" + num(kPlotLeft) + "\" y=\"24\" font-size=\"15\">" + escape_xml(title) + "</text>\n";
    out += "<text x=\"" + num(kPlotRight) + "\" y=\"24\" font-size=\"12\" text-anchor=\"end\" fill=\"#555\">" +
           escape_xml(subtitle) + "</text>\n";
    for (size_t k = 0; k < panels.size(); ++k) draw_panel(out, static_cast<int>(k), titles[k], panels[k], x_axis);
    out += "</svg>\n";
    return out;
}

}  // namespace mf::train
