"""The cost of every "last N convs, radii" setting, from one profile.

:func:`profile_step_costs` traces one training step
(:class:`~..trace.StepTracer`) of a *probe*, the segmentor prepared as if
every candidate conv were trained, and records for every call what it
keeps for backward (:mod:`..kept`) and the last candidate conv upstream of
its input. Which modules record depends only on the first trained conv, so
any setting's kept bytes are a sum over the profile, equal to the count of
the model built that way (tested). FLOPs: :mod:`mmseg_gf.ops.conv.cost`;
peak: :mod:`..peak`. With ``patch_mean_activations`` the profile also
models the patch-mean GELU rule
(:meth:`StepCostProfile.patch_mean_gelus`; docs/budget.md).

One concept per module:

* :mod:`.profiling`: :func:`profile_step_costs`, the traced step(s);
* :mod:`.recorder`: :class:`~.recorder.ProfileRecorder`, which fills the
  profile from the trace's module calls and saved tensors;
* :mod:`.autograd_walks`: the walks of the probe's autograd graph;
* :mod:`.step_cost_profile`: :class:`StepCostProfile`, the query model,
  made of :mod:`.candidate` (:class:`ConvProfile`), :mod:`.kept_entry` and
  :mod:`.gelu_call`;
* :mod:`.step_cost`: :class:`StepCost`, one setting's answer."""
from .candidate import ConvProfile
from .profiling import profile_step_costs
from .step_cost import StepCost
from .step_cost_profile import StepCostProfile

__all__ = ['ConvProfile', 'StepCost', 'StepCostProfile',
           'profile_step_costs']
