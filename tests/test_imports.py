"""The import graph's contract: mmseg_gf is built in layers, lowest first.

``LAYERS`` below is the one definition of the order (docs/layout.md
states it and points here)::

    mmseg_gf.ops         the math: no mmseg, mmcv or mmengine
    mmseg_gf.patching    the one module that changes other libraries' objects
    mmseg_gf.models      registered modules
    mmseg_gf.accounting  cost model, step trace, peak model, budget choice
    mmseg_gf.engine      mmengine integration
    mmseg_gf.analysis    measurements, benchmarks, reports
    mmseg_gf.protocol    the paper's protocol
    mmseg_gf.demo        the steps of `make demo`

``mmseg_gf.datasets`` stands beside the ladder: it imports nothing else of
mmseg_gf, and only protocol and demo import it. ``tools/*.py`` are scripts
on top: they may import anything, and mmseg_gf never imports them. The
package root ``mmseg_gf/__init__.py`` is exempt as an importer (it imports
models, ops and engine to register them); importing it counts as importing
what it imports.

The rules, over every import statement, module-level or inside a function,
absolute or relative (``from . import x``), plus ``importlib.import_module``
/ ``__import__`` calls with a literal name:

1. *layers*: no module imports a higher layer (so analysis does not import
   protocol), a layer outside the list, or ``tools``; ops imports nothing of
   mmseg, mmcv or mmengine; the datasets rule above.
2. *function-level*: no import of an mmseg_gf module inside a function,
   except the pairs in ``FUNCTION_LEVEL_ALLOWED``, each with its reason. A
   function-level import is the usual way to hide a cycle from the import
   system; here it must not hide one from the reader either.
3. *cycles*: no cycle between mmseg_gf's top-level subpackages.

Why an AST walk in this file rather than import-linter or grimp: rule 2
needs to know whether an import sits inside a function, which neither tool
reports, so an AST walk would be needed beside them anyway; the walk alone
covers all three rules, reports each violation as ``importer:line ->
imported [rule]``, imports nothing of the package (no mmseg, no torch:
well under a second) and adds no dependency. Checking direct imports is
enough: a chain from a layer up to a higher one has at least one direct
upward step, and that step is reported.

The tests on small throw-away packages under ``tmp_path`` show that the
checker does see what it must (a nested upward import above all), so the
contract test cannot pass because the checker went blind.
"""
import ast
from dataclasses import dataclass
from pathlib import Path
from textwrap import dedent
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

PACKAGE = 'mmseg_gf'
REPO = Path(__file__).resolve().parents[1]

