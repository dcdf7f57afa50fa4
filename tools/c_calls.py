"""Which C file of a directory uses which: the file graph, and its cycles.

For every ``.c`` file of a directory (not its subdirectories), after comments,
string and character literals are blanked out:

- the functions and variables it defines at file scope, and which of them are
  ``static``;
- every use of a function or variable that another file of the directory
  defines without ``static``: a call, or a function's name taken as a pointer
  (a table of entry points depends on the functions in it as much as a call
  does). A field of the same name (``real.cuMemCreate(``, ``p->fn(``, a member
  declared in a struct body) is not a use.

The files and those uses make a directed graph; a cycle in it is a circle of
files that need each other. Exit status 1 with every cycle printed, 0 when the
graph is acyclic, 2 on a usage error.

    python tools/c_calls.py shim_c            # edges, then "acyclic" or the cycles
    python tools/c_calls.py shim_c --dot      # the graph in Graphviz dot
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

TOKEN = re.compile(r"[A-Za-z_]\w*|->|\S")
IDENT = re.compile(r"[A-Za-z_]\w*")
MACRO = re.compile(r"[A-Z][A-Z0-9_]*")  # SHIM_HIDDEN, CUDAAPI: not a declared name
TAGS = frozenset(("struct", "union", "enum"))
QUALIFIERS = frozenset(
    ("static", "const", "volatile", "inline", "register", "_Thread_local", "__thread")
)
ATTRIBUTES = frozenset(("__attribute__", "__typeof__", "typeof", "_Alignas"))
# Words followed by a parenthesis that are not a function's name.
KEYWORDS = (
    ATTRIBUTES
    | frozenset(("if", "while", "for", "switch", "return", "sizeof", "_Alignof", "_Static_assert"))
    | frozenset(("defined", "do", "else", "case", "goto"))
)


def strip_c(text: str) -> str:
    """Blank out comments, string and character literals, keeping line breaks."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + re.sub(r"[^\n]", " ", text[i + 1 : j - 1]) + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def drop_directives(text: str) -> str:
    """Blank out preprocessor directives (with their continuation lines)."""
    lines = text.split("\n")
    inside = False
    for k, line in enumerate(lines):
        if inside or line.lstrip().startswith("#"):
            inside = line.rstrip().endswith("\\")
            lines[k] = ""
    return "\n".join(lines)


@dataclass
class CFile:
    """One file: the functions it defines and the identifiers it uses."""

    name: str
    exported: set[str] = field(default_factory=set)  # defined without static
    local: set[str] = field(default_factory=set)  # defined static
    uses: list[str] = field(default_factory=list)  # identifiers not after . or ->


