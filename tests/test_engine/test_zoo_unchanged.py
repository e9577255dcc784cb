"""Every decode-head family of mmseg 1.2.2's zoo, its model config as it
comes, trains a lean gradient-filtered step under mmengine's Runner.

One config per decode-head family (the configs of
``tests/test_engine/test_zoo_sweep.py``'s ``CASES``), as a newcomer brings
it: the zoo's ``model`` unchanged but for what a CPU without downloads
needs (:func:`mmseg_gf.engine.zoo.offline_model_config`: SyncBN -> BN, no
pretrained checkpoint), a small crop (``data_preprocessor.size`` 64x64;
ISANet 128, LRASPP 392 as in the sweep) and ``test_cfg`` mode ``'whole'``.
No shrink: K-Net keeps its three kernel-update stages, ResNet-50 stays
ResNet-50, SETR keeps ViT-L. ``custom_imports`` + ``GradFilterHook(
num_layers=5, radius=4)`` with every other setting at its default (lean
region on, the cost table logged), a tiny VOC-layout dataset (labels below
3, an edge map for PIDNet's boundary loss), one iteration.

Checked: the step runs, its loss is finite, the lean region holds lean
modules, and exactly the trainable parameters changed. The families that
do not build on CPU are the sweep's ``NOT_RUN``, each skipped with its
reason.

Marked ``zoo_full``: pytest.ini deselects it (it takes minutes: ResNet-50
and ViT-L models at full width); run it with
``python -m pytest -m zoo_full tests/test_engine/test_zoo_unchanged.py``.
"""
import math
import os.path as osp

import pytest
import torch

pytest.importorskip('mmseg')

from mmengine.config import Config  # noqa: E402

from mmseg_gf.engine.lean_region import lean_counts  # noqa: E402
from mmseg_gf.engine.zoo import (mmseg_config_dir,  # noqa: E402
                                 offline_model_config)
from tests.helpers.engine_fixtures import (make_tiny_voc,  # noqa: E402
                                           runner_cfg)
from tests.test_engine.test_zoo_sweep import (CASES, NOT_RUN,  # noqa: E402
                                              SIZE, _Snapshot)

pytestmark = [pytest.mark.zoo, pytest.mark.zoo_full,
              pytest.mark.usefixtures('one_thread')]


def unchanged_model(config: str, size: int) -> dict:
    """The zoo config's ``model``, offline, at ``size`` x ``size``."""
    model = offline_model_config(
        Config.fromfile(osp.join(mmseg_config_dir(),
                                 config)).model.to_dict())
    model['data_preprocessor']['size'] = (size, size)
    test_cfg = dict(model.get('test_cfg') or {})  # PointRend's subdivision
    test_cfg.pop('crop_size', None)
    test_cfg.pop('stride', None)
    model['test_cfg'] = dict(test_cfg, mode='whole')
    return model


def hook_run_config(config: str, size: int, tmp_path) -> Config:
    """A one-iteration run of the unchanged model with GradFilterHook."""
    voc = make_tiny_voc(str(tmp_path / 'data'), num_train=2, num_val=1,
                        size=SIZE)
    cfg = runner_cfg(str(tmp_path / 'work'), voc, max_iters=1)
    pipeline = cfg['train_dataloader']['dataset']['pipeline']
    pipeline.insert(-1, dict(type='GenerateEdge', edge_width=4))
    cfg['model'] = unchanged_model(config, size)
    cfg['crop_size'] = (size, size)
    cfg['custom_imports'] = dict(imports=['mmseg_gf'],
                                 allow_failed_imports=False)
    cfg['custom_hooks'] = [dict(type='GradFilterHook', num_layers=5,
                                radius=4)]
    return Config(cfg)


@pytest.mark.parametrize('case', CASES,
                         ids=[c.config.split('/')[0] for c in CASES])
def test_unchanged_zoo_config_trains_a_lean_step(case, tmp_path):
    from mmengine.runner import Runner
    runner = Runner.from_cfg(hook_run_config(case.config, case.size,
                                             tmp_path))
    snapshot = _Snapshot()
    runner.register_hook(snapshot)
    runner.train()
    loss = runner.message_hub.get_scalar('train/loss').current()
    assert math.isfinite(loss)
    model = runner.model
    assert sum(lean_counts(model).values()) > 0
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    state = model.state_dict()
    changed = {n for n in params
               if not torch.equal(state[n], snapshot.state[n])}
    assert trainable and changed == trainable


@pytest.mark.parametrize('family, config, reason', NOT_RUN,
                         ids=[c.split('/')[0] for _, c, _ in NOT_RUN])
def test_families_not_built_on_cpu(family, config, reason):
    assert osp.isfile(osp.join(mmseg_config_dir(), config)), config
    pytest.skip(f'{family}: {reason}')
