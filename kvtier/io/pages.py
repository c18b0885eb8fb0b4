"""The page size under the host pool, which the worker and its I/O process both map. Torch-free."""

from __future__ import annotations

import mmap


def ask_for_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for 2 MiB pages under the host pool. Shared memory gets them only where the machine's
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is ``advise`` (or ``within_size``,
    ``always``); under its default, ``never``, this asks in vain and the pages stay 4 KiB. Huge
    pages spare each copy into or out of the pool most of its TLB misses: a Mooncake get of
    16 x 1 MiB into 4 KiB-paged shared memory took 0.5 to 1 ms longer than into a private array
    (which numpy places on huge pages), and none longer once the shared memory had them."""
    try:
        mapping.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
    except (OSError, ValueError):  # a kernel without transparent huge pages: 4 KiB pages, as before
        pass
