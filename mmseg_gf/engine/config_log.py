"""A Runner that names its config instead of logging its text.

mmengine's Runner logs the whole config when it is built (``Config:`` and
the text; 1,000 lines for a zoo config) and dumps it into its work dir. A
run made of several Runners of one config (the demo: initial weights,
evaluation, finetuning, evaluation) would print it each time;
:class:`ConfigByNameRunner` logs one line naming the file instead, and
dumps it all the same. The run that trains keeps mmengine's Runner, so the
log holds the config once.
"""
import logging
import os.path as osp

from mmengine.runner import Runner

__all__ = ['ConfigByNameRunner']


class _DropConfigText(logging.Filter):
    """Drops the record of the Runner's ``Config:`` dump."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith('Config:\n')


class ConfigByNameRunner(Runner):
    """mmengine's Runner, logging ``Config: <work dir>/<config file>``
    (the dump) where it would log the config's text."""

    def _log_env(self, env_cfg: dict) -> None:
        drop = _DropConfigText()
        self.logger.addFilter(drop)
        try:
            super()._log_env(env_cfg)
        finally:
            self.logger.removeFilter(drop)
        if self.cfg._cfg_dict:
            name = (osp.basename(self.cfg.filename) if self.cfg.filename
                    else f'{self.timestamp}.py')  # as dump_config names it
            self.logger.info(f'Config: {osp.join(self.work_dir, name)} '
                             '(its text is not repeated here)')
