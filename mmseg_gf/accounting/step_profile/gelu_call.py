"""A GELU call of the probe and the premises of the patch-mean rule
(:mod:`mmseg_gf.models.patch_mean_graph`) it met in the trace: whether a
setting takes the rule on it is decided here, without the model trained
that way."""
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ...models.patch_mean_graph import LayerCall, is_counted_partition
from ...ops.linear.patch_mean_activation import PatchPartition
from .kept_entry import KeptEntry


@dataclass
class GeluCall:
    """A GELU call of the probe the patch-mean rule may take.

    Attributes:
        path: the GELU's module path.
        entries: the entries of what its plain rule keeps (replaced by the
            patch means where the rule fires).
        shape: its input's shape (one image).
        elem_bytes: its input's element size.
        seq: its call's position.
        producer: the candidate whose output it reads unchanged (-1: none,
            or one whose filtered call would run the exact backward).
        partition: that output's patches at the probe's radius.
        users: the candidate calls consuming its output, when every node
            consuming it is one (None: the rule never fires).
        node: its output's autograd node (only during the trace).
    """

    path: str
    entries: List['KeptEntry']
    shape: Tuple[int, ...]
    elem_bytes: int
    seq: int
    producer: int = -1
    partition: Optional[PatchPartition] = None
    users: Optional[List[LayerCall]] = None
    node: Any = field(default=None, repr=False)

    def rule_partition(self, first: int, radii: Dict[str, int],
                       paths: Dict[int, str]) -> Optional[PatchPartition]:
        """The partition the rule keeps this call on when the candidates
        from ``first`` on are trained at ``radii`` (None: it does not
        fire): its producer and consumers trained at one radius, their
        patches the same (``paths``: candidate index -> path)."""
        if self.producer < first or not self.users or \
                self.partition is None:
            return None
        layers = [self.producer] + [u.layer for u in self.users]
        if min(layers) < first:
            return None
        radius = {radii[paths[i]] for i in layers}
        if len(radius) != 1 or any(u.partition != self.partition
                                   for u in self.users):
            return None
        part = dataclasses.replace(self.partition, radius=radius.pop())
        return part if is_counted_partition(part) else None
