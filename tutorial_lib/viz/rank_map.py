"""The rank map: which GPU holds which rank, and who talks to whom.

``rank_map(world_size=16, gpus_per_node=8, tp=2, pp=2, ep=2)`` draws the ranks
of a parallel layout onto nodes of ``gpus_per_node`` GPUs and colours every GPU
by the communicator group it belongs to.  Two panels sit side by side: the dense
kinds (tp, cp, dp, pp, dp_cp, mp, embedding) and the expert kinds (ep,
expert_tp, expert_dp), because in Megatron's folded layout they are two grids.

The widget has to work in two places:

* live in Jupyter, and
* in the built HTML book, where no Python kernel runs.

So it is one self-contained HTML fragment (a :class:`~tutorial_lib.viz.widget.Widget`)
whose interactivity is plain JavaScript, ``viz/assets/rank_map.js``, inlined into the
page.  The JavaScript never does rank arithmetic: Python
(:mod:`tutorial_lib.grid`, the single source of truth) computes the groups of
every configuration the knobs can reach, and the page only looks them up.

Each panel also says what the selected kind's groups carry: the collective, how often,
and the bytes per op (:data:`KIND_TRAFFIC`).

The embedded data (``RankMap.data``, the fragment's JSON island) is shared-table JSON,
to stay small:

``group_sets``
    Distinct group lists, each with Python's node-crossing flag per group.
``coord_sets``
    Distinct per-rank coordinate arrays (one value per rank).
``configs``
    One entry per valid configuration: its ``describe()`` line, its layout, and
    indices into the two tables (aligned with ``all_kinds`` and the layout's ``dims``).
``table``
    Nested lists indexed by the position of each knob's value (``knobs`` order):
    a number ``i >= 0`` is ``configs[i]``; ``i < 0`` is ``errors[-1 - i]``, the
    :class:`~tutorial_lib.config.ConfigError` message Python raised.

:meth:`RankMap.lookup` unpacks an entry exactly as the JavaScript does.
"""
from __future__ import annotations

import html
import json
import math
import numbers
import uuid

from ..config import LAYOUTS, ConfigError
from ..grid import EXTRA_GROUP_KINDS, GROUP_KINDS, LAYOUT_ORDERS, ProcessGrid, build_grid
from . import draw
from .widget import Widget

#: Kinds drawn in the dense panel and in the expert panel.
DENSE_KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "mp", "embedding")
EXPERT_KINDS = ("ep", "expert_tp", "expert_dp")
ALL_KINDS = DENSE_KINDS + EXPERT_KINDS
assert sorted(ALL_KINDS) == sorted(GROUP_KINDS + EXTRA_GROUP_KINDS)

#: Button labels.
KIND_LABELS = {
    "tp": "TP", "cp": "CP", "dp": "DP", "pp": "PP", "dp_cp": "DP\u00d7CP",
    "mp": "MP (TP\u00d7PP)", "embedding": "Embedding",
    "ep": "EP", "expert_tp": "Expert TP", "expert_dp": "Expert DP",
}

#: What each kind of group carries in a Megatron-style training step: (collective, how
#: often, bytes one rank hands to one op; ``b*s*h*d bytes``: the formula comes first).  Symbols as in :mod:`tutorial_lib.costs.bandwidth`
#: (b microbatch, s sequence, h hidden, h_kv key/value width, k experts per token, P
#: parameters on the rank, V vocabulary, d bytes per element); the five kinds of its
#: bandwidth table say the same there (tests/unit/test_rank_map.py checks).
KIND_TRAFFIC = {
    "tp": ("all-reduce of activations (reduce-scatter + all-gather with sequence "
           "parallelism)", "2 per layer forward, 2 backward", "b*s*h*d bytes"),
    "cp": ("K and V chunks passed around a ring (send/recv)",
           "every attention layer, forward and backward", "2*b*s*h_kv*d bytes per hop"),
    "dp": ("all-reduce of gradients (reduce-scatter + all-gather with a distributed "
           "optimizer)", "once per optimizer step", "P*d bytes"),
    "pp": ("send/recv of activations forward, their gradients backward",
           "every microbatch at every stage boundary", "b*s*h*d bytes"),
    "dp_cp": ("the gradient all-reduce of dp, widened over cp when CP > 1",
              "once per optimizer step", "P*d bytes"),
    "mp": ("all-reduce of a few numbers: the gradient norm, the inf/NaN flag",
           "once per optimizer step (without a distributed optimizer)", "a few bytes"),
    "embedding": ("all-reduce of the tied word-embedding gradient (first and last stage)",
                  "once per optimizer step", "V*h*d/TP bytes"),
    "ep": ("all-to-all of token copies: dispatch, then combine",
           "2 per MoE layer forward, 2 backward", "b*s*h*k*d bytes"),
    "expert_tp": ("all-gather of the dispatched tokens, reduce-scatter of the expert "
                  "outputs (when ETP > 1)", "every MoE layer, forward and backward",
                  "the token rows the dispatch delivered"),
    "expert_dp": ("all-reduce of the routed experts' gradients", "once per optimizer step",
                  "P_expert*d bytes"),
}
assert sorted(KIND_TRAFFIC) == sorted(ALL_KINDS)


