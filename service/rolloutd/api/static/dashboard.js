// rolloutd's built-in dashboard: thirteen areas of live charts over v1/dashboard/history, the
// trainer's side first. An area with nothing to show says so instead of plotting zeros.
//
// The service samples its own metrics every few seconds (rolloutd.telemetry.history); counters
// arrive as totals since the history began, so a rate is the difference of two points of one run
// over their time apart, and a mean duration is the increase of a histogram's sum over the
// increase of its count. The time axis is wall-clock; points of different runs (a restart in
// between) are never joined by a line, and a dashed rule marks where a new run begins.
// Every URL is relative, so the page works behind kubectl port-forward or a path prefix.
"use strict";

(() => {
  const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"];
  const CKPT_PHASES = ["total", "barrier_wait", "exclusive_hold", "buffer_save", "sidecar_write", "commit"];
  const RESTORE_PHASES = ["total", "resolve_snapshot", "dataloader", "buffer", "replay_metadata", "recovery_ledger", "redispatch"];
  const FATES = ["delivered", "buffered", "evicted", "dropped", "failed", "regenerated"];
  const ENGINE_STATES = ["generating", "weight_update", "idle_no_work", "idle_buffer_full"];

  const mean = (prefixSum, prefixCount, phase, scale) => ({
    label: phase, kind: "mean", sum: `${prefixSum}/${phase}`, count: `${prefixCount}/${phase}`, scale,
  });

  // Series kinds: "rate" (per second, within one run), "value" (as sampled), "mean"
  // (increase of sum / increase of count, drawn as dots: one per interval with events), "share"
  // (increase of the keys under `part` over that plus the increase of `rest`, also dots).
  // A series with `prefix` stands for every key under it that is non-zero somewhere.
  // A value counts as something to show when it is non-zero, or present at all for a series
  // marked `zeroIsData` (a trainer step of 0, on-policy staleness); an area where nothing
  // counts shows its `empty` sentence instead of its charts.
  // An area with `needs: "scoring"` shows its `none` text instead of charts while no verifier
  // is configured and no reward was ever recorded.
  const AREAS = [
    {
      id: "trainer", title: "Trainer",
      what: "What trainers receive: groups delivered (acked), groups leased and not yet acked, the highest trainer step acked, and how many policy versions behind the served weights delivered groups were.",
      empty: "No trainer has fetched or acked yet. Start one (rolloutd trainer --target HOST:PORT, or your own loop) and its side shows here.",
      charts: [
        { title: "delivered groups/s", series: [{ label: "acked", kind: "rate", key: "acked_groups" }] },
        { title: "groups leased to trainers", series: [{ label: "leased", kind: "value", key: "buffer_groups/leased" }] },
        { title: "trainer step", series: [{ label: "highest acked", kind: "value", key: "trainer_step", zeroIsData: true }] },
        { title: "staleness delivered (policy versions)", series: [{ label: "mean", kind: "mean", sum: "staleness_sum", count: "staleness_count", zeroIsData: true }] },
      ],
    },
    {
      id: "generation", title: "Generation",
      what: "Raw generation throughput: every token the engine produced, used or not.",
      empty: "No tokens generated yet.",
      charts: [{ title: "generation tokens/s", series: [{ label: "generated", kind: "rate", key: "generation_tokens" }] }],
    },
    {
      id: "usable-output", title: "Usable output",
      what: "Tokens and groups that became training-ready (committed).",
      empty: "No group committed yet.",
      charts: [
        { title: "committed tokens/s", series: [{ label: "committed", kind: "rate", key: "committed_tokens" }] },
        { title: "committed groups/s", series: [{ label: "committed", kind: "rate", key: "committed_groups" }] },
      ],
    },
    {
      id: "efficiency", title: "Efficiency",
      what: "Where generation goes: every generated token is delivered to a trainer, still buffered, or wasted (evicted as too stale, dropped by a filter, failed, or thrown away to be generated again); goodput is the share delivered. And what the engine's time went to: generating, loading weights, or idle with nothing to start or the buffer full.",
      empty: "No token generated yet.",
      charts: [
        { title: "tokens by fate (total)", series: FATES.map((f) => ({ label: f, kind: "value", key: `tokens/${f}` })) },
        { title: "goodput (%)", series: [{ label: "delivered / generated", kind: "value", key: "goodput", scale: 100 }] },
        { title: "engine time (%)", series: ENGINE_STATES.map((s) => ({ label: s, kind: "rate", key: `engine_seconds/${s}`, scale: 100 })) },
      ],
    },
    {
      id: "engine", title: "Engine",
      what: "The engine's own signals, under their OpenTelemetry GenAI names: time to first token and per output token, request duration, tokens per request; preemptions (more sequences than the KV cache holds) and the prefix cache's hit ratio.",
      empty: "No engine request finished yet.",
      charts: [
        {
          title: "mean latency (ms)", series: [
            { label: "first token", kind: "mean", sum: "first_token_sum", count: "first_token_count", scale: 1000 },
            { label: "per output token", kind: "mean", sum: "per_token_sum", count: "per_token_count", scale: 1000 },
          ],
        },
        { title: "mean request duration (s)", series: [{ label: "request", kind: "mean", sum: "request_seconds_sum", count: "request_seconds_count" }] },
        { title: "tokens per request", series: ["input", "output"].map((t) => ({ label: t, kind: "mean", sum: `token_usage_sum/${t}`, count: `token_usage_count/${t}` })) },
        { title: "preemptions/s", series: [{ label: "preempted", kind: "rate", key: "preemptions" }] },
        { title: "prefix-cache hit ratio (%)", series: [{ label: "recent requests", kind: "value", key: "prefix_cache_hit_ratio", scale: 100 }] },
      ],
    },
    {
      id: "checkpoint-latency", title: "Checkpoint latency",
      what: "Mean duration of the attempts in each interval: the whole attempt and each phase.",
      empty: "No checkpoint written yet: one runs every checkpoint.interval_s, when a trainer calls Checkpoint, and at shutdown.",
      charts: [{ title: "duration (ms)", series: CKPT_PHASES.map((p) => mean("checkpoint_seconds_sum", "checkpoint_seconds_count", p, 1000)) }],
    },
    {
      id: "backpressure", title: "Backpressure",
      what: "Mutations that waited for a checkpoint's exclusive hold, by kind, and how long.",
      empty: "No mutation has waited for a checkpoint.",
      charts: [
        { title: "blocked mutations/s", series: [{ label: "all kinds", kind: "rate", sumOf: "blocked/" }, { prefix: "blocked/", kind: "rate" }] },
        { title: "mean wait (ms)", series: [{ label: "wait", kind: "mean", sum: "blocked_wait_sum", count: "blocked_wait_count", scale: 1000 }] },
      ],
    },
    {
      id: "reliability", title: "Reliability",
      what: "Checkpoint attempts by outcome and reason (totals), and the cadence achieved.",
      empty: "No checkpoint attempted yet.",
      charts: [
        { title: "attempts (total) by outcome / reason", series: [{ prefix: "attempts/", kind: "value" }] },
        {
          title: "effective cadence (s)", series: [
            { label: "since last success", kind: "value", key: "since_success" },
            { label: "spacing", kind: "mean", sum: "spacing_sum", count: "spacing_count" },
            { label: "configured interval", kind: "value", key: "interval" },
          ],
        },
      ],
    },
    {
      id: "restore", title: "Restore",
      what: "Duration of each restore at start-up: the whole restore and each phase.",
      empty: "Nothing restored in this history: the service started fresh (no snapshot, or --restore none).",
      charts: [{ title: "duration (ms)", series: RESTORE_PHASES.map((p) => mean("restore_seconds_sum", "restore_seconds_count", p, 1000)) }],
    },
    {
      id: "recovery", title: "Recovery efficiency",
      what: "What restores found (totals): complete groups back as they were; siblings of unfinished groups reused versus generated again; partial tokens of unfinished siblings continued from versus generated again; model turns of episodes reused versus rerun (the first turn each restored episode generated).",
      empty: "Nothing recovered: no restore in this history found groups to bring back.",
      charts: [
        { title: "groups restored, by state", series: ["committed", "leased", "acked", "unfinished"].map((s) => ({ label: s, kind: "value", key: `recovery_groups/${s}` })) },
        { title: "siblings reused vs rerun", series: ["reused", "rerun"].map((s) => ({ label: s, kind: "value", key: `recovery_siblings/${s}` })) },
        { title: "partial tokens reused vs regenerated", series: ["reused", "regenerated"].map((s) => ({ label: s, kind: "value", key: `recovery_tokens/${s}` })) },
        { title: "episode turns reused vs rerun", series: ["reused", "rerun"].map((s) => ({ label: s, kind: "value", key: `recovery_turns/${s}` })) },
      ],
    },
    {
      id: "snapshot-size", title: "Snapshot size",
      what: "The last completed snapshot: rows new in its delta, removed, live; bytes written.",
      empty: "No snapshot written yet.",
      charts: [
        { title: "rows", series: ["live", "new", "removed"].map((k) => ({ label: k, kind: "value", key: `rows/${k}` })) },
        { title: "bytes written", bytes: true, series: ["total", "segments", "groups", "sidecar", "submissions", "ledger", "partials"].map((k) => ({ label: k, kind: "value", key: `size_bytes/${k}` })) },
      ],
    },
    {
      id: "rewards", title: "Rewards", needs: "scoring",
      what: "What the verifier made of the samples, and the finished groups dropped before training (zero reward variance, failed scores, engine errors) with the generation they wasted.",
      none: "No verifier is configured (scoring.verifier or scoring.group_verifier): groups are delivered unscored, so there are no rewards to draw.",
      empty: "No group has been scored yet.",
      charts: [
        { title: "mean reward", series: [{ label: "scored samples", kind: "mean", sum: "reward_sum", count: "reward_count" }] },
        { title: "dropped share of finished groups (%)", series: [{ label: "dropped", kind: "share", part: "dropped_groups/", rest: "committed_groups", scale: 100 }] },
        { title: "dropped groups/s by reason", series: [{ label: "all reasons", kind: "rate", sumOf: "dropped_groups/" }, { prefix: "dropped_groups/", kind: "rate" }] },
        { title: "wasted tokens/s", series: [{ label: "dropped groups", kind: "rate", sumOf: "dropped_tokens/" }] },
        { title: "scorer failures (total) by kind", series: [{ prefix: "scoring_failures/", kind: "value" }] },
        { title: "mean scoring time (ms)", series: [{ label: "per group", kind: "mean", sum: "score_seconds_sum", count: "score_seconds_count", scale: 1000 }] },
      ],
    },
    {
      id: "admission", title: "Admission",
      what: "How many groups may generate at once and why (limits.max_in_flight, or with auto what the engine's KV cache holds without preempting), the groups in flight, the trainers' pace per policy version that staleness gating admits for, and groups evicted as too stale all the same.",
      empty: "Nothing admitted yet.",
      charts: [
        { title: "groups in flight: limit (by reason) and actual", series: [{ prefix: "in_flight_limit/", kind: "value" }, { label: "generating", kind: "value", key: "buffer_groups/generating" }, { label: "finishing", kind: "value", key: "buffer_groups/finishing" }] },
        { title: "KV-cache usage", series: [{ label: "used", kind: "value", key: "kv_cache_usage", zeroIsData: true }] },
        { title: "staleness gate (groups)", series: [{ label: "consumed per version", kind: "value", key: "consumed_per_version" }, { label: "room", kind: "value", key: "staleness_room", zeroIsData: true }] },
        { title: "evicted groups/s", series: [{ label: "evicted", kind: "rate", key: "evicted_groups" }] },
      ],
    },
  ];

  let points = [];
  let counters = [];
  let capacity = 1440;
  let intervalS = 5;
  let draws = 0;
  let listedSequence = null;
  let scoring = false;
  const $ = (id) => document.getElementById(id);

  const isCounter = (key) => counters.includes(key.split("/")[0]);
  const valueOf = (p, key) => (key in p.v ? p.v[key] : isCounter(key) ? 0 : null);
  const sumOf = (p, prefix) => Object.keys(p.v).filter((k) => k.startsWith(prefix)).reduce((a, k) => a + p.v[k], 0);

  function read(spec, prev, p) {
    const get = (q) => (spec.sumOf ? sumOf(q, spec.sumOf) : valueOf(q, spec.key));
    const scale = spec.scale || 1;
    if (spec.kind === "value") {
      const v = get(p);
      return v === null ? null : v * scale;
    }
    if (spec.kind === "rate") {
      if (!prev || prev.run !== p.run || p.t <= prev.t) return null;
      const a = get(prev), b = get(p);
      return a === null || b === null ? null : ((b - a) / (p.t - prev.t)) * scale;
    }
    if (!prev) return null; // mean and share: events between two points, also across a restart
    if (spec.kind === "share") {
      const part = sumOf(p, spec.part) - sumOf(prev, spec.part);
      const whole = part + valueOf(p, spec.rest) - valueOf(prev, spec.rest);
      return whole > 0 ? (part / whole) * (spec.scale || 1) : null;
    }
    const dc = valueOf(p, spec.count) - valueOf(prev, spec.count);
    return dc > 0 ? ((valueOf(p, spec.sum) - valueOf(prev, spec.sum)) / dc) * (spec.scale || 1) : null;
  }

  function expand(specs, visible) {
    const out = [];
    for (const s of specs) {
      if (!s.prefix) { out.push(s); continue; }
      const keys = new Set();
      for (const p of visible) for (const k of Object.keys(p.v)) if (k.startsWith(s.prefix) && p.v[k] !== 0) keys.add(k);
      for (const k of [...keys].sort()) out.push({ label: k.slice(s.prefix.length), kind: s.kind, key: k });
    }
    return out;
  }

  function niceStep(range, target) {
    const raw = range / target;
    const mag = 10 ** Math.floor(Math.log10(raw));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }

  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
  const pad = (n) => String(n).padStart(2, "0");
  function clock(t, withSeconds) {
    const d = new Date(t * 1000);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}` + (withSeconds ? `:${pad(d.getSeconds())}` : "");
  }

  function fmt(v, bytes) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    const units = bytes ? ["B", "KiB", "MiB", "GiB", "TiB"] : ["", "k", "M", "G", "T"];
    const base = bytes ? 1024 : 1000;
    let i = 0;
    let x = Math.abs(v);
    while (x >= base && i < units.length - 1) { x /= base; i++; }
    const shown = x >= 100 ? Math.round(x) : Number(x.toPrecision(3));
    return `${v < 0 ? "-" : ""}${shown}${bytes ? " " : ""}${units[i]}`;
  }

  function drawChart(canvas, chart, visible, prevOfFirst, t0, t1) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
    if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const left = 52, right = 8, top = 6, bottom = 18;
    const pw = w - left - right, ph = h - top - bottom;

    const series = expand(chart.series, visible).map((spec, i) => {
      const color = PALETTE[i % PALETTE.length];
      const data = visible.map((p, j) => [p.t, read(spec, j === 0 ? prevOfFirst : visible[j - 1], p), p.run]);
      return { spec, color, data };
    });
    let ymax = 0;
    let plotted = 0;
    for (const s of series) {
      for (const [, y] of s.data) {
        if (y === null) continue;
        ymax = Math.max(ymax, y);
        if (y !== 0 || s.spec.zeroIsData) plotted++;
      }
    }
    ymax = ymax > 0 ? ymax * 1.1 : 1;
    const x = (t) => left + ((t - t0) / Math.max(t1 - t0, 1e-9)) * pw;
    const y = (v) => top + ph - (v / ymax) * ph;

    ctx.font = "11px system-ui, sans-serif";
    ctx.strokeStyle = "#e4e7ec";
    ctx.fillStyle = "#667085";
    ctx.lineWidth = 1;
    const ystep = niceStep(ymax, 4);
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let v = 0; v <= ymax; v += ystep) {
      ctx.beginPath(); ctx.moveTo(left, Math.round(y(v)) + 0.5); ctx.lineTo(w - right, Math.round(y(v)) + 0.5); ctx.stroke();
      ctx.fillText(fmt(v, chart.bytes), left - 4, y(v));
    }
    const span = t1 - t0;
    const tstep = TIME_STEPS.find((s) => span / s <= 6) || 86400;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let t = Math.ceil(t0 / tstep) * tstep; t <= t1; t += tstep) {
      const label = clock(t, tstep < 60);
      const half = ctx.measureText(label).width / 2;
      if (x(t) - half >= 0 && x(t) + half <= w) ctx.fillText(label, x(t), top + ph + 4);
    }

    ctx.save();
    ctx.setLineDash([4, 3]);
    ctx.strokeStyle = "#98a2b3";
    ctx.textAlign = "left";
    for (let j = 0; j < visible.length; j++) {
      const prev = j === 0 ? prevOfFirst : visible[j - 1];
      if (prev && prev.run !== visible[j].run) {
        const rx = Math.round(x(visible[j].t)) + 0.5;
        ctx.beginPath(); ctx.moveTo(rx, top); ctx.lineTo(rx, top + ph); ctx.stroke();
        const label = rx + 48 > w ? "restart " : " restart";
        ctx.textAlign = rx + 48 > w ? "right" : "left";
        ctx.fillText(label, rx, top + 4);
      }
    }
    ctx.restore();

    ctx.lineWidth = 1.6;
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      const dots = s.spec.kind === "mean" || s.spec.kind === "share";
      let open = false;
      for (let j = 0; j < s.data.length; j++) {
        const [t, v, run] = s.data[j];
        if (v === null) { open = false; continue; }
        const isolated = (j === 0 || s.data[j - 1][1] === null || s.data[j - 1][2] !== run)
          && (j === s.data.length - 1 || s.data[j + 1][1] === null || s.data[j + 1][2] !== run);
        if (dots || isolated) {
          ctx.beginPath(); ctx.arc(x(t), y(v), 2.5, 0, 2 * Math.PI); ctx.fill();
          open = false;
          if (dots) continue;
        }
        if (open && s.data[j - 1][2] === run) ctx.lineTo(x(t), y(v));
        else { if (open) ctx.stroke(); ctx.beginPath(); ctx.moveTo(x(t), y(v)); }
        open = true;
        if (j === s.data.length - 1 || s.data[j + 1][1] === null || s.data[j + 1][2] !== run) { ctx.stroke(); open = false; }
      }
    }
    return { series, plotted };
  }

  function legend(el, series, bytes) {
    el.replaceChildren(...series.map((s) => {
      const last = [...s.data].reverse().find(([, v]) => v !== null);
      const span = document.createElement("span");
      span.style.setProperty("--c", s.color);
      span.append(`${s.spec.label} `);
      const b = document.createElement("b");
      b.textContent = last ? fmt(last[1], bytes) : "–";
      span.append(b);
      return span;
    }));
  }

  function build() {
    const main = $("areas");
    for (const area of AREAS) {
      const section = document.createElement("section");
      section.className = area === AREAS[0] ? "area first" : "area";
      section.id = `area-${area.id}`;
      section.dataset.points = "0";
      section.innerHTML = `<h2></h2><p class="what"></p><p class="empty" hidden></p><div class="charts"></div>`;
      section.querySelector("h2").textContent = area.title;
      section.querySelector(".what").textContent = area.what;
      section.querySelector(".empty").textContent = area.empty;
      if (area.none) {
        const none = document.createElement("p");
        none.className = "none";
        none.hidden = true;
        none.textContent = area.none;
        section.querySelector(".what").after(none);
      }
      for (const chart of area.charts) {
        const div = document.createElement("div");
        div.className = "chart";
        div.innerHTML = `<h3></h3><canvas></canvas><div class="legend"></div>`;
        div.querySelector("h3").textContent = chart.title;
        chart.canvas = div.querySelector("canvas");
        chart.legend = div.querySelector(".legend");
        section.querySelector(".charts").append(div);
      }
      main.append(section);
    }
  }

  function draw() {
    if (!points.length) return;
    const t1 = points[points.length - 1].t;
    const windowS = Number($("window").value);
    const t0 = Math.max(windowS > 0 ? t1 - windowS : -Infinity, points[0].t, t1 - 86400 * 365);
    const first = points.findIndex((p) => p.t >= t0);
    const visible = points.slice(first);
    const prevOfFirst = first > 0 ? points[first - 1] : null;
    const restarts = visible.filter((p, j) => (j === 0 ? prevOfFirst : visible[j - 1])?.run !== undefined
      && (j === 0 ? prevOfFirst : visible[j - 1]).run !== p.run).length;
    const state = { lastT: t1, draws: ++draws, points: points.length, restarts, areas: {} };
    const scored = scoring || points.some((p) => (p.v.reward_count || 0) > 0);
    for (const area of AREAS) {
      let plotted = 0, nseries = 0;
      const charts = {};
      const el = $(`area-${area.id}`);
      if (area.needs === "scoring") {
        el.querySelector(".none").hidden = scored;
        el.querySelector(".charts").hidden = !scored;
        el.querySelector(".empty").hidden = true;
        el.dataset.none = String(!scored);
        if (!scored) {
          el.dataset.points = "0";
          state.areas[area.id] = { plotted: 0, series: 0, none: true };
          continue;
        }
      }
      for (const chart of area.charts) {
        const r = drawChart(chart.canvas, chart, visible, prevOfFirst, t0, t1);
        legend(chart.legend, r.series, chart.bytes);
        plotted += r.plotted;
        nseries += r.series.length;
        charts[chart.title] = r.plotted;
      }
      el.dataset.points = String(plotted);
      el.querySelector(".empty").hidden = plotted > 0;
      el.querySelector(".charts").hidden = plotted === 0;
      state.areas[area.id] = { plotted, series: nseries, charts, empty: plotted === 0, none: false };
    }
    document.body.dataset.lastT = String(t1);
    window.rolloutdDashboard = state;
  }

  async function getJSON(url) {
    const r = await fetch(url, { cache: "no-store" });
    if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
    return r.json();
  }

  async function refreshHistory() {
    const since = points.length ? points[points.length - 1].t : null;
    const h = await getJSON(`v1/dashboard/history${since === null ? "" : `?since=${since}`}`);
    counters = h.counters;
    scoring = Boolean(h.scoring);
    capacity = h.capacity;
    intervalS = h.interval_s;
    points.push(...h.points);
    if (points.length > capacity) points = points.slice(points.length - capacity);
  }

  async function refreshStatus() {
    const s = await getJSON("v1/status");
    const state = String(s.state || "").replace(/^SERVING_STATE_/, "").toLowerCase();
    const el = $("state");
    el.textContent = state || "unknown";
    el.className = `state ${state === "serving" ? "serving" : ""}`;
    const sequence = (s.last_checkpoint || {}).sequence || 0;
    if (sequence !== listedSequence) {  // listing reads the store: only when a snapshot was added
      await refreshCheckpoints();
      listedSequence = sequence;
    }
    const b = s.buffer || {};
    $("summary").textContent = `engine ${s.engine} · policy v${s.policy_version || 0} · group size ${s.group_size}`
      + ` · buffer: ${b.committed || 0} ready, ${b.leased || 0} leased, ${b.generating || 0} generating`;
  }

  async function refreshCheckpoints() {
    const list = await getJSON("v1/checkpoints");
    $("checkpoints").replaceChildren(...list.slice(0, 8).map((c) => {
      const tr = document.createElement("tr");
      for (const v of [c.sequence, c.tag || "–", c.trainer_step ?? "–", new Date(c.created_unix_s * 1000).toLocaleTimeString(), fmt(c.rows), fmt(c.size_bytes, true)]) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      return tr;
    }));
  }

  async function tick() {
    try {
      await Promise.all([refreshHistory(), refreshStatus()]);
      draw();
      $("footer").textContent = `${points.length} points, one every ${intervalS} s; updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      $("state").textContent = "unreachable";
      $("state").className = "state down";
      $("footer").textContent = `cannot reach the service (${err.message}); retrying`;
    }
    setTimeout(tick, intervalS * 1000);
  }

  build();
  $("window").addEventListener("change", draw);
  window.addEventListener("resize", draw);
  tick();
})();
