// The rank map (tutorial_lib.viz.rank_map): looks things up and recolours; it never
// computes a rank, a group or a coordinate.  Every class carries the root's id as prefix.
function startRankMap(root, data) {
  var P = root.id;
  function cls(name) { return P + "-" + name; }
  function one(name, scope) { return (scope || root).querySelector("." + cls(name)); }
  function all(name, scope) { return Array.prototype.slice.call((scope || root).querySelectorAll("." + cls(name))); }
  var state = {config: data.initial.config, rank: null, hover: null,
               kinds: {dense: data.initial.dense_kind, expert: data.initial.expert_kind}};

  // Unpack one precomputed configuration from the shared tables (mirrors _resolve in Python).
  function resolve(index) {
    var entry = data.configs[index];
    var out = {layout: entry.layout, describe: entry.describe, groups: {}, crosses: {}, coords: {}};
    data.all_kinds.forEach(function (kind, i) {
      out.groups[kind] = data.group_sets[entry.groups[i]].groups;
      out.crosses[kind] = data.group_sets[entry.groups[i]].crosses;
    });
    data.layouts[entry.layout].dims.forEach(function (dim, i) { out.coords[dim] = data.coord_sets[entry.coords[i]]; });
    return out;
  }

  // rank -> {group index, colours}, read off Python's group lists (mirrors _paint).
  function paint(groups) {
    var out = {};
    groups.forEach(function (group, i) {
      var single = group.length < 2, c = i % data.palette.length;
      group.forEach(function (r) {
        out[r] = {group: i, bg: single ? data.singleton_color : data.palette[c],
                  fg: single ? data.singleton_text : data.palette_text[c]};
      });
    });
    return out;
  }

  function summary(kind, groups, crosses) {  // mirrors crossing_summary in Python
    var n = groups.length, size = groups[0].length, label = data.kind_labels[kind];
    if (size === 1) { return label + ": " + n + " groups of 1 rank \u2014 nothing to communicate"; }
    var head = label + ": " + n + " group" + (n > 1 ? "s" : "") + " of " + size + " ranks \u2014 ";
    var k = crosses.filter(function (x) { return x; }).length;
    if (k === 0) { return head + "all inside one node (NVLink)"; }
    return head + k + " of " + n + " cross a node boundary (\u21c4 leaves NVLink)";
  }

  function nodesOf(group) {
    var seen = [];
    group.forEach(function (r) { var n = data.node_of[r]; if (seen.indexOf(n) < 0) { seen.push(n); } });
    return seen;
  }

  function renderPanel(panel, cfg) {
    var side = panel.getAttribute("data-side"), kind = state.kinds[side];
    var groups = cfg.groups[kind], crosses = cfg.crosses[kind], colours = paint(groups);
    var chosen = state.rank === null ? -1 : colours[state.rank].group;
    var layout = data.layouts[cfg.layout];
    one("panel-title", panel).textContent = layout[side + "_title"];
    one("formula", panel).textContent = layout[side + "_formula"];
    all("kind", panel).forEach(function (b) {
      var k = b.getAttribute("data-kind"), on = k === kind;
      b.classList.toggle(cls("active"), on);
      b.setAttribute("aria-pressed", on ? "true" : "false");
      b.style.background = on ? data.kind_colors[k] : "";
      b.style.color = on ? data.kind_text[k] : "";
      b.style.borderColor = on ? data.kind_colors[k] : "";
    });
    all("cell", panel).forEach(function (cell) {
      var r = Number(cell.getAttribute("data-rank")), c = colours[r];
      cell.style.background = c.bg;
      cell.style.color = c.fg;
      cell.setAttribute("data-group", c.group);
      cell.classList.toggle(cls("crosses"), !!crosses[c.group]);
      cell.classList.toggle(cls("selected"), c.group === chosen);
      cell.classList.toggle("selected", c.group === chosen);  // plain hook for tests
      cell.classList.toggle(cls("dim"), chosen >= 0 && c.group !== chosen);
      cell.classList.toggle(cls("hover"), r === state.hover);
    });
    one("traffic", panel).textContent = data.kind_traffic[kind];
    one("summary", panel).textContent = summary(kind, groups, crosses);
    renderChips(one("chips", panel), groups, crosses, chosen, colours);
    var line = "";
    if (chosen >= 0) {
      var group = groups[chosen], nodes = nodesOf(group);
      line = "Rank " + state.rank + "\u2019s " + data.kind_labels[kind] + " group (#" + chosen + " of " +
             groups.length + "): [" + group.join(", ") + "] \u2014 " +
             (nodes.length > 1 ? "crosses nodes " + nodes.join(", ") + " \u21c4" : "inside node " + nodes[0]);
    }
    one("selection", panel).textContent = line;
  }

  // The group lists as clickable chips; singletons are summarised instead.
  function renderChips(box, groups, crosses, chosen, colours) {
    box.textContent = "";
    if (groups[0].length < 2) { return; }
    groups.forEach(function (group, i) {
      var chip = document.createElement("span"), c = colours[group[0]];
      chip.className = cls("chip") + (chosen >= 0 && i !== chosen ? " " + cls("dim") : "");
      chip.style.background = c.bg;
      chip.style.color = c.fg;
      chip.setAttribute("data-rank", group[0]);
      chip.textContent = (crosses[i] ? "\u21c4 " : "") + "[" + group.join(" ") + "]";
      box.appendChild(chip);
    });
  }

  function hoverText(cfg, r) {
    var layout = data.layouts[cfg.layout];
    function coords(dims) { return dims.map(function (d) { return d + "=" + cfg.coords[d][r]; }).join(" "); }
    var text = "Rank " + r + " \u00b7 node " + data.node_of[r] + ", GPU " + data.gpu_of[r] + " \u00b7 ";
    if (layout.folded) {
      return text + "dense " + coords(layout.dense_dims) + " \u00b7 expert " + coords(layout.expert_dims);
    }
    return text + "grid " + coords(layout.dense_dims);
  }

  function render() {
    var cfg = resolve(state.config);
    one("describe").textContent = cfg.describe;
    all("panel").forEach(function (panel) { renderPanel(panel, cfg); });
    root.setAttribute("data-selected-rank", state.rank === null ? "" : String(state.rank));
    var info = one("info");
    if (state.hover !== null) { info.textContent = hoverText(cfg, state.hover); }
    else if (state.rank !== null) { info.textContent = hoverText(cfg, state.rank) + "  (selected)"; }
    else { info.textContent = "Hover a GPU for its coordinates; click it to select its groups (click again to clear)."; }
  }

  // --- knobs: walk the nested table with each <select>'s chosen position ---
  var selects = data.knobs.map(function (knob) {
    return root.querySelector("select[data-knob='" + knob.name + "']");
  });
  function lookup(positions) {
    var node = data.table;
    positions.forEach(function (i) { node = node[i]; });
    return node;
  }
  function positions() { return selects.map(function (s) { return s.selectedIndex; }); }
  function markOptions() {  // a cross on each choice that Python rejects given the other knobs
    selects.forEach(function (select, k) {
      Array.prototype.forEach.call(select.options, function (option, i) {
        var at = positions(); at[k] = i;
        var bad = lookup(at) < 0, value = String(data.knobs[k].values[i]);
        option.textContent = bad ? value + " \u2717" : value;
      });
    });
  }
  function onKnob() {
    var found = lookup(positions()), error = one("error");
    if (found < 0) {
      error.textContent = data.errors[-1 - found];
      error.hidden = false;
      root.setAttribute("data-invalid", "1");
    } else {
      error.hidden = true;
      root.removeAttribute("data-invalid");
      state.config = found;
      render();
    }
    markOptions();
  }
  if (data.knobs_enabled) { selects.forEach(function (s) { s.addEventListener("change", onKnob); }); }

  // --- mouse and keyboard ---
  function rankOf(target, name) {
    var hit = target.closest ? target.closest("." + cls(name)) : null;
    return hit && root.contains(hit) ? Number(hit.getAttribute("data-rank")) : null;
  }
  root.addEventListener("click", function (event) {
    var button = event.target.closest ? event.target.closest("." + cls("kind")) : null;
    if (button) {
      state.kinds[button.closest("." + cls("panel")).getAttribute("data-side")] = button.getAttribute("data-kind");
      render();
      return;
    }
    var r = rankOf(event.target, "cell");
    if (r === null) { r = rankOf(event.target, "chip"); }
    if (r === null) { return; }
    state.rank = state.rank === r ? null : r;
    render();
  });
  root.addEventListener("keydown", function (event) {
    if ((event.key === "Enter" || event.key === " ") && rankOf(event.target, "cell") !== null) {
      event.preventDefault();
      event.target.click();
    } else if (event.key === "Escape") {
      state.rank = null;
      render();
    }
  });
  root.addEventListener("mouseover", function (event) {
    var r = rankOf(event.target, "cell");
    if (r !== state.hover) { state.hover = r; render(); }
  });
  root.addEventListener("mouseleave", function () { state.hover = null; render(); });

  if (data.knobs_enabled) { markOptions(); }
  render();
}
