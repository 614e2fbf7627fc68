"""The CTR model of ctr_model.py on 2 local shard server processes: build it
(embedded tables), transpile it onto the shards, train, report AUC.

python examples/ctr_two_shards.py [--train 100000] [--epochs 1]
"""

from __future__ import annotations

import argparse

from ctr_model import make_data, make_model

import tf_dlt
from tf_dlt.server.local import LocalCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args()
    x, y = make_data(args.train, seed=0)
    vx, vy = make_data(args.train // 10, seed=1)
    with LocalCluster(2, "--log-level", "WARNING") as cluster:
        model = tf_dlt.transpile(make_model(), cluster.addresses)
        print(f"training on shard servers {cluster.addresses}")
        model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=2)
        loss, auc = model.evaluate(vx, vy, batch_size=args.batch, verbose=0)
        with tf_dlt.Client(cluster.addresses) as client:
            rows = client.list_tables()["ctr_emb"]["rows"]
        print(f"validation: loss {loss:.4f}  AUC {auc:.4f}; {rows} rows on 2 shards")


if __name__ == "__main__":
    main()
