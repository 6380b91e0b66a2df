#include "model/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <string>

#include "model/attention_block.h"
#include "model/ffn_blocks.h"
#include "ops/attention_decode.h"
#include "ops/ops.h"

namespace mf::model {

// --- weights and workspace --------------------------------------------------------------------------

struct KvCacheDecoder::LayerWeights {
    bool is_moe = false;
    Tensor ln1, ln2;
    AttentionWeights attn;
    MoeWeights moe;
    MlpWeights mlp;
    Tensor k_cache, v_cache;  // [max_tokens, Hkv·D]
};

struct KvCacheDecoder::Workspace {
    Arena arena;
    int64_t n = 0;  // tokens of the chunk the views below were carved for
    Tensor ids, positions;
    Tensor x, ln, rstd, block_out;           // [n, H] residual, normed input, its statistics, a block's output
    Tensor q_raw, k_raw, q, q_rstd, k_rstd;  // attention inputs (k goes straight into the cache)
    Tensor attn;                             // [n, Hq·D]
    MoeActs moe;
    MlpActs mlp;
    Tensor logits;  // [1, V] f32
};

namespace {

MoeDims moe_dims(const Qwen3MoeConfig& c) {
    return {c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob};
}

}  // namespace

KvCacheDecoder::KvCacheDecoder(const Qwen3Moe& model, int64_t max_tokens, int64_t max_chunk, DecodeAttention attention)
    : model_(model), max_tokens_(max_tokens), max_chunk_(max_chunk), ws_(std::make_unique<Workspace>()) {
    const Qwen3MoeConfig& c = model.config();
    const Device dev = model.device();
    MF_CHECK(max_chunk >= 1 && max_tokens >= max_chunk, "KvCacheDecoder: max_tokens ", max_tokens, ", max_chunk ",
             max_chunk);
    if (model.expert_shard().sharded())
        fail("generation needs every expert; this model holds expert shard ", model.expert_shard().rank, " of ",
             model.expert_shard().size);
    act_ = model.param_dtype();
    cached_attention_ = attention == DecodeAttention::cached ||
                        (attention == DecodeAttention::automatic && ops::attention_decode_supported(dev));
    if (cached_attention_ && !ops::attention_decode_supported(dev))
        fail("cached-KV attention has no ", device_name(dev), " kernel");

    // The KV cache: one allocation, K then V of every layer.
    const int64_t L = c.num_hidden_layers, Dkv = c.num_key_value_heads * c.head_dim,
                  Dq = c.num_attention_heads * c.head_dim;
    const size_t per = static_cast<size_t>(shape_numel({max_tokens, Dkv})) * dtype_size(act_);
    cache_ = Buffer(static_cast<size_t>(2 * L) * per, dev);
    cache_.zero();
    for (int64_t l = 0; l < L; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        LayerWeights w;
        w.is_moe = c.is_moe_layer(l);
        w.ln1 = model.param(p + "input_layernorm.weight");
        w.ln2 = model.param(p + "post_attention_layernorm.weight");
        w.attn = {model.param(p + "self_attn.q_proj.weight"), model.param(p + "self_attn.k_proj.weight"),
                  model.param(p + "self_attn.v_proj.weight"), model.param(p + "self_attn.o_proj.weight"),
                  model.param(p + "self_attn.q_norm.weight"), model.param(p + "self_attn.k_norm.weight")};
        if (w.is_moe) {
            w.moe = {model.param(p + "mlp.gate.weight"), model.param(p + "mlp.experts.gate_up_proj"),
                     model.param(p + "mlp.experts.down_proj")};
        } else {
            // gate_proj and up_proj are adjacent in the parameter buffer: one fused [2I, H] view.
            const Tensor gate = model.param(p + "mlp.gate_proj.weight");
            w.mlp = {Tensor(gate.data(), gate.dtype(), {2 * c.intermediate_size, c.hidden_size}, gate.device()),
                     model.param(p + "mlp.down_proj.weight")};
        }
        w.k_cache = cache_.as(act_, {max_tokens, Dkv}, static_cast<size_t>(2 * l) * per);
        w.v_cache = cache_.as(act_, {max_tokens, Dkv}, static_cast<size_t>(2 * l + 1) * per);
        layers_.push_back(w);
    }
    if (!cached_attention_) {
        // A doc-id tensor (one document) keeps attention_forward on one kernel for every prefix length.
        auto up = [](size_t b) { return (b + 255) / 256 * 256; };
        const size_t rows = up(static_cast<size_t>(shape_numel({max_tokens, Dq})) * dtype_size(act_));
        const size_t lse = up(static_cast<size_t>(c.num_attention_heads * max_tokens) * sizeof(float));
        prefix_buffer_ = Buffer(2 * rows + lse + up(static_cast<size_t>(max_tokens) * sizeof(int32_t)), dev);
        prefix_buffer_.zero();
        prefix_q_ = prefix_buffer_.as(act_, {max_tokens, Dq});
        prefix_out_ = prefix_buffer_.as(act_, {max_tokens, Dq}, rows);
        prefix_lse_ = prefix_buffer_.as(DType::f32, {c.num_attention_heads * max_tokens}, 2 * rows);
        prefix_docs_ = prefix_buffer_.as(DType::i32, {max_tokens}, 2 * rows + lse);
    }
    Arena measure = Arena::measuring(dev);
    allocate(measure, max_chunk);
    ws_->arena = Arena(measure.high_water(), dev);
}

KvCacheDecoder::~KvCacheDecoder() = default;

size_t KvCacheDecoder::cache_bytes() const { return cache_.nbytes(); }

void KvCacheDecoder::allocate(Arena& A, int64_t n) {
    const Qwen3MoeConfig& c = model_.config();
    const int64_t H = c.hidden_size, Dq = c.num_attention_heads * c.head_dim, Dkv = c.num_key_value_heads * c.head_dim;
    Workspace& ws = *ws_;
    ws.n = n;
    ws.ids = A.alloc(DType::i32, {n});
    ws.positions = A.alloc(DType::i32, {n});
    ws.x = A.alloc(act_, {n, H});
    ws.ln = A.alloc(act_, {n, H});
    ws.rstd = A.alloc(DType::f32, {n});
    ws.block_out = A.alloc(act_, {n, H});
    ws.q_raw = A.alloc(act_, {n, Dq});
    ws.k_raw = A.alloc(act_, {n, Dkv});
    ws.q = A.alloc(act_, {n, Dq});
    ws.q_rstd = A.alloc(DType::f32, {n * c.num_attention_heads});
    ws.k_rstd = A.alloc(DType::f32, {n * c.num_key_value_heads});
    ws.attn = A.alloc(act_, {n, Dq});
    bool any_moe = false, any_dense = false;
    for (const LayerWeights& w : layers_) (w.is_moe ? any_moe : any_dense) = true;
    if (any_moe) ws.moe.alloc(A, moe_dims(c), n, act_);
    if (any_dense) ws.mlp.alloc(A, n, c.intermediate_size, act_);
    ws.logits = A.alloc(DType::f32, {1, c.vocab_size});
}

// --- the forward ------------------------------------------------------------------------------------

void KvCacheDecoder::layer_forward(size_t l, int64_t n) {
    const Qwen3MoeConfig& c = model_.config();
    const LayerWeights& w = layers_[l];
    Workspace& ws = *ws_;
    const int64_t first = length_, T = first + n, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
    const float eps = static_cast<float>(c.rms_norm_eps);

    // x += o_proj(attention(q, cached k, cached v)), as attention_block_forward computes it.
    ops::rmsnorm_forward(ws.ln, ws.rstd, ws.x, w.ln1, eps);
    const Tensor k_new = w.k_cache.slice_rows(first, T), v_new = w.v_cache.slice_rows(first, T);
    ops::matmul_forward(ws.q_raw, ws.ln, w.attn.wq);
    ops::matmul_forward(ws.k_raw, ws.ln, w.attn.wk);
    ops::matmul_forward(v_new, ws.ln, w.attn.wv);
    const Tensor k_prefix = w.k_cache.slice_rows(0, T), v_prefix = w.v_cache.slice_rows(0, T);
    if (cached_attention_) {
        ops::qknorm_rope_forward(ws.q, k_new, ws.q_rstd, ws.k_rstd, ws.q_raw, ws.k_raw, w.attn.q_norm, w.attn.k_norm,
                                 ws.positions, Hq, Hkv, eps, static_cast<float>(c.rope_theta));
        ops::attention_decode_forward(ws.attn, ws.q, k_prefix, v_prefix, first, Hq, Hkv);
        ops::matmul_forward(ws.block_out, ws.attn, w.attn.wo);
    } else {
        // The new queries go to rows [first, T) of the prefix's query rows; the rows before hold stale
        // (or zero) queries whose outputs are never read.
        const Tensor q_rows = prefix_q_.slice_rows(0, T), out_rows = prefix_out_.slice_rows(0, T);
        const Tensor lse(prefix_lse_.data(), DType::f32, {Hq * T}, prefix_lse_.device());
        ops::qknorm_rope_forward(q_rows.slice_rows(first, T), k_new, ws.q_rstd, ws.k_rstd, ws.q_raw, ws.k_raw,
                                 w.attn.q_norm, w.attn.k_norm, ws.positions, Hq, Hkv, eps,
                                 static_cast<float>(c.rope_theta));
        ops::attention_forward(out_rows, lse, q_rows, k_prefix, v_prefix, prefix_docs_.slice_rows(0, T), 1, T, Hq, Hkv);
        ops::matmul_forward(ws.block_out, out_rows.slice_rows(first, T), w.attn.wo);
    }
    ops::add(ws.x, ws.x, ws.block_out);

    // x += ffn(rmsnorm(x)): the training blocks, dropless MoE or dense MLP.
    ops::rmsnorm_forward(ws.ln, ws.rstd, ws.x, w.ln2, eps);
    if (w.is_moe)
        moe_block_forward(ws.block_out, ws.moe, ws.ln, w.moe, moe_dims(c));
    else
        mlp_block_forward(ws.block_out, ws.mlp, ws.ln, w.mlp);
    ops::add(ws.x, ws.x, ws.block_out);
}

std::vector<float> KvCacheDecoder::forward(std::span<const int32_t> ids, bool all_rows) {
    const Qwen3MoeConfig& c = model_.config();
    const int64_t n = static_cast<int64_t>(ids.size());
    MF_CHECK(n >= 1 && n <= max_chunk_, "KvCacheDecoder::forward: ", n, " tokens, at most ", max_chunk_, " per call");
    if (length_ + n > max_tokens_)
        fail("generation: position ", length_ + n - 1, " is past the KV cache's ", max_tokens_, " positions");
    for (int64_t i = 0; i < n; ++i)
        if (ids[static_cast<size_t>(i)] < 0 || ids[static_cast<size_t>(i)] >= c.vocab_size)
            fail("token id ", ids[static_cast<size_t>(i)], " is outside the model's vocabulary [0, ", c.vocab_size,
                 ")");
    Workspace& ws = *ws_;
    ws.arena.reset();
    allocate(ws.arena, n);
    std::vector<int32_t> positions(static_cast<size_t>(n));
    std::iota(positions.begin(), positions.end(), static_cast<int32_t>(length_));
    ops::copy_from_host(ws.ids, ids.data());
    ops::copy_from_host(ws.positions, positions.data());

    ops::embedding_forward(ws.x, ws.ids, model_.param("model.embed_tokens.weight"));
    for (size_t l = 0; l < layers_.size(); ++l) layer_forward(l, n);
    length_ += n;

    const Tensor head = model_.param(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
    ops::rmsnorm_forward(ws.ln, ws.rstd, ws.x, model_.param("model.norm.weight"), static_cast<float>(c.rms_norm_eps));
    const int64_t first_row = all_rows ? 0 : n - 1, V = c.vocab_size;
    std::vector<float> logits(static_cast<size_t>((n - first_row) * V));
    for (int64_t r = first_row; r < n; ++r) {
        ops::matmul_forward(ws.logits, ws.ln.slice_rows(r, r + 1), head);
        ops::copy_to_host(logits.data() + (r - first_row) * V, ws.logits);
    }
    return logits;
}

// --- choosing tokens --------------------------------------------------------------------------------

int32_t greedy_token(std::span<const float> logits) {
    MF_CHECK(!logits.empty(), "greedy_token: no logits");
    size_t best = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
        if (!std::isfinite(logits[i])) fail("the model produced a non-finite logit (", logits[i], ") for token ", i);
        if (logits[i] > logits[best]) best = i;
    }
    return static_cast<int32_t>(best);
}

TokenSampler::TokenSampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
    if (!(params.temperature >= 0) || !std::isfinite(params.temperature))
        fail("sampling: temperature must be a finite number >= 0, got ", params.temperature);
    if (!(params.top_p > 0 && params.top_p <= 1)) fail("sampling: top_p must lie in (0, 1], got ", params.top_p);
}

