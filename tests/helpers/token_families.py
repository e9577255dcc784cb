"""mmseg 1.2.2's transformer families, offline and shrunk for tests.

Each family is its zoo config made offline (SyncBN -> BN, random weights)
and shrunk (narrow embeddings, one or two blocks per stage, the heads'
channels) for 64x64 inputs. The token-grid tests run them in float64
(:func:`tiny_model`), the accounting's in float32 from the config
(:func:`family_config`).
"""
import copy
import functools

import torch
from mmengine.config import Config
from torch import nn

from mmseg_gf.engine.build import build_segmentor
from mmseg_gf.engine.zoo import make_offline, mmseg_config_dir

SIZE = 64


def _segformer(m):
    m.backbone.update(embed_dims=8, num_layers=[1, 1, 1, 1])
    m.decode_head.update(in_channels=[8, 16, 40, 64], channels=16)


def _swin(m):
    m.backbone.update(embed_dims=12, depths=[2, 2, 1, 1])
    m.decode_head.update(in_channels=[12, 24, 48, 96], channels=16)
    m.auxiliary_head.update(in_channels=48, channels=16)


def _pcpvt(m):
    m.backbone.update(embed_dims=[16, 32, 40, 64], depths=[1, 1, 1, 1])
    m.decode_head.update(in_channels=[16, 32, 40, 64], channels=16)
    m.auxiliary_head.update(in_channels=40, channels=16)


def _svt(m):
    m.backbone.update(embed_dims=[16, 32, 64, 128], depths=[2, 2, 2, 2])
    m.decode_head.update(in_channels=[16, 32, 64, 128], channels=16)
    m.auxiliary_head.update(in_channels=64, channels=16)


def _deit(m):
    m.backbone.update(embed_dims=32, num_heads=2, num_layers=4,
                      out_indices=(0, 1, 2, 3), img_size=(SIZE, SIZE))
    m.decode_head.update(in_channels=[32] * 4, channels=16)
    m.auxiliary_head.update(in_channels=32, channels=16)


def _beit(m):  # BEiT and MAE: their relative position bias fixes the grid
    m.backbone.update(embed_dims=32, num_heads=2, num_layers=4,
                      out_indices=(0, 1, 2, 3), img_size=(SIZE, SIZE))
    m.neck.update(embed_dim=32)
    m.decode_head.update(in_channels=[32] * 4, channels=16)
    m.auxiliary_head.update(in_channels=32, channels=16)


def _dpt(m):
    m.backbone.update(embed_dims=32, num_heads=2, num_layers=4,
                      out_indices=(0, 1, 2, 3), img_size=(SIZE, SIZE))
    m.decode_head.update(in_channels=(32, ) * 4, embed_dims=32, channels=16,
                         post_process_channels=[8, 16, 24, 32])


def _segmenter(m):
    m.backbone.update(embed_dims=32, num_heads=2, num_layers=2,
                      img_size=(SIZE, SIZE))
    m.decode_head.update(in_channels=32, channels=32, embed_dims=32,
                         num_heads=2, num_layers=1, num_classes=5)


FAMILIES = {
    'segformer_b0': ('segformer/segformer_mit-b0_8xb2-160k_ade20k-512x512.py',
                     _segformer),
    'swin_t': ('swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_'
               'ade20k-512x512.py', _swin),
    'twins_pcpvt_s': ('twins/twins_pcpvt-s_uperhead_8xb4-160k_ade20k-'
                      '512x512.py', _pcpvt),
    'twins_svt_s': ('twins/twins_svt-s_uperhead_8xb2-160k_ade20k-512x512.py',
                    _svt),
    'deit_s': ('vit/vit_deit-s16_upernet_8xb2-80k_ade20k-512x512.py', _deit),
    'segmenter_vit_t': ('segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-'
                        '512x512.py', _segmenter),
    'beit_b': ('beit/beit-base_upernet_8xb2-160k_ade20k-640x640.py', _beit),
    'mae_b': ('mae/mae-base_upernet_8xb2-amp-160k_ade20k-512x512.py', _beit),
    'dpt_vit_b': ('dpt/dpt_vit-b16_8xb2-160k_ade20k-512x512.py', _dpt),
}


def family_config(name: str, with_cp: bool = False) -> Config:
    """The family's zoo config, offline, its model shrunk (``with_cp``:
    the backbone's blocks checkpointed, the weights the same)."""
    path, shrink = FAMILIES[name]
    cfg = make_offline(Config.fromfile(f'{mmseg_config_dir()}/{path}'))
    model_cfg = Config(dict(model=cfg.model)).model
    shrink(model_cfg)
    if with_cp:
        model_cfg.backbone.with_cp = True
    cfg.model = model_cfg
    return cfg


@functools.lru_cache(maxsize=None)
def _tiny_model(name: str, with_cp: bool = False) -> nn.Module:
    cfg = family_config(name, with_cp)
    torch.manual_seed(0)
    model = build_segmentor(cfg).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # no zero-initialised weight hides a gradient
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen,
                                      dtype=p.dtype))
    return model


def tiny_model(name: str, with_cp: bool = False) -> nn.Module:
    """The family's model in float64, eval mode, its weights nudged off
    zero (a copy of one built once per process)."""
    return copy.deepcopy(_tiny_model(name, with_cp))
