"""The torch KDA reference: chunked == recurrent == fla's naive recurrence, varlen, gate, gradients."""

import pytest
import torch

from kda_moe.kernels.kda import chunk_kda, kda_decode_step, kda_gate, kda_step, kimi_delta_attention, l2norm, recurrent_kda

fla_naive = pytest.importorskip("fla.ops.kda.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")

H, K, V = 3, 16, 8


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def activated_inputs(B, T, lower_bound=None, dtype=torch.float32, seed=0):
    """q, k normalised, g log decay, beta in (0, 1): the inputs of recurrent_kda / chunk_kda."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen)).to(dtype)
    k = l2norm(torch.randn(B, T, H, K, generator=gen)).to(dtype)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    g = kda_gate(2 * torch.randn(B, T, H, K, generator=gen), A_log, dt_bias, lower_bound).to(dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 100])
def test_chunked_and_recurrent_match_fla_naive_recurrence(T, with_state, lower_bound):
    q, k, v, g, beta = activated_inputs(2, T, lower_bound)
    S0 = torch.randn(2, H, K, V) if with_state else None
    o_ref, S_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, K**-0.5, S0, output_final_state=True)
    o_rec, S_rec = recurrent_kda(q, k, v, g, beta, K**-0.5, S0, output_final_state=True)
    o_chk, S_chk = chunk_kda(q, k, v, g, beta, K**-0.5, S0, output_final_state=True)
    for o, S in [(o_rec, S_rec), (o_chk, S_chk)]:
        assert o.shape == (2, T, H, V) and o.dtype == v.dtype and S.dtype == torch.float32
        assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


@pytest.mark.parametrize("chunk_size", [16, 24, 64])
def test_chunk_size_and_padding_never_change_the_result(chunk_size):
    q, k, v, g, beta = activated_inputs(1, 53, dtype=torch.float64)
    o_rec, S_rec = recurrent_kda(q, k, v, g, beta, 0.3, output_final_state=True)
    o, S = chunk_kda(q, k, v, g, beta, 0.3, output_final_state=True, chunk_size=chunk_size)
    assert rel_err(o, o_rec) < 1e-12 and rel_err(S, S_rec) < 1e-12


def test_packed_sequences_match_running_each_alone():
    lengths = [37, 64, 1, 0, 70]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta = activated_inputs(1, sum(lengths))
    S0 = torch.randn(len(lengths), H, K, V)
    o, S = chunk_kda(q, k, v, g, beta, K**-0.5, S0, output_final_state=True, cu_seqlens=cu_seqlens)
    assert o.shape == v.shape and S.shape == (len(lengths), H, K, V)
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        piece = [t[:, start:end] for t in (q, k, v, g, beta)]
        if end == start:  # an empty sequence passes its state through
            assert torch.equal(S[n], S0[n])
            continue
        o_n, S_n = recurrent_kda(*piece, K**-0.5, S0[n : n + 1], output_final_state=True)
        assert rel_err(o[:, start:end], o_n) < 1e-5 and rel_err(S[n : n + 1], S_n) < 1e-5


def test_decode_steps_continue_a_chunked_prefill():
    q, k, v, g, beta = activated_inputs(2, 40)
    o_full, S_full = recurrent_kda(q, k, v, g, beta, 0.25, output_final_state=True)
    o, S = chunk_kda(q[:, :30], k[:, :30], v[:, :30], g[:, :30], beta[:, :30], 0.25, output_final_state=True)
    for t in range(30, 40):
        o_t, S = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], 0.25, S)
        assert rel_err(o_t, o_full[:, t]) < 1e-5
    assert rel_err(S, S_full) < 1e-5


def test_chunk_gradients_match_recurrent_gradients_fp64():
    inputs = [t.requires_grad_() for t in activated_inputs(2, 45, lower_bound=-5.0, dtype=torch.float64)]
    S0 = torch.randn(2, H, K, V, dtype=torch.float64, requires_grad=True)
    do, dS = torch.randn(2, 45, H, V, dtype=torch.float64), torch.randn(2, H, K, V, dtype=torch.float64)
    grads = []
    for fn in (recurrent_kda, lambda *a, **kw: chunk_kda(*a, **kw, chunk_size=16)):
        o, S = fn(*inputs, 0.25, S0, output_final_state=True)
        grads.append(torch.autograd.grad((o * do).sum() + (S * dS).sum(), [*inputs, S0]))
    for name, g_rec, g_chk in zip(["q", "k", "v", "g", "beta", "initial_state"], *grads):
        assert rel_err(g_chk, g_rec) < 1e-10, name


@pytest.mark.parametrize("decay", [5.0, 20.0, 40.0])
def test_chunk_gradients_match_the_recurrence_in_steep_channels(decay):
    """Every channel decaying by about e^-decay per token: the true gradient of the log decays is tiny, while the
    chunked form's terms of decay 1 (a token against itself, the last token carried to the chunk end, which a
    zero-padded tail turns into any last real token) are its largest. Formed as exp(G_t - G_t), autograd sends them
    into G from two sides whose rounding differs (fp32 would be 1e1 times off at e^-20, fp64 8 times at e^-40). As
    constants, the gradients match the fp64 recurrence; T = 100 ends in a partial chunk."""
    q, k, v, _, beta = activated_inputs(2, 100, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    g = -decay * (1 + 0.1 * torch.randn(2, 100, H, K, generator=gen, dtype=torch.float64))
    S0, dS = torch.randn(2, 2, H, K, V, generator=gen, dtype=torch.float64)
    do = torch.randn(2, 100, H, V, generator=gen, dtype=torch.float64)

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, g, beta, S0)]
        o, S = fn(*leaves[:5], K**-0.5, leaves[5], output_final_state=True)
        return torch.autograd.grad((o.double() * do).sum() + (S.double() * dS).sum(), leaves)

    truth = grads(recurrent_kda, torch.float64)
    for dtype, tol in [(torch.float64, 1e-10), (torch.float32, 1e-4)]:
        for name, got, want in zip(["q", "k", "v", "g", "beta", "initial_state"], grads(chunk_kda, dtype), truth):
            assert rel_err(got, want) < tol, (dtype, name, rel_err(got, want))


def test_chunked_form_is_finite_for_very_strong_unbounded_decay():
    q, k, v, g, beta = activated_inputs(1, 64, dtype=torch.float64)
    g = g * 1e3  # cumulative log decays beyond -1e4 inside a chunk: exp(-G) alone overflows even fp64
    o_ref, S_ref = recurrent_kda(q, k, v, g, beta, 0.25, output_final_state=True)
    o, S = chunk_kda(q, k, v, g, beta, 0.25, output_final_state=True)
    assert torch.isfinite(o).all() and rel_err(o, o_ref) < 1e-12 and rel_err(S, S_ref) < 1e-12


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_matches_fla_naive_gate_in_both_layouts(lower_bound):
    g, A_log, dt_bias = torch.randn(2, 5, H, K), torch.randn(H), torch.randn(H * K)
    if lower_bound is None:
        ref = fla_gate.naive_kda_gate(g, A_log, dt_bias)
    else:
        ref = fla_gate.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)
    out = kda_gate(g, A_log, dt_bias, lower_bound)
    assert out.dtype == torch.float32 and out.shape == (2, 5, H, K)
    assert rel_err(out, ref) < 1e-6
    assert torch.equal(kda_gate(g.flatten(-2), A_log, dt_bias, lower_bound), out)


def test_bounded_gate_stays_in_range_for_extreme_logits():
    logits = torch.tensor([-1e4, -30.0, -1.0, 0.0, 1.0, 30.0, 1e4]).repeat(H, K, 1).permute(2, 0, 1)  # [7, H, K]
    A_log, dt_bias = torch.tensor([-2.0, 0.0, 3.0]), torch.zeros(H * K)
    g = kda_gate(logits, A_log, dt_bias, lower_bound=-5.0)
    assert torch.isfinite(g).all() and (g >= -5.0).all() and (g <= 0.0).all()
    assert torch.equal(g[-1], torch.full((H, K), -5.0))  # saturates exactly at the bound
    assert (g[2:-1] < 0).all()  # strictly decaying wherever sigmoid does not underflow
    assert (g[0] == 0).all()  # sigmoid(-1e4) underflows: no decay, never a positive log decay
    torch.testing.assert_close(g[3], torch.full((H, K), -2.5))


def hand_l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("T", [1, 100])
def test_fused_entry_matches_fla_naive_with_its_gate(T, lower_bound):
    gen = torch.Generator().manual_seed(1)
    q, k, g = (torch.randn(2, T, H, K, generator=gen) for _ in range(3))
    v, beta = torch.randn(2, T, H, V, generator=gen), torch.randn(2, T, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    S0 = torch.randn(2, H, K, V, generator=gen)
    if lower_bound is None:
        g_ref = fla_gate.naive_kda_gate(g, A_log, dt_bias)
    else:
        g_ref = fla_gate.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(
        hand_l2norm(q), hand_l2norm(k), v, g_ref, beta.sigmoid(), None, S0, output_final_state=True
    )
    o, S = kimi_delta_attention(
        q, k, v, g, beta, A_log, dt_bias,
        gate_lower_bound=lower_bound, initial_state=S0, output_final_state=True, backend="torch",
    )
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    o_only, S_none = kimi_delta_attention(
        q, k, v, g, beta, A_log, dt_bias, gate_lower_bound=lower_bound, initial_state=S0
    )
    assert S_none is None and torch.equal(o_only, o)


def test_fused_entry_keeps_bf16_outputs_and_fp32_state():
    q, k, g = (torch.randn(1, 20, H, K, dtype=torch.bfloat16) for _ in range(3))
    v, beta = torch.randn(1, 20, H, V, dtype=torch.bfloat16), torch.randn(1, 20, H, dtype=torch.bfloat16)
    o, S = kimi_delta_attention(q, k, v, g, beta, torch.zeros(H), torch.zeros(H * K), output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32


def test_fused_entry_gradients_reach_gate_parameters():
    q, k, g = (torch.randn(1, 20, H, K) for _ in range(3))
    v, beta = torch.randn(1, 20, H, V), torch.randn(1, 20, H)
    A_log, dt_bias = torch.zeros(H, requires_grad=True), torch.zeros(H * K, requires_grad=True)
    o, _ = kimi_delta_attention(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound=-5.0)
    o.square().sum().backward()
    assert A_log.grad.abs().sum() > 0 and dt_bias.grad.abs().sum() > 0


def test_fused_entry_rejects_bad_inputs_with_a_fix():
    q, k, g = (torch.randn(2, 6, H, K) for _ in range(3))
    v, beta, A_log, dt_bias = torch.randn(2, 6, H, V), torch.randn(2, 6, H), torch.zeros(H), torch.zeros(H * K)
    with pytest.raises(ValueError, match=r"v must be \[B, T, H, V\]"):
        kimi_delta_attention(q, k, v[:, :5], g, beta, A_log, dt_bias)
    with pytest.raises(ValueError, match="beta must be"):
        kimi_delta_attention(q, k, v, g, beta[..., :2], A_log, dt_bias)
    with pytest.raises(ValueError, match="cu_seqlens needs packed inputs with batch size 1.*flatten"):
        kimi_delta_attention(q, k, v, g, beta, A_log, dt_bias, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"initial_state must be \[B, H, K, V\]"):
        kimi_delta_attention(q, k, v, g, beta, A_log, dt_bias, initial_state=torch.zeros(1, H, K, V))
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \(2,"):
        kimi_delta_attention(
            q[:1], k[:1], v[:1], g[:1], beta[:1], A_log, dt_bias,
            cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(1, H, K, V),
        )
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing offsets"):
        kimi_delta_attention(q[:1], k[:1], v[:1], g[:1], beta[:1], A_log, dt_bias, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="gate_lower_bound must be negative"):
        kimi_delta_attention(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound=5.0)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_decode_step_is_the_fused_entry_at_one_token_with_the_state_in_place(lower_bound):
    q, k, g = (torch.randn(3, 1, H, K, dtype=torch.float64) for _ in range(3))
    v, beta = torch.randn(3, 1, H, V, dtype=torch.float64), torch.randn(3, 1, H, dtype=torch.float64)
    A_log, dt_bias = torch.rand(H, dtype=torch.float64), torch.randn(H * K, dtype=torch.float64)
    S0 = torch.randn(3, H, K, V, dtype=torch.float64)
    o_ref, S_ref = kimi_delta_attention(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound=lower_bound,
                                        initial_state=S0, output_final_state=True)
    state = S0.clone()
    ptr = state.data_ptr()
    o = kda_decode_step(q, k, v, g, beta, A_log, dt_bias, state, gate_lower_bound=lower_bound)
    assert o.shape == v.shape and state.data_ptr() == ptr
    assert torch.allclose(o, o_ref, rtol=1e-12, atol=1e-12) and torch.allclose(state, S_ref, rtol=1e-12, atol=1e-12)
    flat = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], A_log, dt_bias, S0.clone(),
                           gate_lower_bound=lower_bound)  # [B, H, *] inputs give [B, H, V]
    assert flat.shape == (3, H, V) and torch.allclose(flat, o[:, 0], rtol=1e-12, atol=1e-12)


def test_decode_step_rejects_inputs_that_are_not_one_token_of_its_state():
    q, k, g = (torch.randn(2, 1, H, K) for _ in range(3))
    v, beta, A_log, dt_bias = torch.randn(2, 1, H, V), torch.randn(2, 1, H), torch.zeros(H), torch.zeros(H * K)
    state = torch.zeros(2, H, K, V)
    with pytest.raises(ValueError, match="one token per sequence.*use kimi_delta_attention"):
        kda_decode_step(q.expand(2, 3, H, K), k, v, g, beta, A_log, dt_bias, state)
    with pytest.raises(ValueError, match=r"state must be \[B, H, K, V\]"):
        kda_decode_step(q, k, v, g, beta, A_log, dt_bias, state[0])
    with pytest.raises(ValueError, match="k must have the shape of q"):
        kda_decode_step(q, k[..., :8], v, g, beta, A_log, dt_bias, state)
    with pytest.raises(ValueError, match="gate_lower_bound must be negative"):
        kda_decode_step(q, k, v, g, beta, A_log, dt_bias, state, gate_lower_bound=1.0)


def test_every_reference_path_returns_the_output_in_v_dtype_and_the_state_in_fp32():
    """bf16 inputs with an fp32 state: the token-by-token, chunked and single-step references, and the public ops on
    the torch backend (T = 1 goes token by token), all return o in v's dtype and the state in fp32."""
    q, k, v, g, beta = (t.to(torch.bfloat16) for t in activated_inputs(2, 3))
    S0 = torch.randn(2, H, K, V)
    o, S = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], 0.25, S0)
    assert (o.dtype, S.dtype) == (torch.bfloat16, torch.float32)
    for fn in (recurrent_kda, chunk_kda):
        o, S = fn(q, k, v, g, beta, 0.25, S0, output_final_state=True)
        assert (o.dtype, S.dtype) == (torch.bfloat16, torch.float32), fn
    raw = [torch.randn_like(t) for t in (q, k, v, q)] + [torch.randn(2, 3, H).to(torch.bfloat16)]
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * K)
    for T in (1, 3):
        o, S = kimi_delta_attention(*(t[:, :T] for t in raw), A_log, dt_bias, initial_state=S0,
                                    output_final_state=True, backend="torch")
        assert (o.dtype, S.dtype) == (torch.bfloat16, torch.float32), T
    state = S0.clone()
    assert kda_decode_step(*(t[:, :1] for t in raw), A_log, dt_bias, state, backend="torch").dtype == torch.bfloat16
