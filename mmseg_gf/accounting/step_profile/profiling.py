"""Profile a prepared segmentor: one traced step (three with the
timeline) gives the :class:`~.step_cost_profile.StepCostProfile` that
every setting's cost is summed from."""
from typing import List, Sequence, Tuple

from torch import nn

from ..batch import random_batch
from ..measured import live_bytes_by_interval
from ..saved_bytes import UnmodelledBytes
from ..trace import StepTracer
from .recorder import ProfileRecorder
from .step_cost_profile import StepCostProfile


def profile_step_costs(probe: nn.Module, candidates: Sequence[nn.Module],
                       input_size: Sequence[int], is_classifier,
                       timeline: bool = False,
                       patch_mean_activations: bool = False
                       ) -> StepCostProfile:
    """Profile a prepared segmentor for the costs of every last-N setting.

    Args:
        probe: the segmentor prepared as gradient filtering trains every
            candidate conv with the exact backward (their outputs carry
            autograd nodes to tag, and, nothing being kept, memory behaves
            as in a step where they run frozen or filtered), the lean
            region on and the classifiers trained. Traced as it is; the
            trace keeps nothing for backward.
        candidates: the candidate convs of ``probe``, execution order.
        input_size: ``(H, W)`` (the training crop).
        is_classifier: path -> whether a conv is a decode-head classifier
            (trained by every setting; costed exactly).
        timeline: also run the trace at batch 1 and 2 under the CPU
            profiler, recording live tensor bytes per module call, for the
            step peak (:attr:`StepCost.peak_bytes`); three traces instead
            of one.
        patch_mean_activations: model the patch-mean GELU rule (the
            setting of the trained model: lean, ``mode='gf'``): each
            setting counts the GELUs the rule takes by their patch means
            (:meth:`StepCostProfile.patch_mean_gelus`).
    """
    size = (int(input_size[0]), int(input_size[1]))
    profile = StepCostProfile(input_size=size)
    recorder = ProfileRecorder(probe, candidates, profile, is_classifier,
                               patch_means=patch_mean_activations)
    tracer = StepTracer(probe, recorder, marks=True,
                        on_pack=recorder.on_pack, operations=True)
    recorder.tracer = tracer
    tracer.operations.on_use = recorder.use
    with tracer.hooked():
        losses = tracer.step(random_batch(probe, size, 1), keep_saved=False)
        recorder.resolve_gelus(losses)
        del losses
        tracer.recording = False
        profile.entries.extend(recorder.measured_entries())
        recorder.unmodelled = UnmodelledBytes.of(probe)
        recorder.memo.clear()
        recorder.tags.clear()
        profile.convs.sort(key=lambda c: c.index)
        if timeline:
            profile.live = live_per_call(tracer, probe, size)
    return profile


def live_per_call(tracer: StepTracer, probe: nn.Module,
                  size: Tuple[int, int]) -> List[Tuple[int, int]]:
    """Live bytes per call of the traced forward at batch 1 and 2."""
    live = []
    for n in (1, 2):
        batch = random_batch(probe, size, n)
        live.append(live_bytes_by_interval(
            lambda: tracer.step(batch, keep_saved=False)))
    if len(live[0]) != len(live[1]):
        raise RuntimeError(
            'gradient_filter budget: the traces at batch 1 and 2 ran '
            'different module calls; the step peak cannot be predicted for '
            'this model')
    return list(zip(*live))