# The layers, lowest first: a module may import its own layer and lower ones.
# A layer need not exist yet (accounting is being created); a subpackage of
# mmseg_gf that is not named here is a violation.
LAYERS = (
    'mmseg_gf.ops',
    'mmseg_gf.patching',
    'mmseg_gf.models',
    'mmseg_gf.accounting',
    'mmseg_gf.engine',
    'mmseg_gf.analysis',
    'mmseg_gf.protocol',
    'mmseg_gf.demo',
)
# Beside the ladder: the package imports nothing else of mmseg_gf, and only
# the listed layers may import it.
STANDALONE = {'mmseg_gf.datasets': ('mmseg_gf.protocol', 'mmseg_gf.demo')}
# The optional compiled kernels setup.py builds from ops/csrc: part of ops.
COMPILED = {
    'mmseg_gf._patch_ops': 'mmseg_gf.ops',
    'mmseg_gf._bit_mask': 'mmseg_gf.ops',
    'mmseg_gf._resized_loss': 'mmseg_gf.ops',
}
# Modules at the package's root that belong to a layer: mmengine imports a
# config scope's registries as ``<scope>.registry`` (mmseg_gf/registry.py
# re-exports engine.scope's).
ROOT_MODULES = {'mmseg_gf.registry': 'mmseg_gf.engine'}
# ops, the bottom layer, must run without the OpenMMLab stack.
OPS_EXTERNAL_FORBIDDEN = ('mmseg', 'mmcv', 'mmengine')
# The scripts directory: above the package, never imported by it.
TOOLS = 'tools'
# (importer, imported) -> why that import may sit inside a function.
FUNCTION_LEVEL_ALLOWED = {
    ('mmseg_gf.ops.conv.gpu', 'mmseg_gf.ops.conv.kernels'):
    'the kernels import triton at module level: loaded on first GPU-path '
    'use, so mmseg_gf.ops imports without triton',
    ('mmseg_gf.ops.conv.gpu', 'mmseg_gf.ops.conv.products_kernels'):
    'the kernels import triton: loaded on first GPU-path use',
    ('mmseg_gf.ops.linear.gpu', 'mmseg_gf.ops.conv.kernels'):
    'the kernels import triton: loaded on first GPU-path use',
    ('mmseg_gf.ops.linear.gpu', 'mmseg_gf.ops.conv.products_kernels'):
    'the kernels import triton: loaded on first GPU-path use',
    ('mmseg_gf.ops.conv_block.gpu',
     'mmseg_gf.ops.conv_block.kernels'):
    'the kernels import triton: loaded on first GPU-path use',
    ('mmseg_gf.ops.bit_mask.gpu', 'mmseg_gf.ops.bit_mask.kernels'):
    'the kernels import triton: loaded on first GPU-path use',
    ('mmseg_gf.ops.linear.gpu', 'mmseg_gf.ops.linear.kernels'):
    'the kernel imports triton: loaded on first GPU-path use',
    ('mmseg_gf.ops.frozen_norm.gpu', 'mmseg_gf.ops.frozen_norm.kernels'):
    'the kernels import triton: loaded on first GPU-path use',
    ('mmseg_gf.ops.resized_loss.loss', 'mmseg_gf.ops.resized_loss.kernels'):
    'the kernel imports triton: loaded on first GPU-path use',
}

RANK = {layer: i for i, layer in enumerate(LAYERS)}
RULE_LAYERS = 'rule 1: layers'
RULE_NESTED = 'rule 2: function-level import'
RULE_CYCLE = 'rule 3: cycle'
NESTED_FIX = ('import it at module level, or allow it in '
              'FUNCTION_LEVEL_ALLOWED with its reason')


@dataclass(frozen=True)
class Import:
    """One module imported by one statement (or literal dynamic call)."""
    importer: str  # dotted name of the importing module
    line: int
    target: str  # dotted name of the imported module
    nested: bool  # inside a function body


def short(name: str) -> str:
    """``mmseg_gf.engine`` -> ``engine`` (messages stay readable)."""
    return name[len(PACKAGE) + 1:] if name.startswith(PACKAGE + '.') else name


def in_package(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + '.')


def module_files(root: Path) -> Dict[str, Tuple[Path, bool]]:
    """Every module of the package under ``root``: name -> (file, is it a
    package's ``__init__``)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob('*.py')):
        parts = path.relative_to(root).with_suffix('').parts
        is_package = parts[-1] == '__init__'
        if is_package:
            parts = parts[:-1]
        modules['.'.join(parts)] = (path, is_package)
    return modules


def scan(root: Path) -> Tuple[List[Import], Set[str]]:
    """All imports of the package under ``root``, and its module names."""
    modules = module_files(root)
    known = set(modules) | set(COMPILED)
    imports = []
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition('.')[0]
        tree = ast.parse(path.read_text(encoding='utf-8'), str(path))
        imports.extend(_imports_in(tree, name, package, known))
    return imports, set(modules)


def _imports_in(tree: ast.AST, importer: str, package: str,
                known: Set[str]) -> Iterator[Import]:
    """Walk the whole tree, remembering whether we are inside a function."""
    stack = [(tree, False)]
    while stack:
        node, nested = stack.pop()
        for target in _targets(node, importer, package, known):
            yield Import(importer, node.lineno, target, nested)
        inner = nested or isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _targets(node: ast.AST, importer: str, package: str,
             known: Set[str]) -> List[str]:
    """The modules one node imports (none for a node that is no import)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _resolve(node.module or '', node.level, package)
        # `from base import name`: a submodule if one is called so, else a
        # name defined in base (or a star), which imports base itself.
        targets = []
        for alias in node.names:
            sub = f'{base}.{alias.name}'
            target = sub if sub in known else base
            if target not in targets:
                targets.append(target)
        return targets
    if isinstance(node, ast.Call):
        return _dynamic_target(node, importer, package)
    return []


