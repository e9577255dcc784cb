"""GradFilterHook: gradient filtering for an unchanged mmseg config.

Where it acts in mmengine's ``Runner.train()``: the optimizer is built, then
``before_run``, weight init, ``load_or_resume`` (checkpoint / optimizer
state), then the train loop calls ``before_train``. The hook swaps layers in
``before_train``, after all of that: GFConv2d shares the conv's Parameters,
so the optimizer (and a resumed optimizer state) stays valid and loaded
weights are kept. DDP fixes the set of gradient-requiring parameters when it
is constructed, so a DDP-wrapped model is wrapped again after freezing
(otherwise the reducer waits for gradients of frozen parameters:
"Expected to have finished reduction in the prior iteration").
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
    """The ``torch.compile`` arguments the hook compiles the segmentor's
    loss with (:mod:`..compiled_loss`), taken from ``runner.cfg.compile``,
    which becomes False (the Runner compiles nothing); None where the
    setting is off or its ``target`` is ``'train_step'`` (then the setting,
    as the model compiles on its device, stays the Runner's). ``lean``:
    whether a model not prepared yet will have its lean trained region on
    (:func:`~..compile_settings.model_compile_setting`). Logged."""
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

    Use with ``custom_imports=dict(imports=['mmseg_gf'],
    allow_failed_imports=False)`` and
    ``custom_hooks=[dict(type='GradFilterHook', num_layers=5, radius=4)]``.
    If the model was already prepared (built by ``GradFilterModel`` through
    ``rewrite_config``), nothing is re-applied and the hook only logs the
    cost table and keeps frozen norms in eval mode; then no settings are
    needed. With the config's ``compile`` on, the hook compiles the
    segmentor's loss, not mmengine's ``train_step``
    (:mod:`..compiled_loss`), with the setting for the model's device
    (:mod:`..compile_settings`).

    Args:
        settings: (positional only) the settings as one object
            (:class:`~mmseg_gf.engine.settings.GradientFilterSettings` or a
            dict), instead of keywords; a config gives keywords.
        **kwargs: the gradient-filter settings, as a config's
            ``gradient_filter`` takes them
            (:class:`~mmseg_gf.engine.settings.GradientFilterSettings`: each
            field's default and doc). ``input_size`` defaults to the
            config's data_preprocessor size / crop_size, else 512; a
            ``budget`` is fitted at the training crop and the train
            dataloader's batch size; ``reuse_cpu_memory`` applies when the
            model trains on CPU (:mod:`mmseg_gf.engine.cpu_memory`).
        log_table: log the per-layer cost table at train start.
        check_load_from: before the checkpoint is loaded, fail if the
            ``load_from`` (or resumed) checkpoint does not exist or does not
            match the model (see :func:`check_checkpoint_matches`).
        resume_random_state: keep torch's generator state in each
            checkpoint and put it back on resume
            (:mod:`..checkpoint.random_state`).

    ``log_table``, ``check_load_from`` and ``resume_random_state`` are
    declared with their defaults and docs in
    :data:`~mmseg_gf.engine.settings.HOOK_OPTIONS`.
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
        """Take the ``compile`` setting over, for the model's device
        (:func:`_take_compile_setting`; the Runner compiles after
        ``before_run``), and check the checkpoint to be loaded, before
        anything is trained.

        ``before_run`` precedes the Runner's ``load_or_resume``. A run
        with ``resume=True`` and no ``load_from`` resumes from the newest
        checkpoint of its work dir that loads
        (:func:`~..checkpoint.resume.find_resumable_checkpoint`), where
        mmengine takes whatever ``last_checkpoint`` names.
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
        """Log the chosen layers' cost table (and, with the lean region,
        the whole step's saved bytes)."""
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
        """mmengine loops call ``model.train()``: re-freeze norm stats. On
        the first iteration after a resume, torch's generators take the
        checkpoint's state (after the loop replayed the data pipeline)."""
        set_frozen_norms_eval(runner.model)
        if self._random_state is not None:
            self._random_state.before_iteration(runner)

    def after_train_iter(self, runner, batch_idx: int,
                         data_batch: Any = None, outputs: Any = None) -> None:
        """On CPU, put the peak resident memory since the previous log
        line into the next one (``peak_rss``, MiB; this hook runs before
        the ``LoggerHook``), and start a new interval once it is logged."""
        if self._peak_memory is None:
            return
        peak = self._peak_memory.peak_mib()
        if peak is not None:
            runner.message_hub.update_scalar(f'train/{PEAK_KEY}', peak)
        if logged_now(runner, batch_idx):
            self._peak_memory.reset()


def _hook_settings(settings: Any, kwargs: Dict[str, Any]
                   ) -> Optional[GradientFilterSettings]:
    """The hook's settings, checked once: ``settings`` (an object or a
    dict) or the keywords; None when neither chooses layers (no
    ``num_layers``, ``layers`` or ``budget``).

    Raises:
        ValueError: an unknown keyword (naming the accepted ones), both
            ``settings`` and keywords, or a setting
            :class:`~mmseg_gf.engine.settings.GradientFilterSettings`
            refuses.
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
    """A peak-memory meter for a model training on CPU (mmengine logs
    CUDA's own ``memory``), started now; None on other devices or where
    the process's peak cannot be read and reset (logged)."""
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
    """Keep freed CPU memory for reuse when the model trains on CPU and its
    settings ask for it, and say so."""
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
