"""`tf-dlt abort-load --pservers a,b LOAD_ID`: undoes a cluster load a client
left in the middle (it died between its phases; `tf-dlt stats` shows it `in
progress` with its id), so that the next load need not wait for it to expire
(`Client.abort_load`, docs/operations.md)."""

from __future__ import annotations

import argparse
import sys
from typing import IO

from tf_dlt import errors
from tf_dlt.tools import cluster_args


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    cluster_args.add_cluster_arguments(parser)
    parser.add_argument("load_id", help="the load's id, as `tf-dlt stats` shows it (in progress)")
    return parser


def run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    try:
        with cluster_args.client(args) as client:
            done = client.abort_load(args.load_id)
    except errors.DltError as e:
        print(f"tf-dlt abort-load: {e}", file=sys.stderr)
        return 1
    for shard, what in enumerate(done):
        out.write(f"shard {shard}: {what}\n")
    if all(what == "-" for what in done):
        print(f"tf-dlt abort-load: no shard was in the middle of load {args.load_id!r}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
