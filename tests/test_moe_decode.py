"""The MoE decode kernel (routed experts of a few tokens, each chosen expert's weights read once, in place) against
the experts module's eager loop and the fp32 reference, and the model's decoding through it.

Without CUDA the kernel runs in the Triton interpreter on tiny shapes (``TRITON_INTERPRET=1``, set by conftest.py);
on a GPU the same tests run compiled, plus the full-size and CUDA-graph tests. fp32 tolerances: the interpreter
measures about 3e-7 (summation order); a GPU's approximate exp in the sigmoid and tanh adds a few fp32 ulps, hence
1e-5.
"""

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it on machines without CUDA
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from bf16_emulation import emulate_bf16  # noqa: E402
from conftest import tiny_config, tiny_model  # noqa: E402
from kda_testing import rel  # noqa: E402

from kda_moe.kernels import moe  # noqa: E402
from kda_moe.kernels.backend import tl, triton  # noqa: E402
from kda_moe.kernels.moe import decode, moe_decode, routed_experts  # noqa: E402
from kda_moe.modeling.modeling_kda_moe import KdaMoeExperts, KdaMoeRMSNorm  # noqa: E402

dev = "cpu" if INTERPRETED else "cuda"
GREEDY = dict(max_new_tokens=4, do_sample=False)
# model tests: one KDA layer (its fused decode kernel) and two MLA layers, the last two sparse
LAYERS = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "full_attention"],
              linear_head_dim=16)


def experts_module(E, k, L, I, dtype=torch.float32, activation="situ", up_cap=25.0, backend="torch", seed=0):
    """A `KdaMoeExperts` of E experts (width L, intermediate I) on the eager loop, weights scaled so that the gate
    and up pre-activations reach the tanh caps' curved part."""
    config = tiny_config(num_experts=E, num_experts_per_tok=k, hidden_size=max(32, L), routed_expert_hidden_size=L,
                         moe_intermediate_size=I, hidden_act=activation, activation_situ_linear_beta=up_cap,
                         kernel_backend=backend)
    config._experts_implementation = "eager"
    experts = KdaMoeExperts(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * I, L, generator=gen) * 3 * L ** -0.5)
        experts.down_proj.copy_(torch.randn(E, L, I, generator=gen) * I ** -0.5)
    return experts.to(device=dev, dtype=dtype)


