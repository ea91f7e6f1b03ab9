"""The CPU laboratory: experiments on a CPU with an emulated link. It may patch the world;
product code may not. Tests, the demo and the benchmarks use it; the plugin itself never does.

    emulated_link.py   an interconnect emulated on gloo (deadlines, one egress port per rank)
    link_spec.py, link_work.py
                       its parameters and counters, its work handles
    deadline_board.py  its P2P deadlines, shared across the rank processes
    compute_clock.py   emulated compute: a wait of a given duration, with a device's queue
    cpu_shims.py       what megatron-core needs to run on a CPU-only torch
    megatron_lm_cpu.py Megatron-LM's own ``pretrain_gpt.py`` on a CPU
    dist_ckpt.py       Megatron's distributed checkpointing inside the test rank workers
    rank_pool.py       live gloo rank processes reused across tests and runs
    fork_launcher.py   trainings and commands forked from one process that imported them once
    session.py         per-rank experiment objects kept between pool calls
    tiny_gpt.py        a tiny GPT on Megatron's local spec, its batches and its training step
    pipeline_gpt.py, virtual_gpt.py
                       the tiny GPT over pipeline stages, and as a virtual pipeline
    cluster.py, cluster_chunks.py, emulated_model.py, durations.py
                       the emulated cluster: PP x DP ranks whose compute is a wait of measured
                       or modelled durations, virtual pipelines on it
    demo.py, demo_plan.py, mlp_bench.py, layer_bench.py, attention_bench.py, pp_bench.py, hdp_demo.py
                       the rank side of ``megatron-overlap demo`` and ``bench`` (drivers in ``cli/``)
    cp_cluster.py, hdp_cluster.py, hdp_pp_cluster.py, long_context_model.py, emulated_attention.py
                       the long-context lab: CP and HDP on the emulated cluster, the product's
                       attention and HDP runtime (also under a 1F1B pipeline) with blocks and linears as waits
"""
