"""`import moeforge.hf` on transformers' own models (the GPU machine has torch 2.11 and transformers
5.17; elsewhere these skip, saying so): the experts of a tiny Qwen3-MoE run on moeforge and give
stock's loss and gradients (fp32 on the CPU tightly, bf16 on the GPU within bf16 rounding); the
default, an explicit choice and disable(); EP sentinels; opcheck; torch.compile(fullgraph=True); a
non-default stream; each family's RMSNorm against its stock forward; the fused loss."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="moeforge.hf needs torch")
transformers = pytest.importorskip("transformers", reason="moeforge.hf needs transformers")

import moeforge  # noqa: E402
import moeforge.hf as mhf  # noqa: E402

CUDA = torch.cuda.is_available() and moeforge.ops.has_cuda()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device (or moeforge built without CUDA)")


def tiny_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, max_position_embeddings=64, router_aux_loss_coef=0.0)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def make_model(experts_implementation=None, seed=0, **overrides):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    return Qwen3MoeForCausalLM._from_config(tiny_config(**overrides), **kwargs)


def use(model, impl):
    setter = getattr(model, "set_experts_implementation", None)
    if callable(setter):
        setter(impl)
    else:
        model.config._experts_implementation = impl
    assert model.config._experts_implementation == impl


def loss_and_grads(model, ids, labels=None, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids if labels is None else labels, **inputs)
    out.loss.backward()
    return out.loss.detach().double().item(), {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()
                                                if p.grad is not None}


def rel_l2(a, b):
    return float((a - b).norm() / max(b.norm(), 1e-30))


def compare_impls(model, ids, stock, loss_rtol, grad_rel, **inputs):
    """The model all stock (its experts on `stock`, its sparse MoE blocks, RMSNorms and input embedding
    transformers' own) against all on moeforge (experts, blocks, RMSNorms and embedding)."""
    mhf._fuse_blocks(model, fuse=False)
    classes = {type(m) for m in model.modules()}
    mhf._unpatch_norms()
    emb = model.get_input_embeddings()
    emb_class, emb.__class__ = type(emb), torch.nn.Embedding
    try:
        use(model, stock)
        ref_loss, ref_grads = loss_and_grads(model, ids, **inputs)
    finally:
        mhf._patch_norms(classes)
        mhf._fuse_blocks(model)
        emb.__class__ = emb_class
    assert any(type(m).forward is mhf._norm_forward for m in model.modules()), "no RMSNorm on moeforge"
    use(model, mhf.IMPLEMENTATION)
    loss, grads = loss_and_grads(model, ids, **inputs)
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    experts = [n for n in grads if "experts" in n]
    assert experts, "the model has no experts parameters: the test would check nothing"
    for n in grads:
        assert rel_l2(grads[n], ref_grads[n]) <= grad_rel, (n, rel_l2(grads[n], ref_grads[n]))
    return loss


def test_the_import_makes_moeforge_the_default_and_an_explicit_choice_wins():
    assert mhf.is_enabled()
    assert make_model().config._experts_implementation == "moeforge"
    assert make_model("eager").config._experts_implementation == "eager"
    mhf.disable()
    try:
        stock = make_model()
        assert stock.config._experts_implementation != "moeforge"
        assert type(stock.model.norm).forward is not mhf._norm_forward and not mhf.status(stock)["rms_norm"]
        assert type(stock.get_input_embeddings()) is torch.nn.Embedding and not mhf.status(stock)["embedding"]
    finally:
        mhf.enable()
    model = make_model()
    assert model.config._experts_implementation == "moeforge"
    assert type(model.model.norm).forward is mhf._norm_forward
    assert mhf.status(model)["embedding"]


def test_status_names_the_experts_modules():
    s = mhf.status(make_model())
    assert s["patched"] and s["experts_implementation"] == "moeforge"
    (name, entry), = s["modules"].items()
    assert "Experts" in name and entry["count"] == 1 and entry["moeforge"] and entry["reason"] is None
    assert s["rms_norm"] == ["Qwen3MoeRMSNorm"]


def test_cpu_fp32_equals_stock_eager():
    model = make_model()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    compare_impls(model, ids, "eager", 1e-6, 1e-5)


def test_ep_sentinels_contribute_nothing():
    model = make_model()
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    g = torch.Generator().manual_seed(2)
    T, K, E = 10, 2, experts.gate_up_proj.shape[0]
    hidden = torch.randn(T, 64, generator=g, requires_grad=True)
    index = torch.randint(0, E, (T, K), generator=g)
    index[::3, 1] = E  # another rank's expert
    index[5, 0] = E + 3
    weights = torch.rand(T, K, generator=g, requires_grad=True)
    out = mhf.experts_forward(experts, hidden, index, weights)
    valid = (index < E).float()
    ref = torch.zeros(T, 64, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            if index[t, k] < E:
                e = int(index[t, k])
                h = experts.gate_up_proj[e].double() @ hidden[t].double()
                gate, up = h.chunk(2)
                ref[t] += weights[t, k].double() * (experts.down_proj[e].double() @ (torch.nn.functional.silu(gate) * up))
    np.testing.assert_allclose(out.detach().double().numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert torch.all(weights.grad[valid == 0] == 0), "a sentinel's weight got a gradient"


# (activation, transposed, biases): the layouts moeforge::experts serves.
LAYOUTS = [("swiglu", False, False), ("clamped_swiglu", True, True), ("relu2", False, False),
           ("relu2", True, True), ("swiglu", True, False), ("swiglu", False, True)]


def op_args(device, dtype, T=12, K=2, E=5, H=64, I=32, seed=3, activation="swiglu", transposed=False, biases=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(device, dtype).requires_grad_()
    index = torch.randint(0, E - 2, (T, K), generator=g, dtype=torch.int32).to(device)  # expert E - 2 gets none
    index[0] = torch.tensor([E - 1, E - 1], dtype=torch.int32)  # both picks of a token on one expert
    weights = torch.rand(T, K, generator=g).to(device).requires_grad_()
    P = I if activation == "relu2" else 2 * I

    def param(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(device, dtype).requires_grad_()

    w_up = param(E, H, P) if transposed else param(E, P, H)
    w_down = param(E, I, H) if transposed else param(E, H, I)
    b_up, b_down = (param(E, P), param(E, H)) if biases else (None, None)
    alpha, limit = (1.702, 7.0) if activation == "clamped_swiglu" else (0.0, 0.0)
    return hidden, index, weights, w_up, w_down, b_up, b_down, activation, alpha, limit, transposed


def experts_reference(hidden, index, weights, w_up, w_down, b_up, b_down, activation, alpha, limit, transposed):
    """The experts' output in float64, one (token, pick) at a time."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    d = lambda t: t.double().cpu()  # noqa: E731  (float64 inputs keep their autograd graph)
    for t in range(hidden.shape[0]):
        for k in range(index.shape[1]):
            e = int(index[t, k])
            up = d(w_up[e]).T if transposed else d(w_up[e])
            down = d(w_down[e]).T if transposed else d(w_down[e])
            h = up @ d(hidden[t]) + (d(b_up[e]) if b_up is not None else 0)
            if activation == "swiglu":
                gate, u = h.chunk(2)
                a = torch.nn.functional.silu(gate) * u
            elif activation == "clamped_swiglu":
                gate, u = h[::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
                a = (u + 1) * gate * torch.sigmoid(alpha * gate)
            else:
                a = torch.relu(h) ** 2
            out[t] += d(weights[t, k]) * (down @ a + (d(b_down[e]) if b_down is not None else 0))
    return out


@pytest.mark.parametrize("activation,transposed,biases", LAYOUTS)
def test_experts_op_layouts_against_float64(activation, transposed, biases):
    """Every served layout on the CPU in fp32 against the per-pick float64 loop, and its gradients
    against float64 autograd through that loop (expert E - 2 gets no rows: its gradients are zeros)."""
    args = op_args("cpu", torch.float32, activation=activation, transposed=transposed, biases=biases)
    out = torch.ops.moeforge.experts(*args)[0]
    with torch.no_grad():
        ref = experts_reference(*args)
    np.testing.assert_allclose(out.detach().double().numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    got = torch.autograd.grad(out, tensors, dout)
    ref_inputs = [a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
                  for a in args]
    ref_out = experts_reference(*ref_inputs)
    want = torch.autograd.grad(ref_out, [a for a in ref_inputs if isinstance(a, torch.Tensor) and a.requires_grad],
                               dout.double())
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.double().numpy(), w.numpy(), rtol=1e-4, atol=1e-5)
    E = args[3].shape[0]
    for g in got[2:]:  # d w_up, d w_down (and the biases'): [E, ...]
        assert torch.all(g[E - 2] == 0), "the expert without rows got a gradient"


@pytest.mark.parametrize("activation,transposed,biases", LAYOUTS[:4])
def test_opcheck_cpu(activation, transposed, biases):
    torch.library.opcheck(torch.ops.moeforge.experts.default,
                          op_args("cpu", torch.float32, activation=activation, transposed=transposed, biases=biases))


@needs_cuda
@pytest.mark.parametrize("activation,transposed,biases", LAYOUTS[:4])
def test_opcheck_cuda(activation, transposed, biases):
    torch.library.opcheck(torch.ops.moeforge.experts.default,
                          op_args("cuda", torch.bfloat16, activation=activation, transposed=transposed, biases=biases))


@needs_cuda
def test_cuda_bf16_equals_stock_grouped_mm():
    model = make_model().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(4)).cuda()
    compare_impls(model, ids, "grouped_mm", 2e-2, 3e-2)


# Tiny models of the other families moeforge::experts serves: gpt-oss (interleaved clamped SwiGLU,
# transposed weights, biases) and Nemotron-H (non-gated relu² experts; MoE and attention layers only).
def make_family(name, seed=0):
    torch.manual_seed(seed)
    if name == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM
        config = GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                              num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], router_aux_loss_coef=0.0)
        return GptOssForCausalLM._from_config(config, attn_implementation="eager")
    from transformers import NemotronHConfig, NemotronHForCausalLM
    config = NemotronHConfig(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             hybrid_override_pattern="E*E", n_routed_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_shared_experts=1,
                             n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                             mlp_hidden_act="relu2", max_position_embeddings=64, tie_word_embeddings=False)
    return NemotronHForCausalLM._from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("family", ["gpt_oss", "nemotron_h"])
def test_family_served_and_cpu_fp32_equals_stock_eager(family):
    model = make_family(family)
    s = mhf.status(model)
    assert s["modules"] and all(e["moeforge"] for e in s["modules"].values()), s
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    compare_impls(model, ids, "eager", 1e-6, 1e-5)


@needs_cuda
@pytest.mark.parametrize("family", ["gpt_oss", "nemotron_h"])
def test_family_cuda_bf16_equals_stock_grouped_mm(family):
    model = make_family(family).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(4)).cuda()
    compare_impls(model, ids, "grouped_mm", 2e-2, 3e-2)


@needs_cuda
def test_cuda_runs_on_the_current_stream():
    """The inputs are written on a side stream after a long sleep there; the op, called on that
    stream, must wait for them: work queued on any other stream would read them unwritten."""
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in op_args("cuda", torch.bfloat16)]
    ref = torch.ops.moeforge.experts(*args)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        late = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = torch.ops.moeforge.experts(*late)[0]
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@needs_cuda
def test_compile_fullgraph_matches_eager():
    model = make_model().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(5)).cuda()
    eager_loss, eager_grads = loss_and_grads(model, ids)
    compiled = copy.deepcopy(model)
    fn = torch.compile(compiled, fullgraph=True)
    compiled.zero_grad(set_to_none=True)
    out = fn(input_ids=ids, labels=ids)
    out.loss.backward()
    assert abs(out.loss.item() - eager_loss) <= 2e-2 * abs(eager_loss)
    for n, p in compiled.named_parameters():
        if p.grad is not None:
            assert rel_l2(p.grad.double().cpu(), eager_grads[n]) <= 3e-2, n


# The RMSNorm classes moeforge.hf patches, and the family whose modeling module holds each.
NORM_FAMILIES = {"Qwen3MoeRMSNorm": "qwen3_moe", "Qwen2MoeRMSNorm": "qwen2_moe", "MixtralRMSNorm": "mixtral",
                 "OlmoeRMSNorm": "olmoe", "DeepseekV3RMSNorm": "deepseek_v3", "Glm4MoeRMSNorm": "glm4_moe",
                 "GptOssRMSNorm": "gpt_oss", "NemotronHRMSNorm": "nemotron_h"}


def test_the_patched_norm_classes_are_these():
    assert set(mhf.NORM_CLASSES) == set(NORM_FAMILIES)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(NORM_FAMILIES))
def test_rms_norm_equals_each_familys_stock_forward(name, device):
    """Each patched class (it must exist in this transformers) against its own stock forward: the
    output and the gradients of the input and the weight."""
    import importlib

    if device == "cuda" and not CUDA:
        pytest.skip("no CUDA device (or moeforge built without CUDA)")
    family = NORM_FAMILIES[name]
    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    mhf._patch_norms([cls])
    assert cls.forward is mhf._norm_forward
    stock = mhf._stock_norm_forwards[cls]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(8)
    m = cls(48, eps=1e-5).to(device, dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(48, generator=g) * 0.5 + 1)
    x = (torch.randn(3, 5, 48, generator=g) * 2).to(device, dtype).requires_grad_()
    dy = torch.randn(3, 5, 48, generator=g).to(device, dtype)
    results = []
    for forward in (stock, cls.forward):
        x.grad, m.weight.grad = None, None
        y = forward(m, x)
        assert y.dtype == dtype and y.shape == x.shape
        (y.float() * dy.float()).sum().backward()
        results.append([t.detach().double().cpu() for t in (y, x.grad, m.weight.grad)])
    bound = 1e-6 if device == "cpu" else 1e-2
    for what, got, ref in zip(("out", "d x", "d weight"), results[1], results[0]):
        assert rel_l2(got, ref) <= bound, (name, device, what, rel_l2(got, ref))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_opcheck_rms_norm(device):
    if device == "cuda" and not CUDA:
        pytest.skip("no CUDA device (or moeforge built without CUDA)")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 7, 64, generator=g).to(device, dtype).requires_grad_()
    w = (torch.rand(64, generator=g) + 0.5).to(device, dtype).requires_grad_()
    torch.library.opcheck(torch.ops.moeforge.rms_norm.default, (x, w, 1e-6))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_embedding_equals_stock_and_its_padding_row_gets_no_gradient(device):
    if device == "cuda" and not CUDA:
        pytest.skip("no CUDA device (or moeforge built without CUDA)")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 12, (3, 40), generator=g)  # (12 of 50 ids: every used id repeats)
    ids[0, 5] = 49
    dy = torch.randn(3, 40, 32, generator=g)
    for padding_idx in (None, 3, -2):
        stock = torch.nn.Embedding(50, 32, padding_idx=padding_idx).to(device, dtype)
        ours = copy.deepcopy(stock)
        ours.__class__ = mhf._Embedding
        results = []
        for m in (stock, ours):
            out = m(ids.to(device))
            out.backward(dy.to(device, dtype))
            results.append((out.detach(), m.weight.grad.detach()))
        (ref_out, ref_grad), (out, grad) = results
        assert torch.equal(out, ref_out)  # (a row copy)
        assert rel_l2(grad.double(), ref_grad.double()) <= (1e-6 if device == "cpu" else 1e-2)
        assert grad.abs().sum(1).count_nonzero() == ref_grad.abs().sum(1).count_nonzero()
        if padding_idx is not None:
            assert not grad[padding_idx % 50].any()
    # What it does not serve runs stock, with the same result.
    clipped = torch.nn.Embedding(50, 32, max_norm=1.0).to(device, dtype)
    assert mhf.embedding_unsupported_reason(clipped, ids.to(device)) is not None


def test_embedding_is_swapped_by_enable_and_refuses_ids_outside_the_table():
    model = make_model()
    model.get_input_embeddings().__class__ = torch.nn.Embedding  # (as a model made before the import)
    assert not mhf.status(model)["embedding"]
    mhf.enable(model)
    assert mhf.status(model)["embedding"] and isinstance(model.get_input_embeddings(), torch.nn.Embedding)
    with pytest.raises(IndexError, match="outside"):
        model.get_input_embeddings()(torch.tensor([[1, 96]]))
    with pytest.raises(IndexError, match="outside"):
        model.get_input_embeddings()(torch.tensor([[-1, 2]]))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_opcheck_embedding(device):
    if device == "cuda" and not CUDA:
        pytest.skip("no CUDA device (or moeforge built without CUDA)")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(22)
    ids = torch.randint(0, 20, (30,), generator=g, dtype=torch.int32).to(device)
    w = torch.randn(20, 16, generator=g).to(device, dtype).requires_grad_()
    for padding_idx in (-1, 4):
        torch.library.opcheck(torch.ops.moeforge.embedding.default, (ids, w, padding_idx))


def fused_vs_stock(device, dtype, loss_rtol, grad_rel, vocab=96):
    stock = make_model(vocab_size=vocab).to(device, dtype)
    fused = copy.deepcopy(stock)
    mhf.enable(fused, fused_loss=True)
    assert mhf.status(fused)["fused_loss"] and not mhf.status(stock)["fused_loss"]
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, vocab, (2, 40), generator=g).to(device)
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt without loss
    labels[1, 30:] = -100
    for num_items in (None, torch.tensor(61)):  # the mean, and HF Trainer's sum over the items of the batch
        results = []
        for model in (stock, fused):
            model.zero_grad(set_to_none=True)
            kw = {} if num_items is None else {"num_items_in_batch": num_items.to(device)}
            out = model(input_ids=ids, labels=labels, **kw)
            out.loss.backward()
            results.append((out, {n: p.grad.double().cpu() for n, p in model.named_parameters() if p.grad is not None}))
        (ref, ref_grads), (got, grads) = results
        assert got.logits is None
        assert abs(got.loss.item() - ref.loss.item()) <= loss_rtol * abs(ref.loss.item()), (got.loss, ref.loss)
        assert grads.keys() == ref_grads.keys()
        for n in grads:
            assert rel_l2(grads[n], ref_grads[n]) <= grad_rel, (n, rel_l2(grads[n], ref_grads[n]))
    mhf.enable(fused, fused_loss=False)
    assert not mhf.status(fused)["fused_loss"]
    assert fused(input_ids=ids, labels=labels).logits is not None


def test_fused_loss_cpu_fp32_equals_stock():
    fused_vs_stock("cpu", torch.float32, 1e-6, 1e-5)


@needs_cuda
def test_fused_loss_cuda_bf16_equals_stock():
    fused_vs_stock("cuda", torch.bfloat16, 1e-2, 3e-2)


@needs_cuda
def test_fused_loss_never_forms_the_logits():
    """Peak memory of one forward + backward where the logits dominate (8192 tokens x 65536 words:
    2 GiB in fp32): stock keeps them (bf16 and fp32) for the loss and its gradient; the fused loss,
    its scratch allocated by torch (so counted), stays under half of that."""
    peaks = []
    for fused in (False, True):
        model = make_model(vocab_size=65536, max_position_embeddings=8192).to("cuda", torch.bfloat16)
        if fused:
            mhf.enable(model, fused_loss=True)
        ids = torch.randint(0, 65536, (1, 8192), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del model
    assert peaks[1] < 0.5 * peaks[0], f"fused loss peak {peaks[1] / 2**20:.0f} MiB vs stock {peaks[0] / 2**20:.0f} MiB"


@needs_cuda
def test_fused_loss_without_labels_tuples_and_compile_fullgraph():
    stock = make_model().to("cuda", torch.bfloat16)
    fused = copy.deepcopy(stock)
    mhf.enable(fused, fused_loss=True)
    assert fused.state_dict().keys() == stock.state_dict().keys(), "the head's parameters keep their names"
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(11)).cuda()
    with torch.no_grad():  # no labels: the logits, the same product as stock's head
        torch.testing.assert_close(fused(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=0, atol=0)
        as_tuple = fused(input_ids=ids, labels=ids, return_dict=False)
        assert as_tuple[0].ndim == 0 and torch.isfinite(as_tuple[0])
        out = fused(input_ids=ids, labels=ids)
        assert out["loss"] is out.loss and "logits" not in out, "HF Trainer reads outputs['loss']"
    # Compiled, the fused loss against the stock loss compiled (the same graph up to the head, so the
    # same routing: eager and compiled rounding may route a near-tie token to another expert).
    results = []
    for model in (stock, fused):
        model.zero_grad(set_to_none=True)
        loss = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.double().cpu() for n, p in model.named_parameters()
                                      if p.grad is not None}))
    (ref_loss, ref_grads), (got_loss, grads) = results
    assert abs(got_loss - ref_loss) <= 2e-2 * abs(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert rel_l2(grads[n], ref_grads[n]) <= 3e-2, (n, rel_l2(grads[n], ref_grads[n]))


def test_fused_loss_is_per_model_and_refuses_what_it_cannot_fuse():
    with pytest.raises(ValueError, match="per model"):
        mhf.enable(fused_loss=True)
    model = make_model()
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(96))
    with pytest.raises(ValueError, match="bias"):
        mhf.enable(model, fused_loss=True)


def test_hf_trainer_with_gradient_accumulation_equals_stock(tmp_path):
    """HF Trainer (CPU, fp32), 2 micro-batches per step with -100 labels of different counts, so that
    num_items_in_batch matters: stock throughout against moeforge's experts, RMSNorm and fused loss;
    the weights after three steps agree tightly."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(12)
    rows = []
    for i in range(12):
        ids = torch.randint(0, 96, (24,), generator=g)
        labels = ids.clone()
        labels[: 3 + i] = -100  # prompts of different lengths: the micro-batches count different items
        rows.append({"input_ids": ids, "labels": labels})

    def train(model, out):
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                 use_cpu=True, seed=0, data_seed=0, dataloader_drop_last=True,
                                 lr_scheduler_type="constant")
        Trainer(model=model, args=args, train_dataset=rows).train()
        return {n: p.detach().double().clone() for n, p in model.named_parameters()}

    mhf.disable()
    try:
        stock_model = make_model("eager", seed=4)
        assert not mhf.status(stock_model)["rms_norm"]
        initial = {n: p.detach().double().clone() for n, p in stock_model.named_parameters()}
        stock = train(stock_model, tmp_path / "stock")
    finally:
        mhf.enable()
    model = make_model(seed=4)
    mhf.enable(model, fused_loss=True)
    s = mhf.status(model)
    assert s["patched"] and s["fused_loss"] and s["rms_norm"]
    got = train(model, tmp_path / "moeforge")
    assert got.keys() == stock.keys()
    moved = 0
    for n in got:
        assert rel_l2(got[n], stock[n]) <= 1e-5, (n, rel_l2(got[n], stock[n]))
        moved += int(not torch.equal(got[n], initial[n]))
    assert moved > 0, "training moved no weight: the comparison would check nothing"


# --- the whole sparse MoE block (moeforge::moe_block, through transformers' patch mapping) -------------

def make_block_family(name, seed=0):
    """A tiny model of each family whose sparse MoE block moeforge.hf runs whole (two layers where the
    family has a dense first layer), its correction bias (sigmoid routers) made non-zero."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    if name == "qwen3_moe":
        return make_model(seed=seed)
    if name == "qwen2_moe":
        config = tf.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48, num_hidden_layers=1, num_key_value_heads=2,
                                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                   router_aux_loss_coef=0.0)
        cls = tf.Qwen2MoeForCausalLM
    elif name == "mixtral":
        config = tf.MixtralConfig(**common, intermediate_size=32, num_hidden_layers=1, num_key_value_heads=2,
                                  head_dim=16, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.0)
        cls = tf.MixtralForCausalLM
    elif name == "olmoe":
        config = tf.OlmoeConfig(**common, intermediate_size=32, num_hidden_layers=1, num_key_value_heads=2,
                                num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.0)
        cls = tf.OlmoeForCausalLM
    elif name == "deepseek_v3":
        config = tf.DeepseekV3Config(**common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                                     first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=8,
                                     num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                     routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=None,
                                     kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        cls = tf.DeepseekV3ForCausalLM
    else:
        config = tf.Glm4MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                                  first_k_dense_replace=1, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
                                  num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                  routed_scaling_factor=2.5, norm_topk_prob=True)
        cls = tf.Glm4MoeForCausalLM
    model = cls._from_config(config)
    with torch.no_grad():
        for m in model.modules():
            bias = getattr(m, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(0.1 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return model


BLOCK_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe"]


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_block_fused_and_cpu_fp32_equals_stock_eager(family):
    model = make_block_family(family)
    blocks = mhf.status(model)["moe_blocks"]
    assert blocks and all(e["moeforge"] for e in blocks.values()), blocks
    assert all(isinstance(m, mhf._FusedMoeBlock) for m in model.modules() if type(m).__name__ in mhf.FUSED_BLOCKS)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    calls = []
    real = mhf.ops.moe_block_forward
    mhf.ops.moe_block_forward = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        compare_impls(model, ids, "eager", 1e-6, 1e-5)
    finally:
        mhf.ops.moe_block_forward = real
    assert calls, "the fused block never ran: the comparison would check nothing"


@needs_cuda
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_block_fused_cuda_bf16_equals_stock_grouped_mm(family):
    model = make_block_family(family)
    # Router logits of a freshly initialised gate (std 0.02) nearly tie: stock rounds them to bf16
    # before its top-k, moeforge keeps fp32, and a near-tie token picks other experts in the two.
    # Gates at std 1 keep the comparison about the arithmetic rather than about tie-breaking.
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in mhf.FUSED_BLOCKS:
                m.gate.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(4)).cuda()
    compare_impls(model.to("cuda", torch.bfloat16), ids, "grouped_mm", 2e-2, 3e-2)


def test_block_runs_its_own_forward_when_router_logits_are_recorded_and_after_disable():
    model = make_model(router_aux_loss_coef=0.01)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert out.router_logits is not None and len(out.router_logits) == 1 and out.aux_loss is not None
    mhf.disable()
    try:
        stock = make_model()
        assert not any(isinstance(m, mhf._FusedMoeBlock) for m in stock.modules())
        assert all(not e["moeforge"] for e in mhf.status(stock)["moe_blocks"].values())
    finally:
        mhf.enable()
    mhf.enable(stock)  # an existing model: its blocks swapped in place
    assert all(e["moeforge"] for e in mhf.status(stock)["moe_blocks"].values())


def block_op_args(device, dtype, sigmoid=False, N=12):
    g = torch.Generator().manual_seed(3)
    E, H, I = 6, 16, 8
    t = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=g)).to(device, dtype).requires_grad_()  # noqa: E731
    bias = (0.1 * torch.randn(E, generator=g)).to(device) if sigmoid else None
    return (t(N, H), t(E, H), t(E, 2 * I, H, s=0.3), t(E, H, I, s=0.3), bias, 2, True, sigmoid, 2 if sigmoid else 1,
            1, 2.5 if sigmoid else 1.0)


@pytest.mark.parametrize("sigmoid", [False, True])
def test_opcheck_moe_block_cpu(sigmoid):
    # (the activation buffer is opaque, its alignment padding unset: outputs are not compared bitwise)
    torch.library.opcheck(torch.ops.moeforge.moe_block.default, block_op_args("cpu", torch.float32, sigmoid),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@needs_cuda
@pytest.mark.parametrize("sigmoid", [False, True])
def test_opcheck_moe_block_cuda(sigmoid):
    torch.library.opcheck(torch.ops.moeforge.moe_block.default, block_op_args("cuda", torch.bfloat16, sigmoid),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# --- attention (AttentionInterface / AttentionMaskInterface "moeforge") --------------------------------

def attention_inputs(kind, B=2, T=24, device="cpu"):
    """input ids, and the padding mask or packed position ids of each kind, with labels that ignore
    the padding."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 96, (B, T), generator=g).to(device)
    labels = ids.clone()
    extra = {}
    if kind in ("right_padding", "left_padding"):
        mask = torch.ones(B, T, dtype=torch.long)
        if kind == "right_padding":
            mask[0, T - 7:] = 0
        else:
            mask[1, :5] = 0
        # (the loss of a position whose input is padding is left out: transformers' mask and
        # moeforge's documents give padding queries different, unused, outputs)
        after_padding = torch.cat([torch.zeros(B, 1, dtype=torch.long), 1 - mask[:, :-1]], 1)
        labels[(mask == 0).to(device) | (after_padding == 1).to(device)] = -100
        extra["attention_mask"] = mask.to(device)
    elif kind == "packed":
        lengths = [[7, 9, 8], [24]][:B]
        extra["position_ids"] = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths]).to(
            device)
    # (no KV cache: transformers reads packed position_ids only without one, as in training)
    extra["use_cache"] = False
    return ids, labels, extra


def count_calls(monkeypatch, name):
    calls = []
    real = getattr(mhf.ops, name)
    monkeypatch.setattr(mhf.ops, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def attention_vs_sdpa(model, kind, device, loss_rtol, grad_rel, monkeypatch):
    ids, labels, extra = attention_inputs(kind, device=device)
    model.set_attn_implementation("sdpa")
    ref_loss, ref_grads = loss_and_grads(model, ids, labels, **extra)
    model.set_attn_implementation("moeforge")
    calls = count_calls(monkeypatch, "attention_forward")
    loss, grads = loss_and_grads(model, ids, labels, **extra)
    assert bool(calls) == (kind != "plain"), f"moeforge's kernel ran {len(calls)} times for {kind}"
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert rel_l2(grads[n], ref_grads[n]) <= grad_rel, (n, rel_l2(grads[n], ref_grads[n]))


def test_attention_is_the_default_and_falls_back_by_name():
    model = make_model()
    assert model.config._attn_implementation == "moeforge" and mhf.status(model)["attention"] == "moeforge"
    from transformers import Qwen3MoeForCausalLM
    explicit = Qwen3MoeForCausalLM._from_config(tiny_config(), attn_implementation="eager")
    assert explicit.config._attn_implementation == "eager"


@pytest.mark.parametrize("kind", ["plain", "right_padding", "left_padding", "packed"])
def test_attention_cpu_fp32_equals_sdpa(kind, monkeypatch):
    attention_vs_sdpa(make_model(), kind, "cpu", 1e-6, 1e-5, monkeypatch)


@needs_cuda
@pytest.mark.parametrize("kind", ["plain", "right_padding", "left_padding", "packed"])
def test_attention_cuda_bf16_equals_sdpa(kind, monkeypatch):
    model = make_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    attention_vs_sdpa(model.to("cuda", torch.bfloat16), kind, "cuda", 2e-2, 3e-2, monkeypatch)


def test_attention_padding_inside_a_row_runs_sdpa_with_its_mask(monkeypatch):
    model = make_model()
    ids, labels, extra = attention_inputs("right_padding")
    extra["attention_mask"][1, 10:12] = 0  # a hole: no document layout expresses it
    labels[1, 10:12] = -100
    model.set_attn_implementation("sdpa")
    ref_loss, _ = loss_and_grads(model, ids, labels, **extra)
    model.set_attn_implementation("moeforge")
    calls = count_calls(monkeypatch, "attention_forward")
    loss, _ = loss_and_grads(model, ids, labels, **extra)
    assert not calls and abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)


def qknorm_rope_vs_stock(model, ids, device, loss_rtol, grad_rel, monkeypatch, **inputs):
    """Qwen3-MoE's attention with its q/k norm and rotary embedding as moeforge's qknorm_rope against
    the whole model stock (compare_impls), proving that the op ran forward and backward."""
    qk = mhf.status(model)["qknorm_rope"]
    assert qk == {"FusedQwen3MoeAttention": {"count": 1, "moeforge": True, "reason": None}} or (
        list(qk.values())[0]["moeforge"]), qk
    forward, backward = count_calls(monkeypatch, "qknorm_rope_forward"), count_calls(monkeypatch,
                                                                                       "qknorm_rope_backward")
    compare_impls(model, ids.to(device), "eager" if device == "cpu" else "grouped_mm", loss_rtol, grad_rel, **inputs)
    assert forward and backward, "qknorm_rope never ran: the comparison would check nothing"


def test_qknorm_rope_cpu_fp32_equals_stock(monkeypatch):
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    qknorm_rope_vs_stock(make_model(), ids, "cpu", 1e-6, 1e-5, monkeypatch)


def test_qknorm_rope_cpu_fp32_packed_positions_equal_stock(monkeypatch):
    ids, labels, extra = attention_inputs("packed")
    model = make_model()
    qknorm_rope_vs_stock(model, ids, "cpu", 1e-6, 1e-5, monkeypatch, labels=labels, **extra)


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_qknorm_rope_cuda_bf16_equals_stock(head_dim, monkeypatch):
    model = make_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(4))
    qknorm_rope_vs_stock(model.to("cuda", torch.bfloat16), ids, "cuda", 2e-2, 3e-2, monkeypatch)


def test_qknorm_rope_with_a_kv_cache_decodes_as_the_whole_sequence(monkeypatch):
    """transformers makes a KV cache even in training (use_cache defaults to on); incremental decoding
    through it, the cached keys rotated by the op, gives the logits of one pass over the sequence."""
    model = make_model().eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    forward = count_calls(monkeypatch, "qknorm_rope_forward")
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        prefix = model(input_ids=ids[:, :8], use_cache=True)
        step = model(input_ids=ids[:, 8:], past_key_values=prefix.past_key_values, use_cache=True).logits
    assert len(forward) == 3, f"qknorm_rope ran {len(forward)} times for 3 forwards of one layer"
    torch.testing.assert_close(prefix.logits, whole[:, :8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, whole[:, 8:], rtol=1e-5, atol=1e-5)
    stock_of = {fused: stock for stock, fused in mhf._FUSED_OF.items()}
    attn = model.model.layers[0].self_attn
    assert type(attn) in stock_of and stock_of[type(attn)].__name__ == "Qwen3MoeAttention"


def test_opcheck_qknorm_rope():
    devices = ["cpu"] + (["cuda"] if CUDA else [])
    for device in devices:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        g = torch.Generator().manual_seed(9)
        t = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
        q, k, qw, kw = t(6, 4, 16), t(6, 2, 16), t(16), t(16)
        for x in (q, k, qw, kw):
            x.requires_grad_()
        torch.library.opcheck(torch.ops.moeforge.qknorm_rope.default, (q, k, qw, kw, t(6, 16), t(6, 16), 1e-6))


def test_opcheck_attention_cpu():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 10, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    docs = torch.tensor([[0] * 4 + [1] * 6, [0] * 10], dtype=torch.int32)
    torch.library.opcheck(torch.ops.moeforge.attention.default, (q, k, v, docs))
    torch.library.opcheck(torch.ops.moeforge.attention.default, (q, k, v, None))


# --- PEFT LoRA on the experts (target_parameters) -------------------------------------------------------

def make_lora_model(device="cpu", dtype=torch.float32, r=8, seed=0):
    """A tiny Qwen3-MoE with PEFT LoRA on both expert projections (target_parameters), its B factors
    made non-zero so that every factor gets a gradient."""
    peft = pytest.importorskip("peft", reason="the LoRA tests need peft")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=[],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(make_model(seed=seed), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed + 7))
    return model.to(device, dtype)


def lora_loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().double().item(), grads


def lora_vs_peft(device, dtype, loss_rtol, grad_rel, monkeypatch):
    from peft.tuners.lora.layer import ParamWrapper

    model = make_lora_model(device, dtype)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3)).to(device)
    mhf._unpatch_peft()
    try:
        ref_loss, ref_grads = lora_loss_and_grads(model, ids)  # PEFT's own: W + s·B·A formed per forward
    finally:
        mhf._patch_peft()
    calls = count_calls(monkeypatch, "grouped_gemm_forward")

    def refuse(*_a, **_k):
        raise AssertionError("PEFT formed W + B·A under moeforge.hf")

    monkeypatch.setattr(ParamWrapper, "_activate_lora", refuse)
    loss, grads = lora_loss_and_grads(model, ids)
    assert calls, "moeforge::experts_lora never ran"
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    lora = [n for n in grads if "lora_" in n]
    assert len(lora) == 4, lora
    for n in grads:
        assert rel_l2(grads[n], ref_grads[n]) <= grad_rel, (n, rel_l2(grads[n], ref_grads[n]))


