"""Models, datasets, transfers and strategies of the paper's protocol: the
pieces in ``configs/_base_`` a run's config is composed of
(:mod:`.run_config`).
"""
import os.path as osp
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = [
    'CONFIG_DIR', 'ModelSpec', 'DatasetSpec', 'StrategySpec',
    'PROTOCOL_MODELS', 'PROTOCOL_DATASETS', 'TRANSFERS', 'STRATEGIES',
    'PAPER_STRATEGIES', 'strategy_names', 'strategy_file', 'strategy_kind'
]

#: The package's ``configs``: ``mmseg_gf/.mim/configs`` where the package
#: ships them (a wheel; an editable install links the checkout's), else
#: the checkout's ``configs`` (a checkout on ``PYTHONPATH``); the real path, so
#: an editable install's link names the checkout's files.
_PACKAGE_DIR = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG_DIR = osp.realpath(next(
    (d for d in (osp.join(_PACKAGE_DIR, '.mim', 'configs'),
                 osp.join(osp.dirname(_PACKAGE_DIR), 'configs'))
     if osp.isdir(d)), osp.join(osp.dirname(_PACKAGE_DIR), 'configs')))

ZOO = 'https://download.openmmlab.com/mmsegmentation/v0.5/'


@dataclass(frozen=True)
class ModelSpec:
    """A segmentor of Tables 3 / 9.

    Attributes:
        base: file in ``configs/_base_/models``.
        label: the paper's name.
        calibration: strategy file of its calibration (``calibrate``: the
            classifier, 1000 iterations; ``calibrate_decoder``: the decoder,
            5000 iterations, for the MobileNetV2 models).
        zoo: source dataset -> mmseg model-zoo checkpoint URL (only those
            mmseg publishes; otherwise see docs/protocol.md).
    """

    base: str
    label: str
    calibration: str = 'calibrate'
    zoo: Dict[str, str] = field(default_factory=dict)


