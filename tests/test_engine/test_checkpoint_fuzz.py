"""Fuzz test of the checkpoint loader
(``mmseg_gf/engine/checkpoint/safe_load.py``).

Hundreds of crafted pickles, each loaded in a child process both by the
plugin's loader and by plain ``torch.load(weights_only=True)`` after
``import mmseg_gf`` (what mmseg's own tools do with the plugin imported):

* every name the plugin allow-lists, and torch's own rebuild functions,
  called (REDUCE), created (NEWOBJ), given a state (BUILD), reached through
  ``getattr`` and passed to torch's ``_rebuild_from_type_v2``, with hostile
  arguments drawn from a pool
  (object / void / datetime dtypes, hand-set dtype states, wrong byte
  counts, huge and negative sizes, HistoryBuffer states, payloads that
  would write a marker file if any code ran);
* opcode-level mutations of a real mmengine checkpoint (state dict, meta,
  a message hub of HistoryBuffers, saved by
  ``mmengine.runner.save_checkpoint``): chunks deleted, duplicated,
  swapped, strings and globals replaced, bytes flipped, truncated.

Each load must end normally (the child's exit status: never a signal),
create no marker file, leave HistoryBuffer's class state and numpy's
built-in dtypes unchanged, and either be refused (the plugin's
``RefusedCheckpointError``; for plain torch.load any exception) or give
plain data (tensors, containers, plain values, numpy values of plain
dtypes, HistoryBuffers holding those), which is then printed in full.

Seeded: ``MMSEG_GF_FUZZ_SEED`` picks another seed; a failure names the
file, and the same seed rebuilds it.
"""
import pickletools
import random
from typing import List

import pytest

from mmseg_gf.engine.checkpoint.safe_load import mmengine_checkpoint_types
from mmseg_gf.ops.backend import switches
from tests.helpers import crafted_checkpoints as cc

SEED = switches.value('MMSEG_GF_FUZZ_SEED')
MARKER = '@MARKER@'
#: torch's own allow-listed callables that rebuild data: fuzzed with the
#: plugin's names, since their arguments can be the stand-ins' results.
TORCH_NAMES = [
    'torch._utils._rebuild_tensor_v2', 'torch._utils._rebuild_tensor',
    'torch._utils._rebuild_parameter',
    'torch._utils._rebuild_parameter_with_state',
    'torch._utils._rebuild_device_tensor_from_numpy', 'torch.Size',
    'torch.device', 'torch.FloatStorage', 'torch.serialization._get_layout',
    'collections.OrderedDict', '_codecs.encode', 'builtins.bytearray',
    'builtins.set', 'builtins.complex'
]

_HOSTILE_TEXT = ['O8', 'O', 'V8', 'M8[s]', 'f8', 'i4', 'U0', 'U3', 'S0',
                 'b1', '|O', 'f8,O', 'x' * 300, '', 'register_statistics',
                 '_statistics_methods', '__class__', '__init__', 'update',
                 'mean', 'max', 'tofile', 'latin1', MARKER]


def _hostile_leaves() -> List[bytes]:
    object_dtype = cc.dtype('O8', cc.dtype_state('|', flags=0))
    return [
        cc.NONE, cc.TRUE, cc.FALSE, cc.integer(0), cc.integer(1),
        cc.integer(-1), cc.integer(3), cc.integer(63), cc.integer(2**31 - 1),
        cc.integer(2**40), cc.integer(-2**70),
        cc.raw(b''), cc.raw(b'b'), cc.raw(b'AAAAAAAA'), cc.raw(b'\x02' * 8),
        cc.raw(bytes(range(256))), cc.raw(b'\xff' * 4),
        cc.tup(), cc.tup(cc.integer(0)), cc.tup(cc.integer(-1)),
        cc.tup(cc.integer(2**31 - 1), cc.integer(2**31 - 1)),
        cc.tup(cc.integer(1)), cc.EMPTY_DICT, cc.EMPTY_LIST,
        cc.dtype('f8'), cc.dtype('U3'), cc.dtype('i8'), object_dtype,
        cc.dtype('f8', cc.dtype_state('>')),
        cc.dtype('f8', cc.dtype_state(flags=63)),
        cc.dtype('f8', cc.dtype_state('|', elsize=16, alignment=32)),
        cc.dtype_state(), cc.dtype_state('|', flags=-1),
        cc.array([1], cc.dtype('f8'), b'\0' * 8),
        cc.array([2], cc.dtype('b1'), b'\0\1'),
        cc.call(cc.SCALAR, cc.dtype('f8'), cc.raw(b'\0' * 8)),
        cc.glob('numpy.ndarray'), cc.glob(cc.HISTORY_BUFFER),
        cc.glob('builtins.getattr'), cc.glob(cc.REBUILD_FROM_TYPE),
        cc.glob('torch.Tensor'), cc.glob('collections.OrderedDict'),
        cc.history_attribute('register_statistics'),
        cc.history_attribute('mean'), cc.history_attribute('__class__'),
        cc.newobj(cc.HISTORY_BUFFER),
        cc.dict_({'statistics_methods': cc.dict_(
            {'mean': cc.history_attribute('max')})}),
        cc.call('builtins.open', cc.text(MARKER), cc.text('w')),
        cc.call('tests.helpers.crafted_checkpoints.touch_marker',
                cc.text(MARKER)),
    ] + [cc.text(t) for t in _HOSTILE_TEXT]


