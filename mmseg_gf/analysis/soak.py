"""A long run with a new input shape in almost every batch: does memory stay
flat?

A shape-keyed cache that never forgets, or a fragmenting allocator, shows
as resident memory growing over a random-resize finetuning run.
:func:`soak` trains a lean step on many distinct sizes, records ``VmRSS``
and the registered shape caches; flat means the last quarter's mean within
:data:`RSS_TOLERANCE` of the second's (docs/benchmarks/soak_cpu.md).
"""
import copy
import random
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from mmengine.config import Config

from ..accounting.batch import random_batch, training_loss
from ..engine.build import build_segmentor
from ..engine.zoo import REALTIME_FAMILIES, make_offline
from ..ops.backend.shape_caches import over_bound, shape_caches
from .hardware import cpu_model, vm_rss_bytes

__all__ = ['RSS_TOLERANCE', 'SOAK_SETTING', 'random_shapes', 'soak_config',
           'soak', 'soak_table']

#: The largest growth of resident memory from the second quarter of a run
#: to its last that counts as flat.
RSS_TOLERANCE = 0.05
#: The gradient-filter setting the soak trains: the last 5 layers, r = 4,
#: the lean region on (the demo's).
SOAK_SETTING = dict(num_layers=5, radius=4, mode='gf', lean=True)


def random_shapes(count: int, base: Sequence[int] = (64, 64),
                  ratio_range: Tuple[float, float] = (0.75, 2.0),
                  multiple: int = 8, seed: int = 0) -> List[Tuple[int, int]]:
    """``count`` distinct ``(H, W)``, each side the base times a ratio,
    rounded.

    Raises:
        ValueError: the range holds fewer than ``count`` distinct sizes.
    """
    sides = [sorted({max(multiple, int(round(b * r / multiple)) * multiple)
                     for r in _ratios(ratio_range)}) for b in base]
    if len(sides[0]) * len(sides[1]) < count:
        raise ValueError(f'{count} distinct shapes asked, the ratio range '
                         f'{ratio_range} of {tuple(base)} holds '
                         f'{len(sides[0]) * len(sides[1])}')
    rng = random.Random(seed)
    shapes = set()
    while len(shapes) < count:
        shapes.add((rng.choice(sides[0]), rng.choice(sides[1])))
    return sorted(shapes)


def _ratios(ratio_range: Tuple[float, float], steps: int = 256):
    lo, hi = ratio_range
    return [lo + (hi - lo) * i / steps for i in range(steps + 1)]


def _shrink_segformer(model: dict) -> None:
    model['backbone'].update(embed_dims=8, num_layers=[1, 1, 1, 1])
    model['decode_head'].update(in_channels=[8, 16, 40, 64], channels=16)


def soak_config(model: str, config: Optional[str] = None) -> Config:
    """The config a soak trains, with the gradient filter :data:`SOAK_SETTING`.

    Raises:
        ValueError: an unknown model, or ``'pspnet_r18'`` without a file.
    """
    if model == 'segformer_b0':
        cfg = make_offline(Config.fromfile(
            REALTIME_FAMILIES['segformer_b0'].path))
        model_cfg = cfg.model.to_dict()
        _shrink_segformer(model_cfg)
        cfg.model = model_cfg
    elif model == 'pspnet_r18' and config is not None:
        cfg = Config.fromfile(config)
    else:
        raise ValueError(f'soak model must be "segformer_b0" or '
                         f'"pspnet_r18" with its config file, not {model!r}')
    cfg.gradient_filter = dict(SOAK_SETTING)
    return cfg


def _quarter_means(records: List[Tuple[int, int]]) -> List[float]:
    size = len(records) // 4
    return [statistics.mean(r for _, r in records[q * size:(q + 1) * size])
            for q in range(4)]


def soak(cfg: Config, iters: int = 1000, shapes: Sequence = (),
         interval: int = 10, batch: int = 1, seed: int = 0,
         progress: Optional[Callable[[], None]] = None,
         threads: Optional[int] = None) -> Dict:
    """Train ``cfg``'s segmentor ``iters`` steps on sizes drawn from
    ``shapes``.

    Returns:
        dict: the ``rss`` records, ``quarters_mib``, ``growth``, ``flat``,
        ``caches`` and ``over_bound``, and the run's context.

    Raises:
        ValueError: no shapes, or ``iters < 4 * interval``.
        RuntimeError: no ``/proc/self/status`` to read ``VmRSS`` from.
    """
    if iters < 4 * interval or not shapes:
        raise ValueError(f'a soak needs shapes and at least 4 records: '
                         f'iters {iters} >= 4 x interval {interval}')
    if vm_rss_bytes() is None:
        raise RuntimeError('a soak reads VmRSS from /proc/self/status, '
                           'which this system does not have (Linux only)')
    shapes = [tuple(int(v) for v in s) for s in shapes]
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _soak(cfg, iters, shapes, interval, batch, seed, progress)
    finally:
        torch.set_num_threads(previous)


def _soak(cfg, iters, shapes, interval, batch, seed, progress) -> Dict:
    """:func:`soak`'s run, its arguments checked."""
    torch.manual_seed(seed)
    model = build_segmentor(copy.deepcopy(cfg), input_size=shapes[0])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    rng = random.Random(seed)
    records, seen = [], set()
    start = time.perf_counter()
    for step in range(1, iters + 1):
        shape = rng.choice(shapes)
        seen.add(shape)
        inputs, samples = random_batch(model, shape, batch, seed=step,
                                       label_block=8)
        training_loss(model, inputs, samples).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % interval == 0:
            records.append((step, vm_rss_bytes()))
        if progress is not None:
            progress()
    quarters = _quarter_means(records)
    growth = quarters[3] / quarters[1] - 1
    return dict(model=type(model).__name__, iters=iters, shapes=len(seen),
                batch=batch, rss=records,
                quarters_mib=[round(q / 2**20, 2) for q in quarters],
                growth=round(growth, 4), flat=growth <= RSS_TOLERANCE,
                caches=shape_caches(), over_bound=over_bound(),
                seconds=round(time.perf_counter() - start, 1),
                cpu=cpu_model(), threads=torch.get_num_threads())


def soak_table(results: Dict[str, Dict], command: str) -> str:
    """The runs' memory and their shape caches as markdown."""
    lines = [f'CPU: {next(iter(results.values()))["cpu"]}; '
             f'command: `{command}`', '',
             '| model | iterations | distinct shapes | seconds | VmRSS '
             'MiB per quarter | last / second quarter | flat (<= '
             f'{RSS_TOLERANCE:.0%}) |', '|---|---|---|---|---|---|---|']
    for name, r in results.items():
        quarters = ' / '.join(f'{q:.1f}' for q in r['quarters_mib'])
        lines.append(f"| {name} | {r['iters']} | {r['shapes']} | "
                     f"{r['seconds']} | {quarters} | {r['growth']:+.2%} | "
                     f"{'yes' if r['flat'] else 'NO'} |")
    lines += ['', '| shape cache | ' + ' | '.join(results) + ' | bound |',
              '|---|' + '---|' * (len(results) + 1)]
    names = sorted({c for r in results.values() for c in r['caches']})
    for cache in names:
        got = [r['caches'].get(cache) for r in results.values()]
        known = next(g for g in got if g is not None)
        sizes = ' | '.join('-' if g is None else str(g['size']) for g in got)
        lines.append(f"| {cache} | {sizes} | {known['bound']} "
                     f"{known['unit']} |")
    return '\n'.join(lines) + '\n'
