"""The decode side's wait for a producer's blocks (``handoffs``) and what it shows on /metrics."""

import time

from kvtier.scheduler.hit_times import HitTimes
from kvtier.scheduler.handoffs import ASK_EVERY_S, HandOffs
from kvtier.integrations.vllm.metrics import KVTierStats, StatsTracker
from tests.test_manager import manager


def test_a_request_waits_until_its_blocks_arrive_or_the_bound_and_is_counted_as_it_goes():
    handoffs = HandOffs(timeout_s=0.3)
    # The lookup that found too few has just asked the tiers: not again yet.
    assert handoffs.wait("a", 0) == (True, False) and handoffs.wait("b", 0) == (True, False)
    assert handoffs.num_waiting == 2 and handoffs.waited_this_step() and not handoffs.waited_this_step()
    time.sleep(ASK_EVERY_S)
    assert handoffs.wait("a", 0) == (True, True)
    handoffs.arrived("a")  # its lookup found every handed token
    assert handoffs.num_waiting == 1 and handoffs.num_timeouts == 0
    time.sleep(0.3)
    assert handoffs.wait("b", 0) == (False, False)  # past the bound: it computes the rest
    assert handoffs.num_waiting == 0 and handoffs.num_timeouts == 1
    assert handoffs.wait("b", 0) == (False, False) and handoffs.num_timeouts == 1  # counted once, waits no more
    handoffs.forget("b")
    assert handoffs.wait("b", 0) == (True, False) and handoffs.num_waiting == 1  # a new request of that id waits afresh


def test_a_request_waits_while_its_blocks_keep_arriving_and_stops_once_they_stall(monkeypatch):
    import types

    from kvtier.scheduler import handoffs as module

    clock = [100.0]
    monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    handoffs = HandOffs(timeout_s=30, stall_s=2.0)
    assert handoffs.wait("a", 0) == (True, False) and handoffs.wait("b", 64) == (True, False)
    for found in (32, 64, 96):  # a block of a's arrives every 1.5 s: its stall clock starts again each time
        clock[0] += 1.5
        assert handoffs.wait("a", found) == (True, True)
    assert handoffs.wait("b", 64) == (False, False)  # 4.5 s and nothing new: b's producer stalled
    assert handoffs.num_stalls == 1 and handoffs.num_timeouts == 0 and handoffs.num_waiting == 1
    clock[0] += 1.5
    assert handoffs.wait("a", 64)[0]  # fewer found than before (an entry evicted meanwhile) is no progress
    clock[0] += 0.5
    assert handoffs.wait("a", 96) == (False, False) and handoffs.num_stalls == 2
    assert handoffs.wait("a", 128) == (False, False) and handoffs.num_stalls == 2  # counted once, waits no more
    slow = HandOffs(timeout_s=5, stall_s=2.0)
    slow.wait("c", 0)
    for found in range(1, 5):  # blocks keep coming, but not all of them within the bound
        clock[0] += 1.5
        assert slow.wait("c", found)[0] == (found < 4)
    assert slow.num_timeouts == 1 and slow.num_stalls == 0


def test_a_request_whose_blocks_cannot_come_waits_no_more_and_is_counted_once():
    handoffs = HandOffs(timeout_s=30)
    assert handoffs.wait("a", 0) == (True, False)
    assert handoffs.cut_short("a") == (False, False)  # the storage pool went down meanwhile
    assert handoffs.num_waiting == 0 and handoffs.num_cut_short == 1 and handoffs.num_timeouts == 0
    assert handoffs.wait("a", 0) == (False, False)  # it waits no more, even if the pool is back
    assert handoffs.cut_short("a") == (False, False) and handoffs.num_cut_short == 1
    handoffs.forget("a")
    assert handoffs.wait("a", 0) == (True, False)


def test_waiting_requests_reach_the_stats_even_when_no_counter_moved(tmp_path):
    mgr = manager(str(tmp_path), host_slots=4, disk_entries=8)
    tracker, handoffs = StatsTracker(), HandOffs(timeout_s=0.2)
    first = tracker.collect(mgr, {}, 0, handoffs, HitTimes())
    assert first is not None and first.data["handoff_waiting_requests"] == 0  # the first gauges
    assert tracker.collect(mgr, {}, 0, handoffs, HitTimes()) is None  # nothing changed
    handoffs.wait("r", 0)
    waiting = tracker.collect(mgr, {}, 0, handoffs, HitTimes())
    assert waiting is not None and not waiting.is_empty() and waiting.data["handoff_waiting_requests"] == 1
    time.sleep(0.2)
    handoffs.wait("r", 0)
    timed_out = tracker.collect(mgr, {}, 0, handoffs, HitTimes())
    assert timed_out.data["handoff_waiting_requests"] == 0 and timed_out.data["handoff_timeouts"] == 1
    assert tracker.collect(mgr, {}, 0, handoffs, HitTimes()) is None
    assert KVTierStats(data={}).is_empty()
    mgr.close()


def test_a_lookup_waits_only_for_handed_tokens_that_can_still_come():
    handoffs = HandOffs(timeout_s=10.0, stall_s=5.0)
    assert handoffs.check("a", 64, 64, lambda req_id: True) == (False, False)  # all there
    assert handoffs.check("a", 32, 64, lambda req_id: True) == (True, False) and handoffs.num_waiting == 1
    assert handoffs.check("a", 64, 64, lambda req_id: True) == (False, False) and handoffs.num_waiting == 0
    assert handoffs.check("b", 0, 64, lambda req_id: False) == (False, False)  # the pool is down: no wait
    assert handoffs.num_cut_short == 1
