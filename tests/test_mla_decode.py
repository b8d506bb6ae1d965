"""The absorbed-MLA decode attention kernel (every head of a few new tokens against the latent cache, split over long
caches) against its PyTorch reference and the expanded (per-head keys and values) attention, and the model's decoding
through it with the dynamic and the static (compiled) cache.

Without CUDA the kernel runs in the Triton interpreter on tiny shapes (``TRITON_INTERPRET=1``, set by conftest.py),
where fp32 products are exact fp32: the kernel is within a few fp32 ulps of the fp64 reference, hence 1e-6 relative
(1e-5 on a GPU). The full-size bf16 test runs on a GPU only.
"""

import os

import pytest
import torch
from conftest import tiny_model
from kda_testing import rel

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it on machines without CUDA
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from bf16_emulation import emulate_bf16  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from kda_moe import KdaMoeCache  # noqa: E402
from kda_moe.compat import output_cache  # noqa: E402
from kda_moe.kernels.mla import MLA_DECODE_MAX_TOKENS, decode, mla_decode_attention  # noqa: E402

dev = "cpu" if INTERPRETED else "cuda"
SCALE = 0.3
FP32_TOL = 1e-6 if INTERPRETED else 1e-5  # a GPU's approximate exp adds a few fp32 ulps


def attention_inputs(B, H, T, S, L=12, R=4, dtype=torch.float32, seed=0):
    """(q_latent [B, H, T, L], q_rope [B, H, T, R], latent [B, 1, S, L], k_rope [B, 1, S, R])."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    shapes = [(B, H, T, L), (B, H, T, R), (B, 1, S, L), (B, 1, S, R)]
    return [torch.randn(*shape, generator=gen, device=dev).to(dtype) for shape in shapes]


def fp64(inputs):
    return [t.double() for t in inputs]


def launch(block_m=16, block_n=16, split_len=32):
    return decode.MlaDecodeLaunch(block_m=block_m, block_n=block_n, split_len=split_len, warps=1, stages=1)


@pytest.mark.parametrize("S", [5, 16, 75, 130], ids=lambda S: f"S{S}")
@pytest.mark.parametrize("T", [1, 3], ids=lambda T: f"T{T}")
def test_kernel_matches_the_fp64_reference_in_one_split_and_in_several(S, T):
    """Caches inside one tile, of a whole tile, and of several splits that end mid-tile; several new tokens each see
    the positions up to their own. 10 query rows of 3 heads x 3 tokens leave part of a 16-row block empty."""
    x = attention_inputs(2, 3, T, S)
    expected = mla_decode_attention(*fp64(x), scale=SCALE, backend="torch")
    for split_len in (32, 48, 256):  # 32 / 48: 5 / 3 splits of S = 130, combined; 256: one split, written directly
        out = decode.launch_mla_decode(*x, None, SCALE, launch(split_len=split_len))
        assert out.shape == (2, T, 3, 12) and out.dtype == torch.float32
        assert rel(out, expected) < FP32_TOL, split_len
    assert rel(mla_decode_attention(*x, scale=SCALE, backend="triton"), expected) < FP32_TOL  # the launch it picks


def test_absorbed_attention_equals_attention_over_expanded_keys_and_values():
    """W_UK folded into the query and W_UV applied to the output give the attention of the expanded form, per head:
    keys ``[W_UK latent | k_rope]``, values ``W_UV latent``, new tokens at the end of the cache (fp64 expanded form)."""
    B, H, T, S, L, R, nope, v = 2, 3, 2, 40, 12, 4, 8, 6
    _, q_rope, latent, k_rope = attention_inputs(B, H, T, S, L, R)
    gen = torch.Generator(device=dev).manual_seed(1)
    q_nope = torch.randn(B, H, T, nope, generator=gen, device=dev)
    w_uk, w_uv = (torch.randn(H, n, L, generator=gen, device=dev) / L**0.5 for n in (nope, v))  # kv_b_proj, per head
    absorbed = mla_decode_attention(q_nope @ w_uk, q_rope, latent, k_rope, scale=SCALE, backend="triton")
    absorbed = (absorbed.transpose(1, 2) @ w_uv.mT).transpose(1, 2)  # [B, T, H, v]

    q_nope, q_rope, latent, k_rope, w_uk, w_uv = (t.double() for t in (q_nope, q_rope, latent, k_rope, w_uk, w_uv))
    key = torch.cat([latent @ w_uk.mT, k_rope.expand(B, H, S, R)], dim=-1)  # [B, H, S, nope + rope]
    scores = torch.cat([q_nope, q_rope], dim=-1) @ key.mT * SCALE
    causal = torch.arange(S, device=dev) <= torch.arange(S - T, S, device=dev)[:, None]
    expanded = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ (latent @ w_uv.mT)  # [B, H, T, v]
    assert rel(absorbed, expanded.transpose(1, 2)) < FP32_TOL


def padding_mask(B, T, S, pad, filled):
    """transformers' 4-D bool mask [B, 1, T, S] of T new tokens at positions filled - T .. filled - 1 of a cache of S
    positions: row b's first pad[b] positions are left padding, positions from `filled` on are not written yet."""
    positions = torch.arange(S, device=dev)
    new = torch.arange(filled - T, filled, device=dev)
    causal = positions <= new[:, None]  # [T, S]
    not_pad = positions >= torch.tensor(pad, device=dev)[:, None]  # [B, S]
    return (causal[None] & not_pad[:, None])[:, None]