def _resolve(module: str, level: int, package: str) -> str:
    """The absolute name of ``from <level dots><module> import ...``."""
    if level == 0:
        return module
    parts = package.split('.')
    base = parts[:len(parts) - (level - 1)]
    return '.'.join(base + ([module] if module else []))


def _dynamic_target(call: ast.Call, importer: str,
                    package: str) -> List[str]:
    """``importlib.import_module('x')`` / ``__import__('x')`` with a literal
    name: the same dodge as a function-level import statement."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(
        func, 'id', None)
    if name not in ('import_module', '__import__') or not call.args:
        return []
    arg = call.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return []
    target = arg.value
    if target.startswith('.'):  # import_module('.x', __package__ / __name__)
        anchor = call.args[1] if len(call.args) > 1 else next(
            (k.value for k in call.keywords if k.arg == 'package'), None)
        if getattr(anchor, 'id', None) == '__name__':
            package = importer
        level = len(target) - len(target.lstrip('.'))
        target = _resolve(target[level:], level, package)
    return [target]


def component(module: str) -> Optional[str]:
    """The layer (or standalone package) a module of mmseg_gf belongs to;
    the root for ``mmseg_gf`` itself; None for one in no layer."""
    if module in COMPILED:
        return COMPILED[module]
    if module in ROOT_MODULES:
        return ROOT_MODULES[module]
    for part in LAYERS + tuple(STANDALONE):
        if module == part or module.startswith(part + '.'):
            return part
    return PACKAGE if module == PACKAGE else None


def layer_rule(src: str, dst: str) -> Optional[str]:
    """Why a module of ``src`` may not import one of ``dst`` (both
    components), or None if it may."""
    if src == dst:
        return None
    if src in STANDALONE:
        return f'{short(src)} imports nothing else of {PACKAGE}'
    if dst in STANDALONE:
        if src in STANDALONE[dst]:
            return None
        allowed = ', '.join(short(c) for c in STANDALONE[dst])
        return f'only {allowed} may import {short(dst)}'
    if RANK[dst] > RANK[src]:
        return (f'upward: {short(src)} (layer {RANK[src] + 1}) imports '
                f'{short(dst)} (layer {RANK[dst] + 1})')
    return None


def where(imp: Import) -> str:
    nested = ' (function-level)' if imp.nested else ''
    return f'{imp.importer}:{imp.line} -> {imp.target}{nested}'


def check(root: Path) -> List[str]:
    """Every violation of the contract by the package under ``root``: rule 1's,
    then rule 2's, then rule 3's, each in file and line order."""
    imports, modules = scan(root)
    layers = [
        f'{module}: in no layer  [{RULE_LAYERS}: add it to LAYERS or '
        'STANDALONE in this file]' for module in sorted(modules)
        if module != PACKAGE and component(module) is None
    ]
    nested = []
    # Importing the root runs its imports: count those instead.
    root_pulls = sorted({
        component(imp.target)
        for imp in imports
        if imp.importer == PACKAGE and in_package(imp.target)
    } - {None, PACKAGE})
    edges: Dict[Tuple[str, str], List[Import]] = {}
    for imp in sorted(imports, key=lambda i: (i.importer, i.line, i.target)):
        src = component(imp.importer)
        if imp.importer == PACKAGE or src is None:
            continue
        layers.extend(_layer_violations(imp, src, root_pulls, edges))
        if (imp.nested and in_package(imp.target)
                and (imp.importer, imp.target) not in FUNCTION_LEVEL_ALLOWED):
            nested.append(f'{where(imp)}  [{RULE_NESTED}: {NESTED_FIX}]')
    return layers + nested + _cycles(edges)


def _layer_violations(imp: Import, src: str, root_pulls: List[str],
                      edges: Dict[Tuple[str, str], List[Import]]) -> List[str]:
    """Rule 1 for one import of a module of ``src``; records the import's
    edge between components for rule 3."""
    top = imp.target.split('.')[0]
    if top == TOOLS:
        return [f'{where(imp)}  [{RULE_LAYERS}: tools are scripts on top of '
                f'{PACKAGE}, never imported by it]']
    if src == 'mmseg_gf.ops' and top in OPS_EXTERNAL_FORBIDDEN:
        return [f'{where(imp)}  [{RULE_LAYERS}: ops imports nothing of '
                f'{", ".join(OPS_EXTERNAL_FORBIDDEN)}]']
    if not in_package(imp.target):
        return []  # third party
    dst = component(imp.target)
    if dst is None:
        return [f'{where(imp)}  [{RULE_LAYERS}: imports a module in no '
                'layer]']
    found = []
    if dst == PACKAGE:
        dsts = root_pulls
        pulled = ', '.join(short(c) for c in root_pulls)
        prefix = f'the package root imports {pulled}; '
    else:
        dsts, prefix = [dst], ''
    for d in dsts:
        reason = layer_rule(src, d)
        if reason:
            found.append(f'{where(imp)}  [{RULE_LAYERS}: {prefix}{reason}]')
        if d != src:
            edges.setdefault((src, d), []).append(imp)
    return found


def _cycles(edges: Dict[Tuple[str, str], List[Import]]) -> List[str]:
    """Each simple cycle between components, once, from its lowest member
    (in LAYERS order), with one import per step as evidence."""
    order = {c: i for i, c in enumerate(LAYERS + tuple(STANDALONE))}
    succ: Dict[str, List[str]] = {}
    for src, dst in sorted(edges, key=lambda e: (order[e[0]], order[e[1]])):
        succ.setdefault(src, []).append(dst)
    found = []

    def walk(start: str, path: List[str]):
        for nxt in succ.get(path[-1], []):
            if nxt == start:
                found.append(path + [start])
            elif order[nxt] > order[start] and nxt not in path:
                walk(start, path + [nxt])

    for start in sorted(succ, key=order.get):
        walk(start, [start])
    messages = []
    for cycle in found:
        steps = []
        for src, dst in zip(cycle, cycle[1:]):
            first, *rest = edges[(src, dst)]
            more = f' (+{len(rest)} more)' if rest else ''
            steps.append(f'{where(first)}{more}')
        chain = ' -> '.join(short(c) for c in cycle)
        messages.append(f'{chain}  [{RULE_CYCLE}] via: ' + '; '.join(steps))
    return messages


# ---------------------------------------------------------------- the tree


def test_package_keeps_its_import_layers():
    """The contract itself, on this repository's mmseg_gf."""
    _, modules = scan(REPO)
    # Guard against a checker that scans nothing (moved file, wrong root).
    assert 'mmseg_gf.ops.conv.function' in modules, sorted(modules)
    violations = check(REPO)
    if violations:
        order = ' < '.join(short(layer) for layer in LAYERS)
        pytest.fail(
            f'{len(violations)} import-contract violation(s) (layers: '
            f'{order}; see the docstring of {Path(__file__).name}):\n' +
            '\n'.join(violations),
            pytrace=False)


