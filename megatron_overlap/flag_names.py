"""The one map from config fields to the flags users type.

A leaf: it imports nothing of the package, so :mod:`megatron_overlap.errors` can read it while
every area imports ``errors`` (the flags' argparse side, their types and help, is
:mod:`megatron_overlap.args`). Errors name config fields (``tp.chunks``); :func:`flag_for` is
where they become flags.
"""

from __future__ import annotations

# config field -> flag, in the order the flags are added to a parser (args._OPTIONS follows it)
FIELDS = {
    "tp.mode": "--overlap-tp",
    "tp.chunks": "--overlap-tp-chunks",
    "tp.rs": "--overlap-tp-rs",
    "tp.sub_batches": "--overlap-tp-sub-batches",
    "tp.sub_batch_blocks": "--overlap-tp-sub-batch-blocks",
    "tp.allreduce_fusion": "--overlap-tp-allreduce-fusion",
    "tp.bidirectional": "--overlap-tp-bidirectional",
    "tp.autotune": "--overlap-tp-autotune",
    "tp.plan_file": "--overlap-tp-plan-file",
    "trace.dir": "--overlap-trace",
    "trace.iterations": "--overlap-trace-iters",
    "cp.mode": "--overlap-cp",
    "cp.a2a_size": "--overlap-cp-a2a-size",
    "hdp.enabled": "--overlap-hdp",
    "hdp.max_tokens": "--overlap-hdp-max-tokens-per-rank",
    "pp.mode": "--overlap-pp",
    "pp.max_inflight": "--overlap-pp-max-inflight",
    "pp.memory_budget_gb": "--overlap-pp-memory-budget",
    "pp.buckets": "--overlap-pp-buckets",
    "comm.timeout_s": "--overlap-timeout-s",
}


# Megatron settings whose flag is not ``--<name with dashes>``: megatron-core dataclass fields
# with ``argparse_meta`` arg_names (Megatron-LM derives its flags from them), an attribute Megatron-LM
# computes from another flag, and model-config fields no flag sets (named as the config's). Checked
# against Megatron-LM's own parser: tests/data/megatron_lm_parser_flags.txt, tests/test_hardening.py.
MEGATRON_FLAG_NAMES = {
    "overlap_p2p_comm_warmup_flush": "--overlap-p2p-communication-warmup-flush",
    "microbatch_group_size_per_vp_stage": "--microbatch-group-size-per-virtual-pipeline-stage",
    "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
    "variable_seq_lengths": "TransformerConfig.variable_seq_lengths",
    "num_microbatches_with_partial_activation_checkpoints":
        "TransformerConfig.num_microbatches_with_partial_activation_checkpoints",
}


def flag_for(field: str) -> str:
    """The flag of a config field: ours from the table, Megatron's (``megatron.seq_length``) by
    Megatron's own convention (``--seq-length``, the exceptions in ``MEGATRON_FLAG_NAMES``), an
    environment variable (``env.MEGATRON_OVERLAP_CACHE``) by its name."""
    if field in FIELDS:
        return FIELDS[field]
    area, _, name = field.partition(".")
    if area == "megatron" and name:
        return MEGATRON_FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    if area == "env" and name:
        return name
    raise KeyError(f"no flag for config field {field!r}")
