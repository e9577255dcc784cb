"""What one recorded non-candidate call keeps, and from which first
trained candidate on autograd records it."""
from dataclasses import dataclass
from typing import Optional

from ..kept import SavedItem


@dataclass
class KeptEntry:
    """A recorded non-candidate call (or a measured storage): what it keeps,
    the last candidate behind its input, and whether it is trained."""

    item: Optional[SavedItem]
    upstream: int
    trained: bool
    path: str
    seq: int = 0
    #: the call from which the traced forward no longer holds the kept
    #: storage itself (a measured storage that is a live tensor of the
    #: forward, e.g. a GroupNorm's input, is in the trace's live bytes
    #: until then); None: ``seq``; -1: never (it outlives the trace)
    live_from: Optional[int] = None
    #: the storage of a Parameter or buffer (a view of a weight saved by a
    #: product): kept bytes, but alive before the step, so never in its
    #: live bytes
    resident: bool = False

    def forward_seq(self) -> Optional[int]:
        """The call from which the forward's live bytes lack it."""
        if self.live_from is None:
            return self.seq
        return None if self.live_from < 0 else max(self.seq,
                                                   self.live_from + 1)

    def counted(self, first: int) -> bool:
        """Autograd records it when training from candidate ``first``."""
        return self.trained or self.upstream >= first
