// Reading metrics.jsonl back (see metrics_log.h).
#include "train/metrics_log.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "core/check.h"
#include "core/json.h"

namespace mf::train {

// --- DecimatedSeries ---------------------------------------------------------------------------

DecimatedSeries::DecimatedSeries(size_t max_buckets) : max_buckets_(max_buckets < 2 ? 2 : max_buckets) {}

void DecimatedSeries::add(double step, double value) {
    if (!std::isfinite(value) || !std::isfinite(step)) {
        ++num_nonfinite_;
        return;
    }
    const uint64_t idx = num_points_;
    if (num_points_ == 0) {
        min_step_ = max_step_ = step;
        min_value_ = max_value_ = value;
    } else {
        min_step_ = std::min(min_step_, step);
        max_step_ = std::max(max_step_, step);
        min_value_ = std::min(min_value_, value);
        max_value_ = std::max(max_value_, value);
    }
    ++num_points_;
    const MetricsPoint p{step, value};
    if (buckets_.empty() || buckets_.back().count >= width_) {
        if (buckets_.size() == max_buckets_) {
            merge_pairs();
            if (buckets_.back().count >= width_) buckets_.push_back({});
        } else {
            buckets_.push_back({});
        }
    }
    Bucket& b = buckets_.back();
    if (b.count == 0 || value < b.lo.value) {
        b.lo = p;
        b.lo_idx = idx;
    }
    if (b.count == 0 || value > b.hi.value) {
        b.hi = p;
        b.hi_idx = idx;
    }
    ++b.count;
}

void DecimatedSeries::merge_pairs() {
    std::vector<Bucket> merged;
    merged.reserve(buckets_.size() / 2 + 1);
    for (size_t k = 0; k < buckets_.size(); k += 2) {
        Bucket m = buckets_[k];
        if (k + 1 < buckets_.size()) {
            const Bucket& n = buckets_[k + 1];
            if (n.lo.value < m.lo.value) {
                m.lo = n.lo;
                m.lo_idx = n.lo_idx;
            }
            if (n.hi.value > m.hi.value) {
                m.hi = n.hi;
                m.hi_idx = n.hi_idx;
            }
            m.count += n.count;
        }
        merged.push_back(m);
    }
    buckets_ = std::move(merged);
    width_ *= 2;
}

std::vector<MetricsPoint> DecimatedSeries::points() const {
    std::vector<MetricsPoint> out;
    out.reserve(buckets_.size() * 2);
    for (const Bucket& b : buckets_) {
        if (b.lo_idx == b.hi_idx) {
            out.push_back(b.lo);
        } else if (b.lo_idx < b.hi_idx) {
            out.push_back(b.lo);
            out.push_back(b.hi);
        } else {
            out.push_back(b.hi);
            out.push_back(b.lo);
        }
    }
    return out;
}

// --- reading metrics.jsonl ---------------------------------------------------------------------

namespace {

// A numeric field: absent -> not a point (returns false); null -> NaN (a non-finite value the
// trainer wrote); a number -> its value; anything else is an error naming the field.
bool numeric_field(const json::Value& record, const char* field, const std::string& where, double& value) {
    const json::Value* v = record.find(field);
    if (v == nullptr) return false;
    if (v->is_null()) {
        value = std::nan("");
        return true;
    }
    if (!v->is_number())
        fail(where, ": field \"", field, "\": expected a number or null, got a ", json::kind_name(v->kind()));
    value = v->as_double();
    return true;
}

void add_record(const json::Value& record, const std::string& where, MetricsLog& log) {
    if (!record.is_object()) fail(where, ": expected a JSON object, got a ", json::kind_name(record.kind()));
    const json::Value* step_value = record.find("step");
    if (step_value == nullptr) fail(where, ": missing field \"step\"");
    if (!step_value->is_int() || step_value->as_int() < 0)
        fail(where, ": field \"step\": expected a non-negative integer, got ", step_value->dump());
    const int64_t step = step_value->as_int();
    if (log.num_records == 0) log.first_step = step;
    log.first_step = std::min(log.first_step, step);
    log.last_step = std::max(log.last_step, step);
    ++log.num_records;
    if (const json::Value* s = record.find("skipped"); s != nullptr) {
        if (!s->is_bool()) fail(where, ": field \"skipped\": expected true or false, got ", s->dump());
        if (s->as_bool()) ++log.num_skipped;
    }
    const double x = static_cast<double>(step);
    double v = 0;
    if (numeric_field(record, "loss", where, v)) log.loss.add(x, v);
    if (numeric_field(record, "val_loss", where, v)) log.val_loss.add(x, v);
    if (numeric_field(record, "lr", where, v)) log.lr.add(x, v);
    if (numeric_field(record, "grad_norm", where, v)) log.grad_norm.add(x, v);
}

// Streams the lines of a regular file, each at most kMaxMetricsLineBytes.
class LineStream {
 public:
    explicit LineStream(const std::filesystem::path& file) : name_(file.string()) {
        struct stat st {};
        if (::stat(name_.c_str(), &st) != 0) fail(name_, ": cannot open metrics: ", std::strerror(errno));
        if (S_ISDIR(st.st_mode)) fail(name_, ": is a directory, expected a metrics.jsonl file");
        if (!S_ISREG(st.st_mode)) fail(name_, ": is not a regular file, expected a metrics.jsonl file");
        file_ = std::fopen(name_.c_str(), "rb");
        if (file_ == nullptr) fail(name_, ": cannot open metrics: ", std::strerror(errno));
    }
    ~LineStream() { std::fclose(file_); }
    LineStream(const LineStream&) = delete;
    LineStream& operator=(const LineStream&) = delete;

