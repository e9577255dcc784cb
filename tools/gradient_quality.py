"""How close are the filtered gradients to the exact ones? Per layer.

For a config with a ``gradient_filter`` setting (+ an optional checkpoint)
and one batch, every filtered conv is examined (paper Section 4.1, 5.6):

* local quality (``mmseg_gf.analysis.quality.layer_gradient_quality``, in
  float64): with the layer's input ``x`` and the gradient ``g_y`` arriving at
  its output, the SNR (paper Eq. 8, ``sum t^2 / sum (t - a)^2``) and the
  cosine of the filtered ``g~_y``, ``g~_x`` (the operator's Eq. 3 input
  gradient, and the "propagated" one of Proposition 1: ``g~_y`` through the
  exact backward) and ``g~_W`` against the exact ones, and whether
  Proposition 1 (``SNR(g~_x) >= SNR(g~_y)``) holds for the layer;
* end to end: the weight gradient the layer gets in a backward where every
  chosen layer is filtered, against the one of a fully exact backward (same
  batch, same dropout masks): the error training actually sees, upstream
  filtering included.

``--upstream exact`` (default) takes ``x`` and ``g_y`` from the exact
backward, ``filtered`` from the filtered one (what the GradientQualityHook
sees during training).

Examples::

    python tools/gradient_quality.py configs/gf/pspnet_r18_voc_r4.py \
        --checkpoint \
        work_dirs/pspnet_r18-d8_calib_1xb8-1k_voc12aug-512x512/iter_1000.pth \
        --shape 512
    python tools/gradient_quality.py configs/gf/upernet_r18_gf-ref10_1xb8-20k_voc12aug-512x512.py \
        --source dataset --data-root data/VOCdevkit/VOC2012 \
        --out work_dirs/quality/upernet.json
"""
import argparse
import copy
import math
import os.path as osp
from typing import Any, Dict, List, Optional, Tuple

import torch
from mmengine.config import Config, DictAction
from torch import nn

import mmseg_gf  # noqa: F401  (registers GFConv2d, GradFilterModel, ...)
from mmseg_gf.analysis.model_cost import (build_segmentor, random_batch,
                                          training_loss)
from mmseg_gf.analysis.quality import (capture_layer_io, cosine,
                                       layer_gradient_quality, snr)
from mmseg_gf.engine.cli import (markdown_table, trust_mmengine_checkpoints,
                                 write_json)
from mmseg_gf.engine.surgery import get_gradient_filter_layers

trust_mmengine_checkpoints()  # before any checkpoint is read


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Per-layer SNR / cosine of the filtered gradients vs '
        'the exact ones')
    parser.add_argument('config', help='config with a gradient_filter '
                        'setting')
    parser.add_argument('--checkpoint', default=None,
                        help='weights to load (default: initialisation)')
    parser.add_argument(
        '--source', choices=['random', 'dataset'], default='random',
        help='random images and region-like random labels of --shape '
        '(default), or the first --batch samples of the config\'s '
        'train dataset through its pipeline')
    parser.add_argument(
        '--data-root', default=None,
        help='--source dataset: move the config\'s datasets here (e.g. '
        'data/pipeline_synthetic/voc/VOCdevkit/VOC2012)')
    parser.add_argument('--shape', type=int, nargs='+', default=[512, 512],
                        help='H [W] of the random batch (default 512 512)')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--label-block', type=int, default=16,
                        help='random labels are constant on squares of this '
                        'many pixels (default 16)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--upstream', choices=['exact', 'filtered'],
                        default='exact',
                        help='where x and g_y of each layer come from')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--out', help='write the rows to this json file')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override some settings in the used config, the key-value '
        'pair in xxx=yyy format will be merged into config file.')
    args = parser.parse_args(argv)
    if not osp.isfile(args.config):
        parser.error(f'config: file {args.config!r} does not exist')
    if len(args.shape) == 1:
        args.shape = args.shape * 2
    if len(args.shape) != 2 or min(args.shape) < 1:
        parser.error('--shape: H [W], positive')
    if args.batch < 1:
        parser.error('--batch must be >= 1')
    return args


def dataset_batch(cfg: Config, model: nn.Module, batch: int, device):
    """The first ``batch`` samples of the train dataset, preprocessed."""
    from mmengine.dataset import pseudo_collate
    from mmseg.registry import DATASETS
    dataset = DATASETS.build(cfg.train_dataloader.dataset)
    data = pseudo_collate([dataset[i] for i in range(batch)])
    model.to(device)
    data = model.data_preprocessor(data, training=True)
    return data['inputs'], data['data_samples']


def _set_enabled(convs: List[Tuple[str, nn.Module]], enabled: bool) -> None:
    for _, conv in convs:
        conv.enabled = enabled


