"""Hit tokens count what a load delivered: when every worker has reported it, less its failed blocks."""

from kvtier.common.plans import JobReport, LoadJob
from kvtier.scheduler.hits import LoadHits


def load(job_id, ready, fills, final=True, missing=()):
    """A load job: ``ready`` host blocks, ``fills`` as (block, tier) pairs."""
    return LoadJob(job_id, "r", list(ready), list(ready), [b"h%d" % b for b in ready],
                   [b for b, _ in fills], [b for b, _ in fills], [b"f%d" % b for b, _ in fills],
                   [tier for _, tier in fills], list(missing), final=final)


def test_a_loads_tokens_count_once_every_rank_reported_it_less_its_failed_blocks():
    hits = LoadHits()
    job = load(1, [10, 11], [(12, "disk"), (13, "redis")])
    hits.planned(job, {10: 32, 11: 32, 12: 32, 13: 7})  # the last block partial
    hits.reported([JobReport(1, True, False, failed_block_ids=[13])])  # rank 0
    hits.completed([])
    assert hits.tokens == {}  # planned and half reported: nothing loaded yet
    hits.reported([JobReport(1, True, False, failed_block_ids=[11])])  # rank 1, a step later
    hits.completed([1])
    assert hits.tokens == {"host": 32, "disk": 32}  # a block failed on any rank was recomputed
    assert hits.num_loading == 0


def test_waves_count_with_their_first_plans_tokens_and_a_store_job_counts_nothing():
    hits = LoadHits()
    tokens_of = {1: 16, 2: 32, 3: 32, 4: 32}  # the first block partly in vLLM's own prefix cache
    hits.planned(load(1, [1], [(2, "file")], final=False), tokens_of)
    hits.reported([JobReport(1, True, True), JobReport(9, False, True)])  # 9: a store job
    hits.completed([1, 9])
    hits.planned(load(2, [], [(3, "file")], final=False))
    hits.planned(load(3, [], [], missing=[4]))  # the last wave: failed before, the rest missing
    hits.reported([JobReport(2, True, False, failed_block_ids=[3]), JobReport(3, True, False, failed_block_ids=[4])])
    hits.completed([2, 3])
    assert hits.tokens == {"host": 16, "file": 32}
    assert hits.num_loading == 0 and hits._waves == {}
