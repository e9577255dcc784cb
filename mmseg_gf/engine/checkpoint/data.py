"""The non-torch data of mmengine checkpoints, rebuilt by checking stand-ins.

Allow-listing numpy's and mmengine's own classes would hand a crafted file
their unchecked ``__setstate__``; so a checkpoint's names resolve to these
stand-ins, each accepting exactly what numpy or mmengine write
(docs/reliability.md#checkpoints-are-data). Every refusal is a
:class:`RefusedCheckpointError` naming the ``--trust-checkpoint-type``
value that would hand the name back to its own code.
"""
import importlib
import pickle
import re
import reprlib
import sys
from typing import Any, Callable, Dict, Optional

import numpy as np
from mmengine.logging import HistoryBuffer

__all__ = [
    'RefusedCheckpointError', 'refusal', 'TRUST_FLAG', 'CheckedDtype',
    'CheckedArray', 'CheckedHistoryBuffer', 'rebuild_dtype',
    'make_rebuild_array', 'make_rebuild_scalar', 'checked_getattr',
    'HISTORY_BUFFER_NAME', 'HISTORY_STATISTICS', 'PLAIN_DTYPE_KINDS',
    'ParentName'
]

#: The opt-in named in errors (tools/train.py and tools/test.py).
TRUST_FLAG = '--trust-checkpoint-type'

#: The name mmengine's HistoryBuffer is pickled under.
HISTORY_BUFFER_NAME = 'mmengine.logging.history_buffer.HistoryBuffer'

#: numpy dtype kinds a checkpoint may hold: bool, signed and unsigned
#: integer, float, complex, bytes, str.
PLAIN_DTYPE_KINDS = 'biufcSU'

_DTYPE_SPEC = re.compile(r'[biufcSU][0-9]{1,6}\Z')
#: HistoryBuffer's default statistics, as its pickles name them.
HISTORY_STATISTICS = ('min', 'max', 'current', 'mean')
_HISTORY_KEYS = ('max_length', '_log_history', '_count_history',
                 'statistics_methods')
_MULTIARRAY = importlib.import_module(
    'numpy._core.multiarray' if hasattr(np, '_core') else
    'numpy.core.multiarray')
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


class RefusedCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds a type or value that is not allowed to load."""


def refusal(holds: str, why: str,
            trust: Optional[str] = None) -> RefusedCheckpointError:
    """The one-line error for a refused checkpoint.

    Args:
        holds: what the file holds, as a user can recognise it.
        why: why it is refused.
        trust: the ``--trust-checkpoint-type`` value; None: no value does.
    """
    text = f'checkpoint refused: it holds {holds}: {why}.'
    if trust is None:
        return RefusedCheckpointError(
            text + ' No trust flag loads it: the file is not what '
            'torch.save writes for data (crafted or damaged)')
    return RefusedCheckpointError(
        text + ' If you trust the file, run that name\'s own code '
        f'explicitly: {TRUST_FLAG} {trust} (tools/train.py, tools/test.py) '
        'or mmseg_gf.engine.checkpoint.safe_load.trust_checkpoint_types'
        f'([{trust!r}])')


def _show(value: Any) -> str:
    return _REPR.repr(value)


def _is_int(value: Any) -> bool:
    return type(value) is int


# ----------------------------------------------------------------- dtypes


def _plain_dtype_problem(dtype: np.dtype) -> Optional[str]:
    """Why a numpy dtype is not a plain one, or None."""
    if dtype.kind not in PLAIN_DTYPE_KINDS:
        return (f'a {dtype.kind!r} dtype (allowed kinds: '
                f'{", ".join(PLAIN_DTYPE_KINDS)})')
    if dtype.fields is not None or dtype.subdtype is not None:
        return 'a structured or subarray dtype'
    if dtype.hasobject or dtype.itemsize == 0:
        return 'an object or unsized dtype'
    reference = np.dtype(dtype.str)
    if dtype.flags != reference.flags or \
            dtype.itemsize != reference.itemsize or \
            dtype.alignment != reference.alignment:
        return 'a dtype whose flags, size or alignment were set by hand'
    return None


class CheckedDtype:
    """A numpy dtype read from a checkpoint: a plain kind and the state numpy
    writes.

    torch's unpickler hands the pickled state to what ``numpy.dtype(...)``
    returned, so this holder's ``__setstate__`` accepts only the state of
    ``spec``; it compares, hashes and pickles as the plain dtype.
    """

    __slots__ = ('dtype', '_state_set')

    def __new__(cls, *args, **kwargs):
        raise refusal(f'{cls.__qualname__}{_show(args)}',
                      'the plugin builds this holder itself only')

    @classmethod
    def _of(cls, dtype: np.dtype) -> 'CheckedDtype':
        checked = object.__new__(cls)
        checked.dtype = dtype
        checked._state_set = False
        return checked

    def __setstate__(self, state: Any) -> None:
        holds = f'numpy.dtype({self.dtype.str!r}) with state {_show(state)}'
        if self._state_set:
            raise refusal(holds, 'a dtype whose state is set twice')
        if type(state) is not tuple or not all(
                v is None or type(v) in (int, str) for v in state):
            raise refusal(holds, 'not the state numpy writes for a dtype',
                          'numpy.dtype')
        candidates = [self.dtype] + [
            self.dtype.newbyteorder(order) for order in '<>'
            if self.dtype.byteorder != '|'
        ]
        for candidate in candidates:
            if candidate.__reduce__()[2] == state:
                self.dtype = candidate
                self._state_set = True
                return
        raise refusal(
            holds, 'not the state numpy writes for this dtype (a byte '
            'order only: no fields, subarray, flags or sizes set by hand)',
            'numpy.dtype')

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, CheckedDtype):
            other = other.dtype
        return self.dtype == other

    def __hash__(self) -> int:
        return hash(self.dtype)

    def __repr__(self) -> str:
        return f'CheckedDtype({self.dtype!r})'

    def __reduce__(self):
        return self.dtype.__reduce__()


def rebuild_dtype(spec: Any = None, align: Any = False,
                  copy: Any = True) -> CheckedDtype:
    """``numpy.dtype(spec, align, copy)`` for a plain dtype only."""
    holds = f'numpy.dtype{_show((spec, align, copy))}'
    if type(spec) is not str or not _DTYPE_SPEC.match(spec) or \
            align is not False or copy is not True:
        raise refusal(
            holds, 'not a plain numpy dtype (allowed: kinds '
            f'{", ".join(PLAIN_DTYPE_KINDS)} with a size, as numpy pickles '
            "them, e.g. ('f8', False, True))", 'numpy.dtype')
    try:
        dtype = np.dtype(spec)
    except TypeError:
        raise refusal(holds, 'no such numpy dtype', 'numpy.dtype') from None
    problem = _plain_dtype_problem(dtype)
    if problem is not None or dtype.kind != spec[0]:
        raise refusal(holds, problem or 'a dtype of another kind',
                      'numpy.dtype')
    return CheckedDtype._of(dtype)


def _checked_dtype(dtype: Any, holds: str, trust: str) -> np.dtype:
    """The numpy dtype behind a :class:`CheckedDtype`, checked."""
    if isinstance(dtype, CheckedDtype):
        return dtype.dtype
    if isinstance(dtype, np.dtype):
        problem = _plain_dtype_problem(dtype)
        if problem is None:
            return dtype
        raise refusal(holds, problem, trust)
    raise refusal(holds, f'a dtype argument of type {type(dtype).__name__}',
                  trust)


def _check_data(dtype: np.dtype, data: Any, count: int, holds: str,
                trust: str) -> None:
    """``data`` holds exactly ``count`` values of ``dtype`` (bools 0/1)."""
    if type(data) is not bytes or len(data) != count * dtype.itemsize:
        raise refusal(
            holds, f'{count} values of {dtype} need {count * dtype.itemsize}'
            f' bytes, the file gives {_show(data)}', trust)
    if dtype.kind == 'b' and data.strip(b'\x00\x01'):
        raise refusal(holds, 'bool bytes other than 0 and 1', trust)


# ------------------------------------------------------------------ arrays


class CheckedArray(np.ndarray):
    """A numpy array read from a checkpoint: a checked dtype and exactly its
    bytes.

    Its ``__setstate__`` checks the state before numpy's runs; it pickles as
    a plain ``ndarray``.
    """

    def __new__(cls, *args, **kwargs):
        raise refusal(f'numpy.ndarray{_show(args)}',
                      'an array made from constructor arguments (numpy '
                      'pickles arrays by _reconstruct and their state)',
                      'numpy.ndarray')

    def __setstate__(self, state: Any) -> None:
        holds = f'a numpy array with state {_show(state)}'
        if getattr(self, '_state_set', False):
            raise refusal(holds, 'an array whose state is set twice')
        if type(state) is tuple and len(state) == 5 and \
                _is_int(state[0]) and state[0] == 1:
            state = state[1:]
        if type(state) is not tuple or len(state) != 4:
            raise refusal(holds, 'not the state numpy writes for an array',
                          'numpy.ndarray')
        shape, dtype, fortran, data = state
        if type(shape) is not tuple or len(shape) > 32 or not all(
                _is_int(n) and n >= 0 for n in shape):
            raise refusal(holds, f'the shape {_show(shape)}',
                          'numpy.ndarray')
        if type(fortran) is not bool:
            raise refusal(holds, 'a memory order that is not a bool',
                          'numpy.ndarray')
        dtype = _checked_dtype(dtype, holds, 'numpy.ndarray')
        _check_data(dtype, data, int(np.prod(shape, dtype=object)), holds,
                    'numpy.ndarray')
        np.ndarray.__setstate__(self, (1, shape, dtype, fortran, data))
        self._state_set = True

    def __reduce__(self):
        return self.view(np.ndarray).__reduce__()

    def __reduce_ex__(self, protocol):
        return self.view(np.ndarray).__reduce_ex__(protocol)


def make_rebuild_array(name: str) -> Callable:
    """numpy's ``_reconstruct`` under ``name``: only the empty array."""

    def rebuild_array(subtype: Any = None, shape: Any = None,
                      typecode: Any = None) -> np.ndarray:
        if (subtype is CheckedArray or subtype is np.ndarray) and \
                type(shape) is tuple and len(shape) == 1 and \
                _is_int(shape[0]) and shape[0] == 0 and \
                type(typecode) is bytes and typecode == b'b':
            # ``CheckedArray.__new__`` refuses calls from a file;
            # ``np.ndarray.__new__`` builds the empty array directly. A
            # trusted ``numpy.ndarray`` gets numpy's own array.
            return np.ndarray.__new__(subtype, (0, ), 'b')
        raise refusal(f'{name}{_show((subtype, shape, typecode))}',
                      "not numpy's pickled array (numpy.ndarray, (0,), "
                      "b'b')", name)

    rebuild_array.__qualname__ = rebuild_array.__name__ = f'checked {name}'
    return rebuild_array


