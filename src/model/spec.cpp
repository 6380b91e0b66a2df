#include "model/spec.h"

#include "core/check.h"

namespace mf::model {

const Branch* LayerSpec::find(BranchKind kind) const {
    for (const Branch& b : branches)
        if (b.kind == kind) return &b;
    return nullptr;
}

std::string describe_branch(const Branch& b) {
    auto n = [](int64_t v) { return std::to_string(v); };
    switch (b.kind) {
        case BranchKind::attention: {
            const AttentionBranch& a = b.attention;
            std::string s =
                "attention (" + n(a.num_heads) + " q heads, " + n(a.num_kv_heads) + " kv heads, dim " + n(a.head_dim);
            if (a.qk_norm == QkNorm::per_head) s += ", qk-norm";
            if (a.qk_norm == QkNorm::full_width) s += ", full-width qk-norm";
            if (a.qkv_bias) s += ", qkv bias";
            if (a.o_bias) s += ", o bias";
            if (a.rotary_dim == a.head_dim)
                s += ", rope";
            else if (a.rotary_dim > 0)
                s += ", rope on " + n(a.rotary_dim) + " dims";
            return s + ")";
        }
        case BranchKind::mlp:
            return "dense mlp (dim " + n(b.mlp.intermediate) +
                   (b.mlp.act == Activation::swiglu ? "" : std::string(", ") + activation_name(b.mlp.act)) + ")";
        case BranchKind::moe: {
            const MoeBranch& m = b.moe;
            std::string s = "moe (" + n(m.num_experts) + " experts, ";
            if (m.router == RouterKind::sigmoid) {
                s += "sigmoid router";
                if (m.n_group > 1) s += " keeping " + n(m.topk_group) + " of " + n(m.n_group) + " groups";
                s += ", ";
            }
            s += "top-" + n(m.top_k) + (m.norm_topk_prob ? " renormalised" : "");
            if (m.routed_scaling != 1.0) s += " x" + json::Value(m.routed_scaling).dump();
            s += std::string(", expert dim ") + n(m.intermediate);
            if (m.act != Activation::swiglu) s += std::string(" ") + activation_name(m.act);
            if (m.shared_intermediate > 0)
                s += std::string(", shared expert dim ") + n(m.shared_intermediate) + (m.shared_gate ? " gated" : "");
            return s + ")";
        }
        case BranchKind::mamba: {
            const MambaBranch& m = b.mamba;
            return "mamba-2 (" + n(m.num_heads) + " heads of dim " + n(m.head_dim) + ", " + n(m.num_groups) +
                   " groups, state " + n(m.state_size) + ", conv " + n(m.conv_kernel) + ")";
        }
    }
    return "?";
}

const char* activation_name(Activation act) { return act == Activation::swiglu ? "swiglu" : "relu2"; }

const MoeBranch* ModelSpec::moe(int64_t l) const {
    const Branch* b = layers[static_cast<size_t>(l)].find(BranchKind::moe);
    return b != nullptr ? &b->moe : nullptr;
}

int64_t ModelSpec::num_experts() const {
    for (int64_t l = 0; l < num_layers(); ++l)
        if (const MoeBranch* m = moe(l)) return m->num_experts;
    return 0;
}

namespace {
// A copy whose top level can change without touching `config` (json::Value copies share their object).
json::Value own_copy(const json::Value& config) { return json::Value(json::Value::Object(config.as_object())); }
}  // namespace

json::Value ModelSpec::to_json() const {
    json::Value c = own_copy(config);
    c.set("dtype", dtype);
    return c;
}

uint64_t ModelSpec::hash() const {
    // FNV-1a over the canonical config (dtype blanked: storage, not shape).
    json::Value c = own_copy(config);
    c.set("dtype", "");
    const std::string s = c.dump(-1, json::NonFinite::bare);  // Infinity and NaN hash apart (null would not)
    uint64_t h = 1469598103934665603ull;
    for (unsigned char ch : s) {
        h ^= ch;
        h *= 1099511628211ull;
    }
    return h;
}

void ModelSpec::validate(const std::string& source) const {
    MF_CHECK(vocab_size > 0 && hidden_size > 0 && !layers.empty(), source, ": empty model");
    int64_t experts = -1;
    for (int64_t l = 0; l < num_layers(); ++l) {
        const LayerSpec& layer = layers[static_cast<size_t>(l)];
        MF_CHECK(!layer.branches.empty(), source, ": layer ", l, " has no branch");
        int moe_branches = 0;
        for (const Branch& b : layer.branches) {
            MF_CHECK(!b.norm.empty() && !b.module.empty(), source, ": layer ", l, ": a branch without module names");
            if (b.kind == BranchKind::attention) {
                const AttentionBranch& a = b.attention;
                MF_CHECK(a.num_heads > 0 && a.num_kv_heads > 0 && a.num_heads % a.num_kv_heads == 0 && a.head_dim > 0,
                         source, ": layer ", l, ": attention heads ", a.num_heads, "/", a.num_kv_heads, " of dim ",
                         a.head_dim);
                MF_CHECK(a.rotary_dim >= 0 && a.rotary_dim <= a.head_dim && a.rotary_dim % 2 == 0, source, ": layer ",
                         l, ": rotary dims ", a.rotary_dim, " of head_dim ", a.head_dim);
            } else if (b.kind == BranchKind::mlp) {
                MF_CHECK(b.mlp.intermediate > 0, source, ": layer ", l, ": dense MLP without width");
            } else if (b.kind == BranchKind::mamba) {
                const MambaBranch& m = b.mamba;
                MF_CHECK(m.num_heads > 0 && m.head_dim > 0 && m.num_groups > 0 && m.num_heads % m.num_groups == 0 &&
                             m.state_size > 0 && m.conv_kernel > 0 && m.chunk_size > 0,
                         source, ": layer ", l, ": Mamba-2 with ", m.num_heads, " heads of dim ", m.head_dim, ", ",
                         m.num_groups, " groups, state ", m.state_size, ", conv ", m.conv_kernel, ", chunk ",
                         m.chunk_size);
            } else {
                const MoeBranch& m = b.moe;
                ++moe_branches;
                MF_CHECK(m.num_experts > 0 && m.top_k > 0 && m.top_k <= m.num_experts && m.intermediate > 0, source,
                         ": layer ", l, ": MoE with ", m.num_experts, " experts, top-", m.top_k, ", width ",
                         m.intermediate);
                MF_CHECK(experts < 0 || experts == m.num_experts, source, ": MoE layers with different expert counts");
                MF_CHECK(!m.shared_gate || m.shared_intermediate > 0, source,
                         ": a shared-expert gate without a shared expert");
                MF_CHECK(m.router == RouterKind::sigmoid || (m.n_group == 1 && m.topk_group == 1), source, ": layer ",
                         l, ": expert groups need the sigmoid router");
                MF_CHECK(m.n_group >= 1 && m.num_experts % m.n_group == 0 && m.topk_group >= 1 &&
                             m.topk_group <= m.n_group && m.top_k <= m.topk_group * (m.num_experts / m.n_group),
                         source, ": layer ", l, ": top-", m.top_k, " of ", m.num_experts, " experts in ", m.n_group,
                         " groups keeping ", m.topk_group);
                experts = m.num_experts;
            }
        }
        MF_CHECK(moe_branches <= 1, source, ": layer ", l, " has more than one MoE branch");
    }
}

}  // namespace mf::model
