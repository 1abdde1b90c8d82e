"""Several JAX processes (hosts) running one trainer or evaluator together.

Design (the one Tunix and verl follow in their own ways):
- Rollouts are local to a sampler group (`rollout.sampler_hosts` hosts,
  `models/slice_meshes.py`). Each group runs a contiguous block of the batch's
  profiles (`Hosts.share`, from the global profile index) on a sampler whose
  mesh holds only its hosts' chips, so groups never wait for each other during
  a dialogue. In a group of one host that host runs its dialogues with its own
  simulator client; in a larger group its lowest host (the leader) does, and
  the others dispatch the leader's row programs as it announces them
  (`RowSampler.follow`). After each update the training weights are cast and
  moved onto every group's mesh in one jitted program (`models/weight_copy.py`,
  inside `SamplerWeights.update`). Sampling keys fold in the global
  dialogue index (`rl.rollout.collect(first_profile=...)`), so the dialogues do
  not depend on how many hosts or groups there are.
- Training batches are collated on each host from its own rows with a width
  agreed by all hosts, then all-gathered (`Hosts.collate`): every host holds
  the same global numpy batch (token ids and masks, small next to the
  weights), so advantages (GRPO groups, whitening over the global batch) and
  mini-batch splits are computed exactly as on one host, and the learners
  place the batch on the global mesh as before. We chose this over
  `jax.make_array_from_process_local_data` because it leaves every batch
  computation of `rl/` unchanged and host-count independent, for one
  all-gather of int32 tokens per step.
- Metrics are reduced over hosts (`Hosts.reduce_metrics`), each as its maker
  declared (`infra/host_metrics.py`), and written by process 0; Orbax
  checkpoints are written by all hosts together.

With one process every method is the identity of the single-host path. What stops
every host when one is lost is `rlver_jax/watchdog.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from infra import host_metrics
from models import partitioning
from models.sampling import bucket_size
from models.slice_meshes import SliceMeshes
from rl import batch as batch_lib
from rl.batch import Sample
from rl.rollout import Rollout
from sim_user.profiles import Profile
from sim_user.simulator import Dialogue

def allgather_json(value: Any) -> list[Any]:
  """Every host's JSON-serialisable `value`, in process order (a collective: all hosts call)."""
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([len(data)], np.int32)).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  gathered = multihost_utils.process_allgather(padded).reshape(len(lengths), -1)
  return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths)]


def barrier(name: str) -> None:
  """Waits until every host got here (no-op with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def block(num_items: int, index: int, count: int) -> range:
  """Host `index`'s contiguous share of `num_items` (the first hosts take one more)."""
  per_host, extra = divmod(num_items, count)
  start = index * per_host + min(index, extra)
  return range(start, start + per_host + (index < extra))


def local_mesh(mesh_axes) -> Mesh:
  """`mesh_axes` resolved over this host's devices (all devices with one process)."""
  return partitioning.make_mesh(partitioning.per_group_axes(mesh_axes, jax.process_count()),
                                jax.local_devices())


def share_of(num_items: int) -> range:
  """This host's contiguous block of `num_items` (e.g. one batch of evaluation profiles)."""
  return block(num_items, jax.process_index(), jax.process_count())


def gather_records(records: Sequence[Any]) -> list[Any]:
  """Every host's JSON-serialisable records, host after host (a collective)."""
  return [record for host in allgather_json(list(records)) for record in host]


def sum_counts(counts: dict) -> dict:
  """Event counters summed over hosts (a collective)."""
  total = {}
  for host in allgather_json(dict(counts)):
    for key, count in host.items():
      total[key] = total.get(key, 0) + count
  return total


def gather_dialogues(dialogues: Sequence[Dialogue]) -> list[Dialogue]:
  """Every host's dialogues, host after host (a collective)."""
  if jax.process_count() == 1:
    return list(dialogues)
  records = [{**{f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "profile"},
              "profile": dataclasses.asdict(d.profile)} for d in dialogues]
  out = []
  for record in gather_records(records):
    profile = record.pop("profile")
    profile["cha_group"] = tuple(profile["cha_group"])
    out.append(Dialogue(profile=Profile(**profile), **record))
  return out


