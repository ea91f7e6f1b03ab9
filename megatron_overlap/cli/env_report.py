"""``megatron-overlap check``: versions, and which overlap backends can run here."""

from __future__ import annotations

import platform
from importlib import metadata

from ..integration import compat


def _version(dist_name: str):
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def report() -> dict:
    import torch
    import torch.distributed as dist

    mcore = compat.megatron_core_version()
    try:
        compat.check_megatron_version(mcore)
        mcore_ok, mcore_note = True, "supported"
    except Exception as exc:  # the message is the report
        mcore_ok, mcore_note = False, str(exc)
    cuda = torch.cuda.is_available()
    te = compat.transformer_engine_version()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron-core": mcore,
        "megatron-core supported": mcore_ok,
        "megatron-core note": mcore_note,
        "triton": _version("triton"),
        "transformer-engine": te,
        "apex": compat.apex_version(),
        "cuda devices": torch.cuda.device_count() if cuda else 0,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
    }
    from ..tp.backends import fused, symm_mem
    from ..tp.backends import resolve_backend
    from ..config import TPConfig

    symm_ok, symm_why = symm_mem.availability()
    fused_ok, fused_why = fused.availability()
    backends = {
        "off": (True, "stock Megatron"),
        "p2p": (
            mcore_ok and dist.is_available(),
            "chunked P2P rings over torch.distributed (gloo, NCCL): works on CPU and GPU"
            if mcore_ok
            else "needs a supported megatron-core",
        ),
        "symm-mem": (mcore_ok and symm_ok, symm_why),
        "fused": (mcore_ok and fused_ok, fused_why + ("; not yet validated on GPUs" if fused_ok else "")),
        "auto": (mcore_ok, f"resolves to {resolve_backend(TPConfig(mode='auto'))} here"),
    }
    info["backends"] = {name: {"usable": ok, "note": note} for name, (ok, note) in backends.items()}
    split = "local spec only (Transformer Engine's wgrad deferral is untested, so zb refuses it)"
    schedules = {
        "megatron": (True, "Megatron's own pipeline schedule"),
        "1f1b": (mcore_ok, "1F1B with every stage transfer posted early, waited late; "
                           "--overlap-pp-max-inflight K (2 x PP - 1 hides the steady-state transfers); with a "
                           "virtual pipeline Megatron's interleaved order"),
        "zb": (mcore_ok, f"ZB-H1: backward split into B and W, 1F1B's peak memory (interleaved zero bubble with a "
                         f"virtual pipeline); {split}"),
        "zbv": (mcore_ok and compat.parse_version(mcore)[:2] == (0, 16),
                "ZB-V: 2 model chunks per stage in a V (Megatron's layer offsets patched: megatron-core 0.16.x "
                "only), 1F1B's peak memory; untied embeddings"),
        "auto": (mcore_ok, "zb where the weight gradients can be deferred, else 1f1b; with a virtual pipeline the "
                           "cost model's fastest of stock interleaved, zb and zbv"),
    }
    info["pipeline schedules"] = {name: {"usable": ok, "note": note} for name, (ok, note) in schedules.items()}
    from ..integration.ddp import buckets_patchable

    cut = buckets_patchable() if mcore_ok else "megatron-core missing or unsupported"
    info["pipeline note"] = ("PP > 1 only (PP = 1: a notice, stock runs); virtual pipelines: 1f1b, zb, zbv, auto; "
                             "their DDP buckets: Megatron's (default) or every-chunk (--overlap-pp-buckets: "
                             + ("usable here)" if not cut else f"not here: megatron-core's {cut})"))
    ortools = _version("ortools")
    info["pipeline floor"] = (f"megatron-overlap floor / bench pp's floor: CP-SAT from ortools {ortools}" if ortools
                              else "megatron-overlap floor needs ortools (pip install ortools); bench pp then "
                              "leaves its floor out")
    info["transformer-engine note"] = (
        "present: only Megatron's local linears (--transformer-impl local) are patched; "
        "TE's linears are left as they are, and --transformer-impl transformer_engine with "
        "--overlap-tp on is refused"
        if te
        else "absent: use --transformer-impl local (the only path this plugin patches)"
    )
    return info


def format_report(info: dict) -> str:
    lines = ["megatron-overlap check", ""]
    for key in ("python", "torch", "megatron-core", "triton", "transformer-engine", "apex", "device", "gloo", "nccl"):
        value = info[key]
        lines.append(f"  {key:20} {value if value not in (None, '') else 'not installed'}")
    if not info["megatron-core supported"]:
        lines.append(f"  !! {info['megatron-core note']}")
    lines += ["", "  --overlap-tp backends:"]
    for name, entry in info["backends"].items():
        mark = "yes" if entry["usable"] else "no "
        lines.append(f"    {name:8} {mark}  {entry['note']}")
    lines += ["", "  --overlap-pp schedules:"]
    for name, entry in info["pipeline schedules"].items():
        mark = "yes" if entry["usable"] else "no "
        lines.append(f"    {name:8} {mark}  {entry['note']}")
    lines.append(f"    {info['pipeline note']}")
    lines.append(f"    {info['pipeline floor']}")
    lines += ["", f"  Transformer Engine: {info['transformer-engine note']}"]
    return "\n".join(lines)


def main(json_output: bool = False) -> int:
    import json

    info = report()
    print(json.dumps(info) if json_output else format_report(info))
    return 0 if info["megatron-core supported"] else 1
