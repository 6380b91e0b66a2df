#include "model/causal_lm.h"

#include <unistd.h>

#include <cmath>
#include <cstring>

#include "model/mamba_block.h"
#include "ops/ops.h"

namespace mf::model {

namespace {
// A phase clock mark named after a block and its layer (ops::phase_mark; nothing when the clock is off).
// "fwd attention 5", "bwd mamba 0", "fwd ffn 1" (MLP and MoE).
void mark_layer(const char* pass, BranchKind kind, int64_t l) {
    if (!ops::phase_clock_on()) return;
    const char* block = kind == BranchKind::attention ? "attention" : kind == BranchKind::mamba ? "mamba" : "ffn";
    ops::phase_mark(std::string(pass) + " " + block + " " + std::to_string(l));
}

const char* output_name(BranchKind kind) {
    switch (kind) {
        case BranchKind::attention:
            return "self-attention output";
        case BranchKind::mlp:
            return "MLP output";
        case BranchKind::moe:
            return "MoE output";
        case BranchKind::mamba:
            return "Mamba-2 output";
    }
    return "output";
}
}  // namespace

// One branch's weights and gradients (views into the store), with its block dims.
struct CausalLM::BranchState {
    const model::Branch* spec = nullptr;
    Tensor norm, g_norm;
    AttentionDims ad{};
    AttentionWeights attn, g_attn;
    MlpWeights mlp, g_mlp;
    MoeWeights moe, g_moe;
    bool has_shared = false;
    SharedExpertWeights shared, g_shared;
    MambaWeights mamba, g_mamba;
    int64_t gate_up_spec = -1, down_spec = -1;  // MoE: the stacked expert specs' indices in specs()
};

struct CausalLM::Layer {
    std::vector<BranchState> branches;
    bool is_moe = false;
    std::vector<int32_t> replay;  // set_routing_replay's experts, or empty
};

struct CausalLM::Workspace {
    int64_t B = -1, T = -1;
    Arena arena;
    struct BranchActs {
        Tensor in;  // the branch's input: resid[l] for the first branch, else the previous branch's sum
        Tensor ln, ln_rstd, out;
        AttentionActs attn;
        MlpActs mlp;
        SharedExpertActs shared;
        MambaActs mamba;
        LatentActs latent;
    };
    struct LayerActs {
        std::vector<BranchActs> branches;
        MoeActs moe;
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
    SharedExpertScratch shared_scratch;
    MambaScratch mamba_scratch;
    LatentActs latent_scratch;  // LatentMoE backward: the gradients at the latent output (y) and input (x)
    // EP rows sized by the real routing (ep_exchange.h EpRowStore), kept across steps: one per
    // kept set of MoE activations, and one scratch shared by the backward and the forward's exchange.
    std::vector<std::shared_ptr<EpRowStore>> ep_local;
    std::shared_ptr<EpRowStore> ep_scratch;
    std::shared_ptr<EpRowStore> ep_local_store(size_t i) {
        if (ep_local.size() <= i) ep_local.resize(i + 1);
        if (!ep_local[i]) ep_local[i] = std::make_shared<EpRowStore>();
        return ep_local[i];
    }
};

// --- the parameter layout ----------------------------------------------------------------------------

ParamTable model_param_table(const ModelSpec& spec, ExpertShard shard) {
    ParamTable table;
    const int64_t H = spec.hidden_size;
    table.add(spec.embedding_module + ".weight", {spec.vocab_size, H}, ParamRole::embedding);
    for (int64_t l = 0; l < spec.num_layers(); ++l) {
        const std::string p = layer_prefix(l);
        const LayerSpec& layer = spec.layers[static_cast<size_t>(l)];
        for (const Branch& b : layer.branches) {
            const std::string m = p + b.module + ".";
            switch (b.kind) {
                case BranchKind::attention:
                    declare_attention_params(table, m, attention_dims(b.attention, H));
                    break;
                case BranchKind::mlp:
                    declare_mlp_params(table, m, H, b.mlp.intermediate, b.mlp.act);
                    break;
                case BranchKind::moe:
                    declare_moe_params(table, p, b.module, b.moe, H, shard);
                    break;
                case BranchKind::mamba:
                    declare_mamba_params(table, m, b.mamba, H);
                    break;
            }
        }
        for (const Branch& b : layer.branches) table.add(p + b.norm + ".weight", {H}, ParamRole::norm);
    }
    table.add(spec.final_norm_module + ".weight", {H}, ParamRole::norm);
    if (!spec.tie_word_embeddings) table.add("lm_head.weight", {spec.vocab_size, H}, ParamRole::head);
    if (!spec.disk_model_prefix.empty()) table.store_model_prefix_as(spec.disk_model_prefix);
    return table;
}

int64_t model_active_params(const ModelSpec& spec, const ParamTable& table) {
    int64_t n = 0;
    for (const auto& s : table.specs()) {
        if (s.is_expert)
            n += s.numel / s.shape[0] * spec.moe(s.layer)->top_k;
        else
            n += s.numel;
    }
    return n;
}

double model_flops_per_token(const ModelSpec& spec, int64_t T) {
    // 6 × matmul parameters touched per token + 3 × causal attention forward (BENCHMARKS.md).
    const double H = static_cast<double>(spec.hidden_size);
    double matmul = 0, attention = 0;
    for (const LayerSpec& layer : spec.layers)
        for (const Branch& b : layer.branches) {
            if (b.kind == BranchKind::attention) {
                const AttentionBranch& a = b.attention;
                matmul +=
                    H * static_cast<double>(a.head_dim) * static_cast<double>(2 * a.num_heads + 2 * a.num_kv_heads);
                attention += 4.0 * static_cast<double>(T) * static_cast<double>(a.num_heads * a.head_dim) / 2.0;
            } else if (b.kind == BranchKind::moe) {
                const MoeBranch& m = b.moe;
                const double mats = m.act == Activation::swiglu ? 3.0 : 2.0;          // matrices per expert
                const double Din = m.latent > 0 ? static_cast<double>(m.latent) : H;  // the experts' width
                matmul += H * static_cast<double>(m.num_experts) +
                          mats * Din * static_cast<double>(m.intermediate * m.top_k) +
                          2.0 * H * static_cast<double>(m.latent);
                if (m.shared_intermediate > 0) matmul += mats * H * static_cast<double>(m.shared_intermediate);
                if (m.shared_gate) matmul += H;
            } else if (b.kind == BranchKind::mamba) {
                // in_proj and out_proj, and the recurrence as a product: per token and head, the state
                // update and the output read each touch its P × S state (2 · 2PS forward FLOPs).
                const MambaBranch& m = b.mamba;
                matmul += H * static_cast<double>(2 * m.inner() + m.conv_dim() + m.num_heads);
                attention += 4.0 * static_cast<double>(m.inner() * m.state_size);
            } else {
                const double mats = b.mlp.act == Activation::swiglu ? 3.0 : 2.0;
                matmul += mats * H * static_cast<double>(b.mlp.intermediate);
            }
        }
    matmul += H * static_cast<double>(spec.vocab_size);
    return 6.0 * matmul + 3.0 * attention;
}

// --- construction --------------------------------------------------------------------------------------

CausalLM::CausalLM(ModelSpec spec, ModelPlacement placement)
    : spec_(std::move(spec)),
      act_dtype_(placement.device == Device::cpu ? DType::f32 : DType::bf16),
      store_(model_param_table(spec_, placement.shard), spec_.num_layers(), placement),
      total_params_(placement.shard.sharded() ? model_param_table(spec_).count() : store_.table().count()),
      ws_(std::make_unique<Workspace>()) {
    const int64_t E = spec_.num_experts();
    if (placement.shard.sharded() && (E == 0 || E % placement.shard.size != 0))
        fail("expert parallelism: EP size ", placement.shard.size, " must divide the number of experts (", E, ")");
    build_layers();
}

CausalLM::~CausalLM() = default;

void CausalLM::build_layers() {
    layers_.clear();
    const int64_t H = spec_.hidden_size;
    const ParamTable& table = store_.table();
    const ParamLookup param = [this](const std::string& name) { return store_.param_view(name); };
    const ParamLookup grad = [this](const std::string& name) { return store_.grad_view(name); };
    for (int64_t l = 0; l < spec_.num_layers(); ++l) {
        const std::string p = layer_prefix(l);
        Layer L;
        for (const Branch& b : spec_.layers[static_cast<size_t>(l)].branches) {
            BranchState s;
            s.spec = &b;
            s.norm = param(p + b.norm + ".weight");
            s.g_norm = grad(p + b.norm + ".weight");
            const std::string m = p + b.module + ".";
            if (b.kind == BranchKind::attention) {
                s.ad = attention_dims(b.attention, H);
                s.attn = attention_weights(param, m, s.ad);
                s.g_attn = attention_weights(grad, m, s.ad);
            } else if (b.kind == BranchKind::mlp) {
                s.mlp = mlp_weights(param, m, H, b.mlp.intermediate, b.mlp.act);
                s.g_mlp = mlp_weights(grad, m, H, b.mlp.intermediate, b.mlp.act);
            } else if (b.kind == BranchKind::mamba) {
                s.mamba = mamba_weights(param, m, b.mamba, H);
                s.g_mamba = mamba_weights(grad, m, b.mamba, H);
            } else {
                L.is_moe = true;
                s.moe = moe_weights(param, m, b.moe);
                s.g_moe = moe_weights(grad, m, b.moe);
                s.has_shared = b.moe.shared_intermediate > 0;
                if (s.has_shared) {
                    s.shared = shared_expert_weights(param, m, b.moe, H);
                    s.g_shared = shared_expert_weights(grad, m, b.moe, H);
                }
                s.gate_up_spec = &table.get(m + experts_first_name(b.moe)) - table.specs().data();
                s.down_spec = &table.get(m + "experts.down_proj") - table.specs().data();
            }
            L.branches.push_back(s);
        }
        layers_.push_back(std::move(L));
    }
}

MoeDims CausalLM::moe_dims(const MoeBranch& m) const {
    MoeDims d = moe_block_dims(m, spec_.hidden_size);
    d.ep = ep_;
    d.ep_chunks = ep_chunks_;
    return d;
}

std::vector<bool> CausalLM::set_grad_square_sums(const Tensor& slots, const std::vector<bool>& wanted) {
    const size_t n = params().specs().size();
    grad_square_slots_ = Tensor();
    grad_square_wanted_.clear();
    if (slots.data() == nullptr) return {};
    MF_CHECK(slots.dtype() == DType::f64 && slots.numel() == static_cast<int64_t>(n) && slots.device() == device() &&
                 wanted.size() == n,
             "set_grad_square_sums: ", slots.numel(), " ", dtype_name(slots.dtype()), " slots and ", wanted.size(),
             " flags for ", n, " parameters");
    grad_square_slots_ = slots;
    grad_square_wanted_.assign(n, false);
    for (const Layer& L : layers_)
        for (const BranchState& s : L.branches)
            if (s.spec->kind == BranchKind::moe)
                for (const int64_t spec : {s.gate_up_spec, s.down_spec})
                    grad_square_wanted_[static_cast<size_t>(spec)] = wanted[static_cast<size_t>(spec)];
    return grad_square_wanted_;
}

size_t CausalLM::activation_bytes() const {
    size_t n = ws_->arena.high_water();
    for (const auto& s : ws_->ep_local) n += s ? s->bytes() : 0;
    return n + (ws_->ep_scratch ? ws_->ep_scratch->bytes() : 0);
}

std::string CausalLM::locate_nonfinite_activation() const {
    const Workspace& ws = *ws_;
    if (ws.resid.empty()) return "(no forward pass yet)";
    if (!ops::all_finite(ws.resid[0])) return "the token embeddings";
    for (size_t l = 0; l + 1 < ws.resid.size(); ++l) {
        const auto& branches = layers_[l].branches;
        for (size_t b = 0; b < branches.size(); ++b) {
            const bool last = b + 1 == branches.size();
            if (!last && recompute_ == Recompute::full) continue;  // not kept
            const Tensor& sum = last ? ws.resid[l + 1] : ws.layers[l].branches[b + 1].in;
            if (!ops::all_finite(sum))
                return "layer " + std::to_string(l) + " (" + output_name(branches[b].spec->kind) + ")";
        }
    }
    if (!ops::all_finite(ws.lnf)) return "the final norm";
    return "the loss head (logits / cross-entropy)";
}

std::vector<int32_t> CausalLM::routing(int64_t layer) const {
    MF_CHECK(recompute_ == Recompute::none, "routing(): the layers' routings are kept only without recompute");
    MF_CHECK(layer >= 0 && layer < spec_.num_layers() && layers_[static_cast<size_t>(layer)].is_moe &&
                 static_cast<size_t>(layer) < ws_->layers.size(),
             "routing(): layer ", layer, " is not a MoE layer of the last forward");
    const Tensor& idx = ws_->layers[static_cast<size_t>(layer)].moe.topk_idx;
    std::vector<int32_t> out(static_cast<size_t>(idx.numel()));
    ops::copy_to_host(out.data(), idx);
    return out;
}

void CausalLM::set_routing_replay(int64_t layer, std::vector<int32_t> experts) {
    MF_CHECK(device() == Device::cpu, "set_routing_replay: routing replay runs on the CPU only");
    MF_CHECK(layer >= 0 && layer < spec_.num_layers() && layers_[static_cast<size_t>(layer)].is_moe,
             "set_routing_replay: layer ", layer, " is not a MoE layer");
    MF_CHECK(experts.size() % static_cast<size_t>(spec_.moe(layer)->top_k) == 0, "set_routing_replay: ", experts.size(),
             " experts is not a whole number of top-", spec_.moe(layer)->top_k, " rows");
    layers_[static_cast<size_t>(layer)].replay = std::move(experts);
}

std::string CausalLM::locate_nonfinite_gradient() const {
    for (const auto& s : params().specs())
        if (!ops::all_finite(grad(s.name))) return s.name;
    return "(none)";
}

// --- the activation plan -----------------------------------------------------------------------------

void CausalLM::plan(int64_t B, int64_t T) {
    Workspace& ws = *ws_;
    if (ws.B != B || ws.T != T) {
        // Replay the allocation sequence on a measuring arena, then allocate exactly that much.
        ws.arena = Arena::measuring(device());
        allocate_step(B, T);
        const size_t need = ws.arena.high_water();
        // A batch shape the host cannot hold is named, not left to the allocator's bare byte count.
        const double host = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
        if (device() == Device::cpu && host > 0 && static_cast<double>(need) > host)
            fail("a micro-batch of ", B, " x ", T, " tokens needs ", static_cast<double>(need) / 1073741824.0,
                 " GiB of activations, more than the ", host / 1073741824.0,
                 " GiB of memory of this machine: lower the micro-batch size or the sequence length "
                 "(train.micro_batch / train.seq_len, eval.* or --micro-batch / --seq-len)");
        ws.arena = Arena(need, device());
        ws.B = B;
        ws.T = T;
    }
    ws.arena.reset();
    allocate_step(B, T);
}

void CausalLM::allocate_step(int64_t B, int64_t T) {
    Workspace& ws = *ws_;
    if (ep_ != nullptr && !ws.ep_scratch) ws.ep_scratch = std::make_shared<EpRowStore>();
    const int64_t N = B * T, H = spec_.hidden_size, L = spec_.num_layers();
    const DType act = act_dtype_;
    const bool full = recompute_ == Recompute::full;
    Arena& A = ws.arena;
    ws.ids = A.alloc(DType::i32, {N});
    ws.targets = A.alloc(DType::i32, {N});
    ws.positions = A.alloc(DType::i32, {N});
    ws.doc_ids = A.alloc(DType::i32, {N});
    ws.mask = A.alloc(DType::f32, {N});
    ws.resid.assign(static_cast<size_t>(L + 1), Tensor());
    const int64_t kept_layers = full ? 1 : L;
    ws.layers.assign(static_cast<size_t>(kept_layers), Workspace::LayerActs());
    for (int64_t l = 0; l <= L; ++l) ws.resid[static_cast<size_t>(l)] = A.alloc(act, {N, H});
    // Outputs consumed right away by the residual adds: one per branch position for all layers.
    size_t max_branches = 0;
    for (const Layer& layer : layers_) max_branches = std::max(max_branches, layer.branches.size());
    std::vector<Tensor> outs(max_branches);
    for (auto& o : outs) o = A.alloc(act, {N, H});
    // The branch of the kind at position b that a layer's kept activations must serve: its own, or
    // under full recompute (one set for all layers) the first layer's with that kind there.
    auto serves = [&](int64_t l, size_t b, BranchKind kind) -> const BranchState* {
        for (int64_t j = full ? 0 : l; j < (full ? L : l + 1); ++j) {
            const auto& br = layers_[static_cast<size_t>(j)].branches;
            if (b < br.size() && br[b].spec->kind == kind) return &br[b];
        }
        return nullptr;
    };
    std::vector<const MoeBranch*> moe_specs;
    for (int64_t l = 0; l < L; ++l)
        for (const BranchState& s : layers_[static_cast<size_t>(l)].branches)
            if (s.spec->kind == BranchKind::moe) moe_specs.push_back(&s.spec->moe);
    for (int64_t l = 0; l < kept_layers; ++l) {
        auto& la = ws.layers[static_cast<size_t>(l)];
        const size_t num_branches = full ? max_branches : layers_[static_cast<size_t>(l)].branches.size();
        la.branches.assign(num_branches, Workspace::BranchActs());
        for (size_t b = 0; b < num_branches; ++b) {
            auto& ba = la.branches[b];
            if (b > 0) ba.in = A.alloc(act, {N, H});
            ba.ln = A.alloc(act, {N, H});
            ba.ln_rstd = A.alloc(DType::f32, {N});
            ba.out = outs[b];
            if (const BranchState* s = serves(l, b, BranchKind::attention)) ba.attn.alloc(A, s->ad, B, T, act);
            if (const BranchState* s = serves(l, b, BranchKind::moe)) {
                if (recompute_ == Recompute::none)
                    la.moe.alloc(A, moe_dims(s->spec->moe), N, act, ws.ep_local_store(static_cast<size_t>(l)),
                                 ws.ep_scratch);
                if (s->has_shared) ba.shared.alloc(A, N, H, s->spec->moe, act);
                if (s->spec->moe.latent > 0) ba.latent.alloc(A, N, s->spec->moe.latent, act);
            }
            if (const BranchState* s = serves(l, b, BranchKind::mlp))
                ba.mlp.alloc(A, N, s->spec->mlp.intermediate, act, s->spec->mlp.act);
            if (const BranchState* s = serves(l, b, BranchKind::mamba)) ba.mamba.alloc(A, s->spec->mamba, B, T, act);
        }
    }
    if (recompute_ != Recompute::none && !moe_specs.empty())
        ws.shared_moe.alloc(A, moe_dims(*moe_specs[0]), N, act, ws.ep_local_store(0), ws.ep_scratch);
    ws.lnf = A.alloc(act, {N, H});
    ws.lnf_rstd = A.alloc(DType::f32, {N});
    ws.losses = A.alloc(DType::f32, {N});
    ws.d_resid = A.alloc(act, {N, H});
    ws.d_mid = A.alloc(act, {N, H});
    ws.d_ln = A.alloc(act, {N, H});
    // Backward scratch: one of each kind, sized for the largest branch of that kind.
    const BranchState *attn = nullptr, *mlp = nullptr, *shared = nullptr, *mamba = nullptr;
    for (const Layer& layer : layers_)
        for (const BranchState& s : layer.branches) {
            if (s.spec->kind == BranchKind::attention && attn == nullptr) attn = &s;
            if (s.spec->kind == BranchKind::mlp &&
                (mlp == nullptr || s.spec->mlp.intermediate > mlp->spec->mlp.intermediate))
                mlp = &s;
            if (s.has_shared && shared == nullptr) shared = &s;
            if (s.spec->kind == BranchKind::mamba && mamba == nullptr) mamba = &s;  // one geometry per model
        }
    if (attn != nullptr) ws.attn_scratch.alloc(A, attn->ad, B, T, act);
    if (!moe_specs.empty()) {
        const int64_t E = moe_specs[0]->num_experts;
        ws.aux_counts = A.alloc(DType::f32, {E});
        ws.aux_prob_sums = A.alloc(DType::f32, {E});
        ws.dprobs = A.alloc(DType::f32, {N, E});
        ws.moe_scratch.alloc(A, moe_dims(*moe_specs[0]), N, act, ws.ep_scratch);
    }
    if (mlp != nullptr) ws.mlp_scratch.alloc(A, N, mlp->spec->mlp.intermediate, act, mlp->spec->mlp.act);
    if (shared != nullptr) ws.shared_scratch.alloc(A, N, H, shared->spec->moe, act);
    if (mamba != nullptr) ws.mamba_scratch.alloc(A, mamba->spec->mamba, N, act);
    if (!moe_specs.empty() && moe_specs[0]->latent > 0) ws.latent_scratch.alloc(A, N, moe_specs[0]->latent, act);
}

Recompute parse_recompute(std::string_view name) {
    if (name == "none") return Recompute::none;
    if (name == "moe") return Recompute::moe;
    if (name == "full") return Recompute::full;
    fail("unknown recompute mode \"", name, "\" (none, moe, full)");
}

void CausalLM::set_embedding_row_gather(RowGather gather, int ranks) {
    MF_CHECK(!gather || !spec_.tie_word_embeddings,
             "set_embedding_row_gather: tied embeddings take the head's dense gradient; reduce them instead");
    MF_CHECK(ranks >= 1, "set_embedding_row_gather: ranks=", ranks);
    row_gather_ = std::move(gather);
    row_gather_ranks_ = row_gather_ ? ranks : 1;
}

void CausalLM::set_expert_parallel(parallel::Communicator* ep_group, int64_t chunks) {
    MF_CHECK(chunks >= 1, "expert parallelism: ", chunks, " pipeline chunks (need at least 1)");
    const ExpertShard& sh = expert_shard();
    const int64_t size = ep_group != nullptr ? ep_group->size() : 1, rank = ep_group != nullptr ? ep_group->rank() : 0;
    if (size != sh.size || rank != sh.rank)
        fail("expert parallelism: the model holds expert shard ", sh.rank, " of ", sh.size, ", the EP group is rank ",
             rank, " of ", size);
    ep_ = size > 1 ? ep_group : nullptr;
    ep_chunks_ = chunks;
    ws_->B = -1;  // the activation plan changes
}

void CausalLM::set_recompute(Recompute r) {
    recompute_ = r;
    ws_->B = -1;  // the activation plan changes
}

// --- forward -------------------------------------------------------------------------------------------

void CausalLM::branch_forward(int64_t l, size_t b, int64_t B, int64_t T) {
    Workspace& ws = *ws_;
    const BranchState& s = layers_[static_cast<size_t>(l)].branches[b];
    auto& la = ws.acts(l, recompute_);
    auto& ba = la.branches[b];
    const size_t num_branches = layers_[static_cast<size_t>(l)].branches.size();
    const Tensor& in = b == 0 ? ws.resid[static_cast<size_t>(l)] : ba.in;
    const Tensor& sum = b + 1 == num_branches ? ws.resid[static_cast<size_t>(l + 1)] : la.branches[b + 1].in;
    ops::rmsnorm_forward(ba.ln, ba.ln_rstd, in, s.norm, static_cast<float>(s.spec->norm_eps));
    switch (s.spec->kind) {
        case BranchKind::attention:
            attention_block_forward(ba.out, ba.attn, ba.ln, s.attn, s.ad, B, T, ws.positions, ws.attention_docs());
            break;
        case BranchKind::mlp:
            mlp_block_forward(ba.out, ba.mlp, ba.ln, s.mlp);
            break;
        case BranchKind::moe: {
            MoeDims md = moe_dims(s.spec->moe);
            const std::vector<int32_t>& replay = layers_[static_cast<size_t>(l)].replay;
            if (!replay.empty()) md.replay = &replay;
            routed_moe_forward(ba.out, ws.moe_acts(l, recompute_), ba.latent, ba.ln, s.moe, md);
        }
            if (s.has_shared) shared_expert_forward(ba.out, ba.shared, ba.ln, s.shared);
            break;
        case BranchKind::mamba:
            mamba_block_forward(ba.out, ba.mamba, ba.ln, s.mamba, s.spec->mamba, T, ws.attention_docs());
            break;
    }
    ops::add(sum, in, ba.out);
    mark_layer("fwd", s.spec->kind, l);
}

void CausalLM::layer_forward(int64_t l, int64_t B, int64_t T) {
    store_.settle_stage(l);
    for (size_t b = 0; b < layers_[static_cast<size_t>(l)].branches.size(); ++b) branch_forward(l, b, B, T);
}

void CausalLM::validate(const data::Batch& b) const {
    const size_t n = static_cast<size_t>(b.B * b.T);
    MF_CHECK(b.B > 0 && b.T > 0, "empty batch");
    MF_CHECK(b.input_ids.size() == n && b.targets.size() == n && b.positions.size() == n && b.doc_ids.size() == n &&
                 b.is_pad.size() == n,
             "batch arrays do not match B·T = ", n);
    const int64_t V = spec_.vocab_size;
    for (size_t i = 0; i < n; ++i) {
        if (b.input_ids[i] < 0 || b.input_ids[i] >= V)
            fail("token id ", b.input_ids[i], " at position ", i, " is outside the vocabulary [0, ", V, ")");
        if (b.targets[i] != data::kIgnoreIndex && (b.targets[i] < 0 || b.targets[i] >= V))
            fail("label ", b.targets[i], " at position ", i, " is outside the vocabulary [0, ", V, ") and is not -100");
        if (b.positions[i] < 0) fail("negative position at ", i);
    }
}

// --- backward ------------------------------------------------------------------------------------------

void CausalLM::branch_backward(int64_t l, size_t b, int64_t B, int64_t T, const Tensor& dx, const Tensor& dy,
                               bool aux_grad) {
    // sum = in + op(rmsnorm(in)):  dx = dy + rmsnorm_backward(op_backward(dy)).
    Workspace& ws = *ws_;
    const BranchState& s = layers_[static_cast<size_t>(l)].branches[b];
    auto& ba = ws.acts(l, recompute_).branches[b];
    const Tensor& in = b == 0 ? ws.resid[static_cast<size_t>(l)] : ba.in;
    ops::copy(dx, dy);
    ops::zero(ws.d_ln);
    switch (s.spec->kind) {
        case BranchKind::attention:
            attention_block_backward(ws.d_ln, s.g_attn, ws.attn_scratch, dy, ba.ln, ba.attn, s.attn, s.ad, B, T,
                                     ws.positions, ws.attention_docs());
            break;
        case BranchKind::mlp:
            mlp_block_backward(ws.d_ln, s.g_mlp, ws.mlp_scratch, dy, ba.ln, ba.mlp, s.mlp);
            break;
        case BranchKind::moe: {
            const MoeDims md = moe_dims(s.spec->moe);
            const bool latent = s.spec->moe.latent > 0;
            if (recompute_ == Recompute::moe)
                moe_block_forward(latent ? ba.latent.y : ba.out, ws.shared_moe, ba.ln, s.moe, md,
                                  latent ? ba.latent.x : Tensor());
            const LatentActs& dl = ws.latent_scratch;
            if (latent) {
                ops::matmul_backward(dl.y, s.g_moe.fc2, dy, ba.latent.y, s.moe.fc2, false);
                ops::zero(dl.x);
            }
            // Written rather than added where zero_grads() left them undefined.
            const bool marked = store_.expert_marked(l);
            ExpertGradSquares squares;
            for (auto [spec, slot] :
                 {std::pair{s.gate_up_spec, &squares.gate_up}, std::pair{s.down_spec, &squares.down}})
                if (!grad_square_wanted_.empty() && grad_square_wanted_[static_cast<size_t>(spec)]) {
                    *slot = Tensor(static_cast<double*>(grad_square_slots_.data()) + spec, DType::f64, {1},
                                   grad_square_slots_.device());
                    ops::zero(*slot);
                }
            moe_block_backward(ws.d_ln, s.g_moe, ws.moe_scratch, latent ? dl.y : dy, aux_grad ? ws.dprobs : Tensor(),
                               ba.ln, ws.moe_acts(l, recompute_), s.moe, md, !marked, squares,
                               latent ? ba.latent.x : Tensor(), latent ? dl.x : Tensor());
            if (latent) ops::matmul_backward(ws.d_ln, s.g_moe.fc1, dl.x, ba.ln, s.moe.fc1);
            if (marked) store_.take_expert_mark(l);
            if (s.has_shared)
                shared_expert_backward(ws.d_ln, s.g_shared, ws.shared_scratch, dy, ba.ln, ba.shared, s.shared);
            break;
        }
        case BranchKind::mamba:
            mamba_block_backward(ws.d_ln, s.g_mamba, ws.mamba_scratch, dy, ba.ln, ba.mamba, s.mamba, s.spec->mamba, T,
                                 ws.attention_docs());
            break;
    }
    ops::rmsnorm_backward(dx, s.g_norm, ws.d_ln, in, s.norm, ba.ln_rstd);
    mark_layer("bwd", s.spec->kind, l);
}

// --- the step ------------------------------------------------------------------------------------------

void CausalLM::zero_padding_rows(const data::Batch& batch, const Tensor& d_embed) const {
    // The rows of tokens equal to padding_idx take no part in the embedding gradient (HF's
    // nn.Embedding(padding_idx)): their output-gradient rows are cleared, one run of them at a time.
    if (spec_.padding_idx < 0) return;
    const auto& ids = batch.input_ids;
    const int32_t pad = static_cast<int32_t>(spec_.padding_idx);
    for (size_t i = 0; i < ids.size();) {
        if (ids[i] != pad) {
            ++i;
            continue;
        }
        size_t j = i;
        while (j < ids.size() && ids[j] == pad) ++j;
        ops::zero(d_embed.slice_rows(static_cast<int64_t>(i), static_cast<int64_t>(j)));
        i = j;
    }
}

StepStats CausalLM::step(const data::Batch& batch, const LossScales* scales, float* logits) {
    validate(batch);
    if (expert_shard().sharded() && ep_ == nullptr)
        fail("this model holds expert shard ", expert_shard().rank, " of ", expert_shard().size,
             "; set its EP group (set_expert_parallel) before step()");
    const int64_t B = batch.B, T = batch.T, N = B * T, H = spec_.hidden_size, L = spec_.num_layers();
    plan(B, T);
    Workspace& ws = *ws_;
    // Not param(): that would wait for every pending parameter write before the forward; each stage
    // waits for its own right before its first op (settle_stage).
    const ParamTable& table = params();
    const ParamSpec& wte_spec = *table.find_role(ParamRole::embedding);
    const ParamSpec* head_role = table.find_role(ParamRole::head);
    const std::string& head_name = head_role != nullptr ? head_role->name : wte_spec.name;
    const Tensor wte = store_.param_view(wte_spec.name);
    const Tensor head = store_.param_view(head_name);
    const std::string normf_name = spec_.final_norm_module + ".weight";
    const Tensor normf = store_.param_view(normf_name);

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
    store_.settle_stage(kStageEmbedding);
    ops::embedding_forward(ws.resid[0], ws.ids, wte);
    int64_t num_moe_layers = 0;
    const int64_t E = spec_.num_experts();
    if (E > 0) {
        ops::zero(ws.aux_counts);
        ops::zero(ws.aux_prob_sums);
    }
    for (int64_t l = 0; l < L; ++l) {
        layer_forward(l, B, T);
        if (layers_[static_cast<size_t>(l)].is_moe && spec_.moe(l)->router == RouterKind::softmax) {
            const MoeActs& ma = ws.moe_acts(l, recompute_);
            ops::moe_aux_stats(ws.aux_counts, ws.aux_prob_sums, ma.topk_idx, ma.probs, ws.mask);
            ++num_moe_layers;
        }
    }
    const Tensor& x_final = ws.resid.back();
    store_.settle_stage(kStageHead);
    ops::rmsnorm_forward(ws.lnf, ws.lnf_rstd, x_final, normf, static_cast<float>(spec_.final_norm_eps));
    if (logits != nullptr) {
        MF_CHECK(device() == Device::cpu, "logits output is for CPU models");
        ops::matmul_forward(Tensor(logits, DType::f32, {N, spec_.vocab_size}), ws.lnf, head);
    }

    // Loss head: CE over counted targets (and, with scales, dL/d lnf and the head's weight grad).
    // The gradients are first touched here (a background zero_grads ran beside the forward).
    store_.settle_grads();
    if (scales != nullptr) ops::zero(ws.d_ln);
    // The bf16 policy on the GPU (bf16 gradients) rounds the logits to bf16, as a bf16 HF model's are.
    const DType logits_dtype = device() == Device::cuda && grad_dtype() == DType::bf16 ? DType::bf16 : DType::f32;
    ops::lm_head_cross_entropy(ws.losses, scales ? ws.d_ln : Tensor(), scales ? grad(head_name) : Tensor(), ws.lnf,
                               head, ws.targets, scales ? static_cast<float>(scales->ce) : 0.0f, logits_dtype);
    ops::phase_mark("fwd head");
    StepStats stats;
    stats.ce_sum = ops::sum(ws.losses);
    stats.num_targets = batch.num_targets();

    // Aux loss over all MoE layers together (HF's load_balancing_loss_func, padding excluded).
    const double rows = rows_per_layer * static_cast<double>(num_moe_layers);
    std::vector<float> counts(static_cast<size_t>(E)), prob_sums(static_cast<size_t>(E));
    if (num_moe_layers > 0 && rows > 0) {
        ops::copy_to_host(counts.data(), ws.aux_counts);
        ops::copy_to_host(prob_sums.data(), ws.aux_prob_sums);
        double s = 0;
        for (int64_t e = 0; e < E; ++e)
            s += static_cast<double>(counts[static_cast<size_t>(e)]) * prob_sums[static_cast<size_t>(e)];
        stats.aux = static_cast<double>(E) * s / (rows * rows);
    }
    if (scales == nullptr) return stats;

    // --- backward ----------------------------------------------------------------------------------
    // d aux / d probs[t, e] = E · C_e / R² for every counted row t of every MoE layer.
    const bool aux_grad = num_moe_layers > 0 && rows > 0 && scales->aux != 0.0;
    if (aux_grad)
        ops::moe_aux_dprobs(ws.dprobs, ws.aux_counts, ws.mask,
                            static_cast<float>(scales->aux * static_cast<double>(E) / (rows * rows)));
    // The gradient of the residual stream alternates between two buffers, one swap per branch.
    const Tensor* dy = &ws.d_resid;
    const Tensor* dx = &ws.d_mid;
    ops::zero(*dy);
    ops::rmsnorm_backward(*dy, grad(normf_name), ws.d_ln, x_final, normf, ws.lnf_rstd);
    if (grad_hook_ && !spec_.tie_word_embeddings) grad_hook_(kGradsHead);
    for (int64_t l = L - 1; l >= 0; --l) {
        // Recompute what was not kept: the whole layer (full); the MoE block (moe) inside its backward.
        if (recompute_ == Recompute::full) layer_forward(l, B, T);
        for (size_t b = layers_[static_cast<size_t>(l)].branches.size(); b-- > 0;) {
            branch_backward(l, b, B, T, *dx, *dy, aux_grad);
            std::swap(dx, dy);
        }
        if (grad_hook_) grad_hook_(l);
    }
    const Tensor& d_embed = *dy;
    zero_padding_rows(batch, d_embed);
    if (row_gather_) {
        const int64_t all = row_gather_ranks_ * N;
        const size_t id_bytes = (static_cast<size_t>(all) * sizeof(int32_t) + 255) / 256 * 256;
        const size_t bytes = id_bytes + static_cast<size_t>(all * H) * dtype_size(d_embed.dtype());
        if (gathered_rows_.nbytes() < bytes) gathered_rows_ = Buffer(bytes, device());
        const Tensor ids = gathered_rows_.as(DType::i32, {all});
        const Tensor rows_t = gathered_rows_.as(d_embed.dtype(), {all, H}, id_bytes);
        row_gather_(ids, ws.ids);
        row_gather_(rows_t, d_embed);
        ops::embedding_backward(grad(wte_spec.name), rows_t, ids);
    } else {
        ops::embedding_backward(grad(wte_spec.name), d_embed, ws.ids);
    }
    if (grad_hook_) grad_hook_(spec_.tie_word_embeddings ? kGradsEmbeddingAndHead : kGradsEmbedding);
    ops::phase_mark("bwd embedding");
    return stats;
}

}  // namespace mf::model
