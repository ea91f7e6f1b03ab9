"""Stage 1 of install (:func:`validate`): the whole config against the model context, before
anything is resolved or patched. Each area's model checks (``tp``, ``hdp``, ``cp``, ``pp``: their
``checks.py``), then what no area owns (:func:`check`): the model's shape against Megatron's own
divisibility rules, the places the plugin will write (trace directory, autotune cache), the
trace's iterations against the run's length, and the timeout of the plugin's waits against the
process group's. Every refusal names its flag or variable (``rules``); nothing here creates a
file. Stage 2 resolves ``auto`` (``install._resolve``), stage 3 patches."""

from __future__ import annotations

from .. import rules
from ..cp.checks import check_cp_model
from ..errors import OverlapConfigError
from ..hdp.checks import check_hdp_model
from ..pp.checks import check_pp_model
from ..tp.checks import check_tp_model


def validate(config, ctx, notice) -> None:
    """Every check of ``config`` against ``ctx``, in one place and order (the first refusal is
    the one reported): TP's, HDP's, CP's and the pipeline's model checks, then :func:`check`."""
    check_tp_model(config.tp, ctx)
    check_hdp_model(config.hdp, ctx, config.pp)
    check_cp_model(config.cp, ctx)
    check_pp_model(config.pp, config.tp, ctx)
    check(config, ctx, notice)


def check(config, ctx, notice) -> None:
    """``config``: the ``OverlapConfig`` asked for; ``ctx``: the ``ModelContext``; ``notice``:
    install's one-line notice on rank 0."""
    seq = None if config.hdp.enabled else ctx.seq_length  # HDP: each micro-batch's rows, padded by the runtime
    problems = rules.model_shape_problems(ctx.tp_size, ctx.heads, ctx.kv_heads, seq, ctx.cp_size or 1,
                                          ctx.sequence_parallel is not False) if ctx.tp_size else []
    if problems:  # Megatron would refuse these later, with an assertion: say it now, and what builds
        field, reason = problems[0]
        sizes = rules.divisors_that_build(max(8, ctx.tp_size), ctx.heads or 0, ctx.kv_heads or 0)
        raise OverlapConfigError(field, f"Megatron cannot build this model: {reason}"
                                 + (f" (TP sizes that split the heads: {', '.join(map(str, sizes))})"
                                    if field.endswith("tensor_model_parallel_size") else ""))
    if config.trace.enabled:
        rules.usable_directory(config.trace.dir, "trace.dir", "the traces")
        first = config.trace.iterations.first
        if ctx.train_iters is not None and first >= ctx.train_iters:
            notice(f"`trace.iterations` {config.trace.iterations.text()}: this run has {ctx.train_iters} iterations "
                   f"(`megatron.train_iters`, counted from 0 here), so nothing will be traced; pick iterations "
                   f"below {ctx.train_iters}")
    if config.tp.autotune:
        from ..tune.cache import cache_dir

        cache_dir()  # refuses a MEGATRON_OVERLAP_CACHE that cannot be a directory
    if config.tp.plan_file is not None:  # read now, whatever the TP size: a bad file is refused at start
        from ..tp.autotune import load_plan_file

        load_plan_file(config.tp.plan_file, None if config.hdp.enabled else ctx.rows_per_rank())
    timeout = config.comm.timeout_s
    if timeout is not None and ctx.pg_timeout_s is not None and timeout >= ctx.pg_timeout_s:
        raise OverlapConfigError(
            "comm.timeout_s", f"{timeout:g} s is not below the process groups' timeout ("
            f"`megatron.distributed_timeout_minutes` = {ctx.pg_timeout_s:g} s), which would end the waits first "
            f"with less to say; pass less than {ctx.pg_timeout_s:g}")
