"""The fused KDA layer decode step (conv step, KDA step and gated RMSNorm in one Triton kernel) against the three
reference ops it replaces, and the model's decoding through it.

Without CUDA the kernel runs in the Triton interpreter on tiny shapes (``TRITON_INTERPRET=1``, set by conftest.py);
on a GPU the same tests run compiled, plus the full-size and CUDA-graph tests. fp32 tolerances: the interpreter
measures 3e-7 at most; a GPU's approximate exp / rsqrt add a few fp32 ulps, hence 1e-5.
"""

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it on machines without CUDA
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from bf16_emulation import emulate_bf16  # noqa: E402
from kda_testing import rel  # noqa: E402

from kda_moe.kernels import arrival_counters as arrival_counters_module  # noqa: E402
from kda_moe.kernels.arrival_counters import arrival_counters  # noqa: E402
from kda_moe.kernels.kda import kda_layer_decode_step, kda_layer_decode_step_unfused  # noqa: E402
from kda_moe.kernels.kda import fused_decode  # noqa: E402

dev = "cpu" if INTERPRETED else "cuda"
GATES = pytest.mark.parametrize("lb", [-5.0, None], ids=["bounded", "softplus"])
# the gates' logits given, or their low-rank inputs with the up-projections' weights (a rank of no power of two)
RANKS = pytest.mark.parametrize("rank", [None, 24], ids=["logits", "low_rank"])
LAUNCH_ARGS = ("qkv", "conv_weight", "conv_state", "g", "g_weight", "beta", "A_log", "dt_bias", "state", "gate",
               "gate_weight", "norm_weight")  # launch_fused_decode's and the op's tensors, in order
on_gpu = pytest.mark.skipif(INTERPRETED, reason="full size and CUDA graphs: on a GPU only")


def step_inputs(B, H, K, V, dtype, W=4, seed=0, rank=None):
    """One decode step's inputs for B sequences of a layer with H heads: q | k | v before the conv, conv weight and
    state, gate / beta / output gate logits and the norm weight in ``dtype``; A_log, dt_bias and the state in fp32.
    With ``rank``, both gates come as low-rank inputs [B, rank] with their up-projections' weights (Kimi Linear's
    f_b / g_b), scaled so that the logits are of order one."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    C = 2 * H * K + H * V
    x = dict(qkv=r(B, C), conv_weight=r(C, W) * 0.5, conv_state=r(B, C, W - 1), g=r(B, H * K), beta=r(B, H),
             gate=r(B, H * V), norm_weight=1 + 0.1 * r(V))
    if rank is not None:
        x.update(g=r(B, rank), g_weight=r(H * K, rank) * rank ** -0.5, gate=r(B, rank),
                 gate_weight=r(H * V, rank) * rank ** -0.5)
    x = {name: t.to(dtype) for name, t in x.items()}
    A_log = torch.log(torch.rand(H, generator=gen, device=dev) * 15 + 1)
    x.update(A_log=A_log, dt_bias=r(H * K) * 0.1, state=r(B, H, K, V))
    return x


def copies(x):
    return {name: t.clone() for name, t in x.items()}


def run(x, lb, backend):
    """The step on ``x`` (its states updated in place); returns the output."""
    return kda_layer_decode_step(**x, eps=1e-5, gate_lower_bound=lb, backend=backend)


@GATES
@RANKS
@pytest.mark.parametrize("shape", [(3, 2, 16, 32), (2, 1, 32, 16)], ids=["K<V", "K>V"])
def test_fused_step_matches_the_reference_ops_in_fp32_with_states_in_place(lb, rank, shape):
    x = step_inputs(*shape, torch.float32, rank=rank)
    ref = copies(x)
    addresses = (x["state"].data_ptr(), x["conv_state"].data_ptr())
    o = run(x, lb, "triton")
    ro = run(ref, lb, "torch")
    assert (x["state"].data_ptr(), x["conv_state"].data_ptr()) == addresses
    assert o.shape == (shape[0], shape[1] * shape[3]) and o.dtype == torch.float32
    assert rel(o, ro) < 1e-5 and rel(x["state"], ref["state"]) < 1e-5
    assert torch.equal(x["conv_state"], ref["conv_state"])  # a copy of inputs, exact


@GATES
@RANKS
def test_fused_step_matches_the_reference_ops_in_bf16(lb, rank, monkeypatch):
    """bf16 inputs, fp32 state. The kernel rounds where the three ops hand bf16 tensors to each other (the conv output,
    the attention output) and keeps fp32 elsewhere, so the two agree up to fp32 summation order: where a sum lands on
    the other side of a bf16 rounding boundary, that element moves by one bf16 ulp (2^-8 relative) and what depends on
    it a fraction of that. Hence 2^-8 on the output and 1e-4 on the fp32 state (measured: bit-equal outputs, state
    within 4e-7), well under what bf16 rounding alone costs (the bf16 reference is 3e-3 from the fp32 one). Low-rank
    gates: both sides round the up-projected logits to bf16, as F.linear stores them."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    x = step_inputs(3, 2, 16, 32, torch.bfloat16, rank=rank)
    ref = copies(x)
    o = run(x, lb, "triton")
    ro = run(ref, lb, "torch")
    assert o.dtype == torch.bfloat16 and x["conv_state"].dtype == torch.bfloat16
    assert rel(o, ro) < 2 ** -8 and rel(x["state"], ref["state"]) < 1e-4
    assert torch.equal(x["conv_state"], ref["conv_state"])


