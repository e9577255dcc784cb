"""The checkpoint a resumed run starts from: the newest one that loads.

mmengine resumes from whatever ``last_checkpoint`` names, so a truncated or
refused file ends the resume although an older one may be good; here the
named file is tried first, then ``iter_<N>.pth`` / ``epoch_<N>.pth``
newest first, skipped files named in one warning.
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
    """What ``<work_dir>/last_checkpoint`` names, or None without the file."""
    path = osp.join(work_dir, LAST_CHECKPOINT)
    if not osp.isfile(path):
        return None
    with open(path, encoding='utf-8', errors='replace') as f:
        return f.read().strip()


def numbered_checkpoints(work_dir: str) -> List[str]:
    """The work dir's ``iter_<N>.pth`` / ``epoch_<N>.pth``, largest ``N``
    first."""
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
    """The error when no checkpoint loads, naming every file tried."""
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
    """The checkpoint to resume ``work_dir``'s run from; None for a fresh run.

    Partial writes a cut left are deleted first; skipped files are named in
    one warning to ``logger``.

    Raises:
        RefusedCheckpointError: the first file tried is refused and no other
            loads.
        NoResumableCheckpoint: there are checkpoints and none loads.
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