def traffic_line(kind: str) -> str:
    """One line for the map: what a group of ``kind`` runs, how often, on how many bytes."""
    collective, when, volume = KIND_TRAFFIC[kind]
    return (f"{KIND_LABELS[kind]} groups run {collective}; {when}; "
            f"per op: {volume.replace('*', chr(0xb7))}")


#: The knobs of the static page, in the order of the nested lookup ``table``.
KNOBS = ("layout", "tp", "pp", "ep", "cp", "etp")

#: Knob sizes are the powers of two dividing the world, up to this.
MAX_KNOB_SIZE = 8

#: Budget for the precomputed data, in (configurations x ranks).  World 16 with
#: every knob free is 3 * 4**5 * 16 = 49,152; bigger worlds fix knobs instead.
KNOB_BUDGET = 50_000

#: Knobs fixed at their initial value, in this order, while over budget.
FREEZE_ORDER = ("etp", "cp", "layout", "pp", "ep", "tp")


# --- Python computes everything -------------------------------------------


def rank_formula(order: str) -> str:
    """``"tp-cp-dp-pp"`` -> ``"rank = tp + TP·(cp + CP·(dp + DP·pp))"`` (fastest first)."""
    dims = order.split("-")
    expr = dims[-1]
    for dim in reversed(dims[:-1]):
        inner = expr if "+" not in expr else f"({expr})"
        expr = f"{dim} + {dim.upper()}\u00b7{inner}"
    return f"rank = {expr}"


