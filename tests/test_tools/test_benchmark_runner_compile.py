"""tools/benchmark_runner_compile.py: the parts that need no training run: the
crop it sets, the iterations it reports compiles at, and its report
(mmseg_gf/analysis/runner_compile.py; the run itself is the
mechanism that tests/test_engine/test_compiled_loss.py tests)."""
import pytest

pytest.importorskip('mmseg')

from mmengine.config import Config  # noqa: E402

from mmseg_gf.analysis.runner_compile import (  # noqa: E402
    _compiled_at, format_report, small_crop)
from tests.helpers.tools import load_tool  # noqa: E402

parse_args = load_tool('benchmark_runner_compile').parse_args


def test_small_crop_sets_the_pipeline_and_the_preprocessor():
    cfg = Config(dict(
        model=dict(data_preprocessor=dict(size=(512, 1024))),
        train_dataloader=dict(dataset=dict(pipeline=[
            dict(type='LoadImageFromFile'),
            dict(type='RandomResize', scale=(2048, 1024),
                 ratio_range=(0.5, 2.0)),
            dict(type='RandomCrop', crop_size=(512, 1024))]))))
    small_crop(cfg, (64, 128))
    pipeline = cfg.train_dataloader.dataset.pipeline
    assert pipeline[1]['scale'] == (128, 64)
    assert pipeline[1]['ratio_range'] == (0.5, 2.0)
    assert pipeline[2]['crop_size'] == (64, 128)
    assert cfg.model.data_preprocessor['size'] == (64, 128)


def test_compiles_are_reported_at_the_iterations_they_happened():
    assert _compiled_at([1, 1, 2, 2, 2]) == [1, 3]
    assert _compiled_at([0, 0]) == []
    run = dict(step_s=[5.0, 0.2, 0.3, 0.2], wall_s=6.0,
               shapes=[(1, 3, 8, 8)] * 2 + [(1, 3, 16, 16)] * 2,
               graphs=[1, 1, 2, 2])
    eager = dict(run, step_s=[0.4, 0.4, 0.4, 0.4], graphs=[0] * 4)
    text = format_report(dict(eager=eager, compiled=run, iters=4,
                              compile=True, cpu='cpu', threads=2,
                              torch='2'), 'x.py')
    assert 'after iterations [1, 3]' in text
    assert '(1, 3, 16, 16) (3)' in text
    assert 'Compiled / eager steady step: 0.625' in text


def test_tool_takes_the_compile_setting_as_a_literal():
    args = parse_args(['c.py', '--compile', "{'mode': 'max-autotune'}",
                       '--crop', '64', '128'])
    assert args.compile == "{'mode': 'max-autotune'}" and args.crop == [64,
                                                                       128]
