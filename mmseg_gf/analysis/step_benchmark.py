"""Whole training steps of gradient-filter settings next to inference.

For one model, each row (``inference``, ``vanilla_last5``,
``gf_last10_r4:lean``, ...) is built from its config and measured on one
random batch: median forward, backward and step seconds, peak live bytes,
bytes saved for backward and, for lean rows, their analytic count. Timed
runs go round robin over the rows so ratios hold under a changing load;
on CUDA every timed part ends with a synchronisation.
"""
import copy
import re
import statistics
import time
from functools import partial
from typing import (Any, Callable, Dict, Iterator, List, Optional, Sequence,
                    Tuple)

import torch

from ..accounting.batch import random_batch, summed_losses, training_loss
from ..accounting.measured import profiled_peak_bytes, saved_tensor_bytes
from ..accounting.saved_bytes import trace_step_saved_bytes
from ..engine.build import build_segmentor
from ..engine.compile_settings import model_compile_setting
from ..models.segmentor import set_frozen_norms_eval
from .hardware import peak_resident_bytes, resident_bytes

__all__ = ['DEFAULT_ROWS', 'ROW_FORMS', 'COMPILE_MODES', 'COMPILED',
           'parse_row', 'split_compiled', 'row_settings', 'compiled_loss',
           'set_row_settings', 'row_config', 'benchmark_model',
           'same_layers_vanilla', 'lean_against_vanilla']

#: Rows measured by default: every target of the lean region has its pair.
DEFAULT_ROWS = ('inference', 'vanilla_last5:plain', 'gf_last5_r4:plain',
                'gf_last5_r4:lean', 'vanilla_last10:plain',
                'gf_last10_r4:plain', 'gf_last10_r4:lean')
#: ``torch.compile`` modes a benchmark's training rows may take.
COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune')
#: A training row's suffix: its ``model.loss`` compiled
#: (:func:`compiled_loss`), timed next to the row without it.
COMPILED = '+compiled'
#: What a row may be (the error message of :func:`row_settings`).
ROW_FORMS = ("'inference', 'vanilla_all', 'vanilla_last<N>', "
             "'gf_last<N>_r<R>' or 'gf_last<N>_auto', the last two "
             "optionally suffixed ':lean' (the default) or ':plain'; "
             f"a training row optionally followed by {COMPILED!r}")
_LAST_N = re.compile(r'(?P<mode>gf|vanilla)_last(?P<n>\d+)'
                     r'(?:_r(?P<r>\d+)|_(?P<auto>auto))?')


def split_compiled(row: str) -> Tuple[str, bool]:
    """``'gf_last5_r4:lean+compiled'`` -> ``('gf_last5_r4:lean', True)``."""
    if row.endswith(COMPILED):
        return row[:-len(COMPILED)], True
    return row, False


def parse_row(row: str):
    """``'gf_last5_r4:lean'`` -> ``('gf_last5_r4', True)``; no suffix means
    lean."""
    row, compiled = split_compiled(row)
    if row == 'inference':
        if compiled:
            raise ValueError(f'row {row + COMPILED!r}: inference stays '
                             'eager; only training rows are compiled')
        return row, None
    strategy, _, variant = row.partition(':')
    if variant not in ('', 'lean', 'plain'):
        raise ValueError(f'row {row!r}: the suffix must be :lean or :plain')
    return strategy, variant != 'plain'


def row_settings(row: str) -> Optional[Dict[str, Any]]:
    """The ``gradient_filter`` setting a row names (None for plain rows).

    Raises:
        ValueError: a row of none of the :data:`ROW_FORMS`.
    """
    strategy, lean = parse_row(row)
    if strategy in ('inference', 'vanilla_all'):
        return None
    match = _LAST_N.fullmatch(strategy)
    if match is None or int(match['n']) < 1 or int(match['r'] or 1) < 1 or \
            (match['mode'] == 'gf') == (match['r'] is None
                                        and match['auto'] is None):
        raise ValueError(f'row {row!r}: a row is one of {ROW_FORMS} '
                         '(N, R >= 1; a radius for gf only)')
    settings = dict(num_layers=int(match['n']), mode=match['mode'],
                    lean=bool(lean))
    if match['auto']:
        settings['radius'] = 'auto'
    elif match['r']:
        settings['radius'] = int(match['r'])
    return settings


def set_row_settings(cfg, row: str):
    """Replace ``cfg``'s ``gradient_filter`` by the row's, in place."""
    settings = row_settings(row)
    cfg.pop('gradient_filter', None)
    if settings is not None:
        cfg.gradient_filter = settings
    return cfg


