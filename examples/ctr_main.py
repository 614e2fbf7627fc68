"""The main job: train the CTR model of ctr_model.py with its embeddings in
the embedded (in-process) tables, the single-machine default, report AUC,
save a checkpoint (tf_dlt.save) and export a SavedModel that plain
TensorFlow serves (mode="standalone").

python examples/ctr_main.py [--train 200000] [--epochs 2] [--batch 1024] [--out out/ctr]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ctr_model import make_data, make_model

import tf_dlt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train", type=int, default=200_000)
    parser.add_argument("--validation", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--out", default="out/ctr", help="where the checkpoint and SavedModel go")
    args = parser.parse_args()
    x, y = make_data(args.train, seed=0)
    vx, vy = make_data(args.validation, seed=1)
    model = make_model()
    start = time.monotonic()
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, validation_data=(vx, vy), verbose=2)
    seconds = time.monotonic() - start
    loss, auc = model.evaluate(vx, vy, batch_size=args.batch, verbose=0)
    layer = model.get_layer("ctr_emb")
    print(
        f"trained {args.epochs} epochs on {args.train} examples in {seconds:.1f} s "
        f"({args.epochs * args.train / seconds:,.0f} examples/s); {int(layer.pushes.numpy())} "
        f"pushes to table {layer.table_name!r}"
    )
    print(f"validation: loss {loss:.4f}  AUC {auc:.4f}")
    out = Path(args.out).resolve()
    tf_dlt.save(model, str(out / "checkpoint"))
    tf_dlt.export_saved_model(model, str(out / "serving" / "1"), mode="standalone")
    print(f"checkpoint: {out / 'checkpoint'}; SavedModel: {out / 'serving' / '1'}")


if __name__ == "__main__":
    main()
