"""install()/uninstall(): only asked-for patches, exact restoration, idempotence, version
range, TP=1 notice, and the same errors when the checks can only run at the first layer."""

import logging

import pytest

import megatron_overlap
from megatron_overlap import MegatronVersionError
from megatron_overlap.integration import compat

from . import tp_rank_fns
from .flag_args import megatron_args, parse


def _snapshot():
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    owners = [layers, mappings, tensor_parallel, layers.ColumnParallelLinear, layers.RowParallelLinear,
              layers.LinearWithGradAccumulationAndAsyncCommunication, DotProductAttention]
    return {(id(o), k): v for o in owners for k, v in vars(o).items()}


def test_install_uninstall_restores_every_attribute():
    from megatron.core.tensor_parallel import layers

    before = _snapshot()
    original = layers.linear_with_grad_accumulation_and_async_allreduce
    megatron_overlap.install(parse("--overlap-tp", "p2p"))
    assert megatron_overlap.is_installed()
    assert layers.linear_with_grad_accumulation_and_async_allreduce is not original
    assert layers.RowParallelLinear.forward is not before[(id(layers.RowParallelLinear), "forward")]
    # Megatron reads this attribute back through the module global, which is now ours
    assert hasattr(layers.linear_with_grad_accumulation_and_async_allreduce, "warned")
    megatron_overlap.uninstall()
    after = _snapshot()
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)


def test_overlap_cp_patches_attention_and_uninstall_restores_it():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    before = _snapshot()
    megatron_overlap.install(parse("--overlap-cp", "ring"))
    assert DotProductAttention.forward is not before[(id(DotProductAttention), "forward")]
    assert DotProductAttention.__init__ is not before[(id(DotProductAttention), "__init__")]
    megatron_overlap.uninstall()
    after = _snapshot()
    assert all(after[k] is before[k] for k in before)
    # CP off: the forward is Megatron's own (only __init__ is wrapped, to name --overlap-cp)
    megatron_overlap.install(parse("--overlap-tp", "p2p"))
    assert DotProductAttention.forward is before[(id(DotProductAttention), "forward")]


def test_install_is_idempotent_and_reconfigurable():
    from megatron.core.tensor_parallel import layers

    args = parse("--overlap-tp", "p2p")
    megatron_overlap.install(args)
    patched = layers.linear_with_grad_accumulation_and_async_allreduce
    megatron_overlap.install(args)
    assert layers.linear_with_grad_accumulation_and_async_allreduce is patched  # no double wrap
    config = megatron_overlap.install(parse("--overlap-tp", "p2p", "--overlap-tp-rs", "a2a")).config
    assert megatron_overlap.active_config() == config and config.tp.rs == "a2a"
    megatron_overlap.install(parse("--overlap-tp", "off"))
    assert not megatron_overlap.is_installed()
    megatron_overlap.uninstall()
    megatron_overlap.uninstall()


def test_only_requested_patches():
    before = _snapshot()
    megatron_overlap.install(parse())  # overlap off: nothing at all
    assert not megatron_overlap.is_installed()
    assert all(_snapshot()[k] is before[k] for k in before)


@pytest.mark.parametrize("version", ["0.15.3", "0.20.0", "1.0.0"])
def test_unsupported_megatron_core(monkeypatch, version):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: version)
    with pytest.raises(MegatronVersionError, match=r"supports megatron-core >=0\.16,<0\.20; found " + version):
        megatron_overlap.install(parse("--overlap-tp", "p2p"))
    assert not megatron_overlap.is_installed()


def test_supported_versions_parse():
    for version in ("0.16.0", "0.16.1", "0.17.1", "0.18.2", "0.19.0rc1", "0.19.2+abc"):
        assert compat.check_megatron_version(version)[:2] in {(0, 16), (0, 17), (0, 18), (0, 19)}


def test_linear_call_reads_both_signatures():
    import inspect

    def v016(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
             grad_output_buffer=None, wgrad_deferral_limit=0, async_grad_allreduce=None, tp_group=None):
        pass

    def v019(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
             grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1):
        pass

    for fn, extra in ((v016, {}), (v019, {"gtp_remat_size": 2})):
        call = compat.LinearCall(inspect.signature(fn), ("x", "w", None, False, False, True),
                                 dict(tp_group="g", **extra))
        assert (call.input, call.sequence_parallel, call.tp_group) == ("x", True, "g")
        assert call.gtp_remat_size == (2 if extra else 1)


