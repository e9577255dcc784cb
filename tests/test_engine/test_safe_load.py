"""Checkpoints load with ``weights_only=True``: mmengine's own types pass
through checking stand-ins, a crafted file neither crashes the process nor
changes its state, a pickle that would run code is refused with what it
holds named, and the trust flag accepts exactly the names refusals print
(``mmseg_gf/engine/checkpoint/safe_load.py``,
``mmseg_gf/engine/checkpoint/data.py``).

Crafted files are loaded in a child process
(``tests/helpers/crafted_checkpoints.py``): a
crash must show as a signal there, not kill the test run.
"""
import os.path as osp
import pickle
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer

from mmseg_gf.engine.checkpoint import check_checkpoint_matches
from mmseg_gf.engine.checkpoint.safe_load import (
    RefusedCheckpointError, explain_refused_checkpoints, load_checkpoint_file,
    trust_checkpoint_types)
from tests.helpers.engine_fixtures import build_model
from tests.helpers.tools import load_tool
from tests.helpers import crafted_checkpoints as cc


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


class Outer:
    """Holds a nested class (pickled as ``getattr(Outer, 'Inner')``)."""

    @dataclass
    class Inner:
        value: int = 0


@pytest.fixture
def allow_list():
    """torch's allow-list, restored after the test."""
    from mmseg_gf.engine.checkpoint import data as checkpoint_data
    before = list(torch.serialization.get_safe_globals())
    nested = dict(checkpoint_data.TRUSTED_NESTED)
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)
    checkpoint_data.TRUSTED_NESTED.clear()
    checkpoint_data.TRUSTED_NESTED.update(nested)


def _trust_values(message):
    return re.findall(r'--trust-checkpoint-type (\S+)', message)


def test_mmengine_types_load_weights_only(tmp_path):
    """What mmengine's Runner writes: HistoryBuffer, numpy arrays, numpy
    scalars and dtypes, of every plain kind and both byte orders."""
    buffer = HistoryBuffer()
    buffer.update(0.5)
    buffer.update(np.float64(0.25))
    meta = dict(log=buffer, seed=np.int64(3),
                arr=np.arange(4, dtype=np.float32),
                big=np.arange(3, dtype='>i4'), text=np.array(['ab', 'c']),
                flags=np.array([True, False]), dtype=np.dtype('float64'),
                scalar=np.float32(1.5), c=np.complex64(1 + 2j),
                b=np.bytes_(b'xy'), u=np.uint8(200))
    path = tmp_path / 'ckpt.pth'
    torch.save(dict(state_dict={'w': torch.ones(2)}, meta=meta), path)
    loaded = torch.load(path, weights_only=True)['meta']
    assert type(loaded['log']) is HistoryBuffer
    assert loaded['log'].mean() == pytest.approx(0.375)
    assert loaded['log'].statistics('mean') == pytest.approx(0.375)
    assert loaded['seed'] == 3 and type(loaded['seed']) is np.int64
    assert loaded['arr'].tolist() == [0, 1, 2, 3]
    assert loaded['arr'].dtype == np.float32
    assert loaded['big'].tolist() == [0, 1, 2]
    assert loaded['text'].tolist() == ['ab', 'c']
    assert loaded['flags'].tolist() == [True, False]
    assert loaded['dtype'] == np.float64
    assert np.dtype(loaded['dtype']) == np.float64
    assert loaded['scalar'] == np.float32(1.5)
    assert loaded['c'] == np.complex64(1 + 2j)
    assert loaded['b'] == b'xy' and loaded['u'] == 200
    # Saved again, the loaded values are plain numpy types: no plugin
    # name in the file.
    again = tmp_path / 'again.pth'
    torch.save(loaded, again)
    assert b'mmseg_gf' not in cc.data_pickle(str(again))


