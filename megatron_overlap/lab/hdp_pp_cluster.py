"""HDP's pipeline mode on the emulated cluster (``bench hdp --emulate --pp P``): R = P x D ranks,
rank ``s D + d`` is stage s of data-parallel rank d (Megatron's order: DP inside, PP outside), so
a stage's D ranks are one HDP group and the stages of one pipeline are D ranks apart.

Per step, every stage's group plans the same batch with the product's runtime in mode ``pp``
(``HdpRuntime(mode="pp")``: the planner's pipeline mode, every DP rank the same count M of
micro-batch slots, the empty ones masked; a plan with fewer slots on some rank is padded with
masked ones to M, as a pipeline runs one count), loads its micro-batches (the lengths
all-gather and the row exchange, before the clock starts, on a free link) and runs Megatron's
non-interleaved 1F1B order (``pp.schedule.one_f_one_b_order``, P in flight) over them:

    F(k)   receive the activation of micro-batch k from stage s-1 (s > 0), run the stage's
           layers (``lab/long_context_model.py``: L / P layers, waits of the cost model's times;
           a ring micro-batch's attention is ``cp_attention`` over its ring of the stage's group,
           on the emulated link), send the activation to stage s+1 (s < P-1); the last stage adds
           the output layer
    B(k)   receive its gradient from stage s+1, the backward, send the gradient to stage s-1

An activation (and its gradient) is ``rows x hidden x 2`` modelled bytes, sent as a tensor of
those bytes x the lab's byte factor on the emulated two-tier link (P2P on the world group, the
rings on their stage's group: one egress port each). Times, not numerics.

The prediction (``simulate_pp``): the independent check of the product's own pipeline cost
(``hdp/pp_timeline.py``, what mode ``pp`` plans against; ``pp/schedule_sim.py`` has no rings),
computed from the lab's rates: per (stage, rank, micro-batch) F and B from
``cp.step_model.LayerCosts`` (linears per row, attention per causal pair, backward 2x and ``bwd_factor`` x, the output
layer on the last stage, a ring's ``HdpCostModel.exposed_ring_ms`` / P shared in that ratio,
once per micro-batch of the rows and pairs packed on it, as the runtime runs them: one ring pass),
1F1B order per stage, a ring starting when all its peers of the stage are ready and ending for
all at the slowest peer's end, a P2P transfer ``latency + bytes / bandwidth`` of its tier, sent
when its op ends (ports not serialised).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..hdp.collector_pause import collector_paused
from .long_context_model import EmulatedRanks, start_device
from .hdp_cluster import HDPLabConfig, LabAdapter, cost_and_link

PP_SCHEDULERS = ("hdp", "static")


@dataclass(frozen=True)
class HDPPipeConfig:
    """``lab``: the HDP lab's config with ``ranks`` = D (one stage's group); ``pp``: P."""

    lab: HDPLabConfig
    pp: int = 4

    @property
    def dp(self) -> int:
        return self.lab.ranks

    @property
    def world(self) -> int:
        return self.pp * self.lab.ranks


def check_pp(ranks: int, pp: int, layers: int, layer_groups: int) -> int:
    """D = ranks / pp, or an error naming the flags."""
    if pp < 2:
        raise ValueError(f"--pp {pp}: a pipeline has at least 2 stages")
    if ranks % pp:
        raise ValueError(f"--ranks {ranks} is not divisible by --pp {pp}: the ranks are PP x DP")
    if ranks // pp < 2:
        raise ValueError(f"--ranks {ranks} / --pp {pp} leaves {ranks // pp} DP rank: HDP needs at least 2")
    if layers % (pp * layer_groups):
        raise ValueError(f"--pp {pp} x --layer-groups {layer_groups} does not divide the model's {layers} layers")
    return ranks // pp


def plan_pp(name: str, seq_lens, dp: int, capacity: int, cost, home=None, pp: int = None):
    """``name``'s plan of one stage's group; HDP's planned for a 1F1B pipeline of ``pp`` stages."""
    from ..hdp.planahead import Planner

    return Planner(name, dp, capacity, "pp", cost, stages=pp)(list(seq_lens), home)


def _mb_costs(plan, cost, costs, pp: int, hidden: int) -> tuple:
    """Per DP rank and slot (padded to M): (F ms, B ms) of a middle stage, the output layer's
    (F, B) extra on the last, the ring (or None), the activation's modelled bytes."""
    M = max(len(m) for m in plan.microbatches)
    lp = costs.layers // pp
    out = []
    for d, mbs in enumerate(plan.microbatches):
        row = []
        for k in range(M):
            mb = mbs[k] if k < len(mbs) else []
            rows = sum(s.rows for s in mb) or 1  # an empty slot: one masked row (``idle_microbatch``)
            pairs = sum(s.causal_pairs for s in mb)
            lin = rows * (costs.qkv_ms_per_token + costs.post_ms_per_token) * lp
            att = pairs * costs.pair_ms * lp
            ring = next((tuple(s.ring) for s in mb if len(s.ring) > 1), None)
            on_ring = [s for s in mb if len(s.ring) > 1]  # packed on one ring: one pass, rows and pairs add
            exp = cost.exposed_ring_ms(sum(s.rows for s in on_ring), sum(s.causal_pairs for s in on_ring),
                                       ring) / pp if ring else 0.0
            f_exp = exp / (1 + costs.bwd_factor)
            head = rows * costs.head_ms_per_token
            row.append((lin + att + f_exp, 2 * lin + costs.bwd_factor * att + exp - f_exp, (head, 2 * head), ring,
                        rows * hidden * 2))
        out.append(row)
    return out, M


