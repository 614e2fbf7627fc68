"""The `tf-dlt` command: `tf-dlt server ...` runs a shard server; `tf-dlt
launch ... -- cmd` runs shard servers and trainers on this machine; `tf-dlt
stats --pservers ...` prints per-shard statistics; `tf-dlt reshard --pservers
... --to ...` moves the tables to other shards while training runs; `tf-dlt k8s ... -- cmd`
prints Kubernetes manifests; `tf-dlt plan ...` a capacity plan; `tf-dlt checkpoint ls|compact|prune`
works on checkpoint chains; `tf-dlt abort-load` undoes a load a client left
in the middle."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tf-dlt", description="tf_dlt command line")
    commands = parser.add_subparsers(dest="command", required=True)
    from tf_dlt.server import main as server_main
    from tf_dlt.tools import (
        abort_load,
        capacity,
        checkpoints,
        cluster_stats,
        k8s,
        launch,
        reshard_command,
    )

    server_main.build_parser(
        commands.add_parser("server", help="serve one shard of the distributed tables")
    )
    launch.build_parser(
        commands.add_parser(
            "launch",
            help="run shard servers and trainers on this machine",
            description="tf-dlt launch --pservers 2 --workers 2 -- python train.py ...",
        )
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" is the trainer command of `launch`, untouched.
    trainer = argv[argv.index("--") + 1 :] if "--" in argv else []
    cluster_stats.build_parser(
        commands.add_parser("stats", help="print per-shard and per-table statistics")
    )
    reshard_command.build_parser(
        commands.add_parser("reshard", help="move the tables to other shards while training runs")
    )
    k8s.build_parser(
        commands.add_parser("k8s", help="print Kubernetes manifests for a training job")
    )
    capacity.build_parser(
        commands.add_parser("plan", help="shards, memory, network and save time for a table size")
    )
    checkpoints.build_parser(
        commands.add_parser("checkpoint", help="list, compact or prune checkpoint chains")
    )
    abort_load.build_parser(
        commands.add_parser("abort-load", help="undo a load a client left in the middle")
    )
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.trainer_command = trainer
    if args.command == "server":
        return server_main.run(args)
    if args.command == "launch":
        return launch.run(args)
    if args.command == "stats":
        return cluster_stats.run(args)
    if args.command == "reshard":
        return reshard_command.run(args)
    if args.command == "k8s":
        return k8s.run(args)
    if args.command == "plan":
        return capacity.run(args)
    if args.command == "checkpoint":
        return checkpoints.run(args)
    if args.command == "abort-load":
        return abort_load.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
