"""Locality: which rank of a plan is which, so the sequences stay where they were loaded.

A plan's step time depends on its ranks only through which ranks share a node (a ring inside one
node uses the intra-node link). Relabelling the ranks, whole nodes onto nodes of the same size
and ranks onto ranks inside a node, therefore keeps the step exactly and changes only which
tokens the row exchange moves. :func:`relabel` picks the relabelling that keeps the most tokens
on the rank that loaded them: a maximum-weight assignment of nodes to nodes (tokens summed per
node), then of ranks to ranks inside each node (:func:`assignment`, the Hungarian method).
:func:`home_first` then gives short sequences to their home rank where the step allows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from .cost import local_ms


def assignment(weight: Sequence[Sequence[float]]) -> List[int]:
    """The permutation p maximising sum_i weight[i][p[i]] (square matrix; the Hungarian method
    with potentials, O(n^3); ties to the lower index, so the identity wins among equals)."""
    n = len(weight)
    if n == 0:
        return []
    top = max(max(row) for row in weight)
    cost = [[top - weight[i][j] for j in range(n)] for i in range(n)]  # minimise
    INF = float("inf")
    u, v = [0.0] * (n + 1), [0.0] * (n + 1)
    match = [0] * (n + 1)  # match[j] = row (1-based) assigned to column j
    way = [0] * (n + 1)
    for i in range(1, n + 1):
        match[0] = i
        j0 = 0
        minv = [INF] * (n + 1)
        used = [False] * (n + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = match[j0], INF, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j] - 1e-12:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta - 1e-12:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if match[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    p = [0] * n
    for j in range(1, n + 1):
        p[match[j] - 1] = j - 1
    return p


def relabel(at_home: Sequence[Sequence[float]], gpus_per_node: int) -> List[int]:
    """``perm[r]``: the new label of plan rank r. ``at_home[r][h]``: tokens plan rank r would hold
    that rank h loaded. Nodes go onto nodes of the same size, then ranks onto ranks inside a node
    (module docstring)."""
    R = len(at_home)
    nodes = [list(range(s, min(R, s + gpus_per_node))) for s in range(0, R, gpus_per_node)]
    target = list(range(len(nodes)))
    full = [k for k, members in enumerate(nodes) if len(members) == gpus_per_node]
    if len(full) > 1:
        node_weight = _node_weight(at_home, nodes, full)
        for a, b in zip(full, assignment(node_weight)):
            target[a] = full[b]
    perm = [0] * R
    for k, members in enumerate(nodes):
        dest = nodes[target[k]]
        inner = assignment([[at_home[r][h] for h in dest] for r in members])
        for r, j in zip(members, inner):
            perm[r] = dest[j]
    return perm


def _node_weight(at_home, nodes, full) -> List[List[float]]:
    """Tokens per (node a, node b) of the full nodes: ``sum(at_home[r][h])`` over r in a, h in b.
    Token counts (whole numbers) sum exactly in any order, so numpy's reshaped sum gives the
    loop's floats; other weights take the loop."""
    import numpy as np

    a = np.asarray(at_home, dtype=float)
    if len(full) == len(nodes) and np.array_equal(a, np.floor(a)) and a.sum() < 2.0 ** 52 and a.min() >= 0:
        count, size = len(nodes), len(nodes[0])
        return a.reshape(count, size, count, size).sum(axis=(1, 3)).tolist()
    return [[sum(at_home[r][h] for r in nodes[a] for h in nodes[b]) for b in full] for a in full]


def relabel_rings(rings, gaps, clock, home, cost):
    """The scheduler's rings, gaps and clocks after step 1 with the ranks renamed by
    :func:`relabel`, so the most ring tokens stay where they were loaded."""
    from .shard import Shard

    R = len(clock)
    at_home = [[0.0] * R for _ in range(R)]
    for x in rings:
        for pos, r in enumerate(x.ring):
            at_home[r][home[x.seq_id]] += Shard(x.seq_id, x.seq_len, x.ring, pos).tokens
    perm = relabel(at_home, cost.gpus_per_node)
    rings = [replace(x, ring=tuple(perm[r] for r in x.ring)) for x in rings]
    gaps = {(perm[r], k): cap for (r, k), cap in gaps.items()}
    new_clock = [0.0] * R
    for r in range(R):
        new_clock[perm[r]] = clock[r]
    return rings, gaps, new_clock


def home_first(ids: Sequence[int], lens: Sequence[int], clock: List[float], home: Sequence[int], cost,
               plain: List[List[int]], ms: Optional[Sequence[float]] = None) -> Tuple[List[List[int]], bool]:
    """Step 2b with locality: ``plain`` is LPT's assignment of ``ids`` (costliest first) after
    the rings, ending at T. Each sequence goes to the rank that loaded it while that rank still
    ends by T; the others, tightest fit first, to a rank that still ends by T. Returns (the
    assignment, True) when every sequence fits by T (the step is LPT's), else (``plain``,
    False). ``ms``: per sequence id, its ``local_ms`` where the caller has them."""
    R = len(clock)
    c = {i: local_ms(lens[i], cost) if ms is None else ms[i] for i in ids}
    limit = max([clock[r] + sum(c[i] for i in plain[r]) for r in range(R)], default=0.0) * (1 + 1e-12)
    ends, out, deferred = list(clock), [[] for _ in range(R)], []
    for i in ids:
        h = home[i]
        if ends[h] + c[i] <= limit:
            out[h].append(i)
            ends[h] += c[i]
        else:
            deferred.append(i)
    if deferred:
        import numpy as np

        at = np.array(ends)
        for i in deferred:  # the tightest fit keeps room for the next ones: the latest end that fits, lowest rank
            fits = np.where(at + c[i] <= limit, at, -np.inf)
            r = int(fits.argmax())  # the first of the largest: the lowest rank among equal ends
            if fits[r] == -np.inf:
                return plain, False
            out[r].append(i)
            at[r] += c[i]
    return out, True


def check_home(home, count: int, ranks: int):
    if home is None:
        return None
    home = tuple(home)
    if len(home) != count or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < ranks for h in home):
        raise ValueError(f"home must give each of the {count} sequences the rank in [0, {ranks}) that loaded it, "
                         f"got {list(home)[:8]}{'...' if len(home) > 8 else ''}")
    return home
