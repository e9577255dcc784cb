"""Hostile input from a file or a setting: a clear refusal, never a crash, a
hang or a memory blow-up (docs/reliability.md#checkpoints-are-data,
#bad-input-fails-before-training).

Each case runs in a child process (one per group, as the checkpoint fuzz
does: a crash must not take the test runner with it) and is measured
there: the child must exit normally (a signal, SIGFPE / SIGSEGV, fails the
group and names the case it died in), and each case's refusal must match
its message, take under 5 s and raise the process's peak memory by under
512 MiB (``/proc/self/clear_refs`` resets the peak before each case; its
setup, e.g. building a model, is not measured).

The cases: radii that overflow the kernels' arithmetic (through the module
constructors, the config, the hook and the compiled entry points);
checkpoints whose loading would crash (a sparse tensor with indices out of
range), hang (40k distinct names, ``Counter(bytearray(2**31))``, an
expanded view iterated) or blow up memory (bytearrays in ``meta``,
deflated records of 1 GiB, storages larger than their records, the legacy
format); and settings whose errors were unclear or missing.
"""
import json
import os
import re
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional

import pytest

from tests.helpers import crafted_checkpoints as cc

pytest.importorskip('mmseg')

MAX_SECONDS = 5.0
MAX_PEAK = 512 << 20
#: A refusal's message stays short whatever the file holds.
MAX_MESSAGE = 4000

CHILD = r'''
import json, sys, time


def status(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')  # the peak RSS becomes the current RSS
    except OSError:
        pass


spec = json.loads(sys.stdin.read())
scope = {'FILES': spec['files']}
exec(spec['prelude'], scope)
for case in spec['cases']:
    print(json.dumps({'start': case['name']}), flush=True)
    exec(case['setup'], scope)
    reset_peak()
    base = status('VmRSS:')
    start = time.perf_counter()
    try:
        exec(case['run'], scope)
        outcome = 'no error'
    except Exception as err:
        outcome = f'{type(err).__name__}: {err}'
    seconds = time.perf_counter() - start
    peak = max(status('VmHWM:') - base, 0)
    print(json.dumps({'name': case['name'], 'outcome': outcome,
                      'seconds': seconds, 'peak': peak}), flush=True)
'''


class Case(NamedTuple):
    name: str
    run: str
    expect: str  # a regex the outcome must match from its start
    setup: str = ''
    forbid: Optional[str] = None  # a regex the outcome must not contain


def run_group(prelude: str, cases: List[Case],
              files: Dict[str, str]) -> Dict[str, dict]:
    """Run ``cases`` in one child process; one record per case."""
    env = dict(os.environ, PYTHONPATH=cc.REPO, OMP_NUM_THREADS='1')
    spec = dict(prelude=prelude, files=files,
                cases=[c._asdict() for c in cases])
    proc = subprocess.run([sys.executable, '-c', CHILD],
                          input=json.dumps(spec), capture_output=True,
                          text=True, env=env, cwd=cc.REPO, timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines()
             if line.startswith('{')]
    started = [r['start'] for r in lines if 'start' in r]
    assert proc.returncode == 0, (
        f'the child exited with status {proc.returncode} in case '
        f'{started[-1] if started else None!r}: {proc.stderr[-3000:]}')
    return {r['name']: r for r in lines if 'name' in r}


def check(record: dict, case: Case) -> None:
    outcome = record['outcome']
    assert re.match(case.expect, outcome, re.S), outcome[:3000]
    if case.forbid:
        assert not re.search(case.forbid, outcome), outcome[:3000]
    assert len(outcome) < MAX_MESSAGE, (len(outcome), outcome[:500])
    assert record['seconds'] < MAX_SECONDS, record
    assert record['peak'] < MAX_PEAK, record


