"""Train a policy against the simulated user.

  python -m rlver_jax.main                                   # configs/demo.py, CPU, minutes
  python -m rlver_jax.main --config=configs/ppo.py --config.workdir=W \
      --config.policy.checkpoint=DIR --config.rl.kl_coef=0.01   # any field can be overridden
"""

import logging as logging_std
import os

from absl import app, flags, logging
from ml_collections import config_flags

from rlver_jax import trainer

_DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                     "demo.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEMO, "training config file[:variant]",
                                          lock_config=True)


class _QuietLibraries(logging_std.Filter):
  """Keeps our INFO progress lines; drops the INFO chatter of checkpointing and JAX internals."""

  def filter(self, record):
    return record.levelno >= logging_std.WARNING or not any(
        part in record.pathname for part in ("orbax", "jax/_src", "etils"))


def main(argv):
  logging.get_absl_handler().addFilter(_QuietLibraries())
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  logging.info("config:\n%s", config)
  trainer.Trainer(config).run()


if __name__ == "__main__":
  flags.FLAGS.alsologtostderr = True
  app.run(main)