class Hosts:
  """This process's place among the hosts: the run's meshes (`models/slice_meshes.py`), its
  sampler group, and whether it leads the group (runs the group's dialogues)."""

  def __init__(self, meshes: SliceMeshes):
    self.index, self.count = jax.process_index(), jax.process_count()
    self.meshes = meshes
    self.train_mesh = meshes.train
    self.primary = self.index == 0
    self.leads_group = self.index == meshes.leader
    self.train_data_parallel_size = math.prod(
        meshes.train.shape[a] for a in partitioning.mesh_axes("batch", meshes.train))

  def share(self, num_items: int) -> range:
    """The global indices (profiles, dialogues) this host runs: its group's block if it leads
    the group, none otherwise (the leader runs them)."""
    block_of_group = block(num_items, self.meshes.group, self.meshes.num_groups)
    return block_of_group if self.leads_group else range(block_of_group.start,
                                                          block_of_group.start)

  def total(self, count: int) -> int:
    """`count` summed over hosts (a collective)."""
    if self.count == 1:
      return count
    return int(multihost_utils.process_allgather(np.array([count], np.int64)).sum())

  # Batches.

  def collate(self, samples: Sequence[Sample], batch_multiple: int,
              pad_id: int) -> batch_lib.TrainBatch:
    """The global training batch (numpy, identical on every host) from each host's samples.

    Host h's rows come h-th, padded to a common row count and width; filler rows
    have all-zero masks and groups of their own. Rows: a multiple of
    `batch_multiple`; width: the power-of-two bucket of the longest sample anywhere.
    """
    if self.count == 1:
      return batch_lib.collate(samples, batch_multiple, pad_id)
    counts_lengths = multihost_utils.process_allgather(
        np.array([len(samples), max((len(s.tokens) for s in samples), default=1)], np.int32))
    counts_lengths = counts_lengths.reshape(self.count, 2)
    multiple = math.lcm(batch_multiple, self.count)
    rows = -(-int(counts_lengths[:, 0].max()) * self.count // multiple) * multiple // self.count
    width = bucket_size(int(counts_lengths[:, 1].max()), minimum=32)
    filler = Sample(tokens=[pad_id], loss_mask=[0], logprobs=[0.0], reward=0.0, group=0,
                    dialogue=-1)
    local = batch_lib.collate(list(samples) or [filler], 1, pad_id)
    real = len(samples)
    local_width = local.tokens_bt.shape[1]

    def widen(array, fill):  # to `rows` rows and the agreed width (width - 1 on the target grid)
      shape = (rows,) + tuple(width - (local_width - n) for n in array.shape[1:])
      out = np.full(shape, fill, array.dtype)
      out[(slice(0, real),) + tuple(slice(0, n) for n in array.shape[1:])] = array[:real]
      return out

    padded = jax.tree.map(lambda array: widen(array, 0), local).replace(
        tokens_bt=widen(local.tokens_bt, pad_id))
    padded.groups_b[real:] = batch_lib.FILLER_GROUP + self.index * rows + np.arange(real, rows)
    return multihost_utils.process_allgather(padded, tiled=True)

  # Metrics.

  def reduce_step_metrics(self, metrics: dict, rollout: Rollout) -> dict:
    """A training step's metrics over all hosts; `rollout` is this host's share."""
    kept = [d for d in rollout.dialogues if not d.dropped]
    counts = {"samples": len(rollout.samples), "dialogues": len(rollout.dialogues),
              "kept_dialogues": len(kept),
              "rollout/row_steps": rollout.metrics.get("rollout/row_steps", 0)}
    for d in kept:  # the weights of emotion/final/<intention>
      key = f"emotion/final/{d.profile.intention}"
      counts[key] = counts.get(key, 0) + 1
    return self.reduce_metrics(metrics, counts)

  def reduce_metrics(self, metrics: dict, counts: dict) -> dict:
    """Metrics over all hosts, each by the reduction its maker declared (`infra/host_metrics.py`);
    `counts`: this host's samples, dialogues, ... that weighted metrics weigh by.

    With one host too a metric without a declared reduction raises: a new metric
    fails its first test run, not the first multi-host run.
    """
    host_metrics.check_declared(metrics)
    if self.count == 1:
      return metrics
    hosts = allgather_json({"metrics": {k: _plain(v) for k, v in metrics.items()},
                            "counts": counts})
    return host_metrics.combine([h["metrics"] for h in hosts], [h["counts"] for h in hosts])


def _plain(value):
  value = np.asarray(value).item()
  return value if isinstance(value, (int, float, bool)) else float(value)
