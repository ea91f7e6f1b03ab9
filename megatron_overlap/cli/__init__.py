"""The ``megatron-overlap`` command line: run, demo, bench, check."""
