#!/usr/bin/env python3
"""Turn logs/<run>/*.log into a markdown table. Usage: summarize.py logs/run1 [logs/run2 ...]"""
import re, sys, os
PH = [("load", "load"), ("load+settle", "load+settle"), ("read_uniform", "read uni"), ("read_zipf", "read zipf"),
      ("churn(promote+demote)", "churn"), ("miss", "miss"), ("read_uniform_cold", "read uni COLD"),
      ("read_zipf_cold", "read zipf COLD")]
ENG = ["rocksdb", "lmdb", "pagehash", "lmdb_nordahead"]
for d in sys.argv[1:]:
    print(f"\n#### {os.path.basename(d.rstrip('/'))} (rows/s; churn = promote+demote iterations/s)\n")
    hdr = ["engine"] + [p[1] for p in PH] + ["RAM B/row: RSS growth (anon)", "RAM B/row: engine structures",
                                            "disk B/row", "peak RSS MiB (VmHWM)", "RSS at end MiB"]
    print("| " + " | ".join(hdr) + " |"); print("|" + "---|" * len(hdr))
    for e in ENG:
        f = os.path.join(d, e + ".log")
        if not os.path.exists(f): continue
        t = open(f).read()
        r = {m.group(1): float(m.group(2)) for m in re.finditer(r"phase=(\S+) ops=\d+ sec=\S+ rows_per_s=(\d+)", t)}
        mr = {m.group(1): float(m.group(2)) for m in re.finditer(r"MEMROW (\S+) (\S+)", t)}
        struct = next((v for k, v in mr.items() if k.endswith("_struct") or k.endswith("_branch_pages")), None)
        skey = next((k for k in mr if k.endswith("_struct") or k.endswith("_branch_pages")), "")
        hwm = int(re.search(r"VmHWM=(\d+)", t).group(1)); end = int(re.search(r"VmRSS_end=(\d+)", t).group(1))
        row = [e] + [f"{r[p[0]]:,.0f}" for p in PH] + [
            f"{mr['rss_growth']:.1f} ({mr['anon_growth']:.1f})",
            f"{struct:.2f}" + {"rocksdb_struct": " (table readers+block cache)", "lmdb_branch_pages": " (branch pages)",
                               "pagehash_struct": " (fingerprints+counts)"}.get(skey, ""),
            f"{mr['disk_apparent']:.1f}", f"{hwm/1024:.0f}", f"{end/1024:.0f}"]
        print("| " + " | ".join(row) + " |")
