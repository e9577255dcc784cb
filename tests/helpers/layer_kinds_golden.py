"""What the layer-kind registry must leave unchanged, as text: per model, the
GradFilterHook's logged tables, ``tools/analyze_cost.py``'s output and the
budget's choices, at a tiny input.

The models: the six protocol models (their ``gf-last5-r4`` VOC configs) and
mmseg's twelve real-time families (zoo configs offline, setting
``gf_last5_r4``); per model, the budgets: the predicted cost of the last
1, 5 and all candidate layers at r = 4 and the choice (or the refusal) of
four budgets, the step-peak model included. Run as a script it writes the
text of every model (or of the models named) to stdout or ``--out``;
``tests/golden/layer_kinds.txt`` holds the text written by commit e0138fd
(plus the step line's ``linear`` category, 0.00 on these models;
the hook table's ``runs`` column, which depends on the machine's
kernels, is left out: :func:`without_runs_column`),
whose selection, surgery and accounting named ``nn.Conv2d`` / ``GFConv2d``
directly (the budgets and the hook's model here count convs only,
``layer_kinds=['conv2d']``: Segformer-B0's attentions are a kind of their
own, counted by default; its last 5 layers are convs either way), and
``tests/test_engine/test_layer_kinds_golden.py`` compares two cheap models
against it. This script on all models against that file is the full
check: 3.6 min alone on this 2-core VM (one thread), up to 7 min with
other work running::

    python tests/helpers/layer_kinds_golden.py --out /tmp/now.txt
    diff tests/golden/layer_kinds.txt /tmp/now.txt && echo identical
"""
import argparse
import contextlib
import dataclasses
import io
import os.path as osp
import sys
import time
from typing import Dict, List, Optional

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

#: Input side; a family's minimum crop where it is larger.
SIZE = 64
BATCH = 2
#: Budgets checked on every model's profile (besides a step-peak limit
#: just above the predicted peak of the last 5 layers at r = 4).
BUDGETS = (dict(saved_mib=0.3, radii=[2, 4, 8]),
           dict(saved_mib=1.0),
           dict(backward_gflops=0.05))
PROTOCOL = ('pspnet_r18', 'pspnet_mv2', 'deeplabv3_r18', 'deeplabv3_mv2',
            'fcn_r18', 'upernet_r18')


def model_names() -> List[str]:
    """Every model this file covers: protocol models, then families."""
    from mmseg_gf.engine.zoo import REALTIME_FAMILIES
    return [f'protocol:{m}' for m in PROTOCOL] + [
        f'family:{f}' for f in REALTIME_FAMILIES]


#: The conv-only count the text was recorded with (Segformer-B0's
#: attentions are a kind of their own, counted by default).
LAYER_KINDS = ['conv2d']


def _argv_and_cfg(name: str):
    """``tools/analyze_cost.py``'s arguments for a model, its loaded config
    and its input side."""
    from mmseg_gf.engine.zoo import REALTIME_FAMILIES
    from tests.helpers.config_names import config_name
    group, key = name.split(':')
    if group == 'protocol':
        path = osp.join(REPO, 'configs', 'gf',
                        config_name(key, 'voc', 'gf_last5_r4', '1xb8-20k'))
        size, extra = SIZE, []
    else:
        family = REALTIME_FAMILIES[key]
        path = family.path
        size = max(SIZE, family.min_crop)
        extra = ['--offline', '--setting', 'gf_last5_r4',
                 '--cfg-options', 'model.test_cfg.mode=whole']
        if key == 'lraspp_mv3':  # as the family test: same layer types
            extra.append('model.backbone.reduction_factor=4')
    argv = [path, '--shape', str(size), str(size), '--batch', str(BATCH)
            ] + extra
    return argv, size


