"""The only code that imports Megatron internals or monkey-patches anything.

    install.py     install() / uninstall(), the patch table, the Installation handle
    linears.py     Column/Row parallel linears -> tp
    attention.py   DotProductAttention -> cp
    hdp.py         data iterator, forward_step, RoPE positions, model checks -> hdp
    training.py    Megatron-LM's train_step (--overlap-trace)
    launch.py      ``megatron-overlap run pretrain_gpt.py ...``
    baselines.py   megatron-core's BalancedCPScheduler as an HDP plan (the benchmarks' peer)
    compat.py      megatron-core 0.16 .. 0.19 differences

A Megatron release that moves something breaks this folder only.
"""
