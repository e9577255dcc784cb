"""GradFilterHook: gradient filtering for an unchanged mmseg config.

Layers are swapped in ``before_train``, after the optimizer, weight init and
``load_or_resume``, and a DDP model is wrapped again after freezing
(docs/reliability.md#distributed-training).
"""
from typing import Any, Dict, Optional, Sequence

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmseg.registry import HOOKS
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ...accounting.report import chosen_layers_table, step_kept_table
from ...accounting.saved_bytes import trace_step_saved_bytes
from ...models.segmentor import (is_classifier, set_frozen_norms_eval,
                                 unwrap_model)
from ..checkpoint import check_checkpoint_matches
from ..checkpoint.resume import find_resumable_checkpoint
from ..checkpoint.random_state import ResumedRandomState
from ..compile_settings import describe, model_compile_setting
from ..compiled_loss import (install_compiled_loss, loss_compile_kwargs,
                             split_target)
from ..config import (default_batch_size, default_input_size,
                      default_optimizer, select_and_apply)
from ..cpu_memory import keep_freed_cpu_memory
from ..ddp import rewrap_ddp
from ..layer_trace import trace_layers
from ..selection import LayerChoice
from ..settings import (ACCEPTED_KEYS, CHOICE_KEYS, DEFAULT_INPUT_SIZE,
                        HOOK_OPTIONS, SETTING_KEYS, GradientFilterSettings,
                        as_settings)
from ..state import get_state
from ..surgery import get_gradient_filter_layers
from ..train_log import (PEAK_KEY, PeakResidentMemory, logged_now,
                         precision_summary)

__all__ = ['GradFilterHook']


def _take_compile_setting(runner, lean: bool) -> Optional[dict]:
    """The ``torch.compile`` arguments for the segmentor's loss, taken from
    ``runner.cfg``.

    The Runner's ``compile`` becomes False; None where it is off or targets
    ``'train_step'``. Logged.
    """
    cfg = getattr(runner, 'cfg', None)
    setting = None if cfg is None else cfg.get('compile')
    if setting is None or setting is False:
        return None
    if hasattr(setting, 'to_dict'):
        setting = setting.to_dict()
    target, rest = split_target({} if setting is True else setting)
    changed = model_compile_setting(rest, runner.model, lean)
    if changed is not rest:
        runner.logger.info(describe(changed))
    if target == 'train_step':
        cfg.compile = changed
        return None
    cfg.compile = False
    kwargs = loss_compile_kwargs(changed)
    runner.logger.info(
        f'GradFilterHook: torch.compile of the segmentor\'s loss with '
        f'{kwargs}, not of mmengine\'s train_step (its preprocessor, '
        'optimizer step and sample metadata would recompile every '
        'iteration: mmseg_gf.engine.compiled_loss says why; '
        "compile=dict(target='train_step') keeps mmengine's)")
    return kwargs


