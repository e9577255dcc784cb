"""A demo run killed with SIGKILL (once by the parent at a random moment,
once inside a checkpoint write) resumes to the uninterrupted run's final
weights, bit for bit (mmseg_gf/analysis/fault_injection.py; the
benchmark's 20 kills: tools/fault_injection.py,
docs/benchmarks/fault_injection_cpu.md)."""
import os.path as osp

import pytest

pytest.importorskip('mmseg')

from mmseg_gf.analysis.fault_injection import (  # noqa: E402
    FaultSetting, child_config_text, run_fault_injection)
from mmseg_gf.analysis.fault_report import fault_markdown  # noqa: E402
from mmseg_gf.demo import ensure_data  # noqa: E402

DEMO = osp.join(osp.dirname(osp.dirname(osp.dirname(__file__))), 'configs',
                'demo', 'pspnet_r18_voc_r4_cpu.py')


def _setting(tmp_path, **kw):
    data = ensure_data(str(tmp_path / 'data'), num_train=8, num_val=2,
                       size=(48, 64), log=lambda m: None)
    kw = dict(dict(max_iters=6, interval=2, crop=32, batch_size=2), **kw)
    return FaultSetting(demo_config=DEMO, data_root=osp.abspath(data), **kw)


@pytest.mark.fault_injection
def test_killed_run_resumes_to_the_uninterrupted_weights(tmp_path):
    """The demo's random augmentations and dropout included: the data
    draws are replayed, torch's generator comes back from the
    checkpoint."""
    s = _setting(tmp_path, pipeline='demo')
    messages = []
    result = run_fault_injection(s, str(tmp_path / 'runs'), kills=2,
                                 in_write=1, kills_per_episode=2, seed=3,
                                 log=messages.append)
    assert result['total_kills'] == 2 and result['planned_in_write'] == 1
    assert result['in_write'] >= 1
    assert result['identical'] == 2, messages
    (episode,) = result['episodes']
    assert episode['identical'] and episode['differing'] == 0
    for kill in result['kills']:
        # a cut costs at most the iterations since the last checkpoint
        assert 0 <= kill['cost'] <= s.interval, kill
        assert kill['resumed_from'] % s.interval == 0
        if kill['kind'] == 'write':  # the temporary file it cut
            (name,) = kill['partial']
            assert name == 'last_checkpoint' or name.startswith('iter_')
    table = fault_markdown(result, 'pytest', 'test CPU')
    assert f'**2 of 2 kills** ({result["in_write"]} inside a checkpoint ' \
        'write, 1 of them placed there)' in table


def test_bad_setting_is_refused_before_any_run(tmp_path):
    s = FaultSetting(demo_config=DEMO, data_root=str(tmp_path),
                     pipeline='random')
    with pytest.raises(ValueError, match=r"pipeline must be one of "
                       r"\('fixed', 'demo'\), got 'random'"):
        run_fault_injection(s, str(tmp_path / 'runs'))
    s = FaultSetting(demo_config=DEMO, data_root=str(tmp_path), interval=0)
    with pytest.raises(ValueError, match='interval must be an int >= 1'):
        s.check()


def test_child_config_turns_dropout_off_for_the_fixed_pipeline(tmp_path):
    from mmengine.config import Config
    s = FaultSetting(demo_config=DEMO, data_root=str(tmp_path))
    for pipeline, dropout in (('fixed', 0.0), ('demo', 0.1)):
        s.pipeline = pipeline
        path = tmp_path / f'{pipeline}.py'
        path.write_text(child_config_text(s))
        cfg = Config.fromfile(str(path))
        assert cfg.model.decode_head.dropout_ratio == dropout
        assert cfg.train_dataloader.num_workers == 0
        assert cfg.default_hooks.checkpoint.interval == s.interval
