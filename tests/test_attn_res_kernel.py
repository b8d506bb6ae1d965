"""The fused Block AttnRes mix (Triton forward and backward) against the PyTorch reference, and the model's training
through it.

Without CUDA the kernels run in the Triton interpreter on tiny shapes (``TRITON_INTERPRET=1``, set by conftest.py); on
a GPU the same tests run compiled. fp32 tolerance 1e-5 relative: both sides compute in fp32 and differ only in
summation order (the interpreter measures under 1e-6; a GPU's approximate exp / rsqrt add a few fp32 ulps).
"""

import os

import pytest
import torch
from torch.nn.utils import parametrize

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it on machines without CUDA
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from bf16_emulation import emulate_bf16  # noqa: E402
from conftest import tiny_model  # noqa: E402
from kda_testing import rel  # noqa: E402

from kda_moe.kernels.attn_res import attn_res_mix, mix_kernel  # noqa: E402
from kda_moe.kernels.attn_res.reference import attn_res_mix as reference_mix  # noqa: E402

dev = "cpu" if INTERPRETED else "cuda"
# Comparisons through a softmax of large scores or a whole model amplify a GPU's few-ulp exp / rsqrt differences:
# measured on an H100, 1.9e-5 for a mixer with random pseudo-queries and 1.8e-4 for the model's embedding gradient
# (its KDA kernels read fp32 operands as tf32). The interpreter's numpy math stays under 1e-5.
AMPLIFIED = 1e-5 if INTERPRETED else 1e-3
EPS = 1e-6
SHAPE = (2, 5)  # 10 token rows: not a multiple of the 4-row blocks
# 2-row tiles of 64 channels for d = 40 (24 masked), 10 rows in blocks of 2, three blocks a backward program (the second
# program's last block past the rows)
SMALL_TILES = mix_kernel.MixLaunch(rows=2, block_d=64, warps=1, backward_blocks=3, stages=3)


def mix_inputs(blocks, d, shape=SHAPE, dtype=torch.float32, blocks_dtype=None, seed=0):
    """partial [*shape, d], blocks [N, *shape, d] (in ``dtype`` / ``blocks_dtype``), fp32 norm and query weights [d]
    large enough that the mixture is far from uniform; all leaves that need grad."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    scales = torch.linspace(0.5, 2.0, blocks).view(blocks, *[1] * (len(shape) + 1))  # sources of different sizes
    partial, stored = r(*shape, d), r(blocks, *shape, d) * scales
    inputs = (partial.to(dtype), stored.to(blocks_dtype or dtype), 1 + 0.3 * r(d), r(d))
    return tuple(t.to(dev).requires_grad_() for t in inputs)


def mix_and_grads(inputs, grad_out, backend, dtype=None):
    """The mix of ``inputs`` (cast to ``dtype`` if given) and its gradients in all four inputs for ``grad_out``."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    out = attn_res_mix(*leaves, EPS, backend=backend) if backend else reference_mix(*leaves, EPS)
    return (out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))


@pytest.mark.parametrize("launch", [None, SMALL_TILES], ids=["default_launch", "small_tiles"])
@pytest.mark.parametrize("blocks", [1, 3])
def test_forward_and_gradients_match_the_reference_in_fp32(blocks, launch, monkeypatch):
    """The output and the gradients of partial, blocks, norm weight and query weight, against the fp32 reference and
    the fp64 one, with d = 40 (not a power of two: masked channels) and 10 rows (not a multiple of the row block)."""
    if launch is not None:
        monkeypatch.setattr(mix_kernel, "mix_launch", lambda d: launch)
    inputs = mix_inputs(blocks, 40)
    grad_out = torch.randn(*SHAPE, 40, generator=torch.Generator().manual_seed(1)).to(dev)
    ours = mix_and_grads(inputs, grad_out, "triton")
    for dtype in (torch.float32, torch.float64):
        expected = mix_and_grads(inputs, grad_out, None, dtype)
        for name, a, b in zip(("out", "partial", "blocks", "norm_weight", "query_weight"), ours, expected):
            assert a.dtype == torch.float32 and a.shape == b.shape
            assert rel(a, b) < 1e-5, (name, dtype, rel(a, b))


