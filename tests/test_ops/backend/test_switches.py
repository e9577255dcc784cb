"""mmseg_gf.ops.backend.switches: the one list of switches, read once, overridable
in a block; every ``MMSEG_GF_*`` name the sources use is declared in it,
and docs/switches.md is its table."""
import ast
import re
from pathlib import Path

import pytest
import torch

from mmseg_gf.ops.backend import cpu_settings, extension, output_pool, switches

REPO = Path(__file__).resolve().parents[3]
#: Where switch names are written: Python, docs, the build's scripts. The
#: C++ sources count only through ``getenv("...")``: their other
#: ``MMSEG_GF_*`` names are preprocessor macros.
SCANNED = ('mmseg_gf/**/*.py', 'tools/*.py', 'tests/**/*.py', 'setup.py',
           'Makefile', '.ci/*', 'README.md', 'docs/**/*.md')
NAME = re.compile(r'\bMMSEG_GF_[A-Z0-9_]*[A-Z0-9]\b')
GETENV = re.compile(r'getenv\("([A-Z0-9_]+)"\)')


class _Environment:
    """``monkeypatch``'s setenv / delenv, each followed by the reread that
    a process started with that environment does at import."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch = monkeypatch

    def setenv(self, name: str, text: str, reread: bool = True) -> None:
        self.monkeypatch.setenv(name, text)
        if reread:
            switches.reread(name)

    def delenv(self, name: str, raising: bool = True) -> None:
        self.monkeypatch.delenv(name, raising=raising)
        switches.reread(name)


@pytest.fixture
def fresh(monkeypatch):
    """The environment of the test, read as at import; what was read
    before the test is read again after it."""
    yield _Environment(monkeypatch)
    monkeypatch.undo()
    switches.reread()


def test_the_environment_is_read_once_until_reread(fresh):
    fresh.setenv('MMSEG_GF_FUZZ_SEED', '7')
    assert switches.value('MMSEG_GF_FUZZ_SEED') == 7
    fresh.setenv('MMSEG_GF_FUZZ_SEED', '8', reread=False)
    assert switches.value('MMSEG_GF_FUZZ_SEED') == 7
    switches.reread('MMSEG_GF_FUZZ_SEED')
    assert switches.value('MMSEG_GF_FUZZ_SEED') == 8


def test_unset_or_empty_takes_the_default(fresh):
    fresh.delenv('MMSEG_GF_NATIVE', raising=False)
    fresh.setenv('MMSEG_GF_TRITON', '')
    assert switches.value('MMSEG_GF_NATIVE') is True
    assert switches.value('MMSEG_GF_TRITON') is True
    assert switches.value('checkpoint_floor_bytes') == 64 << 20


@pytest.mark.parametrize('text, on', [('0', False), ('1', True),
                                      ('no', True), ('false', True)])
def test_kernel_switches_are_on_unless_zero(fresh, text, on):
    fresh.setenv('MMSEG_GF_NATIVE', text)
    assert switches.value('MMSEG_GF_NATIVE') is on


@pytest.mark.parametrize('text, on', [('1', True), ('True', True),
                                      ('on', True), ('0', False),
                                      ('off', False)])
def test_triton_interpret_reads_as_triton_does(fresh, text, on):
    fresh.setenv('TRITON_INTERPRET', text)
    assert switches.value('TRITON_INTERPRET') is on


def test_a_bad_value_is_named_and_not_cached(fresh):
    fresh.setenv('MMSEG_GF_CHECKPOINT_COST_FACTOR', '0.5')
    for _ in range(2):
        with pytest.raises(ValueError,
                           match='MMSEG_GF_CHECKPOINT_COST_FACTOR must be'):
            switches.value('MMSEG_GF_CHECKPOINT_COST_FACTOR')
    fresh.setenv('MMSEG_GF_CHECKPOINT_COST_FACTOR', '6')
    assert switches.value('MMSEG_GF_CHECKPOINT_COST_FACTOR') == 6.0


def test_override_nests_and_restores():
    before = switches.value('MMSEG_GF_NATIVE')
    with switches.override(MMSEG_GF_NATIVE=False):
        assert switches.value('MMSEG_GF_NATIVE') is False
        with switches.override(MMSEG_GF_NATIVE=True):
            assert switches.value('MMSEG_GF_NATIVE') is True
        assert switches.value('MMSEG_GF_NATIVE') is False
    assert switches.value('MMSEG_GF_NATIVE') is before


def test_override_restores_what_the_environment_gave(fresh):
    fresh.setenv('MMSEG_GF_FUZZ_SEED', '5')
    with switches.override(MMSEG_GF_FUZZ_SEED=3):
        assert switches.value('MMSEG_GF_FUZZ_SEED') == 3
    assert switches.value('MMSEG_GF_FUZZ_SEED') == 5


def _pool_limit() -> int:
    """The output pool's limit in bytes, as the compiled kernels hold it
    (set and set back: the extension has no getter)."""
    limit = output_pool.recycle_limit(0)
    output_pool.recycle_limit(limit)
    return limit


def _kept_after_freeing(nbytes: int) -> int:
    """Bytes the pool keeps once a fresh output of ``nbytes`` dies."""
    output_pool.release_recycled()
    out = output_pool.empty_for_writing([nbytes // 4], torch.empty(0))
    del out
    return output_pool.recycled_bytes()


@pytest.mark.skipif(not extension.built(), reason='compiled kernels not built')
def test_override_reaches_the_pool_limit_the_kernels_hold():
    """``MMSEG_GF_RECYCLE_MB`` is read by C++ when the pool starts; an
    override sets the pool's limit itself (native binds the extension's
    setter), so a freed output is not kept inside ``=0``, and the limit
    before, in bytes, is back afterwards."""
    previous = output_pool.recycle_limit((7 << 20) + 4096)
    try:
        with switches.override(MMSEG_GF_NATIVE=True):
            assert _kept_after_freeing(1 << 20) == 1 << 20
            with switches.override(MMSEG_GF_RECYCLE_MB=0):
                assert _pool_limit() == 0
                assert _kept_after_freeing(1 << 20) == 0
                with switches.override(MMSEG_GF_RECYCLE_MB=3):
                    assert _pool_limit() == 3 << 20
                assert _pool_limit() == 0
            assert _pool_limit() == (7 << 20) + 4096
    finally:
        output_pool.recycle_limit(previous)
        output_pool.release_recycled()


@pytest.mark.skipif(not extension.built(), reason='compiled kernels not built')
def test_override_reaches_the_kernels_toggles():
    before = cpu_settings.set_onednn_products(True)
    cpu_settings.set_onednn_products(before)
    with switches.override(onednn_products=not before):
        assert cpu_settings.set_onednn_products(not before) is (not before)
    assert cpu_settings.set_onednn_products(before) is before


def test_switches_no_owner_can_set_are_refused_by_override():
    """glibc's ``mallopt`` has no getter to restore from: its toggle
    stays with its own function."""
    with pytest.raises(KeyError, match='keep_freed_cpu_memory'):
        switches.override(keep_freed_cpu_memory=True).__enter__()
    with pytest.raises(KeyError, match='outside Python'):
        switches.bind_applier('MMSEG_GF_NATIVE', lambda value: None)
    with pytest.raises(TypeError, match='takes a int'):
        switches.override(MMSEG_GF_RECYCLE_MB='0').__enter__()


def test_reading_a_switch_writes_nothing(fresh):
    """``value`` has no side effect once the module is imported (what
    ``torch.compile`` needs inside autograd Functions)."""
    fresh.setenv('MMSEG_GF_TRITON', '0')
    state = dict(switches._environment), dict(switches._runtime)
    for name, switch in switches.SWITCHES.items():
        if switch.reader == switches.PYTHON:
            switches.value(name)
    assert (dict(switches._environment), dict(switches._runtime)) == state


def test_a_value_set_at_run_time_wins_until_set_back():
    with switches.override(MMSEG_GF_TRITON=False):
        assert switches.set_value('MMSEG_GF_TRITON', True) is None
        try:
            assert switches.value('MMSEG_GF_TRITON') is True
        finally:
            assert switches.set_value('MMSEG_GF_TRITON', None) is True
        assert switches.value('MMSEG_GF_TRITON') is False


def test_values_follow_every_change(fresh):
    """The kept tuple of :func:`switches.values` is read again after a run-time
    value, an override (in and out) and a reread."""
    names = ('MMSEG_GF_TRITON', 'MMSEG_GF_FUZZ_SEED')
    fresh.setenv('MMSEG_GF_FUZZ_SEED', '5')
    triton = switches.value('MMSEG_GF_TRITON')
    assert switches.values(names) == (triton, 5)
    with switches.override(MMSEG_GF_FUZZ_SEED=3):
        assert switches.values(names) == (triton, 3)
        switches.set_value('MMSEG_GF_TRITON', not triton)
        try:
            assert switches.values(names) == (not triton, 3)
        finally:
            switches.set_value('MMSEG_GF_TRITON', None)
        assert switches.values(names) == (triton, 3)
    assert switches.values(names) == (triton, 5)
    fresh.setenv('MMSEG_GF_FUZZ_SEED', '8')
    assert switches.values(names) == (triton, 8)


@pytest.mark.parametrize('call', [
    lambda: switches.override(MMSEG_GF_NATIVE='0').__enter__(),
    lambda: switches.set_value('MMSEG_GF_FUZZ_SEED', True),
    lambda: switches.set_value('checkpoint_floor_bytes', 1.5),
])
def test_values_of_the_wrong_type_are_refused(call):
    with pytest.raises(TypeError, match='takes a'):
        call()
    assert switches.value('MMSEG_GF_NATIVE') in (True, False)


def test_undeclared_and_foreign_switches_are_refused():
    with pytest.raises(KeyError, match='no switch'):
        switches.value('NO_SUCH_SWITCH')
    with pytest.raises(KeyError, match='output_pool.recycle_limit'):
        switches.value('MMSEG_GF_RECYCLE_MB')
    with pytest.raises(KeyError, match='setup.py'):
        switches.override(MMSEG_GF_UNITY_BUILD=False).__enter__()


def _names_in_sources():
    found = {}
    for pattern in SCANNED:
        for path in REPO.glob(pattern):
            if path.is_file():
                for name in NAME.findall(path.read_text(errors='replace')):
                    found.setdefault(name, str(path.relative_to(REPO)))
    for path in (REPO / 'mmseg_gf/ops/csrc').glob('*.cpp'):
        for name in GETENV.findall(path.read_text()):
            found.setdefault(name, str(path.relative_to(REPO)))
    return found


def test_every_switch_name_in_the_sources_is_declared():
    found = _names_in_sources()
    assert {'MMSEG_GF_NATIVE', 'MMSEG_GF_RECYCLE_MB',
            'MMSEG_GF_BUILD_NATIVE'} <= set(found)  # the scan sees them
    undeclared = {n: where for n, where in found.items()
                  if n not in switches.SWITCHES}
    assert not undeclared, f'declare them in mmseg_gf/ops/backend/switches.py: ' \
                           f'{undeclared}'


def test_every_setter_exists():
    """Named by path, not imported: engine's need mmseg."""
    for switch in switches.SWITCHES.values():
        if not switch.setter:
            continue
        module, _, function = switch.setter.rpartition('.')
        path = REPO / (module.replace('.', '/') + '.py')
        tree = ast.parse(path.read_text())
        names = {node.name for node in tree.body
                 if isinstance(node, ast.FunctionDef)}
        assert function in names, switch.setter


def test_the_doc_is_the_list():
    doc = (REPO / 'docs/switches.md').read_text()
    assert switches.markdown() in doc, (
        'docs/switches.md: paste python -c "from mmseg_gf.ops.backend import '
        'switches; print(switches.markdown())"')
