"""Routed experts for a few tokens (decoding), reading only the chosen experts' weights, each once.

``moe_decode_triton`` takes hidden states ``[N, l]``, each token's k chosen experts and routing weights ``[N, k]``
and the fused expert weights as stored, ``gate_up_proj [E, 2I, l]`` and ``down_proj [E, l, I]``, and returns
``sum_j w_j down_j(act(gate_up_j(x)))`` per token ``[N, l]``. Two kernels and one sum:

1. up: a program per (choice slot, block of I channels). The program of the first slot that chose an expert (in
   token-major order) runs that expert for every token that chose it: it reads the expert's gate and up rows of its
   block straight from ``gate_up_proj`` once, multiplies them with those tokens' rows (a ``[rows, l]`` tile, the
   other rows masked off) and stores the gated activation per (token, choice). Programs of the other slots exit.
2. down: the same ownership over (choice slot, block of l channels); the owner multiplies its expert's ``down_proj``
   rows with the activations of the tokens that chose it and stores each (token, choice)'s weighted row in fp32.
3. sum: a program per (token, block of l channels) adds the token's k rows in fp32, in choice order, and rounds the
   sum to the input dtype.

A shared expert (a dense MLP every token takes, its gate, up and down weights given apart) adds one slot to both
grids, after the choice slots: its programs run it for all the tokens at once, and its row joins each token's sum
last, with weight 1.

The MoE layer's RMSNorm and residual add can run inside (``kernels/rows.py``): with ``input_norm`` every up program
normalises the token rows it reads, with ``residual`` the sum adds the residual stream's rows to the rounded sum as it
stores it, rounded as ``KdaMoeRMSNorm`` and the eager add round; the layer then reads and writes the residual stream
with no norm or add kernel around it.

No host reads, no data-dependent shapes (the grids depend on N, k, I and l only), so torch.compile traces the custom
op and a CUDA graph replays it. Bytes read per call: the distinct chosen experts' ``3 * I * l`` weights, once each,
plus the tokens' rows. Products accumulate in fp32 (fp32 inputs multiply in full fp32, not tf32); the activation is
rounded to the input dtype before the down product, as the other expert implementations hand it on. Launched as
dependent (``dependent_launch``), each kernel's programs start while the kernel before it still runs: the shared
expert's up programs and every down program load their first weight slab (the down programs their expert's, from the
router's choices), then wait for that kernel's results.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from ..backend import op_for_call, refuse_autograd, tl, triton
from ..dependent_launch import dependent_launch, wait_for_inputs
from ..linear.decode import accumulate_products
from ..rows import add_residual, load_input_slab, load_slab, rms_scales
from .activation import gated_activation
from .limits import MAX_DECODE_TOKENS, fits_decode_kernel

SUM_BLOCK = 256  # output channels per program of the sum over choices (two fp32 a thread at 4 warps)


@dataclass(frozen=True)
class MoeDecodeLaunch:
    """How the two decode kernels are launched; ``moe_decode_launch`` picks one per call."""

    rows: int  # token rows of every tile: all N tokens, padded to a power of two (see ``accumulate_products``)
    block_inter: int  # intermediate channels (of gate and of up each) per up program
    block_out: int  # output channels per down program
    block_k: int  # reduction slice per loop step, in both kernels
    warps: int  # warps per program
    stages: int  # software-pipeline depth of the reduction loops' loads


def moe_decode_launch(tokens: int, hidden: int, intermediate: int) -> MoeDecodeLaunch:
    """Measured on an H100 (``benchmarks/moe_decode.py``, the anchor's and K3's experts). One token: its row unpadded
    on the CUDA cores, 2 intermediate / 4 output channels a program and 512-wide slices at 2 warps, so that its k
    experts spread over thousands of programs (anchor 23.0 us, K3 364 us: the fastest of the 17 settings swept).
    More tokens: 32 / 64 channels a program on the tensor cores, 128-wide slices up to 32 token rows (the fastest at
    32 tokens: anchor 100 us, K3 5.97 ms), 64-wide beyond to keep the token tile in registers."""
    width = max(16, triton.next_power_of_2(max(hidden, intermediate)))
    if tokens == 1:
        return MoeDecodeLaunch(rows=1, block_inter=2, block_out=4, block_k=min(512, width), warps=2, stages=3)
    rows = max(16, triton.next_power_of_2(tokens))
    return MoeDecodeLaunch(rows=rows, block_inter=32, block_out=64, block_k=min(128 if rows <= 32 else 64, width),
                           warps=4, stages=3)


@triton.jit
def _expert_of_slot(top_k_index, slot, N, E, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr):
    """Choice slot ``slot`` (token slot // K, its (slot % K)-th choice) chose expert e. Returns (e; per token row
    [ROWS]: whether it chose e, and the first of its choices that is e; whether this slot owns e: it is the first slot
    that chose e, in token-major order, and e is one of the E experts)."""
    e = tl.load(top_k_index + slot)
    o_t = tl.arange(0, ROWS)
    o_j = tl.arange(0, KP)
    chosen = tl.load(top_k_index + o_t[:, None] * K + o_j[None, :], mask=(o_t < N)[:, None] & (o_j < K)[None, :],
                     other=-1)
    choice = tl.min(tl.where(chosen == e, o_j[None, :], KP), 1)  # [ROWS], KP where the token did not choose e
    chose = choice < KP
    first_token = tl.min(tl.where(chose, o_t, ROWS), 0)
    first_choice = tl.min(tl.where(o_t == first_token, choice, KP), 0)
    owner = (slot == first_token * K + first_choice) & (e >= 0) & (e < E)
    return e, chose, choice, owner


@triton.jit
def _gated_block(x, rows, w_gate, w_up, m_i, first_gate, first_up, gate_cap, up_cap, norm_weight, eps,
                 L: tl.constexpr, ROWS: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, SITU: tl.constexpr,
                 UP_CAP: tl.constexpr, NORM: tl.constexpr):
    """[ROWS, BI] fp32: the gated activation of the token rows marked by ``rows`` ([ROWS]; the others 0; with
    ``NORM`` through the RMSNorm of ``norm_weight``) for the weight rows at pointers w_gate / w_up ([BI], masked by
    m_i), each row of length L read once; their first slabs ``first_gate`` / ``first_up`` ([BI, BK], ``load_slab``)
    already loaded."""
    x_rows = x + tl.arange(0, ROWS) * L
    scales = rms_scales(x_rows, rows, L, eps, BK, NORM)
    bx = load_input_slab(x_rows, rows, 0, L, BK, scales, norm_weight, NORM)
    acc_gate = accumulate_products(tl.zeros((ROWS, BI), dtype=tl.float32), bx, first_gate)
    acc_up = accumulate_products(tl.zeros((ROWS, BI), dtype=tl.float32), bx, first_up)
    for k0 in range(BK, L, BK):
        bx = load_input_slab(x_rows, rows, k0, L, BK, scales, norm_weight, NORM)
        acc_gate = accumulate_products(acc_gate, bx, load_slab(w_gate, m_i, k0, L, BK))
        acc_up = accumulate_products(acc_up, bx, load_slab(w_up, m_i, k0, L, BK))
    return gated_activation(acc_gate, acc_up, gate_cap, up_cap, SITU, UP_CAP)


@triton.jit
def _down_block(act_rows, rows, w_down, m_o, first, I: tl.constexpr, ROWS: tl.constexpr, BO: tl.constexpr,
                BK: tl.constexpr):
    """[ROWS, BO] fp32: the activation rows at pointers act_rows ([ROWS], of length I; those not marked by ``rows``
    read as 0) times the down rows at pointers w_down ([BO], masked by m_o), their first slab ``first`` already
    loaded."""
    acc = accumulate_products(tl.zeros((ROWS, BO), dtype=tl.float32), load_slab(act_rows, rows, 0, I, BK), first)
    for k0 in range(BK, I, BK):
        acc = accumulate_products(acc, load_slab(act_rows, rows, k0, I, BK), load_slab(w_down, m_o, k0, I, BK))
    return acc


@triton.jit
def _moe_up_kernel(x, top_k_index, gate_up, act, shared_gate, shared_up, shared_act, N, E, gate_cap, up_cap,
                   norm_weight, eps, K: tl.constexpr, KP: tl.constexpr, L: tl.constexpr, I: tl.constexpr,
                   IS: tl.constexpr, ROWS: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, SITU: tl.constexpr,
                   UP_CAP: tl.constexpr, NORM: tl.constexpr, DEPENDENT: tl.constexpr):
    slot = tl.program_id(0)
    o_t = tl.arange(0, ROWS)
    o_i = tl.program_id(1) * BI + tl.arange(0, BI)
    if slot == N * K:  # the shared expert (a slot launched only with one): every token, its own weights
        m_i = o_i < IS
        w_gate, w_up = shared_gate + o_i * L, shared_up + o_i * L
        first_gate, first_up = load_slab(w_gate, m_i, 0, L, BK), load_slab(w_up, m_i, 0, L, BK)  # before the wait
        wait_for_inputs(DEPENDENT)
        if tl.program_id(1) * BI < IS:
            h = _gated_block(x, o_t < N, w_gate, w_up, m_i, first_gate, first_up, gate_cap, up_cap, norm_weight,
                             eps, L, ROWS, BI, BK, SITU, UP_CAP, NORM)
            tl.store(shared_act + o_t[:, None] * IS + o_i[None, :], h.to(shared_act.dtype.element_ty),
                     mask=(o_t < N)[:, None] & m_i[None, :])
    else:
        wait_for_inputs(DEPENDENT)  # the experts come from the kernel just before (the router's top-k)
        e, chose, choice, owner = _expert_of_slot(top_k_index, slot, N, E, K, KP, ROWS)
        m_i = o_i < I
        if owner & (tl.program_id(1) * BI < I):
            w_gate = gate_up + e.to(tl.int64) * (2 * I * L) + o_i * L  # [BI] pointers; the up rows: + I * L
            h = _gated_block(x, chose, w_gate, w_gate + I * L, m_i, load_slab(w_gate, m_i, 0, L, BK),
                             load_slab(w_gate + I * L, m_i, 0, L, BK), gate_cap, up_cap, norm_weight, eps, L, ROWS,
                             BI, BK, SITU, UP_CAP, NORM)
            rows = (o_t * K + choice)[:, None] * I  # each token's row of act: the first of its choices that is e
            tl.store(act + rows + o_i[None, :], h.to(act.dtype.element_ty), mask=chose[:, None] & m_i[None, :])


@triton.jit
def _moe_down_kernel(act, top_k_index, top_k_weights, down, shared_act, shared_down, out, N, E, K: tl.constexpr,
                     KP: tl.constexpr, KS: tl.constexpr, L: tl.constexpr, I: tl.constexpr, IS: tl.constexpr,
                     ROWS: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, DEPENDENT: tl.constexpr):
    # Before the wait for the up kernel's activations: the expert of this slot (the router's top-k wrote it, a
    # launch earlier: complete once this kernel starts) and the first slab of its down rows.
    slot = tl.program_id(0)
    o_t = tl.arange(0, ROWS)
    o_o = tl.program_id(1) * BO + tl.arange(0, BO)
    m_o = o_o < L
    if slot == N * K:  # the shared expert: every token's row K, weight 1
        w_down = shared_down + o_o * IS
        first = load_slab(w_down, m_o, 0, IS, BK)
        wait_for_inputs(DEPENDENT)
        acc = _down_block(shared_act + o_t * IS, o_t < N, w_down, m_o, first, IS, ROWS, BO, BK)
        tl.store(out + (o_t * KS + K)[:, None] * L + o_o[None, :], acc, mask=(o_t < N)[:, None] & m_o[None, :])
    else:
        e, chose, choice, owner = _expert_of_slot(top_k_index, slot, N, E, K, KP, ROWS)
        if owner:
            w_down = down + e.to(tl.int64) * (L * I) + o_o * I
            first = load_slab(w_down, m_o, 0, I, BK)
            wait_for_inputs(DEPENDENT)
            acc = _down_block(act + (o_t * K + choice) * I, chose, w_down, m_o, first, I, ROWS, BO, BK)
            for j in tl.static_range(K):  # every (token, choice) that is e gets its own weighted row
                picked = tl.load(top_k_index + o_t * K + j, mask=o_t < N, other=-1) == e
                weight = tl.load(top_k_weights + o_t * K + j, mask=picked, other=0.0).to(tl.float32)
                tl.store(out + (o_t * KS + j)[:, None] * L + o_o[None, :], acc * weight[:, None],
                         mask=picked[:, None] & m_o[None, :])
        elif (e < 0) | (e >= E):  # no expert (an expert-parallel placeholder id): the slot adds nothing
            wait_for_inputs(DEPENDENT)
            tl.store(out + ((slot // K) * KS + slot % K) * L + o_o, tl.zeros((BO,), dtype=tl.float32), mask=m_o)


@triton.jit
def _moe_sum_kernel(out, y, residual, KS: tl.constexpr, L: tl.constexpr, BO: tl.constexpr, RESIDUAL: tl.constexpr,
                    DEPENDENT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    o_o = tl.program_id(1) * BO + tl.arange(0, BO)
    m_o = o_o < L
    wait_for_inputs(DEPENDENT)
    acc = tl.zeros((BO,), dtype=tl.float32)
    for j in tl.static_range(KS):
        acc += tl.load(out + (token * KS + j) * L + o_o, mask=m_o, other=0.0)
    acc = add_residual(acc, residual + token * L + o_o, m_o, RESIDUAL)
    tl.store(y + token * L + o_o, acc.to(y.dtype.element_ty), mask=m_o)


def launch_moe_decode(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, shared, kind, gate_cap,
                      up_cap, launch: MoeDecodeLaunch, norm_weight=None, eps=0.0, residual=None):
    """The three kernels on contiguous inputs (shapes as in ``moe_decode_triton``; ``shared`` None or the shared
    expert's (gate, up, down) weights); returns ``[N, l]`` in hidden_states' dtype. ``norm_weight`` ``[l]``: the
    rows go through that RMSNorm (of epsilon ``eps``) first; ``residual`` ``[N, l]``: added to the sum."""
    N, K = top_k_index.shape
    E, L, I = down_proj.shape
    IS = 0 if shared is None else shared[2].shape[1]
    KS = K + (shared is not None)  # rows per token: its choices, then the shared expert's
    act = hidden_states.new_empty(N * K, I)  # per (token, choice): the gated activation, in the input dtype
    shared_act = hidden_states.new_empty(N, IS)
    out = torch.empty(N, KS, L, device=hidden_states.device, dtype=torch.float32)  # per (token, row): w_j * expert_j
    shared_gate, shared_up, shared_down = (hidden_states,) * 3 if shared is None else shared
    shape = dict(K=K, KP=triton.next_power_of_2(K), L=L, I=I, IS=IS, ROWS=launch.rows)
    slots = N * K + (shared is not None)
    dependent = dependent_launch(hidden_states.device)
    _moe_up_kernel[(slots, triton.cdiv(max(I, IS), launch.block_inter))](
        hidden_states, top_k_index, gate_up_proj, act, shared_gate, shared_up, shared_act, N, E, float(gate_cap),
        0.0 if up_cap is None else float(up_cap), hidden_states if norm_weight is None else norm_weight, float(eps),
        BI=launch.block_inter, BK=launch.block_k, SITU=kind == "situ", UP_CAP=up_cap is not None,
        NORM=norm_weight is not None, num_warps=launch.warps, num_stages=launch.stages, **shape, **dependent)
    _moe_down_kernel[(slots, triton.cdiv(L, launch.block_out))](
        act, top_k_index, top_k_weights, down_proj, shared_act, shared_down, out, N, E, KS=KS,
        BO=launch.block_out, BK=launch.block_k, num_warps=launch.warps, num_stages=launch.stages, **shape, **dependent)
    y = torch.empty_like(hidden_states)
    _moe_sum_kernel[(N, triton.cdiv(L, SUM_BLOCK))](out, y, hidden_states if residual is None else residual, KS=KS,
                                                    L=L, BO=SUM_BLOCK, RESIDUAL=residual is not None, num_warps=4,
                                                    **dependent)
    return y


def _decode(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up_proj: torch.Tensor, down_proj: torch.Tensor, shared: list[torch.Tensor], kind: str,
            gate_cap: float, up_cap: Optional[float], norm_weight: Optional[torch.Tensor], eps: float,
            residual: Optional[torch.Tensor]) -> torch.Tensor:
    """``shared``: the shared expert's (gate, up, down) weights, or empty."""
    shared = shared or None
    intermediate = down_proj.shape[2] if shared is None else max(down_proj.shape[2], shared[2].shape[1])
    return launch_moe_decode(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, shared, kind,
                             gate_cap, up_cap, moe_decode_launch(*hidden_states.shape, intermediate), norm_weight, eps,
                             residual)


moe_decode_op = torch.library.custom_op("kda_moe::moe_decode", _decode, mutates_args=())


@moe_decode_op.register_fake
def _(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, shared, kind, gate_cap, up_cap, norm_weight,
      eps, residual):
    return hidden_states.new_empty(hidden_states.shape)


def moe_decode_triton(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, kind, gate_cap, up_cap,
                      shared=None, input_norm=None, residual=None):
    """The routed experts of at most ``MAX_DECODE_TOKENS`` tokens in three launches. hidden_states ``[N, l]``;
    top_k_index (expert ids) / top_k_weights ``[N, k]``; gate_up_proj ``[E, 2I, l]`` and down_proj ``[E, l, I]``
    (contiguous, hidden_states' dtype, read in place); the activation ``kind`` ("silu" | "situ") with its caps;
    ``shared`` None or a shared expert's (gate ``[Is, l]``, up ``[Is, l]``, down ``[l, Is]``) weights, whose output
    joins every token's sum; ``input_norm`` (weight ``[l]``, eps) and ``residual`` ``[N, l]`` as ``moe_decode``
    checks them. Returns ``[N, l]`` in hidden_states' dtype. Decoding only: no backward."""
    if not fits_decode_kernel(hidden_states, gate_up_proj, down_proj, *(shared or ())):
        raise ValueError(
            f"the Triton MoE decode kernel takes at most {MAX_DECODE_TOKENS} tokens in bf16, fp16 or fp32 and reads "
            f"contiguous expert weights of that dtype in place; got {hidden_states.shape[0]} tokens in "
            f"{hidden_states.dtype}, gate_up_proj {gate_up_proj.dtype} (contiguous: {gate_up_proj.is_contiguous()}) "
            f"and down_proj {down_proj.dtype} (contiguous: {down_proj.is_contiguous()}), shared expert weights "
            f"{[(w.dtype, w.is_contiguous()) for w in shared or ()]}. Run the experts module (its "
            "experts_implementation) for more tokens, or pass matching contiguous weights."
        )
    norm_weight, eps = input_norm or (None, 0.0)
    inputs = [t for t in (hidden_states, top_k_weights, gate_up_proj, down_proj, *(shared or ()), norm_weight,
                          residual) if t is not None]
    refuse_autograd("the Triton MoE decode kernel", inputs, "the experts module")
    hidden_states, top_k_index, top_k_weights = (t.contiguous() for t in (hidden_states, top_k_index, top_k_weights))
    norm_weight, residual = (None if t is None else t.contiguous() for t in (norm_weight, residual))
    up_cap = None if up_cap is None else float(up_cap)
    return op_for_call(moe_decode_op, _decode)(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                               list(shared or ()), kind, float(gate_cap), up_cap, norm_weight,
                                               float(eps), residual)
