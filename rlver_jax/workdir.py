"""A run's workdir: created with a one-line error when it cannot be, and held by one run at a time.

Two runs writing one workdir interleave their metrics and collide in
checkpointing minutes later, so a run takes `W/run.lock` first and refuses to
start while another holds it, naming that run's host and PID. The lock is an
`flock` on the file, which the kernel drops when its holder dies however it
dies (`kill -9` included), and which an NFS server drops when the holder's
machine stops renewing its lease; the file's text (host, PID, start time)
only names the holder. So a lock file left by a dead run is simply taken
over, with a line saying whose it was.

A write that fails for lack of space (the lock, W/config.json, a checkpoint,
the metrics, the export) ends a run with one line (`NoSpaceLeft`) that names
the workdir, the space left and the step a rerun resumes at, and with
NO_SPACE_EXIT_CODE: the last complete checkpoint is untouched, so freeing
space and rerunning the same command loses nothing.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile

from absl import logging

from infra.errors import UserInputError

LOCK_FILE = "run.lock"
# sysexits' EX_CANTCREAT: the run cannot create its outputs where the user asked, and freeing
# space there lets the same command go on. Not EX_IOERR (74): that one also says a read failed
# or the hardware did, which a rerun does not mend.
NO_SPACE_EXIT_CODE = 73
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Tensorstore (orbax's array writer) reports a failed write as a ValueError whose text holds
# the OS error's number: `... No space left on device [os_error_code='28']`.
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")


def no_space_error(error: BaseException | None) -> BaseException | None:
  """The exception in `error`'s chain (causes, contexts, exception groups) that says a write
  failed for lack of space or quota, or None. Orbax's asynchronous saves raise theirs wrapped,
  at a later save or wait, as tensorstore's ValueError."""
  pending, seen = [error], set()
  while pending:
    e = pending.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS:
      return e
    if tells_of_no_space(str(e)):
      return e
    pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
  return None


def tells_of_no_space(text: str) -> bool:
  """Whether `text` is tensorstore's report of a write that failed for lack of space."""
  return any(int(code) in _NO_SPACE_ERRNOS for code in _TENSORSTORE_OS_ERROR.findall(text))


def last_checkpoint_step(workdir: str) -> int | None:
  """The step of the newest complete checkpoint in W/checkpoints (orbax writes each under a
  temporary name and renames it when it is whole), or None."""
  import orbax.checkpoint as ocp
  return max(ocp.utils.checkpoint_steps(os.path.join(workdir, "checkpoints")), default=None)


def _free_mib(path: str) -> int:
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)  # a workdir that could not be made: its file system
  return shutil.disk_usage(path).free // 2**20


class NoSpaceLeft(Exception):
  """A write under the workdir failed for lack of space: what to do, in one line."""

  def __init__(self, workdir: str, rerun_to: str | None = None):
    """`rerun_to`: what a rerun does; by default it resumes at the last complete checkpoint."""
    path = os.path.abspath(workdir)
    if rerun_to is None:
      step = last_checkpoint_step(path)
      rerun_to = (f"to resume at step {step}" if step is not None else
                  "to start from the beginning (no checkpoint was complete)")
    super().__init__(f"no space left on device under {path} ({_free_mib(path)} MiB free); free "
                     f"space and rerun the same command {rerun_to}")


def prepare(workdir: str, field: str = "workdir") -> str:
  """Creates `workdir` if needed and checks it is a writable directory; its absolute path."""
  path = os.path.abspath(workdir)
  try:
    os.makedirs(path, exist_ok=True)
  except FileExistsError:
    raise UserInputError(f"--config.{field}={workdir}: {_blocker(path)} is a file, not a "
                         "directory; choose another workdir") from None
  except NotADirectoryError:
    raise UserInputError(f"--config.{field}={workdir}: {_blocker(path)} is a file, so no "
                         "directory can be made under it; choose another workdir") from None
  except OSError as e:
    if no_space_error(e):
      raise
    raise UserInputError(f"--config.{field}={workdir}: cannot create it: {e.strerror}") from None
  try:  # a real write: permissions, a read-only file system and a full disk all show here
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    if no_space_error(e):
      raise  # not the user's choice of workdir: the CLI says to free space
    raise UserInputError(f"--config.{field}={workdir}: cannot write there: {e.strerror}; "
                         "choose another workdir or fix its permissions") from None
  return path