def test_function_level_allowlist_is_current():
    """An allowlist entry whose import is gone (or moved to module level)
    must go too, or the list stops saying what is actually exempt."""
    imports, _ = scan(REPO)
    used = {(i.importer, i.target) for i in imports if i.nested}
    stale = sorted(set(FUNCTION_LEVEL_ALLOWED) - used)
    assert not stale, f'no longer function-level imports: {stale}'


# ------------------------------------------------- the checker on toy trees


def make_tree(root: Path, files: Dict[str, str]) -> Path:
    """A throw-away package: ``files`` maps paths (under ``root``) to code;
    every directory on the way gets an empty ``__init__.py``."""
    for rel, code in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    for rel in files:
        for directory in (root / rel).parents:
            if directory == root:
                break
            init = directory / '__init__.py'
            if not init.exists():
                init.write_text('')
    return root


def test_checker_sees_nested_upward_imports(tmp_path):
    """The case the contract is for: an upward import hidden in a function
    (absolute; relative, in a function nested in a method)."""
    make_tree(
        tmp_path, {
            'mmseg_gf/engine/hook.py': 'X = 1\n',
            'mmseg_gf/ops/math.py': dedent("""\
                import torch

                def f():
                    from mmseg_gf.engine import hook

                class A:
                    def g(self):
                        def h():
                            from ..engine.hook import X
                """),
        })
    hidden = '-> mmseg_gf.engine.hook (function-level) '
    upward = '[rule 1: layers: upward: ops (layer 1) imports engine (layer 5)]'
    nested = f'[{RULE_NESTED}: {NESTED_FIX}]'
    assert check(tmp_path) == [
        f'mmseg_gf.ops.math:4 {hidden} {upward}',
        f'mmseg_gf.ops.math:9 {hidden} {upward}',
        f'mmseg_gf.ops.math:4 {hidden} {nested}',
        f'mmseg_gf.ops.math:9 {hidden} {nested}',
    ]


