"""Shared pytest configuration."""
import contextlib
import logging
import os

import pytest


def pytest_configure(config):
    # Multi-process tests (torchrun, gloo on CPU); deselect with -m "not ddp".
    config.addinivalue_line(
        'markers', 'ddp: spawns a 2-process DistributedDataParallel run')
    _share_cores_between_workers()


#: Files of a minute or more on 2 cores, slowest first: run before the
#: rest, so that the workers (which take whole files in collection order:
#: the Makefile's ``--dist loadfile --no-loadscope-reorder``) end together
#: rather than one of them starting a long file last.
SLOW_FIRST = (
    'tests/test_protocol/test_protocol.py',
    'tests/test_ops/conv/test_gf_triton.py',
    'tests/test_protocol/test_protocol_heads.py',
    'tests/test_packaging.py',
    'tests/test_engine/test_compile_step.py',
    'tests/test_analysis/test_fault_injection.py',
    'tests/test_tools/test_cli.py',
    'tests/test_models/test_conv_block.py',
    'tests/test_tools/test_gpu_check.py',
    'tests/test_engine/test_cuda_graph_trace.py',
    'tests/test_engine/test_distributed.py',
)


def pytest_collection_modifyitems(session, config, items):
    """The files of :data:`SLOW_FIRST` first, in that order; the rest
    as collected (a stable sort: each file's tests stay together)."""
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition('::')[0],
                                         len(rank)))


def _share_cores_between_workers():
    """Under pytest-xdist (``make test`` runs one worker per core), give each
    worker its share of the cores: torch's default of one intra-op thread
    per core in every worker would oversubscribe the machine."""
    workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
    if workers <= 1:
        return
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _check_unchanged(before, what: str) -> None:
    """Fail ``what`` if a process-wide setting differs from ``before``,
    after setting it back, so that the tests after it run as they would
    alone."""
    from tests.helpers import process_state
    changed = process_state.changes(before, process_state.snapshot())
    process_state.restore(before)  # the quietly restored ones too
    if changed:
        pytest.fail(f'{what} left process-wide settings changed (restored '
                    'now; undo them in a fixture or a finally): ' +
                    '; '.join(changed), pytrace=False)


@pytest.fixture(autouse=True)
def _same_start_and_no_leaks(request):
    """Every test starts from the same seeds of the global generators and
    must leave the process's settings as it found them: under pytest-xdist
    a worker runs many files one after the other, in an order that depends
    on timing, and a test must not compute differently for what ran before
    it (tests/helpers/process_state.py lists what is checked)."""
    from tests.helpers import process_state
    process_state.seed_global_generators()
    before = process_state.snapshot()
    yield
    _check_unchanged(before, request.node.nodeid)


@pytest.fixture(scope='module', autouse=True)
def _same_start_and_no_leaks_per_file(request):
    """The same for a file's module-scoped fixtures (built before its first
    test's seeds, undone after its last test's check)."""
    from tests.helpers import process_state
    process_state.seed_global_generators()
    before = process_state.snapshot()
    yield
    _check_unchanged(before, f'{request.node.nodeid} (its module fixtures)')


@pytest.fixture(autouse=True)
def _exact_float32_on_cuda(request):
    """CUDA tests compare float32 results with tolerances of float32
    rounding: TF32 (on by default for cuDNN convolutions) stays off in
    them, as the CPU computes."""
    if request.node.get_closest_marker('cuda') is None:
        yield
        return
    import torch
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    previous = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = previous


@pytest.fixture
def switch_override():
    """``switch_override(MMSEG_GF_NATIVE=False)`` holds
    :func:`mmseg_gf.ops.backend.switches.override` until the test ends (calls
    nest; each is undone in reverse order), as ``monkeypatch.setenv`` would
    for a variable read at every call."""
    from mmseg_gf.ops.backend import switches
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(
            switches.override(**values))


@pytest.fixture(scope='module')
def one_thread():
    """One intra-op thread for a module's tests (``pytestmark =
    pytest.mark.usefixtures('one_thread')``): tiny zoo models gain little
    from a second thread, and on a busy 2-core machine waiting OpenMP
    threads spin (the zoo sweep took 6 min of CPU with 2 threads, 24 s with
    one, under a load of 10)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Records(logging.Handler):

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def log_records():
    """The messages logged to mmengine's current logger during a test
    (INFO and above; print_log's records do not reach pytest's caplog)."""
    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    handler = _Records()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)