def simulate_pp(plan, cost, link, pp: int) -> float:
    """The step in modelled ms (module docstring)."""
    from ..cp.step_model import LayerCosts
    from ..pp.schedule import B, F, one_f_one_b_order

    costs = LayerCosts.of(cost)
    items, M = _mb_costs(plan, cost, costs, pp, cost.hidden)
    D = plan.ranks

    def p2p_ms(s: int, d: int, nbytes: float) -> float:  # stage s to s+1 of pipeline d
        a, b = s * D + d, (s + 1) * D + d
        intra = link.node_size and a // link.node_size == b // link.node_size
        bw, lat = (link.intra_GBps, link.intra_latency_us) if intra else (link.inter_GBps, link.inter_latency_us)
        return lat * 1e-3 + nbytes / (bw * 1e9) * 1e3

    orders = {(s, d): one_f_one_b_order(pp, M, s, pp) for s in range(pp) for d in range(D)}
    ptr = {key: 0 for key in orders}
    free = {key: 0.0 for key in orders}
    arrive = {}  # (op, s, d, k) -> when its input is at stage s

    def dur(op, s, d, k):
        f, b, (hf, hb), _ring, _n = items[d][k]
        last = s == pp - 1
        return (f + (hf if last else 0.0)) if op == F else (b + (hb if last else 0.0))

    def ready(op, s, d, k):
        if op == F:
            return 0.0 if s == 0 else arrive.get((F, s, d, k))
        if s == pp - 1:
            return 0.0
        return arrive.get((B, s, d, k))

    left = sum(len(o) for o in orders.values())
    while left:
        progressed = False
        for (s, d), order in orders.items():
            if ptr[(s, d)] >= len(order):
                continue
            op, k = order[ptr[(s, d)]]
            ring = items[d][k][3]
            peers = ring if ring else (d,)
            if any(ptr[(s, e)] >= len(orders[(s, e)]) or orders[(s, e)][ptr[(s, e)]] != (op, k) for e in peers):
                continue
            rs = [ready(op, s, e, k) for e in peers]
            if any(r is None for r in rs):
                continue
            start = max(max(rs), max(free[(s, e)] for e in peers))
            end = start + max(dur(op, s, e, k) for e in peers) if ring else start + dur(op, s, d, k)
            for e in peers:
                free[(s, e)] = end
                ptr[(s, e)] += 1
                left -= 1
                nbytes = items[e][k][4]
                if op == F and s < pp - 1:
                    arrive[(F, s + 1, e, k)] = end + p2p_ms(s, e, nbytes)
                if op == B and s > 0:
                    arrive[(B, s - 1, e, k)] = end + p2p_ms(s - 1, e, nbytes)
            progressed = True
        if not progressed:
            raise RuntimeError("simulate_pp: the 1F1B orders and the plan's rings deadlock")
    return max(free.values())


