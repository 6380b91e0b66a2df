// libFuzzer target: the token JSONL reader (data::read_token_jsonl), through a file.
// Input layout: byte 0 picks the vocabulary size (1 + byte * 4, so ids near the bound are
// reachable) and byte 1 bit 0 picks skip_bad_lines; the rest is the file. Any input is read or
// refused with mf::Error. Every accepted document has ids in [0, vocab), labels of the same length
// in [0, vocab) or -100, and a refused file's message names the file and (for a bad line) the line.
#include "data/token_dataset.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 2) return 0;
    const int64_t vocab_size = 1 + int64_t{data[0]} * 4;
    const bool skip_bad_lines = (data[1] & 1) != 0;
    const std::filesystem::path file = mf::fuzz::ScratchDir::get() / "tokens.jsonl";
    mf::fuzz::write_bytes(file, mf::fuzz::as_text(data + 2, size - 2));
    try {
        const mf::data::TokenDataset ds = mf::data::read_token_jsonl(file, vocab_size, skip_bad_lines);
        MF_FUZZ_REQUIRE(!ds.docs.empty(), "an accepted dataset has no documents");
        MF_FUZZ_REQUIRE(skip_bad_lines || ds.skipped_lines == 0, "lines skipped without skip_bad_lines");
        for (const auto& d : ds.docs) {
            MF_FUZZ_REQUIRE(!d.input_ids.empty(), "an empty document was accepted");
            MF_FUZZ_REQUIRE(d.labels.size() == d.input_ids.size(), "labels and input_ids differ in length");
            for (size_t i = 0; i < d.input_ids.size(); ++i) {
                MF_FUZZ_REQUIRE(d.input_ids[i] >= 0 && d.input_ids[i] < vocab_size, "input id out of range");
                MF_FUZZ_REQUIRE(d.labels[i] == -100 || (d.labels[i] >= 0 && d.labels[i] < vocab_size),
                                "label out of range");
            }
        }
    } catch (const mf::Error& e) {
        MF_FUZZ_REQUIRE(std::string_view(e.what()).find("tokens.jsonl") != std::string_view::npos,
                        std::string("message does not name the file: ") + e.what());
    } catch (const std::exception& e) {
        mf::fuzz::finding(std::string("exception other than mf::Error: ") + e.what());
    }
    return 0;
}
