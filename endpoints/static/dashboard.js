// Tandem's dashboard: plain JavaScript, no library, nothing from outside this gateway (endpoints/dashboard.py).
// It reads GET /v1/events (a fetch stream: EventSource cannot send an Authorization header), resumes with
// Last-Event-ID after a drop, and reads the trace, budget, endpoints, readiness and metrics it shows.
"use strict";

const $ = (id) => document.getElementById(id);
const requests = new Map(); // request id -> {row, data}
const hatSessions = new Map();
const MAX_ROWS = 200;
let lastEventId = 0; // 0: replay what the gateway still holds, then go live
let streamAbort = null;

function keys() {
  return { api: sessionStorage.getItem("tandem.api") || "", admin: sessionStorage.getItem("tandem.admin") || "" };
}

function authHeaders(key) {
  return key ? { Authorization: "Bearer " + key } : {};
}

async function getJSON(path, key = keys().api) {
  const r = await fetch(path, { headers: authHeaders(key) });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || r.status + " " + r.statusText);
  return body;
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

const fmtMs = (v) => (v === null || v === undefined ? "–" : v < 1000 ? v.toFixed(0) + " ms" : (v / 1000).toFixed(2) + " s");
const fmtUsd = (v) => (v === null || v === undefined ? "–" : v === 0 ? "$0" : "$" + (v < 0.01 ? v.toExponential(2) : v.toFixed(4)));
const short = (id) => (id.length > 18 ? id.slice(0, 10) + "…" + id.slice(-6) : id);

// -- the live request list ------------------------------------------------------------------------------------------
function requestRow(id) {
  let entry = requests.get(id);
  if (entry) return entry;
  const row = el("tr");
  row.tabIndex = 0;
  row.dataset.id = id;
  row.setAttribute("aria-label", "request " + id + ": open its timeline");
  for (let i = 0; i < 9; i++) row.appendChild(el("td"));
  row.cells[0].textContent = short(id);
  row.cells[0].title = id;
  row.addEventListener("click", () => openTimeline(id));
  entry = { row, data: { id, endpoints: {}, migrations: [], outcome: "running" } };
  requests.set(id, entry);
  const body = $("request-rows");
  body.insertBefore(row, body.firstChild);
  while (body.rows.length > MAX_ROWS) {
    const last = body.rows[body.rows.length - 1];
    requests.delete(last.dataset.id);
    last.remove();
  }
  return entry;
}

function renderRow(entry) {
  const d = entry.data;
  const c = entry.row.cells;
  c[1].textContent = [d.policy, d.plan].filter(Boolean).join(" · ");
  c[2].textContent = d.winner || "–";
  c[3].textContent = d.migrations.map((m) => `${m.from}→${m.to} (${m.reason}${m.error ? ", failed" : ""})`).join("; ") || "–";
  c[4].textContent = fmtMs(d.ttft_ms);
  c[5].textContent = Object.entries(d.endpoints).map(([name, e]) => `${name}: ${e.tokens ?? 0}`).join(", ") || "–";
  c[6].textContent = fmtUsd(d.cost);
  c[7].textContent = d.privacy || "–";
  c[8].textContent = d.outcome;
  entry.row.dataset.outcome = d.outcome;
}

function onRequestEvent(ev) {
  const entry = requestRow(ev.request_id);
  const d = entry.data;
  switch (ev.type) {
    case "request.planned":
      Object.assign(d, { policy: ev.policy, plan: ev.plan, privacy: ev.privacy });
      break;
    case "endpoint.started":
      d.endpoints[ev.backend] = d.endpoints[ev.backend] || { tokens: 0 };
      break;
    case "endpoint.won":
      d.winner = d.winner ? d.winner + " → " + ev.backend : ev.backend;
      if (d.ttft_ms === undefined) d.ttft_ms = ev.ttft_ms;
      break;
    case "migration.started":
      d.migrations.push({ from: ev.from, to: ev.to, reason: ev.reason, at: ev.at_token });
      break;
    case "migration.failed":
      if (d.migrations.length) d.migrations[d.migrations.length - 1].error = ev.error;
      break;
    case "request.finished":
    case "request.failed": {
      const t = ev.trace;
      d.endpoints = {};
      for (const e of t.endpoints) {
        const prev = d.endpoints[e.backend] || { tokens: 0 };
        d.endpoints[e.backend] = { tokens: prev.tokens + e.decode_tokens };
      }
      d.migrations = t.migrations.map((m) => ({ from: m.from, to: m.to, reason: m.reason, error: m.error }));
      d.winner = t.endpoints.filter((e) => e.first_token_ms !== null).map((e) => e.backend).join(" → ") || "none";
      Object.assign(d, { ttft_ms: t.ttft_ms, cost: t.cost_usd, privacy: t.privacy });
      d.outcome = ev.type === "request.finished" ? "finished: " + t.finish_reason : "failed";
      if ($("timeline").dataset.id === ev.request_id) openTimeline(ev.request_id, false);
      soon(loadBudget); // its spend and the realised b moved
      break;
    }
  }
  renderRow(entry);
}