@pytest.mark.parametrize("blocks_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32_blocks"])
def test_bf16_outputs_round_the_fp32_result_once(blocks_dtype, monkeypatch):
    """bf16 sources (and fp32 blocks with a bf16 partial sum, as under autocast): fp32 math from the sources' values,
    one rounding of each output and source gradient to its dtype, so every element lies within 2^-8 relative of the
    fp64 result (half a bf16 ulp is 2^-9) plus the fp32 math's error, 2^-20 of the largest element (a sum of terms
    of either sign errs relative to its terms, not to a result that cancels to near zero). The weight gradients stay
    fp32 (1e-5)."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    monkeypatch.setattr(mix_kernel, "mix_launch", lambda d: SMALL_TILES)
    inputs = mix_inputs(3, 40, dtype=torch.bfloat16, blocks_dtype=blocks_dtype)
    grad_out = torch.randn(*SHAPE, 40, generator=torch.Generator().manual_seed(1)).to(dev)
    ours = mix_and_grads(inputs, grad_out.to(torch.bfloat16), "triton")
    exact = mix_and_grads(inputs, grad_out.to(torch.bfloat16), None, torch.float64)
    assert [t.dtype for t in ours] == [torch.bfloat16, torch.bfloat16, blocks_dtype, torch.float32, torch.float32]
    for name, a, b in zip(("out", "partial", "blocks"), ours[:3], exact[:3]):
        excess = (a.double() - b).abs() - (2 ** -8 * b.abs() + 2 ** -20 * b.abs().max())
        worst = excess.argmax()
        assert excess.max() <= 0, (name, a.flatten()[worst].item(), b.flatten()[worst].item())
    for a, b in zip(ours[3:], exact[3:]):
        assert rel(a, b) < 1e-5


def test_each_rows_output_is_the_same_wherever_the_row_sits():
    """A row's output, bit for bit, does not depend on the other rows or its position (RL trainers re-order rows)."""
    partial, blocks, norm_weight, query_weight = (t.detach() for t in mix_inputs(3, 40, shape=(10,)))
    out = attn_res_mix(partial, blocks, norm_weight, query_weight, EPS, backend="triton")
    permutation = torch.randperm(10, generator=torch.Generator().manual_seed(2)).to(dev)
    permuted = attn_res_mix(partial[permutation], blocks[:, permutation], norm_weight, query_weight, EPS,
                            backend="triton")
    assert torch.equal(permuted, out[permutation])
    alone = attn_res_mix(partial[7:8], blocks[:, 7:8], norm_weight, query_weight, EPS, backend="triton")
    assert torch.equal(alone, out[7:8])