def test_mmengine_checkpoint_restores_history_buffers(tmp_path):
    """A checkpoint of ``mmengine.runner.save_checkpoint`` with a message
    hub: plain HistoryBuffers with plain arrays, class table untouched."""
    path = cc.save_mmengine_checkpoint(str(tmp_path / 'hub.pth'))
    before = dict(HistoryBuffer._statistics_methods)
    loaded = load_checkpoint_file(path)
    loss = loaded['message_hub']['log_scalars']['train/loss']
    assert type(loss) is HistoryBuffer
    assert type(loss._log_history) is np.ndarray
    assert loss.data[0].tolist() == pytest.approx([1, 1 / 2, 1 / 3])
    assert loss.statistics('mean') == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    assert HistoryBuffer._statistics_methods == before
    assert loaded['meta']['dataset_meta']['classes'] == ('a', 'b')


# ------------------------------------------------------ crafted, in a child
_OBJECT_DTYPE = cc.dtype('O8', cc.dtype_state('|', flags=0))
_OBJECT_FIELD_DTYPE = cc.dtype('f8', cc.dtype_state(
    '|', names=cc.tup(cc.text('a')),
    fields=cc.dict_({'a': cc.tup(
        cc.dtype('O8', cc.dtype_state('|', flags=63)), cc.integer(0))}),
    elsize=8, alignment=1, flags=0))
_EVIL_STATISTICS = cc.dict_({
    'max_length': cc.integer(10),
    '_log_history': cc.array([2], cc.dtype('f8'),
                             np.array([1., 3.]).tobytes()),
    '_count_history': cc.array([2], cc.dtype('i8'),
                               np.array([1, 1]).tobytes()),
    'statistics_methods': cc.dict_({'mean': cc.history_attribute('max')}),
})

CRAFTED = {
    # the report's segfault: an object dtype with its flags cleared, and
    # numpy's scalar reading the file's bytes as an object pointer
    'object dtype scalar': cc.call(cc.SCALAR, _OBJECT_DTYPE,
                                   cc.raw(b'AAAAAAAA')),
    'object dtype array': cc.array([1], _OBJECT_DTYPE, b'AAAAAAAA'),
    # a float dtype given an object field by its state
    'object field array': cc.array([1], _OBJECT_FIELD_DTYPE, b'AAAAAAAA'),
    'object field scalar': cc.call(cc.SCALAR, _OBJECT_FIELD_DTYPE,
                                   cc.raw(b'AAAAAAAA')),
    'fields on a float dtype': cc.array([1], cc.dtype('f8', cc.dtype_state(
        '|', names=cc.tup(cc.text('a')),
        fields=cc.dict_({'a': cc.tup(cc.dtype('f8'), cc.integer(0))}),
        elsize=8, alignment=1)), b'AAAAAAAA'),
    'void dtype': cc.call(cc.SCALAR, cc.dtype('V8'), cc.raw(b'AAAAAAAA')),
    'hand-set flags': cc.array([1], cc.dtype('f8', cc.dtype_state(
        flags=63)), b'AAAAAAAA'),
    # mmengine's HistoryBuffer.__setstate__ writes the class-wide table;
    # the unknown global after it makes the load fail afterwards
    'history buffer statistics': cc.dict_({
        'hub': cc.history_buffer(_EVIL_STATISTICS),
        'then': cc.call('tests.helpers.crafted_checkpoints.'
                        'touch_marker', cc.text('MARKER'))}),
    # torch's _rebuild_from_type_v2 calls what getattr resolved
    'register_statistics': cc.call(
        cc.REBUILD_FROM_TYPE, cc.history_attribute('register_statistics'),
        cc.glob('torch.Tensor'), cc.tup(cc.glob('numpy.dtype')),
        cc.EMPTY_DICT),
    'statistics method called': cc.call(
        cc.REBUILD_FROM_TYPE, cc.history_attribute('mean'),
        cc.glob('torch.Tensor'), cc.tup(cc.integer(1)), cc.EMPTY_DICT),
}


@pytest.fixture(scope='module')
def crafted_outcomes(tmp_path_factory):
    """Every CRAFTED file loaded by plain ``torch.load`` after importing
    the plugin, and by the plugin's loader, each batch in a child."""
    root = tmp_path_factory.mktemp('crafted')
    marker = str(root / 'marker')
    paths = {}
    for name, body in CRAFTED.items():
        body = body.replace(b'MARKER', marker.encode())
        paths[name] = cc.write_checkpoint(str(root / f'{len(paths)}.pth'),
                                          cc.pickle_of(body))
    out = {}
    for loader in ('torch', 'plugin'):
        for record in cc.load_in_child(list(paths.values()), marker,
                                       loader=loader):
            name = [n for n, p in paths.items() if p == record['path']][0]
            out[loader, name] = record
    return out