$("request-rows").addEventListener("keydown", (e) => {
  const row = e.target.closest("tr");
  if (!row) return;
  if (e.key === "Enter" || e.key === " ") {
    e.preventDefault();
    openTimeline(row.dataset.id);
  } else if (e.key === "ArrowDown" || e.key === "ArrowUp") {
    e.preventDefault();
    const next = e.key === "ArrowDown" ? row.nextElementSibling : row.previousElementSibling;
    if (next) next.focus();
  }
});

// -- a request's timeline, from its trace ---------------------------------------------------------------------------
async function openTimeline(id, focus = true) {
  const section = $("timeline");
  section.dataset.id = id;
  section.hidden = false;
  const body = $("timeline-body");
  $("timeline-title").textContent = "Timeline of " + id;
  if (focus) {
    body.replaceChildren(el("p", "loading…"));
    section.focus();
  }
  let trace;
  try {
    trace = await getJSON("/v1/requests/" + encodeURIComponent(id));
  } catch (err) {
    body.replaceChildren(el("p", "No trace: " + err.message, "error"));
    return;
  }
  if (section.dataset.id !== id) return; // another row was opened meanwhile
  const choices = trace.choices || [trace];
  const rendered = choices.map(renderTrace);
  rendered.forEach((box) => { box.dataset.id = id; });
  body.replaceChildren(...rendered);
}

function renderTrace(t) {
  const box = el("div", null, "trace");
  const ends = t.endpoints.map((e) => e.ended_ms ?? e.first_token_ms ?? e.started_ms);
  const span = Math.max(1, ...ends, ...t.migrations.map((m) => m.at_ms));
  const pct = (ms) => (100 * ms) / span + "%";
  const plan = t.plan ? `${t.plan.kind} (${t.plan.reason})` : "–";
  box.appendChild(el("p", `plan ${plan} · TTFT ${fmtMs(t.ttft_ms)} · ${t.completion_tokens} tokens · ` +
    `${t.delayed_tokens} delayed past the reader · ${fmtUsd(t.cost_usd)} · finish ${t.finish_reason ?? t.error ?? "–"}`));
  const lanes = el("ol", null, "lanes");
  t.endpoints.forEach((e) => {
    const lane = el("li", null, "lane");
    lane.dataset.outcome = e.outcome;
    const label = el("span", `${e.backend}${e.from_token ? " from token " + e.from_token : ""}: ${e.outcome}`, "lane-label");
    const track = el("span", null, "track");
    const bar = el("span", null, "bar " + e.outcome);
    const end = e.ended_ms ?? span;
    bar.style.left = pct(e.started_ms);
    bar.style.width = pct(Math.max(end - e.started_ms, span / 200));
    track.appendChild(bar);
    if (e.first_token_ms !== null) {
      const first = el("span", null, "mark first");
      first.style.left = pct(e.first_token_ms);
      first.title = "first token at " + fmtMs(e.first_token_ms);
      track.appendChild(first);
    }
    const text = `started ${fmtMs(e.started_ms)}, first token ${fmtMs(e.first_token_ms)}, ended ${fmtMs(e.ended_ms)}; ` +
      `prefill ${e.prefill_tokens} (cached ${e.cached_tokens}), decoded ${e.decode_tokens}` + (e.error ? "; " + e.error : "");
    lane.append(label, track, el("span", text, "lane-text"));
    lanes.appendChild(lane);
  });
  box.appendChild(lanes);
  if (t.migrations.length) {
    const list = el("ul", null, "migrations");
    for (const m of t.migrations) {
      list.appendChild(el("li", `migration at ${fmtMs(m.at_ms)} (token ${m.at_token}): ${m.from} → ${m.to}, ${m.reason}` +
        (m.lead_tokens !== undefined ? `, reader ${m.lead_tokens} tokens behind` : "") +
        (m.t_m_ms !== undefined ? `, target's first token after ${fmtMs(m.t_m_ms)}` : "") + (m.error ? `; failed: ${m.error}` : "")));
      const marker = el("span", null, "mark migration");
      marker.style.left = pct(m.at_ms);
      marker.title = `${m.reason} migration`;
      lanes.querySelectorAll(".track").forEach((tr) => tr.appendChild(marker.cloneNode()));
    }
    box.appendChild(list);
  }
  return box;
}