def _allowed_names() -> List[str]:
    return sorted({name for _, name in mmengine_checkpoint_types()})


class _Generator:
    """Random hostile pickles from the pool and the allowed names."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.leaves = _hostile_leaves()
        self.names = _allowed_names() + [cc.REBUILD_FROM_TYPE] + TORCH_NAMES

    def value(self, depth: int = 0) -> bytes:
        rng = self.rng
        kind = rng.random()
        if depth >= 2 or kind < 0.5:
            return rng.choice(self.leaves)
        if kind < 0.65:
            return cc.tup(*[self.value(depth + 1)
                            for _ in range(rng.randint(0, 4))])
        if kind < 0.8:
            return self.call(rng.choice(self.names), depth + 1)
        if kind < 0.9:
            return cc.build(self.value(depth + 1), self.value(depth + 1))
        return cc.dict_({rng.choice(['max_length', '_log_history',
                                     '_count_history', 'statistics_methods',
                                     'x']): self.value(depth + 1)
                         for _ in range(rng.randint(0, 4))})

    def call(self, name: str, depth: int = 0) -> bytes:
        rng = self.rng
        args = [self.value(depth + 1) for _ in range(rng.randint(0, 4))]
        how = rng.randrange(5)
        if how == 0:
            return cc.call(name, *args)
        if how == 1:
            return cc.newobj(name, *args)
        if how == 2:
            return cc.build(cc.call(name, *args), self.value(depth + 1))
        if how == 3:
            return cc.call(cc.REBUILD_FROM_TYPE, cc.glob(name),
                           self.value(depth + 1), cc.tup(*args),
                           self.value(depth + 1))
        return cc.call(cc.call('builtins.getattr', cc.glob(name),
                               cc.text(rng.choice(_HOSTILE_TEXT))), *args)


def _chunks(data: bytes) -> List[bytes]:
    """The pickle cut at its opcodes."""
    starts = [pos for _, _, pos in pickletools.genops(data)] + [len(data)]
    return [data[a:b] for a, b in zip(starts, starts[1:])]


def _mutate(rng: random.Random, data: bytes, names: List[str]) -> bytes:
    chunks = _chunks(data)
    for _ in range(rng.randint(1, 3)):
        if len(chunks) < 3:
            break
        i = rng.randrange(1, len(chunks) - 1)
        j = rng.randrange(1, len(chunks) - 1)
        how = rng.randrange(8)
        if how == 0:
            del chunks[i]
        elif how == 1:
            chunks.insert(i, chunks[j])
        elif how == 2:
            chunks[i], chunks[j] = chunks[j], chunks[i]
        elif how in (3, 4, 5):
            opcode = {3: b'X', 4: b'c', 5: b'K'}[how]
            found = [k for k, c in enumerate(chunks) if c[:1] == opcode]
            if not found:
                continue
            k = rng.choice(found)
            if how == 3:
                chunks[k] = cc.text(rng.choice(_HOSTILE_TEXT))
            elif how == 4:
                chunks[k] = cc.glob(rng.choice(names + [
                    'builtins.open',
                    'tests.helpers.crafted_checkpoints.touch_marker']))
            else:
                chunks[k] = cc.integer(rng.choice(
                    [0, 1, 2, 7, 63, 255, 2**31 - 1, -1]))
        elif how == 6:
            chunks[i] = rng.choice(_hostile_leaves())
        else:
            del chunks[i:i + rng.randint(1, 20)]
    out = bytearray(b''.join(chunks))
    if rng.random() < 0.2 and len(out) > 2:
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(2, len(out))] = rng.randrange(256)
    if rng.random() < 0.05 and len(out) > 2:
        out = out[:rng.randrange(2, len(out))]
    return bytes(out)


@pytest.fixture(scope='module')
def fuzz_files(tmp_path_factory):
    root = tmp_path_factory.mktemp('fuzz')
    marker = str(root / 'marker')
    rng = random.Random(SEED)
    generator = _Generator(rng)
    reference = cc.save_mmengine_checkpoint(str(root / 'reference.pth'))
    original = cc.data_pickle(reference)
    names = _allowed_names()
    bodies = []
    for name in names + [cc.REBUILD_FROM_TYPE] + TORCH_NAMES:
        bodies += [cc.pickle_of(generator.call(name)) for _ in range(16)]
    bodies += [cc.pickle_of(generator.value()) for _ in range(200)]
    bodies += [_mutate(rng, original, names) for _ in range(500)]
    paths = [reference]
    for k, body in enumerate(bodies):
        body = body.replace(cc.text(MARKER), cc.text(marker))
        paths.append(cc.write_checkpoint(str(root / f'case{k:04d}.pth'),
                                         body, template=reference))
    return paths, marker


@pytest.mark.parametrize('loader', ['plugin', 'torch'])
def test_no_crafted_checkpoint_crashes_or_changes_the_process(fuzz_files,
                                                              loader):
    paths, marker = fuzz_files
    records = cc.load_in_child(paths, marker, loader=loader, timeout=300)
    assert len(records) == len(paths) > 1000
    assert records[0]['outcome'] == 'data', records[0]  # the reference
    bad = [r for r in records
           if r['outcome'] not in ('refused', 'data') or r['marker']
           or not r['class_state_kept']]
    assert not bad, f'seed {SEED}: {bad[:5]}'
    outcomes = [r['outcome'] for r in records]
    # The fuzz reaches both ends: files that load and files refused.
    assert outcomes.count('data') > 10 and outcomes.count('refused') > 100
