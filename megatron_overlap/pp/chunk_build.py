"""Virtual-pipeline schedules built and validated (``build.build`` with ``chunks`` > 1, or
``zbv``). Memory bounds, in one micro-batch's activations of a whole stage:

    interleaved 1F1B  (warm-up + 1) / v on stage s, warm-up = 2 (p - s - 1) + (v - 1) g (+ the
                      extra in flight), at most m v chunk activations
    interleaved zb    the same plus ``w_share`` of a chunk for each of the 2 s weight gradients
                      stage s may hold back before a forward (ZB-H1's rule, per chunk)
    zbv               p on every stage: 1F1B's first stage
"""

from __future__ import annotations

from typing import Sequence

from ..errors import OverlapConfigError
from .chunk_split import split_chunks, v_order
from .chunks import (F, chunked_actions, check_interleaved, interleaved_placement, megatron_order,
                     megatron_warmup, timeline, v_placement)
from .schedule import Schedule
from .validate import validate


def check_chunks(kind: str, chunks: int) -> None:
    if kind == "zbv" and chunks != 2:
        raise OverlapConfigError("pp.mode", f"zbv places exactly 2 model chunks on each stage (a V: stage s holds "
                                 f"virtual stages s and 2p-1-s); this run has {chunks} per stage: set the virtual "
                                 "pipeline size to 2, or use `pp.mode` zb (interleaved zero bubble, any number)")
    if chunks < 1:
        raise ValueError(f"model chunks per stage must be >= 1, got {chunks}")


def build_chunked(kind: str, p: int, m: int, v: int, inflight: int = 0, w_share: float = 0.5,
                  times: Sequence[float] = (1.0, 1.0, 1.0), forward_only: bool = False, group: int = 0) -> Schedule:
    check_chunks(kind, v)
    g = group or p
    if kind == "zbv":
        placement = v_placement(p)
        orders = [[(F, c, mb) for c in (0, 1) for mb in range(m)] for _ in range(p)] if forward_only else \
            v_order(p, m, times, w_share)
        bound = tuple(float(m if forward_only else p) for _ in range(p))
        name = "zbv"
    else:
        check_interleaved(p, m, g)
        extra = (inflight or p) - p
        if extra < 0:
            raise OverlapConfigError("pp.max_inflight", f"is {inflight}, below the {p} pipeline stages")
        placement = interleaved_placement(p, v)
        fb = [megatron_order(p, m, v, s, g, extra) for s in range(p)]
        warm = [min(megatron_warmup(p, m, v, s, g, extra) + 1, m * v) for s in range(p)]
        hold = [2 * s for s in range(p)]
        if forward_only:
            orders = [[(F, c, mb) for mb, c in _forwards(m, v, g)] for _ in range(p)]
            bound = tuple(float(m) for _ in range(p))
        elif kind == "zb":
            orders = split_chunks(fb, placement, m, v, hold, times)
            bound = tuple((warm[s] + hold[s] * w_share) / v for s in range(p))
        else:
            orders = fb
            bound = tuple(warm[s] / v for s in range(p))
        name = ("megatron interleaved" if kind == "megatron" else f"{kind} interleaved") + f" (v={v})" + \
            (f" (inflight {inflight})" if extra else "")
    split = kind in ("zb", "zbv") and not forward_only
    end = timeline(orders, placement)
    actions = [chunked_actions(orders, placement, s, forward_only, end) for s in range(p)]
    schedule = Schedule(name=name, stages=p, microbatches=m, split=split, inflight=inflight or p,
                        actions=tuple(tuple(a) for a in actions), memory_bound=bound, w_share=w_share,
                        forward_only=forward_only, chunks=len({c for _s, c in placement}), placement=placement)
    validate(schedule)
    return schedule


def _forwards(m, v, g):
    from .chunks import schedule_table

    return schedule_table(m, v, g)
