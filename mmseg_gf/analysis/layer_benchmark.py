"""Per-layer timing of the gradient-filtered backward against torch's own:
the paper's 3x3 convs and transformer Linears on token grids.

Vanilla and filtered runs of the same layer are measured side by side in one
process, interleaved repetition by repetition, so that their ratios are
robust to whatever else the machine is doing. Pure torch: no mmseg import.
"""

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..accounting.format import format_table
from ..accounting.measured import saved_tensor_bytes
from ..ops import (TokenGrid, gradient_filtered_conv2d,
                   gradient_filtered_linear)

#: The convs the benchmark times: the paper's Table 10 layers, as
#: (Cin, Cout, H, W), each 3x3, stride 1, padding 1.
BENCHMARK_CONV_SHAPES: Tuple[Tuple[int, int, int, int], ...] = (
    (128, 128, 120, 160), (256, 256, 60, 80), (512, 512, 30, 40),
    (512, 512, 14, 14), (256, 256, 14, 14), (128, 128, 28, 28),
    (64, 64, 56, 56))


@dataclass
class LayerTiming:
    """Median seconds and saved bytes for one layer, radius and case."""

    layer: str
    radius: int
    case: str  # 'with_gx' (input needs a gradient) or 'weight_only'
    device: str
    dtype: str
    vanilla_forward: float
    gf_forward: float
    vanilla_backward: float
    gf_backward: float
    grad_clone: float  # memory floor: one copy of g_y
    io_floor: float  # one read of g_y (+ one write of a g_x with_gx)
    vanilla_saved_bytes: int
    gf_saved_bytes: int
    kind: str = 'conv'  # 'conv' or 'linear'

    @property
    def backward_speedup(self) -> float:
        return self.vanilla_backward / self.gf_backward

    @property
    def step_speedup(self) -> float:
        return ((self.vanilla_forward + self.vanilla_backward) /
                (self.gf_forward + self.gf_backward))

    @property
    def forward_overhead(self) -> float:
        return self.gf_forward / self.vanilla_forward

    @property
    def backward_over_floor(self) -> float:
        return self.gf_backward / self.grad_clone

    @property
    def backward_over_io_floor(self) -> float:
        return self.gf_backward / self.io_floor

    def as_dict(self) -> Dict:
        row = asdict(self)
        row.update(backward_speedup=self.backward_speedup,
                   step_speedup=self.step_speedup,
                   forward_overhead=self.forward_overhead,
                   backward_over_floor=self.backward_over_floor,
                   backward_over_io_floor=self.backward_over_io_floor,
                   saved_ratio=self.gf_saved_bytes / self.vanilla_saved_bytes)
        return row


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


#: Clocks a benchmark can read: ``'wall'`` (elapsed time) or ``'thread'``
#: (CPU time of the calling thread: on a shared machine it leaves out the
#: time other processes hold the core; meaningful for one CPU thread only).
CLOCKS: Dict[str, Callable[[], float]] = {
    'wall': time.perf_counter,
    'thread': time.thread_time,
}


def _timed(fn: Callable[[], object], device: torch.device,
           clock: str = 'wall') -> float:
    now = CLOCKS[clock]
    _sync(device)
    start = now()
    fn()
    _sync(device)
    return now() - start


def _io_floor(grad_out: torch.Tensor, grad_in: torch.Tensor,
              with_gx: bool) -> Callable[[], object]:
    """The least memory traffic a filtered backward needs: read ``g_y``, write
    ``g_x``."""
    if not with_gx:
        return grad_out.sum
    if grad_in.shape == grad_out.shape:
        return lambda: grad_in.copy_(grad_out)
    return lambda: (grad_out.sum(), grad_in.zero_())


