"""The router's kernels against the PyTorch reference: the logits of a few tokens, the top-k choice (sigmoid scores,
the bias-steered choice of k experts, their renormalised weights); and the model's routing through them.

Without CUDA the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set by conftest.py); on a GPU the same
tests run compiled. Weights: fp32 sigmoid, sum and division in both, a GPU's approximate exp gives a few fp32 ulps,
hence 1e-6 relative. Logits: fp32 products and sums in both, summed in another order, hence 1e-5 of their scale.
"""

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it on machines without CUDA
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from bf16_emulation import emulate_bf16  # noqa: E402
from conftest import tiny_model  # noqa: E402

from kda_moe.kernels.moe import MAX_DECODE_TOKENS, router_logits, routing, sigmoid_top_k, top_k_routing  # noqa: E402
from kda_moe.modeling.modeling_kda_moe import KdaMoeRMSNorm  # noqa: E402

dev = "cpu" if INTERPRETED else "cuda"


def logits_and_bias(N, E, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(N, E, generator=gen) * 3).to(dev), (torch.randn(E, generator=gen) * 0.5).to(dev)


@pytest.mark.parametrize("N,E,D", [(1, 64, 96), (5, 40, 200), (MAX_DECODE_TOKENS, 17, 64)],
                         ids=["one", "ragged", "most"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_logits_kernel_is_the_fp32_product_of_the_states_and_the_weight(N, E, D, dtype):
    """bf16 states are widened exactly, so both sides multiply the same fp32 numbers; expert and width counts that are
    no multiple of the kernel's blocks are masked."""
    gen = torch.Generator().manual_seed(N)
    hidden = torch.randn(N, D, generator=gen).to(dev, dtype)
    weight = torch.randn(E, D, generator=gen).to(dev)
    logits = router_logits(hidden, weight, backend="triton")
    expected = hidden.double() @ weight.double().T
    assert logits.dtype == torch.float32 and logits.shape == (N, E)
    assert torch.allclose(logits.double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


@pytest.mark.parametrize("N", [1, 5, MAX_DECODE_TOKENS], ids=["one", "several", "most"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_input_norm_inside_the_logits_kernel_equals_the_eager_norm_then_the_logits(N, dtype, monkeypatch):
    """The router reads the residual stream and normalises it itself: on both backends, the logits of
    ``KdaMoeRMSNorm``'s rows. fp32: 1e-5 of their scale, as above (the summation order). bf16: the kernel's normalised
    rows are the eager norm's up to the order of its sum of squares, which may move an element's rounding by one
    ulp (at most 2^-7 of it; 2^-6 with the rounding of its product with the norm's weight after it): on top of the
    fp32 bound, 2^-6 of the sum of the magnitudes of a logit's products."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    gen = torch.Generator().manual_seed(N)
    D, E = 200, 40
    hidden = (4 * torch.randn(N, D, generator=gen)).to(dev, dtype)  # a residual stream's rows: far from unit RMS
    weight = torch.randn(E, D, generator=gen).to(dev)
    norm = KdaMoeRMSNorm(D, eps=1e-5).to(dev, dtype)
    norm.weight.data = (torch.rand(D, generator=gen) + 0.5).to(dev, dtype)
    with torch.no_grad():
        normed = norm(hidden)
        expected = router_logits(normed, weight, backend="triton")
        logits = [router_logits(hidden, weight, input_norm=(norm.weight, 1e-5), backend=backend)
                  for backend in ("triton", "torch")]
    magnitudes = normed.float().abs() @ weight.abs().T
    bound = 1e-5 * magnitudes.max() + (0 if dtype == torch.float32 else 2 ** -6 * magnitudes)
    for out in logits:
        assert out.dtype == torch.float32 and out.shape == (N, E)
        assert ((out - expected).abs() <= bound).all()


def test_the_input_norm_is_checked_on_both_backends():
    hidden, weight = torch.randn(3, 32, device=dev), torch.randn(8, 32, device=dev)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=r"input_norm's weight must be \[d\] = \[32\]"):
            router_logits(hidden, weight, input_norm=(torch.ones(16, device=dev), 1e-6), backend=backend)
    with pytest.raises(ValueError, match=r"an input norm's weight \[d\]; .* norm weight \(16,\)"):
        routing.router_logits_triton(hidden, weight, input_norm=(torch.ones(16, device=dev), 1e-6))


def test_logits_kernel_refuses_many_tokens_and_gradients_and_auto_takes_the_reference():
    hidden, weight = torch.randn(MAX_DECODE_TOKENS + 1, 32, device=dev), torch.randn(8, 32, device=dev)
    with pytest.raises(ValueError, match=f"N <= {MAX_DECODE_TOKENS}"):
        router_logits(hidden, weight, backend="triton")
    weight.requires_grad_()
    with pytest.raises(ValueError, match="no backward"):
        router_logits(hidden[:2], weight, backend="triton")
    for tokens in (hidden, hidden[:2]):  # too many tokens; gradients: F.linear, whose gradient reaches the weight
        logits = router_logits(tokens, weight, backend="auto")
        assert torch.equal(logits, torch.nn.functional.linear(tokens, weight))
    logits.sum().backward()
    assert weight.grad is not None


@pytest.mark.parametrize("N,E,k", [(1, 8, 2), (5, 64, 8), (3, 384, 8), (2, 6, 6)], ids=["tiny", "anchor", "k3", "all"])
@pytest.mark.parametrize("renormalize,scale", [(True, 2.5), (False, 1.0)], ids=["renormalized", "raw"])
def test_kernel_chooses_the_references_experts_with_its_weights(N, E, k, renormalize, scale):
    """Same experts in the same order (best first), weights within fp32 rounding."""
    logits, bias = logits_and_bias(N, E)
    weights, indices = top_k_routing(logits, bias, k, renormalize=renormalize, scale=scale, backend="triton")
    expected_weights, expected_indices = sigmoid_top_k(logits, bias, k, renormalize=renormalize, scale=scale)
    assert indices.dtype == torch.int64 and torch.equal(indices, expected_indices)
    assert torch.allclose(weights, expected_weights, rtol=1e-6, atol=0)


def test_a_bf16_bias_is_widened_as_the_reference_widens_it():
    """A model cast with `.to(torch.bfloat16)` holds its selection bias in bf16: the kernel reads it as it is (no cast
    before the launch) and chooses the reference's experts, whose sum promotes the bias to fp32."""
    logits, bias = logits_and_bias(5, 64)
    bias = bias.bfloat16()
    weights, indices = top_k_routing(logits, bias, 8, backend="triton")
    expected_weights, expected_indices = sigmoid_top_k(logits, bias, 8)
    assert torch.equal(indices, expected_indices)
    assert torch.allclose(weights, expected_weights, rtol=1e-6, atol=0)


def test_the_bias_steers_the_choice_but_not_the_weights():
    """A large bias on the weakest expert makes it chosen first; its weight stays its unbiased score."""
    logits, _ = logits_and_bias(1, 16)
    weakest = int(logits.argmin())
    bias = torch.zeros(16, device=dev)
    bias[weakest] = 100.0
    weights, indices = top_k_routing(logits, bias, 4, renormalize=False, backend="triton")
    assert int(indices[0, 0]) == weakest
    assert torch.allclose(weights[0, 0], logits[0, weakest].sigmoid(), rtol=1e-6)


def test_bad_inputs_and_expert_groups_name_the_problem():
    logits, bias = logits_and_bias(2, 8)
    with pytest.raises(ValueError, match="fp32 logits"):
        top_k_routing(logits.double(), bias, 2, backend="triton")
    with pytest.raises(ValueError, match="top_k <= E"):
        top_k_routing(logits, bias, 9, backend="triton")
    with pytest.raises(ValueError, match="expert groups"):
        top_k_routing(logits, bias, 2, n_group=2, topk_group=1, backend="triton")


def test_gradients_and_expert_groups_take_the_reference():
    """Under autograd the weights carry the gradient to the logits; with expert groups only the best groups'
    experts are chosen."""
    logits, bias = logits_and_bias(3, 8)
    logits.requires_grad_()
    weights, _ = top_k_routing(logits, bias, 2, backend="auto")
    weights.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with torch.no_grad():
        _, indices = top_k_routing(logits, bias, 2, n_group=4, topk_group=1, backend="auto")
    assert (indices // 2 == indices[:, :1] // 2).all()  # both experts of one group of two


def test_logits_op_has_a_fake_and_skips_the_dispatcher_without_autograd(monkeypatch):
    """The custom op's fake gives the logits' shape, with and without the norm; without autograd the wrapper calls
    the launch code directly, with the op's result."""
    hidden, weight, norm_weight = (torch.randn(*shape, device=dev) for shape in ((3, 32), (8, 32), (32,)))
    for args in ((hidden, weight, None, 0.0), (hidden, weight, norm_weight, 1e-6)):
        torch.library.opcheck(routing.router_logits_op, args, test_utils=("test_schema", "test_faketensor"))
    dispatched = routing.router_logits_op(hidden, weight, norm_weight, 1e-6)

    def fail(*args):
        raise AssertionError("the router-logits op went through the dispatcher without autograd")

    monkeypatch.setattr(routing, "router_logits_op", fail)
    with torch.no_grad():
        assert torch.equal(router_logits(hidden, weight, input_norm=(norm_weight, 1e-6), backend="triton"), dispatched)


def test_op_has_a_fake_and_skips_the_dispatcher_without_autograd(monkeypatch):
    logits, bias = logits_and_bias(3, 8)
    torch.library.opcheck(routing.sigmoid_top_k_op, (logits, bias, 2, True, 1.0),
                          test_utils=("test_schema", "test_faketensor"))
    dispatched = routing.sigmoid_top_k_op(logits, bias, 2, True, 1.0)

    def fail(*args):
        raise AssertionError("the router op went through the dispatcher without autograd")

    monkeypatch.setattr(routing, "sigmoid_top_k_op", fail)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(top_k_routing(logits, bias, 2, backend="triton"), dispatched))


@pytest.mark.skipif(not INTERPRETED, reason="tests/test_gpu_model.py decodes on the GPU")
def test_model_routes_through_the_kernel_with_the_torch_backends_tokens(monkeypatch):
    """Every sparse layer of every forward of generate() routes through the kernel; greedy tokens equal the torch
    backend's."""
    calls = []
    kernel = routing.sigmoid_top_k_triton
    monkeypatch.setattr("kda_moe.kernels.moe.sigmoid_top_k_triton",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    models = [tiny_model(seed=0, kernel_backend=backend, linear_head_dim=16) for backend in ("triton", "torch")]
    input_ids = torch.randint(1, 97, (2, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = [m.generate(input_ids, max_new_tokens=3, do_sample=False) for m in models]
    sparse = models[0].config.mlp_layer_types.count("sparse")
    assert calls == [8] * sparse + [2] * sparse * 2
    assert torch.equal(tokens[0], tokens[1])
