// A box that scrolls sideways (a code cell or an output on a phone, a wide figure in its
// widget) can be scrolled from the keyboard only once it can take the focus: each such box
// in the page gets tabindex="0", and loses it when a wider window stops its scrolling
// (axe-core's rule scrollable-region-focusable; WCAG 2.1.1). Jupyter Book puts every
// _static/*.js on every page.
(function () {
  function scrolls(el) {
    if (el.scrollWidth <= el.clientWidth + 1 && el.scrollHeight <= el.clientHeight + 1) {
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
  var timer = null;
  function later() { clearTimeout(timer); timer = setTimeout(mark, 300); }
  window.addEventListener("load", mark);
  window.addEventListener("resize", later);
})();
