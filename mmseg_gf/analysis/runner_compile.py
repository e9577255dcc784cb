"""mmengine's ``compile`` setting in a real Runner run, against eager mode.

Per iteration: the step time and Dynamo's graph count, so the report
says where it compiled against the input shapes, and the steady-state
step time compiled / eager (docs/benchmarks/runner_compile_cpu.md).
"""
import copy
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner

from ..engine import rewrite_config
from .hardware import cpu_model

__all__ = ['small_crop', 'run_once', 'compare', 'format_report']


def small_crop(cfg: Config, crop: Sequence[int]) -> Config:
    """The pipeline's crop and resize scales and the preprocessor's size at
    ``crop``."""
    h, w = crop
    pipeline = cfg.train_dataloader.dataset.get('pipeline')
    for t in pipeline or []:
        if t['type'] == 'RandomCrop':
            t['crop_size'] = (h, w)
        elif t['type'] in ('RandomResize', 'Resize'):
            t['scale'] = (w, h)
    cfg.crop_size = (h, w)
    if cfg.model.get('data_preprocessor') is not None:
        cfg.model.data_preprocessor['size'] = (h, w)
    return cfg


class _Record(Hook):
    """Per training iteration: its input shape and Dynamo's graph count."""
    priority = 'LOWEST'

    def __init__(self) -> None:
        self.shapes: List[tuple] = []
        self.graphs: List[int] = []

    def before_train(self, runner) -> None:
        runner.model.data_preprocessor.register_forward_hook(
            lambda m, args, out: self.shapes.append(
                tuple(out['inputs'].shape)))

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None) -> None:
        self.graphs.append(
            torch._dynamo.utils.counters['stats']['unique_graphs'])


def run_once(cfg: Config, iters: int, work_dir: str,
             compile_setting: Any = None) -> Dict[str, Any]:
    """Train ``cfg`` ``iters`` iterations; per iteration step seconds, input
    shape, graph count."""
    cfg = copy.deepcopy(cfg)
    cfg.work_dir = work_dir
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters,
                         val_interval=10**9)
    cfg.val_dataloader = cfg.val_evaluator = cfg.val_cfg = None
    cfg.test_dataloader = cfg.test_evaluator = cfg.test_cfg = None
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook',
                                        interval=10**9)
    cfg.default_hooks.logger = dict(type='LoggerHook', interval=10)
    cfg.compile = compile_setting
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runner = Runner.from_cfg(rewrite_config(cfg))
    record = _Record()
    runner.register_hook(record)
    t0 = time.perf_counter()
    runner.train()
    wall = time.perf_counter() - t0
    hub = runner.message_hub
    times = [float(t) - float(d) for t, d in zip(
        hub.get_scalar('train/time').data[0],
        hub.get_scalar('train/data_time').data[0])]
    return dict(step_s=times[-iters:], shapes=record.shapes,
                graphs=record.graphs, wall_s=wall)


def compare(cfg: Config, iters: int, work_dir: str,
            compile_setting: Any = True) -> Dict[str, Any]:
    """:func:`run_once` eager, then compiled with ``compile_setting``."""
    eager = run_once(cfg, iters, f'{work_dir}/eager')
    compiled = run_once(cfg, iters, f'{work_dir}/compiled', compile_setting)
    return dict(eager=eager, compiled=compiled, iters=iters,
                compile=compile_setting, cpu=cpu_model(),
                threads=torch.get_num_threads(), torch=torch.__version__)


def _steady(times: Sequence[float]) -> float:
    return statistics.median(times[len(times) // 2:])


def _compiled_at(graphs: Sequence[int]) -> List[int]:
    """The iterations (1-based) after which Dynamo had more graphs."""
    return [i + 1 for i, (a, b) in enumerate(zip([0] + list(graphs),
                                                  graphs)) if b > a]


def format_report(result: Dict[str, Any],
                  label: Optional[str] = None) -> str:
    """A markdown section of :func:`compare`'s result."""
    e, c = result['eager'], result['compiled']
    shapes = c['shapes']
    first = {}
    for i, s in enumerate(shapes):
        first.setdefault(s, i + 1)
    lines = [
        f'### {label or "run"}', '',
        f'{result["iters"]} iterations, compile={result["compile"]!r}, '
        f'{result["cpu"]}, {result["threads"]} threads, torch '
        f'{result["torch"]}.', '',
        '| | eager | compiled |', '|---|---:|---:|',
        f'| first step s | {e["step_s"][0]:.3f} | {c["step_s"][0]:.3f} |',
        f'| steady step s (median, last half) | {_steady(e["step_s"]):.3f} '
        f'| {_steady(c["step_s"]):.3f} |',
        f'| run wall s | {e["wall_s"]:.1f} | {c["wall_s"]:.1f} |', '',
        f'Compiled / eager steady step: '
        f'{_steady(c["step_s"]) / _steady(e["step_s"]):.3f}. '
        f'Input shapes (first iteration): '
        + ', '.join(f'{s} ({i})' for s, i in first.items()) + '. '
        f'Graphs compiled: {c["graphs"][-1] if c["graphs"] else 0}, after '
        f'iterations {_compiled_at(c["graphs"])}.']
    return '\n'.join(lines)
