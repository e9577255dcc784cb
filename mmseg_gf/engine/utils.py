"""Small helpers shared by the engine and analysis modules."""
from mmengine.model import is_model_wrapper
from torch import nn

__all__ = ['unwrap_model']


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside an mmengine model wrapper (DDP, FSDP, ...), or
    ``model`` itself when it is not wrapped."""
    return model.module if is_model_wrapper(model) else model
