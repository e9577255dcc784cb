"""CalibrationHook: the paper's calibration step before finetuning (Supplement
D.3).

In ``before_train`` every parameter outside ``trainable`` is frozen (a DDP
model is wrapped again); in ``before_train_iter`` every BN layer is put in
train mode so its statistics follow the target data.
"""
from typing import List, Optional, Sequence, Union

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmseg.registry import HOOKS
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from ...models.segmentor import set_frozen_norms_eval, unwrap_model
from ..calibration import freeze_for_calibration, set_norm_stats_train
from ..ddp import rewrap_ddp

__all__ = ['CalibrationHook']


@HOOKS.register_module()
class CalibrationHook(Hook):
    """Train only ``trainable`` and re-estimate the BN statistics.

    Args:
        trainable: module path or paths to train (default:
            ``decode_head.conv_seg``).
        update_norm_stats: keep every BN layer in train mode (default True);
            False: norms without trained parameters stay in eval mode.
    """

    priority = 'ABOVE_NORMAL'

    def __init__(self,
                 trainable: Union[str, Sequence[str]] = (
                     'decode_head.conv_seg', ),
                 update_norm_stats: bool = True) -> None:
        if isinstance(trainable, str):
            trainable = [trainable]
        if not trainable or not all(isinstance(p, str) for p in trainable):
            raise ValueError('CalibrationHook trainable must be a module '
                             f'path or a list of them, got {trainable!r}')
        self.trainable = list(trainable)
        self.update_norm_stats = bool(update_norm_stats)
        self.trained: Optional[List[str]] = None

    def before_train(self, runner) -> None:
        model = unwrap_model(runner.model)
        if is_model_wrapper(runner.model) and not isinstance(
                runner.model, DistributedDataParallel):
            raise TypeError('CalibrationHook can only re-wrap '
                            'DistributedDataParallel models, got '
                            f'{type(runner.model).__name__}')
        self.trained = freeze_for_calibration(model, self.trainable)
        if is_model_wrapper(runner.model):
            # DDP fixed its set of gradient-requiring parameters when built.
            rewrap_ddp(runner, model)
        n_train = sum(p.numel() for p in model.parameters()
                      if p.requires_grad)
        n_all = sum(p.numel() for p in model.parameters())
        n_bn = sum(isinstance(m, _BatchNorm) for m in model.modules())
        runner.logger.info(
            f'CalibrationHook: training {self.trainable} ({n_train} of '
            f'{n_all} parameters); '
            + (f'{n_bn} BN layers update their statistics'
               if self.update_norm_stats else 'BN statistics fixed'))

    def before_train_iter(self, runner, batch_idx: int,
                          data_batch=None) -> None:
        if self.update_norm_stats:
            set_norm_stats_train(runner.model)
        else:
            # Frozen norms keep their statistics (as GradFilterHook does).
            set_frozen_norms_eval(runner.model)
