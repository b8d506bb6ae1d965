"""The routed experts of many tokens on the Triton path (``kernels/moe/grouped.py``: pairs sorted by expert, grouped
GEMMs, the gated activation with the routing weights in one kernel) against the PyTorch reference and transformers'
grouped_mm experts, and the model's training through it.

Without CUDA the kernel runs in the Triton interpreter on tiny shapes (``TRITON_INTERPRET=1``, set by conftest.py); on
a GPU the same tests run compiled. fp32 tolerance 1e-5 relative: every side computes in fp32 and they differ in the
order of their sums only (the routing weight is applied before the down projection here, after it elsewhere).
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

from kda_moe.kernels.moe import grouped, grouped_experts  # noqa: E402
from kda_moe.modeling.modeling_kda_moe import KdaMoeExperts  # noqa: E402

dev = "cpu" if INTERPRETED else "cuda"
N, K, E, L, I = 13, 3, 5, 16, 24  # 39 pairs: not a multiple of the kernel's 8 rows; expert 4 gets no token
ACTIVATIONS = [("silu", None), ("situ", None), ("situ", 2.0)]
SMALL_SLICES = grouped.GluLaunch(rows=8, block_inter=16, warps=1)  # I = 24 in two slices, the last one partial


def expert_inputs(dtype=torch.float32, seed=0):
    """hidden [N, L], top_k_index / top_k_weights [N, K] (distinct experts per token, none choosing expert 4),
    gate_up_proj [E, 2I, L], down_proj [E, L, I]; every floating tensor a leaf that needs grad."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E - 1, generator=gen)[:K] for _ in range(N)])
    floats = (torch.randn(N, L, generator=gen), torch.rand(N, K, generator=gen) + 0.1,
              torch.randn(E, 2 * I, L, generator=gen) / L**0.5, torch.randn(E, L, I, generator=gen) / I**0.5)
    hidden, weights, gate_up, down = (t.to(dev, dtype).requires_grad_() for t in floats)
    return hidden, index.to(dev), weights, gate_up, down


def experts_and_grads(inputs, grad_out, kind, up_cap, backend, dtype=None):
    """The experts' output for ``inputs`` (floats cast to ``dtype`` if given) and its gradients in the hidden states,
    the routing weights and both weights."""
    hidden, index, weights, gate_up, down = inputs
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (hidden, weights, gate_up, down)]
    out = grouped_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], activation=kind, gate_cap=3.0,
                          up_cap=up_cap, backend=backend)
    return (out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))


@pytest.mark.parametrize("launch", [None, SMALL_SLICES], ids=["default_launch", "two_slices"])
@pytest.mark.parametrize("kind,up_cap", ACTIVATIONS, ids=["swiglu", "situ", "situ_up_cap"])
def test_output_and_gradients_match_the_reference_in_fp32(kind, up_cap, launch, monkeypatch):
    if launch is not None:
        monkeypatch.setattr(grouped, "glu_launch", lambda intermediate: launch)
    inputs = expert_inputs()
    grad_out = torch.randn(N, L, generator=torch.Generator().manual_seed(1)).to(dev)
    ours = experts_and_grads(inputs, grad_out, kind, up_cap, "triton")
    for dtype in (torch.float32, torch.float64):
        expected = experts_and_grads(inputs, grad_out, kind, up_cap, "torch", dtype)
        for name, a, b in zip(("out", "hidden", "weights", "gate_up_proj", "down_proj"), ours, expected):
            assert a.dtype == torch.float32 and a.shape == b.shape
            assert rel(a, b) < 1e-5, (name, dtype, rel(a, b))
    assert ours[3][4].abs().sum() == 0 and ours[4][4].abs().sum() == 0  # the expert nobody chose gets no gradient


@pytest.mark.parametrize("kind,up_cap", ACTIVATIONS[1:], ids=["situ", "situ_up_cap"])
def test_output_and_gradients_match_transformers_grouped_mm_experts(kind, up_cap):
    """The same function as transformers' grouped_mm experts, which the experts module runs on the PyTorch backend."""
    config = tiny_config(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, routed_expert_hidden_size=L,
                         hidden_act=kind, activation_situ_beta=3.0, activation_situ_linear_beta=up_cap)
    config._experts_implementation = "grouped_mm"
    module = KdaMoeExperts(config).to(dev)
    inputs = expert_inputs(seed=2)
    hidden, index, weights, gate_up, down = (t.detach() for t in inputs)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    grad_out = torch.randn(N, L, generator=torch.Generator().manual_seed(3)).to(dev)
    x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = module(x, index, w)
    assert not module.takes_grouped_kernel(x)  # the PyTorch backend: transformers' function
    expected = (out, *torch.autograd.grad(out, (x, w, module.gate_up_proj, module.down_proj), grad_out))
    for a, b in zip(experts_and_grads(inputs, grad_out, kind, up_cap, "triton"), expected):
        assert rel(a, b) < 1e-5


