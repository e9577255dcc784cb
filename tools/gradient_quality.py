"""How close are the filtered gradients to the exact ones? Per layer.

For a config with a ``gradient_filter`` setting (+ an optional checkpoint)
and one batch, every filtered conv is examined (paper Section 4.1, 5.6):
its local quality (SNR, paper Eq. 8, and cosine of the filtered ``g~_y``,
``g~_x``, ``g~_W`` against the exact ones; Proposition 1,
``SNR(g~_x) >= SNR(g~_y)``) and its end-to-end weight-gradient error; see
:mod:`mmseg_gf.analysis.model_quality`.

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
import os.path as osp
from typing import Any, Dict, List, Optional

from mmengine.config import Config, DictAction

import mmseg_gf  # noqa: F401  (registers GFConv2d, GradFilterModel, ...)
from mmseg_gf.analysis.model_quality import (jsonable_rows,
                                             measure_config_quality,
                                             quality_table)
from mmseg_gf.engine.tool_args import write_json


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
        'data/protocol_synthetic/voc/VOCdevkit/VOC2012)')
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


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    if args.data_root:
        from mmseg_gf.protocol.run_config import set_data
        set_data(cfg, data_root=args.data_root)
    if cfg.get('gradient_filter') is None:
        raise SystemExit(
            f'{args.config} has no gradient_filter setting; add one, e.g. '
            '--cfg-options gradient_filter.num_layers=5 '
            'gradient_filter.radius=4')
    rows, input_shape = measure_config_quality(
        cfg, args.checkpoint, args.source, args.shape, args.batch,
        args.label_block, args.seed, args.upstream, args.device)
    holds = [r['proposition1_holds'] for r in rows
             if 'proposition1_holds' in r]
    print(f'config: {args.config}; batch {tuple(input_shape)} '
          f'({args.source}); upstream {args.upstream}')
    print(quality_table(rows))
    print(f'Proposition 1 (SNR g~_x >= SNR g~_y) holds on {sum(holds)} of '
          f'{len(holds)} layers')
    out = dict(config=args.config, checkpoint=args.checkpoint,
               source=args.source, input_shape=input_shape,
               upstream=args.upstream, rows=jsonable_rows(rows))
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == '__main__':
    main()
