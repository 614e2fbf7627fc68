"""The `tf-dlt` command: `tf-dlt server ...` runs a shard server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tf-dlt", description="tf_dlt command line")
    commands = parser.add_subparsers(dest="command", required=True)
    from tf_dlt.server import main as server_main

    server_main.build_parser(
        commands.add_parser("server", help="serve one shard of the distributed tables")
    )
    args = parser.parse_args(argv)
    if args.command == "server":
        return server_main.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
