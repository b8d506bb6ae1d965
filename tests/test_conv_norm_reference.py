"""Short causal conv (+ step) and gated RMSNorm references: states, varlen, decoding, hand formulas."""

import pytest
import torch
import torch.nn.functional as F

from kda_moe.kernels.conv import short_conv, short_conv_step
from kda_moe.kernels.norm import gated_rms_norm

C, W = 6, 4


def hand_conv(x, weight, history, activation):
    """y_t = act(sum_j weight[:, j] * x_{t-W+1+j}) with the W-1 earlier inputs taken from history [B, C, W-1]."""
    xp = torch.cat([history.transpose(1, 2), x], dim=1)
    y = torch.stack([(xp[:, t : t + W] * weight.T).sum(1) for t in range(x.shape[1])], dim=1)
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", ["silu", None])
def test_short_conv_matches_hand_formula_with_history(activation):
    x, weight = torch.randn(2, 9, C, dtype=torch.float64), torch.randn(C, W, dtype=torch.float64)
    state = torch.randn(2, C, W - 1, dtype=torch.float64)
    y, final = short_conv(x, weight, initial_state=state, output_final_state=True, activation=activation)
    torch.testing.assert_close(y, hand_conv(x, weight, state, activation))
    torch.testing.assert_close(final, x[:, -(W - 1) :].transpose(1, 2))
    y0, none = short_conv(x, weight, activation=activation)
    assert none is None
    torch.testing.assert_close(y0, hand_conv(x, weight, torch.zeros_like(state), activation))


def test_short_conv_in_pieces_equals_one_pass_even_for_pieces_shorter_than_the_kernel():
    x, weight = torch.randn(2, 12, C), torch.randn(C, W)
    y_full, final_full = short_conv(x, weight, output_final_state=True)
    state, ys = None, []
    for a, b in [(0, 5), (5, 7), (7, 8), (8, 12)]:  # lengths 5, 2, 1, 4 (W - 1 = 3)
        y, state = short_conv(x[:, a:b], weight, initial_state=state, output_final_state=True)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, dim=1), y_full)
    torch.testing.assert_close(state, final_full)


def test_packed_short_conv_matches_separate_sequences():
    lengths = [5, 1, 0, 9, 2]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x, weight, states = torch.randn(1, sum(lengths), C), torch.randn(C, W), torch.randn(len(lengths), C, W - 1)
    y, final = short_conv(x, weight, initial_state=states, output_final_state=True, cu_seqlens=cu_seqlens)
    assert y.shape == x.shape and final.shape == (len(lengths), C, W - 1)
    for n, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        if a == b:  # an empty sequence passes its state through
            torch.testing.assert_close(final[n], states[n])
            continue
        y_n, final_n = short_conv(x[:, a:b], weight, initial_state=states[n : n + 1], output_final_state=True)
        torch.testing.assert_close(y[:, a:b], y_n)
        torch.testing.assert_close(final[n : n + 1], final_n)


def test_packed_short_conv_is_differentiable():
    cu_seqlens = torch.tensor([0, 2, 7])
    x = torch.randn(1, 7, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, W, dtype=torch.float64, requires_grad=True)
    states = torch.randn(2, 3, W - 1, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w, s: short_conv(x, w, initial_state=s, output_final_state=True, cu_seqlens=cu_seqlens)
    assert torch.autograd.gradcheck(fn, (x, weight, states))


def test_repeated_conv_steps_equal_short_conv_and_update_the_state_in_place():
    x, weight, state0 = torch.randn(3, 7, C), torch.randn(C, W), torch.randn(3, C, W - 1)
    y_ref, final_ref = short_conv(x, weight, initial_state=state0, output_final_state=True)
    state = state0.clone()
    address = state.data_ptr()
    ys = [short_conv_step(x[:, t], weight, state) for t in range(7)]
    torch.testing.assert_close(torch.stack(ys, dim=1), y_ref)
    torch.testing.assert_close(state, final_ref)
    assert state.data_ptr() == address


def test_conv_step_keeps_the_input_dtype():
    state = torch.zeros(2, C, W - 1, dtype=torch.bfloat16)
    y = short_conv_step(torch.randn(2, C, dtype=torch.bfloat16), torch.randn(C, W), state)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16


def test_short_conv_rejects_bad_inputs_with_a_fix():
    x, weight = torch.randn(2, 5, C), torch.randn(C, W)
    with pytest.raises(ValueError, match="activation must be one of"):
        short_conv(x, weight, activation="gelu")
    with pytest.raises(ValueError, match=r"weight \[C, W\] with the same C"):
        short_conv(x, weight[:2])
    with pytest.raises(ValueError, match=r"initial_state must be \(2, 6, 3\)"):
        short_conv(x, weight, initial_state=torch.zeros(2, C, W))
    with pytest.raises(ValueError, match=r"cu_seqlens needs packed inputs with batch size 1.*\[1, total_tokens, C\]"):
        short_conv(x, weight, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"state must be \(2, 6, 3\)"):
        short_conv_step(x[:, 0], weight, torch.zeros(1, C, W - 1))


def test_gated_rms_norm_matches_hand_formula_fp64():
    x, gate = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    weight = torch.randn(16, dtype=torch.float64)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * weight / (1 + torch.exp(-gate))
    torch.testing.assert_close(gated_rms_norm(x, gate, weight), expected, rtol=1e-12, atol=1e-12)


def test_gated_rms_norm_computes_in_fp32_and_returns_the_input_dtype():
    x, gate, weight = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16), torch.ones(16)
    y = gated_rms_norm(x, gate, weight, eps=1e-6)
    assert y.dtype == torch.bfloat16
    xf = x.float()
    expected = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * gate.float().sigmoid()
    torch.testing.assert_close(y, expected.bfloat16())


def test_gated_rms_norm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="gate must have the shape of x"):
        gated_rms_norm(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8))