    // The next line without its "\n" (and "\r"); `terminated` says whether a "\n" ended it.
    bool next(std::string& line, bool& terminated) {
        line.clear();
        terminated = false;
        int c;
        while ((c = std::getc(file_)) != EOF) {
            if (c == '\n') {
                terminated = true;
                break;
            }
            if (line.size() >= kMaxMetricsLineBytes)
                fail(name_, ":", line_no_ + 1, ": line longer than ", kMaxMetricsLineBytes,
                     " bytes (is this a metrics.jsonl file?)");
            line.push_back(static_cast<char>(c));
        }
        if (std::ferror(file_)) fail(name_, ": read error after line ", line_no_, ": ", std::strerror(errno));
        if (!terminated && line.empty()) return false;
        ++line_no_;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        return true;
    }
    int64_t line_no() const { return line_no_; }

 private:
    std::string name_;
    std::FILE* file_ = nullptr;
    int64_t line_no_ = 0;
};

bool is_blank(const std::string& line) { return line.find_first_not_of(" \t") == std::string::npos; }

}  // namespace

MetricsLog read_metrics_jsonl(const std::filesystem::path& file, size_t max_buckets) {
    MetricsLog log{DecimatedSeries(max_buckets), DecimatedSeries(max_buckets), DecimatedSeries(max_buckets),
                   DecimatedSeries(max_buckets)};
    LineStream lines(file);
    std::string line;
    bool terminated = false;
    while (lines.next(line, terminated)) {
        if (is_blank(line)) continue;
        const std::string where = file.string() + ":" + std::to_string(lines.line_no());
        json::Value record;
        try {
            record = json::parse(line, "");
        } catch (const Error& e) {
            if (!terminated) {  // a torn write at the end: the training is still running, or was killed
                log.torn_last_line = true;
                break;
            }
            fail(where, ": not a JSON object: ", e.what());
        }
        add_record(record, where, log);
    }
    if (log.num_records == 0)
        fail(file.string(), log.torn_last_line ? ": no complete metrics record (only a torn last line)"
                                               : ": no metrics records (the file is empty)");
    return log;
}

}  // namespace mf::train
