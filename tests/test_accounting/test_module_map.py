"""Where each module of :mod:`mmseg_gf.accounting` is tested.

The accounting is checked by what it predicts against what autograd,
the profiler or a GPU measure, so most of its tests run a whole step and
sit with the layer that builds the model (engine, analysis); this map is
the index. Each entry: the test file and a name it uses, so that a map
gone stale (a module added without a test file here, a file renamed, a
test no longer calling what it checks) fails here.
"""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ACCOUNTING = REPO / 'mmseg_gf' / 'accounting'

#: accounting module -> [(test file, a name the file uses for it)]
TESTS_OF = {
    'batch': [('tests/test_accounting/test_batch.py', 'random_batch')],
    'budget': [
        ('tests/test_accounting/test_budget.py', 'choose_by_budget'),
        ('tests/test_accounting/test_process_budget.py', 'PEAK_HEADROOM'),
        ('tests/test_accounting/test_unmodelled.py', 'choose_by_budget')],
    'cuda_kernels': [
        ('tests/test_accounting/test_cuda_kernels.py', 'count_model')],
    'cuda_path': [
        ('tests/test_accounting/test_launches.py', 'cuda_path')],
    'format': [('tests/test_accounting/test_format.py', 'format_table')],
    'kept': [
        ('tests/test_engine/test_lean_region.py', 'trace_step_saved_bytes'),
        ('tests/test_accounting/test_unmodelled.py',
         'trace_step_saved_bytes')],
    'kept_mask_head': [
        ('tests/test_engine/test_token_kinds_accounting.py',
         'segmenter_vit_t')],
    'kept_tokens': [
        ('tests/test_models/test_gf_attention_sdpa.py', 'kept_tokens'),
        ('tests/test_engine/test_token_kinds_accounting.py',
         'trace_step_saved_bytes')],
    'kept_transformer': [
        ('tests/test_models/test_lean_transformer.py', 'saved_tensor_bytes'),
        ('tests/test_engine/test_lean_transformer_families.py',
         'trace_step_saved_bytes')],
    'launches': [
        ('tests/test_accounting/test_launches.py', 'LaunchCounter'),
        ('tests/test_analysis/test_launch_count.py', 'count_launches')],
    'measured': [
        ('tests/test_accounting/test_measured.py', 'live_bytes_by_interval')],
    'optimizer_state': [
        ('tests/test_accounting/test_process_budget.py',
         'optimizer_state_ratio')],
    'peak': [
        ('tests/test_accounting/test_budget.py', 'timeline=True'),
        ('tests/test_accounting/test_process_budget.py', 'peak_bytes'),
        ('tests/test_analysis/test_budget_check.py', 'peak')],
    'quiet': [('tests/test_accounting/test_quiet.py', 'quiet_profiler')],
    'saved_bytes': [
        ('tests/test_accounting/test_unmodelled.py',
         'trace_step_saved_bytes'),
        ('tests/test_engine/test_lean_region.py', 'trace_step_saved_bytes')],
    'report': [
        ('tests/test_accounting/test_unmodelled.py', 'step_kept_table'),
        ('tests/test_engine/test_hook.py', 'accounting.report')],
    'step_profile': [
        ('tests/test_accounting/test_budget.py', 'profile_segmentor'),
        ('tests/test_accounting/test_unmodelled.py', 'profile_segmentor'),
        ('tests/test_engine/test_token_kinds_accounting.py',
         'profile.patch_mean_gelus')],
    'trace': [
        ('tests/test_accounting/test_trace_patching.py', 'StepTracer'),
        ('tests/test_accounting/test_unmodelled.py',
         'trace_step_saved_bytes'),
        ('tests/test_engine/test_lean_region.py', 'trace_step_saved_bytes')],
}


def _modules():
    """The accounting's modules and subpackages (not its ``__init__``)."""
    names = {p.stem for p in ACCOUNTING.glob('*.py') if p.stem != '__init__'}
    names |= {p.parent.name for p in ACCOUNTING.glob('*/__init__.py')}
    return names


def test_every_accounting_module_has_its_tests_mapped():
    assert set(TESTS_OF) == _modules()


@pytest.mark.parametrize('module', sorted(TESTS_OF))
def test_each_mapped_file_exists_and_uses_the_module(module):
    for path, used in TESTS_OF[module]:
        text = (REPO / path).read_text()
        assert used in text, f'{path} does not use {used!r} ({module})'
