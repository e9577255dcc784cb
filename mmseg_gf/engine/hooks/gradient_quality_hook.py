"""``GradientQualityHook``: log how close filtered gradients are to exact.

Every ``interval`` iterations, SNR and cosine of each filtered layer's
``g_y``, ``g_x`` and ``g_W`` (paper Section 4.1) go to the message hub as
``gf_quality/<layer>/<measure>``.
"""

from typing import Optional

from mmengine.hooks import Hook
from mmseg.registry import HOOKS

from ...models.layer_kinds import is_filtered, kind_of
from ...models.segmentor import unwrap_model
from ...models.gradient_quality import capture_layer_io


@HOOKS.register_module()
class GradientQualityHook(Hook):
    """Periodically measure filtered-vs-exact gradient quality.

    One exact backward per filtered layer on each measured iteration: keep
    ``interval`` large in real runs.

    Args:
        interval (int): measure every ``interval`` training iterations.
    """

    priority = 'LOW'

    def __init__(self, interval: int = 500) -> None:
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f'GradientQualityHook interval must be an int >= 1, '
                f'got {interval!r}')
        self.interval = interval
        self._recorder = None
        self._records: Optional[dict] = None

    @staticmethod
    def _filtered_layers(runner):
        model = unwrap_model(runner.model)
        return [(name, module) for name, module in model.named_modules()
                if is_filtered(module) and module.enabled]

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if not self.every_n_train_iters(runner, self.interval):
            return
        layers = self._filtered_layers(runner)
        if layers:
            self._recorder = capture_layer_io(layers)
            self._records = self._recorder.__enter__()

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None) -> None:
        if self._recorder is None:
            return
        self._recorder.__exit__(None, None, None)
        modules = dict(self._filtered_layers(runner))
        for name, (x, grad_out) in self._records.items():
            if grad_out is None:
                continue
            module = modules[name]
            quality = kind_of(module).quality(module, x, grad_out,
                                              module.radius)
            for key, value in vars(quality).items():
                runner.message_hub.update_scalar(
                    f'gf_quality/{name}/{key}', value)
            runner.logger.info(
                f'gf_quality {name}: SNR g_y {quality.snr_grad_output:.3g}, '
                f'g_x {quality.snr_grad_input:.3g} (propagated '
                f'{quality.snr_grad_input_propagated:.3g}), g_W '
                f'{quality.snr_grad_weight:.3g}; cos g_x '
                f'{quality.cos_grad_input:.3f}, g_W '
                f'{quality.cos_grad_weight:.3f}')
        self._recorder, self._records = None, None