def routing(N, k, E, repeats=True, seed=0):
    """[N, k] expert ids, distinct within a token (as the router's top-k), and positive weights [N, k]. With
    ``repeats`` every token after the first shares its first expert with the token before."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    if repeats:
        for t in range(1, N):
            shared = index[t - 1, 0]
            index[t][index[t] == shared] = index[t, 0]  # keep the row's experts distinct
            index[t, 0] = shared
    return index.to(dev), torch.rand(N, k, generator=gen).to(dev)


def shared_expert(L, intermediate, dtype=torch.float32, seed=2):
    """A shared expert's (gate [Is, l], up [Is, l], down [l, Is]) weights, scaled as the routed experts'."""
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*shape, generator=gen) * shape[1] ** -0.5).to(dev, dtype)
                 for shape in ((intermediate, L), (intermediate, L), (L, intermediate)))


def decode_through_kernel(experts, hidden_states, index, weights, backend="triton", **options):
    act = experts.act_fn
    return moe_decode(hidden_states, index, weights, experts.gate_up_proj, experts.down_proj, activation=act.kind,
                      gate_cap=act.gate_cap, up_cap=act.up_cap, backend=backend, **options)


CASES = {
    "one-token-one-expert": (1, 1, 4, 16, 16),
    "one-token": (1, 4, 8, 32, 16),
    "shared-experts": (5, 3, 6, 40, 24),  # widths that are no multiple of the tiles
    "all-tokens-one-expert": (6, 1, 3, 16, 16),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("activation,up_cap", [("situ", 25.0), ("situ", None), ("silu", 25.0)],
                         ids=["situ", "situ-uncapped", "silu"])
def test_kernel_matches_the_eager_experts_loop_in_fp32(case, activation, up_cap):
    N, k, E, L, I = CASES[case]
    experts = experts_module(E, k, L, I, activation=activation, up_cap=up_cap)
    index, weights = routing(N, k, E)
    x = torch.randn(N, L, generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        out = decode_through_kernel(experts, x, index, weights)
        expected = experts(x, index, weights)
    assert out.shape == (N, L) and out.dtype == torch.float32
    assert rel(out, expected) < 1e-5


@pytest.mark.parametrize("case,rows", [("one-token", 1), ("shared-experts", 8)])
def test_narrow_tiles_multiply_on_the_cuda_cores_to_the_same_sum(case, rows):
    """Tiles narrower than tl.dot's 16 (unpadded token rows, 4 intermediate / 8 output channels a program) take the
    CUDA cores' products (``accumulate_products``): the eager loop's sum within the same 1e-5."""
    N, k, E, L, I = CASES[case]
    experts = experts_module(E, k, L, I)
    index, weights = routing(N, k, E)
    x = torch.randn(N, L, generator=torch.Generator().manual_seed(1)).to(dev)
    launch = decode.MoeDecodeLaunch(rows=rows, block_inter=4, block_out=8, block_k=16, warps=1, stages=1)
    act = experts.act_fn
    with torch.no_grad():
        out = decode.launch_moe_decode(x, index, weights, experts.gate_up_proj, experts.down_proj, None, act.kind,
                                       act.gate_cap, act.up_cap, launch)
        expected = experts(x, index, weights)
    assert rel(out, expected) < 1e-5


@pytest.mark.parametrize("shared_intermediate", [40, 8], ids=["wider", "narrower"])
def test_a_shared_expert_joins_every_tokens_sum(shared_intermediate):
    """With a shared expert's weights the same launches add its output to every token's routed sum: the eager loop's
    routed sum plus the shared MLP, in fp32. Its intermediate width differs from the routed experts' either way."""
    N, k, E, L, I = CASES["shared-experts"]
    experts = experts_module(E, k, L, I)
    index, weights = routing(N, k, E)
    shared = shared_expert(L, shared_intermediate)
    x = torch.randn(N, L, generator=torch.Generator().manual_seed(1)).to(dev)
    act = experts.act_fn
    with torch.no_grad():
        out = decode_through_kernel(experts, x, index, weights, shared=shared)
        shared_out = act(x @ shared[0].T, x @ shared[1].T) @ shared[2].T
        expected = experts(x, index, weights) + shared_out
    assert rel(out, expected) < 1e-5
    with pytest.raises(ValueError, match=r"down \[l, Is\]\) weights with l = 40"):
        decode_through_kernel(experts, x, index, weights, shared=(*shared[:2], shared[2][:, 1:]))


