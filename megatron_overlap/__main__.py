"""``python -m megatron_overlap ...`` (also what torchrun -m runs)."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
