"""Accelerator types read as the slices they name, and a slice's devices made with no TPU."""

import pytest

from infra import topology
from infra.errors import UserInputError


def test_accelerator_types_name_their_slices():
  cases = {"v4-8": ("v4", (2, 2, 1), 1), "v4-32": ("v4", (2, 2, 4), 4),
           "v5p-16": ("v5p", (2, 2, 2), 2), "v5p-64": ("v5p", (2, 4, 4), 8),
           "v5litepod-16": ("v5e", (4, 4), 4), "v6e-8": ("v6e", (2, 4), 1),
           "v6e-16": ("v6e", (4, 4), 4), "v6e-64": ("v6e", (8, 8), 16),
           "h200-8": ("h200", (8,), 1), "h100-16": ("h100", (16,), 2)}
  for name, (generation, shape, hosts) in cases.items():
    tpu_slice = topology.parse_accelerator_type(name)
    assert (tpu_slice.generation.name, tpu_slice.shape, tpu_slice.hosts) == (
        generation, shape, hosts), name
  for bad in ("v5p-12", "v7x-8", "tpu-8", "v6e-3", "h200-12", "a100-8"):
    with pytest.raises(UserInputError, match="--topology="):
      topology.parse_accelerator_type(bad)


def test_a_slices_devices_spread_over_its_hosts():
  try:
    devices = topology.slice_devices(topology.parse_accelerator_type("v6e-16"))
  except UserInputError as e:  # libtpu's compiler makes them: without it there are none
    pytest.skip(f"no TPU compiler: {e}")
  assert len(devices) == 16 and devices[0].device_kind == "TPU v6 lite"
  assert len({d.process_index for d in devices}) == 4
