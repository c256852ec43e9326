// The MoE token flow (tutorial_lib/viz/moe_flow.py): the player of every animation, plus
// the phase pills drawn above each frame. A pill carries data-goto, the first frame of
// its phase; a click, Enter or Space moves the player there through its slider, so Play,
// Back, Next and the counter stay in step.
function startTokenFlow(root, data) {
  startAnimation(root, data);
  var slider = root.querySelector(".tl-slider");
  function pillOf(event) {
    var node = event.target;
    var pill = node && node.closest ? node.closest(".tl-moe-step") : null;
    return pill && root.contains(pill) ? pill : null;
  }
  function jump(pill) {
    slider.value = pill.getAttribute("data-goto");
    slider.dispatchEvent(new Event("input"));
  }
  root.addEventListener("click", function (event) {
    var pill = pillOf(event);
    if (pill) { jump(pill); }
  });
  root.addEventListener("keydown", function (event) {
    var pill = pillOf(event);
    if (pill && (event.key === "Enter" || event.key === " ")) {
      event.preventDefault();
      jump(pill);
    }
  });
}
