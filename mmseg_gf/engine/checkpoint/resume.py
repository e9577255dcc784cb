"""The checkpoint a resumed run starts from: the newest one that loads.

mmengine's ``find_latest_checkpoint`` returns whatever ``last_checkpoint``
names. A file truncated by a cut (written by mmengine without the atomic
writes of :mod:`.atomic_write`, or by a disk that lost what it
acknowledged) or refused by the plugin's loader then ends the resume with
an error, although an older checkpoint of the run may be good.
:func:`find_resumable_checkpoint` tries the named file first, then the
work dir's ``iter_<N>.pth`` / ``epoch_<N>.pth``, newest (largest ``N``)
first, and returns the first that loads (:func:`.safe_load.
load_checkpoint_file`: the names and declared costs checked, then the whole
file read as data). Files it skips are named in one warning, with why; a
truncated newest checkpoint so costs the iterations since the previous one.
"""
import logging
import os
import os.path as osp
import pickle
import re
from typing import List, Optional, Tuple, Union

from mmengine.logging import print_log

from .atomic_write import remove_partial_writes
from .data import RefusedCheckpointError
from .safe_load import load_checkpoint_file

__all__ = ['LAST_CHECKPOINT', 'CHECKPOINT_NAME', 'NoResumableCheckpoint',
           'read_last_checkpoint', 'numbered_checkpoints',
           'find_resumable_checkpoint']

#: The file in a work dir that names the latest checkpoint (mmengine's).
LAST_CHECKPOINT = 'last_checkpoint'
#: The names of the checkpoints a CheckpointHook writes by default.
CHECKPOINT_NAME = re.compile(r'^(?:iter|epoch)_(\d+)\.pth$')


class NoResumableCheckpoint(RuntimeError):
    """The work dir has checkpoints, and none of them loads."""


def read_last_checkpoint(work_dir: str) -> Optional[str]:
    """What ``<work_dir>/last_checkpoint`` names (stripped; ``''`` for an
    empty file), or None without the file."""
    path = osp.join(work_dir, LAST_CHECKPOINT)
    if not osp.isfile(path):
        return None
    with open(path, encoding='utf-8', errors='replace') as f:
        return f.read().strip()


def numbered_checkpoints(work_dir: str) -> List[str]:
    """The work dir's ``iter_<N>.pth`` / ``epoch_<N>.pth`` files, largest
    ``N`` first."""
    if not osp.isdir(work_dir):
        return []
    found = []
    for name in os.listdir(work_dir):
        match = CHECKPOINT_NAME.match(name)
        path = osp.join(work_dir, name)
        if match and osp.isfile(path):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found, reverse=True)]


def _load_problem(path: str) -> Optional[Exception]:
    """None if ``path`` loads as a Runner checkpoint, else the error."""
    if not path:
        return NoResumableCheckpoint('last_checkpoint is empty')
    try:
        checkpoint = load_checkpoint_file(path, map_location='cpu')
    except (OSError, pickle.UnpicklingError) as err:
        return err  # RefusedCheckpointError is an UnpicklingError
    if not (isinstance(checkpoint, dict) and 'state_dict' in checkpoint
            and 'meta' in checkpoint):
        return NoResumableCheckpoint(
            'not a Runner checkpoint (no state_dict and meta)')
    return None


def _why(err: Exception) -> str:
    kind = ('refused' if isinstance(err, RefusedCheckpointError) else
            type(err).__name__)
    return f'{kind}: {(str(err).splitlines() or [""])[0][:300]}'


def _nothing_loads(work_dir: str, skipped) -> Exception:
    """The error when no checkpoint loads: the refusal of the first file
    tried (a refused file stays a refusal), else NoResumableCheckpoint;
    both name every file tried."""
    tried = ', '.join(p for p, _ in skipped)
    first = skipped[0][1]
    if isinstance(first, RefusedCheckpointError):
        return RefusedCheckpointError(
            f'{first} (resume: no checkpoint in {work_dir} loads; tried '
            f'{tried})')
    listed = '; '.join(f'{p} ({_why(err)})' for p, err in skipped)
    return NoResumableCheckpoint(
        f'resume: no checkpoint in {work_dir} loads: {listed}')


def _candidates(work_dir: str, named: Optional[str]) -> List[str]:
    """The named checkpoint first, then the numbered ones not named."""
    numbered = numbered_checkpoints(work_dir)
    if named is None:
        return numbered
    same = {osp.realpath(named)} if named else set()
    return [named] + [p for p in numbered if osp.realpath(p) not in same]


def find_resumable_checkpoint(
        work_dir: str,
        logger: Union[str, logging.Logger] = 'current') -> Optional[str]:
    """The checkpoint to resume ``work_dir``'s run from.

    The file ``last_checkpoint`` names if it loads, else the newest
    numbered checkpoint that does; None if the work dir has neither
    ``last_checkpoint`` nor a numbered checkpoint (a fresh run). The
    temporary files a cut left during a write are deleted first
    (:func:`.atomic_write.remove_partial_writes`). Skipped files are named
    in one warning to ``logger`` (mmengine's ``print_log``).

    Raises:
        RefusedCheckpointError: the first file tried is refused by the
            loader and no other loads (its refusal, naming every file).
        NoResumableCheckpoint: there are checkpoints and none loads (each
            is named with why).
    """
    removed = remove_partial_writes(work_dir)
    if removed:
        print_log(f'resume: deleted {len(removed)} partial write(s) left '
                  f'by a cut: {", ".join(removed)}', logger=logger)
    named = read_last_checkpoint(work_dir)
    skipped: List[Tuple[str, Exception]] = []
    found = None
    for path in _candidates(work_dir, named):
        problem = _load_problem(path)
        if problem is None:
            found = path
            break
        skipped.append((path or LAST_CHECKPOINT, problem))
    if skipped and found is None:
        raise _nothing_loads(work_dir, skipped)
    if skipped:
        listed = '; '.join(f'{p} ({_why(err)})' for p, err in skipped)
        print_log(f'resume: skipped {len(skipped)} checkpoint(s) that do '
                  f'not load: {listed}; resuming from {found}',
                  logger=logger, level=logging.WARNING)
    return found
