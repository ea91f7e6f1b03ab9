"""Namespaces the tests hand to ``install()``: the plugin's flags parsed (``parse``), the same
with the Megatron arguments the plugin reads (``megatron_args``), and the message of a flag the
parser refuses (``parser_error``)."""

import pytest

from megatron_overlap import overlap_parser


def parse(*flags):
    return overlap_parser().parse_args(list(flags))


def megatron_args(*flags, tp=4, sp=True, impl="local", tp_comm_overlap=False, seq=64, cp=1, pp=1,
                  heads=8, kv_heads=4, **megatron):
    args = parse(*flags)
    for name, value in megatron.items():
        setattr(args, name, value)
    args.context_parallel_size = cp
    args.pipeline_model_parallel_size = pp
    args.num_attention_heads = heads
    args.group_query_attention = kv_heads != heads
    args.num_query_groups = kv_heads
    args.tensor_model_parallel_size = tp
    args.sequence_parallel = sp
    args.transformer_impl = impl
    args.tp_comm_overlap = tp_comm_overlap
    args.seq_length = seq
    args.micro_batch_size = 1
    return args


def parser_error(capsys, *flags) -> str:
    with pytest.raises(SystemExit):
        parse(*flags)
    return capsys.readouterr().err
