// `moeforge plot`: metrics.jsonl read back (train/metrics_log.h) and drawn as an SVG
// (train/loss_plot.h). The SVG is parsed back with a small XML checker (balanced tags, quoted
// attributes, entities only), and every polyline point is mapped back through the panel's
// data-to-pixel map to the (step, value) it must show.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <sstream>

#include "core/check.h"
#include "test_util.h"
#include "train/loss_plot.h"
#include "train/metrics_log.h"

namespace {

namespace fs = std::filesystem;
using mf::train::MetricsLog;
using mf::train::MetricsPoint;

struct Element {
    std::string name;
    std::map<std::string, std::string> attrs;
};

// Parses the XML subset the SVG uses; a test failure on unbalanced tags, an unquoted attribute, a
// stray '<' or '&' in text. Returns every element in document order.
std::vector<Element> parse_xml(const std::string& s) {
    std::vector<Element> elements;
    std::vector<std::string> open;
    size_t pos = 0;
    auto check_text = [&](const std::string& text) {
        for (size_t k = text.find('&'); k != std::string::npos; k = text.find('&', k + 1)) {
            const size_t semi = text.find(';', k);
            const std::string entity = semi == std::string::npos ? "" : text.substr(k, semi - k + 1);
            EXPECT_TRUE(entity == "&amp;" || entity == "&lt;" || entity == "&gt;" || entity == "&quot;")
                << "bad entity in: " << text;
        }
        EXPECT_EQ(text.find('>'), std::string::npos) << "stray '>' in text: " << text;
    };
    while (pos < s.size()) {
        const size_t lt = s.find('<', pos);
        check_text(s.substr(pos, lt == std::string::npos ? std::string::npos : lt - pos));
        if (lt == std::string::npos) break;
        if (s.compare(lt, 2, "<?") == 0) {
            const size_t end = s.find("?>", lt);
            EXPECT_NE(end, std::string::npos);
            EXPECT_EQ(lt, 0u) << "processing instruction not at the start";
            pos = end + 2;
            continue;
        }
        const size_t gt = s.find('>', lt);
        EXPECT_NE(gt, std::string::npos) << "unterminated tag at " << lt;
        if (gt == std::string::npos) break;
        std::string tag = s.substr(lt + 1, gt - lt - 1);
        pos = gt + 1;
        if (!tag.empty() && tag[0] == '/') {
            EXPECT_FALSE(open.empty()) << "closing </" << tag.substr(1) << "> with nothing open";
            if (open.empty()) continue;
            EXPECT_EQ(open.back(), tag.substr(1)) << "mismatched closing tag";
            open.pop_back();
            continue;
        }
        const bool self_closing = !tag.empty() && tag.back() == '/';
        if (self_closing) tag.pop_back();
        Element e;
        size_t k = 0;
        while (k < tag.size() && !std::isspace(static_cast<unsigned char>(tag[k]))) e.name += tag[k++];
        EXPECT_FALSE(e.name.empty()) << "empty tag name at " << lt;
        while (k < tag.size()) {
            while (k < tag.size() && std::isspace(static_cast<unsigned char>(tag[k]))) ++k;
            if (k >= tag.size()) break;
            const size_t eq = tag.find('=', k);
            EXPECT_NE(eq, std::string::npos) << "attribute without value in <" << tag << ">";
            if (eq == std::string::npos || eq + 1 >= tag.size() || tag[eq + 1] != '"') {
                ADD_FAILURE() << "unquoted attribute in <" << tag << ">";
                break;
            }
            const size_t close = tag.find('"', eq + 2);
            EXPECT_NE(close, std::string::npos) << "unterminated attribute in <" << tag << ">";
            if (close == std::string::npos) break;
            const std::string name = tag.substr(k, eq - k), value = tag.substr(eq + 2, close - eq - 2);
            EXPECT_EQ(e.attrs.count(name), 0u) << "duplicate attribute " << name;
            check_text(value);
            e.attrs[name] = value;
            k = close + 1;
        }
        elements.push_back(e);
        if (!self_closing) open.push_back(e.name);
    }
    EXPECT_TRUE(open.empty()) << "unclosed <" << (open.empty() ? "" : open.back()) << ">";
    return elements;
}

struct Polyline {
    std::vector<std::pair<double, double>> pixels;
    std::vector<MetricsPoint> data;  // the pixels mapped back
    double left = 0, right = 0, top = 0, bottom = 0;
    double x_tolerance = 0, y_tolerance = 0;  // one rounding of the printed pixel (0.005) in data units
};

std::map<std::string, Polyline> polylines(const std::vector<Element>& elements) {
    std::map<std::string, Polyline> out;
    for (const Element& e : elements) {
        if (e.name != "polyline") continue;
        Polyline p;
        auto num = [&](const char* a) { return std::stod(e.attrs.at(a)); };
        const double x0 = num("data-x0"), x1 = num("data-x1"), y0 = num("data-y0"), y1 = num("data-y1");
        p.left = num("data-left");
        p.right = num("data-right");
        p.top = num("data-top");
        p.bottom = num("data-bottom");
        p.x_tolerance = 0.0051 * (x1 - x0) / (p.right - p.left);
        p.y_tolerance = 0.0051 * (y1 - y0) / (p.bottom - p.top);
        std::istringstream in(e.attrs.at("points"));
        std::string pair;
        while (in >> pair) {
            const size_t comma = pair.find(',');
            const double px = std::stod(pair.substr(0, comma)), py = std::stod(pair.substr(comma + 1));
            p.pixels.emplace_back(px, py);
            p.data.push_back({x0 + (px - p.left) / (p.right - p.left) * (x1 - x0),
                              y0 + (p.bottom - py) / (p.bottom - p.top) * (y1 - y0)});
        }
        EXPECT_EQ(std::to_string(p.pixels.size()), e.attrs.at("data-points"));
        out[e.attrs.at("data-series")] = p;
    }
    return out;
}

void expect_shows(const Polyline& line, const std::vector<MetricsPoint>& expected, const std::string& what) {
    ASSERT_EQ(line.data.size(), expected.size()) << what;
    for (size_t k = 0; k < expected.size(); ++k) {
        EXPECT_NEAR(line.data[k].step, expected[k].step, line.x_tolerance) << what << " point " << k;
        EXPECT_NEAR(line.data[k].value, expected[k].value, line.y_tolerance) << what << " point " << k;
        EXPECT_GE(line.pixels[k].first, line.left - 1e-9) << what;
        EXPECT_LE(line.pixels[k].first, line.right + 1e-9) << what;
        EXPECT_GE(line.pixels[k].second, line.top - 1e-9) << what;
        EXPECT_LE(line.pixels[k].second, line.bottom + 1e-9) << what;
    }
}

std::string record(int64_t step, const std::string& loss, const std::string& lr, const std::string& grad_norm,
                   const std::string& extra = "") {
    return "{\"step\": " + std::to_string(step) + ", \"loss\": " + loss + ", \"ce_loss\": " + loss +
           ", \"aux_loss\": 0.01, \"grad_norm\": " + grad_norm + ", \"lr\": " + lr +
           ", \"tokens\": 512, \"tokens_per_s\": 1000.5, \"peak_mem_gib\": 0.25" + extra + "}\n";
}

std::string g17(double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return buf;
}

double loss_at(int64_t s) { return 4.0 * std::exp(-0.05 * static_cast<double>(s)) + 0.5; }
double lr_at(int64_t s) { return 1e-3 * std::min(1.0, static_cast<double>(s) / 10.0); }
double gn_at(int64_t s) { return 1.0 + 0.5 * std::sin(static_cast<double>(s)); }

std::string expect_error(const fs::path& file) {
    try {
        (void)mf::train::read_metrics_jsonl(file);
    } catch (const mf::Error& e) {
        return e.what();
    }
    ADD_FAILURE() << file << " was accepted";
    return "";
}

}  // namespace