@pytest.mark.parametrize("T", [1, 2])
def test_left_padding_and_the_unfilled_positions_of_a_static_cache_are_never_read(T):
    """A static cache: S = 100 positions of which 61 written, rows left-padded by 0 and 20 tokens. The kernel follows
    the reference on the mask and never loads a position that the mask hides from every new token of a row: NaN
    written there leaves its output unchanged (a masked score of a loaded NaN would still poison the value product)."""
    B, S, filled = 2, 100, 61
    x = attention_inputs(B, 3, T, S)
    mask = padding_mask(B, T, S, pad=[0, 20], filled=filled)
    expected = mla_decode_attention(*fp64(x), mask, scale=SCALE, backend="torch")
    for cache in x[2:]:
        cache[1, :, :20] = float("nan")
        cache[:, :, filled:] = float("nan")
    for split_len in (32, 256):
        out = decode.launch_mla_decode(*x, mask, SCALE, launch(split_len=split_len))
        assert rel(out, expected) < FP32_TOL, split_len


def test_float_masks_add_to_the_scores_and_minus_infinity_drops_a_position():
    """The eager attention's additive mask: 0 keeps, the dtype's minimum or -inf hides, other values bias the score.
    A row that sees no position at all gets zeros (the reference's choice; SDPA's safe softmax gives the same)."""
    B, T, S = 2, 2, 50
    x = attention_inputs(B, 3, T, S)
    gen = torch.Generator(device=dev).manual_seed(2)
    bias = 0.5 * torch.randn(B, 3, T, S, generator=gen, device=dev)  # a per-head mask
    bias[:, :, :, :7] = torch.finfo(torch.float32).min
    bias[0, :, :, 40:] = float("-inf")
    bias[1, 2, 0, :] = float("-inf")  # head 2 of the first new token of row 1 sees nothing
    expected = mla_decode_attention(*fp64(x), bias.double(), scale=SCALE, backend="torch")
    out = decode.launch_mla_decode(*x, bias, SCALE, launch(split_len=32))
    assert rel(out, expected) < FP32_TOL
    assert torch.equal(out[1, 0, 2], torch.zeros(12, device=dev)) and expected[1, 0, 2].abs().max() == 0


