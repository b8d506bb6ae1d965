"""The grouped product of experts' weights stored mxfp4 (``kernels/moe/mxfp4.py``: weight tiles decoded in registers)
against its PyTorch reference, and the reference's decoding against compressed-tensors' own.

Without CUDA the kernel runs in the Triton interpreter on tiny shapes with small tiles (``TRITON_INTERPRET=1``, set by
conftest.py); on a GPU the same tests run compiled. fp32 tolerance 1e-5 relative: both sides form the same exact
products (the decoded weights are exact in fp32) and differ in the order of their fp32 sums only.
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

from kda_moe.kernels.moe import (Mxfp4Weight, dequantize_mxfp4, mxfp4, mxfp4_grouped_mm,  # noqa: E402
                                  mxfp4_grouped_mm_reference)

dev = "cpu" if INTERPRETED else "cuda"
ROWS_PER_EXPERT = (7, 0, 20, 3, 9)  # S = 39 rows, not a multiple of 16; expert 1 gets none, expert 2 two tiles
E, S, N = len(ROWS_PER_EXPERT), sum(ROWS_PER_EXPERT), 40  # N = 40: the last 16-wide block of columns is partial
SMALL_TILES = mxfp4.Mxfp4Launch(rows=16, block_n=16, block_k=64, warps=1, stages=1)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """16-row, 16-column tiles and 64-wide K steps: K = 96 ends in a partial step, and the interpreter stays fast."""
    monkeypatch.setattr(mxfp4, "mxfp4_launch", lambda *args: SMALL_TILES)


def compressed_tensors_codec():
    pytest.importorskip("compressed_tensors")
    from kda_moe.modeling.conversion import mxfp4_codec, mxfp4_quantization_config

    return mxfp4_codec(mxfp4_quantization_config())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (same dtype), except that NaNs only need to sit in the same places (their payloads are the
    platform's)."""
    nan = a.isnan()
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def test_dequantize_matches_compressed_tensors_on_every_byte_and_scale():
    """Every byte (so every nibble in both halves) under every E8M0 scale, [4, 64, K = 512] through the leading dims."""
    compressor, scheme = compressed_tensors_codec()
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # [256, 256]: row i holds every byte
    scale = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 16).contiguous()  # row i has scale i
    expected = compressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]
    assert expected.dtype == torch.bfloat16
    ours = dequantize_mxfp4(packed.view(4, 64, 256).to(dev), scale.view(4, 64, 16).to(dev))
    assert ours.shape == (4, 64, 512) and same_bits(ours.flatten(0, 1).cpu(), expected)


def test_dequantize_matches_compressed_tensors_on_weights_it_compressed():
    """Weights of magnitudes 2^-100 to 2^100, one magnitude per scale group, quantized and packed by
    compressed-tensors (as modeling/conversion.py writes a checkpoint), decode to the same bits."""
    compressor, scheme = compressed_tensors_codec()
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    gen = torch.Generator().manual_seed(0)
    magnitudes = 2.0 ** torch.randint(-100, 101, (3, 8, 3, 1), generator=gen)  # one per scale group
    weights = (torch.randn(3, 8, 3, 32, generator=gen) * magnitudes).flatten(-2)  # [3, 8, 96]
    packed, scale, expected = [], [], []
    for weight in weights:
        groups = weight.view(8, -1, 32)
        group_scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        stored = compressor.compress({"weight": weight, "weight_scale": group_scale, "weight_zero_point": zero_point},
                                     scheme)
        packed.append(stored["weight_packed"])
        scale.append(stored["weight_scale"])
        expected.append(compressor.decompress(stored, scheme)["weight"])
    weight = Mxfp4Weight(torch.stack(packed), torch.stack(scale))
    assert weight.packed.dtype == weight.scale.dtype == torch.uint8 and weight.shape == (3, 8, 96)
    expected = torch.stack(expected)  # bf16 or the weights' dtype, as the compressed-tensors version decodes
    assert same_bits(dequantize_mxfp4(*weight, expected.dtype), expected)


