// The status page: polls /status/data and redraws. No dependencies: the master may run offline.
"use strict";

const POLL_MS = 2000;

function el(id) { return document.getElementById(id); }

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}
function fmtMs(s) { return s === null || s === undefined ? "-" : (s * 1000).toFixed(s < 0.1 ? 1 : 0) + " ms"; }
function fmtPct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(0) + "%"; }
function fmtAge(seconds) {
  seconds = Math.max(0, Math.floor(seconds));
  if (seconds < 60) return seconds + "s";
  if (seconds < 3600) return Math.floor(seconds / 60) + "m" + String(seconds % 60).padStart(2, "0") + "s";
  return Math.floor(seconds / 3600) + "h" + String(Math.floor(seconds % 3600 / 60)).padStart(2, "0") + "m";
}
function fmtTime(epoch) { return new Date(epoch * 1000).toLocaleTimeString(); }

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fillTable(id, rows, columns, render) {
  const body = el(id).tBodies[0];
  body.replaceChildren();
  if (!rows.length) {
    const tr = body.insertRow();
    const td = cell(tr, "none", "empty");
    td.colSpan = columns;
    return;
  }
  for (const row of rows) body.appendChild(render(row));
}

function nodeRow(n, now) {
  const tr = document.createElement("tr");
  tr.dataset.nodeId = n.id;
  tr.dataset.state = n.state;
  cell(tr, n.id);
  cell(tr, n.pending_role ? n.role + " \u2192 " + n.pending_role : n.role);
  cell(tr, n.state, "state state-" + n.state);
  cell(tr, n.device || "-");
  let load = n.load.running + " run / " + n.load.waiting + " wait";
  if (n.load.queued_prefill_tokens) load += " / " + n.load.queued_prefill_tokens + " tok";
  cell(tr, load);
  const kv = cell(tr, "");
  const bar = document.createElement("span");
  bar.className = "bar";
  const fill = document.createElement("span");
  fill.style.width = fmtPct(n.kv.used_fraction || 0);
  bar.appendChild(fill);
  kv.appendChild(bar);
  kv.appendChild(document.createTextNode(fmtPct(n.kv.used_fraction) + " of " + n.kv.total_tokens));
  cell(tr, fmtPct(n.prefix.hit_rate));
  cell(tr, fmtBytes(n.kv_transfer_bytes));
  cell(tr, n.data_plane.warm_peers.join(", ") || "-");
  cell(tr, fmtAge(now - n.registered_at));
  return tr;
}

function requestRow(r, columns) {
  const tr = document.createElement("tr");
  tr.dataset.requestId = r.request_id;
  for (const [text, cls] of columns(r)) cell(tr, text, cls);
  return tr;
}

// A line chart into an SVG of viewBox 300x60; null points break the line.
function drawChart(id, seriesList, format) {
  const svg = el(id);
  svg.replaceChildren();
  const values = seriesList.flat().filter((v) => v !== null && v !== undefined);
  const max = Math.max(1e-9, ...values);
  const ns = "http://www.w3.org/2000/svg";
  seriesList.forEach((series, k) => {
    const n = series.length;
    let points = [];
    const flush = () => {
      if (points.length === 1) {  // a lone point between gaps: a dot
        const [x, y] = points[0].split(",");
        const dot = document.createElementNS(ns, "circle");
        dot.setAttribute("cx", x);
        dot.setAttribute("cy", y);
        dot.setAttribute("r", "1.5");
        if (k > 0) dot.setAttribute("class", "second");
        svg.appendChild(dot);
      } else if (points.length) {
        const line = document.createElementNS(ns, "polyline");
        line.setAttribute("points", points.join(" "));
        if (k > 0) line.setAttribute("class", "second");
        svg.appendChild(line);
      }
      points = [];
    };
    series.forEach((v, i) => {
      if (v === null || v === undefined) { flush(); return; }
      const x = n > 1 ? (300 * i) / (n - 1) : 0;
      const y = 58 - (56 * v) / max;
      points.push(x.toFixed(1) + "," + y.toFixed(1));
    });
    flush();
  });
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", "2");
  label.setAttribute("y", "9");
  label.textContent = "max " + format(values.length ? max : null);
  svg.appendChild(label);
}

function render(data) {
  const h = data.health;
  const serving = h.prefill_nodes > 0 && h.decode_nodes > 0;
  const health = el("health");
  health.textContent = serving ? "serving" : "unavailable";
  health.className = "badge " + (serving ? "ok" : "bad");
  el("model").textContent = (data.model || "no model yet") + " · " + data.policy + " · master " + data.master;
  const hl = data.headline;
  el("requests-rate").textContent = hl.requests_per_s.toFixed(2);
  el("error-ratio").textContent = fmtPct(hl.error_ratio);
  el("ttft").textContent = fmtMs(hl.ttft_s.p50) + " / " + fmtMs(hl.ttft_s.p99);
  el("tpot").textContent = fmtMs(hl.tpot_s.p50) + " / " + fmtMs(hl.tpot_s.p99);
  el("kv-rate").textContent = fmtBytes(hl.kv_bytes_per_s) + "/s";
  el("cluster").textContent = h.prefill_nodes + "P + " + h.decode_nodes + "D · " + h.warm_pairs + " · " + h.queued_requests;
  el("window-note").textContent = "tiles: the last " + hl.window_s + " s; charts: the last " +
    Math.round(data.series.points.length * data.series.bucket_s / 60) + " minutes, one point per " + data.series.bucket_s + " s";
  const pts = data.series.points;
  drawChart("chart-requests", [pts.map((p) => p.requests_per_s)], (v) => (v === null ? "-" : v.toFixed(2)));
  drawChart("chart-ttft", [pts.map((p) => p.ttft_p50), pts.map((p) => p.ttft_p99)], fmtMs);
  drawChart("chart-kv", [pts.map((p) => p.kv_bytes_per_s)], (v) => fmtBytes(v) + "/s");
  fillTable("nodes", data.nodes, 10, (n) => nodeRow(n, data.now));
  fillTable("errors", data.errors, 4, (r) => requestRow(r, (x) => [
    [fmtTime(x.ended_at)], [x.request_id], [x.outcome], [x.error || x.finish_reason || "-"]]));
  fillTable("routing", data.routing, 6, (r) => requestRow(r, (x) => [
    [fmtTime(x.ended_at)], [x.request_id], [x.prefill + " → " + x.decode], [x.routing, "reason"],
    [x.prompt_tokens + " / " + x.decode_hit_tokens], [fmtMs(x.ttft_s)]]));
  el("updated").textContent = "updated " + new Date().toLocaleTimeString();
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

async function poll() {
  try {
    const response = await fetch("/status/data", { credentials: "same-origin", cache: "no-store" });
    if (response.status === 401) { window.location.assign("/status"); return; }
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
  } catch (err) {
    const health = el("health");
    health.textContent = "master unreachable";
    health.className = "badge bad";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
