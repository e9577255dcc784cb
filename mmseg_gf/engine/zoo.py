"""mmseg's own config zoo as a user brings it: where it is installed, the
real-time families the benchmarks and tests run, and :func:`make_offline`,
which lets a zoo config build and train in one process without downloads.
"""
import os.path as osp
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import mmseg
from mmengine.config import Config

__all__ = ['ZooFamily', 'REALTIME_FAMILIES', 'TRANSFORMER_FAMILIES',
           'ZOO_FAMILIES', 'mmseg_config_dir',
           'family_config', 'make_offline', 'offline_model_config']


def mmseg_config_dir() -> str:
    """The ``configs`` directory mmseg installs under its ``.mim``."""
    return osp.join(osp.dirname(mmseg.__file__), '.mim', 'configs')


@dataclass(frozen=True)
class ZooFamily:
    """One model family of mmseg's zoo, by one of its configs.

    Attributes:
        config: path relative to :func:`mmseg_config_dir`.
        crop: the config's training crop ``(H, W)``.
        min_crop: the smallest square side the model runs at.
        why: the reason for ``min_crop`` (empty when it is 32).
    """

    label: str
    config: str
    crop: Tuple[int, int]
    min_crop: int = 32
    why: str = ''

    @property
    def path(self) -> str:
        """The config file's absolute path."""
        return osp.join(mmseg_config_dir(), self.config)


#: The real-time segmentors of mmseg 1.2.2's zoo by short name
#: (``tools/benchmark_step.py --families``).
REALTIME_FAMILIES: Dict[str, ZooFamily] = {
    'segformer_b0': ZooFamily(
        'Segformer-B0',
        'segformer/segformer_mit-b0_8xb2-160k_ade20k-512x512.py',
        (512, 512)),
    'lraspp_mv3': ZooFamily(
        'MobileNetV3-LRASPP',
        'mobilenet_v3/mobilenet-v3-d8_lraspp_4xb4-320k_cityscapes-512x1024.py',
        (512, 1024), min_crop=392,
        why="LRASPPHead's fixed 49x49 average pool on the 1/8 map"),
    'bisenetv1_r18': ZooFamily(
        'BiSeNetV1-R18',
        'bisenetv1/bisenetv1_r18-d32_4xb4-160k_cityscapes-1024x1024.py',
        (1024, 1024)),
    'bisenetv2': ZooFamily(
        'BiSeNetV2', 'bisenetv2/bisenetv2_fcn_4xb4-160k_cityscapes-1024x1024.py',
        (1024, 1024)),
    'stdc1': ZooFamily('STDC1', 'stdc/stdc1_4xb12-80k_cityscapes-512x1024.py',
                       (512, 1024)),
    'pidnet_s': ZooFamily(
        'PIDNet-S', 'pidnet/pidnet-s_2xb6-120k_1024x1024-cityscapes.py',
        (1024, 1024)),
    'fast_scnn': ZooFamily(
        'Fast-SCNN', 'fastscnn/fast_scnn_8xb4-160k_cityscapes-512x1024.py',
        (512, 1024)),
    'cgnet': ZooFamily('CGNet',
                       'cgnet/cgnet_fcn_4xb4-60k_cityscapes-680x680.py',
                       (680, 680)),
    'erfnet': ZooFamily('ERFNet',
                        'erfnet/erfnet_fcn_4xb4-160k_cityscapes-512x1024.py',
                        (512, 1024)),
    'ddrnet_23_slim': ZooFamily(
        'DDRNet-23-slim', 'ddrnet/ddrnet_23-slim_in1k-pre_2xb6-120k_'
        'cityscapes-1024x1024.py', (1024, 1024)),
    'segnext_t': ZooFamily(
        'SegNeXt-T',
        'segnext/segnext_mscan-t_1xb16-adamw-160k_ade20k-512x512.py',
        (512, 512)),
    'icnet_r18': ZooFamily(
        'ICNet-R18', 'icnet/icnet_r18-d8_4xb2-80k_cityscapes-832x832.py',
        (832, 832)),
}


#: Transformer segmentors of mmseg 1.2.2's zoo beside Segformer-B0 (one of
#: the real-time families): their blocks' attention, LayerNorm, GELU and
#: DropPath are the lean region's transformer kinds
#: (``tools/benchmark_step.py --families``).
TRANSFORMER_FAMILIES: Dict[str, ZooFamily] = {
    'segformer_b2': ZooFamily(
        'Segformer-B2',
        'segformer/segformer_mit-b2_8xb2-160k_ade20k-512x512.py',
        (512, 512)),
    'twins_pcpvt_s': ZooFamily(
        'Twins-PCPVT-S UPerNet',
        'twins/twins_pcpvt-s_uperhead_8xb4-160k_ade20k-512x512.py',
        (512, 512)),
    'swin_t': ZooFamily(
        'Swin-T UPerNet',
        'swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_'
        'ade20k-512x512.py', (512, 512)),
    'deit_s': ZooFamily(
        'DeiT-S UPerNet',
        'vit/vit_deit-s16_upernet_8xb2-80k_ade20k-512x512.py', (512, 512)),
    'segmenter_vit_t': ZooFamily(
        'Segmenter ViT-T',
        'segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py',
        (512, 512)),
}

#: Every family by short name: :data:`REALTIME_FAMILIES` and
#: :data:`TRANSFORMER_FAMILIES`.
ZOO_FAMILIES: Dict[str, ZooFamily] = {**REALTIME_FAMILIES,
                                      **TRANSFORMER_FAMILIES}


def family_config(name: str) -> Config:
    """The zoo config of a :data:`ZOO_FAMILIES` entry, unchanged.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in ZOO_FAMILIES:
        raise ValueError(f'unknown family {name!r}; one of '
                         f'{sorted(ZOO_FAMILIES)}')
    return Config.fromfile(ZOO_FAMILIES[name].path)


def _walk_dicts(obj: Any, fn) -> None:
    """Apply ``fn`` to every dict of a nested config, innermost first."""
    if isinstance(obj, dict):
        for value in obj.values():
            _walk_dicts(value, fn)
        fn(obj)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _walk_dicts(value, fn)


def _offline_module(d: dict) -> None:
    """One module config: plain BN, no checkpoint to load."""
    if d.get('type') == 'SyncBN':
        d['type'] = 'BN'
    init = d.get('init_cfg')
    inits = init if isinstance(init, (list, tuple)) else [init]
    if any(isinstance(i, dict) and (i.get('type') == 'Pretrained'
                                    or 'checkpoint' in i) for i in inits):
        d['init_cfg'] = None
    if isinstance(d.get('pretrained'), str):
        d['pretrained'] = None


def offline_model_config(model_cfg: dict) -> dict:
    """A zoo ``model`` config that trains in one process without downloads, in
    place.

    SyncBN becomes BN and every pretrained checkpoint is dropped (random
    init); the layers and heads are the zoo's.
    """
    _walk_dicts(model_cfg, _offline_module)
    return model_cfg


def make_offline(cfg: Config) -> Config:
    """:func:`offline_model_config` on ``cfg.model``, in place."""
    model = cfg.model.to_dict() if hasattr(cfg.model, 'to_dict') else \
        dict(cfg.model)
    cfg.model = offline_model_config(model)
    return cfg