def test_checker_resolves_relative_and_dynamic_forms(tmp_path):
    """What each form imports: ``from . import x`` is module ``x``; a name
    that is no module imports the package defining it; a literal
    ``import_module`` counts, relative ones included."""
    make_tree(
        tmp_path, {
            'mmseg_gf/analysis/table.py': '',
            'mmseg_gf/protocol/report.py': '',
            'mmseg_gf/engine/config.py': '',
            'mmseg_gf/engine/hooks/other.py': '',
            'mmseg_gf/engine/hooks/hook.py': dedent("""\
                from . import other
                from .. import config, check_settings
                from ... import analysis
                from ...analysis.table import format_table
                import importlib
                def f():
                    importlib.import_module('mmseg_gf.protocol.report')
                    importlib.import_module('.other', __package__)
                    __import__('torch')
                """),
        })
    imports, _ = scan(tmp_path)
    assert sorted((i.line, i.target, i.nested) for i in imports) == [
        (1, 'mmseg_gf.engine.hooks.other', False),
        (2, 'mmseg_gf.engine', False),
        (2, 'mmseg_gf.engine.config', False),
        (3, 'mmseg_gf.analysis', False),
        (4, 'mmseg_gf.analysis.table', False),
        (5, 'importlib', False),
        (7, 'mmseg_gf.protocol.report', True),
        (8, 'mmseg_gf.engine.hooks.other', True),
        (9, 'torch', True),
    ]


def test_checker_finds_cycles(tmp_path):
    """A cycle between subpackages, with an import as evidence per step."""
    make_tree(
        tmp_path, {
            'mmseg_gf/models/conv.py': 'from ..engine import surgery\n',
            'mmseg_gf/engine/surgery.py': 'from ..models import conv\n',
        })
    assert check(tmp_path) == [
        'mmseg_gf.models.conv:1 -> mmseg_gf.engine.surgery  '
        '[rule 1: layers: upward: models (layer 3) imports engine (layer 5)]',
        'models -> engine -> models  [rule 3: cycle] via: '
        'mmseg_gf.models.conv:1 -> mmseg_gf.engine.surgery; '
        'mmseg_gf.engine.surgery:1 -> mmseg_gf.models.conv',
    ]


