"""tf_dlt.transpiler: rewrites Keras models onto shard servers.

Installed as ``tf_dlt.transpiler`` (never importable as ``transpiler``).
"""

from .transpile import EMBEDDED, transpile

__all__ = ["EMBEDDED", "transpile"]
