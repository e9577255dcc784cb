"""A stand-in backend of the filtered Linear's backward: the PyTorch
reference, counted, taking float32 only. What a second backend for one
operator costs: this file plus one line in the operator's list
(tests/test_ops/backend/test_dispatch.py adds it)."""
from mmseg_gf.ops.backend.dispatch import Implementation
from mmseg_gf.ops.linear.function import filtered_backward_torch

calls = []


def refusal(layout, g_rows, sums, weight, out_rows, need_w, need_b, acc):
    if g_rows.dtype.is_floating_point and g_rows.dtype.itemsize == 4:
        return None
    return f'stand-in takes float32, got {g_rows.dtype}'


def run(*call):
    calls.append(call[1].shape)
    return filtered_backward_torch(*call)


STAND_IN = Implementation('stand-in', refusal, run)
