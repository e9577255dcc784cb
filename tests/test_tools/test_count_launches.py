"""tools/count_launches.py's arguments (its counts: test_launch_count.py,
which runs it as a script, the only way triton's interpreter is on)."""
import os

import pytest

pytest.importorskip('mmseg')

from tests.helpers.tools import load_tool  # noqa: E402

count_launches = load_tool('count_launches')


def test_loading_it_leaves_the_environment_alone():
    """Only run as a script does it switch triton's interpreter on."""
    before = dict(os.environ)
    load_tool('count_launches')
    assert dict(os.environ) == before


@pytest.mark.parametrize('argv, message', [
    ([], 'give CONFIG files'),
    (['--models', 'pspnet_r18', '--rows', 'inference'], 'inference'),
    (['--models', 'pspnet_r18', '--rows', 'gf_last5'], '--rows'),
    (['--models', 'pspnet_r18', '--input-size', '64', '64', '64'],
     '--input-size'),
    (['--models', 'pspnet_r18', '--batch', '0'], '--batch'),
    (['no_such_config.py'], 'does not exist'),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        count_launches.parse_args(argv)
    assert message in capsys.readouterr().err


def test_defaults():
    args = count_launches.parse_args(['--families', 'segformer_b0'])
    assert args.crop == [64, 64] and args.batch == 1 and args.triton
    assert args.rows == ['gf_last10_r4:lean', 'vanilla_last10:plain']
