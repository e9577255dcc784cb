"""Time and peak memory of a decode loss: mmseg's way (``autograd``) against
the resized cross-entropy's PyTorch path (``per_image``) and compiled
kernel (``kernel``), interleaved repetition by repetition. Pure torch.
"""
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from ..accounting.format import format_table
from ..accounting.measured import profiled_peak_bytes
from ..ops.backend import dispatch
from ..ops.resized_loss.loss import resized_cross_entropy

__all__ = ['loss_cases', 'benchmark_loss', 'loss_table']


def _autograd_loss(logits: torch.Tensor, label: torch.Tensor,
                   sigmoid: bool) -> Callable[[], None]:
    def run() -> None:
        z = logits.detach().requires_grad_(True)
        up = F.interpolate(z, size=label.shape[-2:], mode='bilinear',
                           align_corners=False)
        if sigmoid:
            valid = label != 255
            onehot = F.one_hot(torch.where(valid, label, 0), z.shape[1])
            loss = (F.binary_cross_entropy_with_logits(
                up, onehot.permute(0, 3, 1, 2).to(up.dtype),
                reduction='none').sum(1) * valid).sum()
        else:
            loss = F.cross_entropy(up, label, ignore_index=255,
                                   reduction='sum')
        loss.backward()

    return run


def _resized_loss(logits: torch.Tensor, label: torch.Tensor, sigmoid: bool,
                  use_kernel: bool) -> Callable[[], None]:
    def run() -> None:
        resized_cross_entropy(logits, label, sigmoid=sigmoid,
                              use_kernel=use_kernel)

    return run


def loss_cases(logits: torch.Tensor, label: torch.Tensor,
               sigmoid: bool = False) -> Dict[str, Callable[[], None]]:
    """The ways to run, each a function of no argument."""
    cases = {'autograd': _autograd_loss(logits, label, sigmoid),
             'per_image': _resized_loss(logits, label, sigmoid, False)}
    if dispatch.refusal('resized_loss', 'c++', logits) is None:
        cases['kernel'] = _resized_loss(logits, label, sigmoid, True)
    return cases


def benchmark_loss(batch: int, classes: int, logits_size, label_size,
                   sigmoid: bool = False, repeats: int = 5,
                   warmup: int = 1, memory: bool = True,
                   seed: int = 0) -> List[Dict]:
    """Median seconds (and peak live bytes) of each way on random logits and
    labels."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((batch, classes) + tuple(logits_size), generator=g)
    label = torch.randint(0, classes, (batch, ) + tuple(label_size),
                          generator=g)
    label[:, :label.shape[1] // 10] = 255
    cases = loss_cases(logits, label, sigmoid)
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for i in range(warmup + repeats):
        for name, run in cases.items():
            t0 = time.perf_counter()
            run()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    rows = []
    for name, run in cases.items():
        row = dict(way=name, seconds=statistics.median(times[name]),
                   peak_bytes=profiled_peak_bytes(run) if memory else None)
        rows.append(row)
    base = rows[0]['seconds']
    for row in rows:
        row['speedup'] = base / row['seconds']
    return rows


def loss_table(rows: List[Dict], style: str = 'markdown') -> str:
    """The rows as a table: seconds, speedup over autograd, peak MiB."""
    def mib(v: Optional[int]) -> str:
        return '' if v is None else f'{v / 2**20:.1f}'

    return format_table(
        ['way', 'seconds', 'speedup', 'peak MiB'],
        [[r['way'], f"{r['seconds']:.4f}", f"{r['speedup']:.2f}",
          mib(r['peak_bytes'])] for r in rows], align='lrrr', style=style)
