// A box that scrolls sideways (a code cell or an output on a phone, a wide figure in its
// widget) can be scrolled from the keyboard only once it can take the focus: each such box
// in the page gets tabindex="0", and loses it when a wider window stops its scrolling
// (axe-core's rule scrollable-region-focusable; WCAG 2.1.1). Jupyter Book puts every
// _static/*.js on every page.
(function () {
  // No tolerance: a formula 1 px wider than a phone's column scrolls by 1 px, and while
  // axe runs its other rules such a box measured wider still (found on chapter 3 at 390 px)
  function scrolls(el) {
    if (el.scrollWidth <= el.clientWidth && el.scrollHeight <= el.clientHeight) {
      return false;
    }
    var style = window.getComputedStyle(el);
    return /auto|scroll/.test(style.overflowX + " " + style.overflowY);
  }
  function mark() {
    var all = document.querySelectorAll("article *");
    for (var i = 0; i < all.length; i++) {
      var el = all[i];
      if (el instanceof SVGElement) { continue; }
      if (scrolls(el)) {
        if (!el.hasAttribute("tabindex")) { el.setAttribute("tabindex", "0"); el.dataset.scrollFocus = "1"; }
      } else if (el.dataset.scrollFocus === "1") {
        el.removeAttribute("tabindex"); delete el.dataset.scrollFocus;
      }
    }
  }
  // Boxes also start or stop scrolling after the load event: MathJax typesets its formulas,
  // web fonts swap in, widgets draw, a folded cell opens. So the marks are redone, at most
  // every 300 ms, whenever the page's elements change (SVG drawings left out: an animation
  // frame changes no box) and once the fonts are ready.
  var timer = null;
  function later() {
    if (timer === null) { timer = setTimeout(function () { timer = null; mark(); }, 300); }
  }
  function changed(records) {
    for (var i = 0; i < records.length; i++) {
      if (!(records[i].target instanceof SVGElement)) { later(); return; }
    }
  }
  window.addEventListener("load", mark);
  window.addEventListener("resize", later);
  if (document.fonts && document.fonts.ready) { document.fonts.ready.then(later); }
  // fonts asked for later (MathJax's own, once it typesets) widen boxes with no element
  // changing and after fonts.ready has resolved: each finished font load redoes the marks
  if (document.fonts && document.fonts.addEventListener) {
    document.fonts.addEventListener("loadingdone", later);
  }
  window.addEventListener("load", function () {  // and once MathJax has typeset the page
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
      MathJax.startup.promise.then(later);
    }
  });
  if (window.ResizeObserver) {  // a box's size can change with no element changing
    window.addEventListener("load", function () {
      var article = document.querySelector("article");
      if (article) { new ResizeObserver(later).observe(article); }
    });
  }
  // for the browser tests: true while a redo of the marks is waiting to run
  window.scrollFocusPending = function () { return timer !== null; };
  if (window.MutationObserver) {
    new MutationObserver(changed).observe(document.documentElement, {
      subtree: true, childList: true, attributes: true, attributeFilter: ["open", "hidden"]});
  }
})();
