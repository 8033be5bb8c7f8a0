// The explorer's glue (headsweep report): plotly draws every figure; this draws each one from its JSON block and
// opens a head's drill-down (an HTML fragment the report rendered) when a cell or point is clicked. Nothing is
// fetched: the figures and drill-downs sit in the page, plotly.js beside it.
(function () {
  "use strict";
  var heads = {};  // model key -> {head name -> {html, fig}}, parsed on first use

  function drilldowns(key) {
    if (!(key in heads)) {
      var block = document.querySelector('script.hs-heads[data-key="' + key + '"]');
      heads[key] = block ? JSON.parse(block.textContent) : {};
    }
    return heads[key];
  }

  function openHead(key, name) {
    var entry = drilldowns(key)[name];
    var panel = document.getElementById("drill-" + key);
    if (!entry || !panel) { return; }
    panel.innerHTML = entry.html;
    panel.dataset.head = name;
    panel.hidden = false;
    var before = panel.querySelector("h4");  // role and attention figures go above the examples
    (entry.figs || []).forEach(function (text) {
      var div = document.createElement("div");
      div.className = "plot drill-figure";
      panel.insertBefore(div, before);
      var fig = JSON.parse(text);
      Plotly.newPlot(div, fig.data, fig.layout, {displaylogo: false});
    });
    panel.scrollIntoView({block: "start"});
  }
  window.headsweepOpenHead = openHead;

  function draw(block) {
    var div = document.getElementById(block.dataset.target);
    if (!div || div.dataset.drawn) { return; }
    div.dataset.drawn = "drawing";
    var fig = JSON.parse(block.textContent);
    Plotly.newPlot(div, fig.data, fig.layout, {displaylogo: false, responsive: true}).then(function () {
      div.dataset.drawn = "yes";
      div.dataset.drawnAt = String(performance.now());  // ms since navigation: what the scale bench reads
    });
    var key = div.dataset.drill;
    if (key) {
      div.on("plotly_click", function (event) {
        var point = event.points && event.points[0];
        if (point && typeof point.customdata === "string" && point.customdata) { openHead(key, point.customdata); }
      });
    }
  }

  // Figures are drawn as they come near the viewport: a page of many runs opens at the speed of its first figure.
  var blocks = {};
  document.querySelectorAll("script.hs-figure").forEach(function (block) { blocks[block.dataset.target] = block; });
  if ("IntersectionObserver" in window) {
    var seen = new IntersectionObserver(function (entries) {
      entries.forEach(function (entry) {
        if (entry.isIntersecting) { seen.unobserve(entry.target); draw(blocks[entry.target.id]); }
      });
    }, {rootMargin: "400px 0px"});
    Object.keys(blocks).forEach(function (id) {
      var div = document.getElementById(id);
      if (div) { seen.observe(div); }
    });
  } else {
    Object.keys(blocks).forEach(function (id) { draw(blocks[id]); });
  }
  window.headsweepDrawAll = function () { Object.keys(blocks).forEach(function (id) { draw(blocks[id]); }); };
  document.addEventListener("DOMContentLoaded", function () {
    if (location.hash.indexOf("#head=") === 0) {  // #head=KEY/NAME opens that drill-down
      var target = decodeURIComponent(location.hash.slice(6)).split("/");
      openHead(target[0], target.slice(1).join("/"));
    }
  });
})();
