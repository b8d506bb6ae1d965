"""The projection kernel (several bias-free linear layers of the same few token rows in one launch) against
F.linear, and the model's decoding through it.

Without CUDA the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set by conftest.py); on a GPU the same
tests run compiled. fp32 tolerance: the kernel multiplies in full fp32 (no tf32), so only the summation order
differs from the float64 product: a few fp32 ulps of the largest output, hence 1e-6.
"""

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it on machines without CUDA
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from bf16_emulation import emulate_bf16  # noqa: E402
from conftest import tiny_model  # noqa: E402
from kda_testing import rel  # noqa: E402

from kda_moe.kernels import linear  # noqa: E402
from kda_moe.kernels.linear import MAX_PROJECTION_TOKENS, MAX_PROJECTIONS, decode, decode_projections  # noqa: E402
from kda_moe.modeling.modeling_kda_moe import KdaMoeRMSNorm, KdaMoeSparseMoeBlock  # noqa: E402

dev = "cpu" if INTERPRETED else "cuda"
GREEDY = dict(max_new_tokens=3, do_sample=False)
TRITON_HEADS = dict(linear_head_dim=16)  # the Triton KDA kernels' least head dim
WIDTHS = (40, 8, 17, 64, 16, 5)  # widths of six weights: no multiple of the 16-channel blocks among most of them


def weights_and_input(tokens, widths=WIDTHS, hidden=72, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, hidden, generator=gen).to(dev, dtype) for n in widths]
    return torch.randn(tokens, hidden, generator=gen).to(dev, dtype), weights


@pytest.mark.parametrize("tokens", [1, 5, MAX_PROJECTION_TOKENS])
@pytest.mark.parametrize("count", [1, 2, MAX_PROJECTIONS])
def test_kernel_matches_f_linear_in_fp32(tokens, count):
    x, weights = weights_and_input(tokens, WIDTHS[:count])
    outputs = decode_projections(x, weights, backend="triton")
    assert len(outputs) == count
    for w, out in zip(weights, outputs):
        reference = F.linear(x.double(), w.double())
        assert out.shape == (tokens, w.shape[0]) and out.dtype == torch.float32
        assert (out.double() - reference).abs().max() <= 1e-6 * reference.abs().max()


@pytest.mark.parametrize("tokens,rows,block_out", [(1, 1, 4), (3, 4, 8), (5, 16, 8)])
def test_narrow_tiles_multiply_on_the_cuda_cores_to_the_same_products(tokens, rows, block_out):
    """Tiles narrower than tl.dot's 16 (one unpadded token row, or 4 / 8 output channels a program) take the CUDA
    cores' products (``accumulate_products``): the same fp32 products, within the same 1e-6."""
    x, weights = weights_and_input(tokens)
    launch = decode.ProjectionLaunch(rows=rows, block_out=block_out, block_k=32, warps=1, stages=1)
    for w, out in zip(weights, decode.launch_projections(x, weights, launch)):
        reference = F.linear(x.double(), w.double())
        assert out.shape == (tokens, w.shape[0])
        assert (out.double() - reference).abs().max() <= 1e-6 * reference.abs().max()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grouped_weights_leave_as_one_tensor_of_their_products_side_by_side(backend):
    """``group_sizes=[3, 1, 2]``: the first three products in one ``[N, 40 + 8 + 17]`` tensor (contiguous, as the
    short conv reads it), then the fourth alone, then the last two side by side; the same on both backends."""
    x, weights = weights_and_input(5)
    outputs = decode_projections(x, weights, backend=backend, group_sizes=[3, 1, 2])
    expected = [torch.cat([F.linear(x.double(), w.double()) for w in group], dim=-1)
                for group in (weights[:3], weights[3:4], weights[4:])]
    assert [out.shape for out in outputs] == [(5, 65), (5, 64), (5, 21)]
    assert all(out.is_contiguous() for out in outputs)
    for out, reference in zip(outputs, expected):
        assert (out.double() - reference).abs().max() <= 1e-6 * reference.abs().max()
    with pytest.raises(ValueError, match="group_sizes must be positive and add up to the 6 weights"):
        decode_projections(x, weights, backend=backend, group_sizes=[3, 2])


