"""torch's random-number state in a checkpoint, put back on resume.

mmengine's resume replays the data pipeline but not torch's generators, so
dropout would draw differently; the state saved here and restored before
the first resumed iteration makes a seeded resume bit-identical. One
process only; a foreign state is skipped with a warning
(docs/reliability.md#resume).
"""
from typing import Any, Dict, List, Optional

import torch
from mmengine.dist import get_world_size
from mmengine.logging import print_log

__all__ = ['KEY', 'capture', 'refusal', 'restore', 'ResumedRandomState']

#: Where a checkpoint keeps the state.
KEY = 'random_state'


def capture() -> Dict[str, Any]:
    """torch's CPU generator state and, where CUDA is initialised, every
    device's."""
    state: Dict[str, Any] = {'torch': torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def _byte_state(value: Any, like: torch.Tensor) -> bool:
    return (isinstance(value, torch.Tensor) and value.dtype == torch.uint8
            and value.dim() == 1 and value.numel() == like.numel())


def refusal(state: Any) -> Optional[str]:
    """Why a checkpoint's state cannot be restored in this process, or None."""
    if not isinstance(state, dict) or not _byte_state(
            state.get('torch'), torch.get_rng_state()):
        return 'not a torch generator state'
    cuda = state.get('cuda')
    if cuda is None:
        return None
    if not (torch.cuda.is_available() and isinstance(cuda, (list, tuple))
            and len(cuda) == torch.cuda.device_count()):
        return 'saved on another set of CUDA devices'
    if not all(_byte_state(s, torch.cuda.get_rng_state(i))
               for i, s in enumerate(cuda)):
        return 'not a CUDA generator state'
    return None


def restore(state: Dict[str, Any]) -> None:
    """Put ``state`` back (check it with :func:`refusal` first)."""
    torch.set_rng_state(state['torch'])
    cuda: Optional[List[torch.Tensor]] = state.get('cuda')
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class ResumedRandomState:
    """Saves the state into checkpoints and restores it once, at the resumed
    iteration."""

    def __init__(self) -> None:
        self._pending: Optional[tuple] = None

    @staticmethod
    def save(checkpoint: dict) -> None:
        if get_world_size() == 1:
            checkpoint[KEY] = capture()

    def loaded(self, checkpoint: dict) -> None:
        self._pending = None
        state = checkpoint.get(KEY)
        if state is None or get_world_size() != 1:
            return
        reason = refusal(state)
        if reason is not None:
            print_log(f'checkpoint random state not restored: {reason}',
                      logger='current', level=30)
            return
        meta = checkpoint.get('meta')
        at = meta.get('iter') if isinstance(meta, dict) else None
        if isinstance(at, int):
            self._pending = (at, state)

    def before_iteration(self, runner) -> None:
        if self._pending is None:
            return
        at, state = self._pending
        self._pending = None
        if runner.iter == at:
            restore(state)