function closeTimeline() {
  const section = $("timeline");
  const id = section.dataset.id;
  section.hidden = true;
  delete section.dataset.id;
  const row = requests.get(id);
  if (row) row.row.focus();
}
$("timeline-close").addEventListener("click", closeTimeline);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && !$("timeline").hidden) closeTimeline();
});

// At most one reload a second, however many requests finish.
const pending = new Set();
function soon(load) {
  if (pending.has(load)) return;
  pending.add(load);
  setTimeout(() => { pending.delete(load); load(); }, 1000);
}

// -- budget ---------------------------------------------------------------------------------------------------------
async function loadBudget() {
  let b;
  try {
    b = await getJSON("/v1/budget", keys().admin || keys().api);
  } catch (err) {
    $("budget-facts").replaceChildren(el("dt", "Budget"), el("dd", "unavailable: " + err.message));
    return;
  }
  const realised = b.spend.window.realised_budget;
  const facts = [
    ["Policy", b.policy], ["Constrained side", b.effective_side], ["Target b", b.budget],
    ["Realised b", realised === null ? "no requests yet" : realised.toFixed(3)], ["λ", b.exchange_rate],
    ["r_c", b.consumption_rate + " tokens/s"], ["Migration", b.migration ? "on" : "off"],
    ["Quality τ", b.quality_threshold],
    ["Spent", fmtUsd(b.spend.cost_usd) + " over " + b.spend.requests + " requests"], ["Settings from", b.settings_source],
  ];
  if (b.store.backend !== "memory") facts.push(["Shared store", storeLine(b.store)]);
  $("budget-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", k), el("dd", v)]));
  const meter = el("meter");
  meter.min = 0; meter.max = 1; meter.value = realised ?? 0;
  meter.setAttribute("aria-label", "realised budget share against the target " + b.budget);
  $("budget-facts").appendChild(meter);
  const table = $("budget-spend");
  table.replaceChildren();
  const head = table.createTHead().insertRow();
  for (const h of ["Endpoint", "Requests", "Prefill", "Decode", "Spend", "Price prefill / decode per Mtok"]) head.appendChild(el("th", h));
  const tb = table.createTBody();
  for (const [name, s] of Object.entries(b.spend.endpoints)) {
    const r = tb.insertRow();
    const price = b.prices[name] || (name === "device" ? b.dispatch.device_prices_usd_per_mtok : null);
    for (const v of [name, s.requests, s.prefill_tokens, s.decode_tokens, fmtUsd(s.cost_usd),
      price ? `$${(+price.prefill).toPrecision(3)} / $${(+price.decode).toPrecision(3)}` : "–"]) r.appendChild(el("td", v));
  }
  renderKeys(b.keys || []);
  const form = $("budget-form");
  if (!form.contains(document.activeElement)) {
    $("budget-b").value = b.budget;
    $("budget-lambda").value = b.exchange_rate;
    $("budget-rc").value = b.consumption_rate;
    $("budget-tau").value = b.quality_threshold;
    const select = $("budget-policy");
    select.replaceChildren(...b.known_policies.map((p) => { const o = el("option", p); o.value = p; return o; }));
    select.value = b.policy;
  }
}

// The shared store as this replica sees it: connected, lost (bookings and traces wait) or degraded (it answers, but
// this replica is out of step: settings it cannot read, a background task failing), and what waits for it.
function storeLine(store) {
  const waiting = `${store.pending} bookings, ${store.traces_pending} traces waiting`;
  const dropped = store.traces_dropped ? `; ${store.traces_dropped} traces dropped` : "";
  const problems = store.problems.length ? ` (${store.problems.join("; ")})` : "";
  return `${store.state}${problems}: ${waiting}${dropped}`;
}