def test_bf16_rounds_the_fp32_sum_once(monkeypatch):
    """bf16 inputs, fp32 accumulation, one rounding of the result (as cuBLAS): each output within one bf16 rounding
    (2^-8 relative) of the float64 product."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    x, weights = weights_and_input(3, dtype=torch.bfloat16)
    for w, out in zip(weights, decode_projections(x, weights, backend="triton")):
        assert out.dtype == torch.bfloat16
        assert rel(out.double(), F.linear(x.double(), w.double())) < 2 ** -8


@pytest.mark.parametrize("tokens", [1, 3, MAX_PROJECTION_TOKENS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_residual_inside_the_kernel_equal_the_eager_layer(tokens, dtype, monkeypatch):
    """A pre-norm layer's first projections take the RMSNorm in the kernel, its last one the residual add: the
    same as ``KdaMoeRMSNorm``, F.linear and ``+``, rounded where they round. fp32: within 1e-6 of the largest output
    (summation order, as above); bf16: within one rounding of the output (2^-8), the kernel's rows being the eager
    norm's rows up to the order of the sum of squares (which may move a row's rounding by one ulp)."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    x, weights = weights_and_input(tokens, dtype=dtype)
    x = 4 * x  # a residual stream's rows: far from unit RMS
    norm = KdaMoeRMSNorm(x.shape[1], eps=1e-5).to(dev, dtype)
    norm.weight.data = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(1)).to(dev, dtype) + 0.5
    residual = torch.randn(tokens, weights[0].shape[0], device=dev).to(dtype)
    with torch.no_grad():
        normed = norm(x)
        outputs = decode_projections(x, weights, backend="triton", input_norm=(norm.weight, 1e-5))
        (added,) = decode_projections(normed, weights[:1], backend="triton", residual=residual)
        (both,) = decode_projections(x, weights[:1], backend="triton", input_norm=(norm.weight, 1e-5),
                                     residual=residual)
    bound = 1e-6 if dtype == torch.float32 else 2 ** -8
    for w, out in zip(weights, outputs):
        reference = F.linear(normed, w)
        assert (out.double() - reference.double()).abs().max() <= bound * reference.abs().max()
    for out in (added, both):
        reference = residual + F.linear(normed, weights[0])
        assert (out.double() - reference.double()).abs().max() <= bound * reference.abs().max()


def test_norm_and_residual_are_checked_on_both_backends():
    x, weights = weights_and_input(3)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match="input_norm's weight must be"):
            decode_projections(x, weights, backend=backend, input_norm=(torch.ones(5, device=dev), 1e-6))
        with pytest.raises(ValueError, match="a residual is added to the products of one weight"):
            decode_projections(x, weights, backend=backend, residual=torch.zeros(3, 40, device=dev))
        with pytest.raises(ValueError, match="a residual is added to the products of one weight"):
            decode_projections(x, weights[:1], backend=backend, residual=torch.zeros(3, 41, device=dev))


@pytest.mark.parametrize(
    "problem,match",
    [
        ("too_many_tokens", "at most 16 rows"),
        ("too_many_weights", "1 to 6 contiguous weights"),
        ("dtype", "of that dtype"),
        ("transposed_weight", "contiguous weights"),
    ],
)
def test_bad_inputs_name_the_problem(problem, match):
    x, weights = weights_and_input(MAX_PROJECTION_TOKENS + 1 if problem == "too_many_tokens" else 2)
    if problem == "too_many_weights":
        weights = weights + weights[:1]
    elif problem == "dtype":
        weights[1] = weights[1].double()
    elif problem == "transposed_weight":
        weights[0] = torch.randn(x.shape[1], 40, device=dev).T
    with pytest.raises(ValueError, match=match):
        decode_projections(x, weights, backend="triton")


