"""tools/analyze_cost.py: per-layer costs of a config's trained convs from the
shared cost model, measured saved bytes against the analytic ones, and the
paper's Table 3 comparison."""
import json
import os.path as osp
import subprocess
import sys

import pytest

pytest.importorskip('mmseg')
torch = pytest.importorskip('torch')

from mmengine.config import Config  # noqa: E402

from mmseg_gf.ops.conv.cost import conv_backward_cost  # noqa: E402
from mmseg_gf.engine.config import rewrite_config  # noqa: E402
from mmseg_gf.engine.selection import trace_layers  # noqa: E402
from mmseg_gf.engine.surgery import get_gradient_filter_layers  # noqa: E402

from mmseg_gf.analysis.model_cost import config_backward_cost  # noqa: E402
from mmseg_gf.protocol.paper_table3 import PAPER_TABLE3_GFLOPS  # noqa: E402
from tests.helpers.tools import REPO, load_tool  # noqa: E402

TOOL = osp.join(REPO, 'tools', 'analyze_cost.py')
analyze_cost = load_tool('analyze_cost')

DLV3 = osp.join(REPO, 'configs', 'gf',
                'deeplabv3_r18-d8_gf-ref10_1xb8-20k_voc12aug-512x512.py')
PSP = osp.join(REPO, 'configs', 'gf', 'pspnet_r18_voc_r4.py')
SHAPE = (64, 64)


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def independent_costs(config, shape, collapse=False):
    """Per chosen conv, conv_backward_cost from this test's own build and
    trace (not through mmseg_gf.analysis.model_cost)."""
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    cfg = Config.fromfile(config)
    cfg.gradient_filter = dict(cfg.gradient_filter, input_size=shape)
    rewrite_config(cfg)
    model = MODELS.build(cfg.model)
    records = {r.path: r for r in trace_layers(model, shape, grad=True)}
    out = {}
    for c in get_gradient_filter_layers(model):
        rec = records[c.path]
        kh, kw = _pair(c.module.kernel_size)
        out[c.path] = conv_backward_cost(
            cin=rec.in_shape[0], cout=rec.out_shape[0], kh=kh, kw=kw,
            stride=c.module.stride,
            dilation=1 if collapse else c.module.dilation,
            groups=c.module.groups, in_hw=rec.in_shape[1:],
            out_hw=rec.out_shape[1:], batch=3, radius=c.radius,
            need_input_grad=rec.input_requires_grad)
    return out


def trained_weight_numels(config):
    """Weight elements of each conv the config's gradient filter trains."""
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules
    register_all_modules(init_default_scope=False)
    cfg = Config.fromfile(config)
    rewrite_config(cfg)
    model = MODELS.build(cfg.model)
    return {c.path: c.module.weight.numel()
            for c in get_gradient_filter_layers(model)}


