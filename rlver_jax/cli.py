"""The shape every config-driven entry point shares: `--config=FILE[:variant]` plus overrides."""

from __future__ import annotations

import difflib
import logging as logging_std
import os
import re
import signal
import sys
from typing import Callable, Iterator

from absl import app, flags, logging
import ml_collections
from ml_collections import config_flags
from ml_collections.config_flags import config_path
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from infra.errors import RunStopped, UserInputError
from rlver_jax import compile_cache, preemption, run_config, sharding, workdir

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class _QuietLibraries(logging_std.Filter):
  """Keeps our INFO progress lines; drops the INFO chatter of checkpointing and JAX internals."""

  def filter(self, record):
    # A full disk: orbax (and asyncio, for orbax's tasks) logs each failed write with its
    # traceback; the run then fails with it, and the CLI says it in one line.
    if any(part in record.pathname for part in ("orbax", "etils", "asyncio")) and (
        workdir.no_space_error(record.exc_info and record.exc_info[1]) or
        workdir.tells_of_no_space(record.getMessage())):
      return False
    return record.levelno >= logging_std.WARNING or not any(
        part in record.pathname for part in ("orbax", "jax/_src", "etils"))


def _quiet_closed_loop(report_unraisable: Callable) -> Callable:
  """A sys.unraisablehook that drops "Event loop is closed": when one write of an orbax save
  fails (a full disk), orbax closes its event loop and tensorstore's callbacks for the others'
  writes each print that traceback, which says nothing the run's own error does not."""

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and
            str(unraisable.exc_value) == "Event loop is closed"):
      report_unraisable(unraisable)

  return hook


FIELDS_COMMAND = "python -m rlver_jax.fields"
_CONFIG_FLAG = re.compile(r"^-{1,2}config(=|$)")
_OVERRIDE_FLAG = re.compile(r"^-{1,2}(no)?config\.([^=]+)")
# A user who types the key itself where its variable's name goes is told the difference.
_SUGGESTION_NOTES = {
    "sim_user.api_key_env": "it names the environment variable that holds the key, not the key"}


def is_config_flag(arg: str) -> bool:
  """Whether `arg` is a --config=FILE or --config.FIELD(=VALUE) flag (the entry points' own)."""
  return bool(_CONFIG_FLAG.match(arg) or _OVERRIDE_FLAG.match(arg))


def override_field(arg: str) -> str | None:
  """The dotted field a --config.FIELD=VALUE flag sets; None for any other argument."""
  override = _OVERRIDE_FLAG.match(arg)
  return override.group(2) if override else None


def _config_flag_index(argv: list[str]) -> int:
  """Where the last --config is on the command line; -1 if it is not."""
  return max((i for i, arg in enumerate(argv) if _CONFIG_FLAG.match(arg)), default=-1)


def _chosen_config(argv: list[str], default_file: str) -> str:
  """The --config value on the command line (FILE[:variant]), else the default's path."""
  i = _config_flag_index(argv)
  if i < 0:
    return os.path.relpath(os.path.join(CONFIGS_DIR, default_file))
  return argv[i].split("=", 1)[1] if "=" in argv[i] else argv[i + 1] if i + 1 < len(argv) else ""


def dotted_fields(config: ml_collections.ConfigDict,
                  prefix: str = "") -> Iterator[tuple[str, object]]:
  """(dotted name, value) of every field and section of `config`, sections before their fields."""
  for name, value in config.items():
    yield prefix + name, value
    if isinstance(value, ml_collections.ConfigDict):
      yield from dotted_fields(value, f"{prefix}{name}.")


def check_override_names(argv: list[str], default_file: str) -> None:
  """Raises UserInputError for a --config.FIELD override that names no field of the chosen
  config, or that comes before --config. The message names the field, never the value:
  the value may be a secret typed into the wrong field."""
  argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
  chosen = _chosen_config(argv, default_file)
  config_file = chosen.split(":", 1)[0]
  if not os.path.isfile(config_file):
    raise UserInputError(f"--config: no config file {config_file!r}")
  try:
    config = ConfigFileFlagParser("config").parse(chosen)
  except (TypeError, ValueError) as e:
    # The configs refuse a variant with a ValueError that lists theirs. ml_collections re-raises
    # it with its traceback as text, so its own message is the one it replaced.
    refusal = e.__context__
    if ":" in chosen and isinstance(refusal, ValueError):
      raise UserInputError(f"--config={chosen}: {refusal}") from None
    return  # any other failure: --config's parse reports it, with its traceback
  names = [name for name, _ in dotted_fields(config)]
  config_index = _config_flag_index(argv)
  for i, arg in enumerate(argv):
    field = override_field(arg)
    if field is None:
      continue
    if i < config_index:
      raise UserInputError(f"--config.{field} comes before --config; put --config first")
    if field in names:
      continue
    suggestion = difflib.get_close_matches(field, names, n=1)
    if not suggestion:
      raise UserInputError(f"no field {field} in {chosen}; list its fields with "
                           f"{FIELDS_COMMAND} --config={chosen}")
    note = f" ({_SUGGESTION_NOTES[suggestion[0]]})" if suggestion[0] in _SUGGESTION_NOTES else ""
    raise UserInputError(f"no field {field} in {chosen}; did you mean {suggestion[0]}?{note}")


