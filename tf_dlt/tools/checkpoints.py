"""`tf-dlt checkpoint ls|compact|prune`: checkpoint chains from the command
line (tf_dlt.checkpoint.chain)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from tf_dlt import errors
from tf_dlt.checkpoint import chain, manifest


def build_parser(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser(
        "ls", help="the checkpoints of a directory, or the chain a checkpoint loads"
    )
    ls.add_argument("path", help="a checkpoint, or a directory of checkpoints")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    compact = verbs.add_parser("compact", help="write a chain as one full checkpoint")
    compact.add_argument("source", help="the checkpoint (head of its chain) to compact")
    compact.add_argument("target", help="where the full checkpoint goes (a new directory)")
    compact.add_argument(
        "--num-shards", type=int, default=None, help="files to write (default: the source's)"
    )
    prune = verbs.add_parser(
        "prune", help="delete all but the newest N checkpoints of a directory and what they need"
    )
    prune.add_argument("directory")
    prune.add_argument("--keep", type=int, required=True)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(created_unix: object) -> str:
    """A manifest's creation time as UTC, or "?" for one no calendar holds
    (a manifest's number is not checked for it: 1e300 was a traceback)."""
    try:
        when = datetime.datetime.fromtimestamp(float(str(created_unix)), datetime.UTC)
    except (ValueError, OverflowError, OSError):
        return "?"
    return f"{when:%Y-%m-%d %H:%M:%S}"


def _print_links(links: list[dict[str, object]]) -> None:
    print(f"{'kind':6} {'created (UTC)':20} {'shards':>6} {'rows':>12} {'removed':>9} "
          f"{'bytes':>10}  path")  # fmt: skip
    for link in links:
        print(
            f"{link['kind']!s:6} {_when(link['created_unix']):20} {link['num_shards']!s:>6} "
            f"{link['rows']!s:>12} {link['removed']!s:>9} {_size(float(str(link['bytes']))):>10}"
            f"  {link['path']}"
        )


def run(args: argparse.Namespace) -> int:
    try:
        with errors.storage_errors("reading or writing the checkpoints"):
            return _run(args)
    except errors.DltError as e:
        print(f"tf-dlt checkpoint {args.verb}: {e.message}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.verb == "ls":
        # Absolute, as the chain's bases are (a relative head beside them read
        # as if it lay elsewhere).
        args.path = manifest.absolute(args.path)
        refused: list[str] = []
        found = chain.find(args.path, refused=refused)
        itself = next((c for c in found if c.path == args.path), None)
        if itself is not None:  # one checkpoint: the chain it loads
            links = chain.describe(itself.tables)
            if args.json:
                print(json.dumps(links, indent=2))
            else:
                _print_links(links)
                inside = chain.checkpoints_inside(itself)
                if inside:  # (a prune of the directory counts them too)
                    print(f"holds {len(inside)} more: {', '.join(inside)}")
            return 0
        rows = []
        for c in found:
            try:
                links = chain.describe(c.tables)
                loads = sum(int(str(x["bytes"])) for x in links)
                status = f"chain of {len(links)}, loads {_size(loads)}"
            except errors.DltError as e:
                status = f"BROKEN: {e.message}"
            rows.append({"path": c.path, "kind": c.manifest.get("kind", "full"),
                         "save_id": c.manifest["save_id"], "chain": status,
                         "holds": chain.checkpoints_inside(c)})  # fmt: skip
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                print(f"{r['kind']:6} {r['save_id']}  {r['path']}  ({r['chain']})")
                if r["holds"]:  # not listed here: `ls` them where they are
                    print(f"       holds {len(r['holds'])} more: {', '.join(r['holds'])}")
        # What a load would refuse is not listed, but said: an edited or
        # damaged checkpoint beside good ones must not vanish unnoticed.
        for why in refused:
            print(f"tf-dlt checkpoint ls: not listed, a load refuses it: {why}", file=sys.stderr)
        if not rows:
            if not refused:
                print(f"no committed checkpoint in {args.path}", file=sys.stderr)
            return 1
        return 0
    if args.verb == "compact":
        found = chain.find(args.source)
        model = any(c.path == args.source and c.tables != c.path for c in found)
        # A model checkpoint stays one: tables, dense weights and model file.
        m = (chain.compact_model if model else chain.compact)(
            args.source, args.target, args.num_shards
        )
        rows = sum(t["rows"] for t in m["tables"])
        print(f"wrote {args.target}: full checkpoint of {rows} rows in {m['num_shards']} "
              f"file(s), {_size(sum(f['bytes'] for f in m['files']))}")  # fmt: skip
        return 0
    if args.verb == "prune":
        found = chain.find(args.directory)
        found = [c for c in found if c.path != args.directory]
        # Each checkpoint's own layout (a directory may mix model and
        # table checkpoints).
        tables = {c.path: c.tables for c in found}
        if not found:
            print(f"no committed checkpoint in {args.directory}", file=sys.stderr)
            return 1
        problems: list[str] = []
        deleted = chain.retain(
            [c.path for c in found], args.keep, tables=tables, problems=problems,
            save_ids={c.path: str(c.manifest["save_id"]) for c in found},
        )  # fmt: skip
        for path in deleted:
            print(f"deleted {path}")
        print(f"kept {len(found) - len(deleted)} checkpoint(s)")
        for problem in problems:
            print(f"tf-dlt checkpoint prune: {problem}", file=sys.stderr)
        return 1 if problems else 0
    return 2
