"""Outputs of the plugin's autograd Functions that a caller may modify in
place.

Autograd refuses an in-place change of a view returned by a custom
``Function``, and plain operations return such views routinely (mmcv's
``FFN`` runs an in-place ReLU on ``F.linear``'s output). A view of a
tensor made inside the forward becomes a tensor of its own without a copy
(:func:`owned_output`); a view of an input cannot, and raises
:class:`AliasedOutputError` so that the module runs its plain forward
(:func:`mmseg_gf.models.lean.lean_or_plain`).
"""
import torch
from torch import Tensor

__all__ = ['AliasedOutputError', 'owned_output']


class AliasedOutputError(RuntimeError):
    """A Function's output is a view of one of its inputs."""


def _root(t: Tensor) -> Tensor:
    return t if t._base is None else t._base


def owned_output(out: Tensor, *inputs) -> Tensor:
    """``out`` as a tensor autograd lets its caller modify in place.

    Args:
        out: what the Function's forward computed.
        inputs: the forward's tensor inputs (others are ignored).

    Returns:
        ``out`` when it is not a view (or under ``torch.compile``), else the
        same memory as a non-view (``aten._unsafe_view``, no copy).

    Raises:
        AliasedOutputError: ``out`` is a view of one of ``inputs``.
    """
    if torch.compiler.is_compiling() or out._base is None:
        return out
    base = out._base
    for t in inputs:
        if isinstance(t, Tensor) and _root(t) is base:
            raise AliasedOutputError(
                f'its output ({tuple(out.shape)}) is a view of its input '
                f'({tuple(t.shape)})')
    return torch.ops.aten._unsafe_view(out, out.shape)
