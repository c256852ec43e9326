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
    keepTextReadable(root);
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

// An SVG scales with its box, its labels with it: a picture drawn 940 units wide with
// 11-unit labels, squeezed into a 350 px phone column, would print them 4 px tall.  So each
// SVG gets a min-width at which its smallest label is MIN_TEXT_PX; where the column is
// narrower, the SVG's parent scrolls sideways (widget.css), never the page.  An SVG that
// its widget draws in screen pixels at whatever width the column has (data-text-sized, the
// FP8 tile explorer) keeps its text size by itself and is left alone.
var MIN_TEXT_PX = 9;
function keepTextReadable(root) {
  var svgs = root.querySelectorAll("svg[viewBox]:not([data-text-sized])");
  for (var i = 0; i < svgs.length; i++) {
    var svg = svgs[i], texts = svg.querySelectorAll("text"), smallest = Infinity;
    for (var j = 0; j < texts.length; j++) {
      var size = parseFloat(texts[j].getAttribute("font-size"));
      if (!(size > 0)) { size = parseFloat(window.getComputedStyle(texts[j]).fontSize); }
      if (size > 0 && size < smallest) { smallest = size; }
    }
    var width = svg.viewBox.baseVal ? svg.viewBox.baseVal.width : 0;
    if (smallest === Infinity || !(width > 0)) { continue; }
    svg.style.minWidth = Math.ceil(width * MIN_TEXT_PX / smallest) + "px";
    svg.setAttribute("data-min-width", svg.style.minWidth);
  }
}
