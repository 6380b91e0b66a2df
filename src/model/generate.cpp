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

// One branch of a layer: its norm and op weights (views of the model's parameters), and for attention
// the layer's KV cache.
struct KvCacheDecoder::BranchWeights {
    const Branch* spec = nullptr;
    Tensor norm;
    AttentionDims ad{};
    AttentionWeights attn;
    MoeWeights moe;
    MoeDims md{};
    bool has_shared = false;
    SharedExpertWeights shared;
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
    SharedExpertActs shared;
    LatentActs latent;
    MlpActs mlp;
    Tensor logits;  // [1, V] f32
};

KvCacheDecoder::KvCacheDecoder(const CausalLM& model, int64_t max_tokens, int64_t max_chunk, DecodeAttention attention)
    : model_(model), max_tokens_(max_tokens), max_chunk_(max_chunk), ws_(std::make_unique<Workspace>()) {
    const ModelSpec& spec = model.spec();
    const Device dev = model.device();
    const int64_t H = spec.hidden_size;
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

    // Every attention branch has the same shape here (the workspace is planned from the first).
    int64_t num_attention = 0;
    for (const LayerSpec& layer : spec.layers)
        for (const Branch& b : layer.branches)
            if (b.kind == BranchKind::attention) {
                const AttentionDims d = attention_dims(b.attention, H);
                if (num_attention++ == 0) dims_ = d;
                MF_CHECK(d.num_heads == dims_.num_heads && d.num_kv_heads == dims_.num_kv_heads &&
                             d.head_dim == dims_.head_dim && d.qk_norm == dims_.qk_norm,
                         "generation: attention layers of different shapes are not supported");
            }
    // The KV cache: one allocation, K then V of every attention branch.
    const int64_t Dkv = dims_.num_kv_heads * dims_.head_dim, Dq = dims_.num_heads * dims_.head_dim;
    const size_t per = static_cast<size_t>(shape_numel({max_tokens, Dkv})) * dtype_size(act_);
    cache_ = Buffer(std::max<size_t>(static_cast<size_t>(2 * num_attention) * per, 256), dev);
    cache_.zero();
    const ParamLookup at = [&model](const std::string& name) { return model.param(name); };
    int64_t cache_idx = 0;
    for (int64_t l = 0; l < spec.num_layers(); ++l) {
        const std::string p = layer_prefix(l);
        std::vector<BranchWeights> layer;
        for (const Branch& b : spec.layers[static_cast<size_t>(l)].branches) {
            BranchWeights w;
            w.spec = &b;
            w.norm = model.param(p + b.norm + ".weight");
            const std::string m = p + b.module + ".";
            if (b.kind == BranchKind::attention) {
                w.ad = attention_dims(b.attention, H);
                w.attn = attention_weights(at, m, w.ad);
                w.k_cache = cache_.as(act_, {max_tokens, Dkv}, static_cast<size_t>(2 * cache_idx) * per);
                w.v_cache = cache_.as(act_, {max_tokens, Dkv}, static_cast<size_t>(2 * cache_idx + 1) * per);
                ++cache_idx;
            } else if (b.kind == BranchKind::moe) {
                w.moe = moe_weights(at, m, b.moe);
                w.md = moe_block_dims(b.moe, H);
                w.has_shared = b.moe.shared_intermediate > 0;
                if (w.has_shared) w.shared = shared_expert_weights(at, m, b.moe, H);
            } else if (b.kind == BranchKind::mlp) {
                w.mlp = mlp_weights(at, m, H, b.mlp.intermediate, b.mlp.act);
            } else {
                fail("generation: layer ", l, " is a Mamba-2 layer; the decoder does not carry a scan state yet");
            }
            layer.push_back(w);
        }
        layers_.push_back(std::move(layer));
    }
    if (!cached_attention_ && num_attention > 0) {
        // A doc-id tensor (one document) keeps attention_forward on one kernel for every prefix length.
        auto up = [](size_t b) { return (b + 255) / 256 * 256; };
        const size_t rows = up(static_cast<size_t>(shape_numel({max_tokens, Dq})) * dtype_size(act_));
        const size_t lse = up(static_cast<size_t>(dims_.num_heads * max_tokens) * sizeof(float));
        prefix_buffer_ = Buffer(2 * rows + lse + up(static_cast<size_t>(max_tokens) * sizeof(int32_t)), dev);
        prefix_buffer_.zero();
        prefix_q_ = prefix_buffer_.as(act_, {max_tokens, Dq});
        prefix_out_ = prefix_buffer_.as(act_, {max_tokens, Dq}, rows);
        prefix_lse_ = prefix_buffer_.as(DType::f32, {dims_.num_heads * max_tokens}, 2 * rows);
        prefix_docs_ = prefix_buffer_.as(DType::i32, {max_tokens}, 2 * rows + lse);
    }
    Arena measure = Arena::measuring(dev);
    allocate(measure, max_chunk);
    ws_->arena = Arena(measure.high_water(), dev);
}

