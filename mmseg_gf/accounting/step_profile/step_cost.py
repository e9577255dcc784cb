"""The predicted cost of one training step of one setting: what a query
of the profile (:meth:`~.step_cost_profile.StepCostProfile.cost`) returns
and the budget compares with its limits."""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ...models.layer_kinds import layers_noun
from ..format import MIB


@dataclass
class StepCost:
    """Predicted cost of one training step of a setting.

    Attributes:
        num_layers: trained convs besides the classifier.
        radii: path -> radius of each trained conv.
        batch: images per step.
        saved_bytes: bytes kept for backward by the whole step.
        backward_flops: backward FLOPs per image, trained convs and
            classifier.
        peak_bytes: predicted peak of live tensor bytes during the step,
            the optimizer's state included (None when the profile has no
            peak model).
        optimizer_bytes: the optimizer's state for the trained parameters
            (:mod:`..optimizer_state`; 0 when no optimizer was given).
        process_bytes: predicted peak of the process: what it held when
            the profile was made (``StepCostProfile.process_base_bytes``)
            plus ``peak_bytes``; None without a base or a peak model.
        kinds: the layer kinds of the trained layers.
    """

    num_layers: int
    radii: Dict[str, int]
    batch: int
    saved_bytes: int
    backward_flops: int
    peak_bytes: Optional[int] = None
    optimizer_bytes: int = 0
    process_bytes: Optional[int] = None
    kinds: Tuple[str, ...] = ()

    @property
    def saved_mib(self) -> float:
        return self.saved_bytes / MIB

    @property
    def peak_mib(self) -> Optional[float]:
        return None if self.peak_bytes is None else self.peak_bytes / MIB

    @property
    def process_mib(self) -> Optional[float]:
        return None if self.process_bytes is None else \
            self.process_bytes / MIB

    @property
    def backward_gflops(self) -> float:
        return self.backward_flops / 1e9

    @property
    def layer_noun(self) -> str:
        """``'convs'`` when every trained layer is a conv, else
        ``'layers'``."""
        return layers_noun(self.kinds)

    def value(self, key: str) -> Optional[float]:
        """A limit key's figure (MiB, GFLOPs per image)."""
        return getattr(self, key)

    def describe(self) -> str:
        peak = ''
        if self.peak_bytes is not None:
            state = (f' with {self.optimizer_bytes / MIB:.1f} MiB of '
                     'optimizer state' if self.optimizer_bytes else '')
            peak = f', step peak {self.peak_mib:.1f} MiB{state}'
        if self.process_bytes is not None:
            peak += f', process peak {self.process_mib:.1f} MiB'
        return (f'{self.backward_gflops:.3f} backward GFLOPs per image, '
                f'{self.saved_mib:.1f} MiB kept for backward{peak} '
                f'(batch {self.batch})')