def test_gradients_keep_f_linear():
    """Under autograd (the kernel has no backward) "auto" multiplies with F.linear and the gradients flow."""
    x, weights = weights_and_input(2)
    weights = [w.requires_grad_() for w in weights]
    sum(out.sum() for out in decode_projections(x, weights, backend="auto")).backward()
    assert all(torch.equal(w.grad, x.sum(0).expand_as(w)) for w in weights)


def test_op_has_a_fake_and_skips_the_dispatcher_without_autograd(monkeypatch):
    """The custom op's fake gives the outputs' shapes (what torch.compile traces); without autograd the wrapper calls
    the launch code directly, with the op's result."""
    x, weights = weights_and_input(3)
    for group_sizes in ([1] * len(weights), [3, 1, 2]):
        torch.library.opcheck(decode.decode_projections_op, (x, weights, group_sizes, None, 0.0, None),
                              test_utils=("test_schema", "test_faketensor"))
    norm_weight, residual = torch.rand(x.shape[1], device=dev), torch.randn(3, weights[0].shape[0], device=dev)
    torch.library.opcheck(decode.decode_projections_op, (x, weights[:1], [1], norm_weight, 1e-6, residual),
                          test_utils=("test_schema", "test_faketensor"))
    dispatched = decode.decode_projections_op(x, weights, [1] * len(weights), None, 0.0, None)

    def fail(*args):
        raise AssertionError("the projection op went through the dispatcher without autograd")

    monkeypatch.setattr(decode, "decode_projections_op", fail)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(decode_projections(x, weights, backend="triton"), dispatched))


def count_kernel_calls(monkeypatch) -> list:
    calls = []
    kernel = linear.decode_projections_triton
    monkeypatch.setattr(linear, "decode_projections_triton",
                        lambda x, w, *options: calls.append((x.shape[0], len(w))) or kernel(x, w, *options))
    return calls