TEST(Plot, EveryCurveShowsItsDataAndTheSvgIsWellFormed) {
    const fs::path dir = mf::test::temp_dir("plot_roundtrip");
    std::string text;
    std::vector<MetricsPoint> loss, lr, gn, val;
    for (int64_t s = 1; s <= 37; ++s) {
        std::string extra;
        if (s % 10 == 0) {
            extra = ", \"val_loss\": " + g17(loss_at(s) + 0.2);
            val.push_back({static_cast<double>(s), loss_at(s) + 0.2});
        }
        text += record(s, g17(loss_at(s)), g17(lr_at(s)), g17(gn_at(s)), extra);
        loss.push_back({static_cast<double>(s), loss_at(s)});
        lr.push_back({static_cast<double>(s), lr_at(s)});
        gn.push_back({static_cast<double>(s), gn_at(s)});
    }
    mf::test::write_file(dir / "metrics.jsonl", text);
    const MetricsLog log = mf::train::read_metrics_jsonl(dir / "metrics.jsonl");
    EXPECT_EQ(log.num_records, 37);
    EXPECT_EQ(log.first_step, 1);
    EXPECT_EQ(log.last_step, 37);
    EXPECT_FALSE(log.torn_last_line);
    const std::string svg = mf::train::render_loss_svg(log, "run <a & b>");
    const std::vector<Element> elements = parse_xml(svg);
    ASSERT_FALSE(elements.empty());
    EXPECT_EQ(elements[0].name, "svg");
    EXPECT_NE(svg.find("run &lt;a &amp; b&gt;"), std::string::npos);
    auto lines = polylines(elements);
    ASSERT_EQ(lines.size(), 4u);
    expect_shows(lines["train-loss"], loss, "train-loss");
    expect_shows(lines["val-loss"], val, "val-loss");
    expect_shows(lines["lr"], lr, "lr");
    expect_shows(lines["grad-norm"], gn, "grad-norm");
    // Ticks and labels: each panel has a frame, y tick labels and the "step" label.
    int frames = 0, step_labels = 0;
    for (const Element& e : elements)
        frames += e.name == "rect" && e.attrs.count("class") && e.attrs.at("class") == "frame";
    for (size_t k = svg.find(">step</text>"); k != std::string::npos; k = svg.find(">step</text>", k + 1))
        ++step_labels;
    EXPECT_EQ(frames, 3);
    EXPECT_EQ(step_labels, 3);
    EXPECT_NE(svg.find(">0.0010</text>"), std::string::npos) << "the lr axis (step 2e-4) labels 1e-3";
}

