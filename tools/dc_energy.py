"""DC-energy ratio (paper Eq. 13, Table 5) of a model's conv kernels.

Example::

    python tools/dc_energy.py configs/gf/pspnet_r18_voc_r4.py \
        --checkpoint checkpoints/pspnet_r18-d8_cityscapes.pth

A ratio above 1 means the kernel's DC component dominates its spectrum, the
assumption behind Proposition 1. Random initial weights give about 1; the
paper reports 1.2-2.3 for trained Torchvision models.
"""
import argparse

from mmengine.config import Config, DictAction
from mmengine.registry import init_default_scope
from mmengine.runner import load_checkpoint

import mmseg_gf  # noqa: F401  (registers GFConv2d)
from mmseg_gf.models.layer_kinds import layer_kernels
from mmseg_gf.models.gradient_quality import model_dc_energy_ratio


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('config')
    parser.add_argument('--checkpoint', default=None)
    parser.add_argument('--per-layer', action='store_true',
                        help='print every layer, not only the mean')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    return parser.parse_args()


def main():
    args = parse_args()
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    init_default_scope(cfg.get('default_scope', 'mmseg'))
    from mmseg.registry import MODELS
    model = MODELS.build(cfg.model)
    if args.checkpoint:
        load_checkpoint(model, args.checkpoint, map_location='cpu')
    else:
        model.init_weights()
    ratios = model_dc_energy_ratio(layer_kernels(model))
    mean = ratios.pop('mean')
    if args.per_layer:
        for name, value in ratios.items():
            print(f'{name:60s} {value:8.3f}')
    print(f'DC energy ratio, mean over {len(ratios)} conv layers '
          f'(k > 1): {mean:.3f}')


if __name__ == '__main__':
    main()
