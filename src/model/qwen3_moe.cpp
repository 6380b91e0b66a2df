#include "model/qwen3_moe.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <random>

#include "ops/ops.h"

namespace mf::model {

namespace {
// A phase clock mark named after a block and its layer (ops::phase_mark; nothing when the clock is off).
void mark_layer(const char* what, int64_t l) {
    if (ops::phase_clock_on()) ops::phase_mark(std::string(what) + " " + std::to_string(l));
}
}  // namespace

struct Qwen3Moe::Layer {
    bool is_moe = false;
    int64_t gate_up_spec = -1, down_spec = -1;  // MoE: the stacked expert specs' indices in specs()
    Tensor ln1, ln2, g_ln1, g_ln2;
    AttentionWeights attn, g_attn;
    MoeWeights moe, g_moe;
    MlpWeights mlp, g_mlp;
};

struct Qwen3Moe::Workspace {
    int64_t B = -1, T = -1;
    Arena arena;
    struct LayerActs {
        Tensor ln1, ln1_rstd, x_mid, ln2, ln2_rstd, ffn_out, attn_out;
        AttentionActs attn;
        MoeActs moe;
        MlpActs mlp;
    };
    // Batch, on the model's device.
    Tensor ids, targets, positions, doc_ids, mask;
    // Every row one document: attention takes the plain causal mask (doc_ids left out), which
    // cuDNN's fused engines serve on the GPU; packed rows keep the document mask.
    bool plain_causal = false;
    const Tensor& attention_docs() const { return plain_causal ? kNoDocs : doc_ids; }
    static inline const Tensor kNoDocs{};
    std::vector<Tensor> resid;  // L + 1: resid[l] is the input of layer l
    // Per-layer activations; with recompute = full only layers[0] exists and every layer uses it.
    std::vector<LayerActs> layers;
    // With recompute = moe (or full), the one set of MoE expert activations all MoE layers share.
    MoeActs shared_moe;
    LayerActs& acts(int64_t l, Recompute r) { return layers[r == Recompute::full ? 0 : static_cast<size_t>(l)]; }
    MoeActs& moe_acts(int64_t l, Recompute r) { return r == Recompute::none ? acts(l, r).moe : shared_moe; }
    Tensor lnf, lnf_rstd, losses;
    Tensor aux_counts, aux_prob_sums;  // [E] f32, summed over MoE layers
    // backward
    Tensor d_resid, d_mid, d_ln, dprobs;
    AttentionScratch attn_scratch;
    MoeScratch moe_scratch;
    MlpScratch mlp_scratch;
    // EP rows sized by the real routing (ffn_blocks.h EpRowStore), kept across steps: one per
    // kept set of MoE activations, and one scratch shared by the backward and the forward's exchange.
    std::vector<std::shared_ptr<EpRowStore>> ep_local;
    std::shared_ptr<EpRowStore> ep_scratch;
    std::shared_ptr<EpRowStore> ep_local_store(size_t i) {
        if (ep_local.size() <= i) ep_local.resize(i + 1);
        if (!ep_local[i]) ep_local[i] = std::make_shared<EpRowStore>();
        return ep_local[i];
    }
};

namespace {

AttentionDims attention_dims(const Qwen3MoeConfig& c) {
    return {c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            static_cast<float>(c.rms_norm_eps), static_cast<float>(c.rope_theta)};
}

MoeDims moe_dims(const Qwen3MoeConfig& c) {
    return {c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob};
}

}  // namespace

ParamTable qwen3_moe_param_table(const Qwen3MoeConfig& c, ExpertShard shard) {
    ParamTable table;
    const int64_t H = c.hidden_size, D = c.head_dim;
    table.add("model.embed_tokens.weight", {c.vocab_size, H});
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        table.add(p + "self_attn.q_proj.weight", {c.num_attention_heads * D, H});
        table.add(p + "self_attn.k_proj.weight", {c.num_key_value_heads * D, H});
        table.add(p + "self_attn.v_proj.weight", {c.num_key_value_heads * D, H});
        table.add(p + "self_attn.o_proj.weight", {H, c.num_attention_heads * D});
        table.add(p + "self_attn.q_norm.weight", {D});
        table.add(p + "self_attn.k_norm.weight", {D});
        if (c.is_moe_layer(l)) {
            table.add(p + "mlp.gate.weight", {c.num_experts, H});
            table.add(p + "mlp.experts.gate_up_proj", {c.num_experts, 2 * c.moe_intermediate_size, H}, true, shard);
            table.add(p + "mlp.experts.down_proj", {c.num_experts, H, c.moe_intermediate_size}, true, shard);
        } else {
            // gate_proj then up_proj, adjacent: together the fused [2I, H] gate_up matrix.
            table.add(p + "mlp.gate_proj.weight", {c.intermediate_size, H});
            table.add(p + "mlp.up_proj.weight", {c.intermediate_size, H});
            table.add(p + "mlp.down_proj.weight", {H, c.intermediate_size});
        }
        table.add(p + "input_layernorm.weight", {H});
        table.add(p + "post_attention_layernorm.weight", {H});
    }
    table.add("model.norm.weight", {H});
    if (!c.tie_word_embeddings) table.add("lm_head.weight", {c.vocab_size, H});
    return table;
}

