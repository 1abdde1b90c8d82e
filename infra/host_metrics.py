"""How each metric combines over hosts, declared by the module that makes it.

A run of several processes reduces every step metric over its hosts
(`rlver_jax/multihost.py`), and how depends on what the metric is: a count
sums, a wall time is the slowest host's (a step waits for it), a mean over
dialogues weighs each host's mean by its dialogues. The module that makes a
metric knows which, so it declares it here (`declare`, `declare_family`) next
to where it makes it; `combine` reads the declarations. A metric nobody
declared has no reduction: `reduction` raises rather than average it over
hosts by accident, and the trainer checks its metrics on one host too.

Here under models/ because every layer makes metrics: the sampler, the
simulated user, the rollout and updates of rl/, the trainer.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Iterable, Sequence

import numpy as np

class Kind(enum.Enum):
  SUM = "sum"
  MAX = "max"
  MEAN = "mean"
  WEIGHTED = "weighted"
  RATIO = "ratio"


@dataclasses.dataclass(frozen=True)
class Reduction:
  """How hosts combine one metric (build one with SUM, MAX, MEAN, `weighted`, `ratio`)."""

  kind: Kind
  weight: str = ""  # WEIGHTED: the per-host count each host's value weighs by
  numerator: str = ""  # RATIO: scale x numerator / denominator, of the combined metrics
  denominator: str = ""
  scale: float = 1.0


SUM = Reduction(Kind.SUM)  # counts
MAX = Reduction(Kind.MAX)  # wall times: a step waits for its slowest host
MEAN = Reduction(Kind.MEAN)  # alike on every host (e.g. the update metrics): their plain mean


def weighted(by: str) -> Reduction:
  """Each host's value weighs by its count `by` (its samples, dialogues, ...)."""
  return Reduction(Kind.WEIGHTED, weight=by)


def ratio(numerator: str, denominator: str, scale: float = 1.0) -> Reduction:
  """A rate of the combined metrics, not a mean of the hosts' rates."""
  return Reduction(Kind.RATIO, numerator=numerator, denominator=denominator, scale=scale)


class UndeclaredMetric(LookupError):
  """A metric whose maker did not declare how hosts combine it."""


_EXACT: dict[str, Reduction] = {}
_FAMILIES: dict[str, Reduction] = {}  # name prefix -> the reduction of every metric under it


def _register(table: dict, name: str, how: Reduction) -> None:
  if table.setdefault(name, how) != how:
    raise ValueError(f"metric {name!r} declared twice, as {table[name]} and as {how}")


def declare(reductions: dict[str, Reduction]) -> None:
  """Declares how hosts combine each named metric."""
  for name, how in reductions.items():
    _register(_EXACT, name, how)


def declare_family(prefix: str, how: Reduction) -> None:
  """Declares every metric named `prefix` + something (e.g. one per event or intention).

  A weighted family weighs by a family of counts: metric `prefix + x` by count `how.weight + x`.
  """
  _register(_FAMILIES, prefix, how)


def reduction(name: str) -> Reduction:
  """The declared reduction of metric `name`; UndeclaredMetric where there is none."""
  if name in _EXACT:
    return _EXACT[name]
  prefix = max((p for p in _FAMILIES if name.startswith(p)), key=len, default=None)
  if prefix is None:
    raise UndeclaredMetric(
        f"metric {name!r} has no declared host reduction: declare it where it is made "
        "(infra.host_metrics.declare) as SUM, MAX, MEAN, weighted(count) or ratio(...)")
  how = _FAMILIES[prefix]
  if how.kind == Kind.WEIGHTED:
    return weighted(how.weight + name[len(prefix):])
  return how


def check_declared(names: Iterable[str]) -> None:
  """Raises UndeclaredMetric for the first of `names` without a declared reduction."""
  for name in names:
    reduction(name)


def combine(metrics: Sequence[dict], counts: Sequence[dict]) -> dict:
  """Every host's metrics (`metrics[h]`) combined by their declared reductions.

  `counts[h]`: host h's counts that weighted metrics weigh by. A host without a
  metric had nothing of it (no dialogue of that intention, say) and is left out.
  """
  out, ratios = {}, {}
  for key in sorted({k for host in metrics for k in host}):
    how = reduction(key)
    reporting = [h for h, host in enumerate(metrics) if key in host]
    values = [metrics[h][key] for h in reporting]
    if how.kind == Kind.SUM:
      out[key] = sum(values)
    elif how.kind == Kind.MAX:
      out[key] = max(values)
    elif how.kind == Kind.WEIGHTED:
      weights = [counts[h][how.weight] for h in reporting]
      out[key] = float(np.average(values, weights=weights)) if sum(weights) else 0.0
    elif how.kind == Kind.MEAN:
      out[key] = float(np.mean(values))
    else:
      ratios[key] = how
  for key, how in ratios.items():  # of the combined metrics, so after them
    out[key] = how.scale * out[how.numerator] / max(out[how.denominator], 1e-9)
  return out
