"""Checkpoints are loaded as data: torch's ``weights_only`` unpickler.

mmengine checkpoints' own types (``HistoryBuffer``, numpy values) pass
through the checking stand-ins of :mod:`.data`; anything else is refused,
naming the ``--trust-checkpoint-type`` value for a trusted file
(docs/checkpoints.md).
"""
import builtins
import contextlib
import importlib
import pickle
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from mmengine.logging import HistoryBuffer

from .data import (ALLOWED_NAMES, HISTORY_BUFFER_NAME,
                              HISTORY_STATISTICS, TRUST_FLAG, TRUSTED_NESTED,
                              CheckedArray, CheckedDtype,
                              CheckedHistoryBuffer, ParentName,
                              RefusedCheckpointError, checked_getattr,
                              importable_name, make_rebuild_array,
                              make_rebuild_scalar, rebuild_dtype, refusal)
from .load_bounds import check_cost, scan_checkpoint

__all__ = [
    'mmengine_checkpoint_types', 'allow_mmengine_checkpoints',
    'trust_checkpoint_types', 'explain_refused_checkpoints',
    'check_checkpoint_types', 'check_checkpoint_file', 'load_checkpoint_file',
    'RefusedCheckpointError', 'TRUST_FLAG'
]

_NUMPY_MODULES = ('numpy._core.multiarray', 'numpy.core.multiarray')
#: numpy's pickling names (trusted together: see trust_checkpoint_types).
_NUMPY_NAMES = frozenset(['numpy.dtype', 'numpy.ndarray'] + [
    f'{m}.{f}' for m in _NUMPY_MODULES for f in ('_reconstruct', 'scalar')])
#: Modules torch never loads from, allow-listed or not.
_BLOCKED_MODULES = ('sys', 'os', 'posix', 'nt')
#: Names that run code, read files or import whatever their argument names:
#: no trust flag is suggested for, or accepts, them or anything in these
#: modules (a trusted name is called with the file's arguments).
_RUNS_CODE_MODULES = _BLOCKED_MODULES + (
    'subprocess', 'shutil', 'importlib', 'runpy', 'pickle', '_pickle',
    'marshal', 'ctypes', 'code', 'codeop', 'pty', 'socket', 'pdb', 'bdb',
    'multiprocessing', 'webbrowser', 'pydoc', 'dill', 'cloudpickle',
    'joblib', 'timeit', 'profile', 'cProfile', 'trace', 'threading',
    '_thread', 'signal', 'operator', 'functools', 'io', '_io',
    'pathlib', 'tempfile', 'zipimport', 'pkgutil', 'inspect')
_RUNS_CODE_NAMES = frozenset(
    [f'builtins.{n}' for n in (
        'exec', 'eval', 'compile', '__import__', 'open', 'input',
        'breakpoint', 'setattr', 'delattr', 'globals', 'locals', 'vars',
        'exit', 'quit', 'help', 'memoryview', '__build_class__')]
    + ['torch.load', 'torch.jit.load', 'torch.hub.load', 'torch.package',
       'numpy.load', 'numpy.loads', 'numpy.fromfile', 'numpy.memmap',
       'torch.serialization.load', 'torch.from_file'])


def _qualified_name(cls: type) -> str:
    """The name torch's ``weights_only`` unpickler knows ``cls`` by."""
    return f'{cls.__module__}.{cls.__qualname__}'


def _stand_ins() -> Dict[str, Any]:
    """Name in a checkpoint -> the checking stand-in it resolves to."""
    out: Dict[str, Any] = {
        HISTORY_BUFFER_NAME: CheckedHistoryBuffer,
        'builtins.getattr': checked_getattr,
        'numpy.dtype': rebuild_dtype,
        'numpy.ndarray': CheckedArray,
        # BUILD hands a state only to allow-listed types: the holders
        # rebuild_dtype / _reconstruct return. Their constructors refuse
        # every call from a file.
        _qualified_name(CheckedDtype): CheckedDtype,
        _qualified_name(CheckedArray): CheckedArray,
    }
    for module in _NUMPY_MODULES:
        out[f'{module}._reconstruct'] = make_rebuild_array(
            f'{module}._reconstruct')
        out[f'{module}.scalar'] = make_rebuild_scalar(f'{module}.scalar')
    return out


_STAND_INS = _stand_ins()
for _name, _obj in _STAND_INS.items():
    ALLOWED_NAMES.setdefault(id(_obj), _name)


def mmengine_checkpoint_types() -> List:
    """What :func:`allow_mmengine_checkpoints` allows, for
    ``add_safe_globals``."""
    return [(obj, name) for name, obj in _STAND_INS.items()]


def _entry_name(entry) -> str:
    """The name an allow-list entry answers to (torch's rule)."""
    if isinstance(entry, tuple):
        return entry[1]
    return (f'{getattr(entry, "__module__", None)}.'
            f'{getattr(entry, "__qualname__", None)}')