@GATES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_left_padding_token_leaves_both_states_unchanged(lb, dtype, monkeypatch):
    """The model masks a pad token by zeroing its projections and saturating its gate and beta logits to the dtype's
    minimum. In a row still inside its left padding (conv state all zeros) that leaves the conv state zero and the
    recurrent state bit for bit what it was, and the output zero; the other rows of the batch step as usual."""
    if dtype == torch.bfloat16 and INTERPRETED:
        emulate_bf16(monkeypatch)
    x = step_inputs(3, 2, 16, 16, dtype)
    pad = 1
    x["qkv"][pad] = 0
    x["conv_state"][pad] = 0
    x["g"][pad] = torch.finfo(dtype).min
    x["beta"][pad] = torch.finfo(dtype).min
    before, ref = copies(x), copies(x)
    o = run(x, lb, "triton")
    ro = run(ref, lb, "torch")
    assert torch.equal(x["state"][pad], before["state"][pad])
    assert torch.equal(x["conv_state"][pad], torch.zeros_like(x["conv_state"][pad]))
    assert torch.equal(o[pad], torch.zeros_like(o[pad]))
    real = [0, 2]
    assert not torch.equal(x["state"][real], before["state"][real])
    assert rel(o[real], ro[real]) < 2 ** -8 and rel(x["state"], ref["state"]) < 1e-4


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_state_slabs_narrower_than_v_and_heads_split_over_programs_give_the_same_step(splits):
    """A program walks its part of a head's state in [K, BV] slabs: heads above 128 x 128 take several (K = V = 256
    does), and a small batch splits each head's V channels over programs, the last of which norms the row and
    shifts the q / k conv rows. Every split into slabs of 16 on V = 64 matches one program of one slab of 64 (bit for
    bit in the interpreter; on a GPU a slab's tile shape may reorder the fp32 sums over K, a few ulps), and leaves
    the head counters at zero for the next call."""
    assert fused_decode.fused_decode_launch(1, 256, 256, 1).bv < 256
    assert fused_decode.fused_decode_launch(2 * 8, 128, 128, 132).splits == 4  # batch 2 x 8 heads on an H100
    assert fused_decode.fused_decode_launch(32 * 8, 128, 128, 132).splits == 1
    x = step_inputs(2, 2, 16, 64, torch.float32)
    outputs, states = [], []
    for launch in (fused_decode.FusedDecodeLaunch(bv=64, warps=1),
                   fused_decode.FusedDecodeLaunch(bv=16, warps=1, splits=splits)):
        y = copies(x)
        args = [y.get(n) for n in LAUNCH_ARGS]
        outputs.append(fused_decode.launch_fused_decode(*args, 1e-5, -5.0, 0.25, launch))
        states.append((y["state"], y["conv_state"]))
    assert rel(outputs[1], outputs[0]) < 1e-5
    assert rel(states[1][0], states[0][0]) < 1e-6 and torch.equal(states[1][1], states[0][1])
    if splits > 1:
        assert not arrival_counters(x["state"].device, 4)[:4].any()


