"""The arguments of ``deadpool launch``: torchrun's (``--nproc-per-node``, ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port``) and DeadPool's own."""

from __future__ import annotations

import argparse

from deadpool.agent import verdict
from deadpool.config import Backend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun-style arguments, plus DeadPool's."""
    parser.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1,
                        help="active workers on this host")
    parser.add_argument("--spares", type=int, default=0, help="spare workers on this host")
    parser.add_argument("--nnodes", type=int, default=1, help="number of hosts (one launch per host)")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                        help="this host's index, 0..nnodes-1 (host 0 runs the coordinator)")
    parser.add_argument("--coordinator", default="", help="coordinator address tcp://HOST:PORT (hosts other than 0)")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default="",
                        help="address to bind and advertise the coordinator and store on (host 0)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=0,
                        help="TCPStore port on host 0 (0: pick a free one)")
    parser.add_argument("--coordinator-port", type=int, default=0,
                        help="coordinator control port on host 0 (0: pick a free one); fix it so that the other "
                             "hosts can be given --coordinator tcp://HOST:PORT before host 0 starts")
    parser.add_argument("--bind-host", default="",
                        help="address this host's agent and workers listen on (default: --master-addr or 127.0.0.1)")
    parser.add_argument("--events", default="", help="append JSON-lines events here (default: a temp file)")
    parser.add_argument("--chaos", action="append", default=[], metavar="SPEC",
                        help="inject a failure, e.g. kill:rank=2:step=20 (repeatable)")
    parser.add_argument("--failure-timeout", type=float, default=None, help="seconds of silence before death")
    parser.add_argument("--heartbeat-interval", type=float, default=None, help="seconds between heartbeats")
    parser.add_argument("--snapshot-every", type=int, default=None, help="snapshot every N steps (default 1)")
    parser.add_argument("--replica-checks", type=int, default=None, metavar="K",
                        help="silent-data-corruption checks: each step every seat checksums 1/K of the state that "
                             "is the same on every seat (rt.ddp's parameters and optimizer state), all of it every "
                             "K steps, and a seat that disagrees with the others is replaced (default 2; 0: off)")
    parser.add_argument("--audit", action="store_true",
                        help="an idle spare re-does one seat's step after another (rt.ddp and ZeRO) and compares "
                             "the local gradients with the seat's own; a seat that differs is replaced (needs a "
                             "spare)")
    parser.add_argument("--checkpoint-dir", default="", help="disk checkpoints here (fallback when a seat and its "
                        "buddy die together); a shared filesystem across hosts")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="write a disk checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="start from the newest disk checkpoint under "
                        "--checkpoint-dir that every seat sees (relaunching a job that failed), not from step 0")
    parser.add_argument("--shm-dir", default=None, metavar="DIR",
                        help="snapshot slots are files in this shared-memory directory, so a buddy on the same host "
                             "maps them instead of receiving them over TCP (default: /dev/shm; \"\" turns it off)")
    parser.add_argument("--no-fence-kill", action="store_true",
                        help="do not kill members declared dead (testing zombies)")
    parser.add_argument("--standby-coordinator", action="store_true",
                        help="this host runs the standby coordinator (default: host 1 of a job of 3 hosts or more)")
    parser.add_argument("--no-standby", action="store_true",
                        help="no standby coordinator: losing host 0 then ends the job (give it to host 1's launch)")
    parser.add_argument("--host-name", default="", help="failure-domain name of this host (default: hostname)")
    parser.add_argument("--metrics-port", type=int, default=-1,
                        help="the coordinator serves Prometheus metrics on 127.0.0.1:PORT (0: any free port)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line (steps, tokens/s, spares)")
    parser.add_argument("--backend", choices=tuple(Backend), default=Backend.AUTO,
                        help="what carries CUDA tensors: nccl, gloo, or auto (NCCL where the workers have CUDA and "
                             "NCCL); CPU tensors always go to gloo")
    parser.add_argument("--strict", action="store_true",
                        help=f"exit {verdict.NOT_GUARANTEED_STATUS} instead of 0 when training finished but its final "
                             "state is not guaranteed to be a failure-free run's (a restore left a data loader no "
                             "snapshot holds where it was)")
    parser.add_argument("--check-determinism", action="store_true",
                        help="run the script failure-free twice and once with a kill (--chaos, or rank 1 killed "
                             "half-way through --steps), and report the first tracked object or RNG that differs")
    parser.add_argument("--replace-slow", action="store_true",
                        help="move a seat that stays slow (see --slow-threshold) to a spare when the slowness over "
                             "the steps left costs more than a move (a seat_slow event is written either way)")
    parser.add_argument("--slow-threshold", type=float, default=None,
                        help="a seat computing this many times the job's median per step is slow (default 1.5)")
    parser.add_argument("--slow-steps", type=int, default=None,
                        help="steps a seat stays slow before seat_slow (and --replace-slow) (default 5)")
    parser.add_argument("--slow-reserve", type=int, default=None,
                        help="spares a move for slowness leaves free for failures (default 1)")
    parser.add_argument("--drain-timeout", type=float, default=25.0,
                        help="SIGTERM to this host's launcher alone (a preemption notice) moves its seats to spares "
                             "on other hosts within this many seconds, then exits 0; without spares enough, or past "
                             "it, this host's workers stop as on SIGTERM to every host")
    parser.add_argument("--start-method", choices=("fork", "exec"), default="fork",
                        help="fork: this host imports torch once, in a fork server, and forks every worker from it "
                             "(a worker starts in a fraction of a second); exec: every worker is a fresh "
                             "interpreter (for a script that must set up the environment before torch loads)")
    parser.add_argument("script", help="training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