def _set_allowed(names_to_drop: Sequence[str], add: List) -> None:
    """Remove the allow-list's entries for ``names_to_drop``, then add."""
    drop = set(names_to_drop)
    kept = [e for e in torch.serialization.get_safe_globals()
            if _entry_name(e) not in drop]
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(kept + add)


def allow_mmengine_checkpoints() -> None:
    """Allow mmengine checkpoints' own types under ``weights_only=True``.

    Idempotent; also registers HistoryBuffer's default statistics so that
    restored buffers answer ``statistics('mean')``.
    """
    HistoryBuffer()
    present = {_entry_name(e) for e in torch.serialization.get_safe_globals()}
    torch.serialization.add_safe_globals(
        [e for e in mmengine_checkpoint_types() if e[1] not in present])


def runs_code(name: str) -> bool:
    """Whether ``name`` runs code, reads files or imports by its arguments."""
    parts = name.split('.')
    return parts[0] in _RUNS_CODE_MODULES or any(
        '.'.join(parts[:i]) in _RUNS_CODE_NAMES
        for i in range(2, len(parts) + 1))


def _resolve(name: str):
    """The object a dotted name imports to (nested classes included)."""
    if not isinstance(name, str) or '.' not in name.strip('.'):
        raise ValueError(
            f'{TRUST_FLAG} {name!r}: give the full dotted name as a refused '
            'checkpoint names it, e.g. mypackage.module.ClassName or '
            'builtins.slice')
    parts = name.split('.')
    if parts[0] in _BLOCKED_MODULES:
        raise ValueError(f'{TRUST_FLAG} {name!r}: torch never loads names '
                         f'from the modules {", ".join(_BLOCKED_MODULES)}')
    if runs_code(name):
        raise ValueError(
            f'{TRUST_FLAG} {name!r}: it runs code, reads files or imports '
            'what its arguments name, and a trusted name is called with the '
            "file's arguments; allowed: the data classes a refusal names")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            break
        return obj, '.'.join(parts[:i])
    raise ValueError(
        f'{TRUST_FLAG} {name!r}: no such importable name (allowed: the '
        'dotted name of a class or function, as a refused checkpoint '
        'names it)')


def trust_checkpoint_types(names: Sequence[str]) -> None:
    """Allow the given dotted names (as a refusal prints them) in checkpoints.

    Unpickling one runs its own code: only for a trusted file.

    Raises:
        ValueError: a name that does not import.
    """
    add: List = []
    for name in names:
        if name in _NUMPY_NAMES:
            add += _numpy_own()
            continue
        obj, module = _resolve(name)
        add.append((obj, name))
        ALLOWED_NAMES[id(obj)] = name
        qualname = name[len(module) + 1:]
        if '.' in qualname:  # nested: pickled as getattr(parent, 'attr')
            TRUSTED_NESTED[name] = obj
            # The pickle's GLOBAL names the outermost class; getattr walks
            # down from it (checked_getattr answers for trusted paths).
            top = f'{module}.{qualname.split(".")[0]}'
            present = {_entry_name(e)
                       for e in torch.serialization.get_safe_globals()}
            present.update(_entry_name(e) for e in add)
            if top not in present:
                add.append((ParentName(top), top))
    _set_allowed([e[1] for e in add if isinstance(e, tuple)], add)


def _numpy_own() -> List:
    """numpy's own objects under its pickling names, and its dtype classes."""
    multiarray = importlib.import_module(_NUMPY_MODULES[0] if hasattr(
        np, '_core') else _NUMPY_MODULES[1])
    own: List = [(np.dtype, 'numpy.dtype'), (np.ndarray, 'numpy.ndarray')]
    for module in _NUMPY_MODULES:
        for func in ('_reconstruct', 'scalar'):
            own.append((getattr(multiarray, func), f'{module}.{func}'))
    dtypes = getattr(np, 'dtypes', None)
    if dtypes is not None:  # numpy >= 1.25: one class per dtype
        own += [getattr(dtypes, n) for n in dir(dtypes)
                if n.endswith('DType')]
    for obj, name in own[:2 + 2 * len(_NUMPY_MODULES)]:
        ALLOWED_NAMES[id(obj)] = name
    return own


def _allowed_names() -> set:
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
        defaults = set(_get_allowed_globals())
    except ImportError:  # pragma: no cover (torch < 2.4)
        defaults = set()
    user = {_entry_name(e) for e in torch.serialization.get_safe_globals()}
    nested = {f'{HISTORY_BUFFER_NAME}.{s}' for s in HISTORY_STATISTICS}
    return defaults | user | nested | set(TRUSTED_NESTED)


def refused_names(filename: str) -> Optional[List[str]]:
    """A file's refused names in order of first use; None if not a torch
    format."""
    scanned = scan_checkpoint(filename)
    if scanned is None:
        return None
    allowed = _allowed_names()
    return [n for n in scanned[0].names if n not in allowed]


#: Names a refusal lists at most (a crafted file can hold thousands).
MAX_NAMES_SHOWN = 20


