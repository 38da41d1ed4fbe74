"""The glibc malloc settings the launcher gives its workers, unless the user chose their own.

Two concerns, each a pure function of the environment the launcher was started with:
a heap that stays at its peak between steps (``steady_heap_env``), and transparent huge
pages for the heap (``huge_pages_env``), which make a killed worker's memory quick to free.
"""

from __future__ import annotations

# A training step allocates and frees the same activations every step, and by default glibc gives the top of
# the heap back to the kernel whenever more than twice its (dynamic) mmap threshold is free there, so the next
# step faults the same pages in again, zeroed.  Measured on the demo (2-core host): 600-6,000 page faults in a
# worker's forward and backward on 7 of 12 sampled steps; none with these settings, and none under torch DDP
# without them (most likely because DDP frees its initial 13 MB gradient bucket when it re-buckets after the
# first step, which raises glibc's dynamic threshold past the activations).  The heap then stays at its peak,
# as PyTorch's CUDA caching allocator keeps GPU memory.  Allocations over 32 MB (the most glibc allows here)
# are still mapped one by one.  Set either variable yourself to keep glibc's behaviour or your own values;
# allocators loaded with LD_PRELOAD (jemalloc, tcmalloc) ignore them.
STEADY_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}

# A killed process is gone (its pidfd readable, its sockets closed) only once the kernel has freed its memory,
# and it does that on the dying process's own CPU time, shared with the survivors.  A demo worker holds about
# 400 MB of private pages; in 4 KiB pages the kernel took 0.11-0.16 s to free them with 4 busy workers on 2
# cores (the whole of DeadPool's failure detection then), 0.04-0.05 s when glibc asks for transparent huge
# pages for its heap and its large mappings (``hugetlb=1``, glibc 2.35 and later; older ones ignore it, and
# so does a kernel whose THP mode is ``never``).  Bits computed are the same either way.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"


def steady_heap_env(environ: dict[str, str]) -> dict[str, str]:
    """`STEADY_HEAP_ENV`, unless `environ` already sets either variable (the user's choice wins)."""
    return {} if any(name in environ for name in STEADY_HEAP_ENV) else dict(STEADY_HEAP_ENV)


def huge_pages_env(environ: dict[str, str]) -> dict[str, str]:
    """``GLIBC_TUNABLES`` with ``glibc.malloc.hugetlb=1`` added, unless `environ` already sets that tunable."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(item.split("=", 1)[0] == HUGE_PAGES_TUNABLE for item in tunables.split(":")):
        return {}
    return {"GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{HUGE_PAGES_TUNABLE}=1")))}


def worker_heap_env(environ: dict[str, str]) -> dict[str, str]:
    """Every malloc setting a worker gets on top of `environ`."""
    return {**steady_heap_env(environ), **huge_pages_env(environ)}
