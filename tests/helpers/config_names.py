"""The names of the concrete configs in ``configs/gf`` and ``configs/calib``.

mmseg's scheme, ``{algorithm}_{backbone}_{strategy}_{schedule}_{dataset}-
{crop}.py``: e.g. ``pspnet_r18-d8_gf-last5-r4_1xb8-20k_voc12aug-512x512.py``
is PSPNet with a dilated ResNet-18 (``configs/_base_/models/pspnet_r18-d8
.py``), the pipeline's strategy ``gf_last5_r4``, 1 device x batch 8 for
20k iterations, on VOC12Aug with 512x512 crops. Calibration configs carry
``calib`` as their strategy (1k or 5k iterations, by model).
"""
import os.path as osp
from typing import Tuple

from mmseg_gf.protocol.experiments import PROTOCOL_MODELS

#: pipeline dataset key -> ``{dataset}-{crop}`` part of a name.
DATASET_PARTS = {
    'voc': 'voc12aug-512x512',
    'cityscapes': 'cityscapes-512x1024',
}


def model_part(model: str) -> str:
    """``{algorithm}_{backbone}``: the model base file's name."""
    return osp.splitext(PROTOCOL_MODELS[model].base)[0]


def parse_config_name(path: str) -> Tuple[str, str, str, str]:
    """``(model, target, strategy, schedule)`` of a concrete config, with
    model, target and strategy as the pipeline names them
    (``experiments.PROTOCOL_MODELS`` / ``PROTOCOL_DATASETS`` /
    ``STRATEGIES`` keys) and
    schedule as written (e.g. ``'1xb8-20k'``)."""
    name = osp.splitext(osp.basename(path))[0]
    models = [m for m in PROTOCOL_MODELS
              if name.startswith(model_part(m) + '_')]
    if len(models) != 1:
        raise ValueError(f'{name}: no single model part')
    model = models[0]
    parts = name[len(model_part(model)) + 1:].split('_')
    if len(parts) != 3:
        raise ValueError(f'{name}: not {{model}}_{{strategy}}_{{schedule}}_'
                         '{dataset}-{crop}')
    strategy, schedule, data = parts
    targets = [t for t, part in DATASET_PARTS.items() if part == data]
    if len(targets) != 1:
        raise ValueError(f'{name}: unknown dataset part {data!r}')
    return model, targets[0], strategy.replace('-', '_'), schedule


def config_name(model: str, target: str, strategy: str,
                schedule: str) -> str:
    """The file name of a concrete config (inverse of
    :func:`parse_config_name`)."""
    return (f'{model_part(model)}_{strategy.replace("_", "-")}_{schedule}_'
            f'{DATASET_PARTS[target]}.py')
