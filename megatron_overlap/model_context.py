"""What the plugin reads of the model's parallel setup (:class:`ModelContext`), from Megatron's
arguments by name. Pure Python; the checks that take it live in the areas."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModelContext:
    """The parts of the model's parallel setup that decide whether overlap can run, read from
    Megatron's arguments by name. ``None`` means unknown: programmatic installs learn these
    when a layer first runs."""

    tp_size: Optional[int] = None
    sequence_parallel: Optional[bool] = None
    transformer_impl: Optional[str] = None
    tp_comm_overlap: bool = False
    seq_length: Optional[int] = None
    micro_batch_size: Optional[int] = None
    cp_size: Optional[int] = None
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    packed: bool = False  # variable-length packed batches (THD): lengths checked per batch
    pp_size: Optional[int] = None
    virtual_pp_size: Optional[int] = None
    megatron_pp_flags: tuple = ()  # Megatron's own pipeline-overlap flags that are on
    tied_embeddings: bool = False  # Megatron-LM ties them unless --untie-embeddings-and-output-weights
    documents: Optional[bool] = None  # the GPT dataset marks documents (reset attention mask and positions)
    position_embedding: Optional[str] = None
    world_size: Optional[int] = None
    train_iters: Optional[int] = None  # Megatron-LM's --train-iters (the trace's iterations are checked against it)
    pg_timeout_s: Optional[float] = None  # the process groups' timeout (--distributed-timeout-minutes)
    legacy_checkpoint: bool = False  # Megatron-LM saves or loads in its `torch` format (local layer names)
    hybrid_context_parallel: bool = False  # Megatron's own --hybrid-context-parallel (refused with --overlap-hdp)

    def rows_per_rank(self) -> Optional[int]:
        """Sequence rows each rank's linears see (seq / (TP x CP)), None when not known here."""
        split = (self.tp_size or 0) * (self.cp_size or 1)
        if not self.seq_length or split < 1 or self.seq_length % split:
            return None
        return self.seq_length // split

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace) -> "ModelContext":
        get = lambda name: getattr(args, name, None)  # noqa: E731
        return cls(
            tp_size=get("tensor_model_parallel_size"),
            sequence_parallel=get("sequence_parallel"),
            transformer_impl=get("transformer_impl"),
            tp_comm_overlap=bool(get("tp_comm_overlap")),
            seq_length=get("seq_length"),
            micro_batch_size=get("micro_batch_size"),
            cp_size=get("context_parallel_size"),
            heads=get("num_attention_heads"),
            kv_heads=get("num_query_groups") if get("group_query_attention") else get("num_attention_heads"),
            packed=bool(get("reset_attention_mask")),
            pp_size=get("pipeline_model_parallel_size"),
            virtual_pp_size=get("virtual_pipeline_model_parallel_size") or (
                "set" if get("num_layers_per_virtual_pipeline_stage") else None),
            megatron_pp_flags=tuple(name for name in MEGATRON_PP_FLAGS if get(name)),
            tied_embeddings=get("untie_embeddings_and_output_weights") is False,
            documents=None if get("reset_attention_mask") is None else bool(
                get("reset_attention_mask") and get("reset_position_ids")),
            position_embedding=get("position_embedding_type"),
            world_size=get("world_size"),
            train_iters=get("train_iters") if isinstance(get("train_iters"), int) else None,
            pg_timeout_s=(60.0 * get("distributed_timeout_minutes")
                          if isinstance(get("distributed_timeout_minutes"), (int, float)) else None),
            legacy_checkpoint=get("ckpt_format") == "torch" and any(
                get(name) for name in ("save", "load", "pretrained_checkpoint")),
            hybrid_context_parallel=bool(get("hybrid_context_parallel")),
        )


# Megatron's own pipeline-overlap options that change the schedules --overlap-pp replaces
# (--overlap-p2p-communication-warmup-flush, --delay-wgrad-compute). Its
# --overlap-p2p-communication is on by default and only acts on interleaved schedules (Megatron
# turns it off for the others), so it is no conflict.
MEGATRON_PP_FLAGS = ("overlap_p2p_comm_warmup_flush", "delay_wgrad_compute")
