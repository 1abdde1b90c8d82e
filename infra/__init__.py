"""What every room stands on: config sections, errors, host metrics, compiled programs and
their work, device topologies, registries. It imports no room above it (models, sim_user, rl,
rlver_jax): they all import it."""
