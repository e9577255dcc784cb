"""Fault injection: a training run killed with SIGKILL at random points,
checkpoint writes included, resumed until its schedule completes, and its
final weights compared bit for bit with an uninterrupted run's.

Kills come from the parent at a random moment (``'time'``) or from the
child inside its ``k``-th checkpoint write (``'write'``). Method and
results: docs/reliability.md#measured-sigkill-at-random-points.
"""
import json
import os
import os.path as osp
import random
import shutil
import signal
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from mmengine.hooks import Hook

from ..engine.checkpoint import atomic_write
from ..engine.checkpoint.resume import CHECKPOINT_NAME, LAST_CHECKPOINT
from ..engine.checkpoint.safe_load import load_checkpoint_file
from ..engine.entrypoints import build_runner, build_train_config
from ..patching import override
from .fault_child import ChildRun, read_progress

__all__ = ['FaultSetting', 'child_config_text', 'kill_inside_write',
           'child_main', 'compare_checkpoints', 'run_fault_injection',
           'PIPELINES']

#: The training pipelines a fault-injection run may use.
PIPELINES = ('fixed', 'demo')


@dataclass
class FaultSetting:
    """The shrunk demo run the children train."""
    #: the demo config (its ``_base_`` in the child config)
    demo_config: str
    #: the synthetic VOC12Aug root (``<data>/VOCdevkit/VOC2012``)
    data_root: str
    max_iters: int = 12
    #: a checkpoint every ``interval`` iterations
    interval: int = 3
    crop: int = 32
    batch_size: int = 2
    max_keep_ckpts: int = 2
    #: one of :data:`PIPELINES`
    pipeline: str = 'fixed'

    def check(self) -> None:
        """Raise ValueError naming a bad field."""
        if self.pipeline not in PIPELINES:
            raise ValueError(f'pipeline must be one of {PIPELINES}, got '
                             f'{self.pipeline!r}')
        for name in ('max_iters', 'interval', 'crop', 'batch_size',
                     'max_keep_ckpts'):
            if not (isinstance(getattr(self, name), int)
                    and getattr(self, name) >= 1):
                raise ValueError(f'{name} must be an int >= 1, got '
                                 f'{getattr(self, name)!r}')
        if not osp.isfile(self.demo_config):
            raise ValueError(f'demo_config: no file {self.demo_config!r}')


_FIXED_PIPELINE = """[
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='Resize', scale=crop_size, keep_ratio=False),
    dict(type='PackSegInputs')
]"""
_DEMO_PIPELINE = """[
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='RandomResize', scale=img_scale, ratio_range=(0.75, 1.5),
         keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'),
    dict(type='Pad', size=crop_size),
    dict(type='PackSegInputs')
]"""


def child_config_text(s: FaultSetting) -> str:
    """The child's config: the shrunk demo config, no validation, no cost
    table."""
    fixed = s.pipeline == 'fixed'
    return f"""_base_ = [{osp.abspath(s.demo_config)!r}]
data_root = {s.data_root!r}
crop_size = ({s.crop}, {s.crop})
img_scale = ({s.crop * 4 // 3}, {s.crop})
train_pipeline = {_FIXED_PIPELINE if fixed else _DEMO_PIPELINE}
train_dataloader = dict(
    batch_size={s.batch_size}, num_workers=0, persistent_workers=False,
    dataset=dict(datasets=[
        dict(_base_.dataset_train, data_root=data_root,
             pipeline=train_pipeline),
        dict(_base_.dataset_aug, data_root=data_root,
             pipeline=train_pipeline)]))
val_dataloader = None
val_evaluator = None
val_cfg = None
test_dataloader = None
test_evaluator = None
test_cfg = None
model = dict(data_preprocessor=dict(size=crop_size),
             decode_head=dict({'dropout_ratio=0.0' if fixed else ''}))
param_scheduler = [
    dict(type='CosineAnnealingLR', T_max={s.max_iters}, eta_min=0.0,
         begin=0, end={s.max_iters}, by_epoch=False)
]
train_cfg = dict(max_iters={s.max_iters}, val_interval={s.max_iters + 1})
custom_hooks = [dict(type='GradFilterHook', log_table=False)]
default_hooks = dict(
    logger=dict(interval=1),
    checkpoint=dict(interval={s.interval},
                    max_keep_ckpts={s.max_keep_ckpts}))
"""


