// Reading a run's OUT/metrics.jsonl back: one JSON object per line, as the trainer writes it
// ({"step": N, "loss": ..., "ce_loss": ..., "aux_loss": ..., "grad_norm": ..., "lr": ..., "tokens": ...,
// "tokens_per_s": ..., "peak_mem_gib": ..., optionally "val_loss": ... and "skipped": true}).
//
// Invariants:
//   - Memory is bounded whatever the file's size: the file is streamed line by line (a line longer
//     than kMaxMetricsLineBytes is an error) and each series is decimated as it arrives
//     (DecimatedSeries keeps at most max_buckets buckets of consecutive points, each bucket its
//     smallest and largest point, so a spike survives decimation).
//   - A value written as null (the trainer writes a NaN or Inf as null, JSON having neither) is not
//     a point; it is counted in num_nonfinite. A field that is absent is simply not part of that
//     series (a line may carry only {"step", "val_loss"}).
//   - A last line without its newline that does not parse is a torn write of a running (or killed)
//     training and is ignored; any other line that does not parse is an error naming the file, the
//     line and the problem. A file without any record is an error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <vector>

namespace mf::train {

constexpr size_t kMaxMetricsLineBytes = size_t{1} << 20;

struct MetricsPoint {
    double step = 0;
    double value = 0;
};

// A series of (step, value) points decimated as they arrive. Until more than max_buckets points
// arrive every point is kept; past that, consecutive points share buckets of a power-of-two width
// and each bucket keeps its first smallest and first largest point, so points() returns at most
// 2 * max_buckets points, in arrival order, and the series' extremes are always among them.
class DecimatedSeries {
 public:
    explicit DecimatedSeries(size_t max_buckets = 1024);

    // Adds a point; a non-finite value is counted in num_nonfinite() and not kept.
    void add(double step, double value);

    std::vector<MetricsPoint> points() const;
    size_t num_points() const { return num_points_; }  // finite points added
    size_t num_nonfinite() const { return num_nonfinite_; }
    bool empty() const { return num_points_ == 0; }
    // The exact ranges over every finite point added (undefined when empty()).
    double min_step() const { return min_step_; }
    double max_step() const { return max_step_; }
    double min_value() const { return min_value_; }
    double max_value() const { return max_value_; }

 private:
    struct Bucket {
        size_t count = 0;
        uint64_t lo_idx = 0, hi_idx = 0;  // arrival index of the kept points
        MetricsPoint lo, hi;
    };
    void merge_pairs();

    size_t max_buckets_;
    size_t width_ = 1;  // points per full bucket
    std::vector<Bucket> buckets_;
    size_t num_points_ = 0, num_nonfinite_ = 0;
    double min_step_ = 0, max_step_ = 0, min_value_ = 0, max_value_ = 0;
};

struct MetricsLog {
    DecimatedSeries loss, val_loss, lr, grad_norm;
    int64_t num_records = 0;  // lines with a step
    int64_t num_skipped = 0;  // records marked "skipped": true (the update was skipped)
    int64_t first_step = 0, last_step = 0;
    bool torn_last_line = false;
};

// Reads `file` (see the invariants above); `max_buckets` bounds each series.
MetricsLog read_metrics_jsonl(const std::filesystem::path& file, size_t max_buckets = 1024);

}  // namespace mf::train
