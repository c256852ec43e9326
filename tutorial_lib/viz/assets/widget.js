// Shared by every widget of the course (tutorial_lib/viz/widget.py puts it first in each
// fragment's script, inside one function, so none of these names is global).
// ASCII only: character references are not decoded inside a script element.

// Find the widget's root, read its JSON island and call start(root, data), once.
// The root is the script's parent (a page, the book, JupyterLab); where a front end
// runs the script elsewhere (classic Notebook), it is looked up by id, retrying while
// the output is not attached to the page yet.
function boot(id, start) {
  var script = document.currentScript;
  function attempt(tries) {
    var parent = script && script.parentNode;
    var root = parent && parent.id === id ? parent : document.getElementById(id);
    if (!root) { if (tries < 50) { setTimeout(function () { attempt(tries + 1); }, 100); } return; }
    if (root.getAttribute("data-ready") === "1") { return; }
    root.setAttribute("data-ready", "1");
    start(root, JSON.parse(root.querySelector("script[type='application/json']").textContent));
  }
  attempt(0);
}

// A new SVG element in svg's namespace (read off the element, so no URL is written here).
function svgElement(svg, name, attrs, text) {
  var node = document.createElementNS(svg.namespaceURI, name);
  for (var k in attrs) { node.setAttribute(k, attrs[k]); }
  if (text !== undefined) { node.textContent = text; }
  return node;
}