Qwen3Moe::Qwen3Moe(Qwen3MoeConfig config, ModelPlacement placement)
    : config_(std::move(config)), placement_(placement),
      param_dtype_(placement.device == Device::cpu ? DType::f32 : DType::bf16), act_dtype_(param_dtype_),
      table_(qwen3_moe_param_table(config_, placement.shard)),
      total_params_(placement.shard.sharded() ? qwen3_moe_param_table(config_).total() : table_.total()),
      ws_(std::make_unique<Workspace>()) {
    if (placement.shard.sharded() && (config_.num_experts == 0 || config_.num_experts % placement.shard.size != 0))
        fail("expert parallelism: EP size ", placement.shard.size, " must divide the number of experts (",
             config_.num_experts, ")");
    MF_CHECK(placement.device == Device::cuda || placement.grad_dtype == DType::f32, "CPU models keep f32 gradients");
    MF_CHECK(placement.grad_dtype == DType::f32 || placement.grad_dtype == DType::bf16, "gradients are f32 or bf16");
    const size_t P = static_cast<size_t>(table_.total());
    params_ = Buffer(P * dtype_size(param_dtype_), placement.device);
    grads_ = Buffer(P * dtype_size(placement.grad_dtype), placement.device);
    params_.zero();
    grads_.zero();
    build_layers();
}

Qwen3Moe::~Qwen3Moe() = default;

Tensor Qwen3Moe::param(std::string_view name) const {
    settle_params();
    return param_view(name);
}

Tensor Qwen3Moe::param_view(std::string_view name) const {
    const ParamSpec& s = table_.get(name);
    return params_.as(param_dtype_, s.shape, static_cast<size_t>(s.offset) * dtype_size(param_dtype_));
}

Tensor Qwen3Moe::outer_param(std::string_view name) const {
    MF_CHECK(table_.get(name).layer < 0, "outer_param: ", name, " belongs to a layer");
    return param_view(name);
}

std::vector<bool> Qwen3Moe::set_grad_square_sums(const Tensor& slots, const std::vector<bool>& wanted) {
    const size_t n = table_.specs().size();
    grad_square_slots_ = Tensor();
    grad_square_wanted_.clear();
    if (slots.data() == nullptr) return {};
    MF_CHECK(slots.dtype() == DType::f64 && slots.numel() == static_cast<int64_t>(n) &&
                 slots.device() == placement_.device && wanted.size() == n,
             "set_grad_square_sums: ", slots.numel(), " ", dtype_name(slots.dtype()), " slots and ", wanted.size(),
             " flags for ", n, " parameters");
    grad_square_slots_ = slots;
    grad_square_wanted_.assign(n, false);
    for (const Layer& L : layers_)
        if (L.is_moe)
            for (const int64_t spec : {L.gate_up_spec, L.down_spec})
                grad_square_wanted_[static_cast<size_t>(spec)] = wanted[static_cast<size_t>(spec)];
    return grad_square_wanted_;
}

void Qwen3Moe::zero_grads() {
    settle_grads();
    const Tensor g = grads_.as(placement_.grad_dtype, {table_.expert_offset()});  // the replicated region
    zeroing_ = ops::background(placement_.device, [&g] { ops::zero(g); });
    expert_grads_marked_.assign(layers_.size(), 0);
    for (size_t l = 0; l < layers_.size(); ++l) expert_grads_marked_[l] = layers_[l].is_moe ? 1 : 0;
}

void Qwen3Moe::settle_expert_grads(int64_t layer) const {
    for (size_t l = 0; l < expert_grads_marked_.size(); ++l) {
        if (!expert_grads_marked_[l] || (layer >= 0 && static_cast<int64_t>(l) != layer)) continue;
        ops::zero(layers_[l].g_moe.gate_up);
        ops::zero(layers_[l].g_moe.down);
        expert_grads_marked_[l] = 0;
    }
}

