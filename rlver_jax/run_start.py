"""A training run's start, before any model is built: what the `Trainer` is given.

In this order, each before the slower work after it: the config read as its typed, checked
run; the workdir claimed (before anything is written there) and, on a resume, its saved
config compared with this one; the rollout's system prompt resolved (`rollout.system_prompt`
names a preset or a file); the training profiles read; the simulated user's health check
(a dead simulator fails the run in seconds, not after minutes of preparing a policy; an
in-process simulator runs on its host's own chips); then the checkpoint the policy starts
from, which for the demo (`policy.tiny_init`) is its tiny policy, warmed up here on the run's
first start. A signal in any of it stops the run at once: nothing is saved yet.
"""

from __future__ import annotations

import dataclasses

import jax

from rl.rollout_config import RolloutConfig
from rlver_jax import builder, multihost, off_policy, preemption, run_config, sections, sharding
from rlver_jax import checkpoints as checkpoints_lib
from rlver_jax import workdir as workdir_lib
from sim_user import profiles as profiles_lib
from sim_user.simulator import SimulatedUser


@dataclasses.dataclass
class RunStart:
  """A started training run, owned by the `Trainer` it is given (whose `close` frees the
  workdir).

  Attributes:
    config: the typed, checked run.
    lock: the workdir's lock, held for the run's life.
    checkpoints: the run's checkpoints; `latest_step()` is not None on a resume.
    rollout: the `rollout` section with its system prompt resolved.
    profiles: the training profiles.
    user: the simulated user, healthy at the start.
    policy_path: the checkpoint directory the policy (and by default the critic) starts from.
  """
  config: sections.TrainRun
  lock: workdir_lib.RunLock
  checkpoints: checkpoints_lib.Checkpoints
  rollout: RolloutConfig
  profiles: list[profiles_lib.Profile]
  user: SimulatedUser
  policy_path: str


def start(config_dict) -> RunStart:
  """Starts the run of ml-collections training config `config_dict` (saved as W/config.json)."""
  config = sections.train_run(config_dict)
  sharding.maybe_initialize_distributed()
  lock = workdir_lib.claim(config.workdir)
  checkpoints = None
  try:
    with preemption.STOP_SIGNALS.abortable():
      checkpoints = checkpoints_lib.Checkpoints(config.workdir, config.checkpoint, config.steps)
      run_config.check_and_save(config_dict, config.workdir,
                                resuming=checkpoints.latest_step() is not None)
      off_policy.check_supported(config.rollout.off_policy_steps, jax.process_count())
      rollout = builder.train_rollout_config(config)
      profiles = profiles_lib.load_profiles(config.data.train_profiles,
                                            config.sim_user.max_message_chars)
      user = builder.simulated_user(config, multihost.local_mesh(dataclasses.asdict(config.mesh)))
      return RunStart(config, lock, checkpoints, rollout, profiles, user,
                      policy_path=builder.policy_path(config))
  except BaseException:
    if checkpoints is not None:
      checkpoints.close()
    lock.release()
    raise
