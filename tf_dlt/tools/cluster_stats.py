"""`tf-dlt stats --pservers host:port,...`: one line per shard (rows, bytes,
traffic, latency, errors, connections), then one per table, then (with a
memory budget) where each shard's rows live, from each shard's Stats call.

    tf-dlt stats --pservers ps-0:7000,ps-1:7000 [--auth-token-file F] [--json]

Standbys serve no trainer, so a client cannot ask them: listed alone, each
one's own Stats are shown.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import IO, Any

import grpc

from tf_dlt import _native, errors
from tf_dlt.client import message_dict
from tf_dlt.server.replication import member_stats
from tf_dlt.tools import cluster_args

# Sizes are shown in MiB, the unit --memory-budget is most often given in.
_MIB = 1 << 20

_SHARD_COLUMNS = (
    "shard", "address", "tables", "rows", "RAM MiB", "pulls", "pushes", "pulled rows",
    "pushed rows", "pull p50/p99 us", "push p50/p99 us", "errors", "conns/max",
)  # fmt: skip


def _p50_p99(summary: dict[str, Any]) -> str:
    return f"{summary['p50_us']:.0f}/{summary['p99_us']:.0f}"


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += [
        "  ".join(
            c.rjust(w) if c[:1].isdigit() else c.ljust(w) for c, w in zip(r, widths, strict=True)
        )
        for r in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


# Counters of each table's memory policy, as the table lines show them.
_POLICY = ("admitted", "refused", "expired", "evicted", "shrunk")


_TIER_COLUMNS = (
    "shard", "budget MiB", "resident MiB", "table", "RAM rows", "RAM MiB", "disk rows", "disk MiB",
    "promoted/s", "demoted/s", "disk reads/s", "tier error",
)  # fmt: skip


def _tier_rows(stats: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One line per table of each shard with a memory budget."""
    rows: list[tuple[str, ...]] = []
    for s in stats:
        budget = int(s.get("memory_budget", 0))
        if not budget:
            continue
        for t in s.get("tables", []):
            tier = t.get("tier", {})
            rows.append((
                str(s.get("shard_index", 0)), f"{budget / _MIB:.0f}",
                f"{int(s.get('resident_bytes', 0)) / _MIB:.0f}", t["config"]["name"],
                str(tier.get("ram_rows", 0)), f"{int(t.get('bytes', 0)) / _MIB:.1f}",
                str(tier.get("disk_rows", 0)), f"{int(tier.get('disk_bytes', 0)) / _MIB:.1f}",
                f"{float(tier.get('promotions_per_s', 0)):.0f}",
                f"{float(tier.get('demotions_per_s', 0)):.0f}",
                f"{float(tier.get('disk_reads_per_s', 0)):.0f}",
                _tier_errors(tier),
            ))  # fmt: skip
    return rows


def _tier_errors(tier: dict[str, Any]) -> str:
    """The tier's last error with how many reads and writes failed, or "-"."""
    reads, writes = int(tier.get("disk_read_errors", 0)), int(tier.get("disk_write_errors", 0))
    counts = f"{reads} read / {writes} write errors" if reads or writes else ""
    error = str(tier.get("error", ""))
    return " ".join(x for x in (error, f"({counts})" if error and counts else counts) if x) or "-"


def _replication_lines(s: dict[str, Any], address: str) -> list[str]:
    """A shard's standby, or its primary (serving at `address`), in words
    (docs/replication.md)."""
    shard = s.get("shard_index", 0)
    lines = []
    if s.get("reshard"):
        lines.append(f"shard {shard}: {s['reshard']}")
    copy = f"epoch {s.get('epoch', 0)}, lineage {int(s.get('lineage', 0)):016x}"
    if s.get("role") == "standby":  # asked alone (a client greets primaries only)
        state = "caught up" if s.get("caught_up") else "not caught up: it may not take over yet"
        if s.get("standby_error"):  # refused or cut off, not copying
            state += f"; {s['standby_error']}"
        primary = s.get("standby_of") or "its replica set"
        lines.append(f"shard {shard}: standby of {primary}: {state} ({copy})")
    elif s.get("takeovers"):
        lines.append(f"shard {shard}: took over from its primary ({copy})")
        if not s.get("standbys"):  # its old primary and other standbys are gone
            lines.append(
                f"shard {shard}: WARNING no standby attached: it runs on one copy, {address} "
                f"(start one with --standby-of {address}, or restart the others with "
                "--replica-set)"
            )
    elif s.get("standbys"):  # a replicated primary: a new lineage means it began again
        lines.append(f"shard {shard}: primary ({copy})")
    for r in s.get("standbys", []):
        state = (
            ("caught up" if r.get("caught_up") else "copying tables")
            if r.get("connected")
            else f"DOWN ({r.get('error', '')})"
        )
        lag = float(r.get("lag_seconds", 0))
        lines.append(
            f"shard {shard}: {s.get('replication', '')} standby {r['address']}: {state}, "
            f"{r.get('rows_sent', 0)} rows sent" + (f", lag {lag:.1f} s" if lag else "")
        )
    if len(s.get("standbys", [])) > 1:  # which of them a write waits for
        members = ", ".join(s.get("insync", [])) or (
            "none (a write waits for one standby to apply it; those down are not waited for)"
        )
        lines.append(f"shard {shard}: in sync: {members}")
    return lines


