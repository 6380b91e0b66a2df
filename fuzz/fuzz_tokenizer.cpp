// libFuzzer target: the tokenizer loaders (text::Tokenizer::load), through files.
// Input layout: the tokenizer.json text, optionally followed by a NUL byte and a text to encode.
// An input that starts with "tiktoken\n" is a tiktoken.model instead (the rest up to the NUL),
// loaded with a Kimi-K2 tokenizer_config.json (its split regex, two special tokens, reserved ids).
// Any file loads or is refused with mf::Error. With a loaded tokenizer, encoding the text (with
// and without special tokens) either succeeds or throws mf::Error (invalid UTF-8); every id it
// yields lies in [0, vocab_size()) and decodes (with and without skipping special tokens).
#include "fuzz_util.h"
#include "text/tokenizer.h"

namespace {

constexpr std::string_view kTiktokenMagic = "tiktoken\n";
constexpr const char* kKimiConfig = R"({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
  "added_tokens_decoder": {"300": {"content": "[BOS]", "special": true, "normalized": false},
                           "301": {"content": "<|im_end|>", "special": true, "normalized": false}},
  "eos_token": "<|im_end|>"})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const std::filesystem::path dir = [] {
        const std::filesystem::path d = mf::fuzz::ScratchDir::get() / "tokenizer";
        std::filesystem::create_directories(d);
        return d;
    }();
    std::string_view input = mf::fuzz::as_text(data, size);
    const bool tiktoken = input.substr(0, kTiktokenMagic.size()) == kTiktokenMagic;
    if (tiktoken) input.remove_prefix(kTiktokenMagic.size());
    const size_t nul = input.find('\0');
    std::error_code ec;
    std::filesystem::remove(dir / "tokenizer.json", ec);
    std::filesystem::remove(dir / "tiktoken.model", ec);
    std::filesystem::remove(dir / "tokenizer_config.json", ec);
    if (tiktoken) {
        mf::fuzz::write_bytes(dir / "tiktoken.model", input.substr(0, nul));
        mf::fuzz::write_bytes(dir / "tokenizer_config.json", kKimiConfig);
    } else {
        mf::fuzz::write_bytes(dir / "tokenizer.json", input.substr(0, nul));
    }
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
