"""Step 1 of the scheduler (``scheduler.py``): the size of each ring and the ranks it takes,
for every size from the fewest ranks that hold the sequence up to all R. The candidates and the
choice are the module docstring's of ``scheduler.py``; this module makes them cheap: the clocks
sorted once per ring, prefix sums for a candidate's start and its peers' waits, a peer's time
cached by (length, size, in one node), and the sizes whose only candidate is the n least busy
ranks scored together with numpy in the same float operations (the same plans, bit for bit)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .cost import NODE_SLACK, HdpCostModel, local_ms


class RingSizes:
    """Step 1's candidate rank sets for every ring size n at once, from the clocks sorted once:
    the n ranks with the smallest clocks, and (when n fits in a node) each node's n least busy.
    A candidate's start is the clock of its n-th rank, its peers' waits n x start - (their
    clocks' sum), both from prefix sums; a peer's time depends on the ring only through n and
    whether it sits in one node. So each size costs O(R / gpus_per_node), not O(R log R)."""

    def __init__(self, seq_len: int, clock: List[float], cost: HdpCostModel, cache: Optional[dict] = None):
        import numpy as np

        self.seq_len, self.clock, self.cost = seq_len, clock, cost
        R, gpn = len(clock), cost.gpus_per_node
        clk = np.asarray(clock, dtype=float)
        order = np.lexsort((np.arange(R), clk))  # by (clock, rank), as sorted(key=(clock[r], r))
        self._clk, self._sorted = clk, clk[order]
        self._pre = np.concatenate(([0.0], np.cumsum(self._sorted)))  # accumulate: sequential, as _prefix
        first = np.zeros(R, dtype=bool)
        first[np.unique(order // gpn, return_index=True)[1]] = True
        self._nodes_upto = np.cumsum(first)  # nodes among the first n ranks of ``order``
        self._order = order
        self.order, self.prefix, self.nodes_upto = order.tolist(), self._pre.tolist(), self._nodes_upto.tolist()
        self._node_order = None
        self._node_arrays = None
        self._best: Dict[int, tuple] = {}
        self.w: Dict[Tuple[int, int, bool], float] = {} if cache is None else cache  # (L, n, intra) -> peer time

    @property
    def node_order(self):
        """Per node, its ranks by clock and their clocks' prefix sums (built when first asked)."""
        if self._node_order is None and len(self.clock) % self.cost.gpus_per_node == 0:
            members, _, pre = self._nodes()
            self._node_order = list(zip(members.tolist(), pre.tolist()))
        if self._node_order is None:
            gpn, clock = self.cost.gpus_per_node, self.clock
            by_node: Dict[int, List[int]] = {}
            for r in self.order:
                by_node.setdefault(r // gpn, []).append(r)
            self._node_order = [(m, _prefix([clock[r] for r in m])) for _, m in sorted(by_node.items())]
        return self._node_order

    def _nodes(self):
        """Every node full: (ranks by node, least busy first; their clocks; the clocks' prefix
        sums, a leading 0 column), numpy arrays of one row per node."""
        import numpy as np

        if self._node_arrays is None:
            gpn = self.cost.gpus_per_node
            count = len(self.clock) // gpn
            members = self._order[np.argsort(self._order // gpn, kind="stable")].reshape(count, gpn)
            node_clock = self._clk[members]
            pre = np.concatenate((np.zeros((count, 1)), np.cumsum(node_clock, axis=1)), axis=1)
            self._node_arrays = (members, node_clock, pre)
        return self._node_arrays

    def _w(self, n: int, intra: bool) -> float:
        key = (self.seq_len, n, intra)
        w = self.w.get(key)
        if w is None:
            w = self.w[key] = self.cost.peer_ms(self.seq_len, n, intra)
        return w

    def estimates(self, lo: int, hi: int, placed: float, rest_ms: float) -> Dict[int, float]:
        """``spread_choice``'s estimate for every size lo..hi at once (numpy, the same float
        operations in the same order as one size at a time, so the same numbers), for sizes whose
        only candidate is the n least busy ranks (n > gpus_per_node, or one node holds all)."""
        import numpy as np

        R = len(self.clock)
        ns = np.arange(lo, hi + 1)
        start = self._sorted[ns - 1]
        waits = ns * start - self._pre[ns]
        intra = self._nodes_upto[ns - 1] == 1
        w = self.cost.peer_ms_many(self.seq_len, ns, intra)
        end = start + w
        est = np.maximum(end, (placed + ns * (end - start) + waits + rest_ms) / R)
        return dict(zip(ns.tolist(), est.tolist()))

    def small_estimates(self, lo: int, hi: int, placed: float, rest_ms: float) -> Dict[int, float]:
        """``estimates`` for the sizes 2 <= lo..hi <= gpus_per_node < R whose candidates are the n
        least busy ranks and each node's n least busy (every node full): ``best``'s choice scored
        for all sizes and nodes at once, the same float operations; a size whose tied candidates
        start at different times is left out (``spread_choice`` asks ``best``)."""
        import numpy as np

        R = len(self.clock)
        ns = np.arange(lo, hi + 1)
        _, node_clock, node_pre = self._nodes()  # each node's clocks, least busy first
        g_start = self._sorted[ns - 1]
        g_intra = self._nodes_upto[ns - 1] == 1
        L, cached = self.seq_len, self.w
        if (L, hi, True) not in cached or (L, hi, False) not in cached:  # peer_ms_many: peer_ms's floats (tested)
            both = np.concatenate((ns, ns))
            flags = np.arange(len(both)) < len(ns)  # in one node, then across nodes
            for n, intra, w in zip(both.tolist(), flags.tolist(), self.cost.peer_ms_many(L, both, flags).tolist()):
                cached.setdefault((L, n, intra), w)
        g_w = np.array([self._w(n, bool(i)) for n, i in zip(ns.tolist(), g_intra.tolist())])
        w_in = np.array([self._w(n, True) for n in ns.tolist()])
        g_end, g_waits = g_start + g_w, ns * g_start - self._pre[ns]
        n_start = node_clock[:, ns - 1]
        n_end, n_waits = n_start + w_in, ns * n_start - node_pre[:, ns]
        best_end = np.minimum(g_end, n_end.min(axis=0))
        n_pool = n_end <= best_end + NODE_SLACK * w_in
        g_pool = g_intra & (g_end <= best_end + NODE_SLACK * g_w)
        empty = ~(n_pool.any(axis=0) | g_pool)
        n_pool |= empty
        g_pool |= empty
        ends = np.vstack((g_end, n_end))
        waits = np.vstack((g_waits, n_waits))
        starts = np.vstack((g_start, n_start))
        pool = np.vstack((g_pool, n_pool))
        top_end = np.where(pool, ends, np.inf).min(axis=0)
        tied = pool & (ends == top_end)
        top_waits = np.where(tied, waits, np.inf).min(axis=0)
        tied &= waits == top_waits
        start = np.where(tied, starts, np.inf).min(axis=0)
        same = start == np.where(tied, starts, -np.inf).max(axis=0)
        est = np.maximum(top_end, (placed + ns * (top_end - start) + top_waits + rest_ms) / R)
        return {n: e for n, e, ok in zip(ns.tolist(), est.tolist(), same.tolist()) if ok}

    def best(self, n: int):
        """(ring, start, end, the peers' waits) of size n (``scheduler`` module docstring, step 1):
        the earliest end, an intra-node ring unless it ends more than NODE_SLACK x its time
        later; ties: the smaller waits, then the lower rank ids."""
        if n not in self._best:
            self._best[n] = self._best_of(n)
        return self._best[n]

    def _best_of(self, n: int):
        clock, gpn, R = self.clock, self.cost.gpus_per_node, len(self.clock)
        start = clock[self.order[n - 1]]
        intra = self.nodes_upto[n - 1] == 1
        w = self._w(n, intra)
        scored = [(start + w, n * start - self.prefix[n], -1, start, w, intra)]
        if n <= gpn < R:
            for k, (members, pre) in enumerate(self.node_order):
                if len(members) >= n:
                    s = clock[members[n - 1]]
                    wi = self._w(n, True)
                    scored.append((s + wi, n * s - pre[n], k, s, wi, True))
        best_end = min(x[0] for x in scored)
        pool = [x for x in scored if x[5] and x[0] <= best_end + NODE_SLACK * x[4]] or scored
        top = min((x[0], x[1]) for x in pool)
        ties = [(self._members(x[2], n), x) for x in pool if (x[0], x[1]) == top]
        ring, x = min(ties, key=lambda t: t[0])
        return ring, x[3], x[0], x[1]

    def _members(self, k: int, n: int) -> Tuple[int, ...]:
        return tuple(sorted(self.order[:n] if k < 0 else self.node_order[k][0][:n]))


def _prefix(values: Sequence[float]) -> List[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def spread_choice(seq_len: int, low: int, clock: List[float], cost: HdpCostModel, rest_ms: float,
                   spread: bool, cache: Optional[dict] = None):
    """Step 1's ring size: from the fewest ranks that hold the sequence (``low``) up to all R,
    the one whose estimated step is shortest, max(this ring's end, (work placed so far + this
    ring's busy and idle time + ``rest_ms`` still to place) / R): more ranks end a dominant
    sequence sooner at the price of ring traffic and of the gaps its peers wait in. Ties: fewer
    ranks. Returns (n, ring, start, end); n = 1: held whole (no ring)."""
    R = len(clock)
    placed = sum(clock)
    sizes = RingSizes(seq_len, clock, cost, cache)
    high = R if spread else low
    estimates = {}
    gpn = cost.gpus_per_node
    if high - low > 16 and hasattr(cost, "peer_ms_many"):
        estimates = sizes.estimates(max(low, 2, gpn + 1 if gpn < R else 2), high, placed, rest_ms)
        if gpn < R and R % gpn == 0 and max(low, 2) <= gpn:
            estimates.update(sizes.small_estimates(max(low, 2), gpn, placed, rest_ms))
    best = None
    for n in range(low, high + 1):
        if n in estimates:
            estimate = estimates[n]
        else:
            if n == 1:
                start = clock[sizes.order[0]]
                end, waits = start + local_ms(seq_len, cost), 0.0
            else:
                _, start, end, waits = sizes.best(n)
            # busy and idle time of the ring's peers: n (end - start) + their waits before it
            estimate = max(end, (placed + n * (end - start) + waits + rest_ms) / R)
        if best is None or estimate < best[0] * (1 - 1e-9):
            best = (estimate, n)
    n = best[1]
    if n == 1:
        r = sizes.order[0]
        return 1, (r,), clock[r], clock[r] + local_ms(seq_len, cost)
    ring, start, end, _ = sizes.best(n)
    return n, ring, start, end
