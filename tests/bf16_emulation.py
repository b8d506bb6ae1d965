"""bf16 in Triton's interpreter, as the GPU computes it.

The interpreter keeps bf16 tensors as their raw 16 bits (numpy has no bf16) and, in triton 3.9, handles them right
only in loads, stores and casts to fp32: ``tl.dot`` multiplies the bits as integers, element-wise arithmetic on bf16
tensors does the same, and a cast from fp32 truncates where the GPU rounds to nearest even. ``emulate_bf16`` patches
those places for one test (``monkeypatch``): bf16 operands are widened to fp32, so a ``tl.dot`` forms exact
products and sums them in fp32 as the tensor cores do, bf16 arithmetic runs in fp32 and rounds its result, and fp32
-> bf16 rounds to nearest even. Everything else is the interpreter's own.
"""

import numpy as np
import triton.language as tl
import triton.runtime.interpreter as interpreter


def _widen(bits: np.ndarray) -> np.ndarray:
    """bf16 bits -> the fp32 values they hold (exactly)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _round(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, rounding to nearest even (NaN / inf are not expected here)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _is_bf16(handle) -> bool:
    return handle.dtype.scalar == tl.bfloat16


def emulate_bf16(monkeypatch):
    builder = interpreter.InterpreterBuilder
    dot, unary, binary, cast = builder.create_dot, builder.unary_op, builder.binary_op, builder.cast_impl

    def as_fp32(h):
        return interpreter.TensorHandle(_widen(h.data), tl.float32) if _is_bf16(h) else h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    def unary_op(self, arg, op):
        if _is_bf16(arg):
            return interpreter.TensorHandle(_round(op(_widen(arg.data))), tl.bfloat16)
        return unary(self, arg, op)

    def binary_op(self, lhs, rhs, op):
        if _is_bf16(lhs) and _is_bf16(rhs):
            out = op(_widen(lhs.data), _widen(rhs.data))
            if out.dtype == np.bool_:  # comparisons
                return interpreter.TensorHandle(out, tl.int1)
            return interpreter.TensorHandle(_round(out), tl.bfloat16)
        return binary(self, lhs, rhs, op)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_round(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    for name, fn in [("create_dot", create_dot), ("unary_op", unary_op), ("binary_op", binary_op),
                     ("cast_impl", cast_impl)]:  # fp32 -> bf16 casts (create_fp_trunc) go through cast_impl
        monkeypatch.setattr(builder, name, fn)