# ------------------------------------------------------------ checkpoints
LOADER_PRELUDE = '''
import torch
from mmseg_gf.engine.checkpoint.safe_load import (
    load_checkpoint_file, trust_checkpoint_types)
from mmseg_gf.engine.checkpoint.weights_export import export_weights
from mmengine.config import Config
from mmseg_gf.engine.entrypoints import resolve_resume
OUT = FILES['out']


def resume_from(path):
    import os, tempfile
    work_dir = tempfile.mkdtemp()
    with open(os.path.join(work_dir, 'last_checkpoint'), 'w') as f:
        f.write(path)
    resolve_resume(Config(dict(work_dir=work_dir)), True)
'''
REFUSED = r'RefusedCheckpointError: checkpoint refused: '
TOO_COSTLY = REFUSED + r'it declares {} of {} MiB in a file of .*cap of 64.0'

LOADER_CASES = [
    Case('sparse COO with indices out of range, loaded',
         "load_checkpoint_file(FILES['sparse_bad'])",
         REFUSED + r'.*size is inconsistent with indices'),
    Case('sparse COO with indices out of range, exported',
         "export_weights(FILES['sparse_bad'], OUT)",
         REFUSED + r'.*size is inconsistent with indices'),
    Case('valid sparse tensor, exported',
         "export_weights(FILES['sparse_ok'], OUT)",
         r"ValueError: .*state_dict\['w'\] is a torch.sparse_coo tensor; "
         'exported weights hold dense tensors only'),
    Case('40k distinct names',
         "load_checkpoint_file(FILES['names'])",
         REFUSED + r'it holds mod0.name0, mod1.name1, .* and 39980 more '
         'names, which are not among'),
    # 2 GiB of bytearray, then 8 bytes per element iterated
    Case('Counter(bytearray(2**31))',
         "load_checkpoint_file(FILES['counter'])",
         TOO_COSTLY.format(r'contents \(.*\)', '18432.0')),
    Case('Counter(bytearray(2**31)), the checkpoint --resume finds',
         "resume_from(FILES['counter'])",
         TOO_COSTLY.format(r'contents \(.*\)', '18432.0')),
    Case('three bytearray(1 << 30) in meta, exported',
         "export_weights(FILES['meta_bytearrays'], OUT)",
         TOO_COSTLY.format(r'contents \(.*\)', '3072.0')),
    # 2**31 float32 elements, then 256 bytes per 0-d tensor iterated
    Case('an expanded view of 2**31 elements iterated',
         "load_checkpoint_file(FILES['view'])",
         TOO_COSTLY.format(r'contents \(.*\)', '532480.0')),
    Case('a storage record deflated from 1 GiB',
         "load_checkpoint_file(FILES['storage_bomb'])",
         TOO_COSTLY.format('zip records', '1024.0')),
    Case('a data.pkl deflated from 1 GiB',
         "load_checkpoint_file(FILES['pickle_bomb'])",
         TOO_COSTLY.format('zip records', '1024.0')),
    Case('a storage declared larger than its record',
         "load_checkpoint_file(FILES['storage_past_record'])",
         REFUSED + r"it holds a storage '0' declared as 4000000 bytes whose "
         'record holds 4: a storage must fit in its record'),
    Case('a tensor whose size is not numbers',
         "load_checkpoint_file(FILES['size_not_numbers'])",
         REFUSED + r'it holds a tensor \(torch._utils._rebuild_tensor_v2\) '
         'whose size is not given as numbers'),
    Case('bytearray(2**31) in the legacy format',
         "load_checkpoint_file(FILES['legacy'])",
         TOO_COSTLY.format(r'contents \(.*\)', '2048.0')),
    Case('builtins.exec: no trust flag suggested',
         "load_checkpoint_file(FILES['exec'])",
         REFUSED + r'it holds builtins.exec, .* No trust flag allows '
         'builtins.exec', forbid=r'--trust-checkpoint-type builtins.exec'),
    Case('builtins.exec: the trust flag refuses it',
         "trust_checkpoint_types(['builtins.exec'])",
         r"ValueError: --trust-checkpoint-type 'builtins.exec': it runs "
         'code'),
]


def _sparse_file(path: str, index: int) -> str:
    import torch
    indices = torch.tensor([[0, index], [0, 1]])
    sparse = torch.sparse_coo_tensor(indices, torch.tensor([1., 2.]), (3, 3),
                                     check_invariants=False)
    torch.save({'state_dict': {'w': sparse}}, path)
    return path


