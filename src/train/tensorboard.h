// TensorBoard event files, written by hand: no protobuf or TensorFlow dependency.
//
// A file is a sequence of TFRecords, each
//     uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
// with masked_crc = ((crc >> 15) | (crc << 17)) + 0xa282ead8 and CRC-32C (io/crc32c.h). Each record's
// data is a serialized tensorboard.Event (tensorboard/compat/proto/event.proto):
//     wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5 (Summary)
// and Summary (summary.proto) is `repeated Value value = 1` with Value.tag = 1 (string) and
// Value.simple_value = 2 (float). The first record is {wall_time, file_version: "brain.Event:2"};
// then one Event per step holding every scalar of that step.
//
// Invariants:
//   - The file is dir/events.out.tfevents.<unix time, 10 digits>.<hostname>.<pid>.<n>, created with
//     O_EXCL (n counts up past an existing name), so two writers never share a file.
//   - scalar() gathers the values of one step; a scalar of another step, flush() or the destructor
//     writes the step's Event. flush() hands the bytes to the kernel (write(2)), so a run killed
//     after flush() keeps everything it logged; the destructor also fsyncs.
//   - Values are stored as float32 (TensorBoard's simple_value); NaN and Inf are stored as they are.
//   - Every failure is an mf::Error naming the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace mf::train {

class TensorBoardWriter {
 public:
    // Creates `dir` if needed and the event file inside it, and writes the file_version record.
    explicit TensorBoardWriter(const std::filesystem::path& dir);
    ~TensorBoardWriter();
    TensorBoardWriter(const TensorBoardWriter&) = delete;
    TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

    // Records `value` under `tag` (e.g. "train/loss", non-empty) at `step`.
    void scalar(const std::string& tag, int64_t step, double value);
    // Writes the pending step's Event to the file (a no-op when nothing is pending).
    void flush();

    const std::filesystem::path& file() const { return file_; }

 private:
    void write_event(const std::string& event);
    void write_pending();

    std::filesystem::path file_;
    int fd_ = -1;
    bool has_pending_ = false;
    int64_t pending_step_ = 0;
    std::string pending_values_;  // serialized Summary.Value fields of the pending step
};

}  // namespace mf::train