def test_bf16_and_fp16_inputs_follow_the_fp32_reference(monkeypatch):
    """16-bit inputs, fp32 accumulation: the probabilities are rounded to the input dtype for the value product and
    the output to the input dtype at the end (unit roundoff 2^-9 for bf16, 2^-12 for fp16), so the kernel is within a
    few units of the reference on the same rounded inputs: 2^-7 relative for bf16, 2^-10 for fp16."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    for dtype, tol in ((torch.bfloat16, 2**-7), (torch.float16, 2**-10)):
        x = attention_inputs(2, 3, 2, 75, dtype=dtype)
        expected = mla_decode_attention(*fp64(x), scale=SCALE, backend="torch")
        out = decode.launch_mla_decode(*x, padding_mask(2, 2, 75, [0, 0], 75), SCALE, launch(split_len=32))
        assert out.dtype == dtype and rel(out, expected) < tol, dtype


def test_caches_split_into_short_chains_of_tiles_until_the_batch_fills_the_multiprocessors():
    """On 132 multiprocessors: at batch 1 a 2K cache splits into one-tile splits, a 32K cache of 64 heads (two blocks
    of 32 rows) into splits of MAX_TILES_PER_SPLIT tiles or fewer, about two programs per multiprocessor or more; a
    batch whose row blocks cover the multiprocessors takes one split, and every split is whole tiles."""
    short = decode.mla_decode_launch(1, 8, 2048, 256, torch.bfloat16, 132)
    assert short.split_len == short.block_n
    long = decode.mla_decode_launch(1, 64, 32768, 512, torch.bfloat16, 132)
    splits = -(-32768 // long.split_len)
    assert long.block_m == 32 and long.split_len % long.block_n == 0
    assert long.split_len <= decode.MAX_TILES_PER_SPLIT * long.block_n and 2 * splits >= 132
    assert decode.mla_decode_launch(128, 64, 32768, 512, torch.bfloat16, 132).split_len >= 32768
    assert decode.mla_decode_launch(1, 8, 100, 512, torch.bfloat16, 132).split_len % 64 == 0


def test_custom_op_traces_and_calls_without_autograd_skip_the_dispatcher(monkeypatch):
    """torch.compile sees the kernel as one custom op whose fake gives the output's shape; under no_grad (generate())
    the wrapper calls the launch code directly, with the op's result."""
    x = attention_inputs(2, 3, 2, 40)
    mask = padding_mask(2, 2, 40, [0, 5], 40)
    torch.library.opcheck(decode.mla_decode_attention_op, (*x, mask, SCALE),
                          test_utils=("test_schema", "test_faketensor"))
    dispatched = mla_decode_attention(*x, mask, scale=SCALE, backend="triton")

    def fail(*args):
        raise AssertionError("the MLA decode op went through the dispatcher without autograd")

    monkeypatch.setattr(decode, "mla_decode_attention_op", fail)
    with torch.no_grad():
        assert torch.equal(mla_decode_attention(*x, mask, scale=SCALE, backend="triton"), dispatched)


def test_bad_inputs_name_the_problem():
    x = attention_inputs(2, 3, 2, 40)
    with pytest.raises(ValueError, match=r"latent \[B, 1, S, L\]"):
        mla_decode_attention(x[0], x[1], x[2].expand(2, 3, 40, 12), x[3], scale=SCALE)
    with pytest.raises(ValueError, match="same S and R"):
        mla_decode_attention(x[0], x[1], x[2], x[3][:, :, :30], scale=SCALE)
    with pytest.raises(ValueError, match="hold the 2 new tokens"):
        mla_decode_attention(x[0], x[1], x[2][:, :, :1], x[3][:, :, :1], scale=SCALE)
    with pytest.raises(ValueError, match=r"broadcasts to \[B, H, T, S\] = \(2, 3, 2, 40\)"):
        mla_decode_attention(*x, torch.ones(2, 1, 2, 41, dtype=torch.bool, device=dev), scale=SCALE)
    with pytest.raises(ValueError, match="one dtype among fp16, bf16 and fp32"):
        mla_decode_attention(*fp64(x), scale=SCALE, backend="triton")
    with pytest.raises(ValueError, match="has no backward"):
        mla_decode_attention(torch.zeros_like(x[0], requires_grad=True), *x[1:], scale=SCALE, backend="triton")
    # "auto" runs what the kernel does not take (here fp64) on the reference
    expected = mla_decode_attention(*x, scale=SCALE, backend="torch")
    assert rel(mla_decode_attention(*fp64(x), scale=SCALE), expected) < FP32_TOL


# ------------------------------------------------------------------------------------------------------------------
# The model: KdaMoeAttention decodes through the kernel on the Triton backend
# ------------------------------------------------------------------------------------------------------------------

