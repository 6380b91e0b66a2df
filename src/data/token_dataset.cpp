#include "data/token_dataset.h"

#include "core/check.h"
#include "core/json.h"
#include "data/batch.h"
#include "data/line_reader.h"

namespace mf::data {

std::vector<int32_t> read_token_ids(const json::Value& v, const char* field, int64_t vocab_size, bool allow_ignore) {
    if (!v.is_array()) fail("field \"", field, "\" must be an array of integers, got ", json::kind_name(v.kind()));
    std::vector<int32_t> out;
    out.reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        const json::Value& e = v.as_array()[i];
        if (!e.is_int()) fail("field \"", field, "\"[", i, "] is ", e.dump(), ", expected an integer");
        const int64_t id = e.as_int();
        if (allow_ignore && id == kIgnoreIndex) {
            out.push_back(kIgnoreIndex);
            continue;
        }
        if (id < 0 || id >= vocab_size)
            fail("field \"", field, "\"[", i, "] = ", id, " is outside the vocabulary [0, ", vocab_size, ")",
                 allow_ignore ? " and is not -100" : "");
        out.push_back(static_cast<int32_t>(id));
    }
    return out;
}

namespace {

Document parse_line(const std::string& line, int64_t vocab_size) {
    const json::Value v = json::parse(line, "");  // errors get "FILE:LINE: " from the caller
    if (!v.is_object()) fail("expected a JSON object");
    for (const auto& [key, _] : v.as_object())
        if (key != "input_ids" && key != "labels") fail("unknown field \"", key, "\" (expected input_ids, labels)");
    const json::Value* ids = v.find("input_ids");
    if (ids == nullptr) fail("missing field \"input_ids\"");
    Document d;
    d.input_ids = read_token_ids(*ids, "input_ids", vocab_size, false);
    if (d.input_ids.empty()) fail("field \"input_ids\" is empty");
    if (const json::Value* labels = v.find("labels"); labels != nullptr && !labels->is_null()) {
        d.labels = read_token_ids(*labels, "labels", vocab_size, true);
        if (d.labels.size() != d.input_ids.size())
            fail("\"labels\" has ", d.labels.size(), " entries but \"input_ids\" has ", d.input_ids.size());
    } else {
        d.labels = d.input_ids;
    }
    return d;
}

}  // namespace

TokenDataset read_token_jsonl(const std::filesystem::path& file, int64_t vocab_size, bool skip_bad_lines) {
    LineReader in(file);
    TokenDataset ds;
    std::string line;
    while (in.next(line)) {
        if (line.find_first_not_of(" \t") == std::string::npos) continue;
        try {
            ds.docs.push_back(parse_line(line, vocab_size));
        } catch (const Error& e) {
            const std::string msg = in.name() + ":" + std::to_string(in.line_no()) + ": " + e.what();
            if (!skip_bad_lines) throw Error(msg);
            if (ds.skipped_lines++ == 0) ds.first_skip_reason = msg;
        }
    }
    if (ds.docs.empty()) fail(in.name(), ": no usable documents (", ds.skipped_lines, " bad lines skipped)");
    return ds;
}

}  // namespace mf::data