def test_tp1_is_a_notice_not_an_error(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        config = megatron_overlap.install(megatron_args("--overlap-tp", "p2p", tp=1, sp=False)).config
    assert config.tp.enabled and not megatron_overlap.is_installed()
    notices = [r for r in caplog.records if "tensor-parallel size 1" in r.getMessage()]
    assert len(notices) == 1


def test_full_megatron_args_install(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        megatron_overlap.install(megatron_args("--overlap-tp", "p2p", "--overlap-tp-chunks", "8"))
    assert megatron_overlap.is_installed()
    assert any("TP overlap on" in r.getMessage() for r in caplog.records)


def test_programmatic_install_checks_when_the_layer_runs(pool4):
    for message in pool4.run(tp_rank_fns.programmatic_install_checks_at_first_run, 4, 6):
        assert message.startswith("OverlapConfigError: --overlap-tp-chunks: 6 is not a multiple of the tensor-parallel size 4"), message
    # without sequence parallelism the all-reduce path runs (tests/test_tp_allreduce.py), but not on fused
    for message in pool4.run(tp_rank_fns.sp_off_error, 2):
        assert message.startswith("OverlapConfigError: --overlap-tp: fused: without --sequence-parallel the linears "
                                  "all-reduce"), message
    for message in pool4.run(tp_rank_fns.sp_off_error, 2, ["--overlap-tp", "p2p", "--overlap-tp-bidirectional"]):
        assert message.startswith("OverlapConfigError: --overlap-tp-bidirectional: splits the chunks of a ring"), message


def test_every_subpackage_is_installed():
    """A wheel holds what setuptools' package discovery finds: every folder of the package with
    Python files must be a package (have an __init__.py) and match the discovery pattern."""
    import pathlib
    import tomllib

    from setuptools import find_packages

    root = pathlib.Path(__file__).resolve().parents[1]
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    with_code = {".".join(p.parent.relative_to(root).parts) for p in (root / "megatron_overlap").rglob("*.py")
                 if "__pycache__" not in p.parts}
    assert with_code == set(find_packages(str(root), include=include))


def test_virtual_pipeline_buckets_patch_and_checkpoint_notice():
    """``--overlap-pp-buckets every-chunk`` keeps DDP buckets on every stage and chunk
    (``integration/ddp.py``): DDP's and its buffer's constructors patched while installed and
    restored exactly after; the default (``megatron``) leaves them alone. With the distributed optimizer and a
    checkpoint to save or load in its bucket-following format, a notice says which layout
    resumes which checkpoint; none where the format does not follow buckets."""
    from types import SimpleNamespace

    from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer

    from megatron_overlap.config import OverlapConfig, PPConfig
    from megatron_overlap.errors import render
    from megatron_overlap.integration.ddp import buckets_patchable, checkpoint_notice

    ddp_cls, buf_cls = distributed_data_parallel.DistributedDataParallel, param_and_grad_buffer._ParamAndGradBuffer
    before = ddp_cls.__dict__["__init__"], buf_cls.__dict__["__init__"]
    assert buckets_patchable() == ""  # megatron-core 0.16
    try:
        megatron_overlap.install(OverlapConfig(pp=PPConfig(mode="zb", buckets="every-chunk", explicit=frozenset({"buckets"}))))
        assert ddp_cls.__dict__["__init__"] is not before[0] and buf_cls.__dict__["__init__"] is not before[1]
        megatron_overlap.uninstall()
        assert (ddp_cls.__dict__["__init__"], buf_cls.__dict__["__init__"]) == before
        megatron_overlap.install(OverlapConfig(pp=PPConfig(mode="zb")))  # the default: Megatron's buckets
        assert (ddp_cls.__dict__["__init__"], buf_cls.__dict__["__init__"]) == before
    finally:
        megatron_overlap.uninstall()
    args = dict(virtual_pipeline_model_parallel_size=2, use_distributed_optimizer=True, save="/ckpt", load=None,
                dist_ckpt_optim_fully_reshardable=False, ckpt_format="torch_dist")
    ec = PPConfig(mode="zb", buckets="every-chunk")
    said = render(checkpoint_notice(ec, SimpleNamespace(**args)))
    assert "resumes only with --overlap-pp-buckets megatron" in said and "--dist-ckpt-optim-fully-reshardable" in said
    for change in (dict(dist_ckpt_optim_fully_reshardable=True), dict(save=None), dict(use_distributed_optimizer=False),
                   dict(virtual_pipeline_model_parallel_size=None)):
        assert checkpoint_notice(ec, SimpleNamespace(**{**args, **change})) == "", change
    assert checkpoint_notice(PPConfig(mode="zb", buckets="megatron"), SimpleNamespace(**args)) == ""