def test_checker_applies_the_side_rules(tmp_path):
    """datasets stands alone; ops needs no OpenMMLab package; tools are
    never imported; the root counts as what it imports; the allowlist
    exempts from rule 2 only; a compiled module is part of ops; a missing
    layer (accounting) is fine, an unlisted subpackage is not."""
    make_tree(
        tmp_path, {
            'mmseg_gf/__init__.py': 'from . import engine\n',
            'mmseg_gf/engine/__init__.py': '',
            'mmseg_gf/datasets/synthetic.py': 'from ..ops import math\n',
            'mmseg_gf/analysis/data.py': 'from ..datasets import synthetic\n',
            'mmseg_gf/protocol/stages.py': dedent("""\
                from ..datasets import synthetic
                from ..analysis import data
                from tools import train
                """),
            'mmseg_gf/ops/math.py': 'import torch\nfrom mmcv.ops import x\n',
            'mmseg_gf/ops/backend/extension.py': 'from ... import _patch_ops\n',
            'mmseg_gf/ops/conv/gpu.py': dedent("""\
                def kernels():
                    from . import kernels
                def hook():
                    from ...engine import y
                """),
            'mmseg_gf/ops/conv/kernels.py': 'import triton\n',
            'mmseg_gf/models/conv.py': 'from mmseg_gf import GFConv2d\n',
            'mmseg_gf/extra/thing.py': '',
        })
    assert check(tmp_path) == [
        'mmseg_gf.extra: in no layer  [rule 1: layers: add it to LAYERS or '
        'STANDALONE in this file]',
        'mmseg_gf.extra.thing: in no layer  [rule 1: layers: add it to '
        'LAYERS or STANDALONE in this file]',
        'mmseg_gf.analysis.data:1 -> mmseg_gf.datasets.synthetic  '
        '[rule 1: layers: only protocol, demo may import datasets]',
        'mmseg_gf.datasets.synthetic:1 -> mmseg_gf.ops.math  '
        '[rule 1: layers: datasets imports nothing else of mmseg_gf]',
        'mmseg_gf.models.conv:1 -> mmseg_gf  [rule 1: layers: the package '
        'root imports engine; upward: models (layer 3) imports engine '
        '(layer 5)]',
        'mmseg_gf.ops.conv.gpu:4 -> mmseg_gf.engine '
        '(function-level)  [rule 1: layers: upward: ops (layer 1) imports engine (layer 5)]',
        'mmseg_gf.ops.math:2 -> mmcv.ops  [rule 1: layers: ops imports '
        'nothing of mmseg, mmcv, mmengine]',
        'mmseg_gf.protocol.stages:3 -> tools  [rule 1: layers: tools are '
        'scripts on top of mmseg_gf, never imported by it]',
        'mmseg_gf.ops.conv.gpu:4 -> mmseg_gf.engine '
        f'(function-level)  [{RULE_NESTED}: {NESTED_FIX}]',
    ]


def test_checker_knows_accounting_once_it_exists(tmp_path):
    """accounting sits between models and engine: it may import models and
    be imported by engine, not the other way round."""
    make_tree(
        tmp_path, {
            'mmseg_gf/models/conv.py': '',
            'mmseg_gf/accounting/cost.py': dedent("""\
                from ..models import conv
                from ..engine import budget
                """),
            'mmseg_gf/engine/budget.py': 'from ..accounting import cost\n',
        })
    assert check(tmp_path) == [
        'mmseg_gf.accounting.cost:2 -> mmseg_gf.engine.budget  '
        '[rule 1: layers: upward: accounting (layer 4) imports engine '
        '(layer 5)]',
        'accounting -> engine -> accounting  [rule 3: cycle] via: '
        'mmseg_gf.accounting.cost:2 -> mmseg_gf.engine.budget; '
        'mmseg_gf.engine.budget:1 -> mmseg_gf.accounting.cost',
    ]
