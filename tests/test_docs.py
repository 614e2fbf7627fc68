"""Every Python code block of README.md and docs/ runs as written.

The blocks of one page run in order in one fresh Python process (a page's
later blocks may use what its earlier ones made), in a temporary working
directory, against 2 shard processes with an auth token. The harness:

- replaces the placeholder addresses `ps-0:7000` and `ps-1:7000` (or
  `ps-1:7001`) by the shards' addresses, `auth_token="..."` by their token,
  and the store URLs `s3://bucket/...`, `s3://b/...`,
  `hdfs://namenode.example.com:8020/...` and `hdfs://ns1/...` by local
  directories (real stores are tested in test_real_stores);
- writes the token to `./token` and names it in TF_DLT_AUTH_TOKEN_FILE, and
  sets TF_CONFIG to the shards with this process as the only trainer;
- defines, before the first block, the names the pages use without making
  them (`PRELUDE`): `build_model()` (26 int64 ids, distributed layers
  `ctr_emb` and `user_emb`, compiled), `model` (one on the shards),
  `dataset` / `ds`, `x`, `y`,
  `hot_ids`, `my_slice_of_the_data()` and `client`.

Bash blocks are not run here: the README's two set-up commands are what CI
runs, and the others start servers or clusters by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Cluster

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOKEN = "docs-token"

PRELUDE = """
import keras, numpy as np, tensorflow as tf, tf_dlt

def build_model():
    ids = keras.Input(shape=(26,), dtype="int64")
    ctr = tf_dlt.layers.Embedding(output_dim=16, is_distributed=True, name="ctr_emb")(ids)
    user = tf_dlt.layers.Embedding(output_dim=4, is_distributed=True, name="user_emb")(ids)
    x = keras.layers.Concatenate()([keras.layers.Flatten()(ctr), keras.layers.Flatten()(user)])
    out = keras.layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(ids, out)
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
    return model

def my_slice_of_the_data(index, count):
    rng = np.random.default_rng(index)
    ids = rng.integers(0, 1000, (256, 26))
    return ids[index::count], (ids[index::count, 0] % 2).astype("float32")

x, y = my_slice_of_the_data(0, 1)
dataset = ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
hot_ids = np.arange(100)
model = tf_dlt.transpile(build_model(), PSERVERS)
client = tf_dlt.Client(PSERVERS)
"""


def _blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def _as_run(code: str, addresses: list[str], tmp: Path) -> str:
    code = code.replace("ps-0:7000", addresses[0])
    for placeholder in ("ps-1:7000", "ps-1:7001"):
        code = code.replace(placeholder, addresses[1])
    code = code.replace('auth_token="..."', f'auth_token="{TOKEN}"')
    code = code.replace("s3://bucket/", f"{tmp}/bucket/").replace("s3://b/", f"{tmp}/b/")
    code = code.replace("hdfs://namenode.example.com:8020/", f"{tmp}/nn/")
    code = code.replace("hdfs://ns1/", f"{tmp}/ns1/")
    return code


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.name)
def test_the_python_blocks_of_a_page_run_as_written(
    page: Path, start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2, token=TOKEN)
    (tmp_path / "token").write_text(TOKEN + "\n")
    blocks = [f"# --- {page.name}, block {i + 1}\n{b}" for i, b in enumerate(_blocks(page))]
    prelude = PRELUDE.replace("PSERVERS", repr(cluster.addresses))
    code = _as_run(prelude + "\n".join(blocks), cluster.addresses, tmp_path)
    tf_config = json.dumps(
        {
            "cluster": {"ps": cluster.addresses, "worker": ["localhost:0"]},
            "task": {"type": "worker", "index": 0},
        }
    )
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "TF_DLT_AUTH_TOKEN_FILE": str(tmp_path / "token"),
        "TF_CONFIG": tf_config,
    }
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
