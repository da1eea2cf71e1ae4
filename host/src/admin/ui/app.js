// ferry's dashboard: one page that draws itself from the admin API (/v1/…) with the session
// cookie and the session key. Everything from the outbox (payloads, headers, errors, route and
// type names) is data written by other programs, so it only ever reaches the page as text nodes,
// never as markup.
"use strict";

(() => {
  // The session key: handed out once by the sign-in's answer, kept in this origin's storage (which
  // other ports of the host cannot read, unlike the cookie), and sent with every API request.
  const KEY = "ferry-session-key";
  const handedOut = document.querySelector('meta[name="ferry-key"]');
  if (handedOut) {
    localStorage.setItem(KEY, handedOut.content);
    window.location.replace("/ui");
    return;
  }
  const main = document.getElementById("main");
  const noticeBox = document.getElementById("notice");
  const STATUSES = ["PENDING", "PROCESSING", "SENT", "FAILED"];
  const REASONS = ["permanent", "attempts_exhausted", "no_transport", "plugin_fault", "invalid_event", "operator"];
  const POLL_MS = 2000;
  // Columns whose cells are numbers, right-aligned with their heading.
  const NUMERIC = /^(events|attempts|#|ms|pending|processing|sent|failed|failures in a row)$/i;
  const TEXT_SHOWN = 64 * 1024;
  const BYTES_SHOWN = 4 * 1024;
  let poll = null;
  let generation = 0;
  let signedOut = false;

  // ---- building the page ----

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    setAttrs(el, attrs);
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : String(child));
    }
    return el;
  }

  function svg(tag, attrs, ...children) {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    setAttrs(el, attrs);
    for (const child of children.flat()) {
      if (child !== null && child !== undefined && child !== false) el.append(child instanceof Node ? child : String(child));
    }
    return el;
  }

  function setAttrs(el, attrs) {
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else if (key === "class") el.setAttribute("class", value);
      else el.setAttribute(key, value === true ? "" : String(value));
    }
  }

  function table(headers, rows, caption) {
    return h("div", { class: "table-wrap" },
      h("table", {},
        caption ? h("caption", { class: "muted" }, caption) : null,
        h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col", class: NUMERIC.test(t) ? "num" : null }, t)))),
        h("tbody", {}, rows)));
  }

  function badge(text, cls) {
    return h("span", { class: `badge ${cls}` }, text);
  }

  function when(iso) {
    if (!iso) return "–";
    const t = new Date(iso);
    return h("time", { datetime: iso, title: iso }, `${t.toLocaleString()} (${ago(t)})`);
  }

  function ago(t) {
    const s = (t.getTime() - Date.now()) / 1000;
    const abs = Math.abs(s);
    const text = abs < 1 ? "now" : duration(abs);
    return abs < 1 ? text : s < 0 ? `${text} ago` : `in ${text}`;
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 90) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
    if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
    if (seconds < 172800) return `${(seconds / 3600).toFixed(1)} h`;
    return `${(seconds / 86400).toFixed(1)} d`;
  }

  function number(n) {
    return (n ?? 0).toLocaleString();
  }

  function events(n) {
    return `${number(n)} ${n === 1 ? "event" : "events"}`;
  }

  function notice(text, isError) {
    noticeBox.textContent = text;
    noticeBox.className = isError ? "notice error" : "notice";
  }

  // ---- talking to ferry ----

  async function api(method, path, body) {
    const key = localStorage.getItem(KEY);
    if (!key) {
      signOutView("This browser holds no session key for this dashboard (it was cleared, or the session began in another browser profile).");
      throw new Error("signed out");
    }
    const init = { method, credentials: "same-origin", headers: { Accept: "application/json", "X-Ferry-Session": key } };
    if (method !== "GET") {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body || {});
    }
    const response = await fetch(path, init);
    if (response.status === 401) {
      let message = "The session has ended.";
      try { message = (await response.json()).error.message; } catch { /* the generic message */ }
      // Another tab may have signed in meanwhile: only this request's key is forgotten.
      if (localStorage.getItem(KEY) === key) localStorage.removeItem(KEY);
      signOutView(message);
      throw new Error("signed out");
    }
    const text = await response.text();
    let json = null;
    try { json = text ? JSON.parse(text) : null; } catch { /* not JSON: reported below */ }
    if (!response.ok) throw new Error(json?.error?.message || `${response.status} ${response.statusText}`);
    return json;
  }

  function query(params) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") q.set(k, v);
    const s = q.toString();
    return s ? `?${s}` : "";
  }

  // Shown in place of the page when the session is gone: why, and the sign-in form again.
  function signOutView(why) {
    signedOut = true;
    generation++;
    clearTimeout(poll);
    document.title = "Signed out · ferry";
    const form = h("form", { method: "post", action: "/ui/session", class: "sign-in" },
      h("label", { for: "token" }, "Admin token"),
      h("input", { id: "token", name: "token", type: "password", autocomplete: "off", required: true }),
      h("button", { type: "submit" }, "Sign in"));
    main.replaceChildren(h("h1", {}, "Signed out"), h("p", { role: "alert" }, why), form);
  }

  function confirmAction(text, label) {
    const dialog = document.getElementById("confirm");
    document.getElementById("confirm-text").textContent = text;
    document.getElementById("confirm-ok").textContent = label;
    dialog.returnValue = "";
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
      dialog.showModal();
    });
  }

  // An action button: disabled while it runs; its answer (or error) goes to the notice line.
  function action(label, run, cls) {
    const button = h("button", { type: "button", class: cls || null });
    button.textContent = label;
    button.addEventListener("click", async () => {
      button.disabled = true;
      try {
        const message = await run();
        if (message) notice(message, false);
      } catch (e) {
        if (!signedOut) notice(e.message, true);
      } finally {
        button.disabled = false;
      }
    });
    return button;
  }

  // ---- pages ----

  function page(title, ...children) {
    document.title = `${title} · ferry`;
    main.replaceChildren(h("h1", {}, title), ...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  }

  async function overview(mine) {
    const cards = h("div", { class: "cards" });
    const byRoute = h("section", {}, h("h2", {}, "Events by route"));
    const breakers = h("section", {}, h("h2", {}, "Breakers"));
    const outcomes = h("div", { class: "chart" });
    const latency = h("div", { class: "chart" });
    const charts = h("section", {},
      h("h2", {}, "The last hour on this instance"),
      h("p", { class: "muted" }, "Per minute: events this ferry delivered, scheduled for a retry and failed; and commit-to-delivery latency percentiles. Other instances count their own."),
      h("div", { class: "charts" }, outcomes, latency));
    page("Overview", cards, charts, byRoute, breakers);
    const refresh = async () => {
      if (mine !== generation) return;
      const [stats, routes, activity] = await Promise.all([
        api("GET", "/v1/stats"), api("GET", "/v1/routes"), api("GET", "/v1/activity")]);
      if (mine !== generation) return;
      cards.replaceChildren(
        ...STATUSES.map((s) => card(s, number(stats.counts[s]), `count-${s}`, `s-${s}`)),
        card("Oldest pending", duration(stats.oldest_pending_age_seconds), "oldest-pending"),
        card("Claim lag", duration(stats.claim_lag_seconds), "claim-lag"),
        card("Stuck (lease expired)", number(stats.stuck), "stuck"));
      const names = Object.keys(stats.routes).sort();
      byRoute.replaceChildren(h("h2", {}, "Events by route"), names.length === 0
        ? h("p", { class: "muted" }, "No events yet.")
        : table(["Route", ...STATUSES], names.map((r) => h("tr", { "data-route": r },
          h("th", { scope: "row" }, r),
          STATUSES.map((s) => h("td", { class: "num", "data-status": s }, number(stats.routes[r][s])))))));
      breakers.replaceChildren(h("h2", {}, "Breakers"), table(["Route", "State", "Failures in a row", "Reason"],
        routes.map((r) => h("tr", {},
          h("th", { scope: "row" }, h("a", { href: "#/routes" }, r.route)),
          h("td", {}, badge(r.breaker.state, `b-${r.breaker.state}`)),
          h("td", { class: "num" }, number(r.breaker.consecutive_failures)),
          h("td", {}, r.breaker.reason || "–")))));
      outcomes.replaceChildren(...outcomeChart(activity.minutes));
      latency.replaceChildren(...latencyChart(activity.minutes));
    };
    await refresh();
    // The next refresh is planned when one ends (never two at once), only while this page is the
    // one shown, and skipped while the tab is hidden.
    const again = () => {
      if (mine !== generation) return;
      poll = setTimeout(async () => {
        if (mine !== generation) return;
        if (!document.hidden) {
          try {
            await refresh();
          } catch (e) {
            if (!signedOut) notice(`Could not refresh: ${e.message}`, true);
          }
        }
        again();
      }, POLL_MS);
    };
    again();
  }

  function card(label, value, id, cls) {
    return h("div", { class: "card" }, h("div", { class: "label" }, label),
      h("div", { class: `value ${cls || ""}`, id }, value));
  }

  const W = 600, H = 180, PAD_L = 44, PAD_B = 22, PAD_T = 8;

  function frame(max, unit, minutes) {
    const parts = [svg("line", { class: "axis", x1: PAD_L, y1: H - PAD_B, x2: W, y2: H - PAD_B })];
    for (const f of [0, 0.5, 1]) {
      const y = H - PAD_B - f * (H - PAD_B - PAD_T);
      parts.push(svg("line", { class: "axis", x1: PAD_L, y1: y, x2: W, y2: y, "stroke-dasharray": "2 3" }));
      parts.push(svg("text", { x: PAD_L - 4, y: y + 3, "text-anchor": "end" }, `${roundNice(max * f)}${unit}`));
    }
    if (minutes.length) {
      const first = new Date(minutes[0].at), last = new Date(minutes[minutes.length - 1].at);
      parts.push(svg("text", { x: PAD_L, y: H - 6 }, hhmm(first)));
      parts.push(svg("text", { x: W, y: H - 6, "text-anchor": "end" }, hhmm(last)));
    }
    return parts;
  }

  function roundNice(v) {
    return v >= 100 ? Math.round(v).toLocaleString() : Number(v.toPrecision(2)).toString();
  }

  function hhmm(t) {
    return t.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  function outcomeChart(minutes) {
    const kinds = ["delivered", "retried", "failed"];
    const max = Math.max(1, ...minutes.map((m) => m.delivered + m.retried + m.failed));
    const slot = (W - PAD_L) / Math.max(1, minutes.length);
    const bars = [];
    minutes.forEach((m, i) => {
      let base = H - PAD_B;
      for (const k of kinds) {
        const height = (m[k] / max) * (H - PAD_B - PAD_T);
        if (height > 0) {
          bars.push(svg("rect", { class: `c-${k}`, x: PAD_L + i * slot + 1, y: base - height, width: Math.max(1, slot - 2), height },
            svg("title", {}, `${hhmm(new Date(m.at))}: ${m[k]} ${k}`)));
          base -= height;
        }
      }
    });
    const total = (k) => minutes.reduce((sum, m) => sum + m[k], 0);
    const summary = `Outcomes per minute over the last hour: ${kinds.map((k) => `${number(total(k))} ${k}`).join(", ")}.`;
    return [
      h("h3", {}, "Outcomes per minute"),
      svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": summary, "data-chart": "outcomes" }, frame(max, "", minutes), bars),
      legend(kinds.map((k) => [k, `${k} ${number(total(k))}`])),
    ];
  }

  function latencyChart(minutes) {
    const lines = ["p50", "p95", "p99"];
    const values = minutes.flatMap((m) => lines.map((l) => m[`${l}_ms`]).filter((v) => v !== null));
    const max = Math.max(1, ...values);
    const slot = (W - PAD_L) / Math.max(1, minutes.length);
    const paths = lines.flatMap((l) => {
      const points = [];
      minutes.forEach((m, i) => {
        const v = m[`${l}_ms`];
        if (v !== null) points.push([PAD_L + (i + 0.5) * slot, H - PAD_B - (v / max) * (H - PAD_B - PAD_T)]);
      });
      // A line through the minutes, and a dot on each, so a lone minute shows too.
      return [
        points.length > 1 ? svg("polyline", { class: `c-${l}`, points: points.map((p) => p.map((n) => n.toFixed(1)).join(",")).join(" ") }) : null,
        ...points.map(([x, y]) => svg("circle", { class: `c-${l} dot`, cx: x.toFixed(1), cy: y.toFixed(1), r: 2.5 })),
      ];
    });
    const last = [...minutes].reverse().find((m) => m.p50_ms !== null);
    const now = last ? lines.map((l) => `${l} ${roundNice(last[`${l}_ms`])} ms`).join(", ") : "no deliveries";
    return [
      h("h3", {}, "Latency (commit to delivery)"),
      svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `Latency percentiles per minute; latest minute with deliveries: ${now}.`, "data-chart": "latency" },
        frame(max, " ms", minutes), paths),
      legend(lines.map((l) => [l, `${l}${last ? ` ${roundNice(last[`${l}_ms`])} ms` : ""}`])),
    ];
  }

  function legend(items) {
    return h("ul", { class: "legend" }, items.map(([cls, text]) => h("li", {}, h("span", { class: `swatch c-${cls}`, "aria-hidden": "true" }), text)));
  }

  // The failed page: groups by route, type and reason; a filter; each group's events; resend and
  // purge with a confirmation that says how many.
  async function failed(params, mine) {
    const filter = { route: params.get("route") || "", type: params.get("type") || "", reason: params.get("reason") || "" };
    const describe = (f) => [f.route && `route ${f.route}`, f.type && `type ${f.type}`, f.reason && `reason ${f.reason}`].filter(Boolean).join(", ");
    const routes = await api("GET", "/v1/routes");
    const [summary, listing] = await Promise.all([
      api("GET", `/v1/failed/summary${query(filter)}`),
      params.has("list") ? api("GET", `/v1/failed${query({ ...filter, after: params.get("after"), limit: 50 })}`) : null,
    ]);
    if (mine !== generation) return;
    // The filter in effect is always an option, even for a route no longer configured.
    const select = (name, label, options) => h("label", {}, label,
      h("select", { name }, h("option", { value: "" }, "any"),
        [...new Set([...options, filter[name]].filter(Boolean))].map((o) => h("option", { value: o, selected: o === filter[name] }, o))));
    const form = h("form", { class: "filters", "aria-label": "Filter failed events" },
      select("route", "Route", routes.map((r) => r.route)),
      h("label", {}, "Type", h("input", { name: "type", value: filter.type, placeholder: "any" })),
      select("reason", "Reason", [...REASONS, "none"]),
      h("button", { type: "submit" }, "Filter"));
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const data = new FormData(form);
      window.location.hash = `#/failed${query({ route: data.get("route"), type: data.get("type").trim(), reason: data.get("reason") })}`;
    });
    // The count fixes what the operation may touch: the events counted, up to the highest id
    // counted, so events failing after the confirmation was asked are left alone.
    const bulk = (f, verb) => action(`${verb === "resend" ? "Resend" : "Purge"}…`, async () => {
      const { failed: n, last_id: lastId } = await api("GET", `/v1/failed/count${query(f)}`);
      if (n === 0) return "No FAILED events match any more.";
      const what = `${number(n)} FAILED ${n === 1 ? "event" : "events"}${describe(f) ? ` (${describe(f)})` : ""}`;
      const question = verb === "resend"
        ? `Resend ${what}? They become PENDING with their attempts reset.`
        : `Purge ${what}? They are deleted with their history; this cannot be undone.`;
      if (!(await confirmAction(question, verb === "resend" ? `Resend ${number(n)}` : `Purge ${number(n)}`))) return null;
      const body = Object.fromEntries(Object.entries(f).filter(([, v]) => v));
      if (Object.keys(body).length === 0) body.all = true;
      body.through_id = lastId;
      const answer = await api("POST", `/v1/failed/${verb}`, body);
      render();
      return verb === "resend" ? `${events(answer.resent)} resent.` : `${events(answer.purged)} purged.`;
    }, verb === "purge" ? "danger" : null);
    const groups = summary.groups.length === 0
      ? h("p", { class: "muted" }, "No FAILED events match.")
      : table(["Route", "Type", "Reason", "Events", "First failed", "Last failed", "Actions"], summary.groups.map((g) => {
        // A group without a recorded reason is selected as reason "none", not as every reason.
        const f = { route: g.route, type: g.type, reason: g.reason ?? "none" };
        return h("tr", { "data-group": `${g.route}/${g.type}/${g.reason}` },
          h("td", {}, g.route), h("td", {}, g.type), h("td", {}, g.reason || "–"),
          h("td", { class: "num" }, number(g.count)),
          h("td", {}, when(g.first_failed_at)), h("td", {}, when(g.last_failed_at)),
          h("td", {}, h("div", { class: "actions" },
            h("a", { href: `#/failed${query({ ...f, list: 1 })}` }, "Show events"), bulk(f, "resend"), bulk(f, "purge"))));
      }));
    const children = [
      h("section", {}, form),
      h("section", {},
        h("h2", {}, `${summary.truncated ? "At least " : ""}${number(summary.total)} FAILED ${summary.total === 1 ? "event" : "events"}${describe(filter) ? ` (${describe(filter)})` : ""}`),
        summary.truncated ? h("p", { class: "muted" }, "Only the largest groups are listed; narrow the filter to see the rest.") : null,
        groups,
        summary.total > 0 ? h("div", { class: "actions" }, h("span", { class: "muted" }, "Everything matching the filter:"), bulk(filter, "resend"), bulk(filter, "purge")) : null),
    ];
    if (listing) {
      const next = listing.next_after ? h("a", { href: `#/failed${query({ ...filter, list: 1, after: listing.next_after })}` }, "Next page") : null;
      children.push(h("section", {}, h("h2", {}, "Events"),
        table(["Id", "Route", "Type", "Created", "Attempts", "Reason", "Last error"], listing.events.map((e) => h("tr", {},
          h("td", {}, h("a", { href: `#/event/${e.id}` }, String(e.id))), h("td", {}, e.route), h("td", {}, e.event_type),
          h("td", {}, when(e.created_at)), h("td", { class: "num" }, number(e.attempts)), h("td", {}, e.failure_reason || "–"),
          h("td", {}, firstLine(e.last_error))))),
        next));
    }
    page("Failed events", ...children);
  }

  function firstLine(text) {
    if (!text) return "–";
    const line = text.split("\n")[0];
    return line.length > 200 ? `${line.slice(0, 200)}…` : line;
  }

  async function event(id, mine) {
    // The payload as stored: JSON parsed here would lose the digits of large numbers.
    const e = await api("GET", `/v1/events/${encodeURIComponent(id)}?payload=text`);
    if (mine !== generation) return;
    const field = (name, value) => [h("dt", {}, name), h("dd", {}, value ?? "–")];
    const actions = [];
    if (e.status === "FAILED") {
      actions.push(action("Resend", async () => {
        await api("POST", `/v1/events/${e.id}/resend`);
        render();
        return `Event ${e.id} resent.`;
      }));
    }
    page(`Event ${e.id}`,
      h("section", {},
        h("p", {}, badge(e.status, `s-${e.status}`), " ", h("span", { id: "event-status", class: "muted" }, statusNote(e))),
        actions.length ? h("div", { class: "actions" }, actions) : null,
        h("dl", { class: "fields" },
          field("Route", e.route), field("Type", e.event_type), field("Ordering key", e.ordering_key),
          field("Content type", e.content_type),
          field("Attempts", `${e.attempts}${e.max_attempts ? ` of ${e.max_attempts}` : ""}`),
          field("Event time", when(e.event_time)), field("Created", when(e.created_at)),
          field("Status since", when(e.last_status_at)), field("Next attempt", when(e.next_attempt_at)),
          field("Processed", when(e.processed_at)), field("Failure reason", e.failure_reason),
          field("Last error", e.last_error ? h("pre", { class: "payload" }, e.last_error) : null),
          field("Claimed by", e.claimed_by), field("Lease until", when(e.lease_until)),
          e.defect ? field("Defect", e.defect) : null)),
      h("section", {}, h("h2", {}, "Headers"), headers(e.headers)),
      h("section", {}, h("h2", {}, "Payload"), payload(e)),
      h("section", {}, h("h2", {}, "Attempts"), attempts(e.attempts_history || [])));
  }

  function statusNote(e) {
    if (e.status === "PENDING") return `due ${ago(new Date(e.next_attempt_at))}`;
    if (e.status === "PROCESSING") return `claimed by ${e.claimed_by || "?"}`;
    if (e.status === "FAILED") return e.failure_reason || "";
    return "";
  }

  // An object as stored, or (for a row written by hand that holds no JSON object) its text.
  function headers(value) {
    if (typeof value === "string") return h("pre", { class: "payload" }, value);
    const parsed = value;
    const entries = Array.isArray(parsed) ? parsed : Object.entries(parsed || {});
    if (entries.length === 0) return h("p", { class: "muted" }, "None.");
    return table(["Name", "Value"], entries.map((pair) => h("tr", {},
      h("td", { class: "mono" }, String(pair[0])), h("td", { class: "mono" }, typeof pair[1] === "string" ? pair[1] : JSON.stringify(pair[1])))));
  }

  function payload(e) {
    if (e.payload !== undefined && e.payload !== null) {
      let text = e.payload, kind = "text";
      try {
        JSON.parse(e.payload);
        text = indentJson(e.payload);
        kind = "JSON";
      } catch { /* not JSON: shown as it is */ }
      const size = new TextEncoder().encode(e.payload).length;
      const cut = text.length > TEXT_SHOWN;
      return [
        h("p", { class: "muted" }, `${number(size)} bytes, ${kind}${cut ? `; the first ${number(TEXT_SHOWN)} characters are shown` : ""}.`),
        h("pre", { class: "payload", "data-payload": kind }, cut ? `${text.slice(0, TEXT_SHOWN)}\n…` : text),
      ];
    }
    if (e.payload_base64 !== undefined) {
      const raw = atob(e.payload_base64);
      const shown = Math.min(raw.length, BYTES_SHOWN);
      const lines = [];
      for (let offset = 0; offset < shown; offset += 16) {
        const bytes = [];
        let ascii = "";
        for (let i = offset; i < Math.min(offset + 16, shown); i++) {
          const b = raw.charCodeAt(i);
          bytes.push(b.toString(16).padStart(2, "0"));
          ascii += b >= 0x20 && b < 0x7f ? raw[i] : ".";
        }
        lines.push(`${offset.toString(16).padStart(8, "0")}  ${bytes.join(" ").padEnd(47)}  ${ascii}`);
      }
      return [
        h("p", { class: "muted" }, `${number(raw.length)} bytes, binary${shown < raw.length ? `; the first ${number(shown)} are shown` : ""}.`),
        h("pre", { class: "payload", "data-payload": "hex" }, lines.join("\n")),
      ];
    }
    return h("p", { class: "muted" }, "No payload.");
  }

  // Re-indents JSON text without parsing its values, so numbers beyond a double's precision and
  // the order and spelling of keys are shown exactly as stored.
  function indentJson(text) {
    let out = "", depth = 0, inString = false, escaped = false;
    const newline = () => `\n${"  ".repeat(depth)}`;
    for (let i = 0; i < text.length; i++) {
      const c = text[i];
      if (inString) {
        out += c;
        if (escaped) escaped = false;
        else if (c === "\\") escaped = true;
        else if (c === '"') inString = false;
        continue;
      }
      if (c === " " || c === "\t" || c === "\n" || c === "\r") continue;
      if (c === '"') { inString = true; out += c; continue; }
      if (c === "{" || c === "[") {
        const close = c === "{" ? "}" : "]";
        let j = i + 1;
        while (j < text.length && " \t\n\r".includes(text[j])) j++;
        if (text[j] === close) { out += c + close; i = j; continue; }
        depth++;
        out += c + newline();
      } else if (c === "}" || c === "]") {
        depth--;
        out += newline() + c;
      } else if (c === ",") out += `,${newline()}`;
      else if (c === ":") out += ": ";
      else out += c;
    }
    return out;
  }

  function attempts(history) {
    if (history.length === 0) return h("p", { class: "muted" }, "No attempts recorded.");
    return table(["#", "Started", "ms", "Outcome", "Reason", "Error", "Plugin", "Instance"], history.map((a) => h("tr", {},
      h("td", { class: "num" }, String(a.attempt)), h("td", {}, when(a.started_at)), h("td", { class: "num" }, number(a.duration_ms)),
      h("td", {}, a.outcome), h("td", {}, a.reason || "–"), h("td", {}, a.error ? h("pre", { class: "payload" }, a.error) : "–"),
      h("td", {}, a.plugin ? `${a.plugin}${a.plugin_hash ? ` (${a.plugin_hash.slice(0, 12)})` : ""}` : "–"),
      h("td", {}, a.instance || "–"))));
  }

  async function routesPage(mine) {
    const routes = await api("GET", "/v1/routes");
    if (mine !== generation) return;
    const switchBreaker = (r) => r.breaker.state === "closed"
      ? action(`Open breaker`, async () => {
        const ok = await confirmAction(`Open the breaker of route ${r.route}? Its events stay PENDING until it is closed again.`, "Open breaker");
        if (!ok) return null;
        await api("POST", `/v1/breakers/${encodeURIComponent(r.route)}/open`, { reason: "opened from the dashboard" });
        render();
        return `Breaker of ${r.route} opened.`;
      }, "danger")
      : action(`Close breaker`, async () => {
        await api("POST", `/v1/breakers/${encodeURIComponent(r.route)}/close`);
        render();
        return `Breaker of ${r.route} closed.`;
      });
    page("Routes", routes.length === 0 ? h("p", {}, "No routes are configured.") : routes.map((r) => h("section", { "data-route": r.route },
      h("h2", {}, r.route),
      h("dl", { class: "fields" },
        h("dt", {}, "Plugin"), h("dd", {}, r.plugin, " ", r.plugin_loaded ? badge("loaded", "b-closed") : badge("not loaded", "b-open")),
        h("dt", {}, "Ordering"), h("dd", {}, r.ordered ? `by key${r.failed_blocks_key ? "; a FAILED event holds back its key" : ""}` : "none"),
        h("dt", {}, "Breaker"), h("dd", {}, badge(r.breaker.state, `b-${r.breaker.state}`), " ",
          r.breaker.manual ? "opened by hand " : "", r.breaker.opened_at ? ["since ", when(r.breaker.opened_at)] : "",
          r.breaker.reason ? ` — ${r.breaker.reason}` : ""),
        h("dt", {}, "Retry"), h("dd", {}, `${r.retry.backoff}; jitter ${r.retry.jitter}; `,
          r.retry.max_attempts === 0 ? "no attempt limit" : `${r.retry.max_attempts} attempts at most`,
          `; a plugin may ask to wait up to ${duration(r.retry.retry_after_max_seconds)}`)),
      h("div", { class: "actions" }, switchBreaker(r)))));
  }

  async function pluginsPage(mine, reloaded) {
    const view = await api("GET", "/v1/plugins");
    if (mine !== generation) return;
    const reload = action("Reload plugins", async () => {
      const answer = await api("POST", "/v1/plugins/reload");
      // Drawn again only if this page is still the one shown.
      if (mine === generation) await pluginsPage(mine, answer);
      const loaded = answer.files.filter((f) => f.result === "loaded").length;
      const failedFiles = answer.files.filter((f) => f.result === "failed").length;
      return `Reloaded: ${loaded} loaded, ${failedFiles} failed, ${answer.files.length - loaded - failedFiles} unchanged or removed.`;
    });
    const errors = Object.entries(view.errors || {});
    page("Plugins",
      h("section", {},
        h("div", { class: "actions" }, reload),
        table(["Name", "Version", "Hash", "Routes", "Loaded", "File", "Last error"], view.plugins.map((p) => h("tr", { "data-plugin": p.name },
          h("td", {}, p.name), h("td", {}, p.version), h("td", { class: "mono", title: p.hash }, p.hash.slice(0, 12)),
          h("td", {}, p.routes.length ? p.routes.join(", ") : "–"), h("td", {}, when(p.loaded_at)),
          h("td", { class: "mono" }, p.file), h("td", {}, p.last_error || "–"))))),
      errors.length ? h("section", {}, h("h2", {}, "Files that did not load"),
        table(["File", "Error"], errors.map(([file, error]) => h("tr", {}, h("td", { class: "mono" }, file), h("td", {}, h("pre", { class: "payload" }, error)))))) : null,
      reloaded ? h("section", { id: "reload-result" }, h("h2", {}, "Last reload"),
        table(["File", "Result", "Plugin", "Hash or error"], reloaded.files.map((f) => h("tr", {},
          h("td", { class: "mono" }, f.file), h("td", {}, f.result), h("td", {}, f.plugin || "–"),
          h("td", { class: "mono" }, f.error || (f.hash ? f.hash.slice(0, 12) : "–")))))) : null);
  }

  // ---- navigation ----

  async function render() {
    if (signedOut) return;
    clearTimeout(poll);
    poll = null;
    const mine = ++generation;
    const [path, search] = (window.location.hash.slice(1) || "/overview").split("?");
    const params = new URLSearchParams(search || "");
    const section = path.split("/")[1] || "overview";
    for (const link of document.querySelectorAll(".top nav a")) {
      if (link.getAttribute("href") === `#/${section}`) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    try {
      if (section === "overview") await overview(mine);
      else if (section === "failed") await failed(params, mine);
      else if (section === "event") await event(path.split("/")[2] || "", mine);
      else if (section === "routes") await routesPage(mine);
      else if (section === "plugins") await pluginsPage(mine);
      else page("Not found", h("p", {}, "There is no such page. "), h("a", { href: "#/overview" }, "Back to the overview"));
    } catch (e) {
      if (mine === generation) page("Could not load this page", h("p", { class: "notice error" }, e.message));
    }
  }

  window.addEventListener("hashchange", () => {
    notice("", false);
    render().then(() => main.focus({ preventScroll: false }));
  });
  document.getElementById("find").addEventListener("submit", (e) => {
    e.preventDefault();
    const id = document.getElementById("find-id").value.trim();
    if (/^[0-9]+$/.test(id)) window.location.hash = `#/event/${id}`;
  });
  document.getElementById("sign-out").addEventListener("click", async () => {
    await api("POST", "/ui/session/end").catch(() => null);
    localStorage.removeItem(KEY);
    window.location.replace("/ui");
  });
  if (localStorage.getItem(KEY)) render();
  else signOutView("This browser holds no session key for this dashboard (it was cleared, or the session began in another browser profile).");
})();