def row_config(cfg, row: str, crop: Sequence[int]):
    """A copy of ``cfg`` measuring ``row`` at ``crop``, inference on the whole
    image."""
    cfg = set_row_settings(copy.deepcopy(cfg), row)
    crop = tuple(int(v) for v in crop)
    cfg.crop_size = crop
    model = cfg.model
    if model.get('data_preprocessor') is not None:
        model.data_preprocessor['size'] = crop
    test_cfg = dict(model.get('test_cfg') or {})
    for key in ('crop_size', 'stride'):
        test_cfg.pop(key, None)
    test_cfg['mode'] = 'whole'
    model.test_cfg = test_cfg
    return cfg


def _clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` after the device's queued work has finished."""
    if device.type != 'cuda':
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def _predict_fn(model, inputs, samples, clock):
    model.eval()

    def predict():
        with torch.no_grad():
            model.predict(inputs, samples)
        return {}

    return predict


def compiled_loss(model, mode: str) -> Callable:
    """``training_loss`` with ``model.loss`` compiled as GradFilterHook
    would."""
    model.train()
    set_frozen_norms_eval(model)
    setting = model_compile_setting(dict(mode=mode), model)
    loss = torch.compile(model.loss, **setting)

    return lambda inputs, samples: summed_losses(loss(inputs, samples))


def _step_fn(model, inputs, samples, clock, compile_mode=None):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=5e-4)
    loss_fn = (partial(training_loss, model) if compile_mode is None else
               compiled_loss(model, compile_mode))

    # mmengine's OptimWrapper order: backward, update, then release the
    # gradients (``set_to_none``), so that a step starts without them and
    # its measured peak holds every gradient it allocates.
    def step():
        t0 = clock()
        loss = loss_fn(inputs, samples)
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {'forward': t1 - t0, 'backward': t2 - t1}

    return step


def _timed(row: '_Row') -> Dict[str, float]:
    t0 = row.clock()
    parts = row.run()
    total = row.clock() - t0
    if not parts:  # inference: everything is forward
        return {'forward': total, 'backward': 0.0, 'step': total}
    return dict(parts, step=total)


def benchmark_model(model_name: str,
                    rows: Sequence[Tuple[str, Any]],
                    crop: Sequence[int] = (512, 512),
                    batch: int = 8,
                    repeats: int = 2,
                    warmup: int = 1,
                    memory: bool = True,
                    progress: Optional[Callable[[str], None]] = None,
                    label: Optional[str] = None,
                    device='cpu',
                    compile_mode: Optional[str] = None) -> Dict:
    """Measure ``rows`` of one model (see the module docstring).

    Args:
        model_name: the model's name in the result.
        rows: ``(row name, config)`` pairs.
        crop, batch: the batch's image size and images per step.
        repeats, warmup: timed and untimed runs per row; ``repeats=0``
            measures memory only.
        memory: measure peak and saved bytes.
        progress: called with a short message before each phase.
        label: the model's display name.
        device: ``'cpu'`` or ``'cuda'``.
        compile_mode: ``torch.compile`` mode of the training rows (warm-up
            must be at least 2 for ``'reduce-overhead'``).

    Returns:
        dict: the run's context (crop, batch, threads, torch, device, gpu,
        resident bytes) and ``rows``, one dict per row with its ratios.
    """
    crop = tuple(int(v) for v in crop)
    device = torch.device(device)
    say = progress or (lambda message: None)
    modes = row_compile_modes([name for name, _ in rows], compile_mode)
    built = []
    for (name, cfg), mode in zip(rows, modes):
        say(f'build {name}')
        built.append(_Row(name, cfg, crop, batch, device, mode))
    times = _time_round_robin(built, repeats, warmup, say)
    # what the process holds after the timed steps (all rows' models and
    # whatever malloc kept: engine.cpu_memory), and the most it held, before
    # the memory runs
    resident = resident_bytes() if repeats else None
    peak_resident = peak_resident_bytes() if repeats else None
    measured = _measure_rows(built, times, crop, batch, memory, say)
    label = label or model_name
    if compile_mode is not None and all(
            mode is not None for mode, row in zip(modes, built)
            if row.lean is not None):  # every training row compiled
        label = f'{label}, compiled ({compile_mode})'
    return dict(model=model_name, label=label,
                crop=list(crop), batch=int(batch),
                threads=torch.get_num_threads(), torch=torch.__version__,
                device=device.type, compile=compile_mode,
                gpu=(torch.cuda.get_device_name(device)
                     if device.type == 'cuda' else None),
                resident_bytes=resident, peak_resident_bytes=peak_resident,
                rows=measured)


def _measure_rows(built, times, crop, batch, memory: bool,
                  say: Callable[[str], None]) -> List[Dict]:
    """One result per row: median times, memory if asked, then ratios."""
    measured = []
    for row, row_times in zip(built, times):
        result = {key: statistics.median(v) for key, v in row_times.items()}
        result.update(row=row.name, strategy=row.strategy, lean=row.lean,
                      compiled=row.compile_mode, peak_bytes=None,
                      saved_bytes=None)
        if memory:
            say(f'memory {row.name}')
            result.update(row.memory(crop, batch))
        measured.append(result)
    _add_ratios(measured)
    return measured


class _Row:
    """One row's segmentor, batch and the function that runs it."""

    def __init__(self, name: str, cfg, crop, batch: int,
                 device: torch.device = torch.device('cpu'),
                 compile_mode: Optional[str] = None) -> None:
        self.name = name
        self.device = device
        self.compile_mode = compile_mode
        self.strategy, self.lean = parse_row(name)
        torch.manual_seed(0)
        self.model = build_segmentor(cfg).to(device)
        self.inputs, self.samples = random_batch(self.model, crop, batch,
                                                 device=device,
                                                 label_block=16)
        self.clock = _clock(device)
        if self.lean is None:
            self.run = _predict_fn(self.model, self.inputs, self.samples,
                                   self.clock)
        else:
            self.run = _step_fn(self.model, self.inputs, self.samples,
                                self.clock, compile_mode)

    def memory(self, crop, batch: int) -> Dict[str, Any]:
        """Peak and saved bytes, and the analytic count for a lean row."""
        # One step first: a first call allocates one-time caches (oneDNN's
        # reordered weights, ~20 MiB on STDC1 at 512x512) that later steps
        # reuse; they are not the step's memory.
        self.run()
        out: Dict[str, Any] = dict(
            peak_bytes=profiled_peak_bytes(self.run, self.device))
        if self.lean is None:
            out.update(saved_bytes=0, trainable_params=0)
            return out
        out['saved_bytes'] = saved_tensor_bytes(
            lambda: training_loss(self.model, self.inputs, self.samples))
        out['trainable_params'] = sum(
            p.numel() for p in self.model.parameters() if p.requires_grad)
        if self.lean:
            counted = trace_step_saved_bytes(self.model, crop)
            out['analytic_saved_bytes'] = counted.total(batch)
            out['analytic_by_category'] = counted.by_category(batch)
            out['unmodelled'] = counted.unmodelled
        return out


def row_compile_modes(rows: Sequence[str],
                      compile_mode: Optional[str]) -> List[Optional[str]]:
    """Each row's ``torch.compile`` mode (None: eager)."""
    suffixed = [split_compiled(r)[1] for r in rows]
    if not any(suffixed):
        return [None if parse_row(r)[1] is None else compile_mode
                for r in rows]
    return [(compile_mode or 'default') if s else None for s in suffixed]


def _time_round_robin(built: Sequence[_Row], repeats: int, warmup: int,
                      say) -> List[Dict[str, List[float]]]:
    """Per row, the timed parts of each round."""
    times: List[Dict[str, List[float]]] = [{} for _ in built]
    for i in range(warmup + repeats):
        say(f'{"warm-up" if i < warmup else "timed"} round {i + 1}')
        for k, row in enumerate(built):
            parts = _timed(row)
            if i >= warmup:
                for key, v in parts.items():
                    times[k].setdefault(key, []).append(v)
    return times


def same_layers_vanilla(strategy: str) -> str:
    """``gf_last5_r4`` -> ``vanilla_last5`` (the strategy's layers, exact)."""
    if not strategy.startswith('gf_'):
        return strategy
    return 'vanilla_' + strategy[len('gf_'):].rsplit('_r', 1)[0]


def lean_against_vanilla(rows: Sequence[Dict]) -> Iterator[Tuple[Dict, Dict]]:
    """``(lean row, plain row of the same layers)`` pairs of ``rows``."""
    plain = {r['strategy']: r for r in rows if not r['lean']}
    for r in rows:
        ref = plain.get(same_layers_vanilla(r['strategy']))
        if r['lean'] and ref is not None:
            yield r, ref


def _add_ratios(rows: List[Dict]) -> None:
    inference = next((r for r in rows if r['lean'] is None), None)
    plain = {(r['strategy'], r.get('compiled')): r for r in rows
             if r['lean'] is False}
    eager = {r['row']: r for r in rows if not r.get('compiled')}
    for r in rows:
        timed = 'step' in r
        if inference is not None:
            if r['peak_bytes'] is not None:
                r['peak_vs_inference'] = (r['peak_bytes'] /
                                          inference['peak_bytes'])
            if timed:
                r['step_vs_inference'] = r['step'] / inference['forward']
        compiled = r.get('compiled')
        ref = plain.get((same_layers_vanilla(r['strategy']), compiled))
        if ref is not None and r['lean'] is not None and ref['saved_bytes']:
            r['saved_vs_vanilla_plain'] = r['saved_bytes'] / \
                ref['saved_bytes']
        twin = plain.get((r['strategy'], compiled))
        if timed and r['lean'] and twin is not None:
            r['step_vs_plain'] = r['step'] / twin['step']
        twin = eager.get(split_compiled(r['row'])[0])
        if timed and compiled and twin is not None and 'step' in twin:
            r['step_vs_eager'] = r['step'] / twin['step']