class ProgressHook(Hook):
    """Appends ``start <iter>`` and ``iter <n>`` lines to a file."""

    priority = 'LOWEST'

    def __init__(self, path: str) -> None:
        self.path = path

    def _line(self, text: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, (text + '\n').encode())
        finally:
            os.close(fd)

    def before_train(self, runner) -> None:
        self._line(f'start {runner.iter}')

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None) -> None:
        self._line(f'iter {runner.iter + 1}')


def _is_checkpoint_write(path: str) -> bool:
    name = osp.basename(path)
    return name == LAST_CHECKPOINT or bool(CHECKPOINT_NAME.match(name))


def kill_inside_write(index: int, fraction: float) -> Callable[[], None]:
    """Test-only fault: SIGKILL this process inside its ``index``-th checkpoint
    write, after ``int(fraction * size)`` bytes. Returns the undo.
    """
    seen = [0]
    plain = atomic_write.write_chunks

    def write_chunks(file, data: bytes, path: str) -> None:
        if _is_checkpoint_write(path):
            seen[0] += 1
            if seen[0] == index:
                file.write(memoryview(data)[:int(fraction * len(data))])
                file.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        plain(file, data, path)

    return override(atomic_write, 'write_chunks', write_chunks)


def child_main(config: str, work_dir: str, progress: str, log: str,
               kill_write: Optional[List[float]] = None) -> None:
    """Train ``config`` as ``tools/train.py --resume`` does, logging
    progress."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # one intra-op thread: the same arithmetic in every child, and no
    # spinning OpenMP threads on a busy machine
    torch.set_num_threads(1)
    if kill_write:
        kill_inside_write(int(kill_write[0]), float(kill_write[1]))
    cfg = build_train_config(config, work_dir=work_dir, resume=True,
                             format_python_code=False)
    runner = build_runner(cfg)
    runner.register_hook(ProgressHook(progress))
    runner.train()


def compare_checkpoints(path: str, reference: str) -> Dict[str, Any]:
    """Whether ``path``'s tensors equal ``reference``'s bit for bit, and by how
    much not."""
    a = load_checkpoint_file(path)['state_dict']
    b = load_checkpoint_file(reference)['state_dict']
    differ = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
    largest = max((float((a[k].double() - b[k].double()).abs().max())
                   for k in differ if k in a and a[k].shape == b[k].shape
                   and a[k].is_floating_point()), default=0.0)
    return dict(identical=not differ and a.keys() == b.keys(),
                tensors=len(b), differing=len(differ), max_abs_diff=largest)


def _writes_left(s: FaultSetting, start: int) -> int:
    """Checkpoint writes a child starting at ``start`` makes."""
    saves = {i for i in range(s.interval, s.max_iters + 1, s.interval)
             if i > start} | {s.max_iters}
    return 2 * len(saves)


def _last_start(progress: str) -> int:
    starts = [n for kind, n in read_progress(progress) if kind == 'start']
    return starts[-1] if starts else 0


def _episode(s: FaultSetting, config: str, root: str, kinds: List[str],
             rng: random.Random, seconds_per_iter: float,
             log: Callable[[str], None]) -> Dict[str, Any]:
    """One schedule with one kill per entry of ``kinds``, resumed until it
    completes."""
    os.makedirs(root, exist_ok=True)
    progress = osp.join(root, 'progress.txt')
    kills: List[Dict[str, Any]] = []
    for kind in kinds + [None]:
        child = ChildRun(child_main, config, root, progress,
                         osp.join(root, 'children.log'))
        start = _last_start(progress) if kills else 0
        plan: Dict[str, Any] = dict(kind=kind)
        if kind == 'write':
            plan.update(write=rng.randint(1, _writes_left(s, start)),
                        fraction=rng.random())
        elif kind == 'time':
            plan.update(delay=rng.random() * 0.95 * seconds_per_iter *
                        max(s.max_iters - start, 1))
        code = child.run(plan)
        training = child.training_seconds
        if kind is not None and code == -signal.SIGKILL:
            plan.update(child.report())
            kills.append(plan)
            log(f'  kill {len(kills)}: {plan}')
        elif code != 0:
            raise RuntimeError(f'a child ended with exit code {code}; see '
                               f'{osp.join(root, "children.log")}')
        if code == 0:
            break
    _costs(s, progress, kills)
    return dict(kills=kills, final=osp.join(root, f'iter_{s.max_iters}.pth'),
                training_seconds=training)


def _costs(s: FaultSetting, progress: str, kills: List[Dict]) -> None:
    """Check the schedule completed; set each kill's ``resumed_from`` and
    ``cost``."""
    lines = read_progress(progress)
    if not (lines and lines[-1] == ('iter', s.max_iters)):
        raise RuntimeError(f'the schedule did not complete: {progress}')
    starts = [n for kind, n in lines if kind == 'start']
    for kill, resumed in zip(kills, starts[1:]):
        kill['resumed_from'] = resumed
        kill['cost'] = kill['reached'] - resumed


def run_fault_injection(s: FaultSetting, work_dir: str, kills: int = 20,
                        in_write: int = 5, kills_per_episode: int = 4,
                        seed: int = 0,
                        log: Callable[[str], None] = print) -> Dict[str, Any]:
    """An uninterrupted run, then episodes of kills, each compared with it."""
    s.check()
    if not 0 <= in_write <= kills or kills < 1 or kills_per_episode < 1:
        raise ValueError('need kills >= 1, 0 <= in_write <= kills and '
                         f'kills_per_episode >= 1; got {kills}, {in_write}, '
                         f'{kills_per_episode}')
    shutil.rmtree(work_dir, ignore_errors=True)
    os.makedirs(work_dir)
    config = osp.join(work_dir, 'fault_child.py')
    with open(config, 'w') as f:
        f.write(child_config_text(s))
    rng = random.Random(seed)
    reference = _episode(s, config, osp.join(work_dir, 'reference'), [], rng,
                         0, log)
    ref = reference['final']
    seconds_per_iter = reference['training_seconds'] / s.max_iters
    log(f'uninterrupted run: {reference["training_seconds"]:.1f} s of '
        'training')
    kinds = ['write'] * in_write + ['time'] * (kills - in_write)
    rng.shuffle(kinds)
    episodes: List[Dict[str, Any]] = []
    while kinds:
        if len(episodes) > 2 * kills:
            raise RuntimeError('the children kept completing before their '
                               'kill; see the children.log files')
        batch, kinds = kinds[:kills_per_episode], kinds[kills_per_episode:]
        root = osp.join(work_dir, f'episode_{len(episodes)}')
        log(f'episode {len(episodes)}: kills {batch}')
        episode = _episode(s, config, root, batch, rng, seconds_per_iter,
                           log)
        episode['match'] = compare_checkpoints(episode['final'], ref)
        # a child that completed before its kill: those kills come again
        kinds = batch[len(episode['kills']):] + kinds
        episodes.append(episode)
        log(f'  final weights: {episode["match"]}')
    return _totals(s, episodes, seconds_per_iter)


def _totals(s: FaultSetting, episodes, seconds_per_iter) -> Dict[str, Any]:
    kills = [dict(k, episode=i, identical=e['match']['identical'])
             for i, e in enumerate(episodes) for k in e['kills']]
    return dict(
        setting=asdict(s), seconds_per_iter=seconds_per_iter,
        kills=kills, episodes=[dict(kills=len(e['kills']), **e['match'])
                               for e in episodes],
        total_kills=len(kills),
        # kills that cut a write (a 'time' kill may land in one too)
        in_write=sum(bool(k['partial']) for k in kills),
        planned_in_write=sum(k['kind'] == 'write' for k in kills),
        identical=sum(k['identical'] for k in kills),
        max_cost=max((k['cost'] for k in kills), default=0))