def refuse_training_workdir(path: str, field: str) -> None:
  """A UserInputError when checkpoint `path` (config field `field`) is a training run's
  workdir: its policy is the one exported to W/export, which this names."""
  if not (os.path.isdir(os.path.join(path, "checkpoints"))
          and os.path.exists(os.path.join(path, "metrics.jsonl"))):
    return
  export = os.path.join(path, "export")
  hint = (f"use the policy it exported: --config.{field}={export}" if os.path.isdir(export) else
          f"it has not exported a policy yet ({export} appears when the run ends, with "
          "checkpoint.export_at_end=True)")
  raise UserInputError(f"{field}={path!r} is a training workdir, not a checkpoint; {hint}")


def _blocker(path: str) -> str:
  """The first existing non-directory on the way to `path` (the one in the way)."""
  parts = path.split(os.sep)
  for end in range(2, len(parts) + 1):
    prefix = os.sep.join(parts[:end])
    if os.path.exists(prefix) and not os.path.isdir(prefix):
      return prefix
  return path


class RunLock:
  """Holds W/run.lock until released (or this process ends), or refuses: `RunLock.acquire(W)`.

  A context manager too: `with workdir.claim(W): ...` releases it at the end.
  """

  def __init__(self, path: str, handle=None):
    """`handle` None: a process that holds nothing itself (not process 0 of several)."""
    self.path, self._handle = path, handle

  def __enter__(self) -> "RunLock":
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()

  @classmethod
  def acquire(cls, workdir: str) -> "RunLock":
    """Takes the workdir's lock; UserInputError naming the holder if another run has it."""
    path = os.path.join(workdir, LOCK_FILE)
    try:
      handle = open(path, "a+")
    except OSError as e:
      if no_space_error(e):
        raise
      raise UserInputError(f"{path}: cannot open the run lock: {e.strerror}") from None
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _describe(_read(handle))
      handle.close()
      raise UserInputError(
          f"{workdir} is in use by another run ({holder}); wait for it to end, stop it, or "
          "use another --config.workdir") from None
    previous = _read(handle)
    if previous:  # the lock was free: whoever wrote this is gone
      logging.warning("taking over %s from a run that ended without releasing it (%s)", path,
                      _describe(previous))
    handle.seek(0)
    handle.truncate()
    json.dump({"host": socket.gethostname(), "pid": os.getpid(),
               "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")},
              handle)
    handle.flush()
    return cls(path, handle)

  def release(self) -> None:
    """Empties and unlocks the file (an empty lock file is a clean end)."""
    if self._handle is None or self._handle.closed:
      return
    self._handle.seek(0)
    self._handle.truncate()
    self._handle.flush()
    fcntl.flock(self._handle, fcntl.LOCK_UN)
    self._handle.close()


def _read(handle) -> dict:
  handle.seek(0)
  try:
    return json.loads(handle.read() or "{}")
  except json.JSONDecodeError:
    return {"host": "?", "pid": "?", "started": "an unreadable lock file"}


def _describe(holder: dict) -> str:
  if not holder:
    return "a run that has not yet written its name"
  return (f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, started "
          f"{holder.get('started', '?')}")


def claim(workdir: str, field: str = "workdir") -> RunLock:
  """`prepare`s the workdir and takes its lock on process 0, which speaks for every host.

  Every process calls it (a collective with several): a refusal ends every
  host with process 0's message. The other processes get a lock that holds nothing.
  """
  import jax
  from rlver_jax import multihost
  path = prepare(workdir, field)
  lock, refusal, no_space = None, None, False
  if jax.process_index() == 0:
    try:
      lock = RunLock.acquire(path)
    except UserInputError as e:
      refusal = str(e)
    except OSError as e:
      if not no_space_error(e):
        raise
      no_space = True  # every host ends with the line that says to free space
  refusal, no_space = multihost.allgather_json([refusal, no_space])[0]
  if refusal:
    raise UserInputError(refusal)
  if no_space:
    raise OSError(errno.ENOSPC, f"{os.path.join(path, LOCK_FILE)}: {os.strerror(errno.ENOSPC)}")
  return lock or RunLock(os.path.join(path, LOCK_FILE))


def write_text_atomically(path: str, text: str) -> None:
  """Replaces `path` whole with `text` in UTF-8 (a lone surrogate escaped, not an error): a kill
  leaves the old file or the new one."""
  with open(path + ".tmp", "w", encoding="utf-8", errors="backslashreplace") as f:
    f.write(text)
  os.replace(path + ".tmp", path)
