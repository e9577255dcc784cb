"""Checkpoints load with ``weights_only=True``: mmengine's own types pass,
a pickle that would run code is refused with the type named, and an explicit
opt-in trusts exactly the named type (``mmseg_gf/engine/safe_load.py``)."""
import os.path as osp
import pickle
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer

from mmseg_gf.engine.checkpoint import check_checkpoint_matches
from mmseg_gf.engine.safe_load import (RefusedCheckpointError,
                                       explain_refused_checkpoints,
                                       trust_checkpoint_types)
from tests._engine_fixtures import build_model
from tests._tools import load_tool


def _touch(path):
    with open(path, 'w') as f:
        f.write('ran')


class RunsCode:
    """Unpickling this calls :func:`_touch`: the shape of a malicious
    checkpoint, made harmless (it writes a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return _touch, (self.marker, )


@dataclass
class TrustedNote:
    """A plain data class a user's checkpoint might hold."""

    text: str = ''


def test_mmengine_types_load_weights_only(tmp_path):
    """What mmengine's Runner writes into ``meta``: HistoryBuffer, numpy
    arrays, numpy scalars and dtypes."""
    buffer = HistoryBuffer()
    buffer.update(0.5)
    buffer.update(np.float64(0.25))
    obj = dict(state_dict={'w': torch.ones(2)},
               meta=dict(log=buffer, seed=np.int64(3),
                         arr=np.arange(4, dtype=np.float32),
                         dtype=np.dtype('float64'), scalar=np.float32(1.5)))
    path = tmp_path / 'ckpt.pth'
    torch.save(obj, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded['meta']['log'].mean() == pytest.approx(0.375)
    assert loaded['meta']['seed'] == 3
    assert loaded['meta']['arr'].tolist() == [0, 1, 2, 3]
    assert loaded['meta']['dtype'] == np.float64


def test_code_running_pickle_is_refused_with_the_type_named(tmp_path):
    marker = tmp_path / 'marker'
    path = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': {}, 'meta': RunsCode(str(marker))}, path)
    with pytest.raises(RefusedCheckpointError) as err:
        check_checkpoint_matches(build_model('pspnet_r18'), path)
    message = str(err.value)
    assert '_touch' in message and '--trust-checkpoint-type' in message
    assert not marker.exists()


def test_refusal_through_the_test_tool(tmp_path, monkeypatch):
    """tools/test.py reads the checkpoint safely before evaluating."""
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    marker = tmp_path / 'marker'
    path = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': {}, 'meta': RunsCode(str(marker))}, path)
    config = osp.join(osp.dirname(osp.dirname(osp.dirname(__file__))),
                      'configs', 'gf', 'pspnet_r18_voc_r4.py')
    with pytest.raises(RefusedCheckpointError):
        load_tool('test').main([config, path, '--work-dir',
                                str(tmp_path / 'work')])
    assert not marker.exists()


@pytest.fixture
def allow_list():
    """torch's allow-list, restored after the test."""
    before = list(torch.serialization.get_safe_globals())
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def test_opt_in_trusts_exactly_the_named_type(tmp_path, allow_list):
    path = tmp_path / 'note.pth'
    torch.save({'note': TrustedNote('hello')}, path)
    name = f'{TrustedNote.__module__}.{TrustedNote.__qualname__}'
    with pytest.raises(RefusedCheckpointError, match=name):
        with explain_refused_checkpoints():
            torch.load(path, weights_only=True)
    trust_checkpoint_types([name])
    assert torch.load(path, weights_only=True)['note'].text == 'hello'


def test_pickled_getattr_reaches_history_buffer_methods_only(tmp_path):
    """HistoryBuffer pickles its statistics methods as ``getattr(cls,
    name)``; the allow-listed ``getattr`` answers for nothing else."""
    class Sneaky:
        def __reduce__(self):
            return getattr, (np.ndarray, 'tofile')

    path = tmp_path / 'sneaky.pth'
    torch.save({'x': Sneaky()}, path)
    with pytest.raises(pickle.UnpicklingError, match='not a HistoryBuffer'):
        torch.load(path, weights_only=True)


@pytest.mark.parametrize('name', ['TrustedNote', 'no_such_pkg.Thing',
                                  'tests.test_engine.test_safe_load.Nope'])
def test_opt_in_rejects_names_that_do_not_import(name):
    with pytest.raises(ValueError, match='--trust-checkpoint-type'):
        trust_checkpoint_types([name])