def crossing_flags(groups: list[list[int]], gpus_per_node: int) -> list[bool]:
    """For each group, whether its ranks sit on more than one node (so it leaves NVLink).

    Ranks fill nodes in order: rank ``r`` is GPU ``r % gpus_per_node`` of node
    ``r // gpus_per_node``, as a launcher such as torchrun places them.
    """
    return [len({r // gpus_per_node for r in group}) > 1 for group in groups]


def crossing_summary(kind: str, groups: list[list[int]], crosses: list[bool]) -> str:
    """One line: how many groups of ``kind`` there are and how many cross nodes."""
    n, size = len(groups), len(groups[0])
    label = KIND_LABELS[kind]
    if size == 1:
        return f"{label}: {n} groups of 1 rank \u2014 nothing to communicate"
    head = f"{label}: {n} group{'s' * (n > 1)} of {size} ranks \u2014 "
    k = sum(crosses)
    if k == 0:
        return head + "all inside one node (NVLink)"
    return head + f"{k} of {n} cross a node boundary (\u21c4 leaves NVLink)"


def _layout_info(layout: str) -> dict:
    """Titles, rank formulas and coordinate names of a layout."""
    orders = LAYOUT_ORDERS[layout]
    if len(orders) == 2:  # Megatron's folding: two grids sharing PP
        dense, expert = orders
        return {
            "folded": True,
            "dense_title": f"Dense grid \u00b7 {dense}",
            "expert_title": f"Expert grid \u00b7 {expert} (folded: shares PP)",
            "dense_formula": rank_formula(dense),
            "expert_formula": rank_formula(expert),
            "dense_dims": dense.split("-"),
            "expert_dims": expert.split("-"),
            # ProcessGrid.coords: the dense grid's, then the expert grid's minus pp
            "dims": dense.split("-") + [d for d in expert.split("-") if d != "pp"],
        }
    (order,) = orders
    return {
        "folded": False,
        "dense_title": f"Dense groups \u00b7 one grid {order}",
        "expert_title": "Expert groups \u00b7 same grid, same rank positions",
        "dense_formula": rank_formula(order),
        "expert_formula": rank_formula(order),
        "dense_dims": order.split("-"),
        "expert_dims": [],
        "dims": order.split("-"),
    }


def _knob_values(world_size: int, initial: dict) -> dict[str, list]:
    """Each knob's choices: powers of two dividing the world up to MAX_KNOB_SIZE, plus the initial value."""
    sizes = [s for s in (2 ** i for i in range(MAX_KNOB_SIZE.bit_length())) if world_size % s == 0]
    values = {"layout": list(LAYOUTS)}
    for knob in KNOBS[1:]:
        values[knob] = sorted(set(sizes) | {initial[knob]})
    return values


def _freeze_to_budget(world_size: int, values: dict, initial: dict) -> list[str]:
    """Fix knobs at their initial value until configurations x ranks fits KNOB_BUDGET."""
    frozen = []
    for knob in FREEZE_ORDER:
        if math.prod(len(v) for v in values.values()) * world_size <= KNOB_BUDGET:
            break
        values[knob] = [initial[knob]]
        frozen.append(knob)
    return frozen


class _Interner:
    """Stores each distinct value once and hands out its index."""

    def __init__(self):
        self.items, self._index = [], {}

    def __call__(self, value) -> int:
        key = json.dumps(value)
        if key not in self._index:
            self._index[key] = len(self.items)
            self.items.append(value)
        return self._index[key]


def build_data(world_size: int = 16, gpus_per_node: int = 8, tp: int = 2, pp: int = 2, ep: int = 2,
               cp: int = 1, etp: int = 1, layout: str = "megatron", kind: str = "tp",
               knobs: bool = True) -> dict:
    """Everything the page shows, as JSON-able data (see the module docstring).

    Raises :class:`ConfigError` if the initial configuration is invalid.
    """
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, numbers.Integral) or gpus_per_node < 1:
        raise ConfigError("malformed", f"gpus_per_node must be a whole number >= 1, got {gpus_per_node!r}")
    if kind not in ALL_KINDS:
        raise ValueError(f"unknown group kind {kind!r}; kinds are {', '.join(ALL_KINDS)}")
    build_grid(world_size, tp, pp, ep, cp, etp, layout)  # invalid initial config: raise now

    initial = {"layout": layout, "tp": tp, "pp": pp, "ep": ep, "cp": cp, "etp": etp}
    values = {k: [v] for k, v in initial.items()}
    frozen = []
    if knobs:
        values = _knob_values(world_size, initial)
        frozen = _freeze_to_budget(world_size, values, initial)

    group_sets, coord_sets, errors = _Interner(), _Interner(), _Interner()
    configs = []

    def entry(combo: dict) -> int:
        """Index into configs (>= 0) or -1 - index into errors, for one knob setting."""
        try:
            grid = build_grid(world_size, combo["tp"], combo["pp"], combo["ep"], combo["cp"],
                              combo["etp"], combo["layout"])
        except ConfigError as err:
            return -1 - errors(str(err))
        configs.append(_config_entry(grid, gpus_per_node, group_sets, coord_sets))
        return len(configs) - 1

    def nest(level: int, combo: dict):
        """The lookup table, one list level per knob."""
        if level == len(KNOBS):
            return entry(combo)
        knob = KNOBS[level]
        return [nest(level + 1, {**combo, knob: v}) for v in values[knob]]

    table = nest(0, {})
    first = _walk(table, [values[k].index(initial[k]) for k in KNOBS])
    side = "expert" if kind in EXPERT_KINDS else "dense"
    return {
        "world_size": world_size,
        "gpus_per_node": gpus_per_node,
        "num_nodes": math.ceil(world_size / gpus_per_node),
        "node_of": [r // gpus_per_node for r in range(world_size)],
        "gpu_of": [r % gpus_per_node for r in range(world_size)],
        "kinds": {"dense": list(DENSE_KINDS), "expert": list(EXPERT_KINDS)},
        "all_kinds": list(ALL_KINDS),
        "kind_labels": KIND_LABELS,
        "kind_colors": {k: draw.kind_color(k) for k in ALL_KINDS},
        "kind_text": {k: draw.text_color(draw.kind_color(k)) for k in ALL_KINDS},
        "kind_traffic": {k: traffic_line(k) for k in ALL_KINDS},
        "palette": list(draw.PALETTE),
        "palette_text": [draw.text_color(c) for c in draw.PALETTE],
        "singleton_color": draw.SINGLETON_COLOR,
        "singleton_text": draw.text_color(draw.SINGLETON_COLOR),
        "layouts": {name: _layout_info(name) for name in LAYOUTS},
        "knobs_enabled": knobs,
        "knobs": [{"name": k, "values": values[k], "frozen": k in frozen or not knobs} for k in KNOBS],
        "table": table,
        "configs": configs,
        "group_sets": group_sets.items,
        "coord_sets": coord_sets.items,
        "errors": errors.items,
        "initial": {
            "config": first,
            "knobs": initial,
            "dense_kind": kind if side == "dense" else "tp",
            "expert_kind": kind if side == "expert" else "ep",
        },
    }


def _config_entry(grid: ProcessGrid, gpus_per_node: int, group_sets, coord_sets) -> dict:
    """One configuration: groups and coordinates as indices into the shared tables."""
    groups = []
    for kind in ALL_KINDS:
        g = grid.groups(kind)
        groups.append(group_sets({"groups": g, "crosses": [int(x) for x in crossing_flags(g, gpus_per_node)]}))
    dims = _layout_info(grid.layout)["dims"]
    all_coords = [grid.coords(r) for r in range(grid.world_size)]
    coords = [coord_sets([c[d] for c in all_coords]) for d in dims]
    return {"layout": grid.layout, "describe": grid.describe(), "groups": groups, "coords": coords}


def _walk(table, indices):
    """Follow one index per knob down the nested lookup table."""
    for i in indices:
        table = table[i]
    return table


# --- the widget ---------------------------------------------------------------


class RankMap(Widget):
    """A rank map ready to display: one self-contained HTML fragment (see :class:`Widget`).

    Its root id (``prefix``) is fixed per instance and starts every class and style of
    the map, so two maps on one page never clash.
    """

    styles = ("rank_map.css",)
    scripts = ("rank_map.js",)
    start = "startRankMap"

    def __init__(self, data: dict):
        self.data = data
        # A fresh prefix per instance: ids, classes and styles of two maps never clash.
        self.prefix = "rm" + uuid.uuid4().hex[:10]

    @property
    def title(self) -> str:
        return _title(self.data)

    @property
    def data_class(self) -> str:
        return f"{self.prefix}-data"

    def root_id(self) -> str:
        return self.prefix

    def parts(self, uid: str) -> tuple[str, str, object]:
        return (f'id="{uid}" class="{uid}-root tl-rank-map" data-selected-rank=""',
                _render(self.data, uid), self.data)

    def lookup(self, layout=None, tp=None, pp=None, ep=None, cp=None, etp=None) -> dict:
        """What the page shows for one knob setting (unset knobs keep their initial value).

        Returns ``{"layout", "describe", "groups": {kind: [[ranks]]}, "crosses": {kind:
        [bool]}, "coords": {dim: [per rank]}}``, or ``{"error": message}`` for a setting
        Python rejected.  Raises ``KeyError`` for a setting the knobs do not offer.
        """
        asked = {"layout": layout, "tp": tp, "pp": pp, "ep": ep, "cp": cp, "etp": etp}
        indices = []
        for knob in self.data["knobs"]:
            value = asked[knob["name"]]
            value = self.data["initial"]["knobs"][knob["name"]] if value is None else value
            if value not in knob["values"]:
                raise KeyError(f"{knob['name']}={value!r} is not among the knob's values {knob['values']}")
            indices.append(knob["values"].index(value))
        found = _walk(self.data["table"], indices)
        if found < 0:
            return {"error": self.data["errors"][-1 - found]}
        return _resolve(self.data, found)

    def __repr__(self) -> str:
        config = self.data["configs"][self.data["initial"]["config"]]
        return f"<RankMap {config['describe']}; {len(self.data['configs'])} precomputed configurations>"


def _resolve(data: dict, index: int) -> dict:
    """Unpack ``data["configs"][index]`` from the shared tables (mirrors ``resolve`` in the JS)."""
    entry = data["configs"][index]
    out = {"layout": entry["layout"], "describe": entry["describe"], "groups": {}, "crosses": {}, "coords": {}}
    for kind, i in zip(data["all_kinds"], entry["groups"]):
        out["groups"][kind] = data["group_sets"][i]["groups"]
        out["crosses"][kind] = [bool(x) for x in data["group_sets"][i]["crosses"]]
    for dim, i in zip(data["layouts"][entry["layout"]]["dims"], entry["coords"]):
        out["coords"][dim] = data["coord_sets"][i]
    return out


def rank_map(world_size: int = 16, gpus_per_node: int = 8, tp: int = 2, pp: int = 2, ep: int = 2,
             cp: int = 1, etp: int = 1, layout: str = "megatron", kind: str = "tp",
             knobs: bool = True) -> RankMap:
    """Draw ranks on nodes x GPUs, coloured by communicator group; see the module docstring.

    ``kind`` is the group kind selected first (its panel's; the other panel starts
    on tp or ep).  With ``knobs=True`` the page carries <select> knobs for layout,
    TP, PP, EP, CP and ETP that switch between configurations precomputed here.
    An invalid configuration raises :class:`~tutorial_lib.config.ConfigError`.
    """
    return RankMap(build_data(world_size, gpus_per_node, tp, pp, ep, cp, etp, layout, kind, knobs))


def rank_map_explorer(world_size: int = 16, gpus_per_node: int = 8, tp: int = 2, pp: int = 2,
                      ep: int = 2, cp: int = 1, etp: int = 1, layout: str = "megatron"):
    """Live-kernel version: ipywidgets dropdowns (world size included) that redraw via Python.

    The map sits in an ``ipywidgets.HTML`` widget, which shows the picture Python drew
    (colours, node-crossing marks, summaries) but runs no script: hover and click
    belong to :func:`rank_map`.  (An ``Output`` widget would run the script live, but
    the offline widget manager of the built book fails to render it.)
    """
    import ipywidgets as widgets

    def choices(options, value):  # the starting value is always offered
        return sorted(set(options) | {value})

    dropdowns = {
        "world_size": widgets.Dropdown(options=choices([4, 8, 16, 32, 64], world_size), value=world_size,
                                       description="world"),
        "gpus_per_node": widgets.Dropdown(options=choices([1, 2, 4, 8], gpus_per_node), value=gpus_per_node,
                                          description="GPUs/node"),
        "layout": widgets.Dropdown(options=list(LAYOUTS), value=layout, description="layout"),
    }
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("etp", etp)):
        dropdowns[name] = widgets.Dropdown(options=choices([1, 2, 4, 8, 16], value), value=value,
                                           description=name.upper())
    for d in dropdowns.values():
        d.layout.width = "170px"
        d.style.description_width = "80px"
    picture = widgets.HTML()

    def redraw(_change=None):
        args = {name: d.value for name, d in dropdowns.items()}
        try:
            picture.value = rank_map(**args, knobs=False).to_html()
        except ConfigError as err:  # show Python's message, as the static page does
            picture.value = f"<pre style='color:#b42318'>{html.escape(str(err))}</pre>"

    for d in dropdowns.values():
        d.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox(list(dropdowns.values())[:3]),
                         widgets.HBox(list(dropdowns.values())[3:]), picture])


