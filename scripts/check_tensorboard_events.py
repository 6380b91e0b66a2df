#!/usr/bin/env python3
"""Read moeforge's TensorBoard event files with TensorBoard's own reader and check the scalars.

    check_tensorboard_events.py DIR                       print the scalars of DIR as JSON
    check_tensorboard_events.py DIR EXPECTED.json         ... and exit 1 on any mismatch
    check_tensorboard_events.py DIR --metrics OUT/metrics.jsonl
                                                          ... expected values from the run's metrics

DIR is a run's OUT/tensorboard (every events.out.tfevents.* file in it is read). The reader is
tensorboard's EventAccumulator (tensorboard.backend.event_processing.event_accumulator); without the
tensorboard package, tensorflow's summary_iterator. Neither installed is an error (exit 2) unless
--builtin-reader is given, which decodes the files with this script's own TFRecord/protobuf reader
(CRCs checked): that one is not an independent check of the format, only a convenience.

Output: {"reader": NAME, "scalars": {TAG: [[STEP, VALUE], ...]}} (values as float32 widened to
float; NaN and Inf as the strings "nan", "inf", "-inf"). EXPECTED.json has the form of "scalars".
--metrics builds it from metrics.jsonl with the trainer's tags: train/loss, train/ce_loss,
train/aux_loss, train/grad_norm, train/lr, train/tokens_per_s, train/peak_mem_gib (one per step
line) and val/loss (from val_loss where a line has one); a null there stands for any non-finite
value. Values match when equal after rounding the expected one to float32 (relative tolerance 1e-6
by default); the tags and each tag's steps must match exactly.
"""
import argparse
import glob
import json
import math
import os
import struct
import sys

METRICS_TAGS = {
    "loss": "train/loss",
    "ce_loss": "train/ce_loss",
    "aux_loss": "train/aux_loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "peak_mem_gib": "train/peak_mem_gib",
    "val_loss": "val/loss",
}


def event_files(directory):
    files = sorted(glob.glob(os.path.join(directory, "*tfevents*")))
    if not files:
        sys.exit(f"{directory}: no events.out.tfevents.* files")
    return files


def read_with_tensorboard(directory):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(directory, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_with_tensorflow(directory):
    import tensorflow as tf

    scalars = {}
    for path in event_files(directory):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


# --- the builtin reader (--builtin-reader) ---------------------------------------------------------
def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def masked_crc(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(buf, pos):
    value, shift = 0, 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def fields(buf):
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, value


def read_builtin(directory):
    scalars = {}
    for path in event_files(directory):
        data = open(path, "rb").read()
        pos = 0
        while pos + 12 <= len(data):
            header = data[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            if struct.unpack("<I", data[pos + 8 : pos + 12])[0] != masked_crc(header):
                sys.exit(f"{path}: bad length CRC at byte {pos}")
            record = data[pos + 12 : pos + 12 + length]
            if pos + 16 + length > len(data):
                break  # a torn last record, as TensorBoard's reader treats it
            if struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] != masked_crc(record):
                sys.exit(f"{path}: bad data CRC at byte {pos}")
            pos += 16 + length
            step = 0
            for number, value in fields(record):
                if number == 2:
                    step = value - (1 << 64) if value >= 1 << 63 else value
                elif number == 5:
                    for vnum, vbytes in fields(value):
                        if vnum != 1:
                            continue
                        tag, simple = None, None
                        for fnum, fval in fields(vbytes):
                            if fnum == 1:
                                tag = fval.decode()
                            elif fnum == 2:
                                (simple,) = struct.unpack("<f", fval)
                        if tag is not None and simple is not None:
                            scalars.setdefault(tag, []).append((step, simple))
    return scalars


# --- expected values and the comparison ------------------------------------------------------------
def expected_from_metrics(path):
    expected = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break  # a torn last line
            if not line.strip():
                continue
            record = json.loads(line)
            if "step" not in record:
                sys.exit(f"{path}:{number}: no step")
            for field, tag in METRICS_TAGS.items():
                if field in record:
                    expected.setdefault(tag, []).append([record["step"], record[field]])
    return expected


def to_json_value(v):
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def from_json_value(v):
    if v is None:
        return None  # any non-finite value
    if isinstance(v, str):
        return float(v)
    return float(v)


def values_match(got, want, rtol):
    if want is None:
        return not math.isfinite(got)
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    want32 = struct.unpack("<f", struct.pack("<f", want))[0] if math.isfinite(want) and abs(want) < 3.4e38 else want
    return got == want32 or abs(got - want32) <= rtol * max(abs(want32), 1e-30)


def compare(scalars, expected, rtol):
    problems = []
    if set(scalars) != set(expected):
        problems.append(f"tags differ: events have {sorted(scalars)}, expected {sorted(expected)}")
    for tag in sorted(set(scalars) & set(expected)):
        got, want = sorted(scalars[tag], key=lambda e: e[0]), expected[tag]
        if [s for s, _ in got] != [int(s) for s, _ in want]:
            problems.append(f"{tag}: steps differ: events {[s for s, _ in got]}, expected {[s for s, _ in want]}")
            continue
        for (step, g), (_, w) in zip(got, want):
            if not values_match(g, from_json_value(w), rtol):
                problems.append(f"{tag} step {step}: events {g!r}, expected {w!r}")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="directory of event files (a run's OUT/tensorboard)")
    ap.add_argument("expected", nargs="?", help="JSON file {TAG: [[STEP, VALUE], ...]} to compare with")
    ap.add_argument("--metrics", help="metrics.jsonl to derive the expected scalars from")
    ap.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance after float32 rounding")
    ap.add_argument("--builtin-reader", action="store_true", help="without tensorboard/tensorflow, use this script's reader")
    args = ap.parse_args()
    if args.expected and args.metrics:
        sys.exit("give EXPECTED.json or --metrics, not both")

    event_files(args.dir)
    scalars, reader = None, None
    try:
        scalars, reader = read_with_tensorboard(args.dir), "tensorboard.EventAccumulator"
    except ImportError:
        try:
            scalars, reader = read_with_tensorflow(args.dir), "tensorflow.summary_iterator"
        except ImportError:
            if not args.builtin_reader:
                print("neither the tensorboard nor the tensorflow package is installed "
                      "(pip install tensorboard), or pass --builtin-reader", file=sys.stderr)
                sys.exit(2)
            scalars, reader = read_builtin(args.dir), "builtin (not independent)"
    out = {tag: [[int(s), to_json_value(float(v))] for s, v in sorted(vals, key=lambda e: e[0])]
           for tag, vals in sorted(scalars.items())}
    print(json.dumps({"reader": reader, "scalars": out}, indent=1))

    expected = None
    if args.metrics:
        expected = expected_from_metrics(args.metrics)
    elif args.expected:
        expected = json.load(open(args.expected))
    if expected is None:
        return
    problems = compare({t: [(s, float(v)) for s, v in vals] for t, vals in scalars.items()}, expected, args.rtol)
    if problems:
        for p in problems[:50]:
            print("MISMATCH: " + p, file=sys.stderr)
        print(f"{len(problems)} mismatches ({reader})", file=sys.stderr)
        sys.exit(1)
    print(f"OK: {sum(len(v) for v in expected.values())} scalars in {len(expected)} tags match ({reader})",
          file=sys.stderr)


if __name__ == "__main__":
    main()
