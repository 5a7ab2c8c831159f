"""Triton's interpreter made to do a GPU's arithmetic, for tests only.

The stock interpreter (``TRITON_INTERPRET=1``) computes in numpy (``tl.dot`` as a matmul of the
operands' storage), which differs from an NVIDIA GPU in four places:

* bf16 operands are stored as ``uint16`` bit patterns and multiplied as integers: here they are
  decoded to the fp32 values they stand for;
* fp32 operands of an ``input_precision="tf32"`` product are used with all 23 mantissa bits: the
  tensor cores read only tf32's 10 (the low 13 bits are ignored, a truncation); here they are
  truncated. ``"tf32x3"`` splits each operand into a tf32 part (rounded to nearest) and a tf32
  remainder and adds the three products that matter, as Triton compiles it; ``"ieee"`` stays exact;
* fp32 -> bf16 casts drop the low 16 bits: the GPU rounds to nearest even; here it does;
* ``tl.maximum`` / ``tl.minimum`` (``propagate_nan`` NONE, the default) are numpy's, which return a
  NaN operand: the GPU's ``max.f32`` / ``min.f32`` return the other one; here they do.

:func:`gpu_arithmetic` patches the interpreter's builder for the length of a ``with`` block;
the ``gpu_arithmetic`` fixtures of ``test_triton_chunk.py`` and ``test_nan_propagation.py`` wrap a test in it.
"""

from __future__ import annotations

import contextlib

import numpy as np


def bf16_to_fp32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (``uint16``) -> the fp32 numbers they encode (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, rounded to nearest, ties to even (NaN kept a NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def truncate_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 with the low 13 mantissa bits cleared: what a tensor core reads of a tf32 operand."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def round_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 rounded to tf32's 10 mantissa bits, to nearest (ties away from zero, as ``cvt.rna``)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x1000) & 0xFFFFE000).astype(np.uint32)).view(np.float32)


def _operand(handle) -> np.ndarray:
    """A dot operand's values as numpy floats (bf16 decoded)."""
    import triton.language as tl

    if handle.dtype.scalar == tl.bfloat16:
        return bf16_to_fp32(handle.data)
    return handle.data


def _dot(a: np.ndarray, b: np.ndarray, precision: str) -> np.ndarray:
    if a.dtype != np.float32 or b.dtype != np.float32 or precision == "ieee":
        return np.matmul(a, b, dtype=np.float32)  # fp16/bf16 products are exact in fp32
    if precision == "tf32":
        return np.matmul(truncate_tf32(a), truncate_tf32(b), dtype=np.float32)
    a_big, b_big = round_tf32(a), round_tf32(b)
    a_small, b_small = round_tf32(a - a_big), round_tf32(b - b_big)
    small = np.matmul(a_big, b_small, dtype=np.float32) + np.matmul(a_small, b_big, dtype=np.float32)
    return small + np.matmul(a_big, b_big, dtype=np.float32)


@contextlib.contextmanager
def gpu_arithmetic():
    """Within the block, the interpreter's products, fp32 -> bf16 casts and max / min are a GPU's (above)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    stock_dot, stock_cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar.is_fp8() or b.dtype.scalar.is_fp8():
            return stock_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = _dot(_operand(a), _operand(b), input_precision.name.lower())  # an ir.INPUT_PRECISION
        return interpreter.TensorHandle(product.astype(d.data.dtype) + d.data, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(fp32_to_bf16(src.data), tl.bfloat16)
        return stock_cast(self, src, dst_type)

    def create_maxnumf(self, lhs, rhs):
        return self.binary_op(lhs, rhs, np.fmax)

    def create_minnumf(self, lhs, rhs):
        return self.binary_op(lhs, rhs, np.fmin)

    patched = {"create_dot": create_dot, "cast_impl": cast_impl, "create_maxnumf": create_maxnumf,
               "create_minnumf": create_minnumf}
    stock = {name: getattr(builder, name) for name in patched}
    for name, method in patched.items():
        setattr(builder, name, method)
    try:
        yield
    finally:
        for name, method in stock.items():
            setattr(builder, name, method)