void Qwen3Moe::settle_grads() const {
    if (zeroing_ == 0) return;
    ops::wait_background(placement_.device, zeroing_);
    zeroing_ = 0;
}

int64_t Qwen3Moe::param_stage(const ParamSpec& spec) const {
    if (spec.layer >= 0) return spec.layer;
    return spec.name == "model.embed_tokens.weight" ? kStageEmbedding : kStageHead;
}

void Qwen3Moe::params_pending(int64_t stage, std::function<void()> wait) {
    MF_CHECK(stage >= kStageEmbedding && stage < config_.num_hidden_layers, "params_pending: stage ", stage, " of ",
             config_.num_hidden_layers, " layers");
    params_pending_.resize(static_cast<size_t>(config_.num_hidden_layers + 2));
    params_pending_[static_cast<size_t>(stage + 2)].push_back(std::move(wait));
}

void Qwen3Moe::settle_stage(int64_t stage) const {
    if (static_cast<size_t>(stage + 2) >= params_pending_.size()) return;
    std::vector<std::function<void()>> waits;
    waits.swap(params_pending_[static_cast<size_t>(stage + 2)]);
    for (const auto& wait : waits) wait();
}

void Qwen3Moe::settle_params() const {
    for (int64_t stage = kStageEmbedding; stage < static_cast<int64_t>(params_pending_.size()) - 2; ++stage)
        settle_stage(stage);
}

Tensor Qwen3Moe::grad(std::string_view name) const {
    settle_grads();
    const ParamSpec& s = table_.get(name);
    if (s.is_expert) settle_expert_grads(s.layer);
    return grads_.as(placement_.grad_dtype, s.shape, static_cast<size_t>(s.offset) * dtype_size(placement_.grad_dtype));
}

float* Qwen3Moe::param_data() {
    MF_CHECK(placement_.device == Device::cpu, "param_data() is for CPU models");
    return params_tensor().ptr<float>();
}

float* Qwen3Moe::grad_data() {
    MF_CHECK(placement_.device == Device::cpu, "grad_data() is for CPU models");
    return grads_tensor().ptr<float>();
}

void Qwen3Moe::set_params_from_host(const float* src) {
    const Tensor dst = params_tensor();
    if (dst.device() == Device::cpu) {
        ops::copy_from_host(dst, src);
        return;
    }
    Buffer staging(dst.numel() * sizeof(float), Device::cuda);
    const Tensor f32 = staging.as(DType::f32, {dst.numel()});
    ops::copy_from_host(f32, src);
    ops::cast(dst, f32);
    ops::synchronize(Device::cuda);
}

void Qwen3Moe::get_params_to_host(float* dst) const {
    const Tensor src = params_tensor();
    if (src.device() == Device::cpu) {
        ops::copy_to_host(dst, src);
        return;
    }
    Buffer staging(src.numel() * sizeof(float), Device::cuda);
    const Tensor f32 = staging.as(DType::f32, {src.numel()});
    ops::cast(f32, src);
    ops::copy_to_host(dst, f32);
}

void Qwen3Moe::build_layers() {
    layers_.clear();
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        Layer L;
        L.is_moe = config_.is_moe_layer(l);
        for (int pass = 0; pass < 2; ++pass) {
            auto at = [&](const std::string& name) { return pass == 0 ? param(p + name) : grad(p + name); };
            AttentionWeights a{at("self_attn.q_proj.weight"), at("self_attn.k_proj.weight"),
                               at("self_attn.v_proj.weight"), at("self_attn.o_proj.weight"),
                               at("self_attn.q_norm.weight"), at("self_attn.k_norm.weight")};
            (pass == 0 ? L.attn : L.g_attn) = a;
            (pass == 0 ? L.ln1 : L.g_ln1) = at("input_layernorm.weight");
            (pass == 0 ? L.ln2 : L.g_ln2) = at("post_attention_layernorm.weight");
            if (L.is_moe) {
                (pass == 0 ? L.moe : L.g_moe) =
                    MoeWeights{at("mlp.gate.weight"), at("mlp.experts.gate_up_proj"), at("mlp.experts.down_proj")};
                L.gate_up_spec = &table_.get(p + "mlp.experts.gate_up_proj") - table_.specs().data();
                L.down_spec = &table_.get(p + "mlp.experts.down_proj") - table_.specs().data();
            } else {
                // gate_proj and up_proj are adjacent: one fused [2I, H] view over both.
                const Tensor gate = at("mlp.gate_proj.weight");
                const Tensor gate_up(gate.data(), gate.dtype(), {2 * config_.intermediate_size, config_.hidden_size},
                                     gate.device());
                (pass == 0 ? L.mlp : L.g_mlp) = MlpWeights{gate_up, at("mlp.down_proj.weight")};
            }
        }
        layers_.push_back(L);
    }
}

