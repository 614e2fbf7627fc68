"""The CTR model of ctr_model.py trained by several trainer processes that
share shard servers, as `tf-dlt launch` (or Kubernetes) runs them:

    tf-dlt launch --pservers 2 --workers 2 -- python examples/ctr_multi_trainer.py

Each trainer reads its cluster from TF_CONFIG (`tf_dlt.cluster_from_env()`)
and trains on its slice of the data (worker i of n takes every n-th
example). The embeddings and the dense weights (`tf_dlt.DenseOnShards`) live
on the shards, so all trainers train one model, asynchronously. Each prints
its held-out loss and AUC on a "RESULT {json}" line. With TF_DLT_CHECKPOINT
set (the `tf-dlt k8s` manifests set it), the chief saves a checkpoint there
after every epoch (`<checkpoint>/epoch-<n>`), which `tf_dlt.load` resumes
from (shards started with `tf-dlt k8s --load-from` take its tables:
`<checkpoint>/epoch-<n>/tables`).
"""

from __future__ import annotations

import argparse
import json
import os

import keras
from ctr_model import make_data, make_model

import tf_dlt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=int, default=40_000, help="examples of all trainers")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=0.003)
    parser.add_argument("--local-dense", action="store_true", help="no dense sync (contrast)")
    args = parser.parse_args()
    spec = tf_dlt.cluster_from_env()
    x, y = make_data(args.train, seed=0)
    vx, vy = make_data(10_000, seed=1)
    mine = slice(spec.task_index, None, spec.num_workers)
    x, y = {k: v[mine] for k, v in x.items()}, y[mine]

    model = tf_dlt.transpile(make_model(), spec.pservers or "embedded")
    dense = (
        keras.optimizers.Adam(args.learning_rate)
        if args.local_dense
        else tf_dlt.DenseOnShards(spec, "adam", args.learning_rate)
    )
    model.compile(
        optimizer=dense, loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")]
    )
    print(f"worker {spec.task_index}/{spec.num_workers}: {len(y)} examples, {spec.pservers}")
    callbacks = []
    checkpoint = os.environ.get("TF_DLT_CHECKPOINT")
    if checkpoint and spec.is_chief:
        # The rows and the dense weights are the shards': one trainer saves.
        callbacks.append(tf_dlt.ModelCheckpoint(checkpoint.rstrip("/") + "/epoch-{epoch}"))
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=2, callbacks=callbacks)
    result = model.evaluate(vx, vy, batch_size=1024, verbose=0, return_dict=True)
    result.update(worker=spec.task_index, workers=spec.num_workers, examples=len(y))
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