int32_t TokenSampler::next(std::span<const float> logits) {
    const int32_t best = greedy_token(logits);  // also checks the logits are finite
    if (params_.temperature == 0) return best;
    // Softmax of logits / temperature in double, shifted by the maximum.
    const size_t V = logits.size();
    const double max_z = static_cast<double>(logits[static_cast<size_t>(best)]) / params_.temperature;
    weights_.resize(V);
    double total = 0;
    for (size_t i = 0; i < V; ++i) {
        weights_[i] = std::exp(static_cast<double>(logits[i]) / params_.temperature - max_z);
        total += weights_[i];
    }
    // Top-p: most likely first (the lower id first among equals); keep token j while the tokens
    // before it hold less than top_p of the probability (so at least the most likely one).
    order_.resize(V);
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
        return weights_[static_cast<size_t>(a)] > weights_[static_cast<size_t>(b)];
    });
    size_t kept = 0;
    double before = 0;
    while (kept < V && before < params_.top_p * total) before += weights_[static_cast<size_t>(order_[kept++])];
    // A 53-bit uniform in [0, 1) from the generator's raw output (the standard distributions'
    // algorithms differ between libraries).
    const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * before;
    double acc = 0;
    for (size_t j = 0; j < kept; ++j) {
        acc += weights_[static_cast<size_t>(order_[j])];
        if (u < acc) return order_[j];
    }
    return order_[kept - 1];
}