def skip_group(tokens: list[str], i: int) -> int:
    """The index of the bracket that closes the one at ``i``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    opening, depth = tokens[i], 0
    for j in range(i, len(tokens)):
        if tokens[j] == opening:
            depth += 1
        elif tokens[j] == pairs[opening]:
            depth -= 1
            if depth == 0:
                return j
    return len(tokens) - 1


def declared_variables(head: list[str]) -> Iterable[str]:
    """The variables a file-scope declaration without a body defines."""
    if "typedef" in head or "extern" in head:
        return
    flat: list[str] = []  # groups collapsed: "()" a parameter list, "@name" a (*name)
    k = 0
    while k < len(head):
        t = head[k]
        if t in ATTRIBUTES and head[k + 1 : k + 2] == ["("]:
            k = skip_group(head, k + 1) + 1
        elif t == "(":
            j = skip_group(head, k)
            inner = [x for x in head[k + 1 : j] if x not in ("*", "const")]
            pointer = head[k + 1 : k + 2] == ["*"] and len(inner) == 1
            flat.append("@" + inner[0] if pointer and IDENT.fullmatch(inner[0]) else "()")
            k = j + 1
        elif t in ("[", "{"):
            if t == "{" and flat and flat[-1] in TAGS:
                flat.append("__anonymous__")
            k = skip_group(head, k) + 1
        else:
            flat.append(t)
            k += 1
    declarators: list[list[str]] = [[]]
    for t in flat:
        if t == ",":
            declarators.append([])
        elif t not in QUALIFIERS and t != "*" and not MACRO.fullmatch(t):
            declarators[-1].append(t)
    for n, words in enumerate(declarators):
        pointers = [w[1:] for w in words if w.startswith("@")]
        if pointers:
            yield pointers[0]
            continue
        if "()" in words:
            continue  # a prototype
        names = [w for w in words if IDENT.fullmatch(w)]
        type_words = 0 if n else (2 if names[:1] and names[0] in TAGS else 1)
        if len(names) > type_words:
            yield names[-1]


def definitions(code: str) -> Iterable[tuple[str, bool]]:
    """(name, is_static) of every function and variable defined at file scope."""
    tokens = TOKEN.findall(code)
    start = 0  # first token of the current file-scope declaration
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t == "(" and i > 0 and IDENT.fullmatch(tokens[i - 1]) and tokens[i - 1] not in KEYWORDS:
            j = skip_group(tokens, i)
            if j + 1 < len(tokens) and tokens[j + 1] == "{":
                yield tokens[i - 1], "static" in tokens[start : i - 1]
                i = skip_group(tokens, j + 1) + 1  # past the body
                start = i
                continue
            i = j + 1
            continue
        if t in ("{", "["):
            i = skip_group(tokens, i) + 1
            continue
        if t == ";":
            head = tokens[start:i]
            if "=" in head:
                head = head[: head.index("=")]
            for name in declared_variables(head):
                yield name, "static" in head
            start = i + 1
        i += 1


def uses(code: str) -> list[str]:
    """Identifiers that are not a field: not right after ``.`` or ``->``, and not
    declared inside a struct, union or enum body."""
    tokens = TOKEN.findall(code)
    found: list[str] = []
    k = 0
    while k < len(tokens):
        t = tokens[k]
        tagged = k >= 1 and (tokens[k - 1] in TAGS or (k >= 2 and tokens[k - 2] in TAGS))
        if t == "{" and tagged:
            k = skip_group(tokens, k) + 1
            continue
        if IDENT.fullmatch(t) and (k == 0 or tokens[k - 1] not in (".", "->")):
            found.append(t)
        k += 1
    return found


def read_dir(directory: Path) -> list[CFile]:
    files = []
    for path in sorted(directory.glob("*.c")):
        code = strip_c(path.read_text(encoding="utf-8", errors="replace"))
        cf = CFile(path.name)
        for name, is_static in definitions(drop_directives(code)):
            (cf.local if is_static else cf.exported).add(name)
        cf.uses = uses(code)
        files.append(cf)
    return files


Graph = dict[str, dict[str, set[str]]]  # file -> file it uses -> functions used


def build_graph(files: list[CFile]) -> Graph:
    owner: dict[str, str] = {}
    for cf in files:
        for name in cf.exported:
            owner.setdefault(name, cf.name)
    graph: Graph = {cf.name: {} for cf in files}
    for cf in files:
        for name in cf.uses:
            target = owner.get(name)
            if target is None or target == cf.name or name in cf.local or name in cf.exported:
                continue
            graph[cf.name].setdefault(target, set()).add(name)
    return graph


def cycles(graph: Mapping[str, Mapping[str, set[str]]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one file."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [cycle_in(graph, set(c), c[0]) for c in components]


def cycle_in(
    graph: Mapping[str, Mapping[str, set[str]]], members: set[str], first: str
) -> list[str]:
    """A shortest path from ``first`` back to itself inside ``members``."""
    previous: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == first:
                    path = [v]
                    while path[-1] != first:
                        path.append(previous[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{first} is in a component but on no cycle")


def describe(graph: Graph) -> str:
    lines = []
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            lines.append(f"{src} -> {dst}: {', '.join(sorted(graph[src][dst]))}")
    return "\n".join(lines)


def dot(graph: Graph) -> str:
    lines = ["digraph c_files {"]
    lines += [f'  "{src}";' for src in sorted(graph)]
    lines += [f'  "{src}" -> "{dst}";' for src in sorted(graph) for dst in sorted(graph[src])]
    return "\n".join([*lines, "}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--dot", action="store_true", help="print the graph in Graphviz dot")
    parser.add_argument("--quiet", action="store_true", help="print only the cycles")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a directory")
    graph = build_graph(read_dir(args.directory))
    found = cycles(graph)
    if args.dot:
        print(dot(graph))
    elif not args.quiet:
        print(describe(graph))
    for cycle in found:
        print("cycle: " + " -> ".join(cycle), file=sys.stderr if args.dot else sys.stdout)
    if not found:
        print(
            f"{args.directory}: acyclic ({len(graph)} files)",
            file=sys.stderr if args.dot else sys.stdout,
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
