"""Imports TensorFlow without the lines it logs while it loads (CUDA probing
on a machine without a GPU, CPU features), so the examples print only their
own progress and results. Import it before anything that imports TensorFlow.

Those lines come from C++ before logging is set up, so they are silenced by
pointing the process's stderr away for the import alone; a failing import
still raises its Python exception, and TF_CPP_MIN_LOG_LEVEL=3 (unless set)
keeps only TensorFlow's fatal messages afterwards.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _import_quietly() -> None:
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow  # noqa: F401

        tensorflow.config.list_physical_devices()  # probes CUDA now, quietly
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


_import_quietly()
