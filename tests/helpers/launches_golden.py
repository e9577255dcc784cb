"""The launch counts ``tests/test_analysis/test_launch_count.py`` holds:
``tools/count_launches.py`` on the four models of the launch targets at
64x64, batch 1 (PSPNet-R18 last 10; BiSeNetV2, Segformer-B0 and Swin-T
UPerNet last 20; lean GF at r = 4 against vanilla-same-layers), per row and
phase: launches, Triton launches, bytes read and written, host reads and
launches per kind.

``tests/golden/launches_64.json`` holds them. Code that changes what a step
launches (fewer launches is the point of the lean region's kernels)
rewrites it, and the diff shows the change::

    python tests/helpers/launches_golden.py --write       # all four, ~2-4 min
    git diff tests/golden/launches_64.json
"""
import argparse
import json
import os
import os.path as osp
import subprocess
import sys
import tempfile
from typing import Dict, List

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
GOLDEN = osp.join(REPO, 'tests', 'golden', 'launches_64.json')
_LAST10 = ['--rows', 'gf_last10_r4:lean', 'vanilla_last10:plain']
_LAST20 = ['--rows', 'gf_last20_r4:lean', 'vanilla_last20:plain']
#: Each model's tool arguments.
MODELS = {
    'pspnet_r18': ['--models', 'pspnet_r18', *_LAST10],
    'bisenetv2': ['--families', 'bisenetv2', *_LAST20],
    'segformer_b0': ['--families', 'segformer_b0', *_LAST20],
    'swin_t': ['--families', 'swin_t', *_LAST20],
}
#: Per phase, what the golden file holds.
HELD = ('launches', 'triton', 'read_bytes', 'written_bytes', 'host_reads',
        'by_kind')
PHASES = ('forward', 'backward', 'optimizer', 'step')


def run_tool(model: str, out_dir: str) -> List[Dict]:
    """``tools/count_launches.py`` on one model at 64x64, batch 1, in a
    subprocess (triton decides at import whether it interprets); its
    ``launches.json``."""
    env = dict(os.environ, TRITON_INTERPRET='1')
    env.pop('MMSEG_GF_TRITON', None)
    env['PYTHONPATH'] = os.pathsep.join(
        p for p in (REPO, env.get('PYTHONPATH')) if p)
    proc = subprocess.run(
        [sys.executable, osp.join(REPO, 'tools', 'count_launches.py'),
         *MODELS[model], '--input-size', '64', '--batch', '1', '--threads',
         '1', '--out-dir', out_dir],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(osp.join(out_dir, 'launches.json')) as f:
        return json.load(f)


def held(result: Dict) -> Dict:
    """One model's result as the golden file holds it: row -> phase ->
    :data:`HELD`."""
    return {r['row']: {p: {k: r[p][k] for k in HELD} for p in PHASES}
            for r in result['rows']}


def load() -> Dict:
    with open(GOLDEN) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--write', action='store_true',
                   help=f'write {osp.relpath(GOLDEN, REPO)}')
    p.add_argument('models', nargs='*', default=list(MODELS))
    args = p.parse_args()
    counts = {}
    for model in args.models:
        with tempfile.TemporaryDirectory() as out:
            result = run_tool(model, out)[0]
        counts[model] = held(result)
        meta = dict(torch=result['torch'], triton=result['triton'])
    text = json.dumps(dict(meta, counts=counts), indent=1, sort_keys=True)
    if args.write:
        with open(GOLDEN, 'w') as f:
            f.write(text + '\n')
        print(f'wrote {GOLDEN}')
    else:
        print(text)


if __name__ == '__main__':
    main()