void Qwen3Moe::init_random(uint64_t seed, float std) {
    // Drawn over the whole model in layer order, so every EP shard gets its slice of the same values.
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, std);
    std::vector<float> host(static_cast<size_t>(table_.total()));
    for (const auto& s : table_.specs()) {
        const bool is_norm = s.shape.size() == 1;
        const int64_t per_row = s.is_expert ? s.numel / s.shape[0] : s.numel;
        const int64_t first = s.is_expert ? s.expert_first * per_row : 0;
        const int64_t total = s.is_expert ? s.experts_total * per_row : s.numel;
        for (int64_t i = 0; i < total; ++i) {
            const float x = is_norm ? 1.0f : normal(rng);
            if (i >= first && i < first + s.numel) host[static_cast<size_t>(s.offset + i - first)] = x;
        }
    }
    set_params_from_host(host.data());
}

int64_t qwen3_moe_active_params(const Qwen3MoeConfig& c, const ParamTable& table) {
    int64_t n = 0;
    for (const auto& s : table.specs()) {
        if (s.is_expert) n += s.numel / s.shape[0] * c.num_experts_per_tok;
        else n += s.numel;
    }
    return n;
}

double qwen3_moe_flops_per_token(const Qwen3MoeConfig& c, int64_t T) {
    // 6 × matmul parameters touched per token + 3 × causal attention forward (BENCHMARKS.md).
    double matmul = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        matmul += static_cast<double>(c.hidden_size) * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads);
        if (c.is_moe_layer(l))
            matmul += static_cast<double>(c.hidden_size) * (c.num_experts + 3.0 * c.moe_intermediate_size * c.num_experts_per_tok);
        else
            matmul += 3.0 * c.hidden_size * c.intermediate_size;
    }
    matmul += static_cast<double>(c.hidden_size) * c.vocab_size;
    const double attention = static_cast<double>(c.num_hidden_layers) * 4.0 * T * c.num_attention_heads * c.head_dim / 2.0;
    return 6.0 * matmul + 3.0 * attention;
}

size_t Qwen3Moe::activation_bytes() const {
    size_t n = ws_->arena.high_water();
    for (const auto& s : ws_->ep_local) n += s ? s->bytes() : 0;
    return n + (ws_->ep_scratch ? ws_->ep_scratch->bytes() : 0);
}

std::string Qwen3Moe::locate_nonfinite_activation() const {
    const Workspace& ws = *ws_;
    if (ws.resid.empty()) return "(no forward pass yet)";
    if (!ops::all_finite(ws.resid[0])) return "the token embeddings";
    for (size_t l = 0; l + 1 < ws.resid.size(); ++l) {
        if (recompute_ != Recompute::full && !ops::all_finite(ws.layers[l].x_mid))
            return "layer " + std::to_string(l) + " (self-attention output)";
        if (!ops::all_finite(ws.resid[l + 1]))
            return "layer " + std::to_string(l) + (layers_[l].is_moe ? " (MoE output)" : " (MLP output)");
    }
    if (!ops::all_finite(ws.lnf)) return "the final norm";
    return "the loss head (logits / cross-entropy)";
}

std::string Qwen3Moe::locate_nonfinite_gradient() const {
    for (const auto& s : table_.specs())
        if (!ops::all_finite(grad(s.name))) return s.name;
    return "(none)";
}

void Qwen3Moe::plan(int64_t B, int64_t T) {
    Workspace& ws = *ws_;
    if (ws.B != B || ws.T != T) {
        // Replay the allocation sequence on a measuring arena, then allocate exactly that much.
        ws.arena = Arena::measuring(placement_.device);
        allocate_step(B, T);
        const size_t need = ws.arena.high_water();
        // A batch shape the host cannot hold is named, not left to the allocator's bare byte count.
        const double host = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
        if (placement_.device == Device::cpu && host > 0 && static_cast<double>(need) > host)
            fail("a micro-batch of ", B, " x ", T, " tokens needs ", static_cast<double>(need) / 1073741824.0,
                 " GiB of activations, more than the ", host / 1073741824.0,
                 " GiB of memory of this machine: lower the micro-batch size or the sequence length "
                 "(train.micro_batch / train.seq_len, eval.* or --micro-batch / --seq-len)");
        ws.arena = Arena(need, placement_.device);
        ws.B = B;
        ws.T = T;
    }
    ws.arena.reset();
    allocate_step(B, T);
}