# --- HTML: Python draws the initial state, the script redraws on every click --------


def _paint(groups: list[list[int]], crosses: list[bool]) -> dict[int, tuple]:
    """rank -> (background, text colour, group index, crosses) for one kind (mirrors ``paint`` in the JS)."""
    out = {}
    for i, group in enumerate(groups):
        bg = draw.group_color(i, len(group))
        for r in group:
            out[r] = (bg, draw.text_color(bg), i, crosses[i])
    return out


def _title(data: dict) -> str:
    return (f"Rank map \u00b7 {data['world_size']} ranks on {data['num_nodes']} "
            f"node{'s' * (data['num_nodes'] > 1)} \u00d7 {data['gpus_per_node']} GPUs")


def _render(data: dict, p: str) -> str:
    """The markup inside the root ``p``: header with knobs, two panels, info line."""
    start = _resolve(data, data["initial"]["config"])
    layout = data["layouts"][start["layout"]]
    parts = [f'<div class="{p}-head"><div class="{p}-title">{_title(data)}</div>']
    knobs = []
    for knob in data["knobs"]:
        name = knob["name"]
        chosen = data["initial"]["knobs"][name]
        options = "".join(
            f'<option value="{html.escape(str(v))}"{" selected" if v == chosen else ""}>{html.escape(str(v))}</option>'
            for v in knob["values"]
        )
        frozen = ' disabled title="fixed to keep the embedded data small"' if knob["frozen"] else ""
        label = name if name == "layout" else name.upper()
        knobs.append(f'<label class="{p}-knob">{label}<select class="{p}-select" data-knob="{name}"{frozen}>'
                     f"{options}</select></label>")
    if data["knobs_enabled"]:  # without knobs the describe line below says it all
        parts.append(f'<div class="{p}-knobs">{"".join(knobs)}</div>')
    parts.append(f'<div class="{p}-describe">{html.escape(start["describe"])}</div>')
    parts.append(f'<div class="{p}-error" hidden></div></div>')

    parts.append(f'<div class="{p}-panels">')
    for side in ("dense", "expert"):
        kind = data["initial"][f"{side}_kind"]
        parts.append(_panel_html(data, p, side, kind, start, layout))
    parts.append("</div>")

    parts.append(f'<div class="{p}-info">Hover a GPU for its coordinates; click it to select its groups '
                 f"(click again to clear).</div>")
    parts.append(f'<div class="{p}-legend"><span class="{p}-mark">\u21c4</span> group spans more than one '
                 f"node: its traffic leaves NVLink for the slower inter-node network.</div>")
    return "".join(parts)