KvCacheDecoder::~KvCacheDecoder() = default;

size_t KvCacheDecoder::cache_bytes() const { return cache_.nbytes(); }

void KvCacheDecoder::allocate(Arena& A, int64_t n) {
    const ModelSpec& spec = model_.spec();
    const int64_t H = spec.hidden_size, Dq = dims_.num_heads * dims_.head_dim,
                  Dkv = dims_.num_kv_heads * dims_.head_dim;
    Workspace& ws = *ws_;
    ws.n = n;
    ws.ids = A.alloc(DType::i32, {n});
    ws.positions = A.alloc(DType::i32, {n});
    ws.x = A.alloc(act_, {n, H});
    ws.ln = A.alloc(act_, {n, H});
    ws.rstd = A.alloc(DType::f32, {n});
    ws.block_out = A.alloc(act_, {n, H});
    const bool per_head = dims_.qk_norm == QkNorm::per_head;
    ws.q_raw = A.alloc(act_, {n, Dq});
    ws.k_raw = A.alloc(act_, {n, Dkv});
    ws.q = A.alloc(act_, {n, Dq});
    ws.q_rstd = A.alloc(DType::f32, {n * (per_head ? dims_.num_heads : 1)});
    ws.k_rstd = A.alloc(DType::f32, {n * (per_head ? dims_.num_kv_heads : 1)});
    ws.attn = A.alloc(act_, {n, Dq});
    const BranchWeights *moe = nullptr, *mlp = nullptr;
    for (const auto& layer : layers_)
        for (const BranchWeights& w : layer) {
            if (w.spec->kind == BranchKind::moe && moe == nullptr) moe = &w;
            if (w.spec->kind == BranchKind::mlp &&
                (mlp == nullptr || w.spec->mlp.intermediate > mlp->spec->mlp.intermediate))
                mlp = &w;
        }
    if (moe != nullptr) {
        ws.moe.alloc(A, moe->md, n, act_);
        if (moe->has_shared) ws.shared.alloc(A, n, H, moe->spec->moe, act_);
        if (moe->spec->moe.latent > 0) ws.latent.alloc(A, n, moe->spec->moe.latent, act_);
    }
    if (mlp != nullptr) ws.mlp.alloc(A, n, mlp->spec->mlp.intermediate, act_, mlp->spec->mlp.act);
    ws.logits = A.alloc(DType::f32, {1, spec.vocab_size});
}

// --- the forward ------------------------------------------------------------------------------------

// x += o_proj(attention(q, cached k, cached v)), as attention_block_forward computes it.
void KvCacheDecoder::attention_forward(const BranchWeights& w, int64_t n) {
    Workspace& ws = *ws_;
    const int64_t first = length_, T = first + n, Hq = w.ad.num_heads, Hkv = w.ad.num_kv_heads;
    const Tensor k_new = w.k_cache.slice_rows(first, T), v_new = w.v_cache.slice_rows(first, T);
    const Tensor k_prefix = w.k_cache.slice_rows(0, T), v_prefix = w.v_cache.slice_rows(0, T);
    if (cached_attention_) {
        attention_qkv_forward(ws.q, k_new, v_new, ws.q_raw, ws.k_raw, ws.q_rstd, ws.k_rstd, ws.ln, w.attn, w.ad,
                              ws.positions);
        ops::attention_decode_forward(ws.attn, ws.q, k_prefix, v_prefix, first, Hq, Hkv);
        ops::matmul_forward(ws.block_out, ws.attn, w.attn.wo);
    } else {
        // The new queries go to rows [first, T) of the prefix's query rows; the rows before hold stale
        // (or zero) queries whose outputs are never read.
        const Tensor q_rows = prefix_q_.slice_rows(0, T), out_rows = prefix_out_.slice_rows(0, T);
        const Tensor lse(prefix_lse_.data(), DType::f32, {Hq * T}, prefix_lse_.device());
        attention_qkv_forward(q_rows.slice_rows(first, T), k_new, v_new, ws.q_raw, ws.k_raw, ws.q_rstd, ws.k_rstd,
                              ws.ln, w.attn, w.ad, ws.positions);
        ops::attention_forward(out_rows, lse, q_rows, k_prefix, v_prefix, prefix_docs_.slice_rows(0, T), 1, T, Hq, Hkv);
        ops::matmul_forward(ws.block_out, out_rows.slice_rows(first, T), w.attn.wo);
    }
    if (w.ad.o_bias) ops::add_bias(ws.block_out, w.attn.bo);
}