@pytest.mark.parametrize('loader', ['torch', 'plugin'])
@pytest.mark.parametrize('name', list(CRAFTED))
def test_crafted_file_is_refused_without_side_effects(crafted_outcomes,
                                                      loader, name):
    """No signal (the child's exit status is checked), a refusal, the
    class state and numpy's dtypes unchanged, no code run."""
    record = crafted_outcomes[loader, name]
    assert record['outcome'] == 'refused', record
    assert record['class_state_kept'], record
    assert not record['marker'], record
    if loader == 'plugin':
        assert 'checkpoint refused' in record['detail'], record
        assert 'did not name' not in record['detail']


def test_refusal_names_the_dtype_and_a_flag_value(crafted_outcomes):
    detail = crafted_outcomes['plugin', 'object dtype scalar']['detail']
    assert "numpy.dtype('O8', False, True)" in detail
    assert _trust_values(detail) == ['numpy.dtype']


def test_trusting_numpy_hands_its_pickles_back_to_numpy(
        tmp_path, allow_list):
    """An object array (a user's own meta, say) is refused; the name the
    refusal prints trusts numpy's own pickling, after which it loads."""
    path = str(tmp_path / 'objects.pth')
    torch.save({'ids': np.array(['a', 1], dtype=object)}, path)
    with pytest.raises(RefusedCheckpointError) as err:
        load_checkpoint_file(path)
    names = _trust_values(str(err.value))
    assert names == ['numpy.dtype']
    trust_checkpoint_types(names)
    assert load_checkpoint_file(path)['ids'].tolist() == ['a', 1]


def test_history_buffer_restored_from_data_only(tmp_path):
    """A loaded buffer keeps the file's values; the file's
    ``statistics_methods`` (``'mean'`` -> ``max``) do not reach the class
    table."""
    path = cc.write_checkpoint(str(tmp_path / 'hub.pth'), cc.pickle_of(
        cc.history_buffer(_EVIL_STATISTICS)))
    before = dict(HistoryBuffer._statistics_methods)
    try:
        buffer = torch.load(path, weights_only=True)
        assert HistoryBuffer._statistics_methods == before
    finally:
        HistoryBuffer._statistics_methods.clear()
        HistoryBuffer._statistics_methods.update(before)
    assert type(buffer) is HistoryBuffer
    assert buffer.statistics('mean') == 2.0 and buffer.max() == 3.0
    assert buffer.max_length == 10
    assert 'statistics_methods' not in vars(buffer)


# ------------------------------------------------------------------ names
def test_code_running_pickle_is_refused_with_the_type_named(tmp_path):
    marker = tmp_path / 'marker'
    path = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': {}, 'meta': RunsCode(str(marker))}, path)
    with pytest.raises(RefusedCheckpointError) as err:
        check_checkpoint_matches(build_model('pspnet_r18'), path)
    name = f'{__name__}._touch'
    assert _trust_values(str(err.value)) == [name]
    assert not marker.exists()


def test_refusal_through_the_test_tool(tmp_path, monkeypatch):
    """tools/test.py reads the checkpoint safely before evaluating."""
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    marker = tmp_path / 'marker'
    path = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': {}, 'meta': RunsCode(str(marker))}, path)
    config = osp.join(cc.REPO, 'configs', 'gf', 'pspnet_r18_voc_r4.py')
    with pytest.raises(RefusedCheckpointError):
        load_tool('test').main([config, path, '--work-dir',
                                str(tmp_path / 'work')])
    assert not marker.exists()


def test_opt_in_trusts_exactly_the_named_type(tmp_path, allow_list):
    path = tmp_path / 'note.pth'
    torch.save({'note': TrustedNote('hello')}, path)
    name = f'{TrustedNote.__module__}.{TrustedNote.__qualname__}'
    with pytest.raises(RefusedCheckpointError) as err:
        with explain_refused_checkpoints():
            torch.load(path, weights_only=True)
    assert _trust_values(str(err.value)) == [name]
    trust_checkpoint_types([name])
    assert torch.load(path, weights_only=True)['note'].text == 'hello'


