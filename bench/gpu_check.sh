#!/usr/bin/env bash
# The NCCL check on a machine with one GPU (about 16 cores), bounded at 9 minutes in all:
#
#     bash bench/gpu_check.sh OUTDIR
#
# writes OUTDIR/gpu_check.log, OUTDIR/gpu_check.json (one entry per part: status, reason, figures) and
# OUTDIR/runs/ (each subprocess's output, each DeadPool run's events).  The parts and their limits are in
# bench/gpu_check.py's docstring; on a machine without a GPU it says so in one line and exits 0 at once.
# PYTHON picks the interpreter (default: python, else python3); extra arguments go to bench/gpu_check.py
# (--nproc 4, --nccl-wheel FILE.whl, --budget SECONDS).
set -u
if [ $# -lt 1 ] || [ -z "$1" ]; then
    echo "usage: bash bench/gpu_check.sh OUTDIR [--nproc 4] [--nccl-wheel FILE.whl]" >&2
    exit 2
fi
outdir=$1
shift
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-$(command -v python || command -v python3)}
mkdir -p "$outdir" || exit 2
# The driver keeps itself under 515 s and rewrites the summary after every part; this outer bound
# (SIGTERM, then SIGKILL 10 s later) only catches a driver that hangs.
timeout -k 10 530 "$python" "$here/gpu_check.py" "$outdir" "$@"
status=$?
if [ $status -eq 124 ] || [ $status -eq 137 ]; then
    echo "gpu_check: stopped at the 9-minute bound (status $status); $outdir/gpu_check.json has the parts it finished" >&2
fi
exit $status