HYBRID = dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "full_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"], linear_head_dim=16)
GREEDY = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)


def count_kernel_calls(monkeypatch):
    calls = []
    run = decode._decode_attention
    monkeypatch.setattr(decode, "_decode_attention", lambda *args: calls.append(args[0].shape[2]) or run(*args))
    return calls


def left_padded_prompts():
    input_ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :2], attention_mask[1, :2] = 0, 0
    return input_ids, attention_mask


@pytest.mark.skipif(not INTERPRETED, reason="tests/test_gpu_model.py decodes on the GPU")
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_greedy_decoding_through_the_kernel_matches_the_torch_backend(attn_implementation, monkeypatch):
    """A left-padded batch, dynamic cache: every decoding step of both MLA layers runs the kernel (SDPA's bool mask,
    eager's additive one), tokens equal the torch backend's and scores agree to fp32 rounding."""
    calls = count_kernel_calls(monkeypatch)
    models = [tiny_model(seed=0, kernel_backend=backend, **HYBRID) for backend in ("triton", "torch")]
    input_ids, attention_mask = left_padded_prompts()
    with torch.no_grad():
        out = []
        for model in models:
            model.set_attn_implementation(attn_implementation)
            out.append(model.generate(input_ids, attention_mask=attention_mask, **GREEDY))
    assert calls == [1] * 2 * 3  # 2 MLA layers, 3 tokens decoded after the prefill's
    assert torch.equal(out[0].sequences, out[1].sequences)
    assert rel(torch.stack(out[0].scores), torch.stack(out[1].scores)) < 1e-5


@pytest.mark.skipif(not INTERPRETED, reason="tests/test_gpu_model.py decodes on the GPU")
def test_static_cache_decoding_compiles_to_the_kernel_and_matches_eager_torch_decoding(monkeypatch):
    """Static cache, decode step compiled with fullgraph=True: the graph holds the kernel as our custom op (no
    concatenated latent | rope keys over the whole cache), and the tokens and scores are the torch backend's eager
    ones on the dynamic cache. The short prefill (6 tokens, masked) runs the kernel too."""
    calls = count_kernel_calls(monkeypatch)
    models = [tiny_model(seed=0, kernel_backend=backend, **HYBRID) for backend in ("triton", "torch")]
    input_ids, attention_mask = left_padded_prompts()
    graph_ops = []

    def record(gm, example_inputs):
        graph_ops.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    compile_config = CompileConfig(fullgraph=True, backend=aot_autograd(fw_compiler=record))
    compile_config._compile_all_devices = True  # generate() compiles on GPUs only, unless told
    torch._dynamo.reset()
    with torch.no_grad():
        static = models[0].generate(input_ids, attention_mask=attention_mask, cache_implementation="static",
                                    compile_config=compile_config, **GREEDY)
        expected = models[1].generate(input_ids, attention_mask=attention_mask, **GREEDY)
    assert len(graph_ops) == 1 and "kda_moe.mla_decode_attention.default" in graph_ops[0]
    assert calls[:2] == [6, 6]  # the eager prefill; the compiled steps run it inside the graph
    assert torch.equal(static.sequences, expected.sequences)
    assert rel(torch.stack(static.scores), torch.stack(expected.scores)) < 1e-5


