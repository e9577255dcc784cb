"""Training and evaluation runs: the one code path behind ``tools/train.py``,
``tools/test.py``, the demo and the protocol, so that no caller misses a
step mmseg's own tools take or one the plugin adds.
"""
import json
import logging
import multiprocessing
import os
import os.path as osp
from typing import Any, Callable, Dict, Optional

from mmengine.config import Config
from mmengine.logging import print_log
from mmengine.runner import Runner

from .checkpoint import check_checkpoint_matches
from .config_log import ConfigByNameRunner
from .config import rewrite_config
from .cpu_amp import enable_amp
from .cpu_distributed import init_cpu_process_group, prepare_cpu_distributed
from .checkpoint.resume import find_resumable_checkpoint
from .checkpoint.safe_load import explain_refused_checkpoints

__all__ = [
    'load_config', 'resolve_resume', 'build_train_config', 'build_runner',
    'train', 'build_test_config', 'run_test', 'evaluate', 'format_metrics',
    'run_in_subprocess', 'METRICS_FILE'
]

#: Where :func:`run_test` writes the metrics, in the run's work dir.
METRICS_FILE = 'metrics.json'


def load_config(config: str,
                work_dir: Optional[str] = None,
                cfg_options: Optional[Dict[str, Any]] = None,
                launcher: str = 'none',
                format_python_code: bool = True) -> Config:
    """The config file with the launcher, ``cfg_options`` and work dir.

    ``format_python_code=False`` skips yapf when the config is dumped
    (docs/benchmarks/design_measurements.md).
    """
    cfg = Config.fromfile(config, format_python_code=format_python_code)
    cfg.launcher = launcher
    if cfg_options is not None:
        cfg.merge_from_dict(cfg_options)
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(config))[0])
    return cfg


def resolve_resume(cfg: Config, resume: bool) -> Config:
    """``resume``: continue from the newest checkpoint in ``work_dir`` that
    loads.

    Unlike mmengine, a finetuning config's ``load_from`` is not resumed from;
    without a checkpoint the run starts from it as a fresh run would
    (docs/reliability.md#resume).

    Raises:
        NoResumableCheckpoint: the work dir has checkpoints and none loads.
    """
    cfg.resume = False
    if not resume:
        return cfg
    latest = find_resumable_checkpoint(cfg.work_dir)
    if latest is not None:
        cfg.load_from = latest
        cfg.resume = True
    else:
        print_log(
            f'--resume: no checkpoint in {cfg.work_dir} yet; starting from '
            f'load_from={cfg.get("load_from")!r}', logger='current',
            level=logging.WARNING)
    return cfg


def build_train_config(config: str,
                       work_dir: Optional[str] = None,
                       cfg_options: Optional[Dict[str, Any]] = None,
                       resume: bool = False,
                       amp: bool = False,
                       launcher: str = 'none',
                       format_python_code: bool = True) -> Config:
    """A training config as ``tools/train.py`` runs it, rewrite included."""
    cfg = load_config(config, work_dir, cfg_options, launcher,
                      format_python_code)
    if amp:
        enable_amp(cfg)
    resolve_resume(cfg, resume)
    prepare_cpu_distributed(cfg)
    return rewrite_config(cfg)


def build_runner(cfg: Config, log_config: bool = True) -> Runner:
    """The config's Runner; ``log_config=False`` logs the config's name
    only."""
    if 'runner_type' in cfg:
        from mmseg.registry import RUNNERS
        return RUNNERS.build(cfg)
    return (Runner if log_config else ConfigByNameRunner).from_cfg(cfg)


def train(config: str, **kwargs) -> Runner:
    """Train as ``tools/train.py`` does; returns the Runner afterwards.

    Args:
        config: config file path.
        **kwargs: :func:`build_train_config`'s ``work_dir``,
            ``cfg_options``, ``resume``, ``amp``, ``launcher``,
            ``format_python_code``.
    """
    cfg = build_train_config(config, **kwargs)
    # mmengine's init_dist('pytorch') needs CUDA; create the gloo group
    # first on a CPU-only machine (the Runner then reuses it).
    init_cpu_process_group(cfg)
    runner = build_runner(cfg)
    with explain_refused_checkpoints():
        runner.train()
    return runner