@HOOKS.register_module()
class GradFilterHook(Hook):
    """Gradient-filter the last layers of an existing mmseg config's model.

    Use with ``custom_imports=dict(imports=['mmseg_gf'])`` and
    ``custom_hooks=[dict(type='GradFilterHook', num_layers=5, radius=4)]``.
    On a model already prepared by ``GradFilterModel`` nothing is re-applied:
    the hook logs the cost table and keeps frozen norms in eval mode. With the
    config's ``compile`` on, it compiles the segmentor's loss, not
    ``train_step`` (:mod:`..compiled_loss`).

    Args:
        settings: (positional only) the settings as one object or dict,
            instead of keywords.
        **kwargs: the settings as a config's ``gradient_filter`` takes them
            (:class:`~mmseg_gf.engine.settings.GradientFilterSettings`).
            ``input_size`` defaults to the config's crop, else 512; a
            ``budget`` is fitted at the crop and the dataloader's batch size.
        log_table: log the per-layer cost table at train start.
        check_load_from: fail before loading if the checkpoint does not exist
            or does not match the model.
        resume_random_state: keep torch's generator state in each checkpoint
            and restore it on resume.

    Raises:
        ValueError: an unknown keyword, settings given twice, or a setting
            :func:`check_settings` refuses.
    """

    priority = 'ABOVE_NORMAL'

    def __init__(self,
                 settings: Any = None,
                 /,
                 *,
                 log_table: bool = HOOK_OPTIONS['log_table'].default,
                 check_load_from: bool = HOOK_OPTIONS[
                     'check_load_from'].default,
                 resume_random_state: bool = HOOK_OPTIONS[
                     'resume_random_state'].default,
                 **kwargs: Any) -> None:
        #: The checked settings, passed down as they are; None: the
        #: model is expected prepared (``GradFilterModel``).
        self.settings: Optional[GradientFilterSettings] = _hook_settings(
            settings, kwargs)
        self.configured = self.settings is not None
        self.log_table = log_table
        self.check_load_from = bool(check_load_from)
        self._random_state = (ResumedRandomState()
                              if resume_random_state else None)
        self._peak_memory: Optional[PeakResidentMemory] = None
        self._compile: Optional[dict] = None
        self._undo_compile = None

    def before_run(self, runner) -> None:
        """Take the ``compile`` setting over and check the checkpoint to be
        loaded.

        With ``resume=True`` and no ``load_from``, resume from the newest
        checkpoint of the work dir that loads, not whatever ``last_checkpoint``
        names.
        """
        self._compile = _take_compile_setting(
            runner, self.configured and self.settings.lean)
        load_from = getattr(runner, '_load_from', None)
        resume = bool(getattr(runner, '_resume', False))
        if resume and load_from is None:
            load_from = find_resumable_checkpoint(runner.work_dir,
                                                  logger=runner.logger)
            runner._load_from = load_from
        if load_from is None or not self.check_load_from:
            return
        model = unwrap_model(runner.model)
        check_checkpoint_matches(
            model, load_from, 'resume' if resume else 'load_from',
            logger=runner.logger)

    def before_train(self, runner) -> None:
        """Apply selection + surgery (unless done), re-wrap DDP, log."""
        model = unwrap_model(runner.model)
        choices = get_gradient_filter_layers(model)
        if choices is None and is_model_wrapper(runner.model) and \
                not isinstance(runner.model, DistributedDataParallel):
            # FSDP / DeepSpeed wrappers flatten or shard the Parameters that
            # GFConv2d.from_conv would share: swapping after wrapping is
            # unsafe there, building the model prepared is not.
            raise TypeError(
                'GradFilterHook can only re-wrap DistributedDataParallel '
                f'models, got {type(runner.model).__name__}; use the '
                '`gradient_filter` config setting (rewrite_config) so the '
                'model is prepared before it is wrapped')
        if choices is None:
            if not self.configured:
                raise ValueError(
                    'GradFilterHook needs num_layers, layers or budget, '
                    'unless the model was built by GradFilterModel '
                    '(gradient_filter config setting)')
            s = self.settings
            size = s.input_size or (
                default_input_size(runner.cfg)
                if runner.cfg is not None else DEFAULT_INPUT_SIZE)
            choices = select_and_apply(
                model, s, size, batch=_batch_size(runner),
                optimizer=None if runner.cfg is None else
                default_optimizer(runner.cfg))
            if is_model_wrapper(runner.model):
                rewrap_ddp(runner, model)
        elif self.configured:
            runner.logger.info(
                'GradFilterHook: the model was already gradient-filtered by '
                'its config (GradFilterModel); hook settings are ignored')
        set_frozen_norms_eval(model)
        _reuse_cpu_memory(runner, model)
        wrapper = getattr(runner, 'optim_wrapper', None)
        if hasattr(wrapper, 'optim_context'):  # built (Runner.train)
            runner.logger.info(
                f'GradFilterHook: {precision_summary(wrapper)}')
        self._peak_memory = _cpu_peak_memory(runner, model)
        budget = get_state(model).budget
        if budget is not None:
            runner.logger.info(f'GradFilterHook: {budget.summary()}')
        if self.log_table:
            self._log_cost(runner, model, choices)
        if self._compile is not None and self._undo_compile is None:
            self._undo_compile = install_compiled_loss(model, self._compile)

    def after_run(self, runner) -> None:
        """Give the segmentor its own ``loss`` back."""
        if self._undo_compile is not None:
            self._undo_compile()
            self._undo_compile = None

    @staticmethod
    def _log_cost(runner, model: nn.Module,
                  choices: Sequence[LayerChoice]) -> None:
        """Log the chosen layers' cost table (and the lean step's saved
        bytes)."""
        batch = _batch_size(runner) or 1
        size = choices[0].input_hw if choices[0].input_hw[0] else (
            DEFAULT_INPUT_SIZE)
        # One forward with autograd on: which chosen convs get an input
        # that needs a gradient (they compute g_x; the others do not), and
        # the trained classifiers (the budget's FLOPs count them too).
        records = trace_layers(model, size, grad=True)
        needs = {r.path: r.input_requires_grad for r in records}
        classifiers = [r for r in records if r.inference and is_classifier(
            r.path) and any(p.requires_grad for p in r.module.parameters())]
        state = get_state(model)
        runner.logger.info('\n' + chosen_layers_table(
            model, choices, batch, state.mode, needs, classifiers))
        if state.patch_mean_gelus:
            runner.logger.info(
                f'{len(state.patch_mean_gelus)} GELU(s) between two filtered '
                'layers keep the patch means of their derivative: ' +
                ', '.join(state.patch_mean_gelus))
        if state.lean:
            step = trace_step_saved_bytes(model, size)
            runner.logger.info('\n' + step_kept_table(step, batch))

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        if self._random_state is not None:
            self._random_state.save(checkpoint)

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        if self._random_state is not None:
            self._random_state.loaded(checkpoint)

    def before_train_iter(self, runner, batch_idx: int,
                          data_batch: Any = None) -> None:
        """Re-freeze norm stats; after a resume, restore torch's generators."""
        set_frozen_norms_eval(runner.model)
        if self._random_state is not None:
            self._random_state.before_iteration(runner)

    def after_train_iter(self, runner, batch_idx: int,
                         data_batch: Any = None, outputs: Any = None) -> None:
        """On CPU, log the peak resident memory (``peak_rss``, MiB) per
        interval."""
        if self._peak_memory is None:
            return
        peak = self._peak_memory.peak_mib()
        if peak is not None:
            runner.message_hub.update_scalar(f'train/{PEAK_KEY}', peak)
        if logged_now(runner, batch_idx):
            self._peak_memory.reset()


