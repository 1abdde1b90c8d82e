"""The simulated user: profiles, prompts, parser, emotion dynamics, backends."""
