"""Kept bytes and step time with the classifier fused with its loss, or not.

Example (the figures of docs/lean_region.md)::

    python tools/benchmark_fused_loss.py \
        "$(python -c 'import mmseg, os; print(os.path.dirname(mmseg.__file__))')/.mim/configs/segformer/segformer_mit-b0_8xb2-160k_ade20k-512x512.py" \
        --size 128 128 --batch 2 --num-layers 5 --repeats 30

One process, one batch, three copies of the config's segmentor (SyncBN
reverted to BN, no pretrained weights, GF last N at r = 4): ``lean=False``,
lean with every head's classifier kept out of its loss
(:func:`~mmseg_gf.models.lean_head.disable_classifier_fusion`), and lean
with it fused. Prints what each step keeps for backward (autograd's saved
tensors, and the analytic count) and the median and minimum time of a
training forward + backward, the three interleaved.
"""
import argparse
import copy
import statistics
import time

import torch
from mmengine.config import Config
from mmengine.model import revert_sync_batchnorm

import mmseg_gf  # noqa: F401  (registers GFConv2d)
from mmseg_gf.accounting.batch import random_batch, training_loss
from mmseg_gf.accounting.measured import saved_tensor_bytes
from mmseg_gf.accounting.saved_bytes import trace_step_saved_bytes
from mmseg_gf.engine import apply_gradient_filter, select_layers
from mmseg_gf.models.lean import is_lean, lean_kind
from mmseg_gf.models.lean_head import disable_classifier_fusion

MIB = 2**20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('config')
    parser.add_argument('--size', type=int, nargs=2, default=[128, 128])
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--num-layers', type=int, default=5)
    parser.add_argument('--repeats', type=int, default=10)
    parser.add_argument('--threads', type=int, default=1)
    return parser.parse_args(argv)


def build(config: str, size) -> torch.nn.Module:
    """The config's segmentor, untrained, with plain BN."""
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    model_cfg = Config.fromfile(config).model
    model_cfg.pop('pretrained', None)
    model_cfg.backbone.init_cfg = None
    model_cfg.data_preprocessor.size = tuple(size)
    torch.manual_seed(0)
    return revert_sync_batchnorm(MODELS.build(model_cfg))


def variants(base, size, num_layers):
    """``lean=False``, lean unfused, lean fused: name -> segmentor."""
    out = {}
    for name, lean, fused in (('lean=False', False, False),
                              ('lean, unfused', True, False),
                              ('lean, fused', True, True)):
        model = copy.deepcopy(base)
        choices = select_layers(model, num_layers=num_layers, radius=4,
                                input_size=size)
        apply_gradient_filter(model, choices, mode='gf', lean=lean)
        for module in model.modules():
            if not fused and is_lean(module) and lean_kind(module) == 'loss':
                disable_classifier_fusion(module, 'benchmark: unfused')
        out[name] = model
    return out


def kept_line(name, model, batch, size) -> str:
    kept = saved_tensor_bytes(lambda: training_loss(model, *batch))
    line = f'{name:14s} kept {kept / MIB:8.3f} MiB'
    if name != 'lean=False':
        counted = trace_step_saved_bytes(model, size)
        parts = ', '.join(f'{k} {v / MIB:.3f}' for k, v in
                          counted.by_category(len(batch[1])).items())
        line += (f' (analytic {counted.total(len(batch[1])) / MIB:.3f} '
                 f'MiB: {parts})')
    return line


def step_times(models, batch, repeats):
    """Seconds per forward + backward, each model in turn, ``repeats``
    rounds after one warm-up round."""
    times = {name: [] for name in models}
    for rep in range(repeats + 1):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            training_loss(model, *batch).backward()
            if rep:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    size = tuple(args.size)
    base = build(args.config, size)
    models = variants(base, size, args.num_layers)
    batch = random_batch(base, size, args.batch, label_block=4)
    for name, model in models.items():
        print(kept_line(name, model, batch, size), flush=True)
    times = step_times(models, batch, args.repeats)
    for name, ts in times.items():
        print(f'{name:14s} forward + backward: median '
              f'{statistics.median(ts) * 1e3:.1f} ms, min '
              f'{min(ts) * 1e3:.1f} ms ({len(ts)} steps)')
    return times


if __name__ == '__main__':
    main()
