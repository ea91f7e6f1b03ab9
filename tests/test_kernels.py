"""The fused Triton kernels against their plain-PyTorch references, under TRITON_INTERPRET=1 on
CPU (fp32; flags raised before the launch: the interpreter runs programs one after another),
for odd shapes, uneven chunks and several tile configs; and the GPU check script end to end in
its CPU emulation."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_overlap.kernels.ag_gemm import TileConfig, ag_gemm, ag_gemm_reference, tile_table
from megatron_overlap.kernels.emulation import emulate_ag_gemm, emulate_gemm_rs
from megatron_overlap.kernels.gemm_rs import gemm_rs, gemm_rs_reference, reduce_slots, reduce_slots_reference

# fp32 GEMMs with different tilings sum the K dimension in another order: ~1e-7 relative.
TOL = 1e-5
CONFIGS = [TileConfig(16, 16, 16), TileConfig(32, 64, 16), TileConfig(64, 32, 32)]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.key())
def test_ag_gemm_odd_shapes_uneven_chunks(config):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(77, 40, generator=gen)
    w = torch.randn(50, 40, generator=gen)  # Megatron's [N, K]: the kernel reads w.t() by strides
    bounds = [0, 13, 26, 40, 52, 77]  # uneven chunks
    order = [2, 3, 4, 0, 1]  # local chunk first, then arrival order
    flags = torch.ones(5, dtype=torch.int32)
    out = ag_gemm(a, w.t(), flags, bounds, order, config=config)
    assert rel(out, ag_gemm_reference(a, w.t())) <= TOL


def test_tile_table_never_crosses_a_chunk_and_follows_the_order():
    table = tile_table([0, 10, 30], [1, 0], n=40, block_m=16, block_n=32, device="cpu").tolist()
    assert [row[0] for row in table] == [1, 1, 1, 1, 0, 0]
    for chunk, row0, end, _col0 in table:
        assert row0 < end and end == [10, 30][chunk]


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: c.key())
def test_gemm_rs_slots_flags_and_reduce(config):
    gen = torch.Generator().manual_seed(2)
    world = 3
    a = torch.randn(world * 13, 40, generator=gen)
    b = torch.randn(40, 50, generator=gen)
    slots, flags = gemm_rs(a, b, world, [1, 2, 0], config=config)
    assert rel(slots, gemm_rs_reference(a, b, world)) <= TOL
    assert flags.tolist() == [1, 1, 1]  # every owner's slot announced complete
    out = reduce_slots(slots, flags, [2, 0, 1], block=16)
    assert torch.equal(out, reduce_slots_reference(slots, [2, 0, 1]))  # same order: same bits


def test_emulation_modes():
    for producer in ("copy_engine", "push_kernel"):
        r = emulate_ag_gemm(3, 17, 24, 40, torch.float32, torch.device("cpu"), producer=producer,
                            config=TileConfig(16, 16, 16))
        assert rel(r["out"], r["reference"]) <= TOL
    r = emulate_gemm_rs(3, 11, 24, 40, torch.float32, torch.device("cpu"), config=TileConfig(16, 16, 16))
    assert max(rel(o, ref) for o, ref in zip(r["outs"], r["references"])) <= TOL
    with pytest.raises(ValueError, match="producer must be"):
        emulate_ag_gemm(2, 4, 4, 4, torch.float32, torch.device("cpu"), producer="dma")


def test_kernel_launchers_refuse_bad_input():
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    ones = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not chain"):
        ag_gemm(a, torch.randn(5, 6), ones, [0, 8], [0])
    with pytest.raises(ValueError, match="dtypes"):
        ag_gemm(a.double(), b.double(), ones, [0, 8], [0])
    with pytest.raises(ValueError, match="cover the rows"):
        ag_gemm(a, b, ones, [0, 7], [0])
    with pytest.raises(ValueError, match="int32"):
        ag_gemm(a, b, ones.long(), [0, 8], [0])
    with pytest.raises(ValueError, match="do not split"):
        gemm_rs(a, b, 3, [0, 1, 2])
    with pytest.raises(ValueError, match="every owner once"):
        gemm_rs(a, b, 2, [0, 0])


def test_gpu_check_script_runs_end_to_end_in_cpu_emulation(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "megatron_overlap.kernels.bench.gpu_check", "--interpret",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["correctness_ok"] and result["mode"].startswith("cpu-interpreter")
    assert set(result["chunked_gemm"]) == {"1", "2", "4", "8", "16"}
    assert result["symm_mem"]["usable"] is False
    assert "chunked GEMM efficiency" in proc.stdout and "live producer" in proc.stdout
    assert proc.stdout.splitlines()[-1].strip() == "correctness: all within tolerance 1e-05"


def test_gpu_check_refuses_an_unknown_section():
    proc = subprocess.run([sys.executable, "-m", "megatron_overlap.kernels.bench.gpu_check", "--interpret",
                           "--only", "preset,bogus"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown section(s) ['bogus']" in proc.stderr


def test_a_flag_that_never_rises_ends_the_kernel_with_an_error_naming_the_chunk():
    """Every flag wait is bounded: chunk 3's flag is never raised (its producer died), the
    kernel gives up after its spin cap, skips the tiles of that chunk, and the launcher raises
    an error naming it; the other chunks are computed."""
    import time

    from megatron_overlap.kernels.ag_gemm import FlagWaitTimeout

    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(64, 32, generator=gen), torch.randn(32, 16, generator=gen)
    flags = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    bounds, out = [0, 16, 32, 48, 64], torch.zeros(64, 16)
    t0 = time.monotonic()
    with pytest.raises(FlagWaitTimeout, match="ag_gemm: the ready flag of chunk 3 was not raised within 50 spins"):
        ag_gemm(a, b, flags, bounds, [0, 1, 2, 3], out=out, config=TileConfig(16, 16, 16), max_spins=50)
    assert time.monotonic() - t0 < 60
    assert rel(out[:48], a[:48] @ b) <= TOL and torch.count_nonzero(out[48:]) == 0  # skipped, not garbage
    received = torch.randn(3, 8, 16, generator=gen)
    with pytest.raises(FlagWaitTimeout, match="reduce_slots: the ready flag of slot 1 was not raised"):
        reduce_slots(received, torch.tensor([1, 0, 1], dtype=torch.int32), [0, 1, 2], block=16, max_spins=20)


def test_gpu_check_takes_ranks_as_every_command_spells_it():
    from megatron_overlap.kernels.bench.gpu_check import _args

    assert _args(["--ranks", "4"]).world == 4 and _args(["--world", "4"]).world == 4 and _args([]).world == 8
