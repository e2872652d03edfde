"""``txckpt log``: the lineage graph as data, as a ``git log --graph`` style drawing, and as
Graphviz ``dot`` text.

:func:`build_graph` turns a folded :class:`~txckpt._log.lineage.History` into nodes (newest first),
lanes and a legend; :func:`render_text` and :func:`render_dot` draw it. Retired checkpoints are
left out unless asked for, and ``max_count`` keeps only the newest nodes, so a root with
thousands of saves prints a screenful (and locates only the checkpoints it shows).
"""

from __future__ import annotations

from typing import Any

from .._base.refs import ExternalParent, Ref
from .._root.root import CheckpointRoot
from .common import human_time, table

#: Step lists longer than this are abbreviated in the legend: the first and last few, and a count.
STEPS_SHOWN = 8


def build_graph(
    root: CheckpointRoot, history: Any, *, max_count: int | None = None, include_retired: bool = False
) -> dict[str, Any]:
    """The lineage graph as data: nodes newest first, with lanes and the text drawing.

    ``include_retired``: also show checkpoints retention retired (their data is deleted).
    ``max_count``: show only that many of the newest checkpoints (None: all)."""
    state = history.state
    head = state.head
    current = {c.txid for c in history.in_view(None, include_retired=True)}
    retired = history.retired
    forks: dict[str, list[str]] = {}
    for lid, info in state.lineages.items():
        p = info.parent_ref
        if p is not None:
            forks.setdefault(p.txid, []).append(lid)
    by_lineage: dict[str, list[Any]] = {}
    for c in history.checkpoints.values():
        by_lineage.setdefault(c.lineage, []).append(c)
    for cs in by_lineage.values():
        cs.sort(key=lambda c: (c.step, c.seq))
    position = {c.txid: i for cs in by_lineage.values() for i, c in enumerate(cs)}

    def shown(c: Any) -> bool:
        return include_retired or c.txid not in retired

    def lineage_parent(lid: str) -> str | None:
        info = state.lineages.get(lid)
        p = info.parent_ref if info else None
        return p.txid if p is not None and p.txid in history.checkpoints else None

    def parent_of(c: Any) -> str | None:
        """The nearest shown ancestor: the previous checkpoint of its own lineage, else the fork
        point, skipping hidden (retired) ones."""
        while True:
            i = position[c.txid]
            parent = by_lineage[c.lineage][i - 1].txid if i > 0 else lineage_parent(c.lineage)
            if parent is None:
                return None
            c = history.checkpoints[parent]
            if shown(c):
                return parent

    everything = sorted(history.checkpoints.values(), key=lambda c: (c.seq, c.step), reverse=True)
    visible = [c for c in everything if shown(c)]
    hidden_retired = len(everything) - len(visible)
    chosen = visible if max_count is None else visible[:max_count]
    omitted = len(visible) - len(chosen)

    nodes: list[dict[str, Any]] = []
    for c in chosen:  # only the nodes shown are located: a few reads each on an object store
        path = root.locate(c.ref)
        st = "retired" if c.txid in retired else ("current" if c.txid in current else "abandoned")
        nodes.append(
            {
                "txid": c.txid,
                "step": c.step,
                "lineage": c.lineage,
                "state": st,
                "adopted": c.adopted,
                "path": path,
                "key": _key_display(root, path) if path else None,
                "bytes": c.bytes,
                "time": c.time,
                "parent": parent_of(c),
                "labels": [],
            }
        )
    index = {n["txid"]: n for n in nodes}
    # Decorations, git-style: lineage tips (HEAD first), fork points.
    virtual: list[dict[str, Any]] = []
    for lid, info in sorted(state.lineages.items(), key=lambda kv: (kv[0] != head, -kv[1].created_seq)):
        own = [c for c in by_lineage.get(lid, []) if shown(c)]
        name = f"HEAD -> lineage {lid}" if lid == head else f"lineage {lid}"
        label = f"{name}, {lineage_desc(state, lid)}"
        if own:
            if own[-1].txid in index:
                index[own[-1].txid]["labels"].append(label)
        elif lid == head:
            virtual.append(
                {
                    "txid": None,
                    "step": None,
                    "lineage": lid,
                    "state": "head",
                    "adopted": False,
                    "path": None,
                    "key": None,
                    "bytes": 0,
                    "time": info.created_time,
                    "parent": lineage_parent(lid),
                    "labels": [f"{label}; no checkpoints of its own yet"],
                }
            )
    for txid, children in forks.items():
        if txid in index:
            index[txid]["labels"].append("fork point of " + ", ".join(sorted(children)))
    nodes = virtual + nodes
    lines = draw(nodes, head_first="HEAD" if virtual else None if state.head_tip is None else state.head_tip.txid)
    drawn_lineages = {n["lineage"] for n in nodes}
    lineages = []
    for lid, info in sorted(state.lineages.items(), key=lambda kv: kv[1].created_seq):
        own = by_lineage.get(lid, [])
        p = info.parent
        lineages.append(
            {
                "id": lid,
                "head": lid == head,
                "reason": info.reason,
                "created": info.created_time,
                "parent_lineage": p.lineage if isinstance(p, Ref) else None,
                "fork_step": p.step if isinstance(p, Ref) else None,
                "external_parent": p.path if isinstance(p, ExternalParent) else None,
                "description": lineage_desc(state, lid),
                "steps": [c.step for c in own],
                "abandoned_steps": [c.step for c in own if c.txid not in current and c.txid not in retired],
                "retired_steps": [c.step for c in own if c.txid in retired],
                # Drawn in this graph (with -n, lineages older than what is shown are left out).
                "shown": lid in drawn_lineages or lid == head or max_count is None,
            }
        )
    return {
        "head": head,
        "lines": lines,
        "nodes": nodes,
        "lineages": lineages,
        "omitted": omitted,
        "hidden_retired": hidden_retired,
        "max_count": max_count,
        "include_retired": include_retired,
    }


