#!/usr/bin/env python3
"""Structure checks of the test command: no import cycle between modules, no oversized file.

Cycles. For every Rust crate (a folder with Cargo.toml and src/) the module graph is built from
its files: a file is a module (`a/b.rs` and `a/b/mod.rs` are `a::b`, `lib.rs` and `main.rs` the
root), and file A depends on file B when A's non-test code names a path into B: `use crate::…`,
`use super::…`, `use self::…`, `use child::…`, and the same paths written inline
(`crate::x::f()`). A path is resolved to the longest module prefix, then through that module's
`use` imports (so `crate::Name` re-exported by lib.rs, or `super::Name` imported by the parent,
points at the file that defines Name). Declaring a child (`mod x;`) is not a dependency. For the Python package
(python/kvferry) a file depends on every package module it imports (`import`, `from … import`,
relative or absolute, at any depth of the file). A strongly connected component of more than one
file is a cycle: it is printed with the names that tie each file to the next, and the check
fails (unless it is exactly one of KNOWN_CYCLES, each listed with why it is still there).

Sizes. No non-test file under transfer/src may have more than 600 lines, and no other non-test
source file (Rust under a crate's src/, the Python package) more than 700. Test code is not
counted: files under tests/, files named tests.rs, *_tests.rs or test_*.py, files declared under
`#[cfg(test)]`, and the lines of inline `#[cfg(test)]` items.

Plain Python 3 standard library; reads only tracked sources; about a second.
Usage: scripts/check-structure.py [REPO_ROOT] | --self-test
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

# Cycles known and not yet broken, each with why; the check fails when one of them changes (a
# file joins or leaves it: update the entry, or delete it once the cycle is gone).
KNOWN_CYCLES: dict[frozenset[str], str] = {}

# Files over their size that are not split yet, with the non-test lines they have now: the
# check fails when one grows past that (split it) or falls within the limit (delete the entry).
KNOWN_OVERSIZE = {
}

TRANSFER_LIMIT = 600
LIMIT = 700
SKIP_DIRS = {"target", "third_party", ".git", ".dev", "fuzz", "node_modules", "__pycache__"}

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


# ---------------------------------------------------------------- Rust: lexing


def strip_rust(text: str) -> str:
    """`text` with comments, string and char literals blanked (newlines kept), so that braces,
    `use` and paths are found only in code."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.match(r"[A-Za-z0-9_]", text[i - 1 : i] or " "):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^'\\\n])'", text[i:])
            if m:  # a char literal; otherwise a lifetime
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


CFG_TEST = re.compile(r"#\[cfg\((test|all\(test\b[^\]]*|any\(test\b[^\]]*)\)\]")


