"""The capture tool (``traces/python/vramsim_capture.py`` and ``cuda_autocast.py``, linked here so that the
package ships the same files the repository tests): it records a real PyTorch training step on the
``meta`` device (or on fake CPU tensors, for mixed precision) as a vramsim trace. Needs torch."""

import sys

from . import cuda_autocast

# vramsim_capture imports its sibling as a top-level module (`import cuda_autocast`), as it does when run
# from traces/python: give it this one.
sys.modules.setdefault("cuda_autocast", cuda_autocast)

from . import vramsim_capture  # noqa: E402

__all__ = ["cuda_autocast", "vramsim_capture"]