TEST(Plot, NullValuesAreSkippedAndSkippedUpdatesCounted) {
    const fs::path dir = mf::test::temp_dir("plot_null");
    std::string text;
    for (int64_t s = 1; s <= 6; ++s)
        text += s == 3 ? record(s, "null", "0.001", "null", ", \"skipped\": true") : record(s, "2.0", "0.001", "1.0");
    mf::test::write_file(dir / "metrics.jsonl", text);
    const MetricsLog log = mf::train::read_metrics_jsonl(dir / "metrics.jsonl");
    EXPECT_EQ(log.num_records, 6);
    EXPECT_EQ(log.num_skipped, 1);
    EXPECT_EQ(log.loss.num_points(), 5u);
    EXPECT_EQ(log.loss.num_nonfinite(), 1u);
    EXPECT_EQ(log.grad_norm.num_points(), 5u);
    EXPECT_EQ(log.lr.num_points(), 6u);
    EXPECT_TRUE(log.val_loss.empty());
    const std::string svg = mf::train::render_loss_svg(log, "t");
    auto lines = polylines(parse_xml(svg));
    EXPECT_EQ(lines.count("val-loss"), 0u);
    EXPECT_EQ(lines["train-loss"].data.size(), 5u);
    for (const MetricsPoint& p : lines["train-loss"].data) EXPECT_NE(std::lround(p.step), 3);
    EXPECT_NE(svg.find("1 update skipped"), std::string::npos);
}

