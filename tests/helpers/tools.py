"""Load a script of ``tools/`` as a module, for tests that call its
``main(argv)`` in process (faster than a subprocess, and monkeypatch and
capsys reach it). Loaded from its file: ``tools/`` is not a package and is
not put on ``sys.path``."""
import importlib.util
import os.path as osp

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOLS_DIR = osp.join(REPO, 'tools')


def load_tool(name: str):
    """``tools/<name>.py`` as a fresh module named ``gf_tool_<name>``."""
    spec = importlib.util.spec_from_file_location(
        f'gf_tool_{name}', osp.join(TOOLS_DIR, f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
