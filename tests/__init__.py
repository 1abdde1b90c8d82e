"""The test suite. Its folders mirror the package rooms: tests/infra/ tests infra/,
tests/models/ models/, tests/rl/ rl/, tests/sim_user/ sim_user/, tests/rlver_jax/ rlver_jax/
with configs/ and the CLIs; the helpers shared by several rooms sit here, at its root."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
