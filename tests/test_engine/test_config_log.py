"""The config in a run's log once: a Runner built with ``log_config=False``
(the demo's initial-weights and evaluation runs) names the dump of its
config instead of logging its text, and still dumps it."""
import os.path as osp

import pytest

pytest.importorskip('mmseg')

from mmengine.config import Config  # noqa: E402

from mmseg_gf.engine.entrypoints import build_runner  # noqa: E402
from tests.helpers.engine_fixtures import (make_tiny_voc,  # noqa: E402
                                           runner_cfg)


def _log_of(runner) -> str:
    with open(osp.join(runner.log_dir, f'{runner.timestamp}.log')) as f:
        return f.read()


@pytest.mark.parametrize('log_config', [True, False])
def test_config_text_logged_or_named(tmp_path, log_config):
    voc = make_tiny_voc(str(tmp_path / 'data'), num_train=2, num_val=1)
    work = str(tmp_path / f'work_{log_config}')
    cfg = Config(runner_cfg(work, voc, max_iters=1))
    runner = build_runner(cfg, log_config=log_config)
    text = _log_of(runner)
    dump = osp.join(work, f'{runner.timestamp}.py')
    assert osp.isfile(dump)  # dumped either way
    assert ('Config:\n' in text) == log_config
    assert (f'Config: {dump} (its text is not repeated here)' in text) != \
        log_config
