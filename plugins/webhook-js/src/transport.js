// A ferry transport in JavaScript: POSTs each event to a webhook with fetch (which
// componentize-js runs over wasi:http, so the URL's origin must be on the plugin's http allowlist).
//
// Route configuration:
//   url          (required) where to POST
//   header.NAME  a static header added to every request
//
// Answers: 2xx -> success; 408, 429 and 5xx -> transient (Retry-After honoured); any other
// status -> permanent; a request that gets no answer -> transient.

import { log } from "ferry:transport/logging@0.2.0";

let settings = null;

function init(config) {
  const next = { url: null, headers: {} };
  for (const [key, value] of config) {
    if (key === "url") {
      if (!/^https?:\/\//.test(value)) throw `url: expected an http:// or https:// URL, got ${JSON.stringify(value)}`;
      next.url = value;
    } else if (key.startsWith("header.") && key.length > "header.".length) {
      next.headers[key.slice("header.".length)] = value;
    } else {
      throw `unknown config key ${JSON.stringify(key)} (known: url, header.NAME)`;
    }
  }
  if (next.url === null) throw "url: required";
  settings = next;
  log("info", `posting events to ${next.url}`);
}

function transient(reason, retryAfterMs) {
  return { tag: "transient", val: { reason, retryAfterMs } };
}

function permanent(reason) {
  return { tag: "permanent", val: { reason, retryAfterMs: undefined } };
}

// Seconds in a Retry-After header as milliseconds, or undefined.
function retryAfter(response) {
  const seconds = Number.parseInt(response.headers.get("retry-after") ?? "", 10);
  return Number.isFinite(seconds) && seconds >= 0 ? BigInt(seconds) * 1000n : undefined;
}

async function deliverOne(event) {
  const headers = { ...Object.fromEntries(event.headers), ...settings.headers };
  headers["content-type"] = event.contentType;
  headers["webhook-id"] = event.id.toString();
  let response;
  try {
    response = await fetch(settings.url, { method: "POST", headers, body: event.payload });
  } catch (error) {
    return transient(`request failed: ${error}`);
  }
  const status = response.status;
  if (status >= 200 && status < 300) return { tag: "success" };
  const body = (await response.text()).slice(0, 200);
  if (status === 408 || status === 429 || status >= 500) return transient(`HTTP ${status}: ${body}`, retryAfter(response));
  return permanent(`HTTP ${status}: ${body}`);
}

export const transport = {
  metadata() {
    return { name: "webhook-js", version: "0.1.0" };
  },
  init,
  // All requests of the batch are in flight at once; one outcome per event, in order.
  async deliverBatch(events) {
    if (settings === null) return events.map(() => permanent("webhook-js: init was not called"));
    return Promise.all(events.map(deliverOne));
  },
};
