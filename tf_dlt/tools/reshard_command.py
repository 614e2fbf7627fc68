"""`tf-dlt reshard --pservers a,b --to a,b,c`: moves every table of the
shards serving at --pservers (any address of the current layout will do
after a re-shard: the shards tell theirs) to the shards at --to while
training goes on (docs/replication.md). Servers new to the cluster run
`tf-dlt server --join`; a server not in --to leaves it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO

from tf_dlt import errors
from tf_dlt.client import address_list
from tf_dlt.server.main import positive_seconds
from tf_dlt.tools import cluster_args


def _pace(text: str) -> float:
    """A fraction in (0, 1]."""
    try:
        pace = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < pace <= 1:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return pace


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    cluster_args.add_cluster_arguments(parser)
    parser.add_argument(
        "--to", required=True, help="the new layout's shard addresses, comma-separated, in order"
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=600.0,
        help="seconds the re-shard may take up to its switch (streaming included); past them it "
        "aborts, the old layout serving",
    )
    parser.add_argument(
        "--pace", type=_pace, default=None,
        help="the fraction of the time each range stream's copy may keep a core busy, (0, 1]: "
        "below 1 leaves trainers more of the cores while the ranges stream longer (default: "
        "1/16 of each shard host's cores, at most 1)",
    )  # fmt: skip
    return parser


def run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    try:
        to = address_list(args.to)
        with cluster_args.client(args) as client:
            done = client.reshard(to, timeout=args.timeout, pace=args.pace)
            served = client.pservers  # the layout the shards serve: --to, less any left out
    except errors.DltError as e:
        print(f"tf-dlt reshard: {e}", file=sys.stderr)
        return 1
    out.write(json.dumps({"pservers": ",".join(served), **done}) + "\n")
    return 0
