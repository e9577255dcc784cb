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
    """``module`` with its SyncBN layers as plain BN (mmengine's
    ``revert_sync_batchnorm``, Parameters and running statistics shared),
    logged in one line; unchanged when it has none.

    SyncBN needs CUDA: torch's DDP refuses a CPU module holding one
    ("SyncBatchNorm layers only work with GPU modules"), and every config
    of mmseg's zoo uses it. On CPU each process then normalises a training
    BN with its own batch's statistics; a frozen BN (eval mode, the
    gradient filter's default) computes the same either way.
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
    """``MMDistributedDataParallel`` for CPU modules: no device ids, SyncBN
    reverted to BN (:func:`revert_sync_batchnorm_on_cpu`)."""

    def __init__(self, module, device_ids=None, **kwargs):
        super().__init__(module=revert_sync_batchnorm_on_cpu(module),
                         device_ids=None, **kwargs)


def prepare_cpu_distributed(cfg):
    """Make a distributed config (``launcher != 'none'``) run without CUDA.

    On a machine without a CUDA GPU: a ``nccl`` (or unset) process-group
    backend becomes ``gloo`` (mmseg configs default to ``nccl``, which needs
    GPUs; ``gloo`` and ``mpi`` are kept) and the
    model wrapper becomes :class:`CPUDistributedDataParallel` (a custom
    wrapper type other than ``MMDistributedDataParallel`` is kept). With a
    GPU, or ``launcher='none'``, the config is returned unchanged.

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

    mmengine's ``init_dist('pytorch')`` calls ``torch.cuda.set_device``
    first, which fails on a CPU-only machine; the Runner reuses a group that
    already exists. Uses the environment set by ``torchrun`` (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

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
