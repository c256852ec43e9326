// The layout explorer (tutorial_lib.viz.layout_explorer): buttons pick a model size, a GPU
// type and a count; the result shown is the table Python made for that choice (in D, the
// JSON island). Nothing is computed here. ASCII only.
function startLayoutExplorer(root, D) {
  var result = root.querySelector(".tl-lay-result");
  var state = {size: D.sizes[0], gpu: D.gpus[0][0], count: String(D.counts[0])};
  function buttons(where, pairs) {
    var box = root.querySelector(".tl-lay-" + where);
    box.innerHTML = "";
    pairs.forEach(function (pair) {
      var b = document.createElement("button");
      b.type = "button";
      b.textContent = pair[1];
      b.dataset.value = String(pair[0]);
      b.addEventListener("click", function () { state[where] = b.dataset.value; show(); });
      box.appendChild(b);
    });
  }
  function show() {
    ["size", "gpu", "count"].forEach(function (key) {
      root.querySelectorAll(".tl-lay-" + key + " button").forEach(function (b) {
        b.classList.toggle("tl-on", b.dataset.value === state[key]);
      });
    });
    var key = [state.size, state.gpu, state.count].join("|"), shown = D.results[key];
    root.dataset.key = key;
    if (shown.refused !== undefined) {
      result.textContent = "No layout fits: " + shown.refused;
    } else {
      result.innerHTML = shown.html;
    }
  }
  buttons("size", D.sizes.map(function (s) { return [s, s]; }));
  buttons("gpu", D.gpus);
  buttons("count", D.counts.map(function (c) { return [c, String(c)]; }));
  show();
}
