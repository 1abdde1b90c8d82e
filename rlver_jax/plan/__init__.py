"""The planner: will a run fit, and how fast might it run? Every program of a PPO/GRPO step
compiled with abstract arrays, no weights; `python -m rlver_jax.plan` plans from the command
line (`__main__.py` says how).

Its modules, by job: `spec` (what is planned: `PlanSpec`, from a recipe or from flags),
`planner` (the run's abstract learners and meshes, and the programs of its step), `compile`
(compiling them: memory, kernels, compile seconds), `estimate` (time estimates, the sampler
layouts compared), `step_plan` (the plan of a step and its verdict; the sampler group size
the trainer runs), `report` (the plan printed), `cli` (flags and main).

Importing the package imports none of them, nor JAX: a public name loads its module when
first used. So `python -m rlver_jax.plan`, which imports this package before its
`__main__`, can still set up JAX's environment (`--topology`, `--fake_devices`) before JAX
starts.
"""

from __future__ import annotations

import importlib

# Each public name, and the module of the package that defines it.
_MODULE_OF = {
    "PlanSpec": "spec", "Overrides": "spec", "preset": "spec", "checked_run": "spec",
    "spec_from_config": "spec", "run_from_settings": "spec",
    "Planner": "planner",
    "COMPILE_EVENT": "compile", "compile_program": "compile", "function_name": "compile",
    "USABLE_MEMORY_FRACTION": "step_plan", "plan": "step_plan",
    "fewest_sampler_hosts": "step_plan", "hosts_per_group": "step_plan",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
  if name not in _MODULE_OF:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
  globals()[name] = value  # found once: later uses read it directly
  return value