void Qwen3Moe::allocate_step(int64_t B, int64_t T) {
    Workspace& ws = *ws_;
    if (ep_ != nullptr && !ws.ep_scratch) ws.ep_scratch = std::make_shared<EpRowStore>();
    const auto& c = config_;
    const int64_t N = B * T, H = c.hidden_size;
    const DType act = act_dtype_;
    const AttentionDims ad = attention_dims(c);
    MoeDims md = moe_dims(c);
    md.ep = ep_;
    md.ep_chunks = ep_chunks_;
    Arena& A = ws.arena;
    ws.ids = A.alloc(DType::i32, {N});
    ws.targets = A.alloc(DType::i32, {N});
    ws.positions = A.alloc(DType::i32, {N});
    ws.doc_ids = A.alloc(DType::i32, {N});
    ws.mask = A.alloc(DType::f32, {N});
    ws.resid.assign(static_cast<size_t>(c.num_hidden_layers + 1), Tensor());
    const int64_t kept_layers = recompute_ == Recompute::full ? 1 : c.num_hidden_layers;
    ws.layers.assign(static_cast<size_t>(kept_layers), Workspace::LayerActs());
    for (int64_t l = 0; l <= c.num_hidden_layers; ++l) ws.resid[static_cast<size_t>(l)] = A.alloc(act, {N, H});
    // Outputs consumed right away by the residual adds: one pair for all layers.
    const Tensor attn_out = A.alloc(act, {N, H}), ffn_out = A.alloc(act, {N, H});
    for (int64_t l = 0; l < kept_layers; ++l) {
        auto& la = ws.layers[static_cast<size_t>(l)];
        la.ln1 = A.alloc(act, {N, H});
        la.ln1_rstd = A.alloc(DType::f32, {N});
        la.attn.alloc(A, ad, B, T, act);
        la.attn_out = attn_out;
        la.x_mid = A.alloc(act, {N, H});
        la.ln2 = A.alloc(act, {N, H});
        la.ln2_rstd = A.alloc(DType::f32, {N});
        const bool any_moe = recompute_ == Recompute::full ? c.num_experts > 0 : c.is_moe_layer(l);
        bool has_dense = false;
        for (int64_t j = 0; j < c.num_hidden_layers; ++j) has_dense = has_dense || !c.is_moe_layer(j);
        const bool any_mlp = recompute_ == Recompute::full ? has_dense : !c.is_moe_layer(l);
        if (any_moe && recompute_ == Recompute::none)
            la.moe.alloc(A, md, N, act, ws.ep_local_store(static_cast<size_t>(l)), ws.ep_scratch);
        if (any_mlp) la.mlp.alloc(A, N, c.intermediate_size, act);
        la.ffn_out = ffn_out;
    }
    if (recompute_ != Recompute::none && c.num_experts > 0)
        ws.shared_moe.alloc(A, md, N, act, ws.ep_local_store(0), ws.ep_scratch);
    ws.lnf = A.alloc(act, {N, H});
    ws.lnf_rstd = A.alloc(DType::f32, {N});
    ws.losses = A.alloc(DType::f32, {N});
    ws.d_resid = A.alloc(act, {N, H});
    ws.d_mid = A.alloc(act, {N, H});
    ws.d_ln = A.alloc(act, {N, H});
    ws.attn_scratch.alloc(A, ad, B, T, act);
    if (c.num_experts > 0) {
        ws.aux_counts = A.alloc(DType::f32, {c.num_experts});
        ws.aux_prob_sums = A.alloc(DType::f32, {c.num_experts});
        ws.dprobs = A.alloc(DType::f32, {N, c.num_experts});
        ws.moe_scratch.alloc(A, md, N, act, ws.ep_scratch);
    }
    ws.mlp_scratch.alloc(A, N, c.intermediate_size, act);
}

Recompute parse_recompute(std::string_view name) {
    if (name == "none") return Recompute::none;
    if (name == "moe") return Recompute::moe;
    if (name == "full") return Recompute::full;
    fail("unknown recompute mode \"", name, "\" (none, moe, full)");
}