def _trigger_visualization_hook(cfg: Config, show: bool,
                                show_dir: Optional[str],
                                wait_time: float) -> Config:
    default_hooks = cfg.default_hooks
    if 'visualization' not in default_hooks:
        raise RuntimeError(
            'VisualizationHook must be included in default_hooks, e.g. '
            '"visualization=dict(type=\'SegVisualizationHook\')"')
    hook = default_hooks['visualization']
    hook['draw'] = True
    if show:
        hook['show'] = True
        hook['wait_time'] = wait_time
    if show_dir:
        cfg.visualizer['save_dir'] = show_dir
    return cfg


def build_test_config(config: str,
                      checkpoint: str,
                      work_dir: Optional[str] = None,
                      cfg_options: Optional[Dict[str, Any]] = None,
                      launcher: str = 'none',
                      out: Optional[str] = None,
                      show: bool = False,
                      show_dir: Optional[str] = None,
                      wait_time: float = 2,
                      tta: bool = False) -> Config:
    """A test config as ``tools/test.py`` runs it (``out``, ``show``,
    ``tta``)."""
    cfg = load_config(config, work_dir, cfg_options, launcher)
    cfg.load_from = checkpoint
    cfg.resume = False
    if show or show_dir:
        cfg = _trigger_visualization_hook(cfg, show, show_dir, wait_time)
    if tta:
        cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
        cfg.tta_model.module = cfg.model
        cfg.model = cfg.tta_model
    if out is not None:
        cfg.test_evaluator['output_dir'] = out
        cfg.test_evaluator['keep_results'] = True
    return prepare_cpu_distributed(cfg)


def run_test(cfg: Config, log_config: bool = True) -> Dict[str, float]:
    """Build a Runner from ``cfg`` and return its test metrics.

    The metrics are also written to ``<work_dir>/metrics.json``.

    Raises:
        ValueError: the checkpoint does not match the model exactly.
    """
    init_cpu_process_group(cfg)
    runner = (Runner if log_config else ConfigByNameRunner).from_cfg(cfg)
    model = getattr(runner.model, 'module', runner.model)
    check_checkpoint_matches(model, cfg.load_from, setting='checkpoint',
                             allowed=None)
    with explain_refused_checkpoints():
        metrics = runner.test()
    metrics = {k: float(v) for k, v in metrics.items()}
    if runner.rank == 0:
        os.makedirs(cfg.work_dir, exist_ok=True)
        with open(osp.join(cfg.work_dir, METRICS_FILE), 'w') as f:
            json.dump(metrics, f, indent=2)
    return metrics


def evaluate(config: str, checkpoint: str, log_config: bool = True,
             **kwargs) -> Dict[str, float]:
    """Test a checkpoint as ``tools/test.py`` does; returns the metrics."""
    return run_test(build_test_config(config, checkpoint, **kwargs),
                    log_config)


def format_metrics(metrics: Dict[str, float]) -> str:
    """``aAcc`` / ``mIoU`` / ``mAcc`` first, then the rest, one a line."""
    keys = [k for k in ('aAcc', 'mIoU', 'mAcc') if k in metrics]
    keys += sorted(k for k in metrics if k not in keys)
    return '\n'.join(f'{k:>6s}: {metrics[k]:.2f}' for k in keys)


def run_in_subprocess(fn: Callable, *args, **kwargs) -> None:
    """Call ``fn(*args, **kwargs)`` (module-level) in a fresh Python process.

    mmengine's process-wide logger, message hub and visualizer would let two
    runs of one config meet under one name; a fresh process also gives the
    run's memory back.

    Raises:
        RuntimeError: the process ended with a non-zero exit code.
    """
    proc = multiprocessing.get_context('spawn').Process(
        target=fn, args=args, kwargs=kwargs)
    proc.start()
    try:
        proc.join()
    finally:
        if proc.is_alive():  # the caller was interrupted
            proc.terminate()
            proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(
            f'{fn.__name__}{args} failed in its own process (exit code '
            f'{proc.exitcode})')
