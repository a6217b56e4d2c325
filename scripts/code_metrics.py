#!/usr/bin/env python3
"""Measures of the code's shape, for the restructuring's before/after table (issue 29).

    python3 scripts/code_metrics.py [--src src/ckptool] [--json]

Prints: lines (all, and code lines: not blank, not comment-only), modules, the longest functions,
functions with more than 10 parameters outside the public API (api.py's public functions and the
click commands, whose parameters are the options), import cycles among ckptool's modules (every
import counts, module-level or inside a function: a cycle through a function-local import is still
a cycle in what depends on what; imports under `if TYPE_CHECKING:` are annotations only and do not
count), and how many imports sit inside functions. Repeated blocks are
the `duplicates` tool's to count (`duplicates --most 200 --repo src`), not this script's.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

MAX_PARAMS = 10


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, is_package: bool, tree: ast.AST, known: set):
    """(imported ckptool module, inside a function?) for each import statement."""
    inside, typing_only = set(), set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` imports are for annotations: no dependency at run time
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            if name in known:
                yield name, id(node) in inside


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            params -= 1 if a.args and a.args[0].arg in ("self", "cls") else 0
            decorated_command = any("command" in ast.unparse(d) for d in node.decorator_list)
            yield node, node.end_lineno - node.lineno + 1, params, decorated_command


def measure(src: Path) -> dict:
    files = sorted(src.rglob("*.py"))
    known = {_module_name(src, f) for f in files}
    graph, local_imports, lines, code_lines, longest, many_params = {}, 0, 0, 0, [], []
    for f in files:
        text = f.read_text()
        tree = ast.parse(text)
        mod = _module_name(src, f)
        lines += text.count("\n")
        code_lines += sum(1 for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#"))
        for target, inside in _imports(mod, f.name == "__init__.py", tree, known):
            local_imports += inside
            if target != mod and not mod.startswith(target + "."):  # a package's own __init__ is not a dependency cycle
                graph.setdefault(mod, set()).add(target)
        for node, length, params, command in _functions(tree):
            where = f"{f.relative_to(src.parent)}:{node.lineno} {node.name}"
            longest.append((length, where))
            public_api = f.name == "api.py" and not node.name.startswith("_") and node.col_offset == 0
            if params > MAX_PARAMS and not public_api and not command:
                many_params.append((params, where))
    longest.sort(reverse=True)
    many_params.sort(reverse=True)
    return {"lines": lines, "code_lines": code_lines, "modules": len(files),
            "longest_functions": longest[:10], "functions_over_60_lines": sum(1 for n, _ in longest if n > 60),
            "functions_over_10_params": many_params, "import_cycles": _cycles(graph),
            "function_local_imports": local_imports}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src" / "ckptool")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = measure(args.src)
    if args.json:
        print(json.dumps(m, indent=1))
        return
    print(f"lines {m['lines']} (code {m['code_lines']}), modules {m['modules']}")
    print(f"functions over 60 lines: {m['functions_over_60_lines']}; longest:")
    for n, where in m["longest_functions"][:5]:
        print(f"  {n:4d}  {where}")
    print(f"functions over {MAX_PARAMS} parameters outside the public API: {len(m['functions_over_10_params'])}")
    for n, where in m["functions_over_10_params"]:
        print(f"  {n:4d}  {where}")
    print(f"import cycles: {len(m['import_cycles'])}")
    for comp in m["import_cycles"]:
        print("  " + " <-> ".join(comp))
    print(f"function-local imports: {m['function_local_imports']}")


if __name__ == "__main__":
    main()
