"""Multi-turn rollouts, advantages, losses and train steps."""