#: The protocol's segmentors by name (``--model``): plain data, not an mmseg
#: registry (configs name these through their ``configs/_base_`` files).
PROTOCOL_MODELS: Dict[str, ModelSpec] = {
    'pspnet_r18':
    ModelSpec(
        'pspnet_r18-d8.py', 'PSPNet-R18',
        zoo=dict(cityscapes=ZOO + 'pspnet/pspnet_r18-d8_512x1024_80k_'
                 'cityscapes/pspnet_r18-d8_512x1024_80k_cityscapes_'
                 '20201225_021458-09ffa746.pth')),
    'pspnet_mv2':
    ModelSpec(
        'pspnet_m-v2-d8.py', 'PSPNet-M', 'calibrate_decoder',
        zoo=dict(
            cityscapes=ZOO + 'mobilenet_v2/pspnet_m-v2-d8_512x1024_80k_'
            'cityscapes/pspnet_m-v2-d8_512x1024_80k_cityscapes_'
            '20200825_124817-19e81d51.pth',
            ade20k=ZOO + 'mobilenet_v2/pspnet_m-v2-d8_512x512_160k_ade20k/'
            'pspnet_m-v2-d8_512x512_160k_ade20k_20200825_214953-f5942f7a.pth'
        )),
    'deeplabv3_r18':
    ModelSpec(
        'deeplabv3_r18-d8.py', 'DLV3-R18',
        zoo=dict(cityscapes=ZOO + 'deeplabv3/deeplabv3_r18-d8_512x1024_80k_'
                 'cityscapes/deeplabv3_r18-d8_512x1024_80k_cityscapes_'
                 '20201225_021506-23dffbe2.pth')),
    'deeplabv3_mv2':
    ModelSpec(
        'deeplabv3_m-v2-d8.py', 'DLV3-M', 'calibrate_decoder',
        zoo=dict(
            cityscapes=ZOO + 'mobilenet_v2/deeplabv3_m-v2-d8_512x1024_80k_'
            'cityscapes/deeplabv3_m-v2-d8_512x1024_80k_cityscapes_'
            '20200825_124836-bef03590.pth',
            ade20k=ZOO + 'mobilenet_v2/deeplabv3_m-v2-d8_512x512_160k_'
            'ade20k/deeplabv3_m-v2-d8_512x512_160k_ade20k_20200825_'
            '223255-63986343.pth')),
    'fcn_r18':
    ModelSpec(
        'fcn_r18-d8.py', 'FCN-R18',
        zoo=dict(cityscapes=ZOO + 'fcn/fcn_r18-d8_512x1024_80k_cityscapes/'
                 'fcn_r18-d8_512x1024_80k_cityscapes_20201225_021327-'
                 '6c50f8b4.pth')),
    'upernet_r18':
    ModelSpec('upernet_r18.py', 'UPerNet-R18'),
}


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset of the protocol.

    Attributes:
        base: file in ``configs/_base_/datasets``.
        label: display name.
        maker: key of :data:`mmseg_gf.datasets.MAKERS` (synthetic data).
        subdir: the config's ``data_root`` relative to the maker's ``root``.
        synthetic: default keyword arguments of the maker (image size,
            classes present) for ``--synthetic``. The class subsets and the
            per-family appearance tables of the generator differ between
            datasets: moving from one to another is a real transfer.
    """

    base: str
    label: str
    maker: str
    subdir: str
    synthetic: Dict[str, Any] = field(default_factory=dict)


#: The protocol's datasets by name (the ends of a ``--transfer``): plain
#: data, not mmseg's ``DATASETS`` registry.
PROTOCOL_DATASETS: Dict[str, DatasetSpec] = {
    'voc':
    DatasetSpec('voc12aug.py', 'VOC12Aug', 'voc', 'VOCdevkit/VOC2012',
                dict(size=(96, 96), classes=[1, 2, 3, 4, 5, 6])),
    'cityscapes':
    DatasetSpec('cityscapes.py', 'Cityscapes', 'cityscapes', '',
                dict(size=(64, 128), classes=[11, 12, 13, 14, 15, 16])),
    'ade20k':
    DatasetSpec('ade20k.py', 'ADE20K', 'ade20k', 'ADEChallengeData2016',
                dict(size=(96, 96), classes=list(range(1, 11)))),
}

#: transfer -> (source dataset, target dataset).
TRANSFERS: Dict[str, Tuple[str, str]] = {
    'cityscapes2voc': ('cityscapes', 'voc'),
    'ade2voc': ('ade20k', 'voc'),
    'ade2cityscapes': ('ade20k', 'cityscapes'),
}


@dataclass(frozen=True)
class StrategySpec:
    """A row of the table.

    Attributes:
        base: file in ``configs/_base_/strategies`` (``{model}`` is replaced
            by the model name; ``{calibration}`` by its calibration file).
        kind: ``'calib'`` or ``'finetune'``.
        options: settings merged after loading (``merge_from_dict`` keys).
        budget_like: a strategy whose predicted backward GFLOPs per image
            (at the run's crop) become this one's ``backward_gflops``
            budget (:func:`fill_budget`): the same compute, spent as the
            budget's rule spends it.
    """

    base: str
    kind: str = 'finetune'
    options: Dict[str, Any] = field(default_factory=dict)
    budget_like: Optional[str] = None


def _builtin_strategies() -> Dict[str, StrategySpec]:
    out = dict(calib=StrategySpec('{calibration}.py', 'calib'))
    out['vanilla_all'] = StrategySpec('vanilla_all.py')
    out['classifier_only'] = StrategySpec('classifier_only.py')
    for n in (5, 10):
        out[f'vanilla_last{n}'] = StrategySpec(f'vanilla_last{n}.py')
        for r in ('r2', 'r4', 'auto'):
            out[f'gf_last{n}_{r}'] = StrategySpec(f'gf_last{n}_{r}.py')
        ref = f'reference/{{model}}_{n}.py'
        out[f'gf_ref{n}'] = StrategySpec(ref)
        out[f'vanilla_ref{n}'] = StrategySpec(
            ref, options={'gradient_filter.mode': 'vanilla'})
        # the paper's Section 5.4 (c): "GF last n, r = 4"'s compute spent
        # on as many layers as fit at r = 8
        out[f'gf_budget{n}_r8'] = StrategySpec('gf_budget_r8.py',
                                               budget_like=f'gf_last{n}_r4')
    return out


STRATEGIES: Dict[str, StrategySpec] = _builtin_strategies()

#: The rows of Tables 3 / 9 (with both patch sizes the paper studies).
PAPER_STRATEGIES = [
    'calib', 'vanilla_all', 'vanilla_last5', 'vanilla_last10', 'gf_last5_r2',
    'gf_last5_r4', 'gf_last10_r2', 'gf_last10_r4'
]


def strategy_names() -> List[str]:
    """Built-in strategy names (``gf_ref*`` / ``vanilla_ref*`` exist only
    for the models the reference implementation configured)."""
    return list(STRATEGIES)


def strategy_file(strategy: str, model: str,
                  config_dir: str = CONFIG_DIR) -> str:
    """The strategy's base file for ``model``.

    ``strategy`` is a built-in name or a path to a strategy file of one's
    own (a few lines like those in ``configs/_base_/strategies``).

    Raises:
        ValueError: unknown strategy, or no such file for this model.
    """
    if strategy.endswith('.py'):
        path = osp.abspath(strategy)
    else:
        if strategy not in STRATEGIES:
            raise ValueError(f'unknown strategy {strategy!r}; built-in: '
                             f'{strategy_names()} or a path to a .py file')
        base = STRATEGIES[strategy].base.format(
            model=model, calibration=PROTOCOL_MODELS[model].calibration)
        path = osp.join(config_dir, '_base_', 'strategies', base)
    if not osp.isfile(path):
        raise ValueError(f'strategy {strategy!r} has no config for model '
                         f'{model!r} (no file {path})')
    return path


def strategy_kind(strategy: str) -> str:
    """'calib' or 'finetune'."""
    spec = STRATEGIES.get(strategy)
    return spec.kind if spec is not None else 'finetune'
