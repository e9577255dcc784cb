"""DDP worker for tests/test_hook.py (run by torchrun, 2 procs).

Usage: torchrun --nproc_per_node=2 tests/_ddp_worker.py VOC INIT_CKPT OUT

Trains PSPNet-R18 for 3 iterations with an unchanged config plus
GradFilterHook (gloo, CPU), then writes ``OUT/rank{r}.pth`` with the final
state_dict. mmengine 0.10.7 always passes ``device_ids=[LOCAL_RANK]`` to DDP,
which torch refuses for CPU modules, so a CPU variant of
MMDistributedDataParallel without device ids is registered here and chosen
via ``model_wrapper_cfg`` (which also exercises the hook's re-wrap with a
custom wrapper config); and its ``init_dist`` calls
``torch.cuda.set_device``, so the gloo group is created here first.
"""
import os
import os.path as osp
import sys

import torch
from mmengine.config import Config
from mmengine.model import MMDistributedDataParallel
from mmengine.registry import MODEL_WRAPPERS
from mmengine.runner import Runner

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))
from tests._engine_fixtures import runner_cfg  # noqa: E402


@MODEL_WRAPPERS.register_module(force=True)
class CPUDistributedDataParallel(MMDistributedDataParallel):
    """MMDistributedDataParallel for CPU modules (no device ids)."""

    def __init__(self, module, device_ids=None, **kwargs):
        super().__init__(module=module, device_ids=None, **kwargs)


def main() -> None:
    voc, init_ckpt, out = sys.argv[1:4]
    torch.set_num_threads(1)
    rank = int(os.environ['RANK'])
    cfg = runner_cfg(osp.join(out, 'work'), voc, max_iters=3, batch_size=1)
    cfg.update(
        launcher='pytorch',
        load_from=init_ckpt,
        model_wrapper_cfg=dict(type='CPUDistributedDataParallel',
                               broadcast_buffers=False,
                               find_unused_parameters=False),
        custom_imports=dict(imports=['mmseg_gf'],
                            allow_failed_imports=False),
        custom_hooks=[dict(type='GradFilterHook', num_layers=5, radius=4)])
    cfg['default_hooks']['checkpoint']['interval'] = 10**6
    # mmengine's init_dist('pytorch') calls torch.cuda.set_device: on a
    # CPU-only torch, initialise the gloo group ourselves (Runner reuses it).
    torch.distributed.init_process_group(backend='gloo')
    # Through a file, as a user would: custom_imports is honoured by
    # Config.fromfile (it registers GradFilterHook), not by Config(dict).
    path = osp.join(out, f'cfg_rank{rank}.py')
    Config(cfg).dump(path)
    runner = Runner.from_cfg(Config.fromfile(path))
    runner.train()
    from mmengine.model import is_model_wrapper
    from mmseg_gf.models import GFConv2d
    model = runner.model.module if is_model_wrapper(
        runner.model) else runner.model
    torch.save(
        dict(state={k: v.detach().clone()
                    for k, v in model.state_dict().items()},
             gf_paths=[n for n, m in model.named_modules()
                       if isinstance(m, GFConv2d)],
             wrapped=is_model_wrapper(runner.model),
             iter=runner.iter), osp.join(out, f'rank{rank}.pth'))


if __name__ == '__main__':
    main()