def _legacy_file(path: str) -> str:
    import torch

    class Large:
        def __reduce__(self):
            return bytearray, (2**31, )

    torch.save({'w': torch.zeros(1), 'x': Large()}, path,
               _use_new_zipfile_serialization=False)
    return path


def _tensor_files(root, files: Dict[str, str]) -> None:
    """Files whose tensors declare more than they hold; the template's one
    storage record holds a single float."""
    import torch
    template = str(root / 'template.pth')
    torch.save({'w': torch.zeros(1)}, template)

    def write(name: str, body: bytes) -> None:
        files[name] = cc.write_checkpoint(str(root / f'{name}.pth'),
                                          cc.pickle_of(body), template)

    write('view', cc.call('collections.Counter', cc.tensor(
        cc.storage('0', 1), (2**31, ), (0, ))))
    write('storage_past_record', cc.tensor(cc.storage('0', 10**6), (4, ),
                                           (1, )))
    write('size_not_numbers', cc.call(
        'torch._utils._rebuild_tensor_v2', cc.storage('0', 1), cc.integer(0),
        cc.call('collections.Counter', cc.tup()), cc.tup(cc.integer(0)),
        cc.FALSE, cc.call('collections.OrderedDict')))


@pytest.fixture(scope='module')
def loader_records(tmp_path_factory):
    root = tmp_path_factory.mktemp('hostile')
    bytearray_call = cc.call('builtins.bytearray', cc.integer(1 << 30))
    bodies = {
        'names': cc.list_(*[cc.glob(f'mod{i}.name{i}')
                            for i in range(40000)]),
        'counter': cc.call('collections.Counter', cc.call(
            'builtins.bytearray', cc.integer(2**31))),
        'meta_bytearrays': cc.dict_({
            'meta': cc.dict_({k: bytearray_call for k in 'abc'}),
            'state_dict': cc.EMPTY_DICT}),
        'exec': cc.call('builtins.exec', cc.text('print(1)')),
    }
    files = {name: cc.write_checkpoint(str(root / f'{name}.pth'),
                                       cc.pickle_of(body))
             for name, body in bodies.items()}
    files['sparse_bad'] = _sparse_file(str(root / 'sparse_bad.pth'), 100)
    files['sparse_ok'] = _sparse_file(str(root / 'sparse_ok.pth'), 2)
    files['legacy'] = _legacy_file(str(root / 'legacy.pth'))
    _tensor_files(root, files)
    records = {'archive/version': b'3\n'}
    files['storage_bomb'] = cc.write_zip(
        str(root / 'storage_bomb.pth'),
        dict(records, **{'archive/data.pkl': cc.pickle_of(cc.tensor(
            cc.storage('0', 1), (1, ), (1, )))}),
        {'archive/data/0': 1 << 30})
    files['pickle_bomb'] = cc.write_zip(str(root / 'pickle_bomb.pth'),
                                        records, {'archive/data.pkl': 1 << 30})
    files['out'] = str(root / 'out.pth')
    return run_group(LOADER_PRELUDE, LOADER_CASES, files)


@pytest.mark.parametrize('case', LOADER_CASES, ids=lambda c: c.name)
def test_hostile_checkpoint_is_refused_in_bounds(loader_records, case):
    check(loader_records[case.name], case)


def test_bomb_files_are_small(tmp_path):
    """The bombs are what the cases claim: about 1/1000 of what they
    declare."""
    path = cc.write_zip(str(tmp_path / 'bomb.pth'), {},
                        {'archive/data/0': 1 << 30})
    assert os.path.getsize(path) < 2 << 20