TEST(Plot, OneStepRendersInsideTheFrame) {
    const fs::path dir = mf::test::temp_dir("plot_one");
    mf::test::write_file(dir / "metrics.jsonl", record(1, "3.5", "0", "0.75"));
    const MetricsLog log = mf::train::read_metrics_jsonl(dir / "metrics.jsonl");
    const std::string svg = mf::train::render_loss_svg(log, "one");
    const std::vector<Element> elements = parse_xml(svg);
    auto lines = polylines(elements);
    expect_shows(lines["train-loss"], {{1, 3.5}}, "train-loss");
    expect_shows(lines["lr"], {{1, 0}}, "lr");
    expect_shows(lines["grad-norm"], {{1, 0.75}}, "grad-norm");
    int markers = 0;
    for (const Element& e : elements) markers += e.name == "circle";
    EXPECT_EQ(markers, 3) << "a one-point curve is drawn as a dot";
}

TEST(Plot, ATornLastLineIsIgnored) {
    const fs::path dir = mf::test::temp_dir("plot_torn");
    mf::test::write_file(dir / "metrics.jsonl",
                         record(1, "2", "0.1", "1") + record(2, "1.5", "0.1", "1") + "{\"step\": 3, \"loss\": 1.");
    const MetricsLog log = mf::train::read_metrics_jsonl(dir / "metrics.jsonl");
    EXPECT_EQ(log.num_records, 2);
    EXPECT_TRUE(log.torn_last_line);
    EXPECT_EQ(log.last_step, 2);
    // Only a torn line: no record at all.
    mf::test::write_file(dir / "metrics.jsonl", "{\"step\": 1, \"lo");
    EXPECT_NE(expect_error(dir / "metrics.jsonl").find("torn"), std::string::npos);
}

TEST(Plot, ErrorsNameTheFileAndLine) {
    const fs::path dir = mf::test::temp_dir("plot_errors");
    const fs::path file = dir / "metrics.jsonl";
    const std::string where = file.string() + ":";

    mf::test::write_file(file, "");
    std::string e = expect_error(file);
    EXPECT_NE(e.find(file.string()), std::string::npos) << e;
    EXPECT_NE(e.find("empty"), std::string::npos) << e;

    mf::test::write_file(file, record(1, "2", "0.1", "1") + record(2, "2", "0.1", "1") + "{\"step\": 3, oops}\n" +
                                   record(4, "2", "0.1", "1"));
    e = expect_error(file);
    EXPECT_NE(e.find(where + "3:"), std::string::npos) << e;

    mf::test::write_file(file, record(1, "2", "0.1", "1") + "{\"loss\": 2}\n");
    e = expect_error(file);
    EXPECT_NE(e.find(where + "2:"), std::string::npos) << e;
    EXPECT_NE(e.find("\"step\""), std::string::npos) << e;

    mf::test::write_file(file, record(1, "\"high\"", "0.1", "1"));
    e = expect_error(file);
    EXPECT_NE(e.find(where + "1:"), std::string::npos) << e;
    EXPECT_NE(e.find("\"loss\""), std::string::npos) << e;

    mf::test::write_file(file, "{\"step\": 1.5, \"loss\": 2}\n");
    EXPECT_NE(expect_error(file).find(where + "1:"), std::string::npos);

    mf::test::write_file(file, "[1, 2]\n");
    EXPECT_NE(expect_error(file).find("object"), std::string::npos);

    EXPECT_NE(expect_error(dir / "absent.jsonl").find("absent.jsonl"), std::string::npos);
    fs::create_directories(dir / "dir.jsonl");
    EXPECT_NE(expect_error(dir / "dir.jsonl").find("directory"), std::string::npos);

    mf::test::write_file(file, std::string(mf::train::kMaxMetricsLineBytes + 10, ' ') + "\n");
    e = expect_error(file);
    EXPECT_NE(e.find(where + "1:"), std::string::npos) << e;
    EXPECT_NE(e.find("longer"), std::string::npos) << e;
}

