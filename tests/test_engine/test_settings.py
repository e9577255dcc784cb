"""mmseg_gf.engine.settings: one declaration of each gradient-filter
setting, which the config rewrite, the model builder, GradFilterHook, the
cost tool's reading of a hook and docs/settings.md's tables all follow."""
import inspect
import re
from pathlib import Path

import pytest

pytest.importorskip('mmseg')

from mmengine.config import Config  # noqa: E402

from mmseg_gf.analysis.cost_cli import hook_settings  # noqa: E402
from mmseg_gf.engine import GradFilterHook  # noqa: E402
from mmseg_gf.engine.settings import (ACCEPTED_KEYS,  # noqa: E402
                                      DEFAULTS, FLAGS, HOOK_OPTIONS,
                                      SETTING_KEYS, SURGERY_FLAGS,
                                      GradientFilterSettings,
                                      check_settings, setting_docs)

REPO = Path(__file__).resolve().parents[2]


def test_keys_flags_and_defaults_come_from_the_fields():
    assert SETTING_KEYS == (
        'num_layers', 'layers', 'budget', 'radius', 'mode', 'train_norm',
        'lean', 'input_size', 'keep_frozen_aux_heads',
        'log_frozen_aux_losses', 'reuse_cpu_memory', 'layer_kinds',
        'patch_mean_activations')
    assert {k: DEFAULTS[k] for k in FLAGS} == dict(
        train_norm=False, lean=True, keep_frozen_aux_heads=False,
        log_frozen_aux_losses=False, reuse_cpu_memory=False,
        patch_mean_activations=True)
    assert SURGERY_FLAGS == ('train_norm', 'lean', 'keep_frozen_aux_heads',
                             'log_frozen_aux_losses')


def _table_keys(doc: str, header: str):
    """The first-column names of the markdown table under ``header``."""
    table = doc.split(header, 1)[1].split('\n\n', 1)[0]
    return re.findall(r'^\| `(\w+)` \|', table, flags=re.M)


def test_every_setting_has_a_doc_and_one_row_in_the_docs():
    fields = GradientFilterSettings.__dataclass_fields__
    assert all(f.metadata['doc'] for f in fields.values())
    doc = (REPO / 'docs' / 'settings.md').read_text()
    rows = _table_keys(doc, '| key | values | meaning |')
    assert sorted(rows) == sorted(SETTING_KEYS)
    assert all(f'### `{key}`' in doc for key in SETTING_KEYS)


def test_the_hooks_own_arguments_have_one_row_in_the_docs():
    own = [name for name, p in inspect.signature(
        GradFilterHook.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY]
    doc = (REPO / 'docs' / 'settings.md').read_text()
    assert own and sorted(_table_keys(
        doc, '| argument | values | meaning |')) == sorted(own)


def test_every_accepted_key_is_declared_with_a_doc_and_in_the_docs():
    """What GradFilterHook accepts: the settings and its own two options,
    each declared with its default and a doc, each named in README.md or
    docs/ (the hook's defaults are the declared ones)."""
    import inspect
    assert ACCEPTED_KEYS == SETTING_KEYS + ('log_table', 'check_load_from',
                                           'resume_random_state')
    docs = setting_docs()
    assert tuple(docs) == ACCEPTED_KEYS
    assert all(isinstance(doc, str) and len(doc) > 20
               for _, doc in docs.values())
    signature = inspect.signature(GradFilterHook.__init__).parameters
    for key, option in HOOK_OPTIONS.items():
        assert signature[key].default is option.default
        assert docs[key] == (option.default, option.doc)
    text = (REPO / 'README.md').read_text() + ''.join(
        p.read_text() for p in sorted((REPO / 'docs').rglob('*.md')))
    missing = [k for k in ACCEPTED_KEYS
               if not re.search(rf'`[^`\n]*\b{k}\b[^`\n]*`', text)]
    assert not missing, f'not in README.md or docs/: {missing}'


def test_the_dataclass_checks_and_normalises_when_made():
    s = GradientFilterSettings(layers='decode_head', input_size=64)
    assert (s.layers, s.input_size, s.radius) == (['decode_head'],
                                                  (64, 64), 4)
    assert check_settings(dict(layers='decode_head',
                               input_size=64)) == s.as_dict()
    with pytest.raises(ValueError, match='lean must be True or False'):
        GradientFilterSettings(num_layers=2, lean='yes')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['leen'\]"):
        GradientFilterSettings.from_dict(dict(num_layers=2, leen=True))


@pytest.mark.parametrize('key', [k for k in SETTING_KEYS
                                 if k not in ('layers', 'budget')])
def test_the_hook_takes_every_setting(key):
    given = dict(num_layers=2)
    given.setdefault(key, DEFAULTS[key])
    hook = GradFilterHook(**given, log_table=False)
    assert hook.settings == GradientFilterSettings(num_layers=2)


def test_the_hook_names_an_unknown_argument_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"unknown argument\(s\) "
                       r"\['radus'\]; allowed: \['num_layers'.*"
                       r"'log_table', 'check_load_from', "
                       r"'resume_random_state'\]"):
        GradFilterHook(num_layers=2, radus=4)


def test_the_cost_tool_reads_every_setting_of_a_hook():
    given = {k: v for k, v in DEFAULTS.items() if v is not None}
    cfg = Config(dict(custom_hooks=[
        dict(type='GradFilterHook', num_layers=3, **given)]))
    assert hook_settings(cfg) == dict(given, num_layers=3)
