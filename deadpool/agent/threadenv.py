"""The OpenMP thread count the launcher gives its workers, unless the user chose one: torchrun's rule.

Every worker's torch would otherwise start one OpenMP thread per core for its intra-op work, so
N processes on a host run N x cores threads that compete for the cores (and, where ranks share
cores, with the heartbeat threads that keep a member alive).  torchrun sets ``OMP_NUM_THREADS=1``
when it starts more than one process per host and the variable is not set, and says so; so does
``deadpool launch``, counting the spares, which are processes of the host too.  A pure function
of the launcher's environment and its process count.
"""

from __future__ import annotations

from collections.abc import Mapping

OMP_VARIABLE = "OMP_NUM_THREADS"


def omp_threads_env(environ: Mapping[str, str], processes: int) -> tuple[dict[str, str], str]:
    """``OMP_NUM_THREADS=1`` for the workers when `processes` (actives and spares of this host) is more than one and
    `environ` does not set it; returns (what to add to the workers' environment, the notice to print, "" for none)."""
    if processes <= 1 or OMP_VARIABLE in environ:
        return {}, ""
    return {OMP_VARIABLE: "1"}, (
        f"setting {OMP_VARIABLE}=1 for each of the {processes} worker processes of this host (as torchrun does "
        f"when it starts more than one), to avoid overloading the system; set {OMP_VARIABLE} yourself to tune it "
        "for your application")