def make_rebuild_scalar(name: str) -> Callable:
    """numpy's ``scalar`` under ``name``: a checked dtype from exactly its
    bytes."""
    scalar = _MULTIARRAY.scalar

    def rebuild_scalar(dtype: Any = None, data: Any = None) -> np.generic:
        holds = f'{name}{_show((dtype, data))}'
        checked = _checked_dtype(dtype, holds, name)
        _check_data(checked, data, 1, holds, name)
        return scalar(checked, data)

    rebuild_scalar.__qualname__ = rebuild_scalar.__name__ = f'checked {name}'
    return rebuild_scalar


# ---------------------------------------------------------- HistoryBuffer


def _history_values(value: Any, key: str, holds: str) -> np.ndarray:
    """A plain 1-D numeric copy of a HistoryBuffer's logged values."""
    if not isinstance(value, np.ndarray) or value.ndim != 1 or \
            value.dtype.kind not in 'biuf':
        raise refusal(holds, f'{key} is not a 1-D numeric numpy array',
                      HISTORY_BUFFER_NAME)
    return np.array(value, dtype=value.dtype, copy=True, subok=False)


class CheckedHistoryBuffer(HistoryBuffer):
    """mmengine's ``HistoryBuffer`` restored from its checked data only.

    It drops the pickled ``statistics_methods``, which mmengine's own
    ``__setstate__`` would copy into the class-wide table.
    """

    def __new__(cls, *args, **kwargs):
        if args or kwargs:
            raise refusal(f'{HISTORY_BUFFER_NAME}{_show(args)}',
                          'a HistoryBuffer made from arguments (mmengine '
                          'pickles it as an empty object and its state)',
                          HISTORY_BUFFER_NAME)
        buffer = object.__new__(cls)
        buffer.__dict__.update(max_length=1000000,
                               _log_history=np.array([]),
                               _count_history=np.array([]))
        return buffer

    def __init__(self, *args, **kwargs):
        raise refusal(f'{HISTORY_BUFFER_NAME}{_show(args)}',
                      'a HistoryBuffer made from arguments (mmengine '
                      'pickles it as an empty object and its state)',
                      HISTORY_BUFFER_NAME)

    def __setstate__(self, state: Any) -> None:
        holds = f'a HistoryBuffer with state {_show(state)}'
        if type(state) is not dict or not all(
                type(k) is str for k in state):
            raise refusal(holds, 'its state is not a dict of names',
                          HISTORY_BUFFER_NAME)
        unknown = sorted(set(state) - set(_HISTORY_KEYS))
        missing = [k for k in _HISTORY_KEYS[:3] if k not in state]
        if unknown or missing:
            raise refusal(
                holds, f'keys {unknown} unknown, {missing} missing (allowed:'
                f' {", ".join(_HISTORY_KEYS)})', HISTORY_BUFFER_NAME)
        log = _history_values(state['_log_history'], '_log_history', holds)
        count = _history_values(state['_count_history'], '_count_history',
                                holds)
        max_length = state['max_length']
        if len(log) != len(count) or not _is_int(max_length) or \
                max_length < 1:
            raise refusal(holds, 'values and counts of different lengths or '
                          'a max_length that is not a positive int',
                          HISTORY_BUFFER_NAME)
        methods = state.get('statistics_methods', {})
        if type(methods) is not dict or not all(
                type(k) is str for k in methods):
            raise refusal(holds, 'statistics_methods is not a dict of '
                          'names', HISTORY_BUFFER_NAME)
        self.__dict__.clear()
        self.__dict__.update(max_length=max_length,
                             _log_history=log,
                             _count_history=count)
        self.__class__ = HistoryBuffer


