"""The connector's scheduler half: vLLM requests in, kvtier jobs out.

This runs in vLLM's scheduler process and holds no tensor. It keys each
request's blocks (``requests``), asks the ``TierManager`` for hits, plans loads
into the blocks vLLM allocated and stores of the blocks each step computes
(``store_plans``), and tells vLLM when a finished request's blocks may be freed.
"""

from __future__ import annotations

import logging

from vllm.v1.request import RequestStatus

from kvtier.common.config import KVTierConfig
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata, check_handshakes
from kvtier.integrations.vllm.metrics import StatsTracker
from kvtier.integrations.vllm.misses import count_misses
from kvtier.integrations.vllm.namespace import EngineGeometry
from kvtier.integrations.vllm.requests import extra_keys, follow_blocks, loads_nothing, unsupported
from kvtier.scheduler.handoffs import IDLE_WAIT_S as HANDOFF_IDLE_WAIT_S
from kvtier.scheduler.handoffs import PARAM, HandOffs, handed_tokens
from kvtier.scheduler.hit_times import HitTimes
from kvtier.scheduler.hits import LoadHits
from kvtier.scheduler.manager import TierManager
from kvtier.scheduler.requests import Requests
from kvtier.scheduler.store_plans import StorePlans

logger = logging.getLogger("kvtier.vllm")


