"""The ``deadpool`` command: launch, coordinator, status, chaos, events."""

from __future__ import annotations

import argparse
import sys

from deadpool.errors import DeadPoolError, MisuseError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deadpool", description="Hot-swap failed ranks in PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True)

    from deadpool import launch

    launch_parser = commands.add_parser("launch", help="start the coordinator and this host's workers")
    launch.add_arguments(launch_parser)

    coordinator_parser = commands.add_parser("coordinator", help="run the membership service on its own")
    coordinator_parser.add_argument("rest", nargs=argparse.REMAINDER)

    events_parser = commands.add_parser("events", help="timeline of failures, swaps and loss")
    events_parser.add_argument("file")
    events_parser.add_argument("--plot", default="", metavar="OUT.png", help="draw the loss curve with failures")

    args = parser.parse_args(argv)
    try:
        if args.command == "launch":
            return launch.run(args)
        if args.command == "coordinator":
            from deadpool import coordinator

            return coordinator.main(args.rest)
        if args.command == "events":
            from deadpool import timeline

            events = timeline.load(args.file)
            print(timeline.format_timeline(events))
            if args.plot:
                timeline.plot(events, args.plot)
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
