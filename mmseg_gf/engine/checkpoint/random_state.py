"""torch's random-number state in a checkpoint, put back on resume.

mmengine saves the seed but no generator state. On resume its
``IterBasedTrainLoop`` replays the data pipeline over the iterations
already trained, so the generators mmseg's transforms draw from (numpy's
and Python's, in the main process or in seeded workers) reach the states
of the uninterrupted run; torch's do not: dropout and drop path would draw
from wherever building the model left it. A checkpoint therefore keeps
torch's CPU and CUDA generator states (:data:`KEY`), and the resumed run
puts them back just before its first iteration, after the replay
(:class:`ResumedRandomState`): with a seeded run (``randomness=dict(seed=
...)``) the resumed weights equal the uninterrupted run's bit for bit.

One process only: under DDP each rank has its own generators and rank 0
alone writes the checkpoint, so a distributed resume keeps mmengine's
behaviour. A state that is not what this process's torch would write (a
file from elsewhere, another device count) is not restored, with one
warning: loading a checkpoint never fails on it.
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
    """Why ``state`` (a checkpoint's :data:`KEY`) cannot be restored in
    this process, or None."""
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
    """The hook's side of it: :meth:`save` into each checkpoint written,
    :meth:`loaded` from each one read, :meth:`before_iteration` restores
    the state once, at the iteration the checkpoint was written after
    (a ``load_from`` of another run's checkpoint starts at iteration 0 and
    restores nothing)."""

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