def item_end(code: str, start: int) -> int:
    """The end of the item that starts at `start`: after its first `;` at depth 0 or after the
    brace block that opens before any `;`."""
    depth = 0
    i = start
    while i < len(code):
        c = code[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == ";" and depth == 0:
            return i + 1
        i += 1
    return len(code)


def split_tests(code: str) -> tuple[str, list[str], int]:
    """(code with `#[cfg(test)]` items blanked, names of `#[cfg(test)] mod x;` children, lines
    blanked)."""
    test_children = []
    blanked = 0
    while True:
        m = CFG_TEST.search(code)
        if not m:
            break
        end = item_end(code, m.end())
        item = code[m.end() : end]
        mm = re.match(r"\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;", item)
        if mm:
            test_children.append(mm.group(1))
        chunk = code[m.start() : end]
        blanked += chunk.count("\n")
        code = code[: m.start()] + re.sub(r"[^\n]", " ", chunk) + code[end:]
    return code, test_children, blanked


def use_trees(code: str):
    """Every `use` declaration's paths, expanded: (segments, is_pub)."""
    for m in re.finditer(r"(?:^|[;{}\]\s])((pub(?:\([^)]*\))?\s+)?use\s+)([^;]*);", code):
        tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+" + IDENT, "", m.group(3)))
        for p in expand(tree):
            yield p, bool(m.group(2))


def expand(tree: str) -> list[list[str]]:
    """`a::{b, c::{d, e}}` -> [[a, b], [a, c, d], [a, c, e]] (`self` in a group is the prefix;
    `as` renames and globs dropped)."""
    tree = tree.lstrip(":")
    if "{" not in tree:
        parts = [s for s in tree.split("::") if s and s != "*"]
        return [parts] if parts else []
    head, rest = tree.split("{", 1)
    body = rest[: rest.rfind("}")]
    prefix = [s for s in head.split("::") if s]
    out = []
    depth, cur = 0, ""
    for ch in body + ",":
        if ch == "," and depth == 0:
            if cur:
                for sub in expand(cur):
                    out.append(prefix if sub == ["self"] else prefix + sub)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    return out


# ---------------------------------------------------------------- Rust: crates


class RustCrate:
    def __init__(self, root: Path, src: Path):
        self.root = root
        self.src = src
        self.files: dict[tuple, Path] = {}  # module path -> file
        self.code: dict[Path, str] = {}
        self.test_files: set[Path] = set()
        self.nontest_lines: dict[Path, int] = {}
        self.reexports: dict[tuple, dict[str, list[str]]] = {}
        for f in sorted(src.rglob("*.rs")):
            if any(part in SKIP_DIRS for part in f.relative_to(src).parts):
                continue
            self.files.setdefault(self.module_of(f), f)
        for mod, f in list(self.files.items()):
            raw = f.read_text(encoding="utf-8", errors="replace")
            code, test_children, blanked = split_tests(strip_rust(raw))
            self.code[f] = code
            self.nontest_lines[f] = raw.count("\n") - blanked
            for c in test_children:
                child = self.files.get(mod + (c,))
                if child:
                    self.test_files.add(child)
        # a test file's own children are test code too
        changed = True
        while changed:
            changed = False
            for mod, f in self.files.items():
                if f not in self.test_files and any(
                    self.files.get(mod[:k]) in self.test_files for k in range(1, len(mod))
                ):
                    self.test_files.add(f)
                    changed = True
        for mod, f in self.files.items():
            re_map = {}
            # every `use` names an item in this module: child modules see private ones too
            for path, _ in use_trees(self.code[f]):
                if path:
                    re_map[path[-1]] = self.absolute(mod, path)
            self.reexports[mod] = {k: v for k, v in re_map.items() if v is not None}

    def module_of(self, f: Path) -> tuple:
        rel = f.relative_to(self.src).with_suffix("")
        parts = list(rel.parts)
        if parts in (["lib"], ["main"]):
            return ()
        if parts[-1] == "mod":
            parts = parts[:-1]
        return tuple(parts)

    def is_module(self, mod: tuple) -> bool:
        return mod in self.files

    def absolute(self, cur: tuple, path: list[str]):
        """`path` as written in module `cur`, made absolute (a list of segments from the crate
        root), or None for a path outside the crate."""
        if not path:
            return None
        first = path[0]
        if first == "crate":
            return list(path[1:])
        if first in ("super", "self"):
            base = list(cur)
            i = 0
            while i < len(path) and path[i] in ("super", "self"):
                if path[i] == "super":
                    if not base:
                        return None
                    base.pop()
                i += 1
            return base + list(path[i:])
        if self.is_module(cur + (first,)):
            return list(cur) + list(path)
        return None

    def resolve(self, abs_path: list[str], depth: int = 0):
        """The file a path points into: the longest module prefix, then through that module's
        re-exports."""
        for k in range(len(abs_path), -1, -1):
            mod = tuple(abs_path[:k])
            if self.is_module(mod):
                rest = abs_path[k:]
                if rest and depth < 8:
                    target = self.reexports.get(mod, {}).get(rest[0])
                    if target is not None and target != abs_path:
                        return self.resolve(target + rest[1:], depth + 1)
                return self.files[mod], (rest[0] if rest else mod[-1] if mod else "crate")
        return None

    def edges(self):
        """{file: {file it depends on: {names}}} over non-test files."""
        out: dict[Path, dict[Path, set]] = {}
        for mod, f in self.files.items():
            if f in self.test_files:
                continue
            code = self.code[f]
            deps: dict[Path, set] = {}
            paths = [p for p, _ in use_trees(code)]
            # inline paths; a prefix before `::{` or `::*` is a `use` group, expanded above
            inline = r"(?<![A-Za-z0-9_:])((?:" + IDENT + r")(?:::" + IDENT + r")+)"
            for m in re.finditer(inline, code):
                if re.match(r"\s*::\s*[{*]", code[m.end() : m.end() + 8]):
                    continue
                segs = m.group(1).split("::")
                if segs[0] in ("crate", "super", "self") or self.is_module(mod + (segs[0],)):
                    paths.append(segs)
            for p in paths:
                a = self.absolute(mod, p)
                if a is None:
                    continue
                r = self.resolve(a)
                if r is None:
                    continue
                target, name = r
                if target != f and target not in self.test_files:
                    deps.setdefault(target, set()).add(name)
            out[f] = deps
        return out


# ---------------------------------------------------------------- Python


def python_edges(pkg: Path):
    """{file: {file it imports: {names}}} of the package `pkg` (its folder)."""
    base = pkg.parent
    files = {}
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(base).with_suffix("")
        parts = rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts
        files[".".join(parts)] = f
    out = {}
    for name, f in files.items():
        is_pkg = f.name == "__init__.py"
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"), str(f))
        except SyntaxError as e:
            raise SystemExit(f"check-structure: {f}: {e}")
        deps: dict[Path, set] = {}

        def add(mod: str, what: str):
            t = files.get(mod)
            if t is not None and t != f:
                deps.setdefault(t, set()).add(what)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    add(a.name, a.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg_parts = name.split(".") if is_pkg else name.split(".")[:-1]
                    up = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                    mod = ".".join(up + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for a in node.names:
                    if f"{mod}.{a.name}" in files:
                        add(f"{mod}.{a.name}", a.name)
                    else:
                        add(mod, a.name)
        out[f] = deps
    return out


# ---------------------------------------------------------------- graph


def cycles(edges):
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges.get(root, {})))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(edges.get(w, {}))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def tracked(root: Path):
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
        ).stdout.decode()
        return {root / p for p in out.split("\0") if p}
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    return check(root.resolve(), KNOWN_CYCLES, KNOWN_OVERSIZE)


