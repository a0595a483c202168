// Live regions: the one way a page follows what changes without a reload.
//
// An element marked `data-live` asks for itself again on its own htmx trigger, written
// `hx-trigger="every 5s, live:resume"`. While the tab is hidden its requests are dropped;
// when the tab is shown again every live region is asked at once (the `live:resume` event),
// so a page that was in the background is current the moment it is looked at.
(function () {
  "use strict";
  document.addEventListener("htmx:beforeRequest", function (event) {
    if (document.hidden && event.target.closest && event.target.closest("[data-live]")) {
      event.preventDefault();
    }
  });
  document.addEventListener("visibilitychange", function () {
    if (document.hidden || !window.htmx) {
      return;
    }
    document.querySelectorAll("[data-live]").forEach(function (element) {
      window.htmx.trigger(element, "live:resume");
    });
  });
})();
