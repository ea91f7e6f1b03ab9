"""Context-parallel core attention: ring (P2P, overlapped), all-to-all (Ulysses) and hybrid,
for unpacked sequences in Megatron's zigzag layout and packed (THD) batches.

``cp_attention`` is the entry point; ``reference.reference_attention`` the single-rank
plain-PyTorch attention every mode is tested against.
"""

from .attention import MODES, check_cp_config, check_seq_length, cp_attention
from .block import BlockWork, block_attention, block_backward, merge_partial
from .layout import zigzag_index, zigzag_slice
from .packed import pad_cu_seqlens, pad_packed, partition_index, real_index, thd_batch_on_this_cp_rank
from .reference import reference_attention

CP_MODES = ("off",) + MODES  # the values of OverlapConfig.cp (--overlap-cp); config imports them

__all__ = [
    "CP_MODES",
    "MODES",
    "BlockWork",
    "block_attention",
    "block_backward",
    "check_cp_config",
    "check_seq_length",
    "cp_attention",
    "merge_partial",
    "pad_cu_seqlens",
    "pad_packed",
    "partition_index",
    "real_index",
    "reference_attention",
    "thd_batch_on_this_cp_rank",
    "zigzag_index",
    "zigzag_slice",
]
