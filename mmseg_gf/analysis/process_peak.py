"""A budget's predicted process peak against the process's measured one.

``VmHWM`` is process-wide and only grows, so each measurement runs in a
fresh ``python -m mmseg_gf.analysis.process_peak``: build the model with
the budget, take a few training steps, report the prediction and
``VmHWM`` over the process and over the steps alone (docs/budget.md).
"""
import argparse
import json
import subprocess
import sys
from typing import Any, Dict, Optional, Sequence

import torch
from mmengine.config import Config
from mmengine.optim import build_optim_wrapper
from mmengine.registry import init_default_scope

from ..accounting.batch import random_batch
from ..accounting.format import MIB
from ..engine.config import build_grad_filter_model, default_optimizer
from ..engine.state import get_state
from ..engine.train_log import PeakResidentMemory, peak_resident_bytes
from ..engine.zoo import ZOO_FAMILIES, family_config, make_offline
from ..models.segmentor import set_frozen_norms_eval
from ..ops.backend import extension, output_pool

__all__ = ['measure_process_peak', 'train_and_measure']

#: Marks the child's result line on its standard output.
RESULT_PREFIX = 'process_peak: '


def _model_config(config: str, size: Sequence[int]):
    """The config (a zoo family or a file), offline, its inputs at ``size``."""
    cfg = family_config(config) if config in ZOO_FAMILIES else \
        Config.fromfile(config)
    cfg = make_offline(cfg)
    cfg.model.data_preprocessor['size'] = tuple(size)
    cfg.model.test_cfg = dict(mode='whole')
    return cfg


def train_and_measure(config: str, size: Sequence[int], batch: int,
                      budget: Dict[str, Any], steps: int = 3,
                      threads: Optional[int] = None) -> Dict[str, Any]:
    """In this fresh process: build, choose, train ``steps`` steps, measure
    (MiB)."""
    if threads:
        torch.set_num_threads(threads)
    init_default_scope('mmseg')
    cfg = _model_config(config, size)
    optimizer = default_optimizer(cfg)
    model = build_grad_filter_model(
        cfg.model, budget=dict(budget, batch=batch, optimizer=optimizer),
        input_size=tuple(size))
    choice = get_state(model).budget
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    meter = PeakResidentMemory()
    steps_only = meter.reset()
    for _ in range(steps):
        inputs, samples = random_batch(model, tuple(size), batch)
        model.train()
        set_frozen_norms_eval(model)
        loss, _ = model.parse_losses(model.loss(inputs, samples))
        wrapper.update_params(loss)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cost = choice.cost
    return dict(
        config=config, size=list(size), batch=batch, budget=budget,
        optimizer=optimizer and optimizer['type'],
        num_layers=cost.num_layers, trained_params=trained,
        predicted_process_mib=cost.process_mib,
        predicted_step_peak_mib=cost.peak_mib,
        optimizer_state_mib=cost.optimizer_bytes / MIB,
        base_mib=(cost.process_bytes - cost.peak_bytes) / MIB,
        measured_process_mib=peak_resident_bytes() / MIB,
        measured_steps_mib=meter.peak_mib() if steps_only else None,
        kernel_pool_mib=_kernel_pool_mib())


def _kernel_pool_mib() -> Optional[float]:
    """What the compiled kernels' output pool keeps after the steps, MiB, or
    None."""
    return output_pool.recycled_bytes() / MIB if extension.built() else None


def measure_process_peak(config: str, size: Sequence[int], batch: int,
                         budget: Dict[str, Any], steps: int = 3,
                         threads: Optional[int] = None,
                         timeout: float = 1800) -> Dict[str, Any]:
    """:func:`train_and_measure` in a fresh Python process."""
    args = [sys.executable, '-m', 'mmseg_gf.analysis.process_peak',
            config, '--size', *map(str, size), '--batch', str(batch),
            '--budget', json.dumps(budget), '--steps', str(steps)]
    if threads:
        args += ['--threads', str(threads)]
    done = subprocess.run(args, capture_output=True, text=True,
                          timeout=timeout, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f'process peak measurement of {config} failed '
                       f'(exit {done.returncode}):\n{done.stderr[-4000:]}')


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('config', help='a zoo family name or a config file')
    parser.add_argument('--size', type=int, nargs=2, default=(256, 256))
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--budget', type=json.loads, required=True,
                        help='the budget dict as JSON')
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--threads', type=int, default=None)
    args = parser.parse_args(argv)
    result = train_and_measure(args.config, args.size, args.batch,
                               args.budget, args.steps, args.threads)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == '__main__':
    main()
