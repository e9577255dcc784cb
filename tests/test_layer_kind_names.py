"""Selection, surgery, accounting, analysis, hooks and tools go through the
layer kinds (:mod:`mmseg_gf.models.layer_kinds`) and name no layer type
of theirs, as ``test_imports`` keeps the layering: no ``isinstance`` of
a kind's plain or filtered type and no ``'conv2d'`` literal (the conv
kind is ``CONV2D.name``) in their modules. The kinds' own files, and the
Linear's and attention's kept rule (:mod:`mmseg_gf.accounting.kept_tokens`,
which those kinds name as theirs), may.
"""
import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The packages that must go through the kinds.
SCANNED = ('mmseg_gf/engine', 'mmseg_gf/accounting', 'mmseg_gf/analysis',
           'mmseg_gf/protocol', 'tools')
#: A kind's own code.
KIND_FILES = ('mmseg_gf/accounting/kept_tokens.py', )
#: The kinds' plain and filtered types.
TYPE_NAMES = {'Conv2d', 'GFConv2d', 'Linear', 'GFLinear',
              'MultiheadAttention', 'GFMultiheadAttention'}


def _files():
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob('*.py')):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in KIND_FILES:
                yield rel


def _type_name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ''


def _isinstance_types(tree: ast.AST):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and _type_name(node.func) ==
                'isinstance' and len(node.args) == 2):
            types = node.args[1]
            elements = types.elts if isinstance(types, ast.Tuple) \
                else [types]
            for element in elements:
                if _type_name(element) in TYPE_NAMES:
                    yield node.lineno, _type_name(element)


@pytest.mark.parametrize('rel', list(_files()))
def test_no_layer_type_is_named_outside_the_kinds(rel):
    source = (ROOT / rel).read_text()
    found = [f'{rel}:{line}: isinstance of {name}'
             for line, name in _isinstance_types(ast.parse(source))]
    found += [f'{rel}:{tok.start[0]}: {tok.string}'
              for tok in tokenize.generate_tokens(io.StringIO(source)
                                                  .readline)
              if tok.type == tokenize.STRING
              and tok.string.strip('\'"') == 'conv2d']
    assert not found, found