class SchedulerSide:
    def __init__(self, config: KVTierConfig, geometry: EngineGeometry, kv_role: str = "kv_both",
                 kv_events: bool = False):
        # Prefill/decode: the producer stores every prompt block, the partial one included;
        # the consumer only loads (the partial block too) and stores nothing.
        self.stores_enabled = kv_role != "kv_consumer"
        self.is_producer = kv_role == "kv_producer"
        # Requests waiting for a producer's stores.
        self.handoffs = HandOffs(config.load_timeout_s, config.handoff_stall_s)
        self.partial_blocks = config.store_partial_block or kv_role in ("kv_producer", "kv_consumer")
        self.handed_block_size = None if self.partial_blocks else geometry.block_size  # ``handed_tokens``
        self.config = config
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.fingerprint = geometry.namespace.fingerprint()
        # Built when every rank has announced its layout (vLLM's start-up handshake).
        self.manager: TierManager | None = None
        self.requests = Requests(self.fingerprint, self.block_size, extra_keys)  # each request's keys and device blocks
        self._lookups: dict[str, int] = {}  # req_id -> num_computed_tokens of its last lookup
        self._in_step_loads: set[str] = set()  # requests whose hit is copied within the step of its forward
        if not geometry.extends_loaded_kv:
            logger.warning("kvtier: this engine's attention (vLLM's CPU MLA) computes no prompt over KV loaded for its "
                           "start, so kvtier loads nothing here: it stores, and counts the prompt tokens it looks up "
                           "under the miss reason engine_cannot_load")
        self._new_loads = []
        self._send_waits: dict[str, list[int]] = {}
        self._preempted_store_job_ids: list[int] = []
        self._reports_taken: dict[int, int] = {}  # rank -> its last report's number taken (``RankReport``)
        self.stores: StorePlans | None = None  # which blocks are stored when; built with the manager
        self.hits = LoadHits()  # prompt tokens loaded, by tier: counted as loads complete
        self.times = HitTimes()  # where each hit's time to first token goes
        self.miss_tokens = 0
        self._stats = StatsTracker()
        self.kv_events = kv_events  # vLLM publishes KV events: kvtier's tiers are announced too
        self._events = None  # KVEvents, built with the manager

    def on_handshake(self, metadata: dict) -> None:
        """Every worker's ``KVTierHandshake``, keyed by its rank (``namespace.worker_rank``)."""
        fingerprints = check_handshakes(metadata, self.geometry.tp_rank_count, self.geometry.slot_bytes)
        self.manager = TierManager(self.config, self.geometry.slot_bytes, fingerprints, self.geometry.tp_rank_count,
                                   track_holdings=self.kv_events)
        self.manager.ledger.block_tokens = self.block_size
        self.stores = StorePlans(self.manager, self.requests, self.partial_blocks, self.config.load_timeout_s,
                                 self.geometry.skipped_blocks if self.geometry.sliding_window else None)
        if self.kv_events:
            from kvtier.integrations.vllm.events import KVEvents
            self._events = KVEvents.of(self.manager)
            self.requests.on_keyed = self._events.remember  # vLLM's hashes of new blocks, for any tier's events
        # This instance's namespace recorded beside its entries (for other instances and `kvtier doctor`),
        # and theirs read, to tell a miss of a block they hold from one never stored: off this thread.
        from kvtier.tiers.namespaces import ForeignProbe, record_of
        record = record_of(self.geometry.namespace, fingerprints, self.geometry.slot_bytes)
        self.manager.ledger.probe = ForeignProbe(self.manager.specs, record, self.config.remote_timeout_s)
        logger.info("kvtier: %d host slots, tiers %s, layout %s", self.manager.host.num_slots,
                    [tier.name for tier in self.manager.tiers] or "none", metadata[0].layout)

    @property
    def num_pending_jobs(self) -> int:
        return self.manager.num_pending if self.manager is not None else 0

    # --- vLLM scheduler hooks -------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.manager is None or unsupported(request):
            return 0, False
        if loads_nothing(request, self.geometry):
            self._lookups[request.request_id] = num_computed_tokens  # its misses are counted at allocation
            return 0, False
        state = self.requests.state(request)
        self.times.asked(request.request_id, request.arrival_time)
        num_tokens = request.num_tokens
        keys = self.requests.full_keys(state, num_tokens)
        partial = self.requests.partial_key(state, num_tokens) if self.partial_blocks else None
        start = num_computed_tokens // self.block_size
        wanted = keys[start:] + ([partial] if partial is not None else [])
        # A sliding window's hit needs only the blocks within the window of its next token.
        first_read = self.geometry.first_read(start, len(keys), num_tokens)
        hits = self.manager.lookup(wanted, token=request.request_id, first_read=first_read)
        if hits is None:
            return None, False  # a tier has not answered, or a block or host slot is coming: vLLM asks again
        hit_blocks = start + min(hits, len(keys) - start)
        hit_tokens = num_tokens if partial is not None and hits == len(wanted) else hit_blocks * self.block_size
        # A producer is still storing this prompt: wait, bounded.
        wait, ask_again = self.handoffs.check(request.request_id, hit_tokens,
                                              handed_tokens(request, self.handed_block_size), self.manager.can_arrive)
        if wait:
            if ask_again:
                self.manager.ask_again(request.request_id)
            return None, False
        num_external = hit_tokens - num_computed_tokens
        self._lookups[request.request_id] = num_computed_tokens
        self._in_step_loads.discard(request.request_id)
        # vLLM recomputes a whole-prompt hit's last token: a hit of that token alone would add none,
        # and of a one-token prompt vLLM would look the request up again after each load, for ever.
        if num_external <= 0 or (hit_tokens == num_tokens and num_external == 1):
            self.times.answered(request.request_id, loads=False)
            return 0, False
        self.times.answered(request.request_id, loads=True)
        # vLLM's synchronous load (scheduled now, copied before its forward) leaves it at least one token
        # to compute: a hit of the whole prompt goes the asynchronous way, where vLLM recomputes the last.
        if hit_tokens % self.block_size == 0 and hit_tokens < num_tokens and \
                self.manager.can_load_in_step(keys[start:hit_blocks], request.request_id):
            self._in_step_loads.add(request.request_id)
            return num_external, False
        return num_external, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self.requests.state(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        if request.request_id not in self._lookups:
            return  # the second call, after a load: only the block list changed
        first_token = self._lookups.pop(request.request_id)  # what vLLM's own prefix cache covers
        in_step = request.request_id in self._in_step_loads
        self._in_step_loads.discard(request.request_id)
        hit_tokens = first_token + num_external_tokens  # vLLM may take less than kvtier offered
        self.miss_tokens += count_misses(self.manager, self.requests, self.geometry, request, state, hit_tokens,
                                         handed_tokens(request, self.handed_block_size))
        if num_external_tokens == 0:
            self.times.forget(request.request_id)
            self.manager.drop_lookup(request.request_id)  # it loads nothing: the host slots it counted on are free
            return
        first_block = first_token // self.block_size
        keys = self.requests.full_keys(state, hit_tokens)[first_block:]
        if hit_tokens % self.block_size:
            keys.append(self.requests.partial_key(state, hit_tokens))
        # A sliding window's hit: vLLM gives the blocks before the window its null block, and computes
        # nothing over them. They are not loaded.
        vllm_blocks = blocks.blocks[0]
        at = [first_block + i for i in range(len(keys)) if not getattr(vllm_blocks[first_block + i], "is_null", False)]
        keys, block_ids = [keys[b - first_block] for b in at], [state.block_ids[b] for b in at]
        job = self.manager.plan_load(request.request_id, keys, block_ids, in_step=in_step)
        self._new_loads.append(job)
        state.num_stored_blocks = max(state.num_stored_blocks, hit_tokens // self.block_size)
        state.partial_planned = state.partial_planned or bool(hit_tokens % self.block_size)
        tokens_of = {state.block_ids[b]: min((b + 1) * self.block_size, hit_tokens)
                     - max(b * self.block_size, first_token) for b in at}
        self.hits.planned(job, tokens_of)  # a load larger than the free host slots: its waves follow

    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        self._preempted_store_job_ids += follow_blocks(self.requests, scheduler_output)
        for job in self.manager.waves.due_jobs() if self.manager is not None else ():
            self._new_loads.append(job)
            self.hits.planned(job)
        for job in self._new_loads:
            self.times.sent(job.req_id, job.job_id, job.in_step)
        scheduled = []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            self.times.scheduled(req_id)
            state = self.requests.get(req_id)
            if state is None or self.manager is None or not self.stores_enabled or unsupported(state.request):
                continue
            scheduled.append((state, state.request.num_computed_tokens + num_scheduled))
        store_jobs = self.stores.plan_step(scheduled) if scheduled else []
        finished_store_jobs = self.stores.finish(self._send_waits) if self.manager is not None else []
        idle = scheduler_output.total_num_scheduled_tokens == 0
        waiting = self.handoffs.waited_this_step()  # a request waits for a producer's blocks
        if idle and not waiting and self.manager is not None:  # (waiting: the workers wait for a producer)
            self.manager.wait_for_lookups(self.config.idle_step_wait_s)  # rather than a busy loop: see there
        meta = KVTierMetadata(self._new_loads, store_jobs, self._preempted_store_job_ids, finished_store_jobs,
                              self._send_waits, idle=idle, idle_wait_s=HANDOFF_IDLE_WAIT_S if idle and waiting else 0.0,
                              reports_taken=dict(self._reports_taken))
        self._new_loads, self._preempted_store_job_ids, self._send_waits = [], [], {}
        return meta

    def finishing_meta(self) -> KVTierMetadata:
        """A step that schedules nothing: finished requests' stores as host slots free (``shutdown_drain``)."""
        send_waits, self._send_waits = self._send_waits, {}
        return KVTierMetadata(finished_store_jobs=self.stores.finish(send_waits), send_waits=send_waits, idle=True,
                              reports_taken=dict(self._reports_taken))

    def update_connector_output(self, connector_output) -> None:
        self.on_worker_meta(connector_output.kv_connector_worker_meta)

    def on_worker_meta(self, meta) -> None:
        if not isinstance(meta, KVTierWorkerMetadata) or self.manager is None:
            return
        reports, released = [], []
        for part in meta.parts:
            if part.number <= self._reports_taken.get(part.rank, 0):
                continue  # taken already: a worker sends again at shutdown what no step said was taken
            self._reports_taken[part.rank] = part.number
            reports += part.reports
            released += part.released_slot_ids
        self.manager.on_released(released)
        self.hits.reported(reports)  # before the manager takes them: which blocks failed
        self.times.reported(reports)
        completed = self.manager.on_reports(reports)
        self.hits.completed(completed)
        self.times.completed(completed)
        self.stores.on_completed(completed)
        # vLLM tells a step's output after it appended the step's tokens: one with a token has its first.
        self.times.first_tokens(lambda req_id: (state := self.requests.get(req_id)) is not None
                                and state.request.num_output_tokens > 0)

    def shutdown(self) -> None:
        # vLLM shuts its workers down first, and each ran the last stores at its shutdown (``shutdown_drain``):
        # what is left unstored now did not fit in shutdown_flush_s, or a worker could not reach this process.
        if self.num_finishing:
            logger.warning("kvtier: shutdown: %d blocks of %d finished requests not stored: no host slot freed "
                           "for them before the engine stopped (shutdown_flush_s=%.1f s)",
                           self.stores.num_unstored, self.num_finishing, self.config.shutdown_flush_s)
        if self._events is not None:
            self._events.close()
        if self.manager is not None:
            self.manager.close()

    @property
    def has_pending_work(self) -> bool:
        """Jobs not yet reported, or finished requests' blocks still to store: vLLM keeps stepping."""
        return self.num_pending_jobs > 0 or self.num_finishing > 0

    @property
    def num_finishing(self) -> int:
        return self.stores.num_finishing if self.stores is not None else 0

    def collect_stats(self):
        if self.manager is None:
            return None
        return self._stats.collect(self.manager, self.hits.tokens, self.miss_tokens, self.handoffs, self.times)

    def take_events(self) -> list:
        ready = self._events is not None and self.manager is not None
        return self._events.take(self.manager.ledger, self.block_size) if ready else []

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        # It may end in the step of its first token, before that step's output is told.
        self.times.finished(request.request_id, has_token=request.num_output_tokens > 0)
        state = self.requests.pop(request.request_id)
        self._lookups.pop(request.request_id, None)
        self._in_step_loads.discard(request.request_id)
        self.handoffs.forget(request.request_id)
        if self.manager is not None:
            self.manager.forget(request.request_id)
            self.manager.waves.drop(request.request_id)
        if state is None or self.manager is None or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False, None  # vLLM itself holds a loading request's blocks until the load reports
        if self.stores_enabled and not unsupported(request) and self.stores.keep_finishing(request, state):
            # Blocks the host pool had no free slot for: stored at the next steps, as its slots free;
            # vLLM keeps them until then, and steps while it does (``has_pending_push_work``).
            # A producer's answer says how many prompt tokens it stores: the decode instance waits for them.
            stored = min(request.num_computed_tokens, request.num_prompt_tokens)
            if not self.partial_blocks:
                stored -= stored % self.block_size
            return True, ({PARAM: stored} if self.is_producer else None)
        pending = self.stores.pending(state)
        if not pending:
            return False, None
        # Stores still read this request's blocks: vLLM keeps them until the workers say they are done.
        self._send_waits[request.request_id] = pending
        return True, None
