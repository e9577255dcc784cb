"""Where a GELU may keep only the patch means of its derivative, decided
from the autograd graph of one traced training step.

The rule is exact where the GELU's input is a filtered layer's output and
every consumer of its output is a filtered layer with the same patches
(docs/gradient_filter.md#elementwise-ops-between-filtered-layers);
elsewhere the GELU stays plain. The trace restores training flags,
buffers and random generators, and runs after the selection.
"""
import contextlib
import warnings
from typing import Dict, List

import torch
from torch import nn

from ..accounting.batch import model_device, random_batch, training_loss
from ..models.lean import make_plain
from ..models.patch_mean_gelu import make_patch_mean_gelu
from ..models.patch_mean_graph import (LayerCall, filtered_users,
                                       graph_consumers, is_counted_partition,
                                       is_filtered_layer, is_plain_gelu)
from ..models.segmentor import unwrap_model
from ..ops.linear.patch_mean_activation import PatchPartition, tagged_partition
from ..patching import Hooks
from .frozen_aux_heads import unlogged_aux_heads

__all__ = ['find_patch_mean_gelus', 'install_patch_mean_gelus']


def _plain_gelus(model: nn.Module) -> Dict[str, nn.Module]:
    return {path: m for path, m in model.named_modules()
            if is_plain_gelu(m)}


@contextlib.contextmanager
def _restored(model: nn.Module):
    """Training flags, buffers and generators restored after the block; no aux
    head logged."""
    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    device = model_device(model)
    devices = [device] if device.type == 'cuda' else []
    try:
        with torch.random.fork_rng(devices=devices), \
                unlogged_aux_heads(model):
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _traced_step_graph(model: nn.Module, input_size):
    """The consumers of every node of one training step's graph (two
    images)."""
    param = next((p for p in model.parameters()
                  if p.dtype.is_floating_point), None)
    inputs, samples = random_batch(model, input_size, 2,
                                   device=model_device(model))
    if param is not None:
        inputs = inputs.to(param.dtype)
    return graph_consumers([training_loss(model, inputs, samples).grad_fn])


def find_patch_mean_gelus(model: nn.Module, input_size
                          ) -> Dict[str, PatchPartition]:
    """The GELUs (by path) where the patch-mean rule is exact, with their
    partitions.

    Args:
        model: a gradient-filtered segmentor (wrapped or not).
        input_size: ``(H, W)`` of the traced batch (the training crop).
    """
    model = unwrap_model(model)
    gelus = _plain_gelus(model)
    filtered = [m for m in model.modules()
                if is_filtered_layer(m) and m.enabled]
    if not gelus or not filtered:
        return {}
    for module in gelus.values():  # traced as autograd's GELU
        make_plain(module)
    calls: Dict[str, List[tuple]] = {path: [] for path in gelus}
    consumers: Dict[object, LayerCall] = {}

    def on_gelu(path):
        def hook(module, args, out):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and out.grad_fn is not None:
                calls[path].append((tagged_partition(x), out.grad_fn))
            else:
                calls[path].append((None, None))
        return hook

    def on_filtered(module, args, out):
        x = args[0] if args else None
        if (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)
                and out.grad_fn is not None
                and tagged_partition(out) is not None):
            consumers[out.grad_fn] = LayerCall(x.grad_fn,
                                               module.input_partition(x))

    hooks = Hooks(m.register_forward_hook(on_gelu(p))
                  for p, m in gelus.items())
    hooks.extend(m.register_forward_hook(on_filtered) for m in filtered)
    try:
        with hooks.removed_after(), _restored(model), torch.enable_grad():
            graph = _traced_step_graph(model, input_size)
    except Exception as error:  # noqa: BLE001 - the rule is an option
        warnings.warn(
            'gradient_filter: the training step traced to find GELUs '
            f'between filtered layers failed ({type(error).__name__}: '
            f'{error}); every GELU keeps its input '
            '(patch_mean_activations has no effect)')
        return {}
    found = {}
    for path, records in calls.items():
        partitions = {part for part, _ in records}
        if not records or len(partitions) != 1 or None in partitions:
            continue
        part = partitions.pop()
        if not is_counted_partition(part):
            continue  # images first only (what the accounting counts)
        if all(_only_filtered_consumers(node, part, graph, consumers)
               for _, node in records):
            found[path] = part
    return found


def _only_filtered_consumers(node, part: PatchPartition, graph,
                             consumers: Dict[object, LayerCall]) -> bool:
    users = filtered_users(node, graph, consumers)
    return users is not None and all(u.partition == part for u in users)


def install_patch_mean_gelus(model: nn.Module,
                             input_size) -> Dict[str, PatchPartition]:
    """Make the GELUs :func:`find_patch_mean_gelus` finds keep patch means;
    path -> partition."""
    model = unwrap_model(model)
    found = find_patch_mean_gelus(model, input_size)
    for path, partition in found.items():
        make_patch_mean_gelu(model.get_submodule(path), partition)
    return found

