#!/usr/bin/env python3
"""Runs the code blocks of README.md and docs/*.md that a reader is meant to run.

A fenced block is run when its info string carries the word ``runnable``::

    ```sh runnable
    target/release/kvferry demo --requests 4 --model tiny
    ```

    ```python runnable
    import kvferry
    ...
    ```

- ``sh``/``bash`` blocks run with ``bash -euo pipefail`` in a scratch directory that holds
  ``target`` (the build: $CARGO_TARGET_DIR or the repository's), ``python`` and ``scripts``
  (links into the repository), with the given Python's folder first on PATH. A line
  ``cargo run --release -- ARGS`` runs as ``target/release/kvferry ARGS`` (the binary ``cargo
  run`` would run: the build is the test command's own step, not this script's).
- ``python`` blocks run as a script with ``--python`` (an interpreter with kvferry installed).
- ``replace="FROM=>TO"`` in the info string runs the block with FROM replaced by TO, so the
  reader sees the full command and the test command runs a quick one (e.g. the 64-request demo
  as a 4-request one). Each replacement must match, else the block fails.

Blocks without ``runnable`` are fragments, sample output or commands for other machines (GPU
hosts, vLLM deployments); installing the package (``pip install ./python``) is what
scripts/python-tests.sh does.

Usage: scripts/doc-blocks.py [--python PY] [--bin KVFERRY] [--list] [FILE.md ...]
Exit status 1 when a block fails (its output is printed), 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
SHELLS = {"sh", "bash", "shell", "console"}
TIMEOUT_S = 180


@dataclass
class Block:
    """One runnable block: where it is, its language, its text and its replacements."""

    path: Path
    line: int
    lang: str
    text: str
    replace: list[tuple[str, str]]


def shown(path: Path) -> str:
    """The path relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def blocks_of(path: Path) -> list[Block]:
    """The runnable fenced blocks of a Markdown file, in order. A fence closes on a line of the
    same character at least as long (CommonMark)."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (
            lines[i].startswith(fence[0] * len(fence)) and not lines[i].strip(fence[0]).strip()
        ):
            body.append(lines[i])
            i += 1
        i += 1
        try:
            words = shlex.split(info)
        except ValueError as e:
            raise SystemExit(f"{path}:{start + 1}: info string {info!r} does not parse: {e}")
        if "runnable" not in words[1:]:
            continue
        replace = []
        for w in words[1:]:
            if w.startswith("replace="):
                frm, sep, to = w[len("replace="):].partition("=>")
                if not sep or not frm:
                    raise SystemExit(f"{path}:{start + 1}: replace= needs FROM=>TO, got {w!r}")
                replace.append((frm, to))
        out.append(Block(path, start + 1, words[0] if words else "", "\n".join(body) + "\n", replace))
    return out


def prepared(b: Block) -> str:
    text = b.text
    for frm, to in b.replace:
        if frm not in text:
            raise ValueError(f"replace={frm}=>{to}: {frm!r} is not in the block")
        text = text.replace(frm, to)
    if b.lang in SHELLS:
        text = re.sub(r"cargo run --release --(?: |$)", "target/release/kvferry ", text, flags=re.M)
    return text


def run(b: Block, text: str, python: str, workdir: Path) -> tuple[bool, str, float]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("KVFERRY_LOG", "warn")
    if b.lang in SHELLS:
        cmd = ["bash", "-euo", "pipefail", "-c", text]
    elif b.lang == "python":
        script = workdir / f"block_{b.line}.py"
        script.write_text(text, encoding="utf-8")
        cmd = [python, str(script)]
    else:
        return False, f"runnable block in language {b.lang!r}: only sh/bash and python run", 0.0
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or "") + (e.stderr or "") if isinstance(e.stdout, str) else ""
        return False, f"{out}\ntimed out after {TIMEOUT_S} s", time.monotonic() - t0
    return p.returncode == 0, p.stdout + p.stderr, time.monotonic() - t0


def scratch(target: Path) -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvferry-doc-blocks-"))
    (d / "target").symlink_to(target)
    for name in ("python", "scripts"):
        (d / name).symlink_to(ROOT / name)
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/*.md")
    ap.add_argument("--python", default=sys.executable, help="an interpreter with kvferry installed")
    ap.add_argument("--target", type=Path,
                    default=Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")),
                    help="the cargo target dir holding release/kvferry")
    ap.add_argument("--list", action="store_true", help="list the runnable blocks, run nothing")
    a = ap.parse_args()
    # Absolute, not resolved: a venv's python is a link whose target is outside the venv.
    a.python = os.path.abspath(a.python)
    files = [f.resolve() for f in a.files] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [b for f in files for b in blocks_of(f)]
    if a.list:
        for b in blocks:
            print(f"{shown(b.path)}:{b.line} {b.lang}")
        return 0
    target = a.target if a.target.is_absolute() else ROOT / a.target
    if not (target / "release" / "kvferry").exists():
        print(f"doc-blocks: {target}/release/kvferry is missing: cargo build --release first",
              file=sys.stderr)
        return 1
    failed = 0
    total = 0.0
    for b in blocks:
        where = f"{shown(b.path)}:{b.line}"
        work = scratch(target.resolve())
        try:
            ok, out, secs = run(b, prepared(b), a.python, work)
        except ValueError as e:
            ok, out, secs = False, str(e), 0.0
        finally:
            shutil.rmtree(work)  # removes the links, never what they point to
        total += secs
        print(f"{'ok    ' if ok else 'FAILED'} {where} ({b.lang}, {secs:.1f} s)", flush=True)
        if not ok:
            failed += 1
            print("\n".join("    " + line for line in out.rstrip().splitlines()[-40:]), flush=True)
    print(f"doc-blocks: {len(blocks) - failed} of {len(blocks)} blocks passed in {total:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
