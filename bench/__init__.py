"""Side-by-side benchmarks: rdzv against torchrun (python -m bench)."""
