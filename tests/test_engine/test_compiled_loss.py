"""A Runner run with ``compile`` through ``GradFilterHook`` compiles the
segmentor's loss once per input shape and never again, whatever the
schedule's learning rate and the samples' metadata
(mmseg_gf/engine/compiled_loss.py says why; docs/lean_region.md#torchcompile).

Dynamo only, with a backend that counts what it is given (no code
generation): the timing of 50 Inductor iterations is
``tools/benchmark_runner_compile.py``'s.
"""
import pytest
import torch

pytest.importorskip('mmseg')

from mmengine.structures import PixelData  # noqa: E402
from mmseg.structures import SegDataSample  # noqa: E402

from tests.helpers.devices import needs_cuda  # noqa: E402
from tests.helpers.engine_fixtures import (  # noqa: E402
    prepare_workspace, run_training, tool_cfg)

from mmseg_gf.engine.compiled_loss import (  # noqa: E402
    LOSS_METAINFO, loss_samples)

pytestmark = pytest.mark.usefixtures('one_thread')

#: The graphs Dynamo handed to the backend, in order.
COMPILED = []


@torch._dynamo.register_backend(name='mmseg_gf_counting')
def _counting(gm, example_inputs):
    COMPILED.append(len(example_inputs))
    return gm.forward


def test_loss_samples_keep_ground_truth_and_shapes_only():
    gt = PixelData(data=torch.zeros(1, 4, 4, dtype=torch.long))
    meta = dict(img_path='a.jpg', seg_map_path='a.png', flip=True,
                flip_direction='horizontal', scale_factor=(1.5, 1.5),
                ori_shape=(3, 3), img_shape=(4, 4), pad_shape=(4, 4),
                batch_input_shape=(4, 4), reduce_zero_label=False)
    sample = SegDataSample(metainfo=meta, gt_sem_seg=gt)
    [got] = loss_samples([sample])
    assert type(got) is SegDataSample and got is not sample
    assert got.gt_sem_seg is gt  # shared, not copied (strides canonical)
    assert got.metainfo == {k: meta[k] for k in LOSS_METAINFO}
    assert loss_samples(None) is None


def test_loss_samples_give_labels_one_set_of_strides():
    """The data preprocessor leaves a label that needed no padding with a
    stride of 1 along its size-1 channel dimension: Dynamo guards on it."""
    data = torch.arange(8).view(2, 4).unsqueeze(0).permute(0, 1, 2)
    odd = data.as_strided((1, 2, 4), (1, 4, 1))
    [got] = loss_samples([SegDataSample(gt_sem_seg=PixelData(data=odd))])
    assert got.gt_sem_seg.data.stride() == (8, 4, 1)
    assert torch.equal(got.gt_sem_seg.data, odd)


def _varying_cfg(root: str, work: dict, iters: int) -> dict:
    """The tiny PSPNet-R18 with the hook, batch 1: a random resize (sizes
    24-48, padded to a multiple of 32: 32x32 or 64x64 batches), random
    flips, a poly schedule, and every batch's samples new."""
    cfg = tool_cfg(root, work['voc'], work['init'], way='hook',
                   max_iters=iters, batch_size=1)
    cfg['train_dataloader']['dataset']['pipeline'] = [
        dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
        dict(type='RandomResize', scale=(32, 32), ratio_range=(0.75, 1.5),
             keep_ratio=True),
        dict(type='RandomFlip', prob=0.5), dict(type='PackSegInputs')]
    cfg['model']['data_preprocessor'].update(size=None, size_divisor=32)
    cfg['param_scheduler'] = [dict(type='PolyLR', power=0.9, eta_min=1e-4,
                                   begin=0, end=iters, by_epoch=False)]
    cfg['default_hooks']['checkpoint']['interval'] = 10**6
    return cfg


def test_runner_compiles_once_per_input_shape(tmp_path):
    from mmengine.config import Config
    from mmengine.runner import Runner

    from mmseg_gf.engine import rewrite_config
    work = prepare_workspace(str(tmp_path))
    cfg = Config(_varying_cfg(str(tmp_path / 'run'), work, iters=8))
    cfg.compile = dict(backend='mmseg_gf_counting')
    torch._dynamo.reset()
    COMPILED.clear()
    runner = Runner.from_cfg(rewrite_config(cfg))
    shapes, paths, lrs = [], set(), set()

    def record(module, args, out):
        shapes.append(tuple(out['inputs'].shape))
        paths.update(s.img_path for s in out['data_samples'])
        lrs.add(runner.optim_wrapper.get_lr()['lr'][0])

    runner.model.data_preprocessor.register_forward_hook(record)
    runner.train()
    assert len(set(shapes)) == 2 and len(paths) > 1 and len(lrs) == 8, (
        shapes, paths, lrs)
    # the lean loss is one graph: one per shape, nothing recompiled
    assert len(COMPILED) == 2, (COMPILED, shapes)
    # the segmentor has its own loss back
    assert 'loss' not in vars(runner.model)


@pytest.mark.cuda
@needs_cuda
def test_runner_on_cuda_compiles_with_cuda_graphs(tmp_path):
    """On CUDA, ``compile=True`` through the hook compiles a lean model's
    loss in ``mode='reduce-overhead'``; Inductor takes its CUDA graphs
    (skips none) and the run trains (the Runner puts the model on the
    GPU)."""
    work = prepare_workspace(str(tmp_path))
    cfg = tool_cfg(str(tmp_path / 'run'), work['voc'], work['init'],
                   way='hook', max_iters=4)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runner = run_training(cfg, compile=True)
    [hook] = [h for h in runner.hooks
              if type(h).__name__ == 'GradFilterHook']
    assert hook._compile == dict(mode='reduce-overhead', dynamic=False)
    counters = torch._dynamo.utils.counters['inductor']
    assert counters['cudagraph_skips'] == 0, dict(counters)
    assert next(runner.model.parameters()).is_cuda
