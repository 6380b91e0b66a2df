// Text generation with a KV cache, for sanity-checking a (fine-tuned) model of any supported family.
//
//   prefill:  the prompt's n tokens in one forward at positions 0 .. n-1, each layer writing its
//             keys (after QK-norm and RoPE) and values into the cache;
//   decode:   one token at a time at position t: its q, k, v as the model's attention computes them
//             (model/attention_block.h), k and v appended to the cache at row t, attention of q over
//             cache rows 0 .. t; the FFN is the training one (dense MLP, or the dropless MoE with
//             the same router, top-k and norm_topk_prob); logits = lm_head(rmsnorm(x)) of the row.
// The forward is built on ops:: only, so it runs wherever the model lives: f32 on the CPU, bf16
// activations with f32 router and logits on the GPU. Attention over the cache is
// ops::attention_decode_forward where the device has that op (the CPU: O(t) per token, each row bit
// for bit the full causal attention's), else ops::attention_forward over the whole prefix with the
// new queries in its last rows (the other query rows are never read; O(t²) per token).
// On the CPU the logits of every position are bit for bit those of one forward over the whole
// sequence (CausalLM::step): the CPU kernels compute a row independently of the rows beside it
// (tests/cpu/test_generate). On the GPU the bf16 path follows the same ops, so it agrees with the
// training forward to bf16 rounding, not bit for bit (a different attention kernel serves it).
//
// Memory: the cache is layers × 2 × max_tokens × kv_heads × head_dim activations, allocated once,
// plus a workspace for the largest chunk (the prompt); nothing is allocated per token.
//
// Choosing the next token: greedy = argmax (the lowest id among equal maxima, as torch.argmax);
// sampling = logits / temperature, softmax, top-p nucleus (the smallest set of most likely tokens
// whose probability reaches top_p, as HF's TopPLogitsWarper keeps), then a draw from a
// std::mt19937_64 seeded with `seed` (53-bit uniforms, so the same seed gives the same tokens on
// every platform).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "model/attention_block.h"
#include "model/causal_lm.h"

namespace mf::model {

enum class DecodeAttention {
    automatic,      // cached where the device has ops::attention_decode_forward, else prefix
    cached,         // ops::attention_decode_forward over the cache rows (CPU)
    prefix_square,  // ops::attention_forward over the prefix, new queries in the last rows (any device)
};

class KvCacheDecoder {
 public:
    // max_tokens: positions the cache holds (prompt + new tokens); max_chunk: the most tokens one
    // forward() takes (the prompt's length). The model must hold every expert (no EP shard) and
    // must outlive the decoder.
    KvCacheDecoder(const CausalLM& model, int64_t max_tokens, int64_t max_chunk,
                   DecodeAttention attention = DecodeAttention::automatic);
    ~KvCacheDecoder();
    KvCacheDecoder(const KvCacheDecoder&) = delete;
    KvCacheDecoder& operator=(const KvCacheDecoder&) = delete;

    // Runs `ids` at positions [length(), length() + ids.size()) and appends their keys and values.
    // Returns host f32 logits: [ids.size(), V] with all_rows, else [V] of the last token.
    std::vector<float> forward(std::span<const int32_t> ids, bool all_rows = false);

    int64_t length() const { return length_; }
    int64_t capacity() const { return max_tokens_; }
    size_t cache_bytes() const;
    bool uses_cached_attention() const { return cached_attention_; }
    void reset() { length_ = 0; }

 private:
    struct BranchWeights;
    struct Workspace;
    void allocate(Arena& arena, int64_t n);  // the chunk's activations for n tokens
    void layer_forward(size_t l, int64_t n);
    void attention_forward(const BranchWeights& w, int64_t n);

    const CausalLM& model_;
    int64_t max_tokens_, max_chunk_, length_ = 0;
    bool cached_attention_;
    DType act_;
    AttentionDims dims_{};  // of every attention branch
    std::vector<std::vector<BranchWeights>> layers_;
    Buffer cache_;  // per attention branch: K [max_tokens, Hkv·D], then V [max_tokens, Hkv·D]
    // prefix_square only: the prefix's queries and outputs [max_tokens, Hq·D], its lse [Hq·max_tokens]
    // (f32) and doc ids [max_tokens] (zeros: one document), carved from one allocation.
    Buffer prefix_buffer_;
    Tensor prefix_q_, prefix_out_, prefix_lse_, prefix_docs_;
    std::unique_ptr<Workspace> ws_;
};

struct SamplingParams {
    double temperature = 0;  // 0: greedy
    double top_p = 1;        // in (0, 1]
    uint64_t seed = 0;
};

// argmax, the lowest id among equal maxima. mf::Error on empty or non-finite logits.
int32_t greedy_token(std::span<const float> logits);

class TokenSampler {
 public:
    explicit TokenSampler(const SamplingParams& params);
    int32_t next(std::span<const float> logits);

 private:
    SamplingParams params_;
    std::mt19937_64 rng_;
    std::vector<int32_t> order_;
    std::vector<double> weights_;
};

struct GenerateOptions {
    int64_t max_new_tokens = 64;
    SamplingParams sampling;
    std::vector<int32_t> eos_ids;  // generation stops after producing one of these (it is kept)
    DecodeAttention attention = DecodeAttention::automatic;
    bool keep_logits = false;  // GenerateResult::step_logits
};

struct GenerateResult {
    std::vector<int32_t> tokens;  // the new tokens (the EOS token included when it stopped there)
    bool stopped_at_eos = false;
    double prefill_seconds = 0, decode_seconds = 0;
    std::vector<std::vector<float>> step_logits;  // with keep_logits: the logits each token was chosen from
};

// Generates up to max_new_tokens after `prompt` (non-empty, ids inside the vocabulary, prompt +
// max_new_tokens within max_position_embeddings when the config sets it). on_token, when given, is
// called with each new token as soon as it is chosen.
GenerateResult generate(const CausalLM& model, std::span<const int32_t> prompt, const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token = {});

}  // namespace mf::model