# ------------------------------------------------------------------- ops
OPS_PRELUDE = '''
import torch
from torch import nn
from mmseg_gf.models.gf_linear import GFLinear, TokenGridSource
from mmseg_gf.ops import TokenGrid
from mmseg_gf.ops.resized_loss.loss import resized_cross_entropy


def filtered_step(radius):
    """GFLinear on a 3 x 5 grid, a trained input, one backward."""
    layer = GFLinear.from_linear(nn.Linear(4, 3).requires_grad_(False),
                                 radius, TokenGridSource(TokenGrid(3, 5)))
    x = torch.randn(2, 15, 4, requires_grad=True)
    layer(x).sum().backward()


def empty_linear_matches_nn_linear():
    torch.manual_seed(0)
    plain = nn.Linear(4, 0)
    gf = GFLinear.from_linear(nn.Linear(4, 0), 2,
                              TokenGridSource(TokenGrid(3, 5)))
    x = torch.randn(2, 15, 4, requires_grad=True)
    out = gf(x)
    out.sum().backward()
    assert out.shape == plain(x).shape == (2, 15, 0)
    assert torch.equal(x.grad, torch.zeros_like(x))
'''
RADIUS = (r'ValueError: gradient filter radius must be an int >= 1 and <= '
          r'65536 \(a patch side; larger than any feature map\), got {}')
NATIVE = ('from mmseg_gf import _patch_ops as P\n'
          'z, e = torch.zeros, torch.empty\n')

OPS_CASES = [
    Case('GFLinear radius 2**63 - 1', 'filtered_step(2**63 - 1)',
         RADIUS.format(2**63 - 1)),
    Case('GFLinear radius 2**40', 'filtered_step(2**40)',
         RADIUS.format(2**40)),
    Case('GFLinear radius 65536 runs', 'filtered_step(65536)', 'no error'),
    Case('token_filtered_backward radius 2**63 - 1',
         'P.token_filtered_backward(z(1, 3, 5, 3), z(1, 1, 1, 4), z(3, 4), '
         'e(1, 3, 5, 4), 2**63 - 1, True, True, 1 << 20, 0)',
         r'RuntimeError: radius must be in \[1, 65536\], got '
         f'{2**63 - 1}', setup=NATIVE),
    Case('GFLinear on nn.Linear(4, 0)', 'empty_linear_matches_nn_linear()',
         'no error'),
    Case('uint8 labels in the lean loss',
         'resized_cross_entropy(torch.zeros(1, 3, 2, 2), '
         'torch.zeros(1, 4, 4, dtype=torch.uint8))',
         r'ValueError: label must hold int64 class indices .* got '
         r'torch.uint8 of shape \(1, 4, 4\)'),
]


def _native_built() -> bool:
    from mmseg_gf.ops.backend import extension
    return extension.module('patch_ops') is not None


@pytest.fixture(scope='module')
def ops_records():
    cases = [c for c in OPS_CASES if c.setup != NATIVE or _native_built()]
    return run_group(OPS_PRELUDE, cases, {})


@pytest.mark.parametrize('case', OPS_CASES, ids=lambda c: c.name)
def test_hostile_op_setting_is_refused_in_bounds(ops_records, case):
    if case.name not in ops_records:
        pytest.skip('compiled CPU kernels not built')
    check(ops_records[case.name], case)


# -------------------------------------------------------------- settings
SETTINGS_PRELUDE = '''
import copy
from torch import nn
from mmseg_gf.engine.config import check_settings
from mmseg_gf.engine.hooks import GradFilterHook
from mmseg_gf.engine.selection import select_layers
from tests.helpers.engine_fixtures import build_model, model_cfg
SMALL = (64, 64)


def with_aux_head():
    from mmengine.config import ConfigDict
    from mmseg.registry import MODELS
    cfg = model_cfg('pspnet_r18')
    head = cfg['decode_head']
    cfg['auxiliary_head'] = dict(
        type='FCNHead', in_channels=head['in_channels'], channels=8,
        num_convs=1, concat_input=False, num_classes=head['num_classes'],
        loss_decode=dict(type='CrossEntropyLoss', loss_weight=0.4))
    return MODELS.build(ConfigDict(cfg))
'''
TINY = ('from tests.test_models.test_token_grids import tiny_model\n'
        'model = tiny_model({!r})\n')
PSPNET = "model = build_model('pspnet_r18')\n"
RADIUS_SETTING = (r"ValueError: gradient_filter radius must be an int >= 1, "
                  r"'auto' or a dict .*\(ints at most 65536\), got ")