def _panel_html(data: dict, p: str, side: str, kind: str, start: dict, layout: dict) -> str:
    """One panel: title, formula, kind buttons, nodes of GPU cells, crossing summary."""
    buttons = []
    for k in data["kinds"][side]:
        active = k == kind
        style = (f' style="background:{data["kind_colors"][k]};color:{data["kind_text"][k]};'
                 f'border-color:{data["kind_colors"][k]}"' if active else "")
        buttons.append(
            f'<button type="button" class="{p}-kind{f" {p}-active" if active else ""}" data-kind="{k}" '
            f'aria-pressed="{str(active).lower()}"{style}><span class="{p}-swatch" '
            f'style="background:{data["kind_colors"][k]}"></span>{html.escape(KIND_LABELS[k])}</button>'
        )
    paint = _paint(start["groups"][kind], start["crosses"][kind])
    gpn = data["gpus_per_node"]
    # Eight GPUs as 2 x 4, as on a DGX board; small nodes in one row.
    cols = gpn if gpn <= 4 else min(8, math.ceil(gpn / 2))
    nodes = []
    for node in range(data["num_nodes"]):
        cells = []
        for r in range(node * gpn, min((node + 1) * gpn, data["world_size"])):
            bg, fg, group, crosses = paint[r]
            cross = f" {p}-crosses" if crosses else ""
            cells.append(
                f'<div class="{p}-cell tl-gpu{cross}" data-rank="{r}" data-group="{group}" role="button" tabindex="0" '
                f'aria-label="rank {r}" style="background:{bg};color:{fg}">{r}'
                f'<span class="{p}-badge" title="group crosses nodes">\u21c4</span></div>'
            )
        nodes.append(f'<div class="{p}-node"><div class="{p}-node-label">node {node}</div>'
                     f'<div class="{p}-gpus" style="grid-template-columns:repeat({cols},36px)">'
                     f'{"".join(cells)}</div></div>')
    summary = crossing_summary(kind, start["groups"][kind], start["crosses"][kind])
    return (
        f'<section class="{p}-panel" data-side="{side}">'
        f'<div class="{p}-panel-title">{html.escape(layout[f"{side}_title"])}</div>'
        f'<div class="{p}-formula">{html.escape(layout[f"{side}_formula"])}</div>'
        f'<div class="{p}-kinds">{"".join(buttons)}</div>'
        f'<div class="{p}-traffic" style="font-size:12px;margin:0 0 8px;color:#24292f">'
        f'{html.escape(traffic_line(kind))}</div>'
        f'<div class="{p}-nodes">{"".join(nodes)}</div>'
        f'<div class="{p}-summary">{html.escape(summary)}</div>'
        f'<div class="{p}-chips"></div>'
        f'<div class="{p}-selection"></div>'
        f"</section>"
    )
