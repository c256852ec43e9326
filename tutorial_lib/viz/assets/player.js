// The player shared by every animation (frames of a collective, a timeline's cursor):
// Play/Pause, Back, Next and the slider, kept in step with the root's data-frame.
// show(i) draws frame i; at the last frame, Play starts over from frame `restart`.
// Returns go(i), which moves to frame i.
function player(root, count, interval, show, restart) {
  var play = root.querySelector(".tl-play");
  var slider = root.querySelector(".tl-slider");
  var current = 0, timer = null;
  function go(i) {
    i = Math.max(0, Math.min(count - 1, i));
    current = i;
    root.setAttribute("data-frame", String(i));
    slider.value = String(i);
    show(i);
  }
  function stop() {
    if (timer !== null) { clearInterval(timer); timer = null; }
    play.textContent = "\u25B6\uFE0E Play";
  }
  function tick() {
    go(current + 1);
    if (current >= count - 1) { stop(); }
  }
  function start() {
    if (count < 2) { return; }
    // From the last frame, start over; otherwise move at once, so the click is felt.
    if (current >= count - 1) { go(restart); } else { tick(); if (current >= count - 1) { return; } }
    timer = setInterval(tick, interval);
    play.textContent = "\u275A\u275A Pause";
  }
  function step(by) { return function () { stop(); go(current + by); }; }
  play.addEventListener("click", function () { if (timer === null) { start(); } else { stop(); } });
  root.querySelector(".tl-prev").addEventListener("click", step(-1));
  root.querySelector(".tl-next").addEventListener("click", step(1));
  slider.addEventListener("input", function () { stop(); go(parseInt(slider.value, 10)); });
  return go;
}
