"""The shape every config-driven entry point shares: `--config=FILE[:variant]` plus overrides."""

from __future__ import annotations

import logging as logging_std
import os
from typing import Callable

from absl import app, flags, logging
from ml_collections import config_flags

from models.errors import RunStopped, UserInputError

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class _QuietLibraries(logging_std.Filter):
  """Keeps our INFO progress lines; drops the INFO chatter of checkpointing and JAX internals."""

  def filter(self, record):
    return record.levelno >= logging_std.WARNING or not any(
        part in record.pathname for part in ("orbax", "jax/_src", "etils"))


def run(default_file: str, help_text: str, fn: Callable) -> None:
  """Defines --config (default configs/`default_file`) and runs `fn(config)` under app.run.

  Call it only from a `__main__` block: the flag is defined here, so modules
  that are merely imported define none and can live side by side.
  """
  config_flag = config_flags.DEFINE_config_file(
      "config", os.path.join(CONFIGS_DIR, default_file), help_text, lock_config=True)

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_QuietLibraries())
    config = config_flag.value
    logging.info("config:\n%s", config)
    try:
      fn(config)
    except (UserInputError, RunStopped) as e:  # one line; our bugs keep their traceback
      raise SystemExit(f"error: {e}") from None

  flags.FLAGS.alsologtostderr = True
  app.run(main)