TEST(Plot, DecimationKeepsEveryPointUpToTheCapAndTheExtremesPast) {
    mf::train::DecimatedSeries small(8);
    for (int k = 0; k < 8; ++k) small.add(k, k * 0.5);
    small.add(8, std::nan(""));
    ASSERT_EQ(small.points().size(), 8u);
    EXPECT_EQ(small.num_nonfinite(), 1u);
    for (int k = 0; k < 8; ++k) EXPECT_EQ(small.points()[k].value, k * 0.5);

    mf::train::DecimatedSeries big(64);
    const int n = 100000;
    for (int k = 0; k < n; ++k) big.add(k, k == 77777 ? 1e6 : (k == 4242 ? -5.0 : std::sin(k * 0.001)));
    const std::vector<MetricsPoint> pts = big.points();
    EXPECT_LE(pts.size(), 128u);
    EXPECT_GE(pts.size(), 32u);
    EXPECT_EQ(big.num_points(), static_cast<size_t>(n));
    EXPECT_EQ(big.max_value(), 1e6);
    EXPECT_EQ(big.min_value(), -5.0);
    bool spike = false, dip = false;
    for (size_t k = 0; k < pts.size(); ++k) {
        spike |= pts[k].step == 77777 && pts[k].value == 1e6;
        dip |= pts[k].step == 4242 && pts[k].value == -5.0;
        if (k > 0) {
            EXPECT_LT(pts[k - 1].step, pts[k].step) << "points in step order";
        }
    }
    EXPECT_TRUE(spike);
    EXPECT_TRUE(dip);
    EXPECT_EQ(pts.front().step, 0);
}

TEST(Plot, AHugeFileGivesABoundedSvg) {
    const fs::path dir = mf::test::temp_dir("plot_huge");
    std::string text;
    const int64_t n = 200000;
    text.reserve(static_cast<size_t>(n) * 80);
    for (int64_t s = 1; s <= n; ++s)
        text += "{\"step\": " + std::to_string(s) + ", \"loss\": " + (s == 123456 ? "90" : g17(loss_at(s % 100))) +
                ", \"lr\": 0.0001, \"grad_norm\": 1}\n";
    mf::test::write_file(dir / "metrics.jsonl", text);
    const MetricsLog log = mf::train::read_metrics_jsonl(dir / "metrics.jsonl");
    EXPECT_EQ(log.num_records, n);
    const std::string svg = mf::train::render_loss_svg(log, "huge");
    EXPECT_LT(svg.size(), size_t{200} << 10);
    auto lines = polylines(parse_xml(svg));
    const Polyline& loss = lines["train-loss"];
    EXPECT_LE(loss.data.size(), 2048u);
    double top = 0;
    for (const MetricsPoint& p : loss.data) top = std::max(top, p.value);
    EXPECT_NEAR(top, 90.0, loss.y_tolerance) << "the spike survives decimation";
}

TEST(Plot, CommandWritesLossSvgAtomicallyAndReportsErrors) {
    const fs::path dir = mf::test::temp_dir("plot_cli");
    std::string text;
    for (int64_t s = 1; s <= 5; ++s) text += record(s, g17(loss_at(s)), "0.001", "1");
    mf::test::write_file(dir / "metrics.jsonl", text);
    std::string out;
    const std::string bin = mf::test::moeforge_binary();
    ASSERT_EQ(mf::test::run_command(bin + " plot " + dir.string(), &out), 0) << out;
    EXPECT_NE(out.find("loss.svg"), std::string::npos) << out;
    const std::string svg = mf::test::read_file(dir / "loss.svg");
    EXPECT_EQ(polylines(parse_xml(svg))["train-loss"].data.size(), 5u);
    for (const auto& e : fs::directory_iterator(dir))
        EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << "left " << e.path();

    ASSERT_EQ(mf::test::run_command(bin + " plot " + dir.string() + " --out " + (dir / "other.svg").string(), &out), 0);
    EXPECT_TRUE(fs::exists(dir / "other.svg"));

    out.clear();
    const fs::path empty = mf::test::temp_dir("plot_cli_empty");
    EXPECT_EQ(mf::test::run_command(bin + " plot " + empty.string(), &out), 1);
    EXPECT_NE(out.find((empty / "metrics.jsonl").string()), std::string::npos) << out;
    EXPECT_FALSE(fs::exists(empty / "loss.svg"));

    out.clear();
    EXPECT_NE(mf::test::run_command(bin + " plot", &out), 0);
    EXPECT_NE(out.find("OUT"), std::string::npos) << out;
}
