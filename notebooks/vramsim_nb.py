"""Helpers the notebooks share: find the `vramsim` binary, run it with `--json`, show tables.

The binary is, in order: $VRAMSIM_BIN; target/release/vramsim; target/debug/vramsim (under
$CARGO_TARGET_DIR when set); else `cargo run --release -p vramsim-api --`. Nothing here needs a GPU,
PyTorch or pandas.
"""

from __future__ import annotations

import html
import json
import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
"""The repository root (the notebooks live in `REPO/notebooks`)."""

SNAPSHOTS = REPO.parent / "shared" / "snapshots"
"""Real PyTorch memory snapshots, beside the clone (absent outside the project's machines)."""

GIB = 1 << 30


def _binary() -> list[str]:
    if os.environ.get("VRAMSIM_BIN"):
        return [os.environ["VRAMSIM_BIN"]]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    if not target.is_absolute():
        target = REPO / target
    for profile in ("release", "debug"):
        candidate = target / profile / "vramsim"
        if candidate.exists():
            return [str(candidate)]
    return ["cargo", "run", "--quiet", "--release", "-p", "vramsim-api", "--"]


BIN = _binary()
"""The command that runs vramsim."""


class VramsimError(RuntimeError):
    """vramsim exited with an error (status 2): bad input, or an answer such as "even batch 1 does not
    fit", with its message."""

    def __init__(self, args: list[str], status: int, message: str):
        super().__init__(f"vramsim {' '.join(shlex.quote(a) for a in args)} exited {status}: {message}")
        self.status = status
        self.message = message


def run(*args: str) -> str:
    """Runs `vramsim ARGS` from the repository root and returns its standard output."""
    proc = subprocess.run(
        BIN + [str(a) for a in args], cwd=REPO, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise VramsimError([str(a) for a in args], proc.returncode, proc.stderr.strip())
    return proc.stdout


def vramsim_json(*args: str):
    """Runs `vramsim ARGS --json` and returns the parsed document."""
    return json.loads(run(*args, "--json"))


def gib(n: float) -> float:
    """Bytes in GiB."""
    return n / GIB


def table(rows: list[dict], columns: list[str] | None = None, floats: str = "{:.2f}"):
    """An HTML table of `rows` (dicts) for the notebook, columns in the order given (default: the
    first row's keys)."""
    from IPython.display import HTML

    columns = columns or (list(rows[0]) if rows else [])

    def cell(v):
        if isinstance(v, float):
            return floats.format(v)
        return "" if v is None else str(v)

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell(r.get(c)))}</td>" for c in columns) + "</tr>"
        for r in rows
    )
    return HTML(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