// Spend per API key, by the key's name or a short hash of it (the gateway never sends a key): every key's with the
// admin key, only its own with an API key.
function renderKeys(lines) {
  const table = $("budget-keys");
  table.replaceChildren();
  if (!lines.length) return;
  table.createCaption().textContent = "Spend by API key";
  const head = table.createTHead().insertRow();
  for (const h of ["Key", "Period", "Spent", "Cap", "In flight", "Requests / min", "Tokens / min"]) head.appendChild(el("th", h));
  const tb = table.createTBody();
  const orDash = (v) => (v === null || v === undefined ? "–" : v);
  for (const k of lines) {
    const r = tb.insertRow();
    r.dataset.key = k.name;
    const cap = k.cap_usd === null ? "none" : `${fmtUsd(k.cap_usd)} (${fmtUsd(Math.max(0, k.cap_usd - k.spent_usd))} left; ` +
      `at the cap: ${k.at_cap === "device" ? "device only" : "refused"})`;
    for (const v of [k.name, k.period, fmtUsd(k.spent_usd), cap, orDash(k.streams),
      k.rpm === null ? orDash(k.requests_this_minute) : `${k.requests_this_minute} of ${k.rpm}`,
      k.tpm === null ? k.tokens_this_minute : `${k.tokens_this_minute} of ${k.tpm}`]) r.appendChild(el("td", v));
  }
}

$("budget-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const patch = {
    budget: parseFloat($("budget-b").value),
    policy: $("budget-policy").value,
    exchange_rate: parseFloat($("budget-lambda").value),
    consumption_rate: parseFloat($("budget-rc").value),
    quality_threshold: parseFloat($("budget-tau").value),
  };
  const msg = $("budget-message");
  const r = await fetch("/v1/budget", {
    method: "PUT",
    headers: { "Content-Type": "application/json", ...authHeaders(keys().admin) },
    body: JSON.stringify(patch),
  });
  const body = await r.json().catch(() => ({}));
  msg.className = r.ok ? "ok" : "error";
  msg.textContent = r.ok ? `Saved: b = ${body.budget}, policy ${body.policy} (version ${body.version}).`
    : `Refused (${r.status}): ${(body.error && body.error.message) || r.statusText}`;
  if (r.ok) loadBudget();
});

// -- endpoints' health: readiness, live counters, TTFT and inter-token histograms from /metrics --------------------
function histograms(text, name) {
  const out = {};
  const re = new RegExp("^" + name + '_bucket\\{backend="([^"]+)",le="([^"]+)"\\} ([0-9.e+-]+)', "gm");
  let m;
  while ((m = re.exec(text))) (out[m[1]] = out[m[1]] || []).push([m[2] === "+Inf" ? Infinity : parseFloat(m[2]), parseFloat(m[3])]);
  return out;
}

function quantile(buckets, q) {
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (!total) return null;
  const hit = buckets.find(([, count]) => count >= q * total);
  return hit[0];
}

function histogramFigure(title, buckets) {
  const fig = el("figure", null, "hist");
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  const p50 = quantile(buckets, 0.5);
  const p90 = quantile(buckets, 0.9);
  const fmt = (s) => (s === null ? "–" : s === Infinity ? "> last bucket" : "≤ " + fmtMs(s * 1000));
  fig.appendChild(el("figcaption", `${title}: ${total} samples, p50 ${fmt(p50)}, p90 ${fmt(p90)}`));
  const bars = el("div", null, "bars");
  bars.setAttribute("aria-hidden", "true");
  let prev = 0;
  const counts = buckets.map(([le, c]) => { const n = c - prev; prev = c; return [le, n]; });
  const most = Math.max(1, ...counts.map(([, n]) => n));
  for (const [le, n] of counts) {
    const bar = el("span", null, "hbar");
    bar.style.height = (100 * n) / most + "%";
    bar.title = `≤ ${le === Infinity ? "∞" : fmtMs(le * 1000)}: ${n}`;
    bars.appendChild(bar);
  }
  fig.appendChild(bars);
  return fig;
}

