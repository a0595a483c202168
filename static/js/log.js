// The Job page's log viewer follows the newest line unless its reader has scrolled up.
//
// Its poll appends new lines to the <pre data-follow> (htmx, out of band); nothing here asks
// the server. A viewer whose bottom is in view when lines arrive is scrolled to the new
// bottom; one scrolled up stays where it is, until its reader scrolls to the bottom again.
// The oldest lines are dropped past MAX_LINES so a long run does not grow the page forever.
(function () {
  "use strict";
  var MAX_LINES = 5000;
  var SLACK_PX = 8;

  function atBottom(pre) {
    return pre.scrollHeight - pre.scrollTop - pre.clientHeight <= SLACK_PX;
  }

  function follow() {
    document.querySelectorAll("pre[data-follow]").forEach(function (pre) {
      while (pre.childElementCount > MAX_LINES && pre.firstChild) {
        pre.removeChild(pre.firstChild);
      }
      if (pre.dataset.pinned !== "no") {
        pre.scrollTop = pre.scrollHeight;
      }
    });
  }

  // Scroll events do not bubble: listen while they go down to the viewer.
  document.addEventListener(
    "scroll",
    function (event) {
      var pre = event.target;
      if (pre && pre.matches && pre.matches("pre[data-follow]")) {
        pre.dataset.pinned = atBottom(pre) ? "yes" : "no";
      }
    },
    true
  );
  document.addEventListener("DOMContentLoaded", follow);
  document.addEventListener("htmx:afterSettle", follow);
  document.addEventListener("htmx:oobAfterSwap", follow);
})();
