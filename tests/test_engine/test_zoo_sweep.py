"""Selection, surgery and one training step over mmseg 1.2.2's own config zoo.

One config per decode-head family, loaded from the ``configs`` that mmseg
installs with itself (``mmseg/.mim/configs``) as a user would bring it, then
adapted for a CPU test the same way for every family:

* :func:`mmseg_gf.engine.zoo.offline_model_config`: ``SyncBN`` -> ``BN``
  everywhere (mmengine's Runner does the same outside distributed runs), no
  checkpoint (``pretrained=None`` and every ``init_cfg`` naming one
  removed: nothing can be downloaded; weights are random);
* a 64x64 input (``data_preprocessor.size``; ISANet 128, LRASPP 392, see
  the cases), ``test_cfg`` mode ``'whole'`` (PointRend keeps its
  subdivision settings), batch 2 for training, random labels;
* whatever :class:`Case` ``shrink`` says on top, for speed: ResNet-50
  becomes a 16-channel ResNet-18 (same strides and dilations), heads
  narrower, ViTs shallower and narrower; the decode head type, its
  structure and its code are untouched.

For each config (``num_layers`` N = 5 unless the case says otherwise,
radius 2; mmseg's ``encode_decode`` is the output, see
``mmseg_gf/engine/selection.py``):

1. reachability: on the plain model, every parameter trainable, a backward
   from a random projection of the output (mmseg's ``encode_decode``)
   reaches exactly the convs that the selection trace marks
   ``feeds_output`` (weight gradient nonzero iff marked) -- the trace's
   graph walk checked against a real backward;
2. the config rewrite (``gradient_filter=dict(num_layers=N)`` ->
   ``GradFilterModel``) picks N convs, all marked ``feeds_output``, the last
   N of them in execution order;
3. with the plain model's weights, the filtered model's eval output equals
   plain mmseg's;
4. the training loss backward (all decode and auxiliary losses): every chosen
   conv's weight gradient is nonzero somewhere, every parameter that is not
   a chosen conv or a classifier has no gradient, every trainable parameter
   has one (DDP without ``find_unused_parameters`` needs that), read in
   the optimizer's step pre-hook of the step below;
5. one ``train_step`` (mmengine's, SGD): exactly the trainable parameters
   change and frozen norms keep their running statistics.

``test_zoo_hook_runner`` runs the issue's two failing families (PointRend,
EMANet) the way a user would: unchanged model config, ``custom_imports`` and
``GradFilterHook`` under mmengine's Runner.

Parameters get a small random perturbation after the seeded init: several
heads initialise a scale to 0 (DANet's ``gamma``, GCNet's last
``channel_add_conv``), which would make upstream gradients exactly zero at
step 0 although they are reached.

The sweep counts convs only (``layer_kinds=['conv2d']``, the paper's
count; transformer Linears are checked by
tests/test_engine/test_transformer_selection.py). Segmenter's mask
transformer head has no classifier conv: its class-score Linears
(``patch_proj``, ``classes_proj``) are its classifier, trained with the
last conv (the patch embedding). Families not run here (see
``NOT_RUN``): MaskFormer and Mask2Former (their heads are mmdet's, not
installed), SAN (needs its CLIP checkpoint to initialise), VPD (needs
Stable Diffusion's ldm). All of it is marked ``zoo`` (``-m "not zoo"``
deselects it).
"""
import copy
import os.path as osp
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from mmengine.hooks import Hook

pytest.importorskip('mmseg')

from mmseg_gf.engine.zoo import (mmseg_config_dir,  # noqa: E402
                                 offline_model_config)

pytestmark = [pytest.mark.zoo, pytest.mark.usefixtures('one_thread')]

SIZE = 64
NUM_LAYERS = 5


# ---------------------------------------------------------------------------
# Shrinks: what each one changes, and why (said in the Case's ``shrink``).
# On a 2-core machine the zoo's ResNet-50 models take ~1 min each here;
# shrunk ones a few seconds.

#: ResNet-50/101 stage widths -> those of ResNet-18 with 16 base channels.
_R50_TO_SMALL = {256: 16, 512: 32, 1024: 64, 2048: 128}
R50_SHRINK = ('ResNet-50/101 -> ResNet-18 with 16 base/stem channels (head '
              'in_channels follow); head channels / 4: speed')


