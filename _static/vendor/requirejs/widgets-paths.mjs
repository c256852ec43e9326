// Written by scripts/vendor_js.sh. Runs after require.js, before embed-amd:
// resolve @jupyter-widgets/* AMD modules (and so their fonts) in the vendored
// html-manager folder next to this one, whatever folder the page is in.
(function () {
  var self = document.currentScript;
  if (!self || typeof requirejs === "undefined") { return; }
  var dir = new URL("../html-manager", self.src).href;
  requirejs.config({
    paths: {
      "@jupyter-widgets": dir,
      "@jupyter-widgets/html-manager/dist": dir
    }
  });
})();
