"""The registries of the ``mmseg_gf`` config scope, under the module name
mmengine imports for a scope (``<scope>.registry``): children of mmseg's,
holding nothing of their own (:mod:`mmseg_gf.engine.scope` says why)."""
from .engine.scope import REGISTRIES

globals().update(REGISTRIES)

__all__ = sorted(REGISTRIES)