def format_stats(stats: list[dict[str, Any]], addresses: list[str]) -> str:
    """The per-shard and per-table tables `tf-dlt stats` prints."""
    shard_rows = []
    pending: list[str] = []
    serving: list[str] = []
    by_table: dict[str, list[int]] = {}  # rows, bytes, dim, then _POLICY counts
    for s, address in zip(stats, addresses, strict=True):
        tables = s.get("tables", [])
        rows = sum(int(t["rows"]) for t in tables)
        size = sum(int(t["bytes"]) for t in tables)
        for t in tables:
            entry = by_table.setdefault(
                t["config"]["name"], [0, 0, int(t["config"]["dim"])] + [0] * len(_POLICY)
            )
            entry[0] += int(t["rows"])
            entry[1] += int(t["bytes"])
            counters = t.get("policy_counters", {})
            for i, key in enumerate(_POLICY):
                entry[3 + i] += int(counters.get(key, 0))
        pull, push = s["pull_latency"], s["push_latency"]
        errors_total = sum(int(v) for v in s.get("errors", {}).values())
        shard_rows.append((
            str(s.get("shard_index", 0)), address, str(len(tables)), str(rows),
            f"{size / _MIB:.1f}", str(s.get("pulls", 0)), str(s.get("pushes", 0)),
            str(s.get("pulled_rows", 0)), str(s.get("pushed_rows", 0)),
            _p50_p99(pull), _p50_p99(push),
            str(errors_total),
            f"{s.get('connections_authenticated', 0)}/{s.get('max_connections', 0)}",
        ))  # fmt: skip
        if s.get("pending_load"):
            pending.append(f"shard {s.get('shard_index', 0)}: {s['pending_load']}")
        # A standby refuses writes too: its own line says what it follows.
        if s.get("read_only") and s.get("role") not in ("standby", "joining", "beginning"):
            line = f"shard {s.get('shard_index', 0)}: read-only, serving " + (
                f"{s['serving_path']} (save {s.get('serving_save_id', '')})"
                if s.get("serving_path")
                else "no checkpoint yet"
            )
            if s.get("follow_dir"):
                state = "current" if s.get("follow_current") else (
                    f"BEHIND {float(s.get('follow_lag_seconds', 0)):.0f} s"
                )  # fmt: skip
                line += f"; follows {s['follow_dir']}: {state}, {s.get('deltas_applied', 0)} deltas"
                if s.get("follow_error"):
                    line += f"; error: {s['follow_error']}"
            serving.append(line)
        serving.extend(_replication_lines(s, str(s.get("address") or address)))
    table_rows = [
        (name, str(dim), str(rows), f"{size / _MIB:.1f}", *map(str, counts))
        for name, (rows, size, dim, *counts) in sorted(by_table.items())
    ]
    tiers = _tier_rows(stats)
    return (
        _table(_SHARD_COLUMNS, shard_rows)
        + "\n\n"
        + _table(("table", "dim", "rows", "RAM MiB", *_POLICY), table_rows)
        + ("\n\n" + _table(_TIER_COLUMNS, tiers) if tiers else "")
        + "".join(f"\n\nin progress: {line}" for line in pending)
        + "".join(f"\n\n{line}" for line in serving)
    )


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    cluster_args.add_cluster_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    return parser


def _own_stats(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]] | None:
    """Each listed process's own Stats, from its admin plane found by a
    replica's Hello (which a standby answers); None when one does not
    answer so."""
    token, secure = cluster_args.credentials(args)
    stats, listed = [], []
    for address in (a for shard in cluster_args.addresses(args) for a in shard.split("|") if a):
        try:
            hello = _native.hello(address, token, replica=True)
            reply = member_stats(address, int(hello["admin_port"]), token, secure)
        except (errors.DltError, grpc.RpcError):
            return None
        stats.append(message_dict(reply, False))
        listed.append(address)
    return stats, listed


def run(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    try:
        with cluster_args.client(args) as client:
            stats = client.stats()
            # The shards it asked: after a re-shard, the layout the shards
            # serve, not the addresses given.
            addresses = list(client.pservers)
    except errors.DltError as e:
        # Standbys (which greet no trainer) each give their own stats; not
        # where the data plane greeted this client: a primary refuses the
        # replica's Hello, and counted each such stats call as an error.
        standbys = isinstance(e, errors.UnavailableError) and not isinstance(
            e, errors.ControlPlaneUnreachedError
        )
        own = _own_stats(args) if standbys else None
        if own is None:
            print(f"tf-dlt stats: {e}", file=sys.stderr)
            return 1
        print(
            f"tf-dlt stats: {e}\n(these processes serve no trainer: each one's own stats follow)",
            file=sys.stderr,
        )
        stats, addresses = own
    if args.json:
        out.write(json.dumps(stats, indent=2) + "\n")
    else:
        out.write(format_stats(stats, addresses) + "\n")
    return 0