def check(root: Path, known: dict, oversize: dict) -> int:
    """Runs both checks on the tree at `root`; 0 when it passes (failures on stderr)."""
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    failures = []
    sizes = []  # (file, nontest lines)

    crates = []
    for toml in sorted(root.glob("**/Cargo.toml")):
        if any(part in SKIP_DIRS for part in toml.relative_to(root).parts):
            continue
        if (toml.parent / "src").is_dir():
            crates.append(RustCrate(toml.parent, toml.parent / "src"))
    graph_edges = {}
    for c in crates:
        graph_edges.update(c.edges())
        for f in c.files.values():
            if f not in c.test_files and not re.search(r"(^|_)tests?\.rs$", f.name):
                sizes.append((f, c.nontest_lines[f]))
    pkg = root / "python" / "kvferry"
    if pkg.is_dir():
        graph_edges.update(python_edges(pkg))
        for f in sorted(pkg.rglob("*.py")):
            if not f.name.startswith("test_"):
                sizes.append((f, f.read_text(encoding="utf-8").count("\n")))

    found = set()
    for comp in cycles(graph_edges):
        key = frozenset(rel(f) for f in comp)
        if key in known:
            found.add(key)
            print(f"known import cycle of {len(comp)} files, left for now: {known[key]}")
            continue
        lines = [f"import cycle of {len(comp)} files: " + ", ".join(rel(f) for f in comp)]
        members = set(comp)
        for f in comp:
            for t, names in sorted(graph_edges[f].items()):
                if t in members:
                    lines.append(f"  {rel(f)} -> {rel(t)}: {', '.join(sorted(names))}")
        failures.append("\n".join(lines))

    for key in known.keys() - found:
        failures.append(
            "a known cycle changed or is gone; update KNOWN_CYCLES in scripts/check-structure.py: "
            + ", ".join(sorted(key))
        )

    files_tracked = tracked(root)
    transfer_src = root / "transfer" / "src"
    for f, n in sizes:
        if files_tracked is not None and f not in files_tracked:
            continue
        limit = TRANSFER_LIMIT if transfer_src in f.parents else LIMIT
        known_size = oversize.get(rel(f))
        if known_size is not None:
            if n <= limit:
                failures.append(f"{rel(f)}: {n} lines, within {limit}: delete its KNOWN_OVERSIZE entry")
            elif n > known_size:
                failures.append(f"{rel(f)}: {n} lines of non-test code, more than its {known_size} known; split it by job")
            else:
                print(f"known oversized file, left for now: {rel(f)} ({n} lines, limit {limit})")
            continue
        if n > limit:
            failures.append(f"{rel(f)}: {n} lines of non-test code, more than {limit}; split it by job")

    if failures:
        print("\n".join(failures), file=sys.stderr)
        print(
            "\nstructure check failed: move what both sides need to a module neither imports back, "
            "and keep files within their size (scripts/check-structure.py says how it counts)",
            file=sys.stderr,
        )
        return 1
    print(
        f"structure: no new import cycle among {len(graph_edges)} modules; "
        "every source file within its size"
    )
    return 0


