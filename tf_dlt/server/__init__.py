"""The shard server: `tf-dlt server` / `python -m tf_dlt.server`.

Imports no TensorFlow: numpy, grpcio, protobuf, h5py, fsspec and the native
extension only.
"""

from tf_dlt.server.shard_server import ShardServer

__all__ = ["ShardServer"]