def test_unfused_step_on_triton_matches_the_fused_kernel():
    """The baseline the benchmark sets beside the fused kernel (three launches) computes the same step."""
    x = step_inputs(2, 2, 16, 16, torch.float32)
    ref = copies(x)
    o = run(x, -5.0, "triton")
    ro = kda_layer_decode_step_unfused(**ref, eps=1e-5, gate_lower_bound=-5.0, backend="triton")
    assert rel(o, ro) < 1e-5 and rel(x["state"], ref["state"]) < 1e-5
    assert torch.equal(x["conv_state"], ref["conv_state"])


def test_fused_op_declares_its_mutations_and_skips_the_dispatcher_without_autograd(monkeypatch):
    """The custom op's schema names both states as mutated and its fake gives the output's shape (what torch.compile
    relies on); without autograd the wrapper calls the launch code directly, with the op's result."""
    for rank in (None, 8):
        x = step_inputs(2, 2, 16, 16, torch.float32, rank=rank)
        torch.library.opcheck(fused_decode.kda_layer_decode_step_op, (*map(x.get, LAUNCH_ARGS), 1e-5, -5.0, 0.25),
                              test_utils=("test_schema", "test_faketensor"))
    dispatched_x, direct_x = copies(x), copies(x)
    dispatched = run(dispatched_x, -5.0, "triton")

    def fail(*args):
        raise AssertionError("the fused decode op went through the dispatcher without autograd")

    monkeypatch.setattr(fused_decode, "kda_layer_decode_step_op", fail)
    with torch.no_grad():
        direct = run(direct_x, -5.0, "triton")
    assert torch.equal(direct, dispatched) and torch.equal(direct_x["state"], dispatched_x["state"])


def test_bad_inputs_name_the_problem():
    x = step_inputs(2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=r"qkv must be \(2, 96\)"):
        run({**x, "qkv": x["qkv"][:, :64]}, -5.0, "triton")
    with pytest.raises(ValueError, match=r"conv_state \[B, C, W-1\]"):
        run({**x, "conv_state": x["conv_state"][..., :2]}, -5.0, "torch")
    with pytest.raises(ValueError, match="contiguous fp32 state"):
        run({**x, "state": x["state"].transpose(2, 3).contiguous().transpose(2, 3)}, -5.0, "triton")
    with pytest.raises(ValueError, match="has no backward"):
        run({**x, "qkv": x["qkv"].requires_grad_()}, -5.0, "triton")
    with pytest.raises(ValueError, match="powers of two >= 16"):
        run(step_inputs(1, 1, 16, 24, torch.float32), -5.0, "triton")
    low_rank = step_inputs(2, 2, 16, 16, torch.float32, rank=8)
    with pytest.raises(ValueError, match=r"gate_weight must be \[32, R\] and gate its low-rank input \[B, R\]"):
        run({**low_rank, "gate": low_rank["gate"][:, :4]}, -5.0, "triton")
    with pytest.raises(ValueError, match=r"g must be \(2, 32\)"):
        run({**low_rank, "g_weight": None}, -5.0, "torch")
    with pytest.raises(ValueError, match="has no backward"):
        run({**low_rank, "g_weight": low_rank["g_weight"].requires_grad_()}, -5.0, "triton")