@pytest.mark.parametrize("case", ["one-token", "shared-experts"])
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_and_residual_inside_the_kernels_equal_the_eager_layer(case, with_shared, dtype, monkeypatch):
    """A pre-norm MoE layer on the residual stream: the up kernel normalises the rows it reads, the sum adds the
    residual as it stores, the same as ``KdaMoeRMSNorm``, the experts on its rows and ``residual + ...``; the torch
    backend composes the same three. The add alone rounds where the eager add rounds (the sum, then sum + residual):
    equal bits. fp32: 1e-5, as above. bf16: the kernel's normalised rows are the eager norm's up to the order of its
    sum of squares, which may move an element's rounding by one ulp and what depends on it by a fraction of that, and
    the reference differs from the kernel by summation order only
    (``test_bf16_matches_the_fp32_reference_with_the_same_roundings``): 2^-8."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    N, k, E, L, I = CASES[case]
    experts = experts_module(E, k, L, I, dtype=dtype)
    index, weights = routing(N, k, E)
    gen = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(N, L, generator=gen)).to(dev, dtype)  # a residual stream's rows: far from unit RMS
    residual = torch.randn(N, L, generator=gen).to(dev, dtype)  # not x: a kernel that read x instead would show
    norm = KdaMoeRMSNorm(L, eps=1e-5).to(dev, dtype)
    norm.weight.data = (torch.rand(L, generator=gen) + 0.5).to(dev, dtype)
    options = dict(shared=shared_expert(L, 24, dtype) if with_shared else None)
    input_norm = (norm.weight, 1e-5)
    with torch.no_grad():
        normed = norm(x)
        unfused = decode_through_kernel(experts, normed, index, weights, **options)
        eager = residual + unfused
        normed_inside = decode_through_kernel(experts, x, index, weights, input_norm=input_norm, **options)
        added_inside = decode_through_kernel(experts, normed, index, weights, residual=residual, **options)
        both = {backend: decode_through_kernel(experts, x, index, weights, backend, input_norm=input_norm,
                                               residual=residual, **options) for backend in ("triton", "torch")}
    bound = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert normed_inside.dtype == dtype and rel(normed_inside, unfused) < bound
    assert torch.equal(added_inside, eager)
    for out in both.values():
        assert out.dtype == dtype and out.shape == (N, L) and rel(out, eager) < bound


def test_norm_and_residual_are_checked_on_both_backends():
    experts = experts_module(4, 2, 16, 16)
    x = torch.randn(3, 16, device=dev)
    index, weights = routing(3, 2, 4)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=r"input_norm's weight must be \[d\] = \[16\]"):
            decode_through_kernel(experts, x, index, weights, backend, input_norm=(torch.ones(8, device=dev), 1e-6))
        for residual in (torch.zeros(3, 8, device=dev), torch.zeros(3, 16, device=dev, dtype=torch.float64)):
            with pytest.raises(ValueError, match=r"the residual must be the hidden states' shape and dtype, \(3, 16\)"):
                decode_through_kernel(experts, x, index, weights, backend, residual=residual)


def test_a_token_that_names_an_expert_twice_gets_both_weighted_rows():
    """The router never repeats an expert within a token, but the kernel computes the sum as written: both choices
    count (as in the eager loop), each with its own weight."""
    experts = experts_module(4, 3, 16, 16)
    index = torch.tensor([[2, 2, 0], [1, 2, 3]], device=dev)
    weights = torch.rand(2, 3, generator=torch.Generator().manual_seed(0)).to(dev)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad():
        assert rel(decode_through_kernel(experts, x, index, weights), experts(x, index, weights)) < 1e-5


def test_an_id_outside_the_experts_adds_nothing_and_reads_nothing():
    """An id outside [0, E) (an expert-parallel placeholder) owns no program and its slot's row is zero."""
    experts = experts_module(4, 2, 16, 16)
    index = torch.tensor([[1, 4], [1, 2]], device=dev)
    weights = torch.rand(2, 2, generator=torch.Generator().manual_seed(0)).to(dev)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)).to(dev)
    without = index.clone()
    without[0, 1] = 0
    kept = weights.clone()
    kept[0, 1] = 0
    with torch.no_grad():
        out = decode_through_kernel(experts, x, index, weights)
        assert rel(out, experts(x, without, kept)) < 1e-5


@triton.jit
def _record_owners(top_k_index, owners, N, E, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr):
    slot = tl.program_id(0)
    _, _, _, owner = decode._expert_of_slot(top_k_index, slot, N, E, K, KP, ROWS)
    tl.store(owners + slot, owner.to(tl.int32))


def test_each_chosen_expert_is_run_by_exactly_one_program():
    """The grid has a program per (token, choice); the one whose slot first chose an expert runs it for every token
    that chose it (so its weights are read once), the others exit: one owner per distinct expert, at its first slot."""
    index, _ = routing(7, 3, 6)
    N, K = index.shape
    owners = torch.zeros(N * K, dtype=torch.int32, device=dev)
    _record_owners[(N * K,)](index, owners, N, 6, K=K, KP=triton.next_power_of_2(K), ROWS=16)
    flat = index.flatten().tolist()
    first_slots = sorted(flat.index(e) for e in set(flat))
    assert sorted(torch.nonzero(owners).flatten().tolist()) == first_slots
    assert len(first_slots) < N * K  # the routing does share experts between tokens