def self_test() -> int:
    """Runs the check on small trees it writes: a Rust cycle through `super::` and a re-export,
    a Python cycle, an oversized file, and a clean tree. Returns 0 when each is judged right."""
    import contextlib
    import io
    import tempfile

    def run(files: dict[str, str]) -> tuple[int, str]:
        with tempfile.TemporaryDirectory() as d:
            for name, text in files.items():
                p = Path(d) / name
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = check(Path(d).resolve(), {}, {})
            return rc, err.getvalue()

    crate = {
        "c/Cargo.toml": "",
        "c/src/lib.rs": "mod a;\nmod b;\npub use b::Thing;\n",
        "c/src/a/mod.rs": "mod child;\npub(crate) use child::Leaf;\n",
        "c/src/a/child.rs": "pub struct Leaf;\n",
        "c/src/b.rs": "use crate::a::Leaf;\npub struct Thing(Leaf);\n"
        "#[cfg(test)]\nmod tests {\n    use crate::Thing;\n}\n",
    }
    checks = [
        ("clean tree", crate, 0, ""),
        (
            "cycle through a re-export at the root",
            {**crate, "c/src/a/child.rs": "pub struct Leaf(crate::Thing);\n"},
            1,
            "c/src/a/child.rs -> c/src/b.rs: Thing",
        ),
        (
            "a child using its parent's item, the parent not using the child",
            {**crate, "c/src/a/mod.rs": "mod child;\npub struct Top;\n", "c/src/a/child.rs":
             "use super::Top;\npub struct Leaf;\n", "c/src/b.rs": "use crate::a::child::Leaf;\n",
             "c/src/lib.rs": "mod a;\nmod b;\n", "c/src/a/extra.rs": ""},
            0,
            "",
        ),
        (
            "parent and child importing each other",
            {**crate, "c/src/a/mod.rs": "mod child;\npub struct Top(child::Leaf);\n",
             "c/src/a/child.rs": "use super::Top;\npub struct Leaf;\n"},
            1,
            "c/src/a/child.rs -> c/src/a/mod.rs: Top",
        ),
        (
            "python cycle",
            {**crate, "python/kvferry/__init__.py": "", "python/kvferry/x.py": "from kvferry import y\n",
             "python/kvferry/y.py": "def f():\n    from .x import g\n"},
            1,
            "python/kvferry/y.py -> python/kvferry/x.py: g",
        ),
        (
            "oversized file",
            {**crate, "c/src/b.rs": "use crate::a::Leaf;\n" + "//\n" * 701},
            1,
            "c/src/b.rs: 702 lines",
        ),
        (
            "test code is not counted",
            {**crate, "c/src/b.rs": "use crate::a::Leaf;\n#[cfg(test)]\nmod tests {\n" + "//\n" * 800 + "}\n"},
            0,
            "",
        ),
    ]
    bad = 0
    for what, files, want_rc, want_text in checks:
        rc, err = run(files)
        ok = rc == want_rc and want_text in err
        bad += not ok
        print(f"self-test {'ok  ' if ok else 'FAIL'} {what}" + ("" if ok else f": rc {rc}\n{err}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(self_test() if sys.argv[1:] == ["--self-test"] else main())