def _names_refusal(names: List[str]) -> RefusedCheckpointError:
    """The error naming refused names and the flag values that trust them."""
    more = len(names) - MAX_NAMES_SHOWN
    names = names[:MAX_NAMES_SHOWN]
    trustable = [n for n in names if importable_name(n) is not None and
                 not runs_code(n)]
    flags = ' '.join(f'{TRUST_FLAG} {n}' for n in trustable)
    shown = ', '.join(names) + (f' and {more} more names' if more > 0
                                else '')
    text = (f'checkpoint refused: it holds {shown}, which '
            f'{"is" if len(names) == 1 else "are"} not among the data types '
            'a checkpoint is allowed to hold (tensors, containers, plain '
            'values, numpy arrays / scalars / dtypes of plain kinds and '
            'mmengine\'s HistoryBuffer); loading it could run code.')
    if trustable:
        them = 'it' if len(names) == 1 else 'them'
        text += (f' If you trust the file, allow {them} explicitly: '
                 f'{flags} (tools/train.py, tools/test.py) or '
                 'mmseg_gf.engine.checkpoint.safe_load.trust_checkpoint_types'
                 f'({trustable!r})')
    trusted = set(trustable)
    untrusted = [n for n in names if n not in trusted]
    if untrusted:
        text += (f' No trust flag allows {", ".join(untrusted)} (no such '
                 'name, or one that runs code, reads files or imports what '
                 'its arguments name)')
    return RefusedCheckpointError(text)


def check_checkpoint_types(filename: str) -> None:
    """Refuse a checkpoint file that uses names not allowed, naming all of
    them.

    Raises:
        RefusedCheckpointError: the file uses names that are not allowed.
    """
    names = refused_names(filename)
    if names:
        raise _names_refusal(names)


def check_checkpoint_file(filename: str) -> None:
    """Check a file's names and declared costs before anything is built.

    Raises:
        RefusedCheckpointError: naming the names, or what costs how much.
    """
    scanned = scan_checkpoint(filename)
    if scanned is None:
        return
    scan, infos = scanned
    allowed = _allowed_names()
    names = [n for n in scan.names if n not in allowed]
    if names:
        raise _names_refusal(names)
    check_cost(filename, scan, infos)


_OUR_REFUSAL = re.compile(r'checkpoint refused: [^\n]*')
_TORCH_GLOBAL = re.compile(r'GLOBAL (\S+) was not an allowed global')


def _torch_name(name: str) -> str:
    """A name as torch's error prints it -> as the flag takes it."""
    if '.' not in name and hasattr(builtins, name):
        return f'builtins.{name}'
    return name


@contextlib.contextmanager
def explain_refused_checkpoints(
        filename: Optional[str] = None) -> Iterator[None]:
    """Re-raise a ``weights_only`` refusal as a
    :class:`RefusedCheckpointError`.

    Args:
        filename: the checkpoint loaded inside the block, if known, to name
            all its refused names.
    """
    try:
        yield
    except RefusedCheckpointError:
        raise
    except Exception as err:  # noqa: B902 (re-raised unless a refusal)
        message = str(err)
        if not (isinstance(err, pickle.UnpicklingError)
                and 'weights only' in message.lower().replace('_', ' ')):
            raise
        ours = _OUR_REFUSAL.search(message)
        if ours:
            raise RefusedCheckpointError(ours.group(0)) from err
        names = refused_names(filename) if filename else None
        if not names:
            found = _TORCH_GLOBAL.search(message)
            names = [_torch_name(found.group(1))] if found else None
        if names:
            raise _names_refusal(names) from err
        reason = message.rsplit('WeightsUnpickler error:', 1)[-1].strip()
        reason = reason.splitlines()[0] if reason else message[:200]
        raise refusal(
            f"a pickle torch's weights_only unpickler refuses ({reason})",
            'it is not a checkpoint of tensors and plain data') from err


def load_checkpoint_file(filename: str, map_location: Any = 'cpu') -> Any:
    """A local checkpoint file's content, loaded as data.

    Checks the file first, then ``torch.load(weights_only=True)`` with sparse
    tensors' invariants checked.

    Raises:
        OSError: the file cannot be read.
        RefusedCheckpointError: the file holds what is not allowed, or is
            not a readable checkpoint.
    """
    check_checkpoint_file(filename)
    with explain_refused_checkpoints(filename):
        try:
            with torch.sparse.check_sparse_tensor_invariants(enable=True):
                return torch.load(filename, map_location=map_location,
                                  weights_only=True)
        except (OSError, pickle.UnpicklingError):
            raise
        except MemoryError:
            raise refusal('more than fits in memory', 'it is not a '
                          'checkpoint of tensors and plain data') from None
        except Exception as err:  # noqa: B902 (any other: a damaged pickle)
            raise refusal(
                f'a pickle torch cannot rebuild ({type(err).__name__}: '
                f'{str(err)[:200]})', 'it is not a checkpoint of tensors '
                'and plain data') from err
