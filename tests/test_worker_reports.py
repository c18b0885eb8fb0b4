"""What the workers tell the scheduler side, and what it makes of it: one rank per pipeline stage and
tensor-parallel rank, every stage's blocks of one size, and each numbered report taken once, however
often a worker sends it (``RankReport``: at shutdown it sends again what no step said was taken)."""

import pytest

from kvtier.common.config import KVTierConfig
from kvtier.common.keys import Namespace
from kvtier.common.plans import JobReport
from kvtier.integrations.vllm.metadata import KVTierHandshake, KVTierWorkerMetadata, RankReport
from kvtier.integrations.vllm.namespace import EngineGeometry, worker_rank
from kvtier.integrations.vllm.scheduler_side import SchedulerSide

NAMESPACE = Namespace("test-model", "torch.float32", "kv", (2, 64), 2, 16)
SLOT_BYTES = 2 * 2 * 2 * 64 * 4 * 16


def side(num_ranks: int) -> SchedulerSide:
    """The scheduler side of ``num_ranks`` pipeline stages of one tensor-parallel rank each."""
    config = KVTierConfig.from_sources({"host_bytes": 8 * SLOT_BYTES, "disk_dir": None}, environ={})
    return SchedulerSide(config, EngineGeometry(NAMESPACE, SLOT_BYTES, ["a", "b"], 64, 16, 1, num_ranks))


def handshakes(sizes: list[int]) -> dict[int, KVTierHandshake]:
    return {rank: KVTierHandshake(rank, bytes([rank]) * 16, size, "test") for rank, size in enumerate(sizes)}


def test_each_pipeline_stage_and_tensor_parallel_rank_is_a_rank_of_its_own():
    ranks = [worker_rank(pp, tp, tp_size=2) for pp in range(3) for tp in range(2)]
    assert ranks == list(range(6))


def test_pipeline_stages_that_hold_blocks_of_other_sizes_fail_at_start_up_saying_so():
    scheduler = side(num_ranks=2)
    with pytest.raises(ValueError, match="pipeline stages hold .* bytes per block.*VLLM_PP_LAYER_PARTITION"):
        scheduler.on_handshake(handshakes([SLOT_BYTES, SLOT_BYTES // 2]))
    with pytest.raises(ValueError, match=r"expected a handshake from ranks 0\.\.1"):
        scheduler.on_handshake(handshakes([SLOT_BYTES]))  # one stage's workers missing
    scheduler.on_handshake(handshakes([SLOT_BYTES, SLOT_BYTES]))
    assert scheduler.manager is not None and len(scheduler.manager.rank_fingerprints) == 2


def test_a_report_sent_again_is_taken_once_and_every_step_says_what_was_taken():
    scheduler = side(num_ranks=2)
    scheduler.on_handshake(handshakes([SLOT_BYTES, SLOT_BYTES]))
    taken = []
    take = scheduler.manager.on_reports
    scheduler.manager.on_reports = lambda reports: taken.append([r.job_id for r in reports]) or take(reports)
    first = RankReport(0, 1, [JobReport(7, False, True)])
    scheduler.on_worker_meta(KVTierWorkerMetadata([first]))
    # At shutdown rank 0 sends its first report again beside its second; rank 1 sends its first.
    again = KVTierWorkerMetadata([first, RankReport(0, 2, [JobReport(8, False, True)])])
    scheduler.on_worker_meta(again.aggregate(KVTierWorkerMetadata([RankReport(1, 1, [JobReport(7, False, True)])])))
    assert taken == [[7], [8, 7]]
    assert scheduler.finishing_meta().reports_taken == {0: 2, 1: 1}