def test_lora_experts_cpu_fp32_equal_peft_without_forming_w_plus_ba(monkeypatch):
    lora_vs_peft("cpu", torch.float32, 1e-6, 1e-5, monkeypatch)


@needs_cuda
def test_lora_experts_cuda_bf16_equal_peft(monkeypatch):
    lora_vs_peft("cuda", torch.bfloat16, 2e-2, 3e-2, monkeypatch)


def test_lora_experts_round_trip_through_peft(tmp_path):
    """Three SGD steps of expert LoRA on moeforge, the adapter saved by PEFT and loaded by PEFT on a
    stock model: the same logits."""
    peft = pytest.importorskip("peft", reason="the LoRA tests need peft")
    model = make_lora_model(seed=1)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(4))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before), "nothing trained"
    model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        want = model(input_ids=ids).logits
    mhf.disable()
    try:
        stock = peft.PeftModel.from_pretrained(make_model(seed=1), tmp_path / "adapter")
        with torch.no_grad():
            got = stock(input_ids=ids).logits
    finally:
        mhf.enable()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def autograd_node_names(t) -> set:
    """The class names of the autograd nodes t's graph reaches."""
    names, seen, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [nxt for nxt, _ in node.next_functions]
    return names


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("fused_blocks", [True, False])
def test_eager_twins_equal_the_dispatcher_bitwise(device, fused_blocks, monkeypatch):
    """Eager calls run each op's twin autograd.Function (its implementation, setup_context and
    backward without the dispatcher's round trip): the graph holds the twins' nodes and none of the
    dispatcher's, and loss and every gradient equal those of the calls through the dispatcher bit for
    bit (the same kernels in the same order). Packed documents (moeforge's attention), the fused
    loss, the embedding, RMSNorm and qknorm_rope; the fused sparse MoE block or the experts op."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = make_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = model.to(device, dtype)
    mhf.enable(model, fused_loss=True)
    if not fused_blocks:
        mhf._fuse_blocks(model, fuse=False)
    ids, labels, extra = attention_inputs("packed", device=device)
    runs = {}
    for fast in (False, True):
        monkeypatch.setattr(mhf, "EAGER_FAST_PATH", fast)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels, **extra).loss
        nodes = autograd_node_names(loss)
        loss.backward()
        runs[fast] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, nodes
    # (_fuse_blocks swaps the sparse MoE blocks and the attentions (q/k norm + rotary embedding as one op)
    # together: unfused, the experts op serves the experts and the q/k norms run as RMSNorm ops)
    fused = ("moe_block", "qknorm_rope") if fused_blocks else ("experts",)
    want = {f"EagerTwin_{op}Backward"
            for op in ("embedding", "rms_norm", "attention", "linear_cross_entropy", *fused)}
    assert {n for n in runs[True][2] if n.startswith("EagerTwin_")} == want, runs[True][2]
    assert not any(n.startswith("GeneratedBackwardFor_moeforge") for n in runs[True][2]), runs[True][2]
    assert not any(n.startswith("EagerTwin_") for n in runs[False][2]), runs[False][2]
    assert any(n.startswith("GeneratedBackwardFor_moeforge") for n in runs[False][2]), runs[False][2]
    assert torch.equal(runs[True][0], runs[False][0]), (runs[True][0], runs[False][0])
    assert runs[True][1].keys() == runs[False][1].keys() and len(runs[True][1]) == len(list(model.parameters()))
    for n, g in runs[True][1].items():
        assert torch.equal(g, runs[False][1][n]), n
