// A parser for the subset of YAML that training recipes use, producing mf::json::Value.
//
// Supported: block mappings nested by indentation (spaces only), block sequences (`- item`, items
// are scalars, flow collections, mappings or nested sequences), flow sequences `[a, "b", [1, 2]]`
// and flow mappings `{a: 1, b: [x, y], c: {d: 2}}` on one line (nested in each other freely), plain / 'single' /
// "double" quoted scalars (double quotes take the escapes \" \\ \/ \n \t \r \uXXXX), comments (`#` at the start of a
// line or after whitespace, never inside quotes), blank lines, a leading `---`, CRLF line ends.
//
// Plain scalars are typed as in the YAML 1.2 core schema: null/Null/NULL/~/empty -> null,
// true/false (also True/TRUE...) -> bool, [-+]?[0-9]+ (and 0x.., 0o..) -> int, decimal floats with
// optional exponent (1e-4, 3.0e-5, .5, -2.5) and .inf/.nan -> double; anything else is a string.
// Quoted scalars are always strings; keys are always strings.
//
// Refused with an error: tabs in indentation, duplicate keys, anchors (&), aliases (*), tags (!),
// block scalars (| >), multi-line plain or quoted scalars, flow collections spanning lines,
// complex keys (?), directives (%), more than one document, control characters, invalid UTF-8,
// inputs over kMaxYamlBytes and nesting deeper than kMaxYamlDepth. Every error reads
// "FILE:LINE: problem".
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <string_view>

#include "core/json.h"

namespace mf::train {

inline constexpr size_t kMaxYamlBytes = size_t{1} << 20;
inline constexpr int kMaxYamlDepth = 64;

// A parsed document and where its entries came from. `lines` maps a path to the 1-based line of
// the key (mappings: "optim.lr", nested keys joined with '.') or of the item (sequences:
// "optim.no_decay[1]"). The root path is "".
struct YamlDocument {
    json::Value root;  // always an object
    std::map<std::string, int> lines;

    // Line of `path`, or 0 when unknown.
    int line_of(const std::string& path) const;
};

// Parses a whole document; the top level must be a mapping (an empty document is an empty
// object). `source` names the file in error messages.
YamlDocument parse_yaml_document(std::string_view text, const std::string& source);
json::Value parse_yaml(std::string_view text, const std::string& source);

// Parses one value as written after `key:` on a single line: a plain or quoted scalar, or a
// flow sequence / flow mapping. With `command_line` set, '#' is an ordinary character and a
// plain value may start with '*' (so `[*norm*,*bias]` needs no quotes in a shell override, where
// no aliases exist anyway). Errors read "SOURCE: problem".
json::Value parse_yaml_value(std::string_view text, const std::string& source, bool command_line = false);

}  // namespace mf::train
