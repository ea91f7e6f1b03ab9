"""The only code that imports Megatron internals or monkey-patches anything.

    install.py     install() / uninstall(), the patch table, the Installation handle
    linears.py     Column/Row parallel linears -> tp
    linear_comm.py one linear's TP communication (group, plan, backend, prefetch, wgrad)
    attention.py   DotProductAttention -> cp
    hdp.py         data iterator, forward_step, RoPE positions, model checks -> hdp
    training.py    Megatron-LM's train_step (--overlap-trace)
    launch.py      ``megatron-overlap run pretrain_gpt.py ...``
    baselines.py   megatron-core's BalancedCPScheduler as an HDP plan (the benchmarks' peer)
    allreduce_fusion.py   --overlap-tp-allreduce-fusion in Megatron's transformer layer -> tp
    sub_batches.py        --overlap-tp-sub-batches in Megatron's transformer layer -> tp
    attention_parts.py    a sub-batched core attention with stock's key/value gradients
    embedding_grad.py     the embedding's SP grad all-gather with the held-back wgrads -> tp
    norms.py       Megatron's torch norm under sequence parallelism
    hdp_loop.py    Megatron-LM's training loop -> hdp (--overlap-hdp through pretrain_gpt.py)
    pp_executor.py the pipeline executors' core: forward_backward, groups, P2P posting, waits, timeouts
    schedules.py   Megatron's pipeline schedule -> pp (the executor)
    vschedules.py  Megatron's interleaved schedule (virtual pipelines) -> pp with model chunks
    vplacement.py  ZB-V's layer placement (--overlap-pp zbv)
    pp_megatron.py what the pipeline executors need of Megatron's state
    ddp.py         Megatron DDP under --overlap-pp (buckets, hooks)
    preflight.py   what install checks beyond the areas' model checks
    sites.py       names for where a wait happens (layer, linear)
    compat.py      megatron-core 0.16 .. 0.19 differences

A Megatron release that moves something breaks this folder only.
"""
