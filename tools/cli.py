"""The ``deadpool`` command: launch, coordinator, status, chaos, move, drain, events, simulate."""

from __future__ import annotations

import argparse
import sys

from deadpool.errors import DeadPoolError, MisuseError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deadpool", description="Hot-swap failed ranks in PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True)

    from deadpool.agent import arguments, launch

    launch_parser = commands.add_parser("launch", help="start the coordinator and this host's workers")
    arguments.add_arguments(launch_parser)

    coordinator_parser = commands.add_parser("coordinator", help="run the membership service on its own")
    coordinator_parser.add_argument("rest", nargs=argparse.REMAINDER)

    from . import chaos, move, status

    status_parser = commands.add_parser("status", help="the live view: seats, members, steps, snapshots, spares")
    status.add_status_arguments(status_parser)
    chaos_parser = commands.add_parser("chaos", help="kill, stop or continue a member of a live job")
    chaos.add_chaos_arguments(chaos_parser)

    move_parser = commands.add_parser("move", help="hand a live seat to a spare at its next step boundary")
    move.add_move_arguments(move_parser)
    drain_parser = commands.add_parser("drain", help="move every seat of a host to spares on other hosts")
    move.add_drain_arguments(drain_parser)

    events_parser = commands.add_parser("events", help="timeline of failures, swaps and loss")
    events_parser.add_argument("file")
    events_parser.add_argument("--plot", default="", metavar="OUT.png", help="draw the loss curve with failures")

    simulate_parser = commands.add_parser("simulate", help="deterministic simulation of a large job (virtual clock)")
    simulate_parser.add_argument("--members", type=int, default=1024, help="simulated members (seats + 5%% spares)")
    simulate_parser.add_argument("--failures", type=int, default=4, help="members that die, at seeded random times")
    simulate_parser.add_argument("--seed", type=int, default=0, help="seed of the member ids and failure schedule")
    simulate_parser.add_argument("--heartbeat-interval", type=float, default=0.0,
                                 help="virtual seconds (0: 0.1, grown with the job: see simulate.scaled)")
    simulate_parser.add_argument("--duration", type=float, default=10.0,
                                 help="virtual seconds in which failures fall (the run goes on until they resolve)")
    simulate_parser.add_argument("--aggregate", action=argparse.BooleanOptionalAction, default=None,
                                 help="host agents batch their members' heartbeats, one message per host "
                                      "(default: from 4,096 members)")
    simulate_parser.add_argument("--max-frame-bytes", type=int, default=0,
                                 help="members' control-frame limit (0: the real one, 1 MiB)")
    simulate_parser.add_argument("--json", action="store_true", help="print one JSON object")

    args = parser.parse_args(argv)
    try:
        if args.command == "launch":
            return launch.run(args)
        if args.command == "coordinator":
            from deadpool.coordinator import main as coordinator

            return coordinator.main(args.rest)
        if args.command == "status":
            return status.run_status(args)
        if args.command == "chaos":
            return chaos.run_chaos(args)
        if args.command == "move":
            return move.run_move(args)
        if args.command == "drain":
            return move.run_drain(args)
        if args.command == "simulate":
            import dataclasses
            import json

            from . import simulate

            config = simulate.scaled(args.members, args.failures, args.seed, args.duration, args.aggregate,
                                     args.heartbeat_interval)
            if args.max_frame_bytes:
                config = dataclasses.replace(config, max_frame_bytes=args.max_frame_bytes)
            result = simulate.simulate(config)
            print(json.dumps(result) if args.json else simulate.format_table(result))
            return 1 if result["invariant_violations"] else 0
        if args.command == "events":
            from deadpool.events.schema import SchemaError
            from deadpool.events.summary import load

            from .events import text

            try:
                events = load(args.file)
            except OSError as err:
                raise MisuseError(f"cannot read the events file {args.file}: {err.strerror or err}") from err
            except SchemaError as err:
                raise MisuseError(f"{err}; this version of deadpool reads events files as its own processes write "
                                  "them: read the file with the version that wrote it") from err
            if not events:
                raise MisuseError(f"{args.file} holds no events (deadpool launch --events FILE writes them)")
            print(text.format_timeline(events))
            if args.plot:
                from .events import plot

                plot.plot(events, args.plot)
                print(f"plot written to {args.plot}")
            return 0
    except MisuseError as err:
        print(f"deadpool {args.command}: {err}", file=sys.stderr)
        return 2
    except DeadPoolError as err:
        print(f"deadpool {args.command}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