@pytest.mark.skipif(not INTERPRETED, reason="tests/test_gpu_model.py decodes on the GPU")
def test_forwards_of_several_new_tokens_use_the_kernel_up_to_its_limit(monkeypatch):
    """Chunks of 1 to MLA_DECODE_MAX_TOKENS new tokens continue a dynamic cache through the kernel (each token sees
    the cache up to itself) and give the full forward's logits; a longer chunk, the prefill, output_attentions and
    autograd take the attention interface."""
    calls = count_kernel_calls(monkeypatch)
    model = tiny_model(seed=0, kernel_backend="triton", **HYBRID)
    reference = tiny_model(seed=0, kernel_backend="torch", **HYBRID)
    chunks = [4, 1, 3, MLA_DECODE_MAX_TOKENS, MLA_DECODE_MAX_TOKENS + 1]
    input_ids = torch.randint(1, 97, (2, sum(chunks)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = reference(input_ids).logits
        cache, logits, start = KdaMoeCache(model.config), [], 0
        for size in chunks:
            out = model(input_ids[:, start : start + size], cache=cache, use_cache=True)
            cache, start = output_cache(out), start + size
            logits.append(out.logits)
        assert calls == [1, 1, 3, 3, MLA_DECODE_MAX_TOKENS, MLA_DECODE_MAX_TOKENS]
        assert rel(torch.cat(logits, dim=1), full) < 1e-5
        calls.clear()
        model.set_attn_implementation("eager")
        out = model(input_ids[:, -1:], cache=cache, use_cache=True, output_attentions=True)
        assert out.attentions[1].shape == (2, model.config.num_attention_heads, 1, sum(chunks) + 1) and not calls
    model(input_ids[:, -1:], cache=cache, use_cache=True)
    assert not calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("H", [8, 64])
def test_kernel_at_full_size_matches_the_torch_path_in_bf16(H):
    """DeepSeek-V3 latent dims (L = 512, R = 64, scale 192^-0.5: scores of std ~1.7, a softmax neither flat nor
    one-hot), a 32K-position cache split over the multiprocessors, batch 2 with one row left-padded and a static
    cache's unfilled tail, T = 1 and 4, against the model's torch path (SDPA over the expanded latent, bf16) and the
    fp32 reference on the same bf16 inputs. The kernel rounds the probabilities to bf16 for the value product and its
    output once: unit roundoff 2^-9 (2e-3) each, independent from position to position, so ~2e-3 relative in all; the
    SDPA path rounds its output too. 8e-3 from the reference and 1e-2 from SDPA leave room for the GPU's approximate
    exp without hiding a wrong position or weight (those cost O(1))."""
    B, S, filled = 2, 32768, 30000
    for T in (1, 4):
        x = attention_inputs(B, H, T, S, L=512, R=64, dtype=torch.bfloat16)
        mask = padding_mask(B, T, S, pad=[0, 1000], filled=filled)
        scale = 192**-0.5
        with torch.no_grad():
            out = mla_decode_attention(*x, mask, scale=scale, backend="triton")
            expected = mla_decode_attention(*(t.float() for t in x), mask, scale=scale, backend="torch")
            query = torch.cat(x[:2], dim=-1)
            key = torch.cat(x[2:], dim=-1).expand(B, H, S, 576)
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                query, key, x[2].expand(B, H, S, 512), attn_mask=mask, scale=scale
            ).transpose(1, 2)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        assert rel(out, expected) < 8e-3 and rel(out, sdpa) < 1e-2, T


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU the benchmark runs for real")
def test_benchmark_writes_its_rows_and_table(tmp_path, monkeypatch):
    """benchmarks/mla_decode.py end to end on CPU (fp32, stand-in timings, a tiny shape whose last 3 positions are
    masked): the plumbing and the kernel's error against the reference, not the numbers."""
    import json
    import sys

    from benchmark_testing import load_benchmark, stand_in_timings

    bench = load_benchmark("mla_decode.py")
    stand_in_timings(bench, monkeypatch)
    launches = bench.launches
    monkeypatch.setattr(bench, "launches", lambda *shape: launches(*shape)[:2])  # the pick and one other
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (3, 12, 4)})
    monkeypatch.setattr(bench, "UNFILLED", 3)
    monkeypatch.setattr(sys, "argv", ["mla_decode.py", str(tmp_path), "batches=1,2", "contexts=40", "tune"])
    bench.main(str(tmp_path))
    rows = json.loads((tmp_path / "mla_decode.json").read_text())["rows"]
    assert [(r["B"], r["S"]) for r in rows] == [(1, 40), (2, 40)]
    assert all(r["rel_err"] < FP32_TOL and r["ours_us"] == r["reference_us"] == 1000.0 for r in rows)
    assert all(len(r["launch_us"]) == 2 and r["launch"] in r["launch_us"] for r in rows)
    table = (tmp_path / "mla_decode.md").read_text()
    assert "| tiny | 2 | 40 |" in table and "- tiny B=2 S=40: " in table
