"""tf32 tensor-core rounding of our KDA gradients, emulated on a CPU.

The Triton interpreter multiplies fp32 operands exactly. An H100 / H200 tf32 MMA instead reads each fp32 operand with
its low 13 mantissa bits dropped. This script makes every tf32 product of the interpreter do the same (products asked
for as tf32x3 or ieee stay exact), then prints the relative errors of our fp32-input gradients against the torch
reference for each precision of the gate-gradient kernel's score products (``BackwardLaunch.gate_prec``; "tf32" is
what the default, "bf16", gives fp32 inputs):

    python benchmarks/tf32_emulation.py [BxTxH]       (default 1x1024x2, K = V = 128, bounded gate; kda_moe importable)

The gate gradient cancels the row side of every score-gradient pair term against its column side, so the two must be
rounded identically (``as_mma_reads`` in kernels/kda/chunk_tiles.py); these errors show whether they are. The other
kernels' tf32 products are cut as well, as they would be for fp32 inputs on the GPU.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda as bench  # noqa: E402

from kda_moe.kernels.kda import chunk_bwd, chunk_fwd, kimi_delta_attention  # noqa: E402

TF32_PRECISIONS = ("tf32", "tf32x3")


def read_as_tf32(x: np.ndarray) -> np.ndarray:
    """What a tf32 MMA reads of an fp32 array: its low 13 mantissa bits dropped."""
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def emulate_tf32_products():
    exact = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if str(input_precision).endswith(".TF32") and a.data.dtype == np.float32 and b.data.dtype == np.float32:
            a = interpreter.TensorHandle(read_as_tf32(a.data), a.dtype)
            b = interpreter.TensorHandle(read_as_tf32(b.data), b.dtype)
        return exact(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def our_gradients(ins, A_log, dt_bias, do, gate_prec):
    """Gradients of our kernels (q, k, v, g, beta, A_log, dt_bias) with the gate kernel's products at ``gate_prec``."""
    B, T, H, K = ins[0].shape
    scale = K ** -0.5
    backward = chunk_bwd.backward_launch(K, K, B * H, ins[0].dtype, gate_prec=gate_prec)
    _, _, scores = chunk_fwd.chunk_kda_fwd(*ins, A_log, dt_bias, bench.LB, scale, None, False, None, keep_scores=True)
    return chunk_bwd.chunk_kda_bwd(*ins, A_log, dt_bias, bench.LB, scale, None, None, do, None, scores,
                                   launch=backward)[:7]


def main(shape="1x1024x2"):
    B, T, H = (int(n) for n in shape.split("x"))
    bench.dev = "cpu"
    q, k, v, g, beta, A_log, dt_bias = bench.make(B, T, H, 128)
    ins = [t.float() for t in (q, k, v, g, beta)]
    do = torch.randn_like(ins[2])
    leaves = [t.detach().requires_grad_() for t in ins + [A_log, dt_bias]]
    o = kimi_delta_attention(*leaves, gate_lower_bound=bench.LB, backend="torch")[0]
    reference = torch.autograd.grad(o, leaves, do)
    emulate_tf32_products()
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    print(f"fp32 inputs, {B}x{T}x{H}, K = V = 128, bounded gate; every tf32 product reads its operands as the MMA does")
    print("| gate_prec | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for prec in TF32_PRECISIONS:
        errors = [bench.rel(a, b) for a, b in zip(our_gradients(ins, A_log, dt_bias, do, prec), reference)]
        print(f"| {prec} | " + " | ".join(f"{e:.1e}" for e in errors) + " |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
