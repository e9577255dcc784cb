"""tools/export_weights.py: a Runner's checkpoint (message hub of
HistoryBuffers, numpy values, optimizer state) becomes a file of tensors
and plain data that mmseg's own ``init_model`` loads, with torch's default
``weights_only=True``, in a process that cannot import the plugin, and
predicts as the original model does
(``mmseg_gf/engine/checkpoint/weights_export.py``)."""
import collections
import json
import os.path as osp
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from mmseg_gf.engine.checkpoint.pickle_scan import (checkpoint_pickle,
                                                    names_in_pickle)
from mmseg_gf.engine.checkpoint.weights_export import plain_data
from tests.helpers.engine_fixtures import (
    build_model, make_tiny_voc, model_cfg, run_training, runner_cfg)
from tests.helpers.tools import load_tool

CLASSES = ('background', 'road', 'car')
PALETTE = [[0, 0, 0], [128, 64, 128], [0, 0, 142]]

# Run with ``python -I`` (no PYTHONPATH, no current directory on sys.path)
# and an import blocker: the editable install would otherwise still find
# the plugin through site-packages.
PLAIN_MMSEG = r'''
import json
import sys


class NoPlugin:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'mmseg_gf':
            raise ImportError(f'{name}: plain mmseg must not import it')


sys.meta_path.insert(0, NoPlugin())
import numpy as np
import torch
from mmseg.apis import init_model

config, exported, raw, inputs = sys.argv[1:5]
try:
    torch.load(raw, map_location='cpu')
    raw_error = None
except Exception as err:
    raw_error = f'{type(err).__name__}: {err}'
model = init_model(config, exported, device='cpu')
with torch.no_grad():
    logits = model(torch.from_numpy(np.load(inputs)), mode='tensor')
np.save(inputs + '.out.npy', logits.numpy())
print(json.dumps(dict(
    raw_error=raw_error, classes=list(model.dataset_meta['classes']),
    palette=[list(p) for p in model.dataset_meta['palette']],
    plugin=sorted(m for m in sys.modules if m.startswith('mmseg_gf')))))
'''


def _runner_checkpoint(path: str, model: torch.nn.Module) -> str:
    """What mmengine's Runner writes (``save_checkpoint``): DDP-prefixed
    keys, meta with the config text, numpy values, optimizer state, a
    message hub holding HistoryBuffers."""
    from mmengine.logging import MessageHub
    from mmengine.runner import save_checkpoint
    hub = MessageHub.get_instance('export-weights-test')
    hub.update_scalar('train/loss', 0.5)
    hub.update_scalar('train/loss', np.float64(0.25))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32), mode='tensor').sum().backward()
    optimizer.step()
    save_checkpoint(dict(
        meta=dict(cfg='model = dict(...)\n', seed=np.int64(3), iter=20,
                  dataset_meta=dict(classes=CLASSES,
                                    palette=np.array(PALETTE),
                                    reduce_zero_label=False,
                                    label_map=None)),
        state_dict=collections.OrderedDict(
            ('module.' + k, v) for k, v in model.state_dict().items()),
        optimizer=optimizer.state_dict(), message_hub=hub.state_dict()),
        path)
    return path


def test_exported_weights_load_into_plain_mmseg(tmp_path):
    from mmengine.config import Config
    torch.manual_seed(0)
    model = build_model('pspnet_r18')
    raw = _runner_checkpoint(str(tmp_path / 'iter_20.pth'), model)
    exported = str(tmp_path / 'weights.pth')
    summary = load_tool('export_weights').main([raw, exported])
    assert summary['keys'] == len(model.state_dict())
    assert summary['left_out'] == []
    saved = torch.load(exported, weights_only=True)
    assert set(saved) == {'meta', 'state_dict'}
    assert saved['meta']['cfg'] == 'model = dict(...)\n'
    assert saved['meta']['iter'] == 20
    assert {'mmseg_version', 'mmengine_version', 'torch_version'} <= set(
        saved['meta'])
    config = str(tmp_path / 'model.py')
    Config(dict(model=model_cfg('pspnet_r18'))).dump(config)
    inputs = str(tmp_path / 'inputs.npy')
    np.save(inputs, torch.randn(1, 3, 64, 64).numpy())
    proc = subprocess.run(
        [sys.executable, '-I', '-c', PLAIN_MMSEG, config, exported, raw,
         inputs], capture_output=True, text=True, cwd=str(tmp_path),
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out['plugin'] == []
    # The training checkpoint itself needs the plugin (or this export):
    # torch refuses its numpy values and HistoryBuffers.
    assert re.search(r'GLOBAL (numpy|mmengine)\S* was not an allowed '
                     'global', out['raw_error']), out['raw_error']
    assert out['classes'] == list(CLASSES) and out['palette'] == PALETTE
    model.eval()
    with torch.no_grad():
        expected = model(torch.from_numpy(np.load(inputs)), mode='tensor')
    plain = np.load(inputs + '.out.npy')
    np.testing.assert_allclose(plain, expected.numpy(), rtol=0, atol=1e-6)
    assert (plain.argmax(1) == expected.numpy().argmax(1)).all()


def test_export_refuses_what_is_not_plain(tmp_path):
    with pytest.raises(TypeError, match='object'):
        plain_data({'x': object()})
    path = str(tmp_path / 'no_state.pth')
    torch.save({'meta': {}}, path)
    with pytest.raises(ValueError, match='holds no state dict'):
        load_tool('export_weights').main([path, str(tmp_path / 'out.pth')])
    assert not osp.exists(tmp_path / 'out.pth')


def test_hook_exports_the_runs_last_checkpoint(tmp_path):
    """``ExportWeightsHook`` after a real Runner's run: the last checkpoint
    (dataset metainfo from PascalVOCDataset, message hub, optimizer) also
    as ``iter_N_weights.pth``, naming nothing beyond torch's allow-list."""
    from mmseg.datasets import PascalVOCDataset
    from torch._weights_only_unpickler import _get_allowed_globals
    voc = make_tiny_voc(str(tmp_path / 'data'), num_train=2, num_val=1)
    cfg = runner_cfg(str(tmp_path / 'work'), voc, max_iters=1)
    cfg['custom_hooks'] = [dict(type='ExportWeightsHook')]
    runner = run_training(cfg)
    exported = str(tmp_path / 'work' / 'iter_1_weights.pth')
    assert set(names_in_pickle(checkpoint_pickle(exported))) <= set(
        _get_allowed_globals())
    saved = torch.load(exported, weights_only=True)
    classes = PascalVOCDataset.METAINFO['classes']
    assert tuple(saved['meta']['dataset_meta']['classes']) == classes
    assert 'cfg' in saved['meta'] and 'message_hub' not in saved
    state = runner.model.state_dict()
    assert saved['state_dict'].keys() == state.keys()
    assert all(torch.equal(saved['state_dict'][k], v)
               for k, v in state.items())
