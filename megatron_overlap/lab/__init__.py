"""The CPU laboratory: experiments on a CPU with an emulated link. It may patch the world;
product code may not. Tests, the demo and the benchmarks use it; the plugin itself never does.

    emulated_link.py   an interconnect emulated on gloo (deadlines, one egress port per rank)
    deadline_board.py  its P2P deadlines, shared across the rank processes
    cpu_shims.py       what megatron-core needs to run on a CPU-only torch
    rank_pool.py       live gloo rank processes reused across tests and runs
    session.py         per-rank experiment objects kept between pool calls
    tiny_gpt.py        a tiny GPT on Megatron's local spec, its batches and its training step
    demo.py, mlp_bench.py, attention_bench.py, hdp_demo.py
                       the rank side of ``megatron-overlap demo`` and ``bench`` (drivers in ``cli/``)
"""
