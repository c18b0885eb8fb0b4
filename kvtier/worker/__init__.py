"""Worker side of kvtier: carries out the scheduler's load and store jobs.

``TierWorker`` (``tier_worker``) owns the host pool's memory, shared with its I/O
process (``kvtier.io``), and the transfer engine; it only moves bytes between the
device and host slots. ``LoadPath`` (``loads``) and ``StorePath`` (``stores``)
carry out the two kinds of job on one shared ``JobBook`` (``jobs``): the job
tables, their lock, and the reports waiting for the engine.
"""

from kvtier.worker.tier_worker import TierWorker, tensor_info

__all__ = ["TierWorker", "tensor_info"]
