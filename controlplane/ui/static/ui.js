// weightship status page: keeps the server-rendered sections live from /ui/events (server-sent events).
// No framework: the server renders every section; this swaps them in, draws the charts (uPlot),
// pages through the node list and ticks the heartbeat ages.
(function () {
  "use strict";
  var live = document.getElementById("live");
  var nodes = document.getElementById("nodes");
  var filter = document.getElementById("node-filter");
  var nodePage = 1;
  var charts = {};
  var skew = 0; // server clock minus this browser's, from the last summary

  function setLive(text, cls) { live.textContent = text; live.className = "live " + cls; }

  function ages() {
    var now = Date.now() + skew;
    document.querySelectorAll("time.age").forEach(function (t) {
      var s = Math.max(0, Math.round((now - Date.parse(t.getAttribute("datetime"))) / 1000));
      t.textContent = s < 120 ? s + " s ago" : s < 7200 ? Math.round(s / 60) + " min ago" : Math.round(s / 3600) + " h ago";
    });
  }

  function chart(id, title, names, data, el) {
    if (!window.uPlot || !data || data[0].length === 0) return;
    var key = id + "|" + names.join(",");
    var existing = charts[key];
    if (existing) { existing.setData(data); return; }
    var colors = ["#d9480f", "#1971c2", "#2f9e44", "#7048e8", "#868e96"];
    var series = [{}].concat(names.map(function (n, i) { return { label: n, stroke: colors[i % colors.length], spanGaps: true }; }));
    var box = document.createElement("div");
    box.className = "chart";
    el.appendChild(box);
    charts[key] = new uPlot({ title: title, width: 420, height: 160, series: series, scales: { x: { time: true } } }, data, box);
  }

  function drawCharts(c) {
    chart("bytes", "MiB by source", c.bytes.names, c.bytes.data, document.getElementById("chart-bytes"));
    var serve = document.getElementById("chart-serve");
    if (Object.keys(c.serve).length === 0 && !serve.firstChild) {
      serve.innerHTML = '<p class="none">no model server has reported yet</p>';
    } else if (Object.keys(c.serve).length > 0 && serve.querySelector("p.none")) {
      serve.innerHTML = "";
    }
    var shown = 0;
    Object.keys(c.serve).forEach(function (name) {
      var s = c.serve[name];
      if (shown++ < 12) chart("serve:" + name, name + ": error %, latency ms, queue", s.names, s.data, serve);
    });
  }

  function loadNodes() {
    var form = new FormData(filter);
    var query = new URLSearchParams({ page: nodePage, filter: form.get("filter"), q: form.get("q") });
    fetch("/ui/nodes?" + query.toString(), { credentials: "same-origin" }).then(function (r) {
      if (r.status === 401) { location.reload(); return null; }
      return r.text();
    }).then(function (html) { if (html !== null) { nodes.innerHTML = html; ages(); } });
  }

  nodes.addEventListener("click", function (ev) {
    var goto = ev.target.getAttribute && ev.target.getAttribute("data-goto");
    if (goto) { nodePage = parseInt(goto, 10); loadNodes(); }
  });
  filter.addEventListener("change", function () { nodePage = 1; loadNodes(); });
  filter.addEventListener("input", function () { nodePage = 1; loadNodes(); });
  filter.addEventListener("submit", function (ev) { ev.preventDefault(); });

  var source = new EventSource("/ui/events");
  source.addEventListener("open", function () { setLive("live", "on"); });
  source.addEventListener("error", function () {
    // CLOSED: the server refused the stream (signed out): reload to show the login form.
    // Otherwise the browser retries by itself (a restart, a dropped connection).
    if (source.readyState === EventSource.CLOSED) { location.reload(); return; }
    setLive("reconnecting…", "off");
  });
  source.addEventListener("logout", function () { source.close(); location.reload(); });
  source.addEventListener("summary", function (ev) {
    var s = JSON.parse(ev.data);
    skew = Date.parse(s.at) - Date.now();
    Object.keys(s.html).forEach(function (id) {
      var el = document.getElementById(id);
      if (el) el.innerHTML = s.html[id];
    });
    document.body.setAttribute("data-updated", s.at);
    setLive("live · " + new Date(Date.parse(s.at)).toLocaleTimeString(), "on");
    drawCharts(s.charts);
    loadNodes();
    ages();
  });
  setInterval(ages, 1000);
  ages();
})();
