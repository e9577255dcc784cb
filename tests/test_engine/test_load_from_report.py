"""The ``load_from`` report of a source model with another class count
(``mmseg_gf/engine/checkpoint/matching.py``): shape mismatches first,
re-initialised
keys apart from dropped ones, no mismatch hidden under "(N more)"."""
import copy
import logging

import pytest
import torch

from mmseg_gf.engine.checkpoint import check_checkpoint_matches
from tests.helpers.engine_fixtures import build_model, model_cfg


def _source_model():
    """PSPNet-R18 as trained on a 19-class dataset, with an FCN auxiliary
    head (mmseg's Cityscapes configs)."""
    from mmengine.config import ConfigDict
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS
    init_default_scope('mmseg')
    cfg = copy.deepcopy(model_cfg('pspnet_r18'))
    cfg['decode_head']['num_classes'] = 19
    cfg['auxiliary_head'] = dict(
        type='FCNHead', in_channels=256, in_index=2, channels=64,
        num_convs=1, concat_input=False, dropout_ratio=0.1, num_classes=19,
        norm_cfg=dict(type='BN', requires_grad=True), align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False,
                         loss_weight=0.4))
    return MODELS.build(ConfigDict(cfg))


@pytest.fixture
def warnings():
    from mmengine.logging import MMLogger
    logger = MMLogger.get_instance('gf_load_from_report_test')
    messages = []

    class Collect(logging.Handler):

        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logger.addHandler(handler)
    yield logger, messages
    logger.removeHandler(handler)


def test_classifier_mismatch_listed_first_aux_keys_dropped(tmp_path,
                                                           warnings):
    logger, messages = warnings
    path = str(tmp_path / 'cityscapes.pth')
    torch.save({'state_dict': _source_model().state_dict()}, path)
    model = build_model('pspnet_r18')  # 3 classes, no auxiliary head
    check_checkpoint_matches(model, path, logger=logger)
    assert len(messages) == 1
    report = messages[0]
    channels = model.decode_head.conv_seg.in_channels
    first = report.index('re-initialised, shapes differ: ')
    assert report[first:].startswith(
        're-initialised, shapes differ: decode_head.conv_seg.weight: '
        f'checkpoint (19, {channels}, 1, 1) vs model (3, {channels}, 1, 1);'
        ' decode_head.conv_seg.bias: checkpoint (19,) vs model (3,)')
    dropped = report.index('dropped, not in the model: ')
    assert first < dropped
    assert 'auxiliary_head.conv_seg.{weight, bias}' in report[dropped:]
    assert 'auxiliary_head.convs.0.bn.{weight, bias, running_mean, ' \
        'running_var, num_batches_tracked}' in report[dropped:]
    assert 'more)' not in report and 'not in the checkpoint' not in report


def test_model_keys_the_file_lacks_are_reinitialised(tmp_path, warnings):
    """A source without the classifier: the model's classifier keys are
    re-initialised (not in the checkpoint), nothing dropped."""
    logger, messages = warnings
    model = build_model('pspnet_r18')
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith('decode_head.conv_seg.')}
    path = str(tmp_path / 'headless.pth')
    torch.save({'state_dict': state}, path)
    check_checkpoint_matches(model, path, logger=logger)
    assert messages and messages[0].endswith(
        're-initialised, not in the checkpoint: '
        'decode_head.conv_seg.{weight, bias}')
    assert 'dropped' not in messages[0]


def test_error_lists_every_shape_mismatch_first(tmp_path):
    """Another model's checkpoint: the error's shape mismatches come
    first, all of them."""
    model = build_model('pspnet_r18')
    state = dict(model.state_dict())
    wide = [k for k, v in state.items() if k.startswith('backbone.layer')
            and k.endswith(('conv1.weight', 'conv2.weight'))]
    for k in wide:
        state[k] = torch.zeros(1, *state[k].shape[1:])
    state['renamed.weight'] = state.pop('backbone.stem.0.weight')
    path = str(tmp_path / 'other.pth')
    torch.save({'state_dict': state}, path)
    with pytest.raises(ValueError) as err:
        check_checkpoint_matches(model, path)
    message = str(err.value)
    assert f'{len(wide)} shape mismatches [' in message
    assert message.index('shape mismatches') < message.index(
        'model keys missing') < message.index('keys the model does not')
    assert all(f'{k}: checkpoint (1,' in message for k in wide)
