"""The CPU demo behind ``make demo``: finetune with gradient filtering on a
small synthetic VOC12Aug and measure mIoU before and after.

Every step goes through the CLI tools' code paths; evaluation and
training run in fresh processes, since mmengine's per-run globals are
named after the config and the start second.
"""
import json
import os
import os.path as osp
import time
from typing import Any, Dict, Optional, Sequence

from .datasets import make_voc_aug
from .engine.entrypoints import (METRICS_FILE, build_runner,
                                 build_train_config, evaluate,
                                 run_in_subprocess, train)

__all__ = ['ensure_data', 'save_initial_checkpoint', 'run_demo']


def ensure_data(data: str, num_train: int = 96, num_val: int = 24,
                size: Sequence[int] = (96, 128), seed: int = 0,
                classes: Sequence[int] = (1, 2, 3, 4, 5),
                regenerate: bool = False, log=print) -> str:
    """Write the synthetic VOC12Aug unless ``data`` holds one with the same
    settings."""
    data_root = osp.join(data, 'VOCdevkit', 'VOC2012')
    settings = dict(num_train=num_train, num_val=num_val, size=list(size),
                    seed=seed, classes=list(classes))
    stamp = osp.join(data, 'demo_data.json')
    marker = osp.join(data_root, 'ImageSets', 'Segmentation', 'val.txt')
    same = False
    if osp.exists(stamp) and osp.exists(marker):
        with open(stamp) as f:
            same = json.load(f) == settings
    if regenerate or not same:
        start = time.time()
        make_voc_aug(data, num_train, num_val, size=tuple(size), seed=seed,
                     classes=list(classes))
        with open(stamp, 'w') as f:
            json.dump(settings, f)
        log(f'[demo] synthetic VOC12Aug written to {data_root} '
            f'({num_train} train + {num_train} aug / {num_val} val, '
            f'{time.time() - start:.1f}s)')
    else:
        log(f'[demo] using existing data in {data_root}')
    return data_root


def save_initial_checkpoint(config: str, work_dir: str,
                            cfg_options: Optional[Dict[str, Any]] = None
                            ) -> str:
    """Build the demo Runner, initialise the model, save
    ``<work_dir>/iter_0.pth``."""
    from mmengine.runner.checkpoint import (get_state_dict, save_checkpoint,
                                            weights_to_cpu)
    runner = build_runner(build_train_config(
        config, work_dir=osp.join(work_dir, 'init'), cfg_options=cfg_options),
        log_config=False)
    runner.model.init_weights()
    path = osp.join(work_dir, 'iter_0.pth')
    save_checkpoint(
        dict(
            meta=dict(iter=0, note='initial weights of the demo model'),
            state_dict=weights_to_cpu(get_state_dict(runner.model))), path)
    return path


def _evaluate(config: str, checkpoint: str, work_dir: str,
              cfg_options: Optional[Dict[str, Any]]) -> Dict[str, float]:
    # the finetuning run logs the config; the evaluations name it
    run_in_subprocess(evaluate, config, checkpoint, work_dir=work_dir,
                      cfg_options=cfg_options, log_config=False)
    with open(osp.join(work_dir, METRICS_FILE)) as f:
        return json.load(f)


def run_demo(config: str, work_dir: str,
             cfg_options: Optional[Dict[str, Any]] = None,
             log=print) -> Dict[str, Any]:
    """Evaluate the initial weights, finetune, evaluate again (data in place).

    Returns:
        dict with ``before`` and ``after`` test metrics and their ``seconds``.
    """
    os.makedirs(work_dir, exist_ok=True)
    opts = dict(cfg_options or {})
    t = time.time()
    init_ckpt = save_initial_checkpoint(config, work_dir, opts)
    log(f'[demo] initial weights: {init_ckpt}; evaluating them')
    before = _evaluate(config, init_ckpt, osp.join(work_dir, 'before'), opts)
    t_before = time.time() - t

    t = time.time()
    train_dir = osp.join(work_dir, 'finetune')
    log(f'[demo] finetuning from them in {train_dir}')
    # The user's options after load_from, as on tools/train.py's command
    # line: theirs win.
    run_in_subprocess(train, config, work_dir=train_dir,
                      cfg_options=dict(dict(load_from=init_ckpt), **opts))
    with open(osp.join(train_dir, 'last_checkpoint')) as f:
        last = f.read().strip()
    log(f'[demo] evaluating {last}')
    after = _evaluate(config, last, osp.join(work_dir, 'after'), opts)
    return dict(before=before, after=after,
                seconds=dict(before=t_before, after=time.time() - t))