void KvCacheDecoder::layer_forward(size_t l, int64_t n) {
    Workspace& ws = *ws_;
    // x += op(rmsnorm(x)) for each branch: attention over the cache, or the training FFN blocks.
    for (const BranchWeights& w : layers_[l]) {
        ops::rmsnorm_forward(ws.ln, ws.rstd, ws.x, w.norm, static_cast<float>(w.spec->norm_eps));
        switch (w.spec->kind) {
            case BranchKind::attention:
                attention_forward(w, n);
                break;
            case BranchKind::mlp:
                mlp_block_forward(ws.block_out, ws.mlp, ws.ln, w.mlp);
                break;
            case BranchKind::moe:
                routed_moe_forward(ws.block_out, ws.moe, ws.latent, ws.ln, w.moe, w.md);
                if (w.has_shared) shared_expert_forward(ws.block_out, ws.shared, ws.ln, w.shared);
                break;
            case BranchKind::mamba:
                break;  // refused at construction
        }
        ops::add(ws.x, ws.x, ws.block_out);
    }
}

std::vector<float> KvCacheDecoder::forward(std::span<const int32_t> ids, bool all_rows) {
    const ModelSpec& spec = model_.spec();
    const int64_t n = static_cast<int64_t>(ids.size());
    MF_CHECK(n >= 1 && n <= max_chunk_, "KvCacheDecoder::forward: ", n, " tokens, at most ", max_chunk_, " per call");
    if (length_ + n > max_tokens_)
        fail("generation: position ", length_ + n - 1, " is past the KV cache's ", max_tokens_, " positions");
    for (int64_t i = 0; i < n; ++i)
        if (ids[static_cast<size_t>(i)] < 0 || ids[static_cast<size_t>(i)] >= spec.vocab_size)
            fail("token id ", ids[static_cast<size_t>(i)], " is outside the model's vocabulary [0, ", spec.vocab_size,
                 ")");
    Workspace& ws = *ws_;
    ws.arena.reset();
    allocate(ws.arena, n);
    std::vector<int32_t> positions(static_cast<size_t>(n));
    std::iota(positions.begin(), positions.end(), static_cast<int32_t>(length_));
    ops::copy_from_host(ws.ids, ids.data());
    ops::copy_from_host(ws.positions, positions.data());

    const ParamTable& table = model_.params();
    const ParamSpec* head_spec = table.find_role(ParamRole::head);
    const std::string& embed = table.find_role(ParamRole::embedding)->name;
    ops::embedding_forward(ws.x, ws.ids, model_.param(embed));
    for (size_t l = 0; l < layers_.size(); ++l) layer_forward(l, n);
    length_ += n;

    const Tensor head = model_.param(head_spec != nullptr ? head_spec->name : embed);
    ops::rmsnorm_forward(ws.ln, ws.rstd, ws.x, model_.param(model_.spec().final_norm_module + ".weight"),
                         static_cast<float>(spec.final_norm_eps));
    const int64_t first_row = all_rows ? 0 : n - 1, V = spec.vocab_size;
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

GenerateResult generate(const CausalLM& model, std::span<const int32_t> prompt, const GenerateOptions& o,
                        const std::function<void(int32_t)>& on_token) {
    const ModelSpec& c = model.spec();
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
