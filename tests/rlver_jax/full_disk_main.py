"""The trainer (`python -m rlver_jax.main`) on a disk that fills up: $RLVER_FULL_DISK names the
write that fails with ENOSPC, "lock" (the workdir's lock, at start-up) or "checkpoint:K" (the
save of step K): test_workdir.py's full-disk runs."""

import errno
import os

import orbax.checkpoint as ocp

from rlver_jax import cli, main, watchdog, workdir


def _no_space(path: str) -> OSError:
  return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def fill_disk(write: str) -> None:
  if write == "lock":
    def acquire(cls, path):
      raise _no_space(os.path.join(path, workdir.LOCK_FILE))

    workdir.RunLock.acquire = classmethod(acquire)
    return
  failing_step = int(write.split(":")[1])
  save = ocp.CheckpointManager.save

  def save_until_full(self, step, *args, **kwargs):
    if step == failing_step:  # as orbax reports an asynchronous write's: wrapped in another type
      raise RuntimeError(f"saving step {step} failed") from _no_space(str(self.directory))
    return save(self, step, *args, **kwargs)

  ocp.CheckpointManager.save = save_until_full


if __name__ == "__main__":
  fill_disk(os.environ["RLVER_FULL_DISK"])
  cli.run("demo.py", "training config file[:variant]", watchdog.guarded(main.train))