INPUT_SIZE = (r'ValueError: gradient_filter input_size must be \(H, W\) '
              r'ints in \[1, 8192\] \(the size of the selection trace\), got '
              r'\(100000, 100000\)')

SETTINGS_CASES = [
    Case('config radius 2**40',
         'check_settings(dict(num_layers=2, radius=2**40))',
         RADIUS_SETTING + str(2**40)),
    Case('config radius dict with 2**63 - 1',
         "check_settings(dict(num_layers=2, radius={'*': 2**63 - 1}))",
         RADIUS_SETTING + r"\{'\*': " + str(2**63 - 1)),
    Case('hook radius 2**40', 'GradFilterHook(num_layers=2, radius=2**40)',
         RADIUS_SETTING + str(2**40)),
    Case('config input_size (100000, 100000)',
         'check_settings(dict(num_layers=2, input_size=(100000, 100000)))',
         INPUT_SIZE),
    Case('selection input_size (100000, 100000)',
         'select_layers(model, num_layers=2, input_size=(100000, 100000))',
         INPUT_SIZE, setup=PSPNET),
    Case("layers=['']", "select_layers(model, layers=[''], input_size=SMALL)",
         r"ValueError: gradient_filter layers: '' is no module path",
         setup=PSPNET),
    Case("layers=['auxiliary_head.conv_seg']",
         "select_layers(model, layers=['auxiliary_head.conv_seg'], "
         'input_size=SMALL)',
         r"ValueError: gradient_filter layers: 'auxiliary_head.conv_seg' is "
         r"an auxiliary head's classifier", setup='model = with_aux_head()\n'),
    Case("layers=['decode_head.conv_seg']",
         "select_layers(model, layers=['decode_head.conv_seg'], "
         'input_size=SMALL)',
         r"ValueError: gradient_filter layers: 'decode_head.conv_seg' is "
         r"a decode head's classifier", setup=PSPNET),
    Case('radius key of an unselected layer',
         "select_layers(model, num_layers=2, radius={'*': 2, "
         "'backbone.layer1': 8}, input_size=SMALL)",
         r"ValueError: gradient_filter radius: key 'backbone.layer1' would be "
         'ignored: it names no selected layer', setup=PSPNET),
    Case("layer_kinds=['attention'] on Swin",
         "select_layers(model, num_layers=2, layer_kinds=['attention'], "
         'input_size=SMALL)',
         r"ValueError: gradient_filter: EncoderDecoder runs no layer of the "
         r"kinds \['attention'\] .*the kinds it runs besides its "
         r"classifiers: \['conv2d', 'linear'\]",
         setup=TINY.format('swin_t'), forbid='nn.Conv2d'),
    Case("layer_kinds=['linear'] on Segformer",
         "select_layers(model, num_layers=2, layer_kinds=['linear'], "
         'input_size=SMALL)',
         r"ValueError: gradient_filter: EncoderDecoder runs no layer of the "
         r"kinds \['linear'\] .*the kinds it runs besides its classifiers: "
         r"\['conv2d', 'attention'\]",
         setup=TINY.format('segformer_b0'), forbid='nn.Conv2d'),
    Case("radius key of an attention's out_proj",
         'select_layers(model, layers=[attn], radius={"*": 2, '
         'attn + ".out_proj": 4}, input_size=SMALL)',
         r"ValueError: gradient_filter radius: key '.*\.out_proj' would be "
         r"ignored: it is a part of the selected layer '.*', whose radius "
         'applies to the whole layer',
         setup=TINY.format('segformer_b0') + (
             'attn = [n for n, m in model.named_modules()\n'
             '        if isinstance(m, nn.MultiheadAttention)][-1]\n')),
]


@pytest.fixture(scope='module')
def settings_records():
    return run_group(SETTINGS_PRELUDE, SETTINGS_CASES, {})


@pytest.mark.parametrize('case', SETTINGS_CASES, ids=lambda c: c.name)
def test_hostile_setting_is_refused_in_bounds(settings_records, case):
    check(settings_records[case.name], case)
