"""CPU test harness: megatron-on-CPU shims, a pool of live gloo ranks, a tiny GPT builder.

Only tests, the demo and the benchmarks import this package; the plugin itself never does.
"""
