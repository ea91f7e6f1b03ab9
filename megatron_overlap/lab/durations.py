"""Durations measured on this CPU, for the emulated cluster: a JSON file that ``bench pp
--write-durations FILE`` writes from its real run (the tiny GPT's F, B, W per stage, measured
on a free link, its parameter tensors, its activation on the wire and the link it was
calibrated to) and ``bench pp --emulate --durations FILE`` runs as waits, so the lab can be
checked against a real run on the same machine and then taken to more ranks.

Format (version 1)::

    {"version": 1, "source": "...", "date": "...", "dtype_bytes": 4,
     "transfer_bytes": B, "link": {"bandwidth_GBps": G, "latency_us": L},
     "stages": [{"f_ms": F, "b_ms": B, "w_ms": W, "layers": n, "params": [elements, ...]}, ...]}

A stage's F, B and W are spread evenly over its ``layers`` blocks; its first parameter tensor
is the embedding on the first stage, its last the output layer on the last stage (blocks with
no time of their own: the stage's F/B/W include them).
"""

from __future__ import annotations

import json
from typing import List

from ..pp.schedule_sim import StageTimes
from ..pp.work import BlockWork

VERSION = 1


class DurationsError(ValueError):
    """A durations file that cannot drive the emulated cluster; the message names the file."""


def write(path: str, stages: list, transfer_bytes: float, link: dict, dtype_bytes: int, source: str) -> None:
    import datetime

    doc = {"version": VERSION, "source": source, "date": datetime.date.today().isoformat(),
           "dtype_bytes": dtype_bytes, "transfer_bytes": transfer_bytes,
           "link": {"bandwidth_GBps": link["bandwidth_GBps"], "latency_us": link["latency_us"]}, "stages": stages}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def read(path: str, pp: int) -> dict:
    """The file's content, checked for ``pp`` stages (``DurationsError`` names what is missing)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DurationsError(f"--durations {path}: cannot read it ({exc}); write one with "
                             "`megatron-overlap bench pp --write-durations FILE`") from exc
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise DurationsError(f"--durations {path}: not a version-{VERSION} durations file (from "
                             "`bench pp --write-durations`)")
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        raise DurationsError(f"--durations {path}: no 'stages' list")
    if len(stages) != pp:
        raise DurationsError(f"--durations {path} has durations for {len(stages)} stages, none for "
                             f"{'stages' if pp - len(stages) > 1 else 'stage'} {len(stages)}..{pp - 1} of --pp {pp}: "
                             f"measure them with `bench pp --pp {pp} --write-durations {path}`" if pp > len(stages) else
                             f"--durations {path} has durations for {len(stages)} stages, not --pp {pp}: give --pp "
                             f"{len(stages)}, or measure with `bench pp --pp {pp} --write-durations {path}`")
    for s, st in enumerate(stages):
        for key in ("f_ms", "b_ms", "w_ms", "layers", "params"):
            if key not in st:
                raise DurationsError(f"--durations {path}: stage {s} has no {key!r}")
        if not all(isinstance(st[k], (int, float)) and st[k] >= 0 for k in ("f_ms", "b_ms", "w_ms")) or \
                not isinstance(st["layers"], int) or st["layers"] < 1 or not st["params"]:
            raise DurationsError(f"--durations {path}: stage {s}'s times must be >= 0 ms, its layers >= 1 and its "
                                 "params a list of tensor sizes")
    for key in ("transfer_bytes", "link", "dtype_bytes"):
        if key not in doc:
            raise DurationsError(f"--durations {path}: no {key!r}")
    return doc


def stage_work(doc: dict) -> List[List[BlockWork]]:
    """Blocks per stage (module docstring)."""
    out = []
    p = len(doc["stages"])
    for s, st in enumerate(doc["stages"]):
        params = list(st["params"])
        n = st["layers"]
        head = [params.pop()] if s == p - 1 and len(params) > n else []
        embed = [params.pop(0)] if s == 0 and len(params) > n else []
        per = [params[i * len(params) // n:(i + 1) * len(params) // n] for i in range(n)]
        blocks = [BlockWork(f"stage {s} layer {i}", st["f_ms"] / n, st["b_ms"] / n, st["w_ms"] / n, tuple(chunk))
                  for i, chunk in enumerate(per)]
        if embed:
            blocks.insert(0, BlockWork("embedding", 0.0, 0.0, 0.0, tuple(embed)))
        if head:
            blocks.append(BlockWork("output layer", 0.0, 0.0, 0.0, tuple(head)))
        out.append(blocks)
    return out


def stage_times(doc: dict) -> List[StageTimes]:
    return [StageTimes(st["f_ms"], st["b_ms"], st["w_ms"]) for st in doc["stages"]]


def modelled_costs(cfg) -> tuple:
    """(the stages' costs, run, hardware) of the emulated cluster's ``cfg`` (a
    ``lab.cluster.ClusterConfig``) from its durations file: the file's F/B/W and parameters per
    stage, its link for the stage-to-stage transfers and the data-parallel sync alike."""
    from ..tune.comm import p2p_ms
    from ..tune.hardware import cpu_emulated_spec
    from ..tune.models import RunSpec
    from ..tune.pipeline import DPOptions, PipelineCosts, dp_syncs

    doc = read(cfg.durations, cfg.pp)
    work = stage_work(doc)
    link = doc["link"]
    hw = cpu_emulated_spec(1.0, 1.0, link["bandwidth_GBps"], link["latency_us"], dtype_bytes=doc["dtype_bytes"])
    run = RunSpec(tp=1, pp=cfg.pp, dp=cfg.dp, seq=cfg.seq, micro_batch=cfg.micro_batch,
                  micro_batches=cfg.microbatches)
    nbytes = doc["transfer_bytes"]
    act = doc.get("activation_bytes", nbytes)
    costs = PipelineCosts(stage_times(doc), p2p_ms(nbytes, hw.inter), 0.0, dp_syncs(work, run, hw, DPOptions(
        distributed_optimizer=cfg.distributed_optimizer, overlap_param_gather=cfg.distributed_optimizer)), act, work,
        nbytes)
    return costs, run, hw
