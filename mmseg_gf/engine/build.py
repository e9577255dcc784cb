"""Building a config's segmentor outside a Runner, as training builds it."""
import copy
from dataclasses import replace
from typing import Optional, Sequence

from mmseg.registry import MODELS
from mmseg.utils import register_all_modules
from torch import nn

from .config import rewrite_config
from .settings import as_settings

__all__ = ['build_segmentor']


def build_segmentor(cfg, input_size: Optional[Sequence[int]] = None
                    ) -> nn.Module:
    """Build a config's segmentor with its ``gradient_filter`` applied.

    Args:
        cfg (mmengine.Config): not modified.
        input_size: the selection trace's size when the setting names none
            (cheaper; the chosen layers are the same).

    Raises:
        ValueError: the config's ``gradient_filter`` is refused.
    """
    register_all_modules(init_default_scope=False)
    cfg = copy.deepcopy(cfg)
    given = cfg.get('gradient_filter')
    if input_size is not None and given is not None:
        settings = as_settings(given)  # checked once; the rewrite takes it
        if settings.input_size is None:
            settings = replace(settings, input_size=tuple(
                int(v) for v in input_size))
        cfg.gradient_filter = settings
    rewrite_config(cfg)
    # mmengine gives the model dict a ``_scope_`` only when the config file
    # itself sets ``default_scope``; a zoo config inherits it from a base,
    # and the segmentor's own builds (its data preprocessor) would then
    # look in mmengine's registry instead of mmseg's.
    cfg.model.setdefault('_scope_', cfg.get('default_scope') or 'mmseg')
    return MODELS.build(cfg.model)