def _backward(model, inputs, samples, convs, seed, record: bool):
    """One forward + backward; the chosen convs' weight grads and, if
    ``record``, their ``(x, g_y)``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in every pass
    records: Dict[str, Any] = {}
    if record:
        with capture_layer_io(convs) as records:
            training_loss(model, inputs, samples).backward()
    else:
        training_loss(model, inputs, samples).backward()
    grads = {name: conv.weight.grad.detach().clone()
             for name, conv in convs if conv.weight.grad is not None}
    return grads, dict(records)


def measure(model: nn.Module, inputs, samples, upstream: str = 'exact',
            seed: int = 0) -> List[Dict[str, Any]]:
    """Per filtered layer: local and end-to-end quality (see module doc)."""
    choices = get_gradient_filter_layers(model)
    if not choices:
        raise ValueError('the model has no gradient-filtered layers; give '
                         'a config with a gradient_filter setting')
    convs = [(c.path, c.module) for c in choices]
    was = {name: conv.enabled for name, conv in convs}
    try:
        _set_enabled(convs, False)
        exact_w, exact_io = _backward(model, inputs, samples, convs, seed,
                                      record=upstream == 'exact')
        _set_enabled(convs, True)
        gf_w, gf_io = _backward(model, inputs, samples, convs, seed,
                                record=upstream == 'filtered')
    finally:
        for name, conv in convs:
            conv.enabled = was[name]
        model.zero_grad(set_to_none=True)
    records = exact_io if upstream == 'exact' else gf_io
    rows = []
    for choice in choices:
        name, conv = choice.path, choice.module
        x, grad_out = records.get(name, (None, None))
        row: Dict[str, Any] = dict(path=name, radius=choice.radius)
        if x is not None and grad_out is not None:
            conv64 = copy.deepcopy(conv).double()
            q = layer_gradient_quality(conv64, x.double(), grad_out.double(),
                                       choice.radius)
            row.update(vars(q))
            row['proposition1_holds'] = q.proposition1_holds
        if name in exact_w and name in gf_w:
            row['e2e_snr_grad_weight'] = snr(exact_w[name], gf_w[name])
            row['e2e_cos_grad_weight'] = cosine(exact_w[name], gf_w[name])
        rows.append(row)
    return rows


def _fmt(v) -> str:
    if v is None:
        return '-'
    if isinstance(v, bool):
        return 'yes' if v else 'no'
    if isinstance(v, float):
        if math.isinf(v):
            return 'inf'
        if math.isnan(v):
            return 'nan'
        return f'{v:.4g}'
    return str(v)


COLUMNS = (
    ('path', 'layer'), ('radius', 'r'), ('snr_grad_output', 'SNR g_y'),
    ('snr_grad_input_propagated', 'SNR g_x (Prop. 1)'),
    ('snr_grad_input', 'SNR g_x (GF)'), ('snr_grad_weight', 'SNR g_W'),
    ('cos_grad_output', 'cos g_y'), ('cos_grad_input', 'cos g_x'),
    ('cos_grad_weight', 'cos g_W'),
    ('proposition1_holds', 'Prop. 1 holds'),
    ('e2e_snr_grad_weight', 'SNR g_W e2e'),
    ('e2e_cos_grad_weight', 'cos g_W e2e'))


def markdown(rows: List[Dict[str, Any]]) -> str:
    return markdown_table([label for _, label in COLUMNS],
                          [[_fmt(row.get(key)) for key, _ in COLUMNS]
                           for row in rows])


def _jsonable(v):
    if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
        return str(v)  # 'inf' / 'nan': json has no infinity
    return v


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    if args.data_root:
        from mmseg_gf.pipeline.experiments import set_data
        set_data(cfg, data_root=args.data_root)
    if cfg.get('gradient_filter') is None:
        raise SystemExit(
            f'{args.config} has no gradient_filter setting; add one, e.g. '
            '--cfg-options gradient_filter.num_layers=5 '
            'gradient_filter.radius=4')
    shape = tuple(args.shape)
    torch.manual_seed(args.seed)
    model = build_segmentor(
        cfg, input_size=shape if args.source == 'random' else None)
    if args.checkpoint:
        from mmengine.runner import load_checkpoint
        load_checkpoint(model, args.checkpoint, map_location='cpu')
    model.to(args.device)
    if args.source == 'dataset':
        inputs, samples = dataset_batch(cfg, model, args.batch, args.device)
    else:
        inputs, samples = random_batch(model, shape, args.batch,
                                       args.device, seed=args.seed,
                                       label_block=args.label_block)
    rows = measure(model, inputs, samples, args.upstream, args.seed)
    holds = [r['proposition1_holds'] for r in rows
             if 'proposition1_holds' in r]
    print(f'config: {args.config}; batch {tuple(inputs.shape)} '
          f'({args.source}); upstream {args.upstream}')
    print(markdown(rows))
    print(f'Proposition 1 (SNR g~_x >= SNR g~_y) holds on {sum(holds)} of '
          f'{len(holds)} layers')
    out = dict(config=args.config, checkpoint=args.checkpoint,
               source=args.source, input_shape=list(inputs.shape),
               upstream=args.upstream,
               rows=[{k: _jsonable(v) for k, v in r.items()} for r in rows])
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == '__main__':
    main()
