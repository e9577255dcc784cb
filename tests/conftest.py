"""Shared pytest configuration."""
import os


def pytest_configure(config):
    # Multi-process tests (torchrun, gloo on CPU); deselect with -m "not ddp".
    config.addinivalue_line(
        'markers', 'ddp: spawns a 2-process DistributedDataParallel run')
    _share_cores_between_workers()


def _share_cores_between_workers():
    """Under pytest-xdist (``make test`` runs one worker per core), give each
    worker its share of the cores: torch's default of one intra-op thread
    per core in every worker would oversubscribe the machine."""
    workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
    if workers <= 1:
        return
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
