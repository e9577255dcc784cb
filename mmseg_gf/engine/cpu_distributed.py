"""Distributed training on CPU-only machines (gloo).

The runs of :mod:`mmseg_gf.engine.entrypoints` (``tools/train.py``,
``tools/test.py``) call :func:`prepare_cpu_distributed`
and :func:`init_cpu_process_group` for a distributed launch without CUDA.
"""
from datetime import timedelta

import torch
from mmengine.logging import print_log
from mmengine.model import MMDistributedDataParallel, revert_sync_batchnorm
from mmengine.registry import MODEL_WRAPPERS
from torch import nn

__all__ = [
    'CPU_DDP_WRAPPER', 'CPUDistributedDataParallel', 'prepare_cpu_distributed',
    'init_cpu_process_group', 'revert_sync_batchnorm_on_cpu'
]


def _sync_batchnorm_types() -> tuple:
    types = [nn.SyncBatchNorm]
    try:
        from mmcv.ops import SyncBatchNorm
        types.append(SyncBatchNorm)
    except ImportError:
        pass
    return tuple(types)


def revert_sync_batchnorm_on_cpu(module: nn.Module) -> nn.Module:
    """``module`` with its SyncBN layers as plain BN, logged; unchanged without
    any.

    torch's DDP refuses a CPU module holding SyncBN, which every zoo config
    uses (docs/reliability.md#distributed-training).
    """
    count = sum(isinstance(m, _sync_batchnorm_types())
                for m in module.modules())
    if not count:
        return module
    print_log(
        f'{count} SyncBatchNorm layers reverted to BatchNorm (mmengine\'s '
        'revert_sync_batchnorm): SyncBN runs on CUDA only; in a CPU '
        'distributed run (gloo) each process normalises a training BN with '
        'its own batch', logger='current')
    return revert_sync_batchnorm(module)

#: mmengine's Runner always passes ``device_ids=[LOCAL_RANK]`` to a DDP
#: wrapper, which torch refuses for a CPU module.
CPU_DDP_WRAPPER = 'CPUDistributedDataParallel'


@MODEL_WRAPPERS.register_module(name=CPU_DDP_WRAPPER, force=True)
class CPUDistributedDataParallel(MMDistributedDataParallel):
    """``MMDistributedDataParallel`` for CPU modules: no device ids, SyncBN as
    BN."""

    def __init__(self, module, device_ids=None, **kwargs):
        super().__init__(module=revert_sync_batchnorm_on_cpu(module),
                         device_ids=None, **kwargs)


def prepare_cpu_distributed(cfg):
    """Make a distributed config run without CUDA: ``gloo`` and the CPU DDP
    wrapper.

    With a GPU, or ``launcher='none'``, the config is returned unchanged.

    Args:
        cfg (mmengine.Config): modified in place.

    Returns:
        The same config.
    """
    if cfg.get('launcher', 'none') in (None, 'none') or \
            torch.cuda.is_available():
        return cfg
    env_cfg = dict(cfg.get('env_cfg') or {})
    dist_cfg = dict(env_cfg.get('dist_cfg') or {})
    if dist_cfg.get('backend', 'nccl') == 'nccl':
        dist_cfg['backend'] = 'gloo'
    env_cfg['dist_cfg'] = dist_cfg
    cfg.env_cfg = env_cfg
    wrapper = cfg.get('model_wrapper_cfg')
    if wrapper is None:
        cfg.model_wrapper_cfg = dict(
            type=CPU_DDP_WRAPPER,
            broadcast_buffers=False,
            find_unused_parameters=cfg.get('find_unused_parameters', False))
    elif wrapper.get('type', 'MMDistributedDataParallel') in (
            'MMDistributedDataParallel', MMDistributedDataParallel):
        wrapper['type'] = CPU_DDP_WRAPPER
    return cfg


def init_cpu_process_group(cfg) -> bool:
    """Create the process group for ``launcher='pytorch'`` without CUDA.

    mmengine's ``init_dist`` calls ``torch.cuda.set_device`` first; the
    Runner reuses a group that exists. Reads ``torchrun``'s environment.

    Returns:
        bool: whether a group was created here.
    """
    import torch.distributed as dist
    if cfg.get('launcher') != 'pytorch' or torch.cuda.is_available() or \
            not dist.is_available() or dist.is_initialized():
        return False
    dist_cfg = dict((cfg.get('env_cfg') or {}).get('dist_cfg') or {})
    kwargs = {}
    if dist_cfg.get('timeout') is not None:
        kwargs['timeout'] = timedelta(seconds=dist_cfg['timeout'])
    backend = dist_cfg.get('backend', 'gloo')
    dist.init_process_group(
        backend='gloo' if backend == 'nccl' else backend, **kwargs)
    return True
