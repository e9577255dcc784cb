"""Live tensor bytes measured with torch's CPU profiler
(:func:`mmseg_gf.accounting.measured.live_bytes_by_interval`)."""
import torch
from torch.autograd import Function

from mmseg_gf.accounting.measured import live_bytes_by_interval, mark

MIB = 2 ** 20


class _TemporariesInForward(Function):
    """Makes and drops three 1 MiB tensors one after the other in its
    forward: never more than one of them is alive."""

    @staticmethod
    def forward(ctx, x):
        for _ in range(3):
            temporary = torch.ones(MIB // 4)
            del temporary
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_frees_inside_a_custom_function_count_when_they_happen():
    """What a custom Function frees between its operators is freed then,
    not when the Function returns (the profiler's per-event self memory
    would show three tensors alive at once)."""
    x = torch.zeros(4, requires_grad=True)
    peak = max(live_bytes_by_interval(lambda: _TemporariesInForward.apply(x),
                                      marker=None))
    assert MIB <= peak < 2 * MIB


def test_intervals_and_what_is_left():
    """Peaks per interval between markers; the last interval's value is
    what is still alive at its end."""
    kept = []

    def run():
        kept.append(torch.ones(MIB // 4))
        mark()
        temporary = torch.ones(MIB // 2)
        del temporary
        mark()

    peaks = live_bytes_by_interval(run)
    assert peaks == [MIB, 3 * MIB, MIB]


def test_freeing_memory_from_an_earlier_profiled_run_lowers_nothing():
    """The profiler reports the free of a block an earlier profiling
    session saw allocated (here 4 MiB left alive by it): counted, it would
    put the running sum 4 MiB below zero and the peak of this run, which
    then makes 1 MiB, at 0. Only what the run itself made counts."""
    left = []
    live_bytes_by_interval(lambda: left.append(torch.ones(MIB)),
                           marker=None)

    def run():
        left.clear()
        made = torch.ones(MIB // 4)
        return made

    assert live_bytes_by_interval(run, marker=None) == [MIB]

