"""Simulator backends: scripted (rule-based), OpenAI-compatible HTTP, in-process Flax LLM."""