def test_cli_totals_are_the_sum_of_per_layer_costs(tmp_path):
    out = tmp_path / 'cost.json'
    proc = subprocess.run(
        [sys.executable, TOOL, DLV3, '--shape', '64', '--batch', '3',
         '--out', str(out)], cwd=REPO, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'backbone.layer4.1.conv1' in proc.stdout
    assert 'total (10 layers)' in proc.stdout
    result = json.loads(out.read_text())['cost']
    assert result['mode'] == 'gf' and result['batch'] == 3
    want = independent_costs(DLV3, SHAPE)
    layers = {layer['path']: layer for layer in result['layers']}
    assert list(layers) == list(want)
    for path, cost in want.items():
        got = layers[path]
        assert got['vanilla_flops'] == cost.vanilla_flops, path
        assert got['gf_flops'] == cost.gf_flops, path
        assert got['vanilla_saved_bytes'] == cost.vanilla_saved_bytes, path
        assert got['gf_saved_bytes'] == cost.gf_saved_bytes, path
        assert got['vanilla_macs'] * 2 == cost.vanilla_flops
    totals = result['totals']
    for key in ('vanilla_flops', 'gf_flops', 'vanilla_saved_bytes',
                'gf_saved_bytes', 'gf_forward_overhead_flops'):
        assert totals[key] == sum(getattr(c, key) for c in want.values())
    # Only the first trained conv in execution order lacks g_x here.
    assert [p for p, l in layers.items() if not l['need_input_grad']] == [
        'backbone.layer4.0.conv1', 'backbone.layer4.0.downsample.0'
    ]
    # The dilated layers keep their taps: GF counts depend on the choice.
    collapsed = config_backward_cost(Config.fromfile(DLV3), SHAPE, batch=3,
                                      collapse_dilated=True)
    want_c = independent_costs(DLV3, SHAPE, collapse=True)
    assert collapsed.gf_flops == sum(c.gf_flops for c in want_c.values())
    assert collapsed.gf_flops < totals['gf_flops']
    assert collapsed.vanilla_flops == totals['vanilla_flops']


def test_config_without_gradient_filter_counts_every_conv(tmp_path):
    path = tmp_path / 'fcn_all.py'
    path.write_text(
        f"_base_ = [{osp.join(REPO, 'configs/_base_/models/fcn_r18-d8.py')!r}]"
        '\nmodel = dict(decode_head=dict(num_classes=5))\n')
    cfg = Config.fromfile(str(path))
    cost = config_backward_cost(cfg, SHAPE, radius=2)
    assert cost.mode == 'all'
    assert all(layer.radius == 2 for layer in cost.layers)
    assert not any(layer.path.endswith('conv_seg') for layer in cost.layers)
    assert cost.classifier.path == 'decode_head.conv_seg'
    # Everything is trained: only the stem's first conv needs no g_x.
    assert [layer.need_input_grad for layer in cost.layers] == [False] + [
        True
    ] * (len(cost.layers) - 1)
    assert cost.flops == cost.vanilla_flops


def test_measured_saved_bytes_match_the_analytic_count(tmp_path, capsys):
    out = tmp_path / 'measure.json'
    analyze_cost.main([PSP, '--shape', '64', '--measure', '--out', str(out)])
    printed = capsys.readouterr().out
    assert 'saved vanilla measured' in printed
    measured = json.loads(out.read_text())['measured']
    trained_weights = trained_weight_numels(PSP)
    assert len(trained_weights) == 5
    for mode in ('vanilla', 'gf'):
        m = measured[mode]
        assert len(m['layers']) == 5
        for layer in m['layers']:
            assert layer['analytic'] > 0
            assert layer['measured'] == pytest.approx(layer['analytic'],
                                                      rel=0.03), (mode,
                                                                  layer)
        assert m['trained_saved_bytes'] == pytest.approx(
            m['analytic_saved_bytes'], rel=0.03)
        assert m['saved_bytes_total'] >= m['trained_saved_bytes']
        # The step allocates every trained conv's weight gradient (float32)
        # and starts without them: its peak is at least their bytes.
        assert m['peak_bytes'] >= 4 * sum(trained_weights.values())
    # What GF removes from the whole forward is what the trained convs no
    # longer keep (their inputs are not saved by any other op here).
    van, gf = measured['vanilla'], measured['gf']
    assert gf['trained_saved_bytes'] < van['trained_saved_bytes'] / 8
    assert van['saved_bytes_total'] - gf['saved_bytes_total'] == \
        van['trained_saved_bytes'] - gf['trained_saved_bytes']


def test_paper_table3_pspnet(capsys, tmp_path):
    out = tmp_path / 't3.json'
    analyze_cost.main(['--paper-table3', '--models', 'pspnet_r18', '--rows',
                       '5', '--out', str(out)])
    printed = capsys.readouterr().out
    assert '| PSPNet-R18 | 5 | 5 |' in printed
    assert '15.0' in printed and '0.14' in printed
    row, = json.loads(out.read_text())['paper_table3']['rows']
    assert row['paper_vanilla'] == PAPER_TABLE3_GFLOPS['pspnet_r18'][
        'vanilla'][5]
    assert row['paths'] == [f'decode_head.psp_modules.{i}.1.conv'
                            for i in range(4)] + ['decode_head.bottleneck.conv']
    # docs/cost.md: the paper's "Ours 5" is our GF count (2 FLOPs per MAC,
    # g_x + g_W + overheads, per image) to the paper's two decimals.
    assert abs(row['gf'] - row['paper_gf']) <= 0.005
    assert row['gf_ref_op'] == row['gf']  # no dilated conv among them
    # Its "Vanilla BP 5" is not our exact-backward count of the same convs
    # (about 0.78 of it); forward + backward MACs come within 4%.
    assert abs(row['paper_vanilla'] / row['vanilla'] - 1) > 0.15
    assert row['paper_vanilla'] / row['fwd_bwd'] == pytest.approx(1,
                                                                  abs=0.04)


def test_sweep_marks_the_budget_and_its_choice(tmp_path, capsys):
    """--sweep: one row per (N, r) from the same profile as the budget's
    choice; the marks are the limits applied to the printed figures; a
    budget nothing meets prints the reason instead of a choice."""
    from mmseg.registry import MODELS

    from mmseg_gf.accounting.budget import choose_by_budget
    from mmseg_gf.engine.budget import profile_segmentor
    out = str(tmp_path / 'new_dir' / 'cost.json')
    result = analyze_cost.main([
        PSP, '--shape', '64', '--batch', '2', '--sweep', '--budget',
        'saved_mib=0.2', 'radii=[2,8]', '--out', out])['sweep']
    cfg = Config.fromfile(PSP)
    torch.manual_seed(0)
    profile = profile_segmentor(MODELS.build(cfg.model), SHAPE)
    rows = result['rows']
    assert len(rows) == 2 * profile.max_layers
    for row in rows:
        cost = profile.cost(row['num_layers'], row['radius'], 2)
        assert row['saved_mib'] == pytest.approx(cost.saved_mib)
        assert row['backward_gflops'] == pytest.approx(cost.backward_gflops)
        assert row['fits'] == (row['saved_mib'] <= 0.2)
        assert row['peak_mib'] > row['saved_mib']
    expected = choose_by_budget(profile, dict(saved_mib=0.2, radii=[2, 8]),
                                2)
    assert result['choice']['num_layers'] == expected.num_layers
    assert result['choice']['radius'] == expected.radius
    assert osp.isfile(str(tmp_path / 'new_dir' / 'cost_sweep.png'))
    assert 'Chosen: budget (saved_mib <= 0.2)' in capsys.readouterr().out
    result = analyze_cost.main([PSP, '--shape', '64', '--sweep',
                                '--budget', 'backward_gflops=1e-9'])['sweep']
    assert result['choice'] is None and 'cannot be met' in result['error']


def test_a_zoo_config_offline_with_a_named_setting(capsys):
    """mmseg's own Fast-SCNN config as it comes (SyncBN, no checkpoint to
    load with --offline) with the setting named like benchmark_step's
    rows: its last 5 convs, radius 4, counted as the engine selects them."""
    from mmseg_gf.engine.build import build_segmentor
    from mmseg_gf.engine.zoo import REALTIME_FAMILIES, family_config
    path = REALTIME_FAMILIES['fast_scnn'].path
    result = analyze_cost.main([path, '--offline', '--setting',
                                'gf_last5_r4', '--shape', '64'])
    assert 'total (5 layers)' in capsys.readouterr().out
    cfg = family_config('fast_scnn')
    cfg.gradient_filter = dict(num_layers=5, radius=4)
    want = [c.path for c in get_gradient_filter_layers(build_segmentor(
        cfg, input_size=SHAPE))]
    layers = result['cost']['layers']
    assert [layer['path'] for layer in layers] == want
    assert all(layer['radius'] == 4 for layer in layers)
    with pytest.raises(SystemExit):
        analyze_cost.main([path, '--setting', 'gf_last5'])


def test_a_config_trained_by_the_hook_is_analysed_with_its_settings(
        tmp_path, capsys):
    """An unchanged config plus GradFilterHook: without --setting the tool
    counts what the hook trains (its last 3 convs at r = 2), not every
    conv."""
    path = tmp_path / 'fcn_hook.py'
    path.write_text(
        f"_base_ = [{osp.join(REPO, 'configs/_base_/models/fcn_r18-d8.py')!r}]"
        '\nmodel = dict(decode_head=dict(num_classes=5))\n'
        "custom_imports = dict(imports=['mmseg_gf'], "
        'allow_failed_imports=False)\n'
        "custom_hooks = [dict(type='GradFilterHook', num_layers=3, "
        'radius=2, log_table=False)]\n')
    result = analyze_cost.main([str(path), '--shape', '64'])
    printed = capsys.readouterr().out
    assert "setting: the config's GradFilterHook" in printed
    cost = result['cost']
    assert cost['mode'] == 'gf' and cost['num_layers'] == 3
    assert [layer['radius'] for layer in cost['layers']] == [2, 2, 2]
    # --setting still wins
    result = analyze_cost.main([str(path), '--shape', '64', '--setting',
                                'vanilla_last2'])
    assert result['cost']['mode'] == 'vanilla'
    assert result['cost']['num_layers'] == 2


def test_vanilla_bp_all_says_it_counts_convs_only(capsys):
    """"Vanilla BP All" of a model with Linear layers (Segformer-B0's
    MiT): the summary says the count is of convs only and names what it
    leaves out."""
    from mmseg_gf.engine.zoo import REALTIME_FAMILIES
    result = analyze_cost.main([REALTIME_FAMILIES['segformer_b0'].path,
                                '--offline', '--shape', '64'])
    printed = capsys.readouterr().out
    cost = result['cost']
    assert cost['mode'] == 'all' and cost['not_counted']['Linear'] > 0
    assert cost['layers'] and {
        layer['kind'] for layer in cost['layers']} == {'conv2d'}
    assert 'convs only (nn.Conv2d); not counted: ' in printed
    assert f"{cost['not_counted']['Linear']} Linear" in printed


def test_a_transformer_family_by_name_counts_its_linear_layers(capsys):
    """``--family swin_t``: mmseg's Swin-T UPerNet config as it comes
    (offline); its last 20 layers reach the backbone's last stage, whose
    Linears and window grids are listed as the engine selects them."""
    result = analyze_cost.main(['--family', 'swin_t', '--setting',
                                'gf_last20_r4', '--shape', '64'])
    printed = capsys.readouterr().out
    layers = result['cost']['layers']
    assert len(layers) == 20 and 'total (20 layers)' in printed
    kinds = {layer['kind'] for layer in layers}
    assert kinds == {'conv2d', 'linear'}
    linear = [layer['path'] for layer in layers if layer['kind'] == 'linear']
    assert linear and all(p.startswith('backbone.stages.3.') for p in linear)
    assert 'linear 7x7 win' in printed or 'linear 2x2' in printed
    with pytest.raises(SystemExit):
        analyze_cost.main([PSP, '--family', 'swin_t'])
