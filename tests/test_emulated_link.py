"""The emulated link: transfers take latency + bytes / bandwidth, queue on one egress port per
rank, reach Megatron's import-time bindings, and count the same bytes for stock and plugin."""

from megatron_overlap.lab.emulated_link import LinkSpec

from . import link_rank_fns


def test_link_spec_validates():
    import pytest

    with pytest.raises(ValueError, match="bandwidth_GBps"):
        LinkSpec(bandwidth_GBps=0)
    with pytest.raises(ValueError, match="latency_us"):
        LinkSpec(bandwidth_GBps=1, latency_us=-1)
    assert LinkSpec(bandwidth_GBps=1, latency_us=0).seconds(1e9) == 1.0


def test_transfers_take_link_time(pool4):
    results = pool4.run(link_rank_fns.link_timing)
    for rank, r in enumerate(results):
        sender = results[rank ^ 1]  # ranks 0-1 and 2-3 exchange
        one = r["expected_one_s"]  # 1 MiB at 0.02 GB/s + 2 ms = ~54 ms
        assert r["rebound"] and r["restored"], r
        assert r["async_return_s"] < one / 2, r  # issuing does not wait
        assert r["all_gather_s"] >= one * 0.99, r
        assert r["first_recv_at"] - sender["send_issued_at"] >= one * 0.99, (r, sender)
        # the second send queues behind the first on the sender's egress port
        assert r["second_recv_at"] - sender["send_issued_at"] >= (2 * one - 0.002) * 0.99, (r, sender)
        assert r["recv_ok"], r
        assert r["all_gather_bytes"] == 1 << 20, r  # x shard for R=2
        assert r["blocked_s"] > 0, r


def test_plugin_moves_the_same_bytes_as_stock(pool4):
    for tp in (2, 4):
        for counted in pool4.run(link_rank_fns.mlp_bytes_stock_vs_ours, tp):
            stock_total, stock_ops = counted["stock"]
            ours_total, ours_ops = counted["ours"]
            assert stock_total > 0
            assert ours_total == stock_total, (stock_ops, ours_ops)


def test_every_path_is_delayed_and_counted_once(pool4):
    """DDP's coalesced bucket all-reduces (overlap_grad_reduce on and off), torch's two names of
    a collective, and equal tags in two groups: the link counts exactly the bytes the tensors
    hold, no step ends before its bytes / bandwidth, and groups do not share deadlines."""
    for ogr in (True, False):
        for r in pool4.run(link_rank_fns.link_paths, ogr):
            assert r["buckets"] >= 1 and r["expected_ddp_bytes"] > 0, r
            assert r["all_reduce_bytes"] == r["expected_ddp_bytes"] + 6, r  # + the reported loss (fp32, 2 x 3/4 x 4 B)
            # a step cannot beat its own transfers (before the fix DDP's coalesced all-reduce was not delayed)
            assert r["step_s"] >= r["bytes_s"], r
            assert r["bytes_s"] > 0.1 and r["blocked_s"] > 0, r
            assert r["names"]["all_gather_into_tensor"][1] + r["names"]["all_gather_single"][1] == r["expected_gather_bytes"]
            assert r["names"]["reduce_scatter_tensor"][1] + r["names"]["reduce_scatter_single"][1] == r["expected_scatter_bytes"]
            assert sum(calls for calls, _ in r["names"].values()) == 4, r["names"]  # one count per call, no alias twice
            assert r["large_recv_s"] >= 0.99 * r["large_s"] and r["recv_ok"], r
            # a free communicator carries nothing: no real op (the tensor keeps this rank's
            # values), no wait, every call and byte still counted; another group's op runs
            assert r["free_untouched"] and r["free_s"] < 1.0, r
            assert r["free_counted"] == (4, 2, r["free_expected_bytes"]), r
            peer_value = (r["rank"] ^ 1) + 1
            assert r["other_reduced"] == [float(r["rank"] + 1 + peer_value)] * 4, r
