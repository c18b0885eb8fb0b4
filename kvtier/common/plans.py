"""What crosses between the scheduler side and the worker side. Torch-free.

The scheduler plans jobs (which device blocks, which host slots, which keys) and
the worker carries them out and reports each job once per rank. Only these small
dataclasses cross; no tensor, no tier object.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadJob:
    """Fill device blocks from the tiers. ``ready_*`` blocks are already in host
    slots; ``fill_*`` blocks are first read into their reserved host slots from
    the tier ``fill_from[i]`` names (a ``TierSpec.name``); ``missing_block_ids``
    could not be found and fail at once."""

    job_id: int
    req_id: str
    ready_block_ids: list[int]
    ready_slot_ids: list[int]
    ready_keys: list[bytes]
    fill_block_ids: list[int]
    fill_slot_ids: list[int]
    fill_keys: list[bytes]
    fill_from: list[str] = field(default_factory=list)
    missing_block_ids: list[int] = field(default_factory=list)
    # Host slots only, copied within the engine's step before attention reads them (vLLM's synchronous
    # load): no step goes by between the hit and its forward. Layer by layer where ``layerwise`` is set.
    in_step: bool = False
    fill_locations: list[int] = field(default_factory=list)  # where the tier keeps each fill (-1: its store finds it)
    # False: a wave of a load larger than the host pool's free slots; the request's load ends with a later job
    final: bool = True

    def __post_init__(self):
        if not (len(self.ready_block_ids) == len(self.ready_slot_ids) == len(self.ready_keys)
                and len(self.fill_block_ids) == len(self.fill_slot_ids) == len(self.fill_keys)
                == len(self.fill_from)):
            raise ValueError(f"load job {self.job_id}: block, slot and key lists differ in length")

    @property
    def num_blocks(self) -> int:
        return len(self.ready_block_ids) + len(self.fill_block_ids) + len(self.missing_block_ids)


@dataclass(frozen=True)
class StoreJob:
    """Copy device blocks into reserved host slots, then write them through: ``writes``
    maps a tier's name to the keys (a subset of ``keys``) to write to it."""

    job_id: int
    req_id: str
    block_ids: list[int]
    slot_ids: list[int]
    keys: list[bytes]
    writes: dict[str, list[bytes]] = field(default_factory=dict)
    write_locations: dict[str, list[int]] = field(default_factory=dict)  # per tier, where each key goes

    def __post_init__(self):
        if not len(self.block_ids) == len(self.slot_ids) == len(self.keys):
            raise ValueError(f"store job {self.job_id}: block, slot and key lists differ in length")
        known = set(self.keys)
        if any(key not in known for keys in self.writes.values() for key in keys):
            raise ValueError(f"store job {self.job_id}: a write names a key the job does not store")

    def slots_of(self, keys: list[bytes]) -> list[int]:
        slot_of = dict(zip(self.keys, self.slot_ids))
        return [slot_of[key] for key in keys]


@dataclass
class JobReport:
    """One rank's outcome of one job."""

    job_id: int
    is_load: bool
    success: bool  # every block of the job moved
    failed_block_ids: list[int] = field(default_factory=list)  # loads: blocks to recompute
    bad_keys: list[bytes] = field(default_factory=list)  # entries found corrupt, truncated or foreign
    gone_keys: list[bytes] = field(default_factory=list)  # entries no longer there: evicted or expired since the lookup
    failed_writes: dict[str, list[bytes]] = field(default_factory=dict)  # stores: tier name -> keys not written
    full_tiers: list[str] = field(default_factory=list)  # stores: tiers whose filesystem had no room for a write
    deleted: dict[str, list[bytes]] = field(default_factory=dict)  # stores: tier name -> entries its store deleted (bound)
    # Loads abandoned after load_timeout_s: slots a read may still write into. They stay
    # reserved until the worker reports them released (``released_slot_ids``).
    held_slot_ids: list[int] = field(default_factory=list)
    num_bytes: int = 0
    seconds: float = 0.0
    # Loads: when this rank began the job, when its last tier read was answered and when its last
    # copy to the device ended (``time.monotonic()``: one clock for every process of the host), for
    # the scheduler's account of where a hit's time goes (``kvtier.scheduler.hit_times``). 0: unknown.
    began_at: float = 0.0
    filled_at: float = 0.0
    finished_at: float = 0.0