def define_config_flag(default_file: str, help_text: str) -> flags.FlagHolder:
  """Defines --config (default configs/`default_file`) for app.run(..., flags_parser=parse_flags).

  Defining it loads the config when the command line names none, and loading defines a
  flag per --config.FIELD override: a FIELD that is not there fails in three chained
  tracebacks that repeat the value. So the names are checked first, in one line.
  """
  try:
    check_override_names(sys.argv, default_file)
  except UserInputError as e:
    raise SystemExit(f"error: {e}") from None
  config_flag = config_flags.DEFINE_config_file(
      "config", os.path.join(CONFIGS_DIR, default_file), help_text, lock_config=True)
  # --help lists the main module's flags only; this one is defined here.
  flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS["config"])
  return config_flag


def _parsed(flag_values: flags.FlagValues, argv: list[str]) -> list[str]:
  """`flag_values(argv)`; a flag error is a UserInputError in one line, a bad --config.FIELD
  value named by its field and expected type, not by the value (a secret?)."""
  try:
    return flag_values(argv)
  except flags.IllegalFlagValueError as e:
    bad_flag = re.match(r"flag --(config\.[^=]+)=", str(e))
    if bad_flag is None:
      raise UserInputError(str(e)) from None
    field = bad_flag.group(1).split(".", 1)[1]
    expected = config_path.get_type(field, flag_values["config"].value).__name__
    raise UserInputError(f"--config.{field} must be of type {expected}") from None
  except flags.Error as e:
    raise UserInputError(str(e)) from None


def parse_flags(argv: list[str]) -> list[str]:
  """app.run's flags_parser: a flag error in one line, without absl's usage hint."""
  try:
    return _parsed(flags.FLAGS, argv)
  except UserInputError as e:
    raise SystemExit(f"error: {e}") from None


def load_config(config_flags_argv: list[str], default_file: str) -> ml_collections.ConfigDict:
  """The config that `config_flags_argv` (--config=FILE[:variant] and --config.FIELD=VALUE
  flags, nothing else) gives an entry point whose default is configs/`default_file`, checked
  as its command line is: a UserInputError in the CLI's one line. For a program that starts
  such entry points (rlver_jax.sweep) and checks their command lines first."""
  argv = ["check", *config_flags_argv]
  check_override_names(argv, default_file)
  if _config_flag_index(argv) < 0:  # named, so that parsing it defines the override flags
    argv.insert(1, f"--config={os.path.join(CONFIGS_DIR, default_file)}")
  flag_values = flags.FlagValues()
  config_flag = config_flags.DEFINE_config_file("config", None, flag_values=flag_values,
                                                lock_config=True, sys_argv=argv)
  _parsed(flag_values, argv)
  return config_flag.value


def run(default_file: str, help_text: str, fn: Callable) -> None:
  """Defines --config (default configs/`default_file`) and runs `fn(config)` under app.run.

  Call it only from a `__main__` block: the flag is defined here, so modules
  that are merely imported define none and can live side by side.
  """
  config_flag = define_config_flag(
      default_file, f"{help_text}; {FIELDS_COMMAND} --config=FILE[:variant] lists its fields")

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_QuietLibraries())
    sharding.cpu_unless_accelerators()
    sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)
    config = config_flag.value
    logging.info("config:\n%s", run_config.printable(config))
    compile_cache.enable(config.get("compile_cache_dir", ""))
    try:
      try:
        fn(config)
      except Exception as e:
        if workdir.no_space_error(e) is None or isinstance(e, workdir.NoSpaceLeft):
          raise
        raise workdir.NoSpaceLeft(config.get("workdir") or os.getcwd()) from e
    except workdir.NoSpaceLeft as e:  # free space and rerun, told apart from a failure
      print(f"error: {e}", file=sys.stderr, flush=True)
      raise SystemExit(workdir.NO_SPACE_EXIT_CODE) from None
    except preemption.Preempted as e:  # "run me again", told apart from a failure
      print(f"preempted: {e}", file=sys.stderr, flush=True)
      raise SystemExit(preemption.PREEMPTED_EXIT_CODE) from None
    except preemption.StopRequested as e:
      print(f"preempted: {e}: stopped while starting, before any step; nothing to save. Run "
            "the same command again to start", file=sys.stderr, flush=True)
      raise SystemExit(preemption.PREEMPTED_EXIT_CODE) from None
    except (UserInputError, RunStopped) as e:  # one line; our bugs keep their traceback
      raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (that one saves: Preempted)
      print("interrupted (SIGINT)", file=sys.stderr, flush=True)
      raise SystemExit(128 + signal.SIGINT) from None

  flags.FLAGS.alsologtostderr = True
  app.run(main, flags_parser=parse_flags)
