"""Outputs of the plugin's autograd Functions that a caller may modify in place.

Autograd refuses an in-place operation on a view returned by a custom
``Function`` (``Output 0 of ... is a view and is being modified inplace``):
its view bookkeeping would replace the Function's backward. Plain
operations return such views routinely: ``F.linear`` on a 3-D input with a
bias computes a 2-D ``addmm`` and returns a view of it, and mmcv's ``FFN``
then runs an in-place ReLU on that output (K-Net's kernel update head).

:func:`owned_output` gives such an output back as a tensor of its own
where that is exact: a view of a tensor made inside the forward (nobody else
holds it) becomes a non-view over the same memory, no copy. A view of one
of the Function's inputs cannot: writing into it would change that input
behind autograd's back. That case raises :class:`AliasedOutputError`, and
the module that applied the Function runs its plain forward instead
(:func:`mmseg_gf.models.lean.lean_or_plain`, one logged line).
"""
import torch
from torch import Tensor

__all__ = ['AliasedOutputError', 'owned_output']


class AliasedOutputError(RuntimeError):
    """A Function's output is a view of one of its inputs: it cannot be
    given to its caller as a tensor of its own."""


def _root(t: Tensor) -> Tensor:
    return t if t._base is None else t._base


def owned_output(out: Tensor, *inputs) -> Tensor:
    """``out`` as a tensor autograd lets its caller modify in place.

    Args:
        out: what the Function's forward computed.
        inputs: the forward's tensor inputs (others are ignored).

    Returns:
        ``out`` itself when it is not a view; else the same memory, shape
        and strides as a tensor that is not a view
        (``aten._unsafe_view``, no copy). Under ``torch.compile``, ``out``
        itself: the compiled graph functionalizes in-place operations.

    Raises:
        AliasedOutputError: ``out`` is a view of one of ``inputs`` (or of
            their common base).
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