def _measure(layer: str, radius: int, case: str, vanilla, filtered,
             inputs, grad_out: torch.Tensor, io_floor, dev: torch.device,
             dtype: torch.dtype, repeats: int, warmup: int,
             clock: str = 'wall', kind: str = 'conv') -> LayerTiming:
    """Median times of one layer, radius and case, vanilla and filtered
    interleaved."""
    if clock not in CLOCKS:
        raise ValueError(f'clock must be one of {sorted(CLOCKS)}, got '
                         f'{clock!r}')
    y_v, y_g = vanilla(), filtered()
    samples = {k: [] for k in ('vf', 'gf', 'vb', 'gb', 'clone', 'io')}
    for rep in range(warmup + repeats):
        measured = {
            'vf': _timed(vanilla, dev, clock),
            'gf': _timed(filtered, dev, clock),
            'vb': _timed(lambda: torch.autograd.grad(
                y_v, inputs, grad_out, retain_graph=True), dev, clock),
            'gb': _timed(lambda: torch.autograd.grad(
                y_g, inputs, grad_out, retain_graph=True), dev, clock),
            'clone': _timed(grad_out.clone, dev, clock),
            'io': _timed(io_floor, dev, clock),
        }
        if rep >= warmup:
            for key, value in measured.items():
                samples[key].append(value)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return LayerTiming(layer=layer, radius=radius, case=case,
                       device=str(dev), dtype=str(dtype).split('.')[-1],
                       vanilla_forward=med['vf'], gf_forward=med['gf'],
                       vanilla_backward=med['vb'], gf_backward=med['gb'],
                       grad_clone=med['clone'], io_floor=med['io'],
                       vanilla_saved_bytes=saved_tensor_bytes(vanilla),
                       gf_saved_bytes=saved_tensor_bytes(filtered),
                       kind=kind)


def time_layer(cin: int, cout: int, height: int, width: int,
               radii: Sequence[int] = (2, 4), batch: int = 8,
               repeats: int = 7, warmup: int = 2,
               device: str = 'cpu',
               dtype: torch.dtype = torch.float32,
               clock: str = 'wall') -> List[LayerTiming]:
    """Time one 3x3 stride-1 layer, vanilla vs GF, for each radius and case.

    Backward times are of the backward alone (the graph replayed with
    ``retain_graph``); two memory floors are timed in the same loop.
    """
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    x_data = torch.randn(batch, cin, height, width, generator=gen,
                         device=dev, dtype=dtype)
    weight = torch.nn.Parameter(
        torch.randn(cout, cin, 3, 3, generator=gen, device=dev,
                    dtype=dtype) * (2.0 / (9 * cin))**0.5)
    grad_out = torch.randn(batch, cout, height, width, generator=gen,
                           device=dev, dtype=dtype)
    grad_in = torch.empty_like(x_data)
    layer = f'{cin}x{cout}@{height}x{width}'
    results = []
    for case in ('with_gx', 'weight_only'):
        x = x_data.clone().requires_grad_(case == 'with_gx')
        io_floor = _io_floor(grad_out, grad_in, case == 'with_gx')
        inputs = (x, weight) if case == 'with_gx' else (weight, )

        def vanilla():
            return F.conv2d(x, weight, None, 1, 1)

        for radius in radii:

            def filtered(radius=radius):
                return gradient_filtered_conv2d(x, weight, None, 1, 1, 1, 1,
                                                radius)

            results.append(
                _measure(layer, radius, case, vanilla, filtered, inputs,
                         grad_out, io_floor, dev, dtype, repeats, warmup,
                         clock))
    return results


@dataclass(frozen=True)
class LinearShape:
    """One transformer Linear on a token grid (``window``: Swin's window side,
    or 0)."""

    label: str
    height: int
    width: int
    cin: int
    cout: int
    window: int = 0


#: The Linears the benchmark times, at a 512x512 crop: Segformer-B2's
#: first stage (128x128 tokens, C = 64; its key/value on the 16x16 grid of
#: the ``sr`` conv, ratio 8) and an MLP of ratio 4 at that width (Twins'
#: and ViT's FFNs are Linears); Swin-T's first stage (C = 96, 7x7 windows).
BENCHMARK_LINEAR_SHAPES: Tuple[LinearShape, ...] = (
    LinearShape('segformer-b2 s1 q/out', 128, 128, 64, 64),
    LinearShape('segformer-b2 s1 kv (sr 8)', 16, 16, 64, 128),
    LinearShape('mlp 4x fc1 (C=64)', 128, 128, 64, 256),
    LinearShape('mlp 4x fc2 (C=64)', 128, 128, 256, 64),
    LinearShape('swin-t s1 qkv (7x7 windows)', 128, 128, 96, 288, 7),
    LinearShape('swin-t s1 proj (7x7 windows)', 128, 128, 96, 96, 7),
    LinearShape('swin-t s1 fc1', 128, 128, 96, 384),
    LinearShape('swin-t s1 fc2', 128, 128, 384, 96),
)


