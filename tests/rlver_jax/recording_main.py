"""The trainer (`python -m rlver_jax.main`), recording what it compiles once its steps begin,
beside what the planner lists for the same config on the same devices (process 0 writes both
to $RLVER_COMPILES as JSON): `test_multihost.py`'s guard that the plan is what runs."""

import json
import os

import jax

from rlver_jax import cli, plan, preemption, trainer


def train_and_plan(config) -> None:
  trained = set()

  def record(event, seconds, **kwargs):
    del seconds
    if event == plan.COMPILE_EVENT and kwargs.get("fun_name"):
      trained.add(plan.function_name(kwargs["fun_name"]))

  with preemption.STOP_SIGNALS:
    run = trainer.Trainer.from_config(config)
    jax.monitoring.register_event_duration_secs_listener(record)
    run.run()
    jax.monitoring.unregister_event_duration_listener(record)
  if jax.process_index() == 0:
    tiny_model = plan.Overrides(hf_config=os.path.join(run.policy_path, "config.json"))
    planned = plan.plan(plan.spec_from_config(config, tiny_model), jax.devices())
    with open(os.environ["RLVER_COMPILES"], "w") as f:
      json.dump({"trained": sorted(trained), "planned": planned["compiled_functions"],
                 "hosts_per_group": planned["hosts_per_group"]}, f)


if __name__ == "__main__":
  cli.run("demo.py", "training config file[:variant]", train_and_plan)
