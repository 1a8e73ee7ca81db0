#!/usr/bin/env python3
"""Runs the notebooks for CI.

    python3 notebooks/run_notebooks.py --check-stripped   # fail if a notebook holds outputs
    python3 notebooks/run_notebooks.py                     # execute every notebook, fail on a failing cell
    python3 notebooks/run_notebooks.py 02_*.ipynb          # some of them

Execution uses nbclient with the `python3` kernel (this interpreter: jupyter_client starts a kernelspec
whose command is `python` with `sys.executable`), from the notebooks' directory, and never writes the
notebooks back: what is committed stays without outputs. Executed copies go to target/notebooks/ for
inspection. The notebooks `import vramsim`: the installed package (`pip install ./python`), checked
before any notebook runs. A notebook that needs more (`"vramsim": {"requires": ["torch", ...]}` in its
metadata, e.g. `from_module` on a torchvision model) is reported SKIPPED, with the missing module named,
where that is not installed; it is never counted as passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def notebooks(patterns: list[str]) -> list[Path]:
    found = sorted(HERE.glob("*.ipynb"))
    if patterns:
        found = [p for p in found if any(p.match(pat) for pat in patterns)]
    return found


def check_stripped(paths: list[Path]) -> int:
    """Notebooks must be committed without outputs, execution counts or widget state."""
    bad = []
    for path in paths:
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb.get("cells", [])):
            if cell.get("outputs") or cell.get("execution_count") is not None:
                bad.append(f"{path.name}: cell {i} has outputs or an execution count")
        if "widgets" in nb.get("metadata", {}):
            bad.append(f"{path.name}: metadata holds widget state")
    for line in bad:
        print(f"error: {line}", file=sys.stderr)
    if bad:
        print(
            "strip them before committing, e.g. `jupyter nbconvert --clear-output --inplace notebooks/*.ipynb`",
            file=sys.stderr,
        )
        return 1
    print(f"{len(paths)} notebooks, no outputs")
    return 0


def installed_package() -> str | None:
    """Where the installed `vramsim` package is, or None (with the reason printed) when it cannot be
    imported, or when what imports is the source tree rather than a built package."""
    try:
        import vramsim
        from vramsim import _vramsim  # the native module: only a built package has it
    except ImportError as error:
        print(
            f"error: the notebooks need the vramsim package ({error}); install it first: "
            "python3 -m pip install ./python",
            file=sys.stderr,
        )
        return None
    return f"{Path(vramsim.__file__).parent} (native module {Path(_vramsim.__file__).name})"


def missing_requirements(nb: dict) -> list[str]:
    """The modules a notebook's metadata (`vramsim.requires`) names that this interpreter cannot find."""
    import importlib.util

    wanted = nb.get("metadata", {}).get("vramsim", {}).get("requires", [])
    return [m for m in wanted if importlib.util.find_spec(m) is None]


def execute(paths: list[Path], timeout: int) -> int:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    package = installed_package()
    if package is None:
        return 1
    print(f"vramsim package: {package}")
    out_dir = REPO / "target" / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    skipped = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        missing = missing_requirements(nb)
        if missing:
            skipped += 1
            print(f"{path.name}: SKIPPED: needs {', '.join(missing)}, not installed "
                  f"(python3 -m pip install {' '.join(missing)})")
            continue
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(HERE)}},
        )
        start = time.monotonic()
        try:
            client.execute()
            status = "ok"
        except CellExecutionError as error:
            status = "FAILED"
            failed += 1
            print(str(error), file=sys.stderr)
        finally:
            nbformat.write(nb, out_dir / path.name)
        print(f"{path.name}: {status} in {time.monotonic() - start:.1f} s")
    passed = len(paths) - failed - skipped
    print(f"notebooks: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="*", help="notebook name patterns (default: all)")
    parser.add_argument("--check-stripped", action="store_true", help="only check for outputs")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args()
    paths = notebooks(args.patterns)
    if not paths:
        print("error: no notebooks found", file=sys.stderr)
        return 1
    if args.check_stripped:
        return check_stripped(paths)
    return execute(paths, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
