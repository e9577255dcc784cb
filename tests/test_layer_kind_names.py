"""Selection, surgery, accounting, analysis, hooks and tools go through the
layer kinds (:mod:`mmseg_gf.models.layer_kinds`) and name no layer type
of theirs, as ``test_imports`` keeps the layering: no reference to a
kind's plain, filtered or family type in their code (an ``isinstance``, a
table of types, a constructor, an ``is`` test; a type annotation may name
one) and no ``'conv2d'`` literal (the conv kind is ``CONV2D.name``). The
same holds for the modules below them that ask what a layer is: the lean
region (:mod:`mmseg_gf.models.lean`, ``lean_head``, ``lean_transformer``,
``conv_block``) and the gradient-quality measures (:mod:`mmseg_gf.models.gradient_quality`, whose
DC-energy ratio takes the kernels the kinds give). The kinds' own files
(``layer_kinds``, ``linear_kinds``, their filtered modules) may.
"""
import ast
import io
import tokenize
from pathlib import Path
from textwrap import dedent
from typing import Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The packages and modules that must go through the kinds.
SCANNED = ('mmseg_gf/engine', 'mmseg_gf/accounting', 'mmseg_gf/analysis',
           'mmseg_gf/protocol', 'tools', 'mmseg_gf/models/lean.py',
           'mmseg_gf/models/lean_head.py', 'mmseg_gf/models/conv_block.py',
           'mmseg_gf/models/lean_transformer.py', 'mmseg_gf/models/gradient_quality.py')
#: The kinds' plain, filtered and family types.
TYPE_NAMES = {'Conv2d', 'GFConv2d', '_ConvNd', 'Linear', 'GFLinear',
              'NonDynamicallyQuantizableLinear', 'MultiheadAttention',
              'GFMultiheadAttention'}


def _files() -> Iterator[str]:
    for entry in SCANNED:
        path = ROOT / entry
        paths = [path] if path.suffix == '.py' else sorted(path.rglob('*.py'))
        for found in paths:
            yield found.relative_to(ROOT).as_posix()


def _annotation_nodes(tree: ast.AST) -> Set[int]:
    """The nodes inside type annotations (arguments, returns, annotated
    assignments): they may name a type."""
    roots = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            roots += [arg.annotation for arg in (
                a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg])
                if arg is not None and arg.annotation is not None]
            roots += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
    return {id(n) for root in roots for n in ast.walk(root)}


def _type_references(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """``(line, name)`` of every reference to a kind's type outside
    annotations: ``nn.Conv2d``, ``Conv2d``, an imported name."""
    skip = _annotation_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in TYPE_NAMES:
                    yield node.lineno, f'import of {alias.name}'
            continue
        name = node.attr if isinstance(node, ast.Attribute) else \
            node.id if isinstance(node, ast.Name) else ''
        if name in TYPE_NAMES and id(node) not in skip:
            yield node.lineno, name


def _conv2d_literals(source: str) -> Iterator[int]:
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and \
                tok.string.strip('\'"') == 'conv2d':
            yield tok.start[0]


def violations(source: str, rel: str = '<source>') -> List[str]:
    """Every layer type named and ``'conv2d'`` literal in ``source``."""
    found = [f'{rel}:{line}: {name}'
             for line, name in _type_references(ast.parse(source))]
    found += [f'{rel}:{line}: conv2d' for line in _conv2d_literals(source)]
    return found


@pytest.mark.parametrize('rel', list(_files()))
def test_no_layer_type_is_named_outside_the_kinds(rel):
    found = violations((ROOT / rel).read_text(), rel)
    assert not found, found


def test_the_scan_sees_every_way_of_naming_a_type():
    source = dedent('''
        from torch import nn
        from torch.nn.modules.conv import _ConvNd
        from mmseg_gf.models.gf_linear import GFLinear

        _TYPES = ((nn.Linear, 'linear'), )

        def kind(module: nn.Conv2d) -> nn.MultiheadAttention:
            if type(module) is not nn.Conv2d:
                return nn.MultiheadAttention(4, 1)
            return isinstance(module, (GFLinear, _ConvNd)) or 'conv2d'
    ''')
    lines = sorted(v.split(':', 1)[1] for v in violations(source))
    assert lines == sorted([
        '3: import of _ConvNd', '4: import of GFLinear', '6: Linear',
        '9: Conv2d', '10: MultiheadAttention', '11: GFLinear', '11: _ConvNd',
        '11: conv2d'])
