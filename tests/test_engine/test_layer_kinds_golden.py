"""The layer-kind registry changed no output: for two cheap models, the
GradFilterHook's tables, ``tools/analyze_cost.py``'s output and the
budget's choices equal, to the character, the text recorded in
``tests/golden/layer_kinds.txt`` by the code that named ``nn.Conv2d`` /
``GFConv2d`` directly (``tests/helpers/layer_kinds_golden.py`` writes it;
run as a
script on all 18 models it is the full check, see its docstring)."""
import os.path as osp

import pytest

pytest.importorskip('mmseg')

from tests.helpers.layer_kinds_golden import (  # noqa: E402
    REPO, golden_text, split_golden)

GOLDEN = osp.join(REPO, 'tests', 'golden', 'layer_kinds.txt')
#: Two zoo families that take about 10 s each (their budgets included).
CHEAP = ('family:segformer_b0', 'family:fast_scnn')


pytestmark = pytest.mark.usefixtures('one_thread')


@pytest.mark.parametrize('name', CHEAP)
def test_output_equals_the_recorded_text(name):
    with open(GOLDEN) as f:
        want = split_golden(f.read())[name]
    assert golden_text([name])[name] == want
