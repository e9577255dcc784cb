"""Test-only mmseg modules, imported by test configs via ``custom_imports``
(so also inside ``torchrun`` workers of ``tools/train.py``).

* ``StateDumpHook``: after the run, each rank writes its final state_dict,
  the GFConv2d paths, the lean modules, world size and wrapper type to
  ``out/rank{r}.pth``.
* ``InterruptHook``: raises :class:`SimulatedInterrupt` after iteration
  ``at_iter`` (after the CheckpointHook has saved): an interrupted run.
* ``ConvFreeBackbone``: a backbone with no convolution at all.
"""
import os.path as osp

import torch
from mmengine.dist import get_dist_info
from mmengine.hooks import Hook
from mmengine.model import BaseModule
from mmseg.registry import HOOKS, MODELS
from torch import nn


class SimulatedInterrupt(RuntimeError):
    """Stands in for a killed job."""


@HOOKS.register_module(force=True)
class StateDumpHook(Hook):
    priority = 'LOWEST'

    def __init__(self, out: str) -> None:
        self.out = out

    def after_run(self, runner) -> None:
        from mmseg_gf.engine.lean_region import lean_counts
        from mmseg_gf.models.segmentor import unwrap_model
        from mmseg_gf.models import GFConv2d
        model = unwrap_model(runner.model)
        rank, world = get_dist_info()
        backend = None
        if torch.distributed.is_available() and \
                torch.distributed.is_initialized():
            backend = torch.distributed.get_backend()
        torch.save(
            dict(state={k: v.detach().clone()
                        for k, v in model.state_dict().items()},
                 gf_paths=[n for n, m in model.named_modules()
                           if isinstance(m, GFConv2d)],
                 wrapper=type(runner.model).__name__,
                 lean=lean_counts(model),
                 world_size=world, backend=backend, iter=runner.iter),
            osp.join(self.out, f'rank{rank}.pth'))


@HOOKS.register_module(force=True)
class InterruptHook(Hook):
    # after CheckpointHook (VERY_LOW) has written iter_{at_iter}.pth
    priority = 'LOWEST'

    def __init__(self, at_iter: int) -> None:
        self.at_iter = at_iter

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None) -> None:
        if runner.iter + 1 == self.at_iter:
            raise SimulatedInterrupt(f'interrupted after {self.at_iter}')


@MODELS.register_module(force=True)
class ConvFreeBackbone(BaseModule):
    """Average-pools the image to 1/8 and widens it linearly: no conv."""

    def __init__(self, channels: int = 8, init_cfg=None) -> None:
        super().__init__(init_cfg)
        self.pool = nn.AvgPool2d(8)
        self.proj = nn.Linear(3, channels)

    def forward(self, x):
        y = self.pool(x).permute(0, 2, 3, 1)
        return [self.proj(y).permute(0, 3, 1, 2).contiguous()]
