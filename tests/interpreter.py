"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) made fit to run fla's delta-rule kernels in bf16.

The interpreter (Triton 3.9) holds a bf16 tensor as its uint16 bits and hands those bits to numpy: ``tl.dot``,
negation, element-wise arithmetic of two bf16 tensors and ``tl.sum`` of one computed on the integers (fla's
``fwd_intra`` gave 1e11), and it rounds fp32 -> bf16 by truncation where a GPU rounds to nearest even. Here each of
those computes in fp32 and rounds to nearest even, as the GPU does; an fp32 ``tl.dot`` in TF32 (Triton's default,
and fla's triangular solve on Hopper) reads its operands rounded to TF32, as tensor cores do. Autotuning keeps its first config (the
interpreter has no benchmarker). Import and call :func:`install` before fla is imported."""

from __future__ import annotations

import numpy as np
import torch


def _float32(handle) -> np.ndarray:
    import triton.language as tl

    if handle.dtype.scalar == tl.bfloat16:
        return (handle.data.astype(np.uint32) << 16).view(np.float32)
    return handle.data


def _bfloat16(values) -> np.ndarray:
    """fp32 values as bf16 bits, rounded to nearest even (torch's rounding, the GPU's)."""
    array = np.ascontiguousarray(values, dtype=np.float32)
    bits = torch.from_numpy(array.reshape(-1)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return bits.reshape(array.shape)


def _tf32(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to TF32 (10 mantissa bits, to nearest even), as a GPU's tensor cores read them."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x0FFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return rounded.view(np.float32)


def install() -> None:
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as it

    if getattr(it, "_fusepatch_bf16", False):
        return
    it._fusepatch_bf16 = True
    builder, handle, bf16 = it.InterpreterBuilder, it.TensorHandle, tl.bfloat16

    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if bf16 in (a.dtype.scalar, b.dtype.scalar):
            a, b = handle(_float32(a), tl.float32), handle(_float32(b), tl.float32)
        elif input_precision == ir.INPUT_PRECISION.TF32 and a.dtype.scalar == b.dtype.scalar == tl.float32:
            a, b = handle(_tf32(a.data), tl.float32), handle(_tf32(b.data), tl.float32)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == bf16 and dst_type.scalar == tl.float32:
            return handle(_float32(src), tl.float32)
        if dst_type.scalar == bf16 and src.dtype.scalar.is_floating():
            return handle(_bfloat16(_float32(src)), bf16)
        return cast(self, src, dst_type)

    fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if bf16 in (src.dtype.scalar, dst_type.scalar) and src.dtype.scalar != tl.float16:
            return cast_impl(self, src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    binary = builder.binary_op

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar == bf16 and rhs.dtype.scalar == bf16:
            out = op(_float32(lhs), _float32(rhs))
            return handle(out, tl.int1) if out.dtype == np.bool_ else handle(_bfloat16(out), bf16)
        return binary(self, lhs, rhs, op)

    unary = builder.unary_op

    def unary_op(self, arg, op):
        if arg.dtype.scalar == bf16:
            return handle(_bfloat16(op(_float32(arg))), bf16)
        return unary(self, arg, op)

    total = it.ReduceOps.sum

    def reduce_sum(self, input):
        if input.dtype.scalar == bf16:
            data = np.asarray(np.sum(_float32(input.handle), axis=self.axis, keepdims=self.keep_dims))
            return self.to_tensor(_bfloat16(data), input.dtype)
        return total(self, input)

    builder.create_dot, builder.cast_impl, builder.create_fp_to_fp = create_dot, cast_impl, create_fp_to_fp
    builder.binary_op, builder.unary_op, it.ReduceOps.sum = binary_op, unary_op, reduce_sum

    init = autotuner.Autotuner.__init__

    def first_config(self, fn, arg_names, configs, *args, **kwargs):
        init(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_config
    it.FunctionRewriter.ast_transformer = _loop_counters()()


def _loop_counters():
    """The interpreter's kernel rewriter, whose ``for i in range(n)`` counters are tensors, as compiled Triton's
    are (fla's kernels call ``i_t.to(tl.int64)`` on one): the loop's body starts with ``i = i``, which the
    rewriter's assignment rule makes a tensor."""
    import ast

    import triton.runtime.interpreter as it

    class LoopCounters(it.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            call = node.iter
            plain = isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "range"
            if plain and isinstance(node.target, ast.Name):
                name = node.target.id
                again = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Name(id=name, ctx=ast.Load())
                )
                node.body.insert(0, ast.copy_location(self.visit_Assign(again), node.body[0]))
            return node

    return LoopCounters