void Qwen3Moe::set_embedding_row_gather(RowGather gather, int ranks) {
    MF_CHECK(!gather || !config_.tie_word_embeddings,
             "set_embedding_row_gather: tied embeddings take the head's dense gradient; reduce them instead");
    MF_CHECK(ranks >= 1, "set_embedding_row_gather: ranks=", ranks);
    row_gather_ = std::move(gather);
    row_gather_ranks_ = row_gather_ ? ranks : 1;
}

void Qwen3Moe::set_expert_parallel(parallel::Communicator* ep_group, int64_t chunks) {
    MF_CHECK(chunks >= 1, "expert parallelism: ", chunks, " pipeline chunks (need at least 1)");
    const ExpertShard& sh = placement_.shard;
    const int64_t size = ep_group != nullptr ? ep_group->size() : 1, rank = ep_group != nullptr ? ep_group->rank() : 0;
    if (size != sh.size || rank != sh.rank)
        fail("expert parallelism: the model holds expert shard ", sh.rank, " of ", sh.size, ", the EP group is rank ",
             rank, " of ", size);
    ep_ = size > 1 ? ep_group : nullptr;
    ep_chunks_ = chunks;
    ws_->B = -1;  // the activation plan changes
}

void Qwen3Moe::set_recompute(Recompute r) {
    recompute_ = r;
    ws_->B = -1;  // the activation plan changes
}

void Qwen3Moe::layer_forward(int64_t l, int64_t B, int64_t T) {
    Workspace& ws = *ws_;
    const auto& c = config_;
    const Layer& L = layers_[static_cast<size_t>(l)];
    settle_stage(l);
    auto& la = ws.acts(l, recompute_);
    const float eps = static_cast<float>(c.rms_norm_eps);
    const Tensor& x = ws.resid[static_cast<size_t>(l)];
    ops::rmsnorm_forward(la.ln1, la.ln1_rstd, x, L.ln1, eps);
    attention_block_forward(la.attn_out, la.attn, la.ln1, L.attn, attention_dims(c), B, T, ws.positions,
                            ws.attention_docs());
    ops::add(la.x_mid, x, la.attn_out);
    mark_layer("fwd attention", l);
    ops::rmsnorm_forward(la.ln2, la.ln2_rstd, la.x_mid, L.ln2, eps);
    if (L.is_moe) {
        MoeDims md = moe_dims(c);
        md.ep = ep_;
        md.ep_chunks = ep_chunks_;
        moe_block_forward(la.ffn_out, ws.moe_acts(l, recompute_), la.ln2, L.moe, md);
    }
    else mlp_block_forward(la.ffn_out, la.mlp, la.ln2, L.mlp);
    ops::add(ws.resid[static_cast<size_t>(l + 1)], la.x_mid, la.ffn_out);
    mark_layer("fwd ffn", l);
}

void Qwen3Moe::validate(const data::Batch& b) const {
    const size_t n = static_cast<size_t>(b.B * b.T);
    MF_CHECK(b.B > 0 && b.T > 0, "empty batch");
    MF_CHECK(b.input_ids.size() == n && b.targets.size() == n && b.positions.size() == n && b.doc_ids.size() == n &&
                 b.is_pad.size() == n,
             "batch arrays do not match B·T = ", n);
    for (size_t i = 0; i < n; ++i) {
        if (b.input_ids[i] < 0 || b.input_ids[i] >= config_.vocab_size)
            fail("token id ", b.input_ids[i], " at position ", i, " is outside the vocabulary [0, ", config_.vocab_size, ")");
        if (b.targets[i] != data::kIgnoreIndex && (b.targets[i] < 0 || b.targets[i] >= config_.vocab_size))
            fail("label ", b.targets[i], " at position ", i, " is outside the vocabulary [0, ", config_.vocab_size,
                 ") and is not -100");
        if (b.positions[i] < 0) fail("negative position at ", i);
    }
}

