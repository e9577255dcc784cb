"""Checkpoints are loaded as data: torch's ``weights_only`` unpickler, with
exactly the types mmengine checkpoints hold allowed.

A checkpoint is a pickle, and a pickle can name any callable to run while it
loads; ``load_from`` is often a URL of a model zoo. ``torch.load`` with
``weights_only=True`` (torch's default since 2.6, which mmengine 0.10.7's
``torch.load(filename, map_location=...)`` calls inherit) rebuilds tensors,
containers and plain values only and refuses every other type. mmengine's
own checkpoints hold a few more, all data:

* ``meta.message_hub``: the logged scalars as mmengine ``HistoryBuffer``
  objects (numpy arrays inside);
* numpy arrays, scalars and their dtypes (logged values, ``meta`` entries
  such as ``seed``-derived values and dataset metadata).

:func:`allow_mmengine_checkpoints` puts those types on torch's allow-list
(``torch.serialization.add_safe_globals``); importing :mod:`mmseg_gf.engine`
calls it, so plain mmseg / mmengine checkpoints and this project's load with
``weights_only=True`` through mmseg's own tools too. A checkpoint holding
any other type fails; :func:`explain_refused_checkpoints` turns torch's
error into one that names the type and the opt-in that trusts it
(:func:`trust_checkpoint_types`, the tools' ``--trust-checkpoint-type``).
"""
import contextlib
import importlib
import pickle
import re
from typing import Iterator, List, Sequence

import numpy as np
import torch
from mmengine.logging import HistoryBuffer

__all__ = [
    'mmengine_checkpoint_types', 'allow_mmengine_checkpoints',
    'trust_checkpoint_types', 'explain_refused_checkpoints',
    'RefusedCheckpointError'
]

#: The opt-in named in errors (tools/train.py and tools/test.py).
TRUST_FLAG = '--trust-checkpoint-type'


class RefusedCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds a type that is not allowed to load."""


def _numpy_globals() -> List:
    """numpy's array, scalar and dtype constructors, under the names both
    numpy 1 (``numpy.core``) and numpy 2 (``numpy._core``) pickle them."""
    multiarray = importlib.import_module(
        'numpy._core.multiarray' if hasattr(np, '_core') else
        'numpy.core.multiarray')
    out: List = [np.ndarray, np.dtype]
    for name in ('_reconstruct', 'scalar'):
        func = getattr(multiarray, name)
        out += [func, (func, f'numpy.core.multiarray.{name}'),
                (func, f'numpy._core.multiarray.{name}')]
    dtypes = getattr(np, 'dtypes', None)
    if dtypes is not None:  # numpy >= 1.25: one class per dtype
        out += [getattr(dtypes, n) for n in dir(dtypes)
                if n.endswith('DType') and isinstance(getattr(dtypes, n),
                                                      type)]
    return out


def _history_buffer_attribute(obj, name: str):
    """``getattr`` restricted to what a pickled HistoryBuffer names.

    A HistoryBuffer pickles its ``statistics_methods`` (``min``, ``max``,
    ``current``, ``mean`` and any registered one) as ``getattr(HistoryBuffer,
    name)``; allowing Python's ``getattr`` itself would let a checkpoint reach
    any attribute of any allowed object, so the pickled ``getattr`` resolves
    to this function, which answers only for HistoryBuffer's functions.
    """
    value = getattr(obj, name, None) if obj is HistoryBuffer else None
    if not callable(value) or name.startswith('_'):
        raise pickle.UnpicklingError(
            f'checkpoint refused: getattr({obj!r}, {name!r}) is not a '
            'HistoryBuffer statistics method')
    return value


def mmengine_checkpoint_types() -> List:
    """What :func:`allow_mmengine_checkpoints` allows (see the module
    docstring), in ``add_safe_globals``'s format."""
    return [HistoryBuffer,
            (_history_buffer_attribute, 'builtins.getattr'),
            (_history_buffer_attribute, '__builtin__.getattr'),
            ] + _numpy_globals()


def allow_mmengine_checkpoints() -> None:
    """Allow mmengine checkpoints' own types under ``weights_only=True``.

    Idempotent. ``torch.load`` stays safe: only these data types are added.
    """
    torch.serialization.add_safe_globals(mmengine_checkpoint_types())


def _resolve(name: str):
    module, _, attr = name.rpartition('.')
    if not module:
        raise ValueError(f'{TRUST_FLAG} {name!r}: give the full dotted '
                         'name, e.g. mypackage.module.ClassName')
    try:
        obj = importlib.import_module(module)
        for part in attr.split('.'):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise ValueError(
            f'{TRUST_FLAG} {name!r}: no such importable name (allowed: the '
            'dotted name of a class or function, as a refused checkpoint '
            'names it)') from None
    return obj


def trust_checkpoint_types(names: Sequence[str]) -> None:
    """Allow the given types (dotted names) in checkpoints, explicitly.

    Unpickling one of them runs its construction code: use it only for a
    checkpoint whose origin you trust, and only for the types its refusal
    named.

    Raises:
        ValueError: a name that does not import.
    """
    objs = [(_resolve(n), n) for n in names]
    torch.serialization.add_safe_globals(objs)


_GLOBAL = re.compile(r'GLOBAL ([\w.]+)')


@contextlib.contextmanager
def explain_refused_checkpoints() -> Iterator[None]:
    """Re-raise torch's ``weights_only`` refusal as a
    :class:`RefusedCheckpointError` naming the type and the opt-in."""
    try:
        yield
    except pickle.UnpicklingError as err:
        if isinstance(err, RefusedCheckpointError) or \
                'weights_only' not in str(err).lower():
            raise
        found = _GLOBAL.search(str(err))
        name = found.group(1) if found else '(a type torch did not name)'
        raise RefusedCheckpointError(
            f'checkpoint refused: it holds {name}, which is not among the '
            'data types a checkpoint is allowed to hold (tensors, '
            'containers, plain values, numpy arrays and mmengine\'s '
            'HistoryBuffer); loading it could run code. If you trust the '
            f'file, allow that type explicitly: {TRUST_FLAG} {name} '
            '(tools/train.py, tools/test.py) or '
            'mmseg_gf.engine.safe_load.trust_checkpoint_types'
            f'([{name!r}])') from err
