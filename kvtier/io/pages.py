"""The host pool's mapping, which the worker and its I/O process both make, and the page size
under it. Torch-free.

Copies into and out of the pool (the store clients', the disk's, the device copies') miss
the TLB far less on 2 MiB pages than on 4 KiB ones: on 4 KiB pages a kvtier get from
Mooncake falls behind the raw client's into a numpy array (which the kernel places on
huge pages), and on huge pages it keeps up (``kvtier bench pool``).
Shared memory gets huge pages on its first touch only where
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows them; under the kernel's
default, ``never``, it does not. ``MADV_COLLAPSE`` (Linux 6.1) makes them
whatever that setting is (it is ignored for an explicit request, unless ``deny``): the
worker asks for it once, while the pool is new and still all zeros. Each process maps the
pool at an address that is a multiple of 2 MiB, as a huge page can be mapped only there;
the I/O process, mapping pages that are huge already, then maps each with one entry.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref

HUGE_PAGE = 2 << 20

_PROT_NONE, _PROT_READ_WRITE = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED, _MAP_NORESERVE, _MAP_POPULATE = 0x10, 0x4000, 0x8000  # Linux's values
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux 6.1
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _mmap(address: int | None, num_bytes: int, prot: int, flags: int, fd: int) -> int:
    result = _libc.mmap(address, num_bytes, prot, flags, fd, 0)
    if result in (None, _MAP_FAILED):
        code = ctypes.get_errno()
        raise OSError(code, f"mmap of {num_bytes} bytes: {os.strerror(code)}")
    return result


def _advise(address: int, num_bytes: int, advice: int) -> int:
    """0, or the errno of a refusal (an advice the kernel does not know, memory it could not get)."""
    return 0 if _libc.madvise(address, num_bytes, advice) == 0 else ctypes.get_errno()


def map_shared(fd: int, num_bytes: int) -> ctypes.Array:
    """``num_bytes`` of memory file ``fd``, mapped shared, readable and writable, at a multiple of
    2 MiB, as a writable buffer; unmapped once it and every view of it (numpy, torch) are gone."""
    if num_bytes <= 0:
        raise ValueError("an empty host pool cannot be mapped")
    length = _round_up(num_bytes, mmap.PAGESIZE)
    # Reserve room for an aligned start, then map the file over the reservation's aligned part
    # (MAP_FIXED replaces it in one step) and give back the rest on both sides.
    reserved = _mmap(None, length + HUGE_PAGE, _PROT_NONE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1)
    start = _round_up(reserved, HUGE_PAGE)
    try:
        _mmap(start, length, _PROT_READ_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd)
    except OSError:
        _libc.munmap(reserved, length + HUGE_PAGE)
        raise
    if start > reserved:
        _libc.munmap(reserved, start - reserved)
    _libc.munmap(start + length, reserved + HUGE_PAGE - start)  # at least a page: start < reserved + 2 MiB
    buffer = (ctypes.c_char * num_bytes).from_address(start)
    # Unmapped with the last view, as an mmap object is, and never at interpreter exit, when threads
    # that copy into the pool may still run.
    weakref.finalize(buffer, _libc.munmap, start, length).atexit = False
    return buffer


def make_huge(buffer: ctypes.Array) -> int:
    """Put the new pool ``buffer`` (all zeros, as a memory file's fresh pages are) on huge pages
    where the kernel can: bytes now on them. Call once, before anything is written to it."""
    address, num_bytes = ctypes.addressof(buffer), ctypes.sizeof(buffer)
    _advise(address, num_bytes, _MADV_HUGEPAGE)  # where shmem_enabled is advise: the next faults too
    huge = (num_bytes // HUGE_PAGE) * HUGE_PAGE  # the whole huge pages in the pool (it starts at one)
    if not huge:
        return 0
    # A collapse makes a huge page only where some small page is already there: one zero byte per
    # huge page (which a fresh page already holds) is enough, and costs no copy of 4 KiB pages.
    for offset in range(0, huge, HUGE_PAGE):
        ctypes.memset(address + offset, 0, 1)
    if _advise(address, huge, _MADV_COLLAPSE) in (errno.EINVAL, errno.ENOSYS):
        return 0  # a kernel before 6.1, or shmem_enabled=deny: 4 KiB pages, as before
    return huge_bytes(buffer)  # a collapse that could not get every huge page leaves the rest small


def map_for_writing(fd: int, num_bytes: int) -> ctypes.Array:
    """The pool as the I/O process maps it (``map_shared``), every page mapped writable now, so that
    a store read writes into the pool at the speed of memory. A page of a shared mapping is
    otherwise mapped on its first touch, and mapped read-only where that touch is a read (as
    MAP_POPULATE's are): its first write faults again. Either fault costs a fresh process one
    per 4 KiB of each slot it first loads into, on the way of a request's first load."""
    buffer = map_shared(fd, num_bytes)
    address, length = ctypes.addressof(buffer), _round_up(num_bytes, mmap.PAGESIZE)
    _advise(address, length, _MADV_HUGEPAGE)
    if _advise(address, length, _MADV_POPULATE_WRITE):  # writes nothing: maps the worker's pages
        # An older kernel: at least every page mapped, read-only (the same file over the same range).
        _mmap(address, length, _PROT_READ_WRITE, mmap.MAP_SHARED | _MAP_FIXED | _MAP_POPULATE, fd)
    return buffer


def huge_bytes(buffer: ctypes.Array) -> int:
    """Bytes of ``buffer``'s mapping that this process maps on huge pages (``ShmemPmdMapped``)."""
    address = ctypes.addressof(buffer)
    try:
        with open("/proc/self/smaps") as smaps:
            inside = False
            for line in smaps:
                name, _, value = line.partition(":")
                if " " in name:  # a mapping's address line
                    low, high = (int(end, 16) for end in line.split()[0].split("-"))
                    inside = low <= address < high
                elif inside and name == "ShmemPmdMapped":
                    return int(value.split()[0]) * 1024
    except OSError:
        pass
    return 0
