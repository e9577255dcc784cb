"""Shared pytest configuration."""


def pytest_configure(config):
    # Multi-process tests (torchrun, gloo on CPU); deselect with -m "not ddp".
    config.addinivalue_line(
        'markers', 'ddp: spawns a 2-process DistributedDataParallel run')
