// The live fleet page: one websocket (/ws/fleet/, the staff session's cookie) brings a snapshot of the fleet
// after every change; this renders it in place (rows keyed by node id, one uPlot chart per node). No reload.
(function () {
  "use strict";
  const charts = {};  // node id -> uPlot
  let lastSeq = 0;

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  function num(v, digits) { return v === null || v === undefined ? "–" : Number(v).toFixed(digits || 0); }
  function setText(id, text) { const e = document.getElementById(id); if (e) e.textContent = text; }
  function kv(n) {
    if (!n.kv_total) return "–";
    return `${n.kv_used} / ${n.kv_total} (${Math.round(100 * n.kv_used / n.kv_total)}%)`;
  }

  function chartFor(node, cell) {
    const data = [node.history.map((p) => p[0]), node.history.map((p) => p[1])];
    let chart = charts[node.id];
    if (chart && chart.root.parentNode !== cell) { chart.destroy(); chart = null; }
    if (!chart) {
      if (typeof uPlot === "undefined") return;
      chart = charts[node.id] = new uPlot({
        width: 180, height: 44, legend: {show: false}, cursor: {show: false},
        axes: [{show: false}, {show: false}], scales: {x: {time: true}, y: {range: (u, lo, hi) => [0, Math.max(hi, 1)]}},
        series: [{}, {stroke: "#417690", fill: "rgba(65,118,144,0.15)", width: 1.5}],
      }, data, cell);
    } else {
      chart.setData(data);
    }
  }

  function modelsCell(n) {  // what it serves, then each deployed model on its way in (pulling or loading, with progress)
    const cell = el("span", n.models.join(", "));
    for (const p of n.preparing || []) {
      const line = el("span", `${p.model}: ${p.state} `, "fleet-preparing");
      if (p.state === "pulling" || p.progress) {
        const bar = el("progress"); bar.max = 100; bar.value = p.percent;
        line.append(bar, ` ${p.percent}%`);
      }
      if (p.why) line.title = p.why;  // an on-demand load: why the head put it there
      if (p.why) line.append(` (${p.why})`);
      cell.appendChild(line);
    }
    return cell;
  }

  function nodeRow(n) {
    let tr = document.getElementById("node-" + n.id);
    const cells = [];
    const link = el(n.url ? "a" : "span", n.identity);  // a node not joined yet has no page
    if (n.url) link.href = n.url;
    cells.push(link);
    cells.push(el("span", n.state));
    cells.push(modelsCell(n));
    cells.push(el("span", `${n.lanes_busy === null ? "?" : n.lanes_busy} / ${n.lanes}`));
    cells.push(el("span", n.placed === null ? "–" : String(n.placed)));
    cells.push(el("span", kv(n)));
    cells.push(el("span", n.tokens_per_s ? num(n.tokens_per_s, 1) : "–"));
    if (!tr) {
      tr = el("tr"); tr.id = "node-" + n.id;
      for (let i = 0; i < 11; i++) tr.appendChild(el("td"));
    }
    const tds = tr.children;
    cells.forEach((c, i) => { tds[i].replaceChildren(c); });
    tds[1].className = "state-" + n.state;
    tds[7].className = "chart";
    tds[8].textContent = n.context;
    tds[9].textContent = n.address;
    const device = el("span", n.device || "", n.cpu_fallback ? "fleet-device fleet-fallback" : "fleet-device");
    if (n.url) tds[10].replaceChildren(n.engine, device); else tds[10].textContent = n.engine;
    return tr;
  }

  function renderNodes(nodes) {
    const body = document.querySelector("#fleet-nodes tbody");
    const keep = new Set(nodes.map((n) => "node-" + n.id));
    for (const tr of Array.from(body.children)) if (!keep.has(tr.id)) tr.remove();
    for (const id of Object.keys(charts)) if (!keep.has("node-" + id)) { charts[id].destroy(); delete charts[id]; }
    if (!nodes.length) {
      const tr = el("tr", null, "fleet-empty"); const td = el("td", "No node has joined yet."); td.colSpan = 11;
      tr.appendChild(td); body.appendChild(tr); return;
    }
    for (const n of nodes) {
      const tr = nodeRow(n);
      body.appendChild(tr);  // appending an existing row moves it: the order follows the snapshot
      chartFor(n, tr.children[7]);
    }
  }

  function renderModels(models) {
    const body = document.querySelector("#fleet-models tbody");
    body.replaceChildren();
    if (!models.length) {
      const tr = el("tr"); const td = el("td", "No model is served: start a node with manage.py node_join.");
      td.colSpan = 5; tr.appendChild(td); body.appendChild(tr); return;
    }
    for (const m of models) {
      const tr = el("tr");
      [m.name, m.nodes, m.lanes, m.busy, m.waiting].forEach((v) => tr.appendChild(el("td", String(v))));
      body.appendChild(tr);
    }
  }

  function render(s) {
    const t = s.totals;
    setText("card-nodes", t.nodes);
    setText("card-lanes", `${t.lanes_busy} / ${t.lanes_total}`);
    setText("card-waiting", t.waiting);
    const classes = ["high", "normal", "low", "batch"].map((p) => `${p} ${(t.waiting_by_priority || {})[p] || 0}`);
    setText("fleet-waiting-priority", classes.join(", "));
    const keys = Object.entries(t.waiting_by_key || {}).sort((a, b) => b[1] - a[1]).slice(0, 10);
    setText("fleet-waiting-keys", keys.map(([k, v]) => `${k} ${v}`).join(", ") || "none");
    setText("card-generations", t.generations);
    setText("card-tokens", t.completion_tokens);
    setText("card-ttft", t.ttft_ms ? `${Math.round(t.ttft_ms)} ms` : "–");
    const statuses = Object.entries(t.by_status || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    setText("fleet-by-status", statuses || "none");
    renderModels(s.models);
    renderNodes(s.nodes);
  }

  function status(text, cls) {
    const e = document.getElementById("fleet-live");
    e.textContent = text; e.className = cls || "";
  }

  function connect(delay) {
    const path = document.getElementById("content-main").dataset.socket;
    const socket = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + path);
    socket.onmessage = (event) => {
      const frame = JSON.parse(event.data);
      if (frame.type === "error") { status(frame.message, "down"); return; }
      if (frame.type !== "fleet" || frame.seq <= lastSeq) return;
      lastSeq = frame.seq;
      window.fleetSnapshotSeq = (window.fleetSnapshotSeq || 0) + 1;
      status("live", "live");
      render(frame);
    };
    socket.onopen = () => { lastSeq = 0; delay = 1000; };
    socket.onclose = (event) => {
      if (event.code === 4401 || event.code === 4403) return;  // refused: the error frame said why
      status("disconnected, reconnecting…", "down");
      setTimeout(() => connect(Math.min(delay * 2, 15000)), delay);
    };
  }

  document.addEventListener("DOMContentLoaded", () => connect(1000));
})();