class _Logger:

    def __init__(self) -> None:
        self.lines: List[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(str(msg))


class _Runner:
    cfg = None

    def __init__(self) -> None:
        self.logger = _Logger()


def without_runs_column(messages: List[str]) -> List[str]:
    """The logged messages with the layer table's last column, ``runs``
    (the kernels this machine runs), cut off at its header's offset."""
    out = []
    for message in messages:
        lines = message.split('\n')
        headers = [line for line in lines if line.endswith('  runs')
                   or '  runs ' in line]
        if headers:
            cut = headers[0].index('  runs')
            lines = [line[:cut] if i >= lines.index(headers[0]) else line
                     for i, line in enumerate(lines)]
        out.append('\n'.join(lines))
    return out


def _normalise(text: str) -> str:
    from mmseg_gf.engine.zoo import mmseg_config_dir
    return text.replace(mmseg_config_dir(), '<mmseg>').replace(REPO, '<repo>')


def model_text(name: str, analyze_cost) -> str:
    """The golden text of one model."""
    from mmseg_gf.accounting.budget import check_budget, choose_by_budget
    from mmseg_gf.engine.budget import profile_segmentor
    from mmseg_gf.engine.build import build_segmentor
    from mmseg_gf.engine.hooks.grad_filter_hook import GradFilterHook
    from mmseg_gf.engine.surgery import get_gradient_filter_layers

    argv, size = _argv_and_cfg(name)
    out = [f'==== {name}']
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        analyze_cost.main(argv)
    # mmengine's log lines (time-stamped warnings) are not the tool's text
    printed = [line for line in buf.getvalue().rstrip().split('\n')
               if ' - mmengine - ' not in line]
    out += ['---- analyze_cost', '\n'.join(printed)]

    cfg = analyze_cost.load_config(analyze_cost.parse_args(argv))
    # load_config keeps the checked settings object in the config
    cfg.gradient_filter = dataclasses.replace(cfg.gradient_filter,
                                              layer_kinds=LAYER_KINDS)
    torch.manual_seed(0)
    model = build_segmentor(cfg, (size, size))
    runner = _Runner()
    GradFilterHook._log_cost(runner, model, get_gradient_filter_layers(model))
    out += ['---- hook table'] + without_runs_column(runner.logger.lines)

    plain_cfg = cfg.copy()
    plain_cfg.pop('gradient_filter', None)
    torch.manual_seed(0)
    plain = build_segmentor(plain_cfg)
    out.append('---- budgets')
    try:
        # the GELUs by their input, as the recorded text (the patch-mean
        # rule came after it; test_token_kinds_accounting.py and
        # test_lean_transformer_families.py check the budget with it)
        profile = profile_segmentor(plain, (size, size), timeline=True,
                                    layer_kinds=LAYER_KINDS,
                                    patch_mean_activations=False)
    except ValueError as err:  # e.g. a layer the all-layers probe refuses
        out.append(f'profile: ValueError: {err}')
        return _normalise('\n'.join(out)) + '\n'
    for n in sorted({1, min(5, profile.max_layers), profile.max_layers}):
        out.append(f'last {n}, r = 4: '
                   f'{profile.cost(n, 4, BATCH).describe()}')
    last5 = profile.cost(min(5, profile.max_layers), 4, BATCH)
    peak = dict(peak_mib=round(last5.peak_mib + 0.05, 1))
    for budget in BUDGETS + (peak, ):
        try:
            choice = choose_by_budget(profile, check_budget(dict(budget)),
                                      BATCH)
            out.append(f'{budget}: {choice.summary()}')
            out.append(f'  radii {sorted(choice.cost.radii.items())}')
        except ValueError as err:
            out.append(f'{budget}: ValueError: {err}')
    return _normalise('\n'.join(out)) + '\n'


def golden_text(names: Optional[List[str]] = None) -> Dict[str, str]:
    """Model name -> its text, for ``names`` (default: all)."""
    from tests.helpers.tools import load_tool
    analyze_cost = load_tool('analyze_cost')
    texts = {}
    for name in names or model_names():
        start = time.time()
        texts[name] = model_text(name, analyze_cost)
        print(f'{name}: {time.time() - start:.1f} s', file=sys.stderr)
    return texts


def split_golden(text: str) -> Dict[str, str]:
    """The per-model sections of a golden file."""
    sections: Dict[str, str] = {}
    for part in text.split('==== ')[1:]:
        name = part.split('\n', 1)[0]
        sections[name] = '==== ' + part
    return sections


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('names', nargs='*', help='models (default: all)')
    parser.add_argument('--out', help='write here instead of stdout')
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    text = ''.join(golden_text(args.names or None).values())
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == '__main__':
    main()