def test_bf16_matches_the_fp32_reference_with_the_same_roundings(monkeypatch):
    """bf16 inputs and weights. The reference multiplies in fp32 and rounds where the kernel does (the activation to
    bf16 before the down product, the result once), so the two differ by fp32 summation order only: where a sum lands
    on the other side of a bf16 rounding boundary that element moves by one bf16 ulp (2^-8 relative), hence 2^-8.
    The eager bf16 loop rounds more often (the gate / up products, each expert's output, the weight products and
    every partial sum of the k experts: about k + 4 roundings of 2^-9 each), hence 2^-5 against it."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    N, k, E, L, I = CASES["shared-experts"]
    experts = experts_module(E, k, L, I, dtype=torch.bfloat16)
    index, weights = routing(N, k, E)
    x = torch.randn(N, L, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)
    weights = weights.to(torch.bfloat16)
    with torch.no_grad():
        out = decode_through_kernel(experts, x, index, weights)
        reference = routed_experts(x, index, weights, experts.gate_up_proj, experts.down_proj, "situ", 4.0, 25.0)
        eager = experts(x, index, weights)
    assert out.dtype == torch.bfloat16
    assert rel(out, reference) < 2 ** -8
    assert rel(out, eager) < 2 ** -5


def test_bad_inputs_name_the_problem():
    experts = experts_module(4, 2, 16, 16)
    x = torch.randn(3, 16, device=dev)
    index, weights = routing(3, 2, 4)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"down_proj \[E, l, I\] with l = 8"):
            decode_through_kernel(experts, x[:, :8], index, weights)
        with pytest.raises(ValueError, match=r"top_k_index and top_k_weights must both be \[N, k\] with N = 3"):
            decode_through_kernel(experts, x, index[:2], weights[:2])
        with pytest.raises(ValueError, match="activation must be one of"):
            moe_decode(x, index, weights, experts.gate_up_proj, experts.down_proj, activation="gelu", gate_cap=4.0,
                       up_cap=None, backend="triton")
        many = torch.randn(moe.MAX_DECODE_TOKENS + 1, 16, device=dev)
        many_index, many_weights = routing(moe.MAX_DECODE_TOKENS + 1, 2, 4, repeats=False)
        with pytest.raises(ValueError, match="at most 64 tokens"):
            decode_through_kernel(experts, many, many_index, many_weights)
    with pytest.raises(ValueError, match="has no backward"):
        decode_through_kernel(experts, x.requires_grad_(), index, weights)


def test_op_has_a_fake_and_skips_the_dispatcher_without_autograd(monkeypatch):
    """The custom op's fake gives the output's shape (what torch.compile traces); without autograd the wrapper calls
    the launch code directly, with the op's result."""
    experts = experts_module(4, 2, 16, 16)
    x = torch.randn(3, 16, device=dev)
    index, weights = routing(3, 2, 4)
    args = (x, index, weights, experts.gate_up_proj.detach(), experts.down_proj.detach(), [], "situ", 4.0, 25.0, None,
            0.0, None)
    shared = [torch.randn(8, 16, device=dev), torch.randn(8, 16, device=dev), torch.randn(16, 8, device=dev)]
    norm_and_residual = (torch.rand(16, device=dev), 1e-6, torch.randn(3, 16, device=dev))
    for checked in (args, (*args[:5], shared, *args[6:]), (*args[:9], *norm_and_residual)):
        torch.library.opcheck(decode.moe_decode_op, checked, test_utils=("test_schema", "test_faketensor"))
    dispatched = decode.moe_decode_op(*args)

    def fail(*args):
        raise AssertionError("the MoE decode op went through the dispatcher without autograd")

    monkeypatch.setattr(decode, "moe_decode_op", fail)
    with torch.no_grad():
        assert torch.equal(decode_through_kernel(experts, x, index, weights), dispatched)


# Whole-model logits of the kernel path against another path: fp32 rounding in the interpreter; on a GPU the KDA
# chunk kernel (both models run it) reads fp32 operands as tf32 and the paths round differently after it (measured on
# an H100: 1.4e-4 against the torch experts implementation, 6.5e-5 against the torch backend).
MODEL_RTOL = 1e-5 if INTERPRETED else 1e-3