class HDPPipeRanks(EmulatedRanks):
    """Per-rank state of one run (through ``lab.session``)."""

    def __init__(self, cfg):
        if isinstance(cfg, dict):
            cfg = HDPPipeConfig(lab=HDPLabConfig(**cfg["lab"]), pp=cfg["pp"])
        from ..cp.step_model import LayerCosts, groups_of
        from ..hdp.runtime import HdpRuntime
        from .emulated_attention import TimedBlocks
        from .long_context_model import EmulatedTransformer, emulated_two_tier, rank_samples

        torch.set_num_threads(1)
        logging.getLogger("megatron_overlap").setLevel(logging.ERROR)
        lab = cfg.lab
        if dist.get_world_size() != cfg.world:
            raise ValueError(f"the emulated HDP pipeline needs {cfg.world} ranks, got {dist.get_world_size()}")
        if not lab.time_factor > 0:
            raise ValueError("the driver sets time_factor (cli/bench_hdp_emulate.py)")
        self.cfg, self.lab = cfg, lab
        self.rank = dist.get_rank()
        D, P = cfg.dp, cfg.pp
        self.stage, self.d = divmod(self.rank, D)
        groups = [dist.new_group(list(range(s * D, (s + 1) * D))) for s in range(P)]  # every rank makes every group
        self.group = groups[self.stage]
        self.cost, link = cost_and_link(replace(lab, ranks=cfg.world))
        costs = LayerCosts.of(self.cost)
        lp = costs.layers // P
        self.ring_groups = groups_of(lp, lab.layer_groups)
        self.local_groups = [lp]
        per_group = self.ring_groups[0]
        tf = lab.time_factor
        self.byte_factor = 1.0 / (costs.kv_heads * costs.head_dim)
        self.act_numel = self.cost.hidden * self.byte_factor / per_group  # bf16 elements per row (2 bytes each)
        self.spec, self.free_spec, self.clock, self.link = emulated_two_tier(link, self.byte_factor, per_group, tf,
                                                                             cfg.world)
        self.blocks = TimedBlocks(self.clock, costs.pair_ms * tf, costs.bwd_factor, heads=1)
        self.model = EmulatedTransformer(costs, self.clock, self.ring_groups, tf, heads=1, kv_heads=1)
        self.samples = rank_samples(lab.batches, lab.seed, self.d, D)  # every stage of pipeline d: the same samples
        self.runtime = HdpRuntime(lab.capacity, self.group, LabAdapter(), mode="pp", cost=self.cost, device="cpu")
        gc.collect()
        gc.freeze()

    def load(self, batch: int, scheduler: str):
        self.link.spec = self.free_spec
        try:
            samples = self.samples[batch]
            gathered = self.runtime.gather(samples)
            plan = plan_pp(scheduler, gathered.seq_lens, self.cfg.dp, self.lab.capacity, self.cost, gathered.home,
                           self.cfg.pp)
            step = self.runtime.load(samples, gathered, plan)
        finally:
            self.link.spec = self.spec
        M = max(len(m) for m in plan.microbatches)
        mbs = list(step.microbatches) + [self.runtime.idle_microbatch() for _ in range(M - len(step.microbatches))]
        return mbs

    def _attend(self, q, k, v):
        from ..cp import ring_context
        from ..cp.attention import cp_attention

        ring = ring_context.current()
        return cp_attention(q, k, v, mode="ring", causal=True, group=ring.group, ranks=ring.ranks, packed=ring.packed)

    def _act(self, rows: int) -> torch.Tensor:
        return torch.zeros(max(1, round(rows * self.act_numel)), dtype=torch.bfloat16)

    def _run(self, mbs) -> dict:
        from ..pp.schedule import F, one_f_one_b_order
        from .cluster import _common_start

        P, D, s = self.cfg.pp, self.cfg.dp, self.stage
        order = one_f_one_b_order(P, len(mbs), s, P)
        self.clock.reset()
        self.link.reset()
        gc.collect()
        sends, held = [], {}
        with self.blocks.installed(packed=True):
            t0 = _common_start()
            self.link.reset()
            t0 = start_device(self.clock, t0)  # the hosts run ahead of their devices (as on a GPU)
            c0 = time.thread_time()
            with collector_paused():
                for op, k in order:
                    mb = mbs[k]
                    rows = mb.layout.rows
                    groups = self.ring_groups if len(mb.layout.ring) > 1 else self.local_groups
                    self.blocks.layers = groups[0]
                    if op == F:
                        if s > 0:
                            dist.irecv(self._act(rows), src=self.rank - D).wait()
                        with mb.context():
                            held[k] = self.model.forward(rows, rows, self._attend, groups, head=s == P - 1)
                        if s < P - 1:
                            sends.append(dist.isend(self._act(rows), dst=self.rank + D))
                    else:
                        if s < P - 1:
                            dist.irecv(self._act(rows), src=self.rank + D).wait()
                        out = held.pop(k)
                        with mb.context():
                            out.backward() if s == P - 1 else out.backward(torch.ones_like(out))
                        if s > 0:
                            sends.append(dist.isend(self._act(rows), dst=self.rank - D))
                for w in sends:
                    w.wait()
            self.clock.sync()
            t1, c1 = self.clock.end, time.thread_time()  # the device's end
        stats = self.link.reset()
        return {"wall_s": t1 - t0, "cpu_s": c1 - c0, "late_s": self.clock.late_s, "microbatches": len(mbs),
                "bytes_by_tier": dict(stats.bytes_by_tier)}

    def step(self, batch: int, scheduler: str) -> dict:
        from .hdp_cluster import HDPClusterRanks

        mbs = self.load(batch, scheduler)
        HDPClusterRanks._count_masks(SimpleNamespace(blocks=self.blocks, rank=self.d), [(0, mb) for mb in mbs])
        out = {"link": self._run(mbs)}
        if self.lab.exposed:  # the limit: the same step with every transfer free (rings and stage hops)
            self.link.spec = self.free_spec
            try:
                out["free"] = self._run(mbs)
            finally:
                self.link.spec = self.spec
        return out

    def round(self, index: int) -> dict:
        return {name: self.step(index, name) for name in self.rotated(self.lab.schedulers, index)}


def config_dict(cfg: HDPPipeConfig) -> dict:
    return {"lab": asdict(cfg.lab), "pp": cfg.pp}