@pytest.mark.skipif(not INTERPRETED, reason="tests/test_gpu_model.py decodes on the GPU")
@pytest.mark.parametrize("full_rank_gate", [True, False], ids=["K3_gate", "Kimi_Linear_gate"])
def test_model_decodes_through_the_fused_kernel_like_the_reference(full_rank_gate, monkeypatch):
    """Prefill through the chunked kernels, then one fused-kernel step per KDA layer and new token, which multiplies
    the decay gate's (and a low-rank output gate's) up-projection itself: greedy tokens equal the torch backend's,
    scores within fp32 rounding."""
    from conftest import tiny_model

    from kda_moe.kernels import kda

    steps = []
    fused = kda.kda_layer_decode_step_triton
    monkeypatch.setattr(kda, "kda_layer_decode_step_triton",
                        lambda *a, **kw: steps.append((kw["g_weight"] is None, kw["gate_weight"] is None))
                        or fused(*a, **kw))
    models = [tiny_model(seed=0, kernel_backend=b, linear_head_dim=16, use_full_rank_gate=full_rank_gate)
              for b in ("triton", "torch")]
    input_ids = torch.randint(1, models[0].config.vocab_size, (2, 7))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # the second prompt is left-padded
    with torch.no_grad():
        out = [m.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False,
                          output_scores=True, return_dict_in_generate=True) for m in models]
    assert steps == [(False, full_rank_gate)] * 3 * 3  # 3 KDA layers, 3 tokens decoded after the prefill's
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel(torch.stack(out[0].scores), torch.stack(out[1].scores)) < 1e-5


@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 33])
def test_fused_step_at_full_size_matches_the_fp32_reference(B, dtype):
    """16 heads of K = V = 128 (one 128 x 128 slab a program, 8 warps) against the three reference ops in fp32 on the
    same inputs. bf16: the conv and attention outputs are rounded to bf16 (unit roundoff 2^-9), hence 5e-3."""
    x = step_inputs(B, 16, 128, 128, dtype)
    ref = {name: t.float().clone() for name, t in x.items()}
    for lb in (-5.0, None):
        o = run(x, lb, "triton")
        ro = run(ref, lb, "torch")
        tol = 5e-3 if dtype == torch.bfloat16 else 1e-5
        assert torch.isfinite(o).all() and rel(o, ro) < tol and rel(x["state"], ref["state"]) < tol, lb
        assert rel(x["conv_state"], ref["conv_state"]) < tol


@on_gpu
def test_split_steps_decode_through_transformers_compiled_cuda_graph_trees():
    """Heads of V = 64 split over 2 programs at batch 1; transformers' compiled decoding (inductor's CUDA-graph trees,
    which refuse a tensor allocated in their warm-up that no output holds) gives the eager step's tokens: the cache
    reserved the split programs' counters with its states."""
    from conftest import tiny_model

    assert fused_decode.fused_decode_launch(2, 64, 64, 132).splits == 2
    model = tiny_model(seed=0, kernel_backend="triton", linear_head_dim=64, layer_types=["linear_attention"] * 5)
    model = model.to(dev)
    model.generation_config.decode_steps_per_graph = None  # transformers' loop over its compiled step
    input_ids = torch.randint(1, 97, (1, 6), device=dev, generator=torch.Generator(dev).manual_seed(0))
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(input_ids, **settings)
        arrival_counters_module._COUNTERS.clear()  # as in a new process: the cache must reserve them
        tokens = model.generate(input_ids, cache_implementation="static", **settings)
    assert torch.equal(tokens, expected)


@on_gpu
def test_fused_step_replays_in_a_cuda_graph():
    """Captured once on fixed buffers, each replay is one more decoding step: two replays equal two eager steps."""
    x = step_inputs(4, 16, 128, 128, torch.bfloat16)
    start, eager = copies(x), copies(x)
    with torch.no_grad():
        run(x, -5.0, "triton")  # compiles the kernel before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x, -5.0, "triton")
        for name in ("state", "conv_state"):
            x[name].copy_(start[name])
        expected = [run(eager, -5.0, "triton") for _ in range(2)]
        replayed = []
        for _ in range(2):
            graph.replay()
            replayed.append(out.clone())
    assert all(torch.equal(a, b) for a, b in zip(replayed, expected))
    assert torch.equal(x["state"], eager["state"]) and torch.equal(x["conv_state"], eager["conv_state"])