def _small_resnet(model):
    """ResNet-18 with 16 base channels in place of a ResNet-50/101 (same
    type, strides, dilations, stages): its stage outputs are 1/16 as wide,
    so the ``in_channels`` reading them follow; heads' own ``channels`` / 4.
    """
    bb = model['backbone']
    assert bb['type'] in ('ResNetV1c', 'ResNet') and bb['depth'] in (50, 101)
    bb.update(depth=18, stem_channels=16, base_channels=16)

    def remap(v):
        if isinstance(v, (list, tuple)):
            return type(v)(_R50_TO_SMALL[c] for c in v)
        return _R50_TO_SMALL[v]

    def heads(key):
        h = model.get(key)
        return [] if h is None else (list(h) if isinstance(h, list) else [h])

    readers = [model['neck']] if model.get('neck') else \
        heads('decode_head') + heads('auxiliary_head')
    if model.get('neck'):
        readers += heads('auxiliary_head')
    for d in readers:
        if d['type'] == 'IterativeDecodeHead':  # K-Net
            d = d['kernel_generate_head']
        d['in_channels'] = remap(d['in_channels'])
        if 'c1_in_channels' in d:  # DeepLabV3+ low-level features
            d['c1_in_channels'] = remap(d['c1_in_channels'])
    if not model.get('neck'):
        for d in heads('decode_head') + heads('auxiliary_head'):
            if 'channels' in d and d['type'] != 'IterativeDecodeHead':
                d['channels'] //= 4
    return model


