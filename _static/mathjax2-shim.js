// ipywidgets (html-manager 1.x) typesets widget descriptions with MathJax 2's
// `MathJax.Hub.Queue(["Typeset", MathJax.Hub, element])`, but this book loads MathJax 3,
// which has no `Hub`: every widget with a description then throws "reading 'Queue'".
// Give whatever object is assigned to window.MathJax (Sphinx's config, then MathJax 3
// itself) a hidden `Hub.Queue` that forwards to MathJax 3's typesetPromise.
(function () {
  "use strict";
  var current = window.MathJax;

  function queue(job) {
    var element = job && job[2];
    if (element && current && typeof current.typesetPromise === "function") {
      current.typesetPromise([element]).catch(function () {});
    }
  }

  function withHub(mathjax) {
    if (mathjax && typeof mathjax === "object" && !mathjax.Hub) {
      // Not enumerable: MathJax 3 reads its configuration from the enumerable keys.
      Object.defineProperty(mathjax, "Hub", { value: { Queue: queue }, configurable: true });
    }
    return mathjax;
  }

  Object.defineProperty(window, "MathJax", {
    configurable: true,
    get: function () { return current; },
    set: function (value) { current = withHub(value); },
  });
  withHub(current);
})();
