"""A registry: the functions of one kind, each under its key, added where it is defined.

As verl's `core_algos` registries (`register_adv_est` / `get_adv_estimator_fn`,
`register_policy_loss` / `get_policy_loss_fn`): a peer adds a variant with a
decorator next to its code, and the config check and the dispatch read the
same keys, so the two cannot drift apart. The keys are names (the config's
values) or types (`rlver_jax/costs.py`'s cost function of each work type).
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

Fn = TypeVar("Fn", bound=Callable)


class Registry(dict, Generic[Fn]):
  """key -> function of one kind (`what`, for the errors), in the order registered.

  A dict, so that a config check takes it as its choices (`Problems.one_of`) and a test
  may swap one entry (`monkeypatch.setitem`).
  """

  def __init__(self, what: str):
    super().__init__()
    self.what = what

  def register(self, key: Hashable) -> Callable[[Fn], Fn]:
    """A decorator that adds its function under `key`; a key taken twice is a mistake."""
    def add(fn: Fn) -> Fn:
      if key in self:
        raise ValueError(f"{self.what} {_shown(key)!r} is registered twice")
      self[key] = fn
      return fn
    return add

  def lookup(self, key: Hashable) -> Fn:
    """The function registered under `key`, or a one-line error naming the registered keys."""
    if key not in self:
      raise ValueError(f"unknown {self.what} {_shown(key)!r}; expected one of "
                       f"{[_shown(k) for k in self]}")
    return self[key]


def _shown(key: Hashable):
  """A key as the errors show it: a type by its name."""
  return key.__name__ if isinstance(key, type) else key
