"""GPU check and timing scripts for the fused kernels."""
