"""Model code only: the Qwen2 family, its value head and HF checkpoint I/O."""