def lineage_desc(state: Any, lid: str) -> str:
    info = state.lineages.get(lid)
    if info is None:
        return lid
    p = info.parent
    if isinstance(p, Ref):
        return f"forked from {p.lineage} at step {p.step}"
    if isinstance(p, ExternalParent):
        return f"started from external {p.path}"
    return {"adopt": "adopted legacy checkpoints", "root": "root lineage"}.get(info.reason, info.reason)


def _key_display(root: CheckpointRoot, path: str | None) -> str:
    if path is None:
        return "(missing)"
    key = root.storage.key_of(path)
    return key if key else path


def draw(nodes: list[dict[str, Any]], head_first: str | None) -> list[tuple[str, dict[str, Any] | None]]:
    """Lanes like ``git log --graph``: (graph prefix, node or None for a connector line).

    A lane holds the node it expects next (a node's parent), or None when it is free. A chain
    that ends at a root lineage's first checkpoint frees its lane without shifting the others;
    a chain that starts afresh (an unrelated lineage) takes a free lane, never the one drawn
    just above it, so it does not read as that node's parent."""
    columns: list[Any] = [head_first] if head_first is not None else []
    out: list[tuple[str, dict[str, Any] | None]] = []
    above: int | None = None  # the lane of the previous node's "*"

    def trim() -> None:
        while columns and columns[-1] is None:
            columns.pop()

    for n in nodes:
        me = n["txid"] if n["txid"] is not None else "HEAD"
        hits = [i for i, t in enumerate(columns) if t == me]
        if not hits:
            col = next(i for i in range(len(columns) + 2) if (i >= len(columns) or columns[i] is None) and i != above)
            columns.extend([None] * (col + 1 - len(columns)))
            columns[col] = me
            hits = [col]
        col = hits[0]
        for j in reversed(hits[1:]):  # merge extra lanes into the leftmost: "|/", "|_|/"
            chars = [" "] * (2 * len(columns))
            for k in range(j):
                if columns[k] is not None:
                    chars[2 * k] = "|"
            for pos in range(2 * col + 1, 2 * j - 1, 2):
                chars[pos] = "_"
            chars[2 * j - 1] = "/"
            for k in range(j + 1, len(columns)):
                if columns[k] is not None:
                    chars[2 * k - 1] = "/"
            out.append(("".join(chars).rstrip(), None))
            del columns[j]
        cells = ["*" if k == col else ("|" if t is not None else " ") for k, t in enumerate(columns)]
        out.append((" ".join(cells), n))
        above = col
        columns[col] = n["parent"]
        trim()
    return out