def _small_resnet_fpn(model):
    """_small_resnet, and the FPN neck and the heads behind it 1/4 wide."""
    _small_resnet(model)
    model['neck']['out_channels'] //= 4
    heads = model['decode_head']
    for d in heads if isinstance(heads, list) else [heads]:
        d['in_channels'] = [c // 4 for c in d['in_channels']]
        d['channels'] //= 4
    return model


def _knet(model):
    """_small_resnet, and one kernel-update stage instead of three."""
    _small_resnet(model)
    head = model['decode_head']
    head['num_stages'] = 1
    head['kernel_update_head'] = head['kernel_update_head'][:1]
    return model


def _lraspp(model):
    """MobileNetV3's tail (layers 9-11) 1/4 as wide (its own
    ``reduction_factor``)."""
    model['backbone']['reduction_factor'] = 4
    return model


def _vit(embed_dims: int, num_layers: int, num_heads: int):
    """A narrower/shallower ViT backbone, same type and structure."""

    def edit(model):
        bb = model['backbone']
        bb.update(embed_dims=embed_dims, num_layers=num_layers,
                  num_heads=num_heads, img_size=(SIZE, SIZE))
        if 'out_indices' in bb and isinstance(bb['out_indices'],
                                              (list, tuple)):
            n = len(bb['out_indices'])
            bb['out_indices'] = tuple(range(num_layers - n, num_layers))
        elif 'out_indices' in bb:
            bb['out_indices'] = num_layers - 1
        return model

    return edit


def _setr(model):
    _vit(128, 4, 4)(model)
    model['neck']['in_channels'] = [128] * 4
    return model


def _dpt(model):
    _vit(192, 4, 3)(model)
    model['decode_head'].update(in_channels=(192, ) * 4, embed_dims=192,
                                channels=64,
                                post_process_channels=[24, 48, 96, 192])
    return model


def _segmenter_fcn(model):
    _vit(192, 4, 3)(model)
    model['decode_head'].update(in_channels=192, channels=192)
    return model


def _segmenter_mask(model):
    _vit(192, 2, 3)(model)
    model['decode_head'].update(in_channels=192, embed_dims=192,
                                num_heads=3, num_layers=1)
    return model


@dataclass
class Case:
    family: str
    config: str
    shrink: str = 'nothing'
    edit: Optional[Callable] = None
    num_layers: int = NUM_LAYERS
    refuse: Optional[str] = None  # regex of the expected refusal
    size: int = SIZE  # input side; larger where the family needs it


def _r50(family: str, config: str, more: str = '', **kwargs) -> 'Case':
    """A ResNet-50 config, shrunk by :func:`_small_resnet` (+ ``more``)."""
    kwargs.setdefault('edit', _small_resnet)
    return Case(family, config, shrink=R50_SHRINK + more, **kwargs)


CASES = [
    _r50('FCNHead', 'fcn/fcn_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('PSPHead', 'pspnet/pspnet_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('ASPPHead',
         'deeplabv3/deeplabv3_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('DepthwiseSeparableASPPHead', 'deeplabv3plus/'
         'deeplabv3plus_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('UPerHead', 'upernet/upernet_r50_4xb2-40k_cityscapes-512x1024.py'),
    _r50('PSAHead', 'psanet/psanet_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('DAHead', 'danet/danet_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('EMAHead', 'emanet/emanet_r50-d8_4xb2-80k_cityscapes-512x1024.py'),
    _r50('CCHead', 'ccnet/ccnet_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    Case('FCNHead + OCRHead (cascade)',
         'ocrnet/ocrnet_hr18s_4xb2-40k_cityscapes-512x1024.py'),
    _r50('FPNHead + PointHead (cascade, PointRend)',
         'point_rend/pointrend_r50_4xb2-80k_cityscapes-512x1024.py',
         more='; FPN neck and both heads 1/4 wide', edit=_small_resnet_fpn),
    _r50('EncHead', 'encnet/encnet_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('GCHead', 'gcnet/gcnet_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('NLHead',
         'nonlocal_net/nonlocal_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('ANNHead', 'ann/ann_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('APCHead', 'apcnet/apcnet_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('DMHead', 'dmnet/dmnet_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    _r50('DNLHead', 'dnlnet/dnl_r50-d8_4xb2-40k_cityscapes-512x1024.py'),
    # 128: at 64 the 8x8 map is one 8x8 patch, whose global relation is a
    # softmax over one key: connected, yet its gradient is exactly zero
    _r50('ISAHead', 'isanet/isanet_r50-d8_4xb2-40k_cityscapes-512x1024.py',
         size=128),
    _r50('FPNHead (Semantic FPN)',
         'sem_fpn/fpn_r50_4xb2-80k_cityscapes-512x1024.py',
         more='; FPN neck and head 1/4 wide', edit=_small_resnet_fpn),
    _r50('IterativeDecodeHead (K-Net)',
         'knet/knet-s3_r50-d8_fcn_8xb2-adamw-80k_ade20k-512x512.py',
         more='; 1 kernel-update stage instead of 3', edit=_knet),
    # LRASPPHead pools with a fixed 49x49 kernel on the 1/8 map: >= 392 px
    Case('LRASPPHead', 'mobilenet_v3/'
         'mobilenet-v3-d8-s_lraspp_4xb4-320k_cityscapes-512x1024.py',
         size=392, edit=_lraspp,
         shrink='MobileNetV3-small reduction_factor 1 -> 4 (layers 9-11 '
         '1/4 wide): speed at 392x392'),
    Case('DepthwiseSeparableFCNHead (Fast-SCNN)',
         'fastscnn/fast_scnn_8xb4-160k_cityscapes-512x1024.py'),
    Case('FCNHead on BiSeNetV1',
         'bisenetv1/bisenetv1_r18-d32_4xb4-160k_cityscapes-1024x1024.py'),
    Case('FCNHead on BiSeNetV2',
         'bisenetv2/bisenetv2_fcn_4xb4-160k_cityscapes-1024x1024.py'),
    Case('FCNHead + STDCHead aux (STDC)',
         'stdc/stdc1_4xb12-80k_cityscapes-512x1024.py'),
    Case('FCNHead on CGNet', 'cgnet/cgnet_fcn_4xb4-60k_cityscapes-680x680.py'),
    Case('FCNHead on ICNet',
         'icnet/icnet_r18-d8_4xb2-80k_cityscapes-832x832.py'),
    Case('FCNHead on ERFNet',
         'erfnet/erfnet_fcn_4xb4-160k_cityscapes-512x1024.py'),
    Case('DDRHead', 'ddrnet/ddrnet_23-slim_in1k-pre_2xb6-120k_'
         'cityscapes-1024x1024.py'),
    Case('PIDHead', 'pidnet/pidnet-s_2xb6-120k_1024x1024-cityscapes.py'),
    Case('SegformerHead',
         'segformer/segformer_mit-b0_8xb2-160k_ade20k-512x512.py'),
    Case('LightHamHead (SegNeXt)',
         'segnext/segnext_mscan-t_1xb16-adamw-160k_ade20k-512x512.py'),
    Case('SETRMLAHead', 'setr/setr_vit-l_mla_8xb2-160k_ade20k-512x512.py',
         shrink='ViT-L 24x1024 -> 4 layers x 128 (4 heads): SETR-L alone '
         'has ~300M parameters', edit=_setr),
    Case('DPTHead', 'dpt/dpt_vit-b16_8xb2-160k_ade20k-512x512.py',
         shrink='ViT-B 12x768 -> 4 layers x 192 (3 heads), head channels '
         '/ 4: speed', edit=_dpt),
    Case('FCNHead on ViT (Segmenter)',
         'segmenter/segmenter_vit-s_fcn_8xb1-160k_ade20k-512x512.py',
         shrink='ViT-S 12x384 -> 4 layers x 192 (3 heads): speed',
         edit=_segmenter_fcn, num_layers=1),  # its only conv: patch_embed
    Case('SegmenterMaskTransformerHead',
         'segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py',
         shrink='ViT-T 12 layers -> 2, mask transformer 2 layers -> 1: speed',
         edit=_segmenter_mask, num_layers=1),  # its only conv: patch_embed
]

NOT_RUN = [
    ('MaskFormerHead',
     'maskformer/maskformer_r50-d32_8xb2-160k_ade20k-512x512.py',
     'its head is mmdet\'s MaskFormerHead: needs mmdet, not installed'),
    ('Mask2FormerHead',
     'mask2former/mask2former_r50_8xb2-160k_ade20k-512x512.py',
     'its head is mmdet\'s Mask2FormerHead: needs mmdet, not installed'),
    ('SideAdapterCLIPHead (SAN)', 'san/san-vit-b16_voc12aug-640x640.py',
     'builds only from its CLIP checkpoint: without one, mmseg 1.2.2\'s '
     'RecWithAttnbias.init_weights fails (nn.Module has none) and the CLIP '
     'text encoder\'s embeddings stay uninitialised (non-finite class '
     'embeddings, so the Hungarian matching of its loss refuses the cost '
     'matrix); nothing can be downloaded here'),
    ('VPDDepthHead', 'vpd/vpd_sd_4xb8-25k_nyu-512x512.py',
     'depth estimation on Stable Diffusion: needs ldm and its checkpoint'),
]


# ---------------------------------------------------------------------------
# Config adaptation and data


def load_model_cfg(case: Case) -> dict:
    """The case's ``model`` config, adapted (see the module docstring)."""
    from mmengine.config import Config
    cfg = Config.fromfile(osp.join(mmseg_config_dir(), case.config))
    model = offline_model_config(cfg.model.to_dict())
    model['data_preprocessor']['size'] = (case.size, case.size)
    test_cfg = dict(model.get('test_cfg') or {})
    test_cfg['mode'] = 'whole'
    test_cfg.pop('crop_size', None)
    test_cfg.pop('stride', None)
    model['test_cfg'] = test_cfg
    if case.edit is not None:
        model = case.edit(model)
    return model


def build(model_cfg: dict):
    from mmengine.config import ConfigDict
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    import mmseg_gf  # noqa: F401 (registers GradFilterModel)
    init_default_scope('mmseg')
    return MODELS.build(ConfigDict(copy.deepcopy(model_cfg)))


def _num_classes(model) -> int:
    head = model.decode_head
    head = head[-1] if isinstance(head, torch.nn.ModuleList) else head
    return int(head.num_classes)


def metas(size: int, n: int = 1):
    return [dict(img_shape=(size, size), ori_shape=(size, size),
                 pad_shape=(size, size)) for _ in range(n)]


def data_batch(model, size: int, batch: int = 2, seed: int = 0) -> dict:
    """Random uint8 images and labels as a dataloader gives
    them; with an edge map for PIDNet's boundary loss."""
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    gen = torch.Generator().manual_seed(seed)
    classes = _num_classes(model)
    inputs, samples = [], []
    for meta in metas(size, batch):
        inputs.append(
            torch.randint(0, 256, (3, size, size), generator=gen,
                          dtype=torch.uint8))
        # no ignored (255) pixels: mmseg's cross entropy with class_weight
        # (CGNet, PIDNet) indexes the weights with every label
        label = torch.randint(0, classes, (1, size, size), generator=gen)
        sample = SegDataSample(metainfo=meta)
        sample.gt_sem_seg = PixelData(data=label)
        sample.gt_edge_map = PixelData(
            data=torch.randint(0, 2, (1, size, size), generator=gen))
        samples.append(sample)
    return dict(inputs=inputs, data_samples=samples)


def perturb(model, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def _params_of(model, paths):
    return {
        f'{path}.{n}'
        for path in paths
        for n, _ in model.get_submodule(path).named_parameters()
    }


# ---------------------------------------------------------------------------
# The sweep


def check_reachability_against_backward(plain, records, size: int) -> None:
    """The trace's ``feeds_output`` equals "a backward from the output gives
    the conv's weight a nonzero gradient", on the plain model."""
    x = torch.randn(1, 3, size, size,
                    generator=torch.Generator().manual_seed(2))
    flags = {p: p.requires_grad for p in plain.parameters()}
    for p in flags:
        p.requires_grad_(True)
        p.grad = None
    try:
        out = plain.encode_decode(x, metas(size))
        proj = torch.randn(out.shape,
                           generator=torch.Generator().manual_seed(3))
        (out * proj).sum().backward()
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)
    mismatched = []
    for rec in records:
        if rec.inference:
            g = rec.module.weight.grad
            got = g is not None and bool(g.abs().sum() > 0)
            if got != rec.feeds_output:
                mismatched.append((rec.path, rec.feeds_output, got))
    for p in flags:
        p.grad = None
    assert not mismatched, (
        'trace feeds_output vs real backward (path, trace, backward): '
        f'{mismatched}')


@pytest.mark.parametrize('case', CASES,
                         ids=[c.config.split('/')[0] for c in CASES])
def test_zoo_config(case):
    from mmengine.config import Config
    from mmengine.optim import OptimWrapper

    from mmseg_gf.engine import (get_gradient_filter_layers, rewrite_config,
                                 set_frozen_norms_eval, trace_layers)
    from mmseg_gf.models.segmentor import is_classifier

    size = case.size
    model_cfg = load_model_cfg(case)
    cfg = Config(dict(model=copy.deepcopy(model_cfg), crop_size=(size, size),
                      gradient_filter=dict(num_layers=case.num_layers,
                                           radius=2,
                                           layer_kinds=['conv2d'])))
    rewrite_config(cfg)
    if case.refuse is not None:
        with pytest.raises(ValueError, match=case.refuse):
            build(cfg.model)
        return

    # 1. the trace's reachability agrees with a real backward
    torch.manual_seed(0)
    plain = build(model_cfg)
    perturb(plain)
    plain.eval()
    records = [r for r in trace_layers(plain, (size, size))
               if r.kind == 'conv2d' or is_classifier(r.path)]
    check_reachability_against_backward(plain, records, size)

    # 2. the rewrite's model picks the last N convs that feed the output
    gf = build(cfg.model)
    gf.load_state_dict(plain.state_dict())
    choices = get_gradient_filter_layers(gf)
    pool = [
        r.path for r in records if r.inference and r.feeds_output
        and not is_classifier(r.path) and r.kind == 'conv2d'
    ]
    assert len(choices) == case.num_layers
    assert [c.path for c in choices] == pool[-case.num_layers:]

    # 3. same eval output as plain mmseg
    gf.eval()
    x = torch.randn(1, 3, size, size,
                    generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # seeded: SegNeXt's NMF draws random bases
        torch.manual_seed(5)
        ref = plain.encode_decode(x, metas(size))
        torch.manual_seed(5)
        got = gf.encode_decode(x, metas(size))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    # 4. one mmengine train_step (SGD over all parameters, as a Runner
    # builds it); the gradients are read just before the optimizer steps
    chosen = {c.path for c in choices}
    classifiers = [n for n, _ in gf.named_modules() if is_classifier(n)]
    allowed = _params_of(gf, chosen) | _params_of(gf, classifiers)
    params = dict(gf.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == allowed
    optimizer = torch.optim.SGD(gf.parameters(), lr=0.01, momentum=0.9,
                                weight_decay=5e-4)
    grads = {}
    optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: p.grad.clone() for n, p in params.items()
         if p.grad is not None}))
    before = {k: v.clone() for k, v in gf.state_dict().items()}
    gf.train()
    set_frozen_norms_eval(gf)
    log_vars = gf.train_step(data_batch(gf, size), OptimWrapper(optimizer))
    assert torch.isfinite(log_vars['loss'])
    for c in choices:
        g = grads.get(f'{c.path}.weight')
        assert g is not None and bool(g.abs().sum() > 0), c.path
    assert set(grads) == allowed, (
        f'gradient outside the chosen convs: {sorted(set(grads) - allowed)}'
        f'; trainable without one: {sorted(allowed - set(grads))}')
    state = gf.state_dict()
    changed = {k for k in params if not torch.equal(state[k], before[k])}
    assert changed == allowed
    stats = [k for k in before if k.endswith(('running_mean', 'running_var'))]
    assert all(torch.equal(state[k], before[k]) for k in stats)


@pytest.mark.parametrize('family, config, reason', NOT_RUN,
                         ids=[c.split('/')[0] for _, c, _ in NOT_RUN])
def test_zoo_not_run(family, config, reason):
    assert osp.isfile(osp.join(mmseg_config_dir(), config)), config
    pytest.skip(f'{family}: {reason}')


class _Snapshot(Hook):
    """The state at ``before_train``: after weight init and the
    GradFilterHook (priority ABOVE_NORMAL), before the first iteration."""
    priority = 'LOWEST'
    state = None

    def before_train(self, runner):
        self.state = {
            k: v.clone()
            for k, v in runner.model.state_dict().items()
        }


@pytest.mark.parametrize('config', [
    'point_rend/pointrend_r50_4xb2-80k_cityscapes-512x1024.py',
    'emanet/emanet_r50-d8_4xb2-80k_cityscapes-512x1024.py'
], ids=['point_rend', 'emanet'])
def test_zoo_hook_runner(config, tmp_path):
    """The issue's two failures, as a new user meets them: an unchanged
    zoo model config + ``custom_imports`` + ``GradFilterHook(num_layers=5)``
    under mmengine's Runner (tiny VOC-layout dataset, 2 iterations)."""
    from mmengine.config import Config
    from mmengine.runner import Runner

    from mmseg_gf.engine import get_gradient_filter_layers
    from mmseg_gf.models.segmentor import is_classifier
    from tests.helpers.engine_fixtures import make_tiny_voc, runner_cfg
    case = next(c for c in CASES if c.config == config)
    voc = make_tiny_voc(str(tmp_path / 'data'), num_train=4, num_val=2,
                        size=SIZE)
    cfg = runner_cfg(str(tmp_path / 'work'), voc, max_iters=2)
    cfg['model'] = load_model_cfg(case)
    cfg['custom_imports'] = dict(imports=['mmseg_gf'],
                                 allow_failed_imports=False)
    cfg['custom_hooks'] = [dict(type='GradFilterHook', num_layers=5,
                                radius=2)]
    runner = Runner.from_cfg(Config(cfg))
    snapshot = _Snapshot()
    runner.register_hook(snapshot)
    runner.train()
    model = runner.model
    init = snapshot.state
    choices = get_gradient_filter_layers(model)
    assert len(choices) == 5
    assert 'decode_head.ema_mid_conv.conv' not in [c.path for c in choices]
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    changed = {n for n in params
               if not torch.equal(model.state_dict()[n], init[n])}
    assert changed == trainable
    assert {n.rsplit('.', 1)[0] for n in trainable} == \
        {c.path for c in choices} | {
            n for n, _ in model.named_modules() if is_classifier(n)}
