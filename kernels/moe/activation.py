"""The experts' gated activation on fp32 Triton tiles, and its derivatives, shared by the decode and grouped kernels.

``a = A(gate) * U(up)``: SwiGLU ``A(g) = g sigmoid(g)``, ``U(u) = u``; SiTU-GLU ``A(g) = gate_cap tanh(g / gate_cap)
sigmoid(g)``, ``U(u) = up_cap tanh(u / up_cap)`` (or ``u`` without the up cap), as ``reference.gated_activation``.
"""

from ..backend import tl, triton


@triton.jit
def _tanh(x):
    """tanh from exp (Triton's language has no tanh that its interpreter runs): (1 - e) / (1 + e) with
    e = exp(-2|x|), which cannot overflow; below |x| = 0.1, where that difference cancels, its odd Taylor polynomial
    (truncation error < 3e-10 relative)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    a2 = a * a
    taylor = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 - a2 * (17.0 / 315.0))))
    t = tl.where(a < 0.1, taylor, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def gated_activation(gate, up, gate_cap, up_cap, SITU: tl.constexpr, UP_CAP: tl.constexpr):
    """``A(gate) * U(up)`` on fp32 tiles (the up cap only if UP_CAP, and only for SiTU-GLU)."""
    sigmoid = tl.sigmoid(gate)
    if SITU:
        gate = gate_cap * _tanh(gate / gate_cap)
        if UP_CAP:
            up = up_cap * _tanh(up / up_cap)
    return gate * sigmoid * up


@triton.jit
def gated_activation_and_grads(gate, up, gate_cap, up_cap, SITU: tl.constexpr, UP_CAP: tl.constexpr):
    """``(a, da / dgate, da / dup)`` of ``a = A(gate) * U(up)`` on fp32 tiles, element by element."""
    sigmoid = tl.sigmoid(gate)
    if SITU:
        t = _tanh(gate / gate_cap)
        act = gate_cap * t * sigmoid
        act_grad = (1.0 - t * t) * sigmoid + act * (1.0 - sigmoid)
        if UP_CAP:
            t_up = _tanh(up / up_cap)
            capped, capped_grad = up_cap * t_up, 1.0 - t_up * t_up
        else:
            capped, capped_grad = up, 1.0
    else:
        act = gate * sigmoid
        act_grad = sigmoid + act * (1.0 - sigmoid)
        capped, capped_grad = up, 1.0
    return act * capped, act_grad * capped, act * capped_grad