def abbreviate_steps(items: list[str], limit: int = STEPS_SHOWN) -> str:
    """``a, b, c`` for a few; ``a, b, c, ..., x, y, z (N)`` for more than ``limit``."""
    if len(items) <= limit:
        return ", ".join(items) or "-"
    k = max(1, (limit - 2) // 2)
    return f"{', '.join(items[:k])}, ..., {', '.join(items[-k:])} ({len(items)} checkpoints)"


def render_text(graph: dict[str, Any]) -> str:
    width = max((len(p) for p, _ in graph["lines"]), default=0)
    out = []
    for prefix, n in graph["lines"]:
        if n is None:
            out.append(prefix)
            continue
        labels = f"  ({'; '.join(n['labels'])})" if n["labels"] else ""
        if n["txid"] is None:
            out.append(f"{prefix.ljust(width)}  {labels.strip()}")
            continue
        state = n["state"] + (",adopted" if n["adopted"] else "")
        where = n["key"] or "(data missing)" if n["state"] != "retired" else (n["key"] or "(deleted)")
        out.append(
            f"{prefix.ljust(width)}  step {str(n['step']).ljust(6)} {n['lineage']}  {state.ljust(9)}  {where}{labels}"
        )
    with_retired = graph["include_retired"]
    out.append("")
    out.append("lineages:")
    rows = []
    for l in reversed([l for l in graph["lineages"] if l["shown"]]):
        steps = abbreviate_steps(
            [
                f"{s}{'*' if s in l['abandoned_steps'] else ''}{'~' if s in l['retired_steps'] else ''}"
                for s in l["steps"]
                if with_retired or s not in l["retired_steps"]
            ]
        )
        rows.append(
            [
                f"  {l['id']}",
                "HEAD" if l["head"] else "",
                l["description"],
                f"created {human_time(l['created'])}",
                f"steps: {steps}",
            ]
        )
    out.append(table(rows, ["", "", "", "", ""]).split("\n", 1)[1] if rows else "  (none)")
    hidden_lineages = sum(not l["shown"] for l in graph["lineages"])
    notes = []
    if any(l["abandoned_steps"] for l in graph["lineages"] if l["shown"]):
        notes.append("* abandoned: kept intact, not in the current lineage")
    if with_retired and any(l["retired_steps"] for l in graph["lineages"] if l["shown"]):
        notes.append("~ retired by the retention policy")
    if graph["omitted"]:
        notes.append(
            f"{graph['omitted']} older checkpoint(s)"
            + (f" and {hidden_lineages} lineage(s)" if hidden_lineages else "")
            + f" not shown (-n {graph['max_count']})"
        )
    if graph["hidden_retired"] and not with_retired:
        notes.append(f"{graph['hidden_retired']} retired checkpoint(s) hidden (--all shows them)")
    out.extend(f"  ({note})" for note in notes)
    return "\n".join(out)


# ----- Graphviz ------------------------------------------------------------------------------------
_DOT_STYLE = {
    "current": 'style="filled", fillcolor="#d6eaff", color="#1f5f99"',
    "abandoned": 'style="dashed", color="#888888", fontcolor="#666666"',
    "retired": 'style="dotted", color="#bbbbbb", fontcolor="#999999"',
    "head": 'style="dashed", color="#1f5f99", fontcolor="#1f5f99"',
}


def _q(text: Any) -> str:
    """A dot double-quoted string."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(graph: dict[str, Any], title: str) -> str:
    """The graph as Graphviz ``dot`` text: one cluster per lineage, an edge from each checkpoint
    to the next one after it (solid within a lineage, bold and labelled across a fork),
    ``HEAD`` pointing at the current lineage's newest checkpoint. Render it with
    ``txckpt log ROOT --format dot | dot -Tpng -o lineages.png``."""
    nodes = graph["nodes"]
    ids = {n["txid"] if n["txid"] is not None else "HEAD": f"n{i}" for i, n in enumerate(nodes)}
    lineage_of = {n["txid"]: n["lineage"] for n in nodes if n["txid"] is not None}
    out = [
        "digraph txckpt {",
        "  rankdir=LR;",
        f"  label={_q(title + ' (filled: current lineage; dashed: abandoned; dotted: retired)')};",
        '  labelloc="t"; fontname="Helvetica";',
        '  node [shape=box, fontname="Helvetica", fontsize=11];',
        '  edge [color="#555555", fontname="Helvetica", fontsize=10];',
    ]
    shown = [l for l in graph["lineages"] if l["shown"]]
    for k, l in enumerate(reversed(shown)):
        members = [n for n in nodes if n["lineage"] == l["id"]]
        title_l = f"lineage {l['id']}{' (HEAD)' if l['head'] else ''}\n{l['description']}"
        out.append(f"  subgraph cluster_{k} {{")
        out.append(f"    label={_q(title_l)};")
        out.append(f'    style="rounded"; color={_q("#1f5f99" if l["head"] else "#aaaaaa")};')
        for n in members:
            if n["txid"] is None:
                label = "no checkpoints\nof its own yet"
            else:
                label = f"step {n['step']}\n{n['state']}" + (", adopted" if n["adopted"] else "")
                if any(t.startswith("fork point") for t in n["labels"]):
                    label += "\nfork point"
            node_id = ids[n["txid"] if n["txid"] is not None else "HEAD"]
            out.append(f"    {node_id} [label={_q(label)}, {_DOT_STYLE[n['state']]}];")
        out.append("  }")
    for n in nodes:
        me = ids[n["txid"] if n["txid"] is not None else "HEAD"]
        parent = n["parent"]
        if parent is None or parent not in ids:
            continue
        attrs = []
        if lineage_of.get(parent) != n["lineage"]:
            attrs.append('label="fork", style="bold", color="#1f5f99"')
        elif n["state"] in ("abandoned", "retired"):
            attrs.append('style="dashed"' if n["state"] == "abandoned" else 'style="dotted"')
        out.append(f"  {ids[parent]} -> {me}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    head_node = next((n for n in nodes if n["txid"] is None), None) or next(
        (n for n in nodes if any(t.startswith("HEAD ->") for t in n["labels"])), None
    )
    if head_node is not None:
        out.append('  HEAD [shape=plaintext, fontcolor="#1f5f99", label="HEAD"];')
        out.append(
            f"  HEAD -> {ids[head_node['txid'] if head_node['txid'] is not None else 'HEAD']} "
            '[color="#1f5f99", arrowhead="vee"];'
        )
    out.append("}")
    return "\n".join(out)