async function loadHealth() {
  try {
    const [eps, ready, metrics] = await Promise.all([
      getJSON("/v1/endpoints"),
      fetch("/health/ready").then((r) => r.json()),
      fetch("/metrics").then((r) => r.text()),
    ]);
    const ttft = histograms(metrics, "tandem_ttft_seconds");
    const itl = histograms(metrics, "tandem_inter_token_seconds");
    const cards = eps.data.map((e) => {
      const card = el("article", null, "endpoint");
      const up = ready.backends && ready.backends[e.name];
      card.dataset.endpoint = e.name;
      card.appendChild(el("h3", `${e.name} (${e.role}, ${e.locality})`));
      card.appendChild(el("p", `${e.model} · ${up ? "ready" : "not ready"} · ${e.active} streams · ${e.tokens_generated} tokens generated`,
        up ? "ok" : "error"));
      if (e.breaker) {  // a cloud's circuit breaker (policies/breaker.py): while open, DiSCo does not start it
        const b = e.breaker;
        const line = el("p", b.state === "open" ? `breaker open: ${b.reason}, after: ${b.last_error}`
          : `breaker closed${b.failures ? ` (${b.failures} failures in a row)` : ""}`, b.state === "open" ? "error" : "ok");
        line.dataset.breaker = b.state;
        card.appendChild(line);
      }
      card.appendChild(histogramFigure("TTFT", ttft[e.name] || []));
      card.appendChild(histogramFigure("Inter-token", itl[e.name] || []));
      if (e.hat) card.appendChild(el("p", `HAT: worker ${e.hat.workers.map((w) => w.url).join(", ")}, ${e.hat.sessions} sessions, ` +
        `accept length ${e.hat.accept_length.toFixed(2)}, ${e.hat.draft_shape}`));
      if (e.prompt_cache) {  // the device's prompt cache (docs/prompt-cache.md)
        const c = e.prompt_cache, mb = (n) => (n / 1048576).toFixed(1);
        const line = el("p", `prompt cache: ${c.entries} states, ${mb(c.bytes)} of ${mb(c.limit_bytes)} MB in RAM · ` +
          `${c.disk_entries} states, ${mb(c.disk_bytes)} MB on disk · hit rate ${(100 * c.hit_rate).toFixed(0)} %, ` +
          `${(100 * c.token_hit_rate).toFixed(0)} % of prompt tokens cached · ${c.restores_ram + c.restores_disk} restored`);
        line.dataset.promptCache = "";
        card.appendChild(line);
      }
      return card;
    });
    $("health-body").replaceChildren(...cards);
  } catch (err) {
    $("health-body").replaceChildren(el("p", "unavailable: " + err.message, "error"));
  }
}

// -- HAT sessions ---------------------------------------------------------------------------------------------------
function onHatEvent(ev) {
  let row = hatSessions.get(ev.session);
  if (!row) {
    row = $("hat-rows").insertRow(0);
    for (let i = 0; i < 7; i++) row.insertCell();
    hatSessions.set(ev.session, row);
  }
  const closed = ev.type === "hat.session.closed";
  const values = [ev.session, ev.backend, ev.worker, ev.mu.toFixed(2), ev.draft_shape,
    closed && ev.accept_length !== null ? ev.accept_length.toFixed(2) : "–", closed ? `closed after ${ev.rounds} rounds` : "open"];
  values.forEach((v, i) => { row.cells[i].textContent = v; });
}

// -- the event feed -------------------------------------------------------------------------------------------------
function logEvent(ev) {
  const log = $("event-log");
  const what = ev.type === "dropped" ? `dropped ${ev.count} events from id ${ev.from_id} (this page was too slow); reloading`
    : `${ev.type} ${ev.request_id ? short(ev.request_id) : ""} ${ev.backend || ""}`;
  log.insertBefore(el("li", new Date(ev.time * 1000).toLocaleTimeString() + " " + what), log.firstChild);
  while (log.children.length > 60) log.lastChild.remove();
}

function onEvent(ev) {
  logEvent(ev);
  if (ev.type.startsWith("hat.session.")) onHatEvent(ev);
  else if (ev.request_id) onRequestEvent(ev);
  else if (ev.type === "budget.changed") loadBudget();
  else if (ev.type === "dropped") { loadBudget(); loadHealth(); }
}

async function stream() {
  if (streamAbort) streamAbort.abort();
  const abort = (streamAbort = new AbortController());
  const headers = authHeaders(keys().api);
  if (lastEventId !== null) headers["Last-Event-ID"] = String(lastEventId);
  const status = $("connection");
  try {
    const r = await fetch("/v1/events", { headers, signal: abort.signal, cache: "no-store" });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      status.textContent = "not connected: " + ((body.error && body.error.message) || r.status);
      status.className = "error";
      return;
    }
    status.textContent = "live";
    status.className = "ok";
    document.body.dataset.live = "true";
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (!data) continue;
        const ev = JSON.parse(data);
        if (ev.id !== null) lastEventId = ev.id;
        onEvent(ev);
      }
    }
  } catch (err) {
    if (abort.signal.aborted) return;
  }
  if (abort.signal.aborted) return;
  document.body.dataset.live = "false";
  status.textContent = "reconnecting…";
  status.className = "error";
  setTimeout(stream, 1000); // resumes after lastEventId while the gateway still holds it
}

$("keys").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("tandem.api", $("api-key").value);
  sessionStorage.setItem("tandem.admin", $("admin-key").value);
  connect();
});

function connect() {
  stream();
  loadBudget();
  loadHealth();
}

$("api-key").value = keys().api;
$("admin-key").value = keys().admin;
connect();
setInterval(loadHealth, 5000);