StepStats Qwen3Moe::step(const data::Batch& batch, const LossScales* scales, float* logits) {
    validate(batch);
    if (placement_.shard.sharded() && ep_ == nullptr)
        fail("this model holds expert shard ", placement_.shard.rank, " of ", placement_.shard.size,
             "; set its EP group (set_expert_parallel) before step()");
    const auto& c = config_;
    const int64_t B = batch.B, T = batch.T, N = B * T, H = c.hidden_size;
    plan(B, T);
    Workspace& ws = *ws_;
    const AttentionDims ad = attention_dims(c);
    MoeDims md = moe_dims(c);
    md.ep = ep_;
    md.ep_chunks = ep_chunks_;
    const float eps = static_cast<float>(c.rms_norm_eps);
    // Not param(): that would wait for every pending parameter write before the forward; each stage
    // waits for its own right before its first op (settle_stage).
    const Tensor wte = outer_param("model.embed_tokens.weight");
    const std::string head_name = c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    const Tensor head = outer_param(head_name);
    const Tensor normf = outer_param("model.norm.weight");

    std::vector<float> mask(static_cast<size_t>(N));
    double rows_per_layer = 0;
    for (int64_t i = 0; i < N; ++i) {
        mask[static_cast<size_t>(i)] = batch.is_pad[static_cast<size_t>(i)] ? 0.0f : 1.0f;
        rows_per_layer += mask[static_cast<size_t>(i)];
    }
    ops::copy_from_host(ws.ids, batch.input_ids.data());
    ops::copy_from_host(ws.targets, batch.targets.data());
    ops::copy_from_host(ws.positions, batch.positions.data());
    ops::copy_from_host(ws.doc_ids, batch.doc_ids.data());
    ws.plain_causal = true;
    for (int64_t i = 0; i < N && ws.plain_causal; ++i)
        ws.plain_causal = batch.doc_ids[static_cast<size_t>(i)] == batch.doc_ids[static_cast<size_t>(i - i % T)];
    ops::copy_from_host(ws.mask, mask.data());

    // --- forward -----------------------------------------------------------------------------------
    settle_stage(kStageEmbedding);
    ops::embedding_forward(ws.resid[0], ws.ids, wte);
    int64_t num_moe_layers = 0;
    if (c.num_experts > 0) {
        ops::zero(ws.aux_counts);
        ops::zero(ws.aux_prob_sums);
    }
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        layer_forward(l, B, T);
        if (layers_[static_cast<size_t>(l)].is_moe) {
            const MoeActs& ma = ws.moe_acts(l, recompute_);
            ops::moe_aux_stats(ws.aux_counts, ws.aux_prob_sums, ma.topk_idx, ma.probs, ws.mask);
            ++num_moe_layers;
        }
    }
    const Tensor& x_final = ws.resid.back();
    settle_stage(kStageHead);
    ops::rmsnorm_forward(ws.lnf, ws.lnf_rstd, x_final, normf, eps);
    if (logits != nullptr) {
        MF_CHECK(placement_.device == Device::cpu, "logits output is for CPU models");
        ops::matmul_forward(Tensor(logits, DType::f32, {N, c.vocab_size}), ws.lnf, head);
    }

    // Loss head: CE over counted targets (and, with scales, dL/d lnf and the head's weight grad).
    // The gradients are first touched here (a background zero_grads ran beside the forward).
    settle_grads();
    if (scales != nullptr) ops::zero(ws.d_ln);
    // The bf16 policy on the GPU (bf16 gradients) rounds the logits to bf16, as a bf16 HF model's are.
    const DType logits_dtype =
        placement_.device == Device::cuda && placement_.grad_dtype == DType::bf16 ? DType::bf16 : DType::f32;
    ops::lm_head_cross_entropy(ws.losses, scales ? ws.d_ln : Tensor(), scales ? grad(head_name) : Tensor(), ws.lnf,
                               head, ws.targets, scales ? static_cast<float>(scales->ce) : 0.0f, logits_dtype);
    ops::phase_mark("fwd head");
    StepStats stats;
    stats.ce_sum = ops::sum(ws.losses);
    stats.num_targets = batch.num_targets();

    // Aux loss over all MoE layers together (HF's load_balancing_loss_func, padding excluded).
    const int64_t E = c.num_experts;
    const double rows = rows_per_layer * static_cast<double>(num_moe_layers);
    std::vector<float> counts(static_cast<size_t>(E)), prob_sums(static_cast<size_t>(E));
    if (num_moe_layers > 0 && rows > 0) {
        ops::copy_to_host(counts.data(), ws.aux_counts);
        ops::copy_to_host(prob_sums.data(), ws.aux_prob_sums);
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += static_cast<double>(counts[static_cast<size_t>(e)]) * prob_sums[static_cast<size_t>(e)];
        stats.aux = static_cast<double>(E) * s / (rows * rows);
    }
    if (scales == nullptr) return stats;

    // --- backward ----------------------------------------------------------------------------------
    // d aux / d probs[t, e] = E · C_e / R² for every counted row t of every MoE layer.
    const bool aux_grad = num_moe_layers > 0 && rows > 0 && scales->aux != 0.0;
    if (aux_grad) ops::moe_aux_dprobs(ws.dprobs, ws.aux_counts, ws.mask,
                                      static_cast<float>(scales->aux * static_cast<double>(E) / (rows * rows)));
    ops::zero(ws.d_resid);
    ops::rmsnorm_backward(ws.d_resid, grad("model.norm.weight"), ws.d_ln, x_final, normf, ws.lnf_rstd);
    if (grad_hook_ && !c.tie_word_embeddings) grad_hook_(kGradsHead);
    for (int64_t l = c.num_hidden_layers - 1; l >= 0; --l) {
        const Layer& L = layers_[static_cast<size_t>(l)];
        auto& la = ws.acts(l, recompute_);
        // Recompute what was not kept: the whole layer (full), or the MoE block (moe).
        if (recompute_ == Recompute::full) layer_forward(l, B, T);
        else if (recompute_ == Recompute::moe && L.is_moe) moe_block_forward(la.ffn_out, ws.shared_moe, la.ln2, L.moe, md);
        // x_out = x_mid + ffn(rmsnorm(x_mid))
        ops::copy(ws.d_mid, ws.d_resid);
        ops::zero(ws.d_ln);
        if (L.is_moe) {
            // Written rather than added where zero_grads() left them undefined.
            const bool marked = static_cast<size_t>(l) < expert_grads_marked_.size() &&
                                expert_grads_marked_[static_cast<size_t>(l)] != 0;
            ExpertGradSquares squares;
            for (auto [spec, slot] : {std::pair{L.gate_up_spec, &squares.gate_up}, std::pair{L.down_spec, &squares.down}})
                if (!grad_square_wanted_.empty() && grad_square_wanted_[static_cast<size_t>(spec)]) {
                    *slot = Tensor(static_cast<double*>(grad_square_slots_.data()) + spec, DType::f64, {1},
                                   grad_square_slots_.device());
                    ops::zero(*slot);
                }
            moe_block_backward(ws.d_ln, L.g_moe, ws.moe_scratch, ws.d_resid, aux_grad ? ws.dprobs : Tensor(), la.ln2,
                               ws.moe_acts(l, recompute_), L.moe, md, !marked, squares);
            if (marked) expert_grads_marked_[static_cast<size_t>(l)] = 0;
        } else {
            mlp_block_backward(ws.d_ln, L.g_mlp, ws.mlp_scratch, ws.d_resid, la.ln2, la.mlp, L.mlp);
        }
        ops::rmsnorm_backward(ws.d_mid, L.g_ln2, ws.d_ln, la.x_mid, L.ln2, la.ln2_rstd);
        mark_layer("bwd ffn", l);
        // x_mid = x + attention(rmsnorm(x))
        ops::copy(ws.d_resid, ws.d_mid);
        ops::zero(ws.d_ln);
        attention_block_backward(ws.d_ln, L.g_attn, ws.attn_scratch, ws.d_mid, la.ln1, la.attn, L.attn, ad, B, T,
                                 ws.positions, ws.attention_docs());
        ops::rmsnorm_backward(ws.d_resid, L.g_ln1, ws.d_ln, ws.resid[static_cast<size_t>(l)], L.ln1, la.ln1_rstd);
        if (grad_hook_) grad_hook_(l);
        mark_layer("bwd attention", l);
    }
    if (row_gather_) {
        const int64_t all = row_gather_ranks_ * N;
        const size_t id_bytes = (static_cast<size_t>(all) * sizeof(int32_t) + 255) / 256 * 256;
        const size_t bytes = id_bytes + static_cast<size_t>(all * H) * dtype_size(ws.d_resid.dtype());
        if (gathered_rows_.nbytes() < bytes) gathered_rows_ = Buffer(bytes, placement_.device);
        const Tensor ids = gathered_rows_.as(DType::i32, {all});
        const Tensor rows = gathered_rows_.as(ws.d_resid.dtype(), {all, H}, id_bytes);
        row_gather_(ids, ws.ids);
        row_gather_(rows, ws.d_resid);
        ops::embedding_backward(grad("model.embed_tokens.weight"), rows, ids);
    } else {
        ops::embedding_backward(grad("model.embed_tokens.weight"), ws.d_resid, ws.ids);
    }
    if (grad_hook_) grad_hook_(c.tie_word_embeddings ? kGradsEmbeddingAndHead : kGradsEmbedding);
    ops::phase_mark("bwd embedding");
    (void)H;
    return stats;
}

}  // namespace mf::model
