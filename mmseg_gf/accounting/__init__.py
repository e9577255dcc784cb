"""The accounting: what a training step costs, counted once.

Below the engine (which imports it) and above the models (whose lean
modules it knows; the cost formula of a conv's backward is the conv kind's,
:mod:`mmseg_gf.ops.conv.cost`): the rules of what each kind of module keeps
for backward (:mod:`.kept`; transformer kinds: :mod:`.kept_transformer`;
trained Linears and attentions on tokens: :mod:`.kept_tokens`; Segmenter's mask
head's own code and loss: :mod:`.kept_mask_head`), the one step tracer
(:mod:`.trace`), the profile of
every "last N, radii" setting (:mod:`.step_profile`), the peak model
(:mod:`.peak`), the budget's choice (:mod:`.budget`), the measured
counterparts the tests check them against (:mod:`.measured`), the kernel
launches and bytes of a step on the CUDA path, counted on a CPU
(:mod:`.launches`), and how all of it is written (:mod:`.format`,
:mod:`.report`).
"""
from importlib.util import find_spec

from . import kept_transformer  # noqa: F401  (registers its rules)

if find_spec('mmseg') is not None:  # the head is mmseg's (without it, the
    # modules below mmseg, e.g. .measured, still import)
    from . import kept_mask_head  # noqa: F401  (registers its rules)

__all__ = []
