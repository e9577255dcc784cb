"""The one step tracer: a record per leaf-module call of a training step.

Everything the accounting says about a whole step (what it keeps for
backward, which convs lie upstream of which module, when tensors live and
die) comes from running the segmentor's ``loss`` once on a random batch with
a forward hook on every leaf module. :class:`StepTracer` runs that step and
hands each call, as a :class:`ModuleCall`, to its consumer:
:func:`trace_step_saved_bytes` (the training log's "kept for backward"
line) and :func:`~.profile.profile_step_costs` (the budget) read the same
calls, so the two cannot disagree about which modules a step records.
"""
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import nn

from ..models.segmentor import set_frozen_norms_eval
from .batch import random_batch
from .kept import StepSavedBytes, kept_by_call
from .measured import mark

__all__ = ['ModuleCall', 'StepTracer', 'trace_step_saved_bytes']


@dataclass
class ModuleCall:
    """One call of a leaf module during the traced step.

    Attributes:
        seq: position of the call among all leaf calls of the step.
        path: the module's path in the segmentor.
        module: the module.
        x: its first positional argument when that is a tensor, else None.
        output: what it returned.
        trained: some parameter of it requires a gradient.
        recorded: autograd records the call (grad mode on, and ``x``
            requires a gradient or the module is trained): only recorded
            calls keep anything for backward.
    """

    seq: int
    path: str
    module: nn.Module
    x: Optional[torch.Tensor]
    output: Any
    trained: bool
    recorded: bool


def _drop(_):
    return None


def _no_unpack(_):
    raise RuntimeError('a trace that keeps nothing cannot run backward')


class StepTracer:
    """Runs training steps of a segmentor, reporting every leaf call.

    Args:
        model: the segmentor (unwrapped), in the state it trains in.
        on_call: called with each :class:`ModuleCall` while
            :attr:`recording` is True.
        marks: put a profiler mark (:func:`~.measured.mark`) at every
            call, so that :func:`~.measured.live_bytes_by_interval` cuts
            the step's live bytes per call.

    Attributes:
        seq: calls so far in the current step (the next call's ``seq``).
        recording: False: calls are only counted (and marked).
    """

    def __init__(self, model: nn.Module,
                 on_call: Callable[[ModuleCall], None],
                 marks: bool = False) -> None:
        self.model = model
        self.on_call = on_call
        self.marks = marks
        self.seq = 0
        self.recording = True
        self._paths = {m: n for n, m in model.named_modules()}

    def _hook(self, module, args, output) -> None:
        seq = self.seq
        self.seq += 1
        if self.marks:
            mark()
        if not self.recording:
            return
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        trained = any(p.requires_grad for p in module.parameters())
        recorded = x is not None and torch.is_grad_enabled() and (
            x.requires_grad or trained)
        self.on_call(ModuleCall(seq, self._paths[module], module, x,
                                output, trained, recorded))

    @contextlib.contextmanager
    def hooked(self):
        """Hooks on every leaf module for the duration of the block."""
        handles = [
            m.register_forward_hook(self._hook) for m in self.model.modules()
            if not any(True for _ in m.children())
        ]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def step(self, batch, keep_saved: bool = True) -> Dict[str, Any]:
        """One training forward + loss on ``batch`` (``(inputs,
        data_samples)``), as training runs it: train mode, frozen norms in
        eval mode; the random state is restored afterwards.

        Args:
            keep_saved: False: autograd keeps nothing for backward (the
                step's live bytes are then the forward's alone).
        """
        inputs, samples = batch
        self.seq = 0
        saved = contextlib.nullcontext() if keep_saved else \
            torch.autograd.graph.saved_tensors_hooks(_drop, _no_unpack)
        with torch.random.fork_rng(), saved:
            self.model.train()
            set_frozen_norms_eval(self.model)
            return self.model.loss(inputs, samples)


def trace_step_saved_bytes(model: nn.Module,
                           input_size: Sequence[int]) -> StepSavedBytes:
    """What one training step of ``model`` keeps for backward, analytic.

    One step at batch 1 is traced and each recorded call's rule
    (:func:`~.kept.kept_by_call`) gives its bytes per image. The model's
    training flag is restored afterwards.
    """
    size = tuple(int(v) for v in input_size)
    result = StepSavedBytes(input_size=size)
    shared: Dict[int, str] = {}

    def on_call(call: ModuleCall) -> None:
        if not call.recorded or not isinstance(call.output, torch.Tensor):
            return
        items, modelled = kept_by_call(model, call.path, call.module, call.x,
                                       call.output, shared)
        if not modelled:
            result.unmodelled.append(call.path)
        result.items.extend(items)

    was_training = model.training
    tracer = StepTracer(model, on_call)
    try:
        with tracer.hooked():
            tracer.step(random_batch(model, size, 1))
    finally:
        model.train(was_training)
    return result