# ----------------------------------------------------------------- getattr


class ParentName:
    """The parent of a trusted nested class: usable only as ``getattr``'s first
    argument."""

    __slots__ = ('path', )

    def __init__(self, path: str):
        self.path = path

    def __call__(self, *args, **kwargs):
        raise refusal(self.path, 'a class trusted only as the parent of a '
                      'nested class', self.path)

    def __repr__(self) -> str:
        return f'ParentName({self.path!r})'


#: Nested names a user trusted (``trust_checkpoint_types``): dotted name ->
#: the object.
TRUSTED_NESTED: Dict[str, Any] = {}

#: ``id(object) -> the name a checkpoint reaches it by``, for the objects
#: the allow-list maps names to (:mod:`.safe_load` fills it).
ALLOWED_NAMES: Dict[int, str] = {}


def importable_name(path: str) -> Optional[str]:
    """``path`` if it may name something (without importing), else None."""
    parts = path.split('.')
    for i in range(len(parts) - 1, 0, -1):
        module = sys.modules.get('.'.join(parts[:i]))
        if module is None:
            continue
        obj = module
        for part in parts[i:]:
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return path
    return path if len(parts) > 1 else None


def _path_of(obj: Any) -> str:
    if isinstance(obj, ParentName):
        return obj.path
    if obj is CheckedHistoryBuffer or obj is HistoryBuffer:
        return HISTORY_BUFFER_NAME
    if id(obj) in ALLOWED_NAMES:
        return ALLOWED_NAMES[id(obj)]
    if isinstance(obj, type) or callable(obj) and hasattr(obj, '__qualname__'):
        return f'{getattr(obj, "__module__", "?")}.{obj.__qualname__}'
    return f'(a {type(obj).__name__})'


def checked_getattr(obj: Any, name: Any) -> Any:
    """``getattr`` as a checkpoint may use it.

    HistoryBuffer's pickled statistics resolve to their names; a trusted
    nested class to itself; everything else is refused.
    """
    if type(name) is not str:
        raise refusal(f'getattr{_show((obj, name))}',
                      'an attribute that is not a name')
    if obj is CheckedHistoryBuffer and name in HISTORY_STATISTICS:
        return f'HistoryBuffer.{name}'
    if obj is HistoryBuffer and name in HISTORY_STATISTICS:
        return getattr(HistoryBuffer, name)  # HistoryBuffer itself trusted
    path = f'{_path_of(obj)}.{name}'
    if path in TRUSTED_NESTED:
        return TRUSTED_NESTED[path]
    if any(p.startswith(path + '.') for p in TRUSTED_NESTED):
        return ParentName(path)
    if path.startswith('('):
        raise refusal(f'getattr{_show((obj, name))}',
                      'an attribute of a value')
    return _refuse_attribute(path)


def _refuse_attribute(path: str):
    raise refusal(path, 'an attribute the allowed types do not include '
                  '(a nested class or a function reached through getattr)',
                  importable_name(path))
