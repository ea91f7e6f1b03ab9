"""A CP training step's programs (``cp/step_model.py``) executed on the two-tier link, with every
transfer free (the compute alone), and the planner's pick of mode and all-to-all size: the
candidate with the shortest simulated step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .step_model import CPCase, Compute, LayerCosts, Send, programs


# -- execution ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    """Per rank: when its step ends, its compute, the time it waited, bytes it sent per tier."""

    end_ms: Tuple[float, ...]
    compute_ms: Tuple[float, ...]
    bytes_by_tier: Tuple[dict, ...]

    @property
    def step_ms(self) -> float:
        return max(self.end_ms)

    @property
    def compute_limit_ms(self) -> float:
        """The busiest rank's compute alone: no communication at all."""
        return max(self.compute_ms)


def run(progs: Sequence[list], link) -> StepResult:
    """Execute the programs on ``link`` (a ``tune.two_tier.TwoTierLink``; None: every transfer
    free). Each rank runs until it waits for a message not yet sent; ranks take turns until all
    are done (a program that deadlocks raises)."""
    R = len(progs)
    now, port, compute = [0.0] * R, [0.0] * R, [0.0] * R
    tiers = [dict() for _ in range(R)]
    pc = [0] * R
    delivered: Dict[tuple, float] = {}
    remaining = sum(len(p) for p in progs)
    while remaining:
        progressed = False
        for r in range(R):
            prog = progs[r]
            while pc[r] < len(prog):
                op = prog[pc[r]]
                if isinstance(op, Compute):
                    now[r] += op.ms
                    compute[r] += op.ms
                elif isinstance(op, Send):
                    if link is None:
                        delivered[op.key] = now[r]
                    else:
                        start = max(now[r], port[r])
                        busy, _ = link.transfer_ms(op.nbytes, (r, op.dst))
                        lat = link.link((r, op.dst)).latency_us * 1e-3 * op.messages
                        port[r] = start + busy
                        delivered[op.key] = start + busy + lat
                        tier = link.tier((r, op.dst))
                        tiers[r][tier] = tiers[r].get(tier, 0.0) + op.nbytes
                else:
                    when = delivered.get(op.key)
                    if when is None:
                        break
                    now[r] = max(now[r], when)
                pc[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: progs[r][pc[r]] for r in range(R) if pc[r] < len(progs[r])}
            raise AssertionError(f"the simulated step deadlocks: {stuck}")
    return StepResult(tuple(now), tuple(compute), tuple(tiers))


@dataclass(frozen=True)
class Prediction:
    """A case simulated on the link and with every transfer free."""

    case: CPCase
    step_ms: float
    free_ms: float
    compute_limit_ms: float
    bytes_by_tier: Tuple[dict, ...]

    @property
    def exposed_ms(self) -> float:
        return self.step_ms - self.free_ms


def predict(case: CPCase, cost, link) -> Prediction:
    """``case`` on ``link`` (``TwoTierLink``) with the rates of ``cost`` (``HdpCostModel``)."""
    costs = LayerCosts.of(cost)
    progs = programs(case, costs)
    on = run(progs, link)
    free = run(progs, None)
    return Prediction(case, on.step_ms, free.step_ms, on.compute_limit_ms, on.bytes_by_tier)


def candidates(cp: int, heads: int, kv_heads: int) -> List[Tuple[str, int]]:
    """Every (mode, all-to-all size) the code runs at this CP size and head count: the ring, the
    all-to-all when both head counts divide by CP, hybrid for every U in (1, CP) dividing CP and
    both head counts."""
    out = [("ring", 1)]
    out += [("hybrid", u) for u in range(2, cp) if cp % u == 0 and heads % u == 0 and kv_heads % u == 0]
    if heads % cp == 0 and kv_heads % cp == 0:
        out.append(("a2a", cp))
    return out


def plan_mode(seq: int, cp: int, world: int, cost, link, layer_groups: int = 0) -> Tuple[Prediction, List[Prediction]]:
    """The planner's pick: the candidate (``candidates``) with the shortest simulated step, ties
    to the earlier (the ring first, then smaller all-to-all sizes); returns (pick, every one)."""
    preds = [predict(CPCase(seq, cp, world, mode, u, True, layer_groups), cost, link)
             for mode, u in candidates(cp, cost.heads, cost.kv_heads)]
    best = min(preds, key=lambda p: p.step_ms)
    return best, preds