// --- the loop ---------------------------------------------------------------------------------------

GenerateResult generate(const Qwen3Moe& model, std::span<const int32_t> prompt, const GenerateOptions& o,
                        const std::function<void(int32_t)>& on_token) {
    const Qwen3MoeConfig& c = model.config();
    if (prompt.empty()) fail("generation: the prompt has no tokens");
    if (o.max_new_tokens < 0) fail("generation: max_new_tokens must not be negative, got ", o.max_new_tokens);
    const int64_t n = static_cast<int64_t>(prompt.size()), total = n + o.max_new_tokens;
    if (c.max_position_embeddings > 0 && total > c.max_position_embeddings)
        fail("generation: the prompt's ", n, " tokens + ", o.max_new_tokens, " new tokens = ", total,
             " positions, more than the model's max_position_embeddings (", c.max_position_embeddings, ")");
    TokenSampler sampler(o.sampling);
    KvCacheDecoder decoder(model, total, n, o.attention);
    GenerateResult r;
    using Clock = std::chrono::steady_clock;
    auto t0 = Clock::now();
    std::vector<float> logits = decoder.forward(prompt);
    r.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    t0 = Clock::now();
    for (int64_t step = 0; step < o.max_new_tokens; ++step) {
        const int32_t token = sampler.next(logits);
        if (o.keep_logits) r.step_logits.push_back(logits);
        r.tokens.push_back(token);
        if (on_token) on_token(token);
        if (std::find(o.eos_ids.begin(), o.eos_ids.end(), token) != o.eos_ids.end()) {
            r.stopped_at_eos = true;
            break;
        }
        if (step + 1 == o.max_new_tokens) break;
        const int32_t next[1] = {token};
        logits = decoder.forward(next);
    }
    r.decode_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return r;
}

}  // namespace mf::model
