"""Re-wrapping a DDP model after its trainable parameters changed.

DDP records which parameters require gradients when it is built and waits
for all of them in every backward; after the hooks freeze most of them (or
unfreeze some, as calibration does) the old wrapper would fail with
"Expected to have finished reduction in the prior iteration". Both
GradFilterHook and CalibrationHook wrap the model again with this.
"""
import copy
import gc

from torch import nn

__all__ = ['rewrap_ddp']


def rewrap_ddp(runner, model: nn.Module) -> None:
    """Wrap ``model`` in the runner's model wrapper again, with the
    config's wrapper settings (``model_wrapper_cfg``).

    The old wrapper is released first (and collected) so its reducer's
    autograd hooks leave the shared Parameters.
    """
    wrapper_cfg = copy.deepcopy(runner.cfg.get('model_wrapper_cfg'))
    runner.model = None
    gc.collect()
    runner.model = runner.wrap_model(wrapper_cfg, model)
