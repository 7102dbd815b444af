"""The project's import graph, read from the source (ast, so imports inside
functions count too), and the layering it must keep.

    python -m testkit.import_graph > docs/imports.md     # redraw the picture

Layers, top to bottom: a module may import its own package and packages of
lower layers only; packages on one layer never import each other. Inside the
layers, no circle: neither between modules nor between folders (a module at a
package's top counts in that package's folder, so pipelines/'s loose modules
and pipelines/inputs/ may not import each other).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> layer (higher imports lower). Why each sits where it does:
LAYERS: dict[str, int] = {
    "benchmarks": 5,  # measurement scripts run with python -m: import anything, imported by nothing
    "testkit": 4,  # test builders and references: imports anything, imported by no shipped package
    "apps": 3,  # the commands users run (prepack CLI, preflight, report, inspect, plots)
    "gcp": 3,  # deployment tooling: launches the pack command on Dataflow
    "train": 2,  # the Tunix trainer reads shard sets through loaders/
    "pipelines": 1,  # the Beam job: never JAX, so never loaders/ or train/
    "loaders": 1,  # the Grain reader: never Beam, so never pipelines/
    "prepack": 0,  # the core both sides share: row format, packer, templates, tokenizer, manifest, stats
}

# Folders of scripts, not packages (no __init__.py), whose imports are checked all the same.
SCRIPT_FOLDERS = frozenset({"benchmarks"})


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path = ROOT, packages: Iterable[str] = LAYERS) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(path, root)] = path
    return found


def imports_of(here: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """Project modules that module `here` (at `path`) imports, at module level or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != here:
                out.add(target)
    return out


def import_graph(root: Path = ROOT, packages: Iterable[str] = LAYERS) -> dict[str, set[str]]:
    known = project_modules(root, packages)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def module_folders(root: Path = ROOT, packages: Iterable[str] = LAYERS) -> dict[str, str]:
    """module -> the folder it lives in, dotted: a package's __init__ and a module at a package's
    top both count in that package's folder."""
    return {name: name if path.name == "__init__.py" else name.rpartition(".")[0]
            for name, path in project_modules(root, packages).items()}


def folder_graph(graph: Mapping[str, set[str]], folders: Mapping[str, str]) -> dict[str, set[str]]:
    """folder -> the other folders its modules import."""
    out: dict[str, set[str]] = {folder: set() for folder in folders.values()}
    for module, targets in graph.items():
        out[folders[module]] |= {folders[t] for t in targets if folders[t] != folders[module]}
    return out


def upward_imports(graph: Mapping[str, set[str]], layers: Mapping[str, int] = LAYERS) -> list[str]:
    """'a -> b' for every import of a package on the same or a higher layer than the importer's."""
    bad = []
    for module, targets in sorted(graph.items()):
        own = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != own and layers[other] >= layers[own]:
                bad.append(f"{module} -> {target}")
    return bad


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; recursion goes as deep as the longest import chain, a few dozen
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_edges(graph: Mapping[str, set[str]]) -> dict[tuple[str, str], int]:
    """(importer package, imported package) -> number of module-level edges."""
    edges: dict[tuple[str, str], int] = {}
    for module, targets in graph.items():
        for target in targets:
            key = (module.split(".")[0], target.split(".")[0])
            if key[0] != key[1]:
                edges[key] = edges.get(key, 0) + 1
    return edges


def folder_heights(folders_graph: Mapping[str, set[str]]) -> dict[str, int]:
    """folder -> the longest chain of imports below it (0: it imports no other folder), so a folder
    stands above every folder it imports; an edge that closes a circle counts as nothing."""
    heights: dict[str, int] = {}
    open_now: set[str] = set()

    def height(folder: str) -> int:
        if folder not in heights:
            open_now.add(folder)
            heights[folder] = 1 + max((height(t) for t in sorted(folders_graph[folder]) if t not in open_now), default=-1)
            open_now.discard(folder)
        return heights[folder]

    for folder in sorted(folders_graph):
        height(folder)
    return heights


def folder_lines(graph: Mapping[str, set[str]], folders: Mapping[str, str]) -> list[str]:
    """Each package's folders from the top down, with the folders of the same package they import."""
    between = folder_graph(graph, folders)
    heights = folder_heights(between)
    lines = []
    for package in sorted(LAYERS, key=lambda p: (-LAYERS[p], p)):
        mine = sorted((f for f in between if f.split(".")[0] == package), key=lambda f: (-heights[f], f))
        if len(mine) < 2:
            continue
        lines.append(f"- package `{package}`:")
        for folder in mine:
            below = sorted(t for t in between[folder] if t.split(".")[0] == package)
            imports = ", ".join(f"`{_folder_path(t)}`" for t in below) or "(none of its package)"
            lines.append(f"  - `{_folder_path(folder)}` -> {imports}")
    return lines


def _folder_path(folder: str) -> str:
    return folder.replace(".", "/") + "/"


def render_markdown(graph: Mapping[str, set[str]], folders: Mapping[str, str]) -> str:
    packages = sorted(LAYERS, key=lambda p: (-LAYERS[p], p))
    lines = [
        "# Imports",
        "",
        "Generated by `python -m testkit.import_graph > docs/imports.md` from the source (imports inside",
        "functions count). Packages are drawn top to bottom by layer; every arrow points down.",
        "tests/test_import_boundaries.py fails on an arrow up, between packages of one layer, or on a circle",
        "between modules or between folders (a module at a package's top counts in that package's folder).",
        "",
        "```dot",
        "digraph imports {",
        "  rankdir=TB; node [shape=box];",
    ]
    for layer in sorted(set(LAYERS.values()), reverse=True):
        same = " ".join(f'"{p}";' for p in packages if LAYERS[p] == layer)
        lines.append(f"  {{ rank=same; {same} }}")
    for (a, b), n in sorted(package_edges(graph).items()):
        lines.append(f'  "{a}" -> "{b}" [label="{n}"];')
    lines += ["}", "```", "", "## Folders, top down", "",
              "Inside each package, a folder imports only folders listed below it (`pipelines/` stands for the",
              "modules at pipelines' top); no two folders import each other.", ""]
    lines += folder_lines(graph, folders)
    lines += ["", "## Modules and what they import (other packages first)", ""]
    for module in sorted(graph, key=lambda m: (-LAYERS[m.split(".")[0]], m)):
        outside = sorted(t for t in graph[module] if t.split(".")[0] != module.split(".")[0])
        inside = sorted(t for t in graph[module] if t.split(".")[0] == module.split(".")[0])
        if outside or inside:
            lines.append(f"- `{module}` -> " + ", ".join(f"`{t}`" for t in outside + inside))
    lines += ["", f"Upward imports: {len(upward_imports(graph))}. Cycles between modules: {len(cycles(graph))}, "
                  f"between folders: {len(cycles(folder_graph(graph, folders)))}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown(import_graph(), module_folders()))
