"""Model code only: the Qwen2 family, its value head, HF checkpoint I/O and the sampler. What
every room stands on (config sections, errors, programs, topologies) is infra/'s."""