def linear_tokens(shape: LinearShape, batch: int) -> Tuple[Tuple[int, ...],
                                                           TokenGrid]:
    """The input shape ``(B', N, cin)`` and token grid of a Linear."""
    if shape.window:
        ws = shape.window
        windows = -(-shape.height // ws) * -(-shape.width // ws)
        return (batch * windows, ws * ws, shape.cin), TokenGrid.windows(ws)
    return (batch, shape.height * shape.width,
            shape.cin), TokenGrid(shape.height, shape.width)


def time_linear_layer(shape: LinearShape,
                      radii: Sequence[int] = (2, 4),
                      batch: int = 8,
                      repeats: int = 7,
                      warmup: int = 2,
                      device: str = 'cpu',
                      dtype: torch.dtype = torch.float32,
                      cases: Sequence[str] = ('with_gx', 'weight_only'),
                      clock: str = 'wall') -> List[LayerTiming]:
    """Time one Linear on a token grid, ``F.linear`` vs
    :func:`gradient_filtered_linear`."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    in_shape, grid = linear_tokens(shape, batch)
    x_data = torch.randn(in_shape, generator=gen, device=dev, dtype=dtype)
    weight = torch.nn.Parameter(
        torch.randn(shape.cout, shape.cin, generator=gen, device=dev,
                    dtype=dtype) * shape.cin**-0.5)
    bias = torch.nn.Parameter(torch.zeros(shape.cout, device=dev,
                                          dtype=dtype))
    grad_out = torch.randn(*in_shape[:-1], shape.cout, generator=gen,
                           device=dev, dtype=dtype)
    grad_in = torch.empty_like(x_data)
    layer = f'linear {shape.label} {shape.cin}x{shape.cout}'
    results = []
    for case in cases:
        x = x_data.clone().requires_grad_(case == 'with_gx')
        io_floor = _io_floor(grad_out, grad_in, case == 'with_gx')
        inputs = ((x, weight, bias) if case == 'with_gx' else
                  (weight, bias))

        def vanilla():
            return F.linear(x, weight, bias)

        for radius in radii:

            def filtered(radius=radius):
                return gradient_filtered_linear(x, weight, bias, grid,
                                                radius)

            results.append(
                _measure(layer, radius, case, vanilla, filtered, inputs,
                         grad_out, io_floor, dev, dtype, repeats, warmup,
                         clock, 'linear'))
    return results


def summarize(rows: Sequence[LayerTiming]) -> Dict[str, Dict[str, float]]:
    """Medians over layers per (kind, case, radius), plus the worst layer."""
    summary = {}
    for kind, case, radius in sorted({(r.kind, r.case, r.radius)
                                      for r in rows}):
        sel = [r for r in rows
               if (r.kind, r.case, r.radius) == (kind, case, radius)]
        prefix = '' if kind == 'conv' else f'{kind}/'
        summary[f'{prefix}{case}/r={radius}'] = dict(
            median_backward_speedup=statistics.median(
                r.backward_speedup for r in sel),
            min_backward_speedup=min(r.backward_speedup for r in sel),
            median_step_speedup=statistics.median(
                r.step_speedup for r in sel),
            max_forward_overhead=max(r.forward_overhead for r in sel),
            median_forward_overhead=statistics.median(
                r.forward_overhead for r in sel),
            max_saved_ratio=max(r.gf_saved_bytes / r.vanilla_saved_bytes
                                for r in sel),
        )
    return summary


def timing_table(rows: Sequence[LayerTiming]) -> str:
    """The per-layer table of the README (markdown)."""
    return format_table(
        ('layer (Cin x Cout @ H x W)', 'case', 'r', 'bwd speedup',
         'fwd+bwd speedup', 'fwd overhead', 'GF bwd / clone(g_y)',
         'GF bwd / IO floor', 'saved bytes GF/vanilla'),
        [(r.layer, r.case, r.radius, f'{r.backward_speedup:.1f}x',
          f'{r.step_speedup:.2f}x', f'{r.forward_overhead:.2f}',
          f'{r.backward_over_floor:.2f}', f'{r.backward_over_io_floor:.2f}',
          f'{r.gf_saved_bytes / r.vanilla_saved_bytes:.4f}') for r in rows])


def plot(rows: Sequence[LayerTiming], path: str) -> None:
    """Backward speedup per layer, log scale: the benchmark's
    ``layers.png``."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4))
    keys = sorted({(r.device, r.case, r.radius) for r in rows})
    layers = list(dict.fromkeys(r.layer for r in rows))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        sel = {r.layer: r.backward_speedup for r in rows
               if (r.device, r.case, r.radius) == key}
        ax.bar([j + i * width for j in range(len(layers))],
               [sel.get(layer, 0) for layer in layers], width,
               label=f'{key[0]} {key[1]} r={key[2]}')
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))])
    ax.set_xticklabels(layers, rotation=20, fontsize=7)
    ax.set_yscale('log')
    ax.set_ylabel('backward speedup vs torch (x)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
