"""Train a policy against the simulated user.

  python -m rlver_jax.main                                   # configs/demo.py, CPU, minutes
  python -m rlver_jax.main --config=configs/ppo.py --config.workdir=W \
      --config.policy.checkpoint=DIR --config.rl.kl_coef=0.01   # any field can be overridden
"""

from rlver_jax import cli, preemption, trainer, watchdog


def train(config) -> None:
  with preemption.STOP_SIGNALS:  # a signal during start-up stops it too (before any step)
    trainer.Trainer.from_config(config).run()


if __name__ == "__main__":
  cli.run("demo.py", "training config file[:variant]", watchdog.guarded(train))
