// A ferry transport in JavaScript, made by `ferry plugins new NAME --lang javascript`.
//
// It writes each event's id, type and text payload to ferry's log, after an optional `prefix`
// from the route's config, and refuses payloads that are not UTF-8 text as permanent failures.
// Replace deliverOne with your delivery; `fetch` works too, to the origins granted in the
// plugin's sandbox (`http = [...]`).
//
// Outcomes: { tag: "success" }, { tag: "transient" | "permanent", val: { reason, retryAfterMs } }
// with retryAfterMs a BigInt of milliseconds or undefined, or { tag: "deferred", val: { reason,
// delayMs } } when the receiver asked to wait (delayMs a BigInt; no attempt is counted).

import { log } from "ferry:transport/logging@0.2.0";

// What routes put in `plugin = "…"`; the file is installed in the plugins directory under this
// name. Keep VERSION in step with package.json.
const NAME = "template-js";
const VERSION = "0.1.0";

let prefix = null;

// Called once per instance with the route's `config` table as [key, value] pairs. Throw a string
// that names the bad key to refuse the route.
function init(config) {
  let next = "";
  for (const [key, value] of config) {
    if (key === "prefix") next = value;
    else throw `unknown config key ${JSON.stringify(key)} (known: prefix)`;
  }
  prefix = next;
}

const utf8 = new TextDecoder("utf-8", { fatal: true });

function permanent(reason) {
  return { tag: "permanent", val: { reason, retryAfterMs: undefined } };
}

async function deliverOne(event) {
  let text;
  try {
    text = utf8.decode(event.payload);
  } catch {
    return permanent("payload is not UTF-8 text");
  }
  log("info", `${prefix}${event.id} ${event.eventType}: ${text}`);
  return { tag: "success" };
}

export const transport = {
  metadata() {
    return { name: NAME, version: VERSION };
  },
  init,
  // One outcome per event, in the order given.
  async deliverBatch(events) {
    if (prefix === null) return events.map(() => permanent(`${NAME}: init was not called`));
    return Promise.all(events.map(deliverOne));
  },
};