def test_bf16_output_and_gradients_are_within_bf16_rounding_of_fp64(monkeypatch):
    """bf16 in and out: the grouped GEMMs round gate_up and y to bf16, the kernel rounds h once, the pair sum is fp32
    and rounds once; each of those roundings is at most 2^-9 relative, so the output and the gradients stay within
    2e-2 of the fp64 result (relative Frobenius error; measured 4e-3 to 7e-3, as the PyTorch reference in bf16)."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    inputs = expert_inputs(seed=4)
    grad_out = torch.randn(N, L, generator=torch.Generator().manual_seed(5)).to(dev)
    ours = experts_and_grads(inputs, grad_out, "situ", 2.0, "triton", torch.bfloat16)
    exact = experts_and_grads(inputs, grad_out, "situ", 2.0, "torch", torch.float64)
    for name, a, b in zip(("out", "hidden", "weights", "gate_up_proj", "down_proj"), ours, exact):
        assert a.dtype == torch.bfloat16
        assert rel(a.double(), b) < 2e-2, (name, rel(a.double(), b))


def test_output_is_deterministic_and_follows_the_tokens_when_they_are_reordered():
    """The same call gives the same bits (no atomics: each token's pairs are summed in its choice order), and
    re-ordered tokens get their outputs re-ordered, within fp32 rounding: a token's rows then sit elsewhere in its
    experts' grouped GEMMs, whose tiling may sum them in another order."""
    hidden, index, weights, gate_up, down = (t.detach() for t in expert_inputs(seed=6))
    run = lambda h, i, w: grouped_experts(h, i, w, gate_up, down, activation="situ", gate_cap=3.0, up_cap=2.0,  # noqa: E731
                                          backend="triton")
    out = run(hidden, index, weights)
    assert torch.equal(run(hidden, index, weights), out)
    permutation = torch.randperm(N, generator=torch.Generator().manual_seed(7)).to(dev)
    assert rel(run(hidden[permutation], index[permutation], weights[permutation]), out[permutation]) < 1e-6


def test_ops_have_fakes_and_a_registered_backward():
    gate_up = torch.randn(11, 2 * I, device=dev)
    weights = torch.rand(11, device=dev)
    for situ, up_cap in ((False, None), (True, 2.0)):
        args = (gate_up, weights, situ, 3.0, up_cap)
        torch.library.opcheck(grouped.weighted_glu_op, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
        torch.library.opcheck(grouped.weighted_glu_bwd_op, (gate_up, weights, torch.randn(11, I, device=dev), situ,
                                                            3.0, up_cap), test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_the_experts_with_their_backward():
    """torch.compile (fullgraph): the kernel as its custom op, the pair permutations and grouped GEMMs as they are.
    On CUDA in bf16, where compiled code takes torch's grouped_mm: for other dtypes compiled code takes transformers'
    per-expert fallback, whose backward on CUDA gives wrong gradients in transformers 5.17 (measured on an H100: the
    forward right, every gradient off), also under transformers' own grouped_mm experts."""
    inputs = expert_inputs(seed=8, dtype=torch.float32 if INTERPRETED else torch.bfloat16)
    hidden, index, weights, gate_up, down = inputs
    grad_out = torch.randn(N, L).to(dev, hidden.dtype)
    compiled = torch.compile(lambda h, w, gu, d: grouped_experts(h, index, w, gu, d, activation="situ", gate_cap=3.0,
                                                                 up_cap=2.0, backend="triton"),
                             backend="eager", fullgraph=True)
    out = compiled(hidden, weights, gate_up, down)
    got = (out, *torch.autograd.grad(out, (hidden, weights, gate_up, down), grad_out))
    for a, b in zip(got, experts_and_grads(inputs, grad_out, "situ", 2.0, "triton")):
        assert rel(a, b) < 1e-6


def test_model_training_takes_the_grouped_kernel_with_the_same_loss_and_gradients(monkeypatch):
    """The tiny model (every K3 feature on, Triton kernels) under `experts_implementation="grouped_mm"`: its training
    forward runs every sparse layer's experts through `grouped_experts`, and gives the loss and the gradient of every
    parameter that transformers' grouped_mm experts give (the experts' backend set to the PyTorch one)."""
    calls = []
    kernel = grouped.grouped_experts_triton
    monkeypatch.setattr("kda_moe.kernels.moe.grouped_experts_triton",
                        lambda *a, **kw: calls.append(a[0].shape) or kernel(*a, **kw))
    input_ids = torch.randint(1, 98, (2, 19), generator=torch.Generator().manual_seed(9)).to(dev)
    results = []
    for experts_backend in ("triton", "torch"):
        model = tiny_model(seed=0, kernel_backend="triton", linear_head_dim=16, vocab_size=98,
                           experts_implementation="grouped_mm").to(dev).train()
        experts = [m for m in model.modules() if type(m).__name__ == "KdaMoeExperts"]
        for module in experts:
            module.backend = experts_backend
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert len(calls) == len(experts) and all(shape == (38, experts[0].hidden_dim) for shape in calls)
    (loss, grads), (expected_loss, expected_grads) = results
    assert rel(loss, expected_loss) < 1e-5 and grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert rel(grad, expected_grads[name]) < 1e-5, (name, rel(grad, expected_grads[name]))


def test_expert_parallel_shards_keep_transformers_experts():
    """An expert-parallel shard routes tokens of other ranks' experts with an id past its own: the grouped kernel,
    which takes every id as one of its experts, leaves such modules to transformers' implementation."""
    config = tiny_config(kernel_backend="triton", experts_implementation="grouped_mm")
    config._experts_implementation = "grouped_mm"
    experts = KdaMoeExperts(config).to(dev)
    hidden = torch.randn(70, config.routed_expert_hidden_size, device=dev)
    assert experts.takes_grouped_kernel(hidden)
    experts._is_expert_parallel = True  # what transformers' expert-parallel plan sets (5.19+)
    assert not experts.takes_grouped_kernel(hidden)
    experts._is_expert_parallel = False
    experts.num_experts += 1  # up to 5.18 a shard holds fewer experts than the model's count
    assert not experts.takes_grouped_kernel(hidden)



class Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def test_parametrized_expert_weights_reach_the_grouped_kernel_as_tensors():
    """A parametrization on the experts' weights (what PEFT's expert adapters are): the grouped path reads the
    computed weights and the gradients reach the original ones, as on transformers' path."""
    from torch.nn.utils import parametrize

    inputs = expert_inputs(seed=10)
    hidden, index, weights = (t.detach() for t in inputs[:3])
    results = []
    for backend in ("triton", "torch"):
        config = tiny_config(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I, routed_expert_hidden_size=L,
                             kernel_backend=backend)
        config._experts_implementation = "grouped_mm"
        experts = KdaMoeExperts(config).to(dev)
        with torch.no_grad():
            experts.gate_up_proj.copy_(inputs[3])
            experts.down_proj.copy_(inputs[4])
        parametrize.register_parametrization(experts, "gate_up_proj", Doubled())
        x = hidden.clone().requires_grad_()
        assert experts.takes_grouped_kernel(x) == (backend == "triton")
        out = experts(x, index, weights)
        out.square().sum().backward()
        results.append((out, x.grad, experts.parametrizations.gate_up_proj.original.grad, experts.down_proj.grad))
    for a, b in zip(*results):
        assert rel(a, b) < 1e-5


def test_decoding_past_the_decode_kernel_under_batched_mm_takes_the_grouped_kernel(monkeypatch):
    """generate() switches grouped_mm to batched_mm while decoding (`_optimize_model_for_decode`): a forward without
    autograd of more tokens than the decode kernel takes then runs the grouped kernel (each expert read once, not
    once per token) with batched_mm's logits; with autograd batched_mm keeps its own forward."""
    from kda_moe.kernels import moe

    calls = []
    kernel = grouped.grouped_experts_triton
    monkeypatch.setattr("kda_moe.kernels.moe.grouped_experts_triton",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    model = tiny_model(seed=0, kernel_backend="triton", linear_head_dim=16, experts_implementation="batched_mm").to(dev)
    reference = tiny_model(seed=0, linear_head_dim=16, experts_implementation="batched_mm").to(dev)
    sparse_layers = model.config.mlp_layer_types.count("sparse")
    input_ids = torch.randint(1, 97, (1, moe.MAX_DECODE_TOKENS + 1), generator=torch.Generator().manual_seed(3))
    input_ids = input_ids.to(dev)
    with torch.no_grad():
        logits = model(input_ids).logits
        assert calls == [moe.MAX_DECODE_TOKENS + 1] * sparse_layers
        assert rel(logits, reference(input_ids).logits) < (1e-5 if INTERPRETED else 1e-3)
    model(input_ids)  # with autograd: transformers' batched_mm
    assert len(calls) == sparse_layers