@pytest.mark.skipif(not INTERPRETED, reason="tests/test_gpu_model.py decodes on the GPU")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_model_decodes_through_the_kernel_with_the_torch_backends_tokens(cache, monkeypatch):
    """Prefill (2 x 4 = 8 token rows) and decoding steps (2 rows) of every layer take the kernel: a KDA layer's six
    input projections, an MLA layer's three (query factor, latent, output gate), each dense MLP's and shared expert's
    gate and up, then its down, and each attention's output projection; greedy tokens equal the torch backend's,
    scores within fp32 rounding."""
    calls = count_kernel_calls(monkeypatch)
    models = [tiny_model(seed=0, kernel_backend=backend, **TRITON_HEADS) for backend in ("triton", "torch")]
    config = models[0].config
    input_ids = torch.randint(1, config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    options = dict(cache_implementation="static") if cache == "static" else {}
    with torch.no_grad():
        out = [m.generate(input_ids, output_scores=True, return_dict_in_generate=True, **GREEDY, **options)
               for m in models]
    per_forward = sorted([6] * config.layer_types.count("linear_attention")
                         + [3] * config.layer_types.count("full_attention") + [2, 1] * config.num_hidden_layers
                         + [1] * config.num_hidden_layers)
    forwards = [calls[i : i + len(per_forward)] for i in range(0, len(calls), len(per_forward))]
    steps = GREEDY["max_new_tokens"] - 1
    assert [rows for rows, _ in calls] == [8] * len(per_forward) + [2] * len(per_forward) * steps
    assert all(sorted(count for _, count in forward) == per_forward for forward in forwards)
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel(torch.stack(out[0].scores), torch.stack(out[1].scores)) < 1e-5


@pytest.mark.skipif(not INTERPRETED, reason="tests/test_gpu_model.py decodes on the GPU")
@pytest.mark.parametrize("latent", [16, None])
@pytest.mark.parametrize("shape", [(1, 1), (2, 3)])
def test_one_token_forwards_normalise_inside_the_kernels(latent, shape, monkeypatch):
    """A forward of one token without autograd never calls the RMSNorms in front of the sublayers: the attention and
    MLP projections, the router's logits and, without a latent projection, the MoE decode kernels apply them to the
    rows they read (the LatentMoE's own projection takes the norm's output, so there the block calls it). With more
    tokens every norm runs once as a module and the projection kernels still run. The logits equal the torch
    backend's within fp32 rounding."""
    called = []
    forward = KdaMoeRMSNorm.forward
    monkeypatch.setattr(KdaMoeRMSNorm, "forward", lambda self, x: called.append(self) or forward(self, x))
    kernel_calls = count_kernel_calls(monkeypatch)
    models = [tiny_model(seed=0, kernel_backend=backend, routed_expert_hidden_size=latent, **TRITON_HEADS)
              for backend in ("triton", "torch")]
    input_ids = torch.randint(1, models[0].config.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    logits = []
    for model in models:
        called.clear()
        with torch.no_grad():
            logits.append(model(input_ids).logits)
        layers = model.model.layers
        sublayer_norms = [norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        calls = [sum(norm is c for c in called) for norm in sublayer_norms]
        if model.config.kernel_backend == "torch" or input_ids.numel() > 1:
            assert calls == [1] * len(sublayer_norms)
        else:  # each layer's input norm, then its MLP's: only a LatentMoE's is called
            folded_mlp = [latent is None or not isinstance(layer.mlp, KdaMoeSparseMoeBlock) for layer in layers]
            assert calls == [count for folded in folded_mlp for count in (0, 0 if folded else 1)]
    assert {rows for rows, _ in kernel_calls} == {input_ids.numel()}  # the Triton model's projections, every one
    assert rel(logits[0], logits[1]) < 1e-5


def test_hooked_or_adapted_projections_are_called_as_modules(monkeypatch):
    """A linear layer with a hook (tensor-parallel plans, offloading) or an adapter keeps its own call: its layer's
    projections all go module by module."""
    calls = count_kernel_calls(monkeypatch)
    model = tiny_model(seed=0, kernel_backend="triton", **TRITON_HEADS).to(dev)
    attention = model.model.layers[0].self_attn
    seen = []
    attention.k_proj.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    with torch.no_grad():
        model(torch.tensor([[5, 6]], device=dev))
    assert seen == [(1, 2, attention.k_proj.out_features)]
    kda_layers = model.config.layer_types.count("linear_attention")
    assert [count for _, count in calls].count(6) == kda_layers - 1  # the hooked layer's six went one by one


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU the benchmark runs for real")
def test_benchmark_writes_its_rows_and_table(tmp_path, monkeypatch):
    """benchmarks/decode_projections.py end to end on CPU (fp32, stand-in timings, a KDA set of six narrow weights
    with q | k | v grouped, and one weight alone): the plumbing and the kernel's error, not the numbers."""
    import json
    import sys

    from benchmark_testing import load_benchmark, stand_in_timings

    bench = load_benchmark("decode_projections.py")
    stand_in_timings(bench, monkeypatch)
    launches = bench.launches
    monkeypatch.setattr(bench, "launches", lambda tokens: launches(tokens)[:2])  # the pick and one other
    monkeypatch.setattr(bench, "HIDDEN", 32)
    monkeypatch.setattr(bench, "SETS", {"kda": (16, 16, 16, 8, 2, 8), "o_proj": (32,)})
    monkeypatch.setattr(sys, "argv", ["decode_projections.py", str(tmp_path), "tokens=1,3", "tune"])
    bench.main(str(tmp_path))
    rows = json.loads((tmp_path / "decode_projections.json").read_text())["rows"]
    assert [(r["set"], r["N"], r["weights"]) for r in rows] == [("kda", 1, 6), ("kda", 3, 6), ("o_proj", 1, 1),
                                                                 ("o_proj", 3, 1)]
    assert all(r["rel_err"] < 1e-6 and r["ours_us"] == r["cublas_us"] == 1000.0 for r in rows)
    assert all(len(r["launch_us"]) == 2 and r["launch"] in r["launch_us"] for r in rows)
    assert "- o_proj N=3: " in (tmp_path / "decode_projections.md").read_text()