def test_weight_gradients_are_deterministic():
    inputs = mix_inputs(2, 40)
    grad_out = torch.randn(*SHAPE, 40).to(dev)
    first, second = (mix_and_grads(inputs, grad_out, "triton") for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize(
    "problem,match",
    [("blocks_shape", r"blocks must be \[N, \*partial.shape\]"), ("no_blocks", "N >= 1"),
     ("weight_shape", r"must be \[d\] = \[40\]")],
)
def test_bad_inputs_name_the_problem(problem, match):
    partial, blocks, norm_weight, query_weight = (t.detach() for t in mix_inputs(2, 40))
    if problem == "blocks_shape":
        blocks = blocks[:, :, :3]
    elif problem == "no_blocks":
        blocks = blocks[:0]
    else:
        query_weight = query_weight[None]
    with pytest.raises(ValueError, match=match):
        attn_res_mix(partial, blocks, norm_weight, query_weight, EPS, backend="triton")


def test_rows_wider_than_the_kernels_take_are_refused_with_the_fix(monkeypatch):
    """A program holds whole rows: past `MAX_MIX_WIDTH` channels an explicit Triton backend names the limit and the
    reference (here a limit of 32 against d = 40)."""
    import kda_moe.kernels.attn_res as attn_res

    monkeypatch.setattr(attn_res, "MAX_MIX_WIDTH", 32)
    partial, blocks, norm_weight, query_weight = (t.detach() for t in mix_inputs(2, 40))
    with pytest.raises(ValueError, match=r"takes d <= 32, got d = 40; use backend=\"torch\""):
        attn_res_mix(partial, blocks, norm_weight, query_weight, EPS, backend="triton")


def test_ops_have_fakes_and_a_registered_backward():
    inputs = tuple(t.detach() for t in mix_inputs(2, 40))
    torch.library.opcheck(mix_kernel.attn_res_mix_fwd_op, (*inputs, EPS),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    _, weights, rstd = mix_kernel.attn_res_mix_fwd_op(*inputs, EPS)
    torch.library.opcheck(mix_kernel.attn_res_mix_bwd_op, (*inputs, weights, rstd, inputs[0]),
                          test_utils=("test_schema", "test_faketensor"))


class Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def test_parametrized_weights_reach_the_kernel_as_tensors():
    """A parametrization on the AttnRes norm weight (what PEFT-style adapters do): the Triton path gets the computed
    tensor and the gradient reaches the original weight, as on the reference path."""
    model = tiny_model(seed=4, attn_res_block_size=2)
    mixer = model.model.layers[3].attn_res.to(dev)
    partial, blocks, norm_weight, query_weight = (t.detach() for t in mix_inputs(2, 32, shape=(2, 3)))
    with torch.no_grad():
        mixer.norm.weight.copy_(norm_weight)
        mixer.proj.weight.copy_(query_weight[None])
    parametrize.register_parametrization(mixer.norm, "weight", Doubled())
    results = []
    for backend in ("triton", "torch"):
        mixer.backend = backend
        mixer.zero_grad()
        out = mixer(partial, blocks)
        out.square().sum().backward()
        original = mixer.norm.parametrizations.weight.original
        results.append((out, original.grad.clone(), mixer.proj.weight.grad.clone()))
    expected = reference_mix(partial, blocks, 2 * norm_weight, query_weight, mixer.norm.variance_epsilon)
    assert rel(results[0][0], expected) < AMPLIFIED
    for a, b in zip(*results):
        assert rel(a, b) < AMPLIFIED


def test_model_loss_and_gradients_are_the_same_with_the_triton_mix():
    """The tiny model (every K3 feature on, Triton kernels elsewhere) with its AttnRes modules on the Triton mix and on
    the PyTorch reference: same loss and same gradient of every parameter."""
    results = []
    for attn_res_backend in ("triton", "torch"):
        model = tiny_model(seed=0, kernel_backend="triton", linear_head_dim=16).to(dev).train()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("res.proj.weight"):  # away from zero: a non-uniform mixture
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
        mixers = [m for m in model.modules() if type(m).__name__ == "KdaMoeAttnRes"]
        assert len(mixers) == 10
        for mixer in mixers:
            mixer.backend = attn_res_backend
        input_ids = torch.randint(1, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(4))
        loss = model(input_ids.to(dev), labels=input_ids.to(dev)).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (expected_loss, expected_grads) = results
    assert rel(loss, expected_loss) < AMPLIFIED and grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert rel(grad, expected_grads[name]) < AMPLIFIED, (name, rel(grad, expected_grads[name]))


def test_torch_compile_traces_the_mix_as_one_op_with_its_backward():
    """torch.compile (fullgraph) takes the Triton mix as its custom op and the backward through the registered one."""
    inputs = mix_inputs(2, 40)
    grad_out = torch.randn(*SHAPE, 40).to(dev)
    compiled = torch.compile(lambda *x: attn_res_mix(*x, EPS, backend="triton"), backend="eager", fullgraph=True)
    out = compiled(*inputs)
    got = (out, *torch.autograd.grad(out, inputs, grad_out))
    assert all(torch.equal(a, b) for a, b in zip(got, mix_and_grads(inputs, grad_out, "triton")))
