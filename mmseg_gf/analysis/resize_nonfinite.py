"""What keeping a non-finite gradient local would cost the GEMM resize.

The GEMM route spreads one NaN or inf over a whole plane, and cannot be
chosen per call without a host sync; this times, on the CPU, the route
as it is (``gemm``), with a device-side finiteness flag (``gemm_flag``),
with torch's non-finite pattern restored (``gemm_local``), and torch's
kernel (``torch``) (docs/benchmarks/resize_nonfinite_cpu.md).
"""
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from ..ops.backend.device_path import as_on_cuda
from ..ops.resize import gemm as bilinear_gemm
from .hardware import cpu_model

__all__ = ['CASES', 'VARIANTS', 'local_nonfinite_backward', 'measure',
           'markdown']

#: ``(name, batch, channels, in_hw, out_hw)``: the resizes of a PSPNet
#: step (loss upsample of 1/8 logits, a pyramid branch) and a
#: Segformer-style head (1/32 features to 1/4).
CASES = (
    ('loss 64->256, 19 classes', 2, 19, (64, 64), (256, 256)),
    ('head 16->64, 256 ch', 2, 256, (16, 16), (64, 64)),
    ('pyramid 6->32, 128 ch', 2, 128, (6, 6), (32, 32)),
)


def local_nonfinite_backward(grad: torch.Tensor, in_hw: Sequence[int],
                             align_corners: bool) -> torch.Tensor:
    """The GEMMs' input gradient with non-finite entries where torch puts
    them."""
    finite = torch.isfinite(grad)
    clean = torch.where(finite, grad, 0)
    out = bilinear_gemm.resize_backward(clean, in_hw, align_corners)
    rest = grad - clean  # 0 where finite, the non-finite value elsewhere
    return out.add_(torch.ops.aten.upsample_bilinear2d_backward(
        rest, list(grad.shape[2:]), list(grad.shape[:2]) + list(in_hw),
        align_corners))


def _torch_backward(grad, in_hw, align_corners):
    return torch.ops.aten.upsample_bilinear2d_backward(
        grad, list(grad.shape[2:]), list(grad.shape[:2]) + list(in_hw),
        align_corners)


def _gemm_flag(grad, in_hw, align_corners):
    flag = torch.isfinite(grad).all()
    return bilinear_gemm.resize_backward(grad, in_hw, align_corners), flag


VARIANTS: Dict[str, Callable] = {
    'gemm': lambda g, hw, ac: bilinear_gemm.resize_backward(g, hw, ac),
    'gemm_flag': _gemm_flag,
    'gemm_local': local_nonfinite_backward,
    'torch': _torch_backward,
}


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first call: matrices cached, memory faulted in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(repeats: int = 9, cases: Sequence[Tuple] = CASES
            ) -> List[dict]:
    """One row per case: its shape and each variant's median ms."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    with as_on_cuda():
        for name, n, c, in_hw, out_hw in cases:
            grad = torch.randn((n, c) + tuple(out_hw), generator=gen)
            row = dict(case=name, batch=n, channels=c, in_hw=list(in_hw),
                       out_hw=list(out_hw))
            for variant, fn in VARIANTS.items():
                row[variant] = round(_median_ms(
                    lambda: fn(grad, in_hw, False), repeats), 3)
            rows.append(row)
    return rows


def markdown(rows: List[dict], command: str) -> str:
    """The table, with the CPU, torch's threads and the command."""
    head = ('| case | gemm ms | + isfinite flag | local non-finite '
            '(gemm_local) | torch kernel |\n|---|---|---|---|---|\n')
    body = ''.join(
        f"| {r['case']} (batch {r['batch']}) | {r['gemm']:.2f} | "
        f"{r['gemm_flag']:.2f} | {r['gemm_local']:.2f} | "
        f"{r['torch']:.2f} |\n" for r in rows)
    return (f'CPU: {cpu_model()}, {torch.get_num_threads()} threads, '
            f'torch {torch.__version__}; median ms of one resize '
            f'backward (float32).\n\nCommand: `{command}`\n\n' + head + body)
