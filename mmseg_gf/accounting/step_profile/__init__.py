"""The cost of every "last N convs, radii" setting, from one profile.

A budget is met by choosing how many of a segmentor's last convs to train
and at which radii (:mod:`..budget`); trying each setting would cost a
model build and a step apiece. Instead :func:`profile_step_costs` traces one
training step (:class:`~..trace.StepTracer`) of a *probe*: the segmentor
prepared as if every candidate conv were trained, and records, for every
call autograd would record, what it keeps for backward (the rules of
:mod:`..kept`) and the last candidate conv upstream of its input. Which
modules record depends only on the first trained conv, so the bytes kept by
a step that trains the last ``N`` convs are a sum over the profile for every
``N`` and radius assignment, equal to the count of the model actually built
that way (tested), which itself equals autograd's saved bytes. Backward
FLOPs are the single cost model's (:mod:`mmseg_gf.ops.conv.cost`); the
step's peak is the peak model's (:mod:`..peak`).

With ``patch_mean_activations`` the profile also models the patch-mean
GELU rule (:mod:`mmseg_gf.engine.patch_mean_activations`): the trace
records, for each GELU call, the candidate whose output it reads unchanged
and the candidate calls consuming its output (the graph premises of
:mod:`mmseg_gf.models.patch_mean_graph`), with their partitions; a setting
counts a GELU by the patch means of ``f'`` (plus the tokens on no grid)
exactly where the rule would fire in the step trained that way: its
producer and all its consumers among the trained layers, at one radius, on
one partition (:meth:`StepCostProfile.patch_mean_gelus`).

One concept per module:

* :mod:`.profiling`: :func:`profile_step_costs`, the traced step(s);
* :mod:`.recorder`: :class:`~.recorder.ProfileRecorder`, which fills the
  profile from the trace's module calls and saved tensors;
* :mod:`.autograd_walks`: the walks of the probe's autograd graph the
  recorder asks (the last candidate behind a tensor, a node's readers, a
  loss's nodes);
* :mod:`.step_cost_profile`: :class:`StepCostProfile`, the query model
  (a setting's cost, its step peak, the GELUs the rule takes), made of
  :mod:`.candidate` (:class:`ConvProfile`), :mod:`.kept_entry` (what a
  non-candidate call keeps) and :mod:`.gelu_call` (a GELU call and the
  rule's premises it met);
* :mod:`.step_cost`: :class:`StepCost`, one setting's answer.
"""
from .candidate import ConvProfile
from .profiling import profile_step_costs
from .step_cost import StepCost
from .step_cost_profile import StepCostProfile

__all__ = ['ConvProfile', 'StepCost', 'StepCostProfile',
           'profile_step_costs']