def mxfp4_inputs(K: int, dtype=torch.float32, seed=0):
    """x [S, K] in ``dtype`` (a leaf that needs grad), random mxfp4 weights [E, N, K] (every byte value, scales
    2^-4 ... 2^0) and the offsets of ROWS_PER_EXPERT."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, K, generator=gen).to(dev, dtype).requires_grad_()
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(123, 128, (E, N, K // 32), dtype=torch.uint8, generator=gen)
    offsets = torch.tensor(ROWS_PER_EXPERT).cumsum(0).to(dev, torch.int32)
    return x, Mxfp4Weight(packed.to(dev), scale.to(dev)), offsets


def test_row_tiles_list_every_experts_rows_in_fixed_slots():
    offsets = torch.tensor(ROWS_PER_EXPERT).cumsum(0).to(dev, torch.int32)
    tiles = mxfp4.row_tiles(offsets, S, 16)  # cdiv(39, 16) + 5 slots: 5 tiles, then 3 unused
    expected = [[0, 0], [2, 7], [2, 23], [3, 27], [4, 30], [-1, 0], [-1, 0], [-1, 0]]
    assert tiles.dtype == torch.int32 and tiles.tolist() == expected


def test_row_tiles_of_fewer_rows_than_experts_take_a_slot_per_row_at_most():
    """A decoding step: 3 rows over 5 experts need cdiv(3, 16) + 3 slots, not one per expert."""
    offsets = torch.tensor([0, 2, 2, 2, 3]).to(dev, torch.int32)  # expert 1: rows 0-1, expert 4: row 2
    assert mxfp4.row_tiles(offsets, 3, 16).tolist() == [[1, 0], [4, 2], [-1, 0], [-1, 0]]


@pytest.mark.parametrize("K", [64, 96])
def test_output_and_gradient_match_the_reference_in_fp32(K):
    x, weight, offsets = mxfp4_inputs(K)
    grad_out = torch.randn(S, N, generator=torch.Generator().manual_seed(1)).to(dev)
    ours = mxfp4_grouped_mm(x, weight, offsets, backend="triton")
    expected = mxfp4_grouped_mm_reference(x, weight, offsets)
    assert ours.dtype == torch.float32 and ours.shape == (S, N)
    assert rel(ours, expected) < 1e-5
    (grad,), (expected_grad,) = (torch.autograd.grad(out, x, grad_out) for out in (ours, expected))
    assert rel(grad, expected_grad) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_operands_round_once(dtype, monkeypatch):
    """bf16 (and fp16) inputs multiply as bf16 operands: bf16 x and the decoded weights are exact in bf16, so the
    kernel and the fp32 reference form the same products and differ in the order of their fp32 sums, then each rounds
    once to bf16: one bf16 step (2^-7 relative) at most apart where the sums straddle a rounding boundary. fp16 x is
    rounded to bf16 first (2^-9 relative an element), within 1e-2 of the reference's fp32 products of fp16 x."""
    if INTERPRETED:
        emulate_bf16(monkeypatch)
    x, weight, offsets = mxfp4_inputs(96, dtype, seed=2)
    ours = mxfp4_grouped_mm(x, weight, offsets, backend="triton")
    expected = mxfp4_grouped_mm_reference(x, weight, offsets)
    assert ours.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(ours, expected, rtol=2**-7, atol=1e-5)
    else:
        assert rel(ours, expected) < 1e-2


def test_op_has_a_fake_and_a_registered_backward():
    x, weight, offsets = mxfp4_inputs(64)
    for transposed in (False, True):
        rows = (x.detach()[:, :N] if transposed else x.detach()).contiguous().requires_grad_()
        args = (rows, *weight, offsets, transposed)
        torch.library.opcheck(mxfp4.mxfp4_grouped_mm_op, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_torch_compile_traces_the_op_with_its_backward():
    """aot_eager traces the forward and the registered backward through the fake implementation, in one graph."""
    x, weight, offsets = mxfp4_inputs(64, seed=3)
    compiled = torch.compile(lambda x: mxfp4_grouped_mm(x, weight, offsets, backend="triton"), backend="aot_eager",
                             fullgraph=True)
    out = compiled(x)
    expected = mxfp4_grouped_mm_reference(x, weight, offsets)
    assert rel(out, expected) < 1e-5
    (grad,), (expected_grad,) = (torch.autograd.grad(y.sum(), x) for y in (out, expected))
    assert rel(grad, expected_grad) < 1e-5


def test_bad_inputs_are_refused_with_the_fix():
    x, weight, offsets = mxfp4_inputs(64)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_grouped_mm(x[:, :48], Mxfp4Weight(weight.packed[..., :24], weight.scale[..., :1]), offsets)
    with pytest.raises(ValueError, match=r"must be uint8.*\.to\(torch\.uint8\)"):
        mxfp4_grouped_mm(x, Mxfp4Weight(weight.packed.float(), weight.scale), offsets)
    with pytest.raises(ValueError, match=r"offsets must be \[E\] = \[5\] int32"):
        mxfp4_grouped_mm(x, weight, offsets[:4])
    with pytest.raises(ValueError, match=r"offsets must be \[E\] = \[5\] int32"):
        mxfp4_grouped_mm(x, weight, offsets.long())
    with pytest.raises(ValueError, match=r"weight.packed must be \[E, N, K / 2\]"):
        mxfp4_grouped_mm(x[:, :32], weight, offsets)
