"""tf32 tensor-core rounding of our KDA gradients, emulated on a CPU.

The Triton interpreter multiplies fp32 operands exactly. An H100 / H200 tf32 MMA instead reads each fp32 operand with
its low 13 mantissa bits dropped. This script makes every tf32 product of the interpreter do the same (products asked
for as tf32x3 or ieee stay exact), then prints the relative errors of our fp32-input gradients against the torch
reference for each precision of the gate-gradient kernel's score products (``chunk_bwd.CONFIG["gate_prec"]``):

    python benchmarks/tf32_emulation.py [BxTxH]       (default 1x1024x2, K = V = 128, bounded gate; kda_moe importable)

It is how the gate-gradient precision problem was found and fixed: the gate gradient cancels the row side of every
score-gradient pair term against its column side, so the two must be rounded identically (``as_mma_reads`` in
kernels/kda/chunk_tiles.py). The other kernels' tf32 products are cut as well, as they would be for fp32 inputs on
the GPU.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda as bench  # noqa: E402

from kda_moe.kernels.kda import chunk_bwd  # noqa: E402

GATE_PRECISIONS = ("tf32", "tf32x3")


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


def main(shape="1x1024x2"):
    B, T, H = (int(n) for n in shape.split("x"))
    bench.dev = "cpu"
    q, k, v, g, beta, A_log, dt_bias = bench.make(B, T, H, 128)
    ins = [t.float() for t in (q, k, v, g, beta)]
    do = torch.randn_like(ins[2])
    emulate_tf32_products()
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    print(f"fp32 inputs, {B}x{T}x{H}, K = V = 128, bounded gate; every tf32 product reads its operands as the MMA does")
    print("| gate_prec | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for prec in GATE_PRECISIONS:
        chunk_bwd.CONFIG["gate_prec"] = prec
        errors = bench.grad_errors(ins, A_log, dt_bias, do, {})["ours"]
        print(f"| {prec} | " + " | ".join(f"{errors[n]:.1e}" for n in names) + " |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