def test_all_refused_names_listed_before_loading(tmp_path, allow_list):
    """The file's every refused name at once, builtins under the name the
    flag takes (torch prints ``slice``), each value accepted by the flag."""
    path = str(tmp_path / 'two.pth')
    torch.save({'s': slice(1, 2), 'note': TrustedNote('x')}, path)
    with pytest.raises(RefusedCheckpointError) as err:
        load_checkpoint_file(path)
    names = _trust_values(str(err.value))
    assert names == ['builtins.slice', f'{__name__}.TrustedNote']
    trust_checkpoint_types(names)
    assert load_checkpoint_file(path)['s'] == slice(1, 2)


def test_builtin_named_by_torch_message_alone(tmp_path, allow_list):
    """Without the file name, torch's message is read: its ``slice`` is
    ``builtins.slice``."""
    path = str(tmp_path / 'slice.pth')
    torch.save({'s': slice(1, 2)}, path)
    with pytest.raises(RefusedCheckpointError) as err:
        with explain_refused_checkpoints():
            torch.load(path, weights_only=True)
    assert _trust_values(str(err.value)) == ['builtins.slice']
    trust_checkpoint_types(['builtins.slice'])
    assert torch.load(path, weights_only=True)['s'] == slice(1, 2)


def test_nested_class_trusted_without_its_parent(tmp_path, allow_list):
    path = str(tmp_path / 'nested.pth')
    torch.save({'x': Outer.Inner(3)}, path)
    name = f'{__name__}.Outer.Inner'
    with pytest.raises(RefusedCheckpointError) as err:
        load_checkpoint_file(path)
    assert _trust_values(str(err.value)) == [name]
    trust_checkpoint_types([name])
    assert load_checkpoint_file(path)['x'] == Outer.Inner(3)
    # Outer itself stays untrusted: calling it is refused.
    called = str(tmp_path / 'outer.pth')
    cc.write_checkpoint(called, cc.pickle_of(cc.call(f'{__name__}.Outer')))
    with pytest.raises(RefusedCheckpointError) as err:
        load_checkpoint_file(called)
    assert _trust_values(str(err.value)) == [f'{__name__}.Outer']


def test_refused_value_of_an_allowed_type_names_the_type(tmp_path):
    """torch's own refusals (here a state given to a numpy scalar) name
    the type, not '(a type torch did not name)'."""
    path = cc.write_checkpoint(str(tmp_path / 'build.pth'), cc.pickle_of(
        cc.build(cc.call(cc.SCALAR, cc.dtype('f8'), cc.raw(b'\0' * 8)),
                 cc.dict_({'x': cc.integer(1)}))))
    with pytest.raises(RefusedCheckpointError) as err:
        load_checkpoint_file(path)
    assert 'numpy.float64' in str(err.value)
    assert 'did not name' not in str(err.value)
    assert _trust_values(str(err.value)) == []


def test_pickled_getattr_reaches_history_buffer_statistics_only(tmp_path):
    """HistoryBuffer pickles its statistics methods as ``getattr(cls,
    name)``; the allow-listed ``getattr`` answers for those names only,
    with the name (nothing callable)."""
    class Sneaky:
        def __reduce__(self):
            return getattr, (np.ndarray, 'tofile')

    path = tmp_path / 'sneaky.pth'
    torch.save({'x': Sneaky()}, path)
    with pytest.raises(pickle.UnpicklingError, match='numpy.ndarray.tofile'):
        torch.load(path, weights_only=True)
    path = cc.write_checkpoint(str(tmp_path / 'mean.pth'), cc.pickle_of(
        cc.history_attribute('mean')))
    assert torch.load(path, weights_only=True) == 'HistoryBuffer.mean'


@pytest.mark.parametrize('name', ['TrustedNote', 'no_such_pkg.Thing',
                                  'tests.test_engine.test_safe_load.Nope',
                                  'os.system'])
def test_opt_in_rejects_names_that_do_not_import(name):
    with pytest.raises(ValueError, match='--trust-checkpoint-type'):
        trust_checkpoint_types([name])
