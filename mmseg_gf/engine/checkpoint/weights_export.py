"""Weights files that plain mmseg loads: tensors and plain Python data only.

A Runner checkpoint holds objects torch >= 2.6 refuses by default, so
:func:`export_weights` writes only ``state_dict`` and plain ``meta`` and
checks the file against torch's own allow-list (docs/checkpoints.md).
"""
import collections
import re
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .pickle_scan import checkpoint_pickle, names_in_pickle
from .safe_load import load_checkpoint_file, trust_checkpoint_types

__all__ = ['export_weights', 'plain_data']

_META_KEYS = ('cfg', 'epoch', 'iter')


def plain_data(value: Any) -> Any:
    """``value`` as plain Python data (numpy values become numbers and lists).

    Raises:
        TypeError: a value of another type (named).
    """
    import numpy as np
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    for base in (int, float, str, bytes):  # a subclass: as its base
        if isinstance(value, base):
            return base(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(plain_data(v) for v in value)
    if isinstance(value, dict):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    raise TypeError(f'{type(value).__module__}.{type(value).__qualname__}')


def _state_dict(checkpoint: Any, filename: str) -> 'collections.OrderedDict':
    state = checkpoint.get('state_dict', checkpoint) \
        if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not state or not all(
            isinstance(v, torch.Tensor) for v in state.values()):
        keys = sorted(map(str, checkpoint))[:8] \
            if isinstance(checkpoint, dict) else []
        raise ValueError(
            f'{filename!r} holds no state dict (expected a dict of tensors, '
            "or a dict with one under 'state_dict'; got "
            f'{type(checkpoint).__name__} with keys {keys})')
    for key, value in state.items():
        _check_dense(key, value, filename)
    out = collections.OrderedDict(
        (re.sub(r'^module\.', '', k), v.detach().cpu().clone())
        for k, v in state.items())
    metadata = getattr(state, '_metadata', None)
    if isinstance(metadata, dict):
        try:
            out._metadata = {
                re.sub(r'^module(\.|$)', '', str(k)): plain_data(v)
                for k, v in metadata.items()}
        except (TypeError, RecursionError):
            pass  # torch then loads every module as its current version
    return out


def _check_dense(key: Any, value: torch.Tensor, filename: str) -> None:
    """A state-dict entry plain mmseg can load: a dense tensor of data."""
    problem = None
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        problem = f'a {type(value).__qualname__}'
    elif value.layout != torch.strided:
        problem = f'a {value.layout} tensor'
    elif value.is_quantized:
        problem = 'a quantized tensor'
    elif value.is_meta:
        problem = 'a meta tensor (no data)'
    if problem is not None:
        raise ValueError(
            f'{filename!r}: state_dict[{str(key)[:100]!r}] is {problem}; '
            'exported weights hold dense tensors only (allowed: strided '
            'tensors with data, as a model\'s state_dict holds)')


def _meta(checkpoint: Any) -> Tuple[Dict[str, Any], List[str]]:
    """The exported ``meta`` and the source entries left out."""
    import mmengine
    import mmseg
    source = checkpoint.get('meta', {}) if isinstance(checkpoint, dict) \
        else {}
    source = source if isinstance(source, dict) else {}
    meta: Dict[str, Any] = {}
    left_out: List[str] = []
    dataset_meta = source.get('dataset_meta')
    if isinstance(dataset_meta, dict):
        meta['dataset_meta'] = {}
        for key, value in dataset_meta.items():
            try:
                meta['dataset_meta'][key] = plain_data(value)
            except (TypeError, RecursionError):
                left_out.append(f'dataset_meta.{key}')
    for key in _META_KEYS:
        if key in source:
            try:
                meta[key] = plain_data(source[key])
            except (TypeError, RecursionError):
                left_out.append(key)
    # str(): torch.__version__ is a TorchVersion, a str subclass torch's
    # allow-list does not name.
    meta.update(mmseg_version=str(mmseg.__version__),
                mmengine_version=str(mmengine.__version__),
                torch_version=str(torch.__version__))
    return meta, left_out


def _check_loads_without_plugin(filename: str) -> None:
    """The written file uses torch's own allow-list only."""
    from torch._weights_only_unpickler import _get_allowed_globals
    data = checkpoint_pickle(filename)
    extra = sorted(set(names_in_pickle(data or b'')) -
                   set(_get_allowed_globals()))
    if data is None or extra:
        raise RuntimeError(f'{filename!r} would need more than torch\'s '
                           f'weights_only allow-list: {extra}')


def export_weights(checkpoint: str, out: str,
                   trust: Sequence[str] = ()) -> Dict[str, Any]:
    """Write ``checkpoint``'s weights and plain metadata to ``out``.

    Args:
        checkpoint: a checkpoint file (a Runner's or a bare state dict), read
            as data.
        out: the file to write.
        trust: names to trust in ``checkpoint`` (``--trust-checkpoint-type``).

    Returns:
        A summary: ``keys`` (number of tensors), ``meta`` (the keys written),
        ``left_out`` (meta entries that were not plain data).

    Raises:
        RefusedCheckpointError: ``checkpoint`` holds what is not allowed.
        ValueError: no state dict of tensors, or one that is not dense.
    """
    trust_checkpoint_types(list(trust))
    source = load_checkpoint_file(checkpoint, map_location='cpu')
    state = _state_dict(source, checkpoint)
    meta, left_out = _meta(source)
    torch.save({'meta': meta, 'state_dict': state}, out)
    _check_loads_without_plugin(out)
    return dict(keys=len(state), meta=sorted(meta), left_out=left_out)