def _hook_settings(settings: Any, kwargs: Dict[str, Any]
                   ) -> Optional[GradientFilterSettings]:
    """The hook's settings, checked once; None when nothing chooses layers.

    Raises:
        ValueError: an unknown keyword (naming the accepted ones), both
            ``settings`` and keywords, or a refused setting.
    """
    unknown = sorted(set(kwargs) - set(SETTING_KEYS))
    if unknown:
        raise ValueError(
            f'GradFilterHook: unknown argument(s) {unknown}; '
            f'allowed: {list(ACCEPTED_KEYS)}')
    if settings is not None:
        if kwargs:
            raise ValueError(
                'GradFilterHook: give the settings either as one object or '
                f'as keywords, not both; got an object and {sorted(kwargs)}')
        return as_settings(settings)
    if not any(kwargs.get(k) is not None for k in CHOICE_KEYS):
        return None
    return as_settings(kwargs)


def _cpu_peak_memory(runner, model: nn.Module
                     ) -> Optional[PeakResidentMemory]:
    """A peak-memory meter for a model training on CPU, or None (logged)."""
    if any(p.device.type != 'cpu' for p in model.parameters()):
        return None
    meter = PeakResidentMemory()
    if not meter.reset():
        runner.logger.info(
            'GradFilterHook: the peak memory of CPU steps is not logged '
            '(no resettable VmHWM in /proc/self on this system)')
        return None
    runner.logger.info(
        f'GradFilterHook: each log line\'s {PEAK_KEY} is the process\'s '
        'peak resident memory (Linux VmHWM, MiB) over the iterations since '
        'the previous line')
    return meter


def _reuse_cpu_memory(runner, model: nn.Module) -> None:
    """Keep freed CPU memory for reuse when the settings ask for it."""
    if not get_state(model).reuse_cpu_memory or any(
            p.device.type != 'cpu' for p in model.parameters()):
        return
    if keep_freed_cpu_memory():
        runner.logger.info(
            'GradFilterHook: freed CPU memory stays in malloc\'s heap for '
            'the next steps (no page faults of fresh memory; resident '
            'memory stays at its peak)')
    else:
        runner.logger.info(
            'GradFilterHook: reuse_cpu_memory has no effect here (the C '
            'library has no glibc mallopt)')


def _batch_size(runner) -> Optional[int]:
    """The train dataloader's batch size from the runner's config."""
    return default_batch_size(runner.cfg) if runner.cfg is not None else None
