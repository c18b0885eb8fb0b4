"""The optional features that wrap the worker's load and store paths from outside.

Each one subclasses the paths it changes; ``Wrapping`` puts the configured ones around
``LoadPath`` and ``StorePath`` and holds their parts, which the worker polls, rebinds
after the KV cache moves, and closes, without knowing what they are:

- ``verify_loads`` (``kvtier.worker.verify``): every loaded block read back and compared
  with what was stored;
- ``save_only_first_rank`` with a broadcast group (``kvtier.worker.replicated``): rank 0
  stores and reads the tiers for every rank and broadcasts its loads; the blocks of
  every rank are keyed as rank 0's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.worker.loads import LoadPath
from kvtier.worker.stores import StorePath


@dataclass
class Wrapping:
    key_rank: int  # the rank whose namespace this rank's blocks are keyed under
    reads_tiers: bool = True  # False: this rank never reads or writes a tier (another does it for it)
    load_path: type = LoadPath
    store_path: type = StorePath
    _builders: list = field(default_factory=list)  # (attribute on the paths, builder of the part)
    _attach: list = field(default_factory=list)  # (attribute, part), set on both paths once built
    parts: list = field(default_factory=list)  # each: poll(), rebind(tensors), close(timeout_s), counters()

    @classmethod
    def of(cls, config, rank: int, broadcast_group) -> "Wrapping":
        """What the configuration wraps around the paths; its parts are built by ``build_parts``."""
        replicated = config.save_only_first_rank and broadcast_group is not None
        wrapping = cls(key_rank=0 if replicated else rank, reads_tiers=not replicated or rank == 0)
        if replicated:
            from kvtier.worker.replicated import ReplicaStores, ReplicatedLoadPath, ReplicatedLoads
            wrapping.load_path = ReplicatedLoadPath
            wrapping.store_path = StorePath if rank == 0 else ReplicaStores
            wrapping._builders.append(("replicated", lambda layout, tensors, host_slots: ReplicatedLoads(
                layout, tensors, broadcast_group, config.broadcast_shard_blocks, host_slots, rank == 0)))
        if config.verify_loads:  # outermost: it sees what the other wrappers leave in the slots and blocks
            from kvtier.worker.verify import LoadVerifier, VerifiedLoads, VerifiedStores
            wrapping.load_path = type("VerifiedLoadPath", (VerifiedLoads, wrapping.load_path), {})
            wrapping.store_path = type("VerifiedStorePath", (VerifiedStores, wrapping.store_path), {})
            wrapping._builders.append(("verifier", LoadVerifier))
        return wrapping

    def build_parts(self, layout, tensors, host_slots) -> None:
        """The parts, once the KV cache's layout and the host pool are known."""
        for attribute, build in self._builders:
            part = build(layout, tensors, host_slots)
            self._attach.append((attribute, part))
            self.parts.append(part)

    def attach(self, *paths) -> None:
        for path in paths:
            for attribute, part in self._attach:
                setattr(path, attribute, part)

    def counters(self) -> dict[str, int]:
        return {name: value for part in self.parts for name, value in part.counters().items()}
