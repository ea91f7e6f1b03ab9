"""The package's version (pyproject.toml's), in a leaf every layer may read."""

__version__ = "0.1.0"
