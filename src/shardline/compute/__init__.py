"""MLX computation of one stage: a model's layer range, its KV caches, attention, sampling, the CPU kernel."""