def count_kernel_calls(monkeypatch) -> list:
    calls = []
    kernel = moe.moe_decode_triton
    monkeypatch.setattr(moe, "moe_decode_triton", lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    return calls


@pytest.mark.skipif(not INTERPRETED, reason="tests/test_gpu_model.py decodes on the GPU")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("latent", [16, None], ids=["latent", "full_width"])
def test_model_greedy_tokens_through_the_kernel_equal_the_torch_backend(cache, latent, monkeypatch):
    """The prefill (8 tokens) and every decoding step (2 tokens) of each sparse layer run the kernel under
    transformers' default experts implementation (grouped_mm), with the shared expert inside it where the experts run
    at the hidden width; greedy tokens equal the torch backend's, scores within fp32 rounding."""
    calls = []
    kernel = moe.moe_decode_triton
    monkeypatch.setattr(moe, "moe_decode_triton", lambda *a, **kw: calls.append(
        (a[0].shape[0], kw.get("shared") is not None)) or kernel(*a, **kw))
    models = [tiny_model(seed=0, kernel_backend=b, routed_expert_hidden_size=latent, **LAYERS)
              for b in ("triton", "torch")]
    assert models[0].config._experts_implementation == "grouped_mm"
    sparse_layers = models[0].config.mlp_layer_types.count("sparse")
    input_ids = torch.randint(1, models[0].config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    options = dict(cache_implementation="static") if cache == "static" else {}
    with torch.no_grad():
        out = [m.generate(input_ids, output_scores=True, return_dict_in_generate=True, **GREEDY, **options)
               for m in models]
    fused = latent is None
    assert calls == [(8, fused)] * sparse_layers + [(2, fused)] * sparse_layers * 3
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel(torch.stack(out[0].scores), torch.stack(out[1].scores)) < 1e-5


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_transformers_plain_weight_implementations_give_way_to_the_kernel(implementation, monkeypatch):
    calls = count_kernel_calls(monkeypatch)
    model = tiny_model(seed=0, kernel_backend="triton", **LAYERS, experts_implementation=implementation).to(dev)
    reference = tiny_model(seed=0, **LAYERS, experts_implementation=implementation).to(dev)
    input_ids = torch.randint(1, 97, (1, 3), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        logits = model(input_ids).logits
        assert calls == [3] * model.config.mlp_layer_types.count("sparse")
        assert rel(logits, reference(input_ids).logits) < MODEL_RTOL


def test_other_experts_implementations_keep_their_forward(monkeypatch):
    """An implementation other than transformers' three for plain weights (deepgemm, sonicmoe, one registered by the
    user) may compute from other weights or another layout: it runs, the kernel does not."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    used = []
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "recording",
                        lambda *a, **kw: used.append(1) or batched_mm_experts_forward(*a, **kw))
    calls = count_kernel_calls(monkeypatch)
    model = tiny_model(seed=0, kernel_backend="triton", **LAYERS).to(dev)
    model.set_experts_implementation("recording")
    with torch.no_grad():
        model(torch.tensor([[5, 6]], device=dev))
    assert used and not calls


def test_inputs_that_need_gradients_keep_the_experts_implementation(monkeypatch):
    """A forward under autograd with trainable experts (training, or scoring with gradients) never takes the kernel,
    which has no backward; the same forward without autograd does."""
    calls = count_kernel_calls(monkeypatch)
    model = tiny_model(seed=0, kernel_backend="triton", **LAYERS).to(dev)
    input_ids = torch.tensor([[5, 6, 7]], device=dev)
    logits = model(input_ids).logits
    assert logits.requires_grad and not calls
    logits.sum().backward()
    assert model.model.layers[1].mlp.experts.gate_up_proj.grad is not None
    with torch.no_grad():
        assert rel(model(input_ids).logits, logits.detach()) < MODEL_RTOL
    assert calls


def test_a_trainable_shared_expert_beside_frozen_experts_keeps_its_own_mlp(monkeypatch):
    """Only the shared experts train: the first sparse layer's frozen routed experts still take the kernel, its
    shared expert runs apart (the kernel has no backward); from there on the states carry gradients, so later layers
    keep the experts implementation. Every shared expert gets its gradients."""
    calls = count_kernel_calls(monkeypatch)
    model = tiny_model(seed=0, kernel_backend="triton", routed_expert_hidden_size=None, **LAYERS).to(dev)
    model.requires_grad_(False)
    sparse = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "shared_experts")]
    for mlp in sparse:
        mlp.shared_experts.requires_grad_(True)
    model(torch.tensor([[5, 6, 7]], device=dev)).logits.sum().backward()
    assert len(sparse) > 1 and calls == [3]
    assert all(mlp.shared_experts.down_proj.weight.grad is not None for mlp in sparse)


def test_more_tokens_than_the_kernel_takes_keep_the_experts_implementation(monkeypatch):
    """A forward of more than MAX_DECODE_TOKENS tokens (a prompt) runs the experts implementation; 64 take the kernel."""
    calls = count_kernel_calls(monkeypatch)
    model = tiny_model(seed=0, kernel_backend="triton", **LAYERS).to(dev)
    sparse_layers = model.config.mlp_layer_types.count("sparse")
    with torch.no_grad():
        model(torch.randint(1, 97, (1, moe.MAX_DECODE_TOKENS + 1), device=dev))
        assert not calls
        model(torch.randint(1, 97, (2, moe.MAX_DECODE_TOKENS // 2), device=dev))
    assert calls == [moe.MAX_DECODE_TOKENS] * sparse_layers


def test_experts_under_an_active_lora_adapter_keep_the_experts_implementation(monkeypatch):
    """PEFT adds a LoRA adapter to the fused expert weights by parametrizing them for the duration of the call: the
    kernel would read the base weights only, so such a call keeps the implementation (which reads the adapted
    weights); with the adapter disabled the kernel runs, on the base weights."""
    from peft import LoraConfig, get_peft_model

    calls = count_kernel_calls(monkeypatch)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    models = [get_peft_model(tiny_model(seed=0, kernel_backend=b, **LAYERS).to(dev), config).eval()
              for b in ("triton", "torch")]
    models[1].load_state_dict(models[0].state_dict())
    input_ids = torch.tensor([[5, 6, 7]], device=dev)
    with torch.no_grad():
        adapted = models[0](input_ids).logits
        assert not calls
        assert rel(adapted, models[1](input_ids).logits) < MODEL_RTOL
        with models[0].disable_adapter():
            base = models[0](input_ids).logits
        assert calls
        assert rel(adapted, base) > 1e-3  # the adapter changes the output: the first call did read it


def test_compiled_sparse_block_holds_the_kernel_as_one_op():
    """torch.compile(fullgraph=True) traces a sparse block's decoding step without a graph break, with the kernel as
    one custom op (no host reads, no data-dependent shapes), and gives the eager result."""
    from torch._dynamo.backends.common import aot_autograd

    model = tiny_model(seed=0, kernel_backend="triton", **LAYERS).to(dev)
    block = model.model.layers[1].mlp
    graph_ops = []

    def record(gm, example_inputs):
        graph_ops.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    x = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dev)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = block(x)
        out = torch.compile(block, fullgraph=True, backend=aot_autograd(fw_compiler=record))(x)
    assert torch.equal(out, expected)
    assert len(graph_ops) == 1 and "kda_moe.moe_decode.default" in graph_ops[0]


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU the benchmark runs for real")
def test_benchmark_writes_its_rows_and_table(tmp_path, monkeypatch):
    """benchmarks/moe_decode.py end to end on CPU (fp32, stand-in timings): the plumbing, not the numbers."""
    import json
    import sys

    from benchmark_testing import load_benchmark, stand_in_timings

    bench = load_benchmark("moe_decode.py")
    stand_in_timings(bench, monkeypatch)
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (6, 2, 32, 16, "situ")})
    monkeypatch.setattr(sys, "argv", ["moe_decode.py", str(tmp_path), "tokens=1,3", "tune"])
    bench.main(str(tmp_path))
    rows = json.loads((tmp_path / "moe_decode.json").read_text())["rows"]
    assert [r["N"] for r in rows] == [1, 3] and all(r["rel_err"] < 1e-5 for r in rows)
    assert all(r[f"{side}_ms"] == 1.0 for r in rows for side in ("ours", "grouped_mm", "batched_mm", "eager"))
    assert all(len(r["launch_us"]) > 1 and r["launch"] in r["launch_us"] for r in rows)
    table = (tmp_path / "moe_decode.md").read_text()
    assert "| tiny | 3 |" in table and "- tiny N=3: " in table and "(pick: 1000.0)" in table


# ---------------------------------------------------------------------------------------------------------------
# On a GPU: realistic shapes and a CUDA graph
# ---------------------------------------------------------------------------------------------------------------


def realistic_inputs(N, k, E, L, I, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=dtype)  # noqa: E731
    gate_up, down = r(E, 2 * I, L), r(E, L, I)
    gate_up.mul_(3 * L ** -0.5)
    down.mul_(I ** -0.5)
    scores = torch.rand(N, E, generator=gen, device="cuda")
    weights, index = scores.topk(k, dim=-1)
    return r(N, L), index, (weights / weights.sum(-1, keepdim=True)).to(dtype), gate_up, down


FULL_SIZE = {  # E, k, l, I
    "e64-l512": (64, 8, 512, 256),  # a LatentMoE of 64 experts, top-8, latent width 512, intermediate 256
    "anchor": (64, 8, 1024, 512),  # benchmarks/model.py's anchor config: full-width SwiGLU experts (silu here)
    "k3-width": (384, 16, 3584, 3072),  # K3's latent width, intermediate and top-16 over 384 experts: 25 GB in bf16
}
FULL_SIZE_CASES = [(shape, N, dtype) for shape in ("e64-l512", "anchor") for N in (1, 8, 64)
                   for dtype in (torch.bfloat16, torch.float32)] + [("k3-width", N, torch.bfloat16) for N in (1, 8)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape,N,dtype", FULL_SIZE_CASES)
def test_kernel_at_full_size_matches_the_fp32_reference(shape, N, dtype):
    """The reference runs in fp32 on the same inputs with the kernel's rounding points, so the two differ by summation
    order (tensor-core fp32 accumulation in another order, the GPU's exp): 2^-8 in bf16 (a rounding that flips moves
    an element by one bf16 ulp, 2^-8 relative, and what depends on it by a fraction of that), 1e-5 in fp32 (full fp32
    products, not tf32: a few ulps)."""
    E, k, L, I = FULL_SIZE[shape]
    need = E * 3 * I * L * dtype.itemsize + N * k * 3 * I * L * 4  # the weights, and the reference's fp32 gathers
    if need > 0.8 * torch.cuda.get_device_properties(0).total_memory:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of GPU memory")
    activation = "silu" if shape == "anchor" else "situ"
    x, index, weights, gate_up, down = realistic_inputs(N, k, E, L, I, dtype)
    with torch.no_grad():
        out = moe_decode(x, index, weights, gate_up, down, activation=activation, gate_cap=4.0, up_cap=25.0,
                         backend="triton")
        reference = routed_experts(x, index, weights, gate_up, down, activation, 4.0, 25.0)
    tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert torch.isfinite(out).all() and rel(out, reference) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_replays_in_a_cuda_graph_with_new_routing():
    """Captured once, the kernel follows the routing written into the captured index and weight buffers."""
    x, index, weights, gate_up, down = realistic_inputs(8, 8, 64, 512, 256, torch.bfloat16)
    options = dict(activation="situ", gate_cap=4.0, up_cap=25.0, backend="triton")
    with torch.no_grad():
        moe_decode(x, index, weights, gate_up, down, **options)  # compiles the kernels before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_decode(x, index, weights, gate_up, down, **options)
        for seed in (1, 2):
            new_x, new_index, new_weights, _, _ = realistic_inputs(8, 8, 64, 512, 256, torch.bfloat16, seed=seed)
            x.copy_(new_x), index.copy_(new_index), weights.copy_(new_weights)
            graph.replay()
            assert torch.equal(out, moe_decode(x, index, weights, gate_up, down, **options))
