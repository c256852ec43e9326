// Precomputed frames (tutorial_lib.viz.widget.Animation): one frame shows at a time,
// with its caption (the frame's data-caption) and the counter "i / n".
function startAnimation(root, data) {
  var frames = root.querySelectorAll(".tl-frame");
  var caption = root.querySelector(".tl-anim-caption");
  var counter = root.querySelector(".tl-anim-counter");
  var shown = 0;
  player(root, frames.length, data.interval, function (i) {
    frames[shown].style.display = "none";
    frames[i].style.display = "";
    shown = i;
    caption.textContent = frames[i].getAttribute("data-caption");
    counter.textContent = (i + 1) + " / " + frames.length;
  }, 0);
}
