"""Fused Triton kernels of the ``--overlap-tp fused`` backend (installed as
``megatron_overlap.kernels``).

- :mod:`.ag_gemm`: a persistent GEMM whose tiles wait on the ready flag of the input chunk
  they read (local chunk first, then in arrival order);
- :mod:`.gemm_rs`: a GEMM whose epilogue writes each output tile to the staging slot of the
  rank that owns its rows, counts finished tiles per owner and raises that owner's flag when
  its slot is complete; :func:`.gemm_rs.reduce_slots` then sums the slots an owner received.

Each kernel file holds its plain-PyTorch reference. Kernels know nothing of
``torch.distributed``: transports (``megatron_overlap.tp.backends.fused``) move the chunks and raise
the flags. On CPU they run under ``TRITON_INTERPRET=1`` (fp32), with flags raised before the
launch, since the interpreter runs programs one after another.
"""
