// libFuzzer target: the tokenizer.json loader (text::Tokenizer::load), through a file.
// Input layout: the tokenizer.json text, optionally followed by a NUL byte and a text to encode.
// Any tokenizer.json loads or is refused with mf::Error. With a loaded tokenizer, encoding the
// text (with and without special tokens) either succeeds or throws mf::Error (invalid UTF-8); every
// id it yields lies in [0, vocab_size()) and decodes (with and without skipping special tokens).
#include "fuzz_util.h"
#include "text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const std::filesystem::path dir = [] {
        const std::filesystem::path d = mf::fuzz::ScratchDir::get() / "tokenizer";
        std::filesystem::create_directories(d);
        return d;
    }();
    const std::string_view input = mf::fuzz::as_text(data, size);
    const size_t nul = input.find('\0');
    mf::fuzz::write_bytes(dir / "tokenizer.json", input.substr(0, nul));
    const std::string_view text = nul == std::string_view::npos ? std::string_view{} : input.substr(nul + 1);
    mf::fuzz::run_one([&] {
        const mf::text::Tokenizer tok = mf::text::Tokenizer::load(dir);
        for (const bool special : {false, true}) {
            const std::vector<int32_t> ids = tok.encode(text, special);
            for (const int32_t id : ids)
                MF_FUZZ_REQUIRE(id >= 0 && static_cast<size_t>(id) < tok.vocab_size(),
                                "encode produced id " + std::to_string(id) + " outside the vocabulary");
            (void)tok.decode(ids, false);
            (void)tok.decode(ids, true);
        }
    });
    return 0;
}
