#!/usr/bin/env python3
"""Fetch PyTorch's `torch/cuda/_memory_viz.py` from a released torch wheel and print its path.

    python3 tools/memory_viz/fetch_memory_viz.py            # -> ~/.cache/vramsim/memory_viz/torch-2.15.0/_memory_viz.py
    python3 tools/memory_viz/fetch_memory_viz.py --wheel torch-2.15.0-*.whl   # offline, from a wheel at hand

Why not `pip install torch`: the full install is about 3 GB of wheels (5.3 GB on disk with the CUDA
libraries and triton, 79 s on a fast mirror), and `pip install --no-deps torch` is no way out:
`import torch` then fails on the missing CUDA libraries ("libcublasLt.so.*[0-9] not found"), and
`torch.cuda._memory_viz` cannot be imported without importing torch. But `_memory_viz.py` itself
imports only the standard library (only `profile_plot`'s helper imports torch), and PyTorch runs it as a
standalone script (`python torch/cuda/_memory_viz.py stats snapshot.pickle`; its `__main__` block takes
its own directory off `sys.path` for that). So this downloads one wheel with `pip download --no-deps`,
takes the single file out of it, checks its SHA-256, and keeps only that file (29 KB) in the cache.

The file is pure Python and identical in every wheel of a release (for 2.15.0 the manylinux x86_64 and
macOS arm64 wheels carry the same bytes, SHA-256 below), so the smallest wheel of the release is
downloaded whatever the machine: macOS arm64, 139 MB, against 539 MB for manylinux x86_64. pip's
cache is bypassed (`--no-cache-dir`) so that a CI cache keeps the 29 KB file, not the wheel.
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_TORCH_VERSION = "2.15.0"
MEMORY_VIZ = "torch/cuda/_memory_viz.py"
# SHA-256 of torch/cuda/_memory_viz.py in each pinned release's wheels.
KNOWN_SHA256 = {
    "2.15.0": "cebc6449a2d34b83ac2a35cf7490babd590732c30362e18d22de18c8da7c9221",
}
# The smallest wheel of a release (pure-Python content is the same in all of them).
WHEEL_PLATFORM = ["--platform", "macosx_14_0_arm64", "--python-version", "3.12"]


def default_cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vramsim", "memory_viz")


def extract(wheel, version):
    with zipfile.ZipFile(wheel) as z:
        data = z.read(MEMORY_VIZ)
    digest = hashlib.sha256(data).hexdigest()
    expected = KNOWN_SHA256.get(version)
    if expected is not None and digest != expected:
        sys.exit(f"error: {MEMORY_VIZ} in {wheel} has SHA-256 {digest}, expected {expected}")
    return data


def download(version, where):
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir",
        "--only-binary=:all:", *WHEEL_PLATFORM, "--dest", where, f"torch=={version}",
    ]  # fmt: skip
    result = subprocess.run(command, stdout=sys.stderr)
    if result.returncode != 0:
        sys.exit(f"error: `{' '.join(command)}` failed with status {result.returncode}")
    wheels = [f for f in os.listdir(where) if f.endswith(".whl")]
    if len(wheels) != 1:
        sys.exit(f"error: pip download left {wheels} in {where}, expected one torch wheel")
    return os.path.join(where, wheels[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-version", default=DEFAULT_TORCH_VERSION)
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--wheel", help="take the file from this wheel instead of downloading one")
    args = parser.parse_args(argv)
    target = os.path.join(args.cache_dir, f"torch-{args.torch_version}", "_memory_viz.py")
    if not os.path.isfile(target) or args.wheel:
        if args.wheel:
            data = extract(args.wheel, args.torch_version)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                data = extract(download(args.torch_version, tmp), args.torch_version)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = target + ".partial"
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, target)
    print(target)


if __name__ == "__main__":
    main()
