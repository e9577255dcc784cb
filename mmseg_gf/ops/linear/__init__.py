"""The gradient-filtered Linear on token grids and its implementations,
fastest first.

``linear_backward``: steps 1, 3 and 4 of the filtered backward on the grid
tokens: the Triton kernels (:mod:`.gpu`), the compiled C++ kernel
(:mod:`.cpu`), the PyTorch reference
(:func:`~.function.filtered_backward_torch`).
``token_patch_sums``: the forward's patch sums of the grid tokens: the
compiled kernel, or PyTorch's pooling (:meth:`~.token_grid.TokenLayout.
pool_rows`; on CUDA it is kept, see docs/benchmarks).
"""
from ..backend import dispatch
from ..backend.dispatch import tensor_signature
from . import cpu, gpu
from .function import filtered_backward_torch


def _backward_signature(layout, g_rows, sums, weight, out_rows, need_w,
                        need_b, acc) -> tuple:
    return (tensor_signature(g_rows), tensor_signature(sums),
            tensor_signature(weight), tensor_signature(out_rows), acc)


def _triton_refusal(layout, g_rows, sums, weight, out_rows, *rest):
    return gpu.refusal(g_rows, out_rows, weight, sums)


def _cpp_refusal(layout, g_rows, sums, weight, out_rows, need_w, need_b,
                 acc):
    if g_rows.dtype != acc:
        return f'{g_rows.dtype} gradient accumulated in {acc}'
    return cpu.token_rows_refusal(g_rows, out_rows, weight, sums)


def _triton(layout, g_rows, x_sums, weight, out_rows, need_w, need_b, acc):
    return gpu.filtered_backward(g_rows, x_sums if need_w else None, weight,
                                 out_rows, layout.radius, need_w, need_b,
                                 acc)


def _cpp(layout, g_rows, x_sums, weight, out_rows, need_w, need_b, acc):
    return cpu.token_filtered_backward(g_rows, x_sums if need_w else None,
                                       weight, out_rows, layout.radius,
                                       need_w, need_b)


dispatch.register('linear_backward', [
    dispatch.Implementation('triton', _triton_refusal, _triton),
    dispatch.Implementation('c++', _cpp_refusal, _cpp),
    dispatch.Implementation('torch', lambda *call: None,
                            filtered_backward_torch),
], signature=_backward_signature)


def _sums_cpp_refusal(layout, rows, dtype):
    if dtype != rows.dtype:
        return f'{rows.dtype} rows summed in {dtype}'
    return cpu.token_rows_refusal(rows)


dispatch.register('token_patch_sums', [
    dispatch.Implementation(
        'c++', _sums_cpp_refusal,
        lambda layout, rows, dtype: cpu.token_patch_sums(rows,
                                                         layout.radius)),
    dispatch.Implementation(
        'torch', lambda *call: None,
        lambda layout, rows, dtype: layout.pool_rows(rows, dtype)),
], signature=lambda layout, rows, dtype: (tensor_signature(rows), dtype,
                                          layout.radius))
