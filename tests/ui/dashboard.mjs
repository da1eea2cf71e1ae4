// Drives ferry's dashboard in headless Chromium as an operator would, and attacks it as a
// cross-site page would. Run by `dashboard.rs` against a real `ferry serve`; it prints each step
// and exits non-zero at the first expectation that does not hold.
//
// Environment: FERRY_URL (the admin API's base URL), FERRY_TOKEN, FERRY_FAILED_ID (an event that
// failed permanently, with a hostile JSON payload), FERRY_BINARY_ID (an event with a binary
// payload), FERRY_HUGE_ID (an event with a payload of 300 000 characters), FERRY_OLD_HASH (the plugin's hash before a new version was put in its directory, with
// the watcher off), FERRY_SHOTS (where screenshots go), CHROMIUM (the browser; /usr/bin/chromium).

import http from "node:http";
import { chromium } from "playwright-core";

const base = need("FERRY_URL");
const token = need("FERRY_TOKEN");
const failedId = need("FERRY_FAILED_ID");
const binaryId = need("FERRY_BINARY_ID");
const shots = need("FERRY_SHOTS");
const oldHash = need("FERRY_OLD_HASH");
const hugeId = need("FERRY_HUGE_ID");

function need(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
}

function step(text) {
  console.log(`step: ${text}`);
}

function expect(condition, what) {
  if (!condition) throw new Error(`expected: ${what}`);
}

async function api(method, path, body) {
  const response = await fetch(`${base}${path}`, {
    method,
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

async function until(what, check, timeoutMs = 15000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

// Runs in the page: the elements with text of their own whose contrast with the background behind
// them is below WCAG 2 AA (4.5:1, or 3:1 for large text).
function lowContrast() {
  const rgb = (text) => (text.match(/[\d.]+/g) || []).map(Number);
  const luminance = ([r, g, b]) => {
    const channel = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b);
  };
  const background = (el) => {
    for (let at = el; at; at = at.parentElement) {
      const [r, g, b, a = 1] = rgb(getComputedStyle(at).backgroundColor);
      if (a > 0) return [r, g, b];
    }
    return [255, 255, 255];
  };
  const low = [];
  for (const el of document.querySelectorAll("body *")) {
    const ownText = [...el.childNodes].some((n) => n.nodeType === Node.TEXT_NODE && n.textContent.trim());
    const style = getComputedStyle(el);
    if (!ownText || style.visibility === "hidden" || style.display === "none" || el.closest("svg")) continue;
    const rect = el.getBoundingClientRect();
    if (rect.width === 0 || rect.height === 0) continue;
    const [fg, bg] = [luminance(rgb(style.color)), luminance(background(el))];
    const ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
    const size = parseFloat(style.fontSize);
    const large = size >= 24 || (size >= 18.66 && Number(style.fontWeight) >= 700);
    if (ratio < (large ? 3 : 4.5)) low.push({ text: el.textContent.trim().slice(0, 40), ratio: ratio.toFixed(2) });
  }
  return low;
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox"],
});
let exitCode = 0;
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  page.setDefaultTimeout(15000);
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(e.message));
  page.on("dialog", (d) => {
    // A JavaScript alert/confirm would be the sign of injected script; none is expected.
    pageErrors.push(`unexpected ${d.type()} dialog: ${d.message()}`);
    d.dismiss();
  });

  step("the dashboard asks to sign in, and a wrong token is refused");
  await page.goto(`${base}/ui`);
  await page.getByLabel("Admin token").fill("not-the-token-at-all");
  await page.getByRole("button", { name: "Sign in" }).click();
  await page.getByText("Wrong token").waitFor();
  expect((await context.cookies()).length === 0, "no cookie after a wrong token");
  await page.screenshot({ path: `${shots}/sign-in-refused.png` });

  step("the right token signs in with an HttpOnly, SameSite=Strict cookie, and no token in the URL");
  await page.getByLabel("Admin token").fill(token);
  await page.getByRole("button", { name: "Sign in" }).click();
  await page.getByRole("heading", { name: "Overview" }).waitFor();
  const cookies = await context.cookies();
  expect(cookies.length === 1 && cookies[0].name === "ferry_session", `one session cookie, got ${JSON.stringify(cookies)}`);
  expect(cookies[0].httpOnly && cookies[0].sameSite === "Strict", "the cookie is HttpOnly and SameSite=Strict");
  expect(!page.url().includes(token), `the token is not in the URL ${page.url()}`);
  expect((await page.evaluate(() => document.cookie)) === "", "the page's script cannot read the session cookie");

  step("the overview's counts change while events are emitted");
  const sent = async () => Number((await page.locator("#count-SENT").textContent()).replace(/[^0-9]/g, ""));
  const before = await sent();
  for (let i = 0; i < 5; i++) await api("POST", "/v1/events", { route: "orders", type: "order.created", payload: { n: i } });
  await until("SENT to grow by 5 on the page", async () => (await sent()) >= before + 5);
  await page.locator('[data-chart="outcomes"] rect').first().waitFor();
  await page.screenshot({ path: `${shots}/overview.png`, fullPage: true });

  step("the failed page groups by route, type and reason, and resends after saying how many");
  await page.getByRole("link", { name: "Failed", exact: true }).click();
  const group = page.locator('tr[data-group="orders/permanent/permanent"]');
  await group.waitFor();
  expect((await group.locator("td.num").textContent()).trim() === "1", "one event in the group");
  await page.screenshot({ path: `${shots}/failed.png`, fullPage: true });
  await group.getByRole("button", { name: "Resend…" }).click();
  const dialog = page.getByRole("dialog");
  await dialog.waitFor();
  const question = await dialog.textContent();
  expect(question.includes("Resend 1 FAILED event (route orders, type permanent, reason permanent)"), `the dialog says how many: ${question}`);
  await dialog.getByRole("button", { name: "Resend 1" }).click();
  await page.getByText("1 event resent.").waitFor();
  await until("the resent event to be attempted again", async () => {
    const event = await api("GET", `/v1/events/${failedId}`);
    return event.status === "FAILED" && event.attempts_history.length === 2;
  });

  step("an event's detail shows its payload exactly, as text, and its history");
  await page.goto(`${base}/ui#/event/${failedId}`);
  await page.getByRole("heading", { name: `Event ${failedId}` }).waitFor();
  const payload = await page.locator('pre[data-payload="JSON"]').textContent();
  expect(payload.includes('"amount": 12345678901234567890123'), `big numbers are shown as stored: ${payload}`);
  expect(payload.includes('"note": "<img src=x onerror=\\"window.__pwned=1\\">'), `markup is shown as text: ${payload}`);
  expect((await page.locator("img[src=x]").count()) === 0, "no element was made from the payload");
  expect((await page.evaluate(() => window.__pwned)) === undefined, "no script from the payload ran");
  expect((await page.locator("tbody tr", { hasText: "permanent" }).count()) >= 2, "both attempts are listed");
  await page.getByRole("cell", { name: "x-tenant" }).waitFor();
  await page.screenshot({ path: `${shots}/event.png`, fullPage: true });
  await page.goto(`${base}/ui#/event/${binaryId}`);
  const hex = await page.locator('pre[data-payload="hex"]').textContent();
  expect(hex.startsWith("00000000  00 01 02 ff fe"), `binary payloads are shown in hex: ${hex}`);
  await page.goto(`${base}/ui#/event/${hugeId}`);
  await page.getByText("the first 65,536 characters are shown").waitFor();
  const shown = await page.locator('pre[data-payload="JSON"]').textContent();
  expect(shown.length < 70000 && shown.endsWith("…"), `a huge payload is cut (${shown.length} characters shown)`);

  step("a breaker is opened and closed from the routes page");
  await page.getByRole("link", { name: "Routes" }).click();
  const route = page.locator('section[data-route="orders"]');
  await route.getByRole("button", { name: "Open breaker" }).click();
  await page.getByRole("dialog").getByRole("button", { name: "Open breaker" }).click();
  await route.getByText("open", { exact: true }).waitFor();
  expect((await api("GET", "/v1/breakers")).some((b) => b.route === "orders" && b.state === "open"), "the API reports it open");
  expect((await route.textContent()).includes("exponential"), "the retry policy is shown");
  await route.getByRole("button", { name: "Close breaker" }).click();
  await route.getByText("closed", { exact: true }).waitFor();
  expect((await api("GET", "/v1/breakers")).every((b) => b.state === "closed"), "the API reports it closed");

  step("plugins are listed, and a reload loads the new version waiting in the directory");
  await page.getByRole("link", { name: "Plugins" }).click();
  const hashCell = page.locator('tr[data-plugin="scripted"] td[title]');
  expect((await hashCell.getAttribute("title")) === oldHash, "the running version's hash is shown");
  await page.getByRole("button", { name: "Reload plugins" }).click();
  await page.locator("#reload-result").getByRole("cell", { name: "loaded", exact: true }).waitFor();
  await page.getByText("Reloaded: 1 loaded, 1 failed").waitFor();
  await page.locator("#reload-result").getByRole("cell", { name: "failed", exact: true }).waitFor();
  await page.getByRole("heading", { name: "Files that did not load" }).waitFor();
  expect((await page.locator("main").textContent()).includes("broken.wasm"), "the broken file is named");
  const newHash = await hashCell.getAttribute("title");
  expect(newHash !== oldHash && /^[0-9a-f]{64}$/.test(newHash), `the table shows the new hash ${newHash}`);
  await page.screenshot({ path: `${shots}/plugins.png`, fullPage: true });

  step("a request with the cookie but without the session key is refused");
  const forged = await page.evaluate(async () => {
    const r = await fetch("/v1/breakers/orders/open", { method: "POST", headers: { "Content-Type": "application/json" }, body: "{}" });
    return r.status;
  });
  expect(forged === 401, `401 without the session key, got ${forged}`);

  step("another port of the host receives the cookie, and can do nothing with it; its page cannot act either");
  let stolen = null;
  const attacker = http.createServer((req, res) => {
    stolen ??= (req.headers.cookie || "").split(";").map((c) => c.trim()).find((c) => c.startsWith("ferry_session="));
    res.setHeader("Content-Type", "text/html");
    res.end(`<form id="f" method="post" enctype="text/plain" action="${base}/v1/breakers/orders/open">
      <input name='{"reason":"' value='csrf"}'></form><script>document.getElementById("f").submit()</script>`);
  });
  await new Promise((r) => attacker.listen(0, "127.0.0.1", r));
  const evil = await context.newPage();
  const answer = evil.waitForResponse((r) => r.url().includes("/v1/breakers/orders/open"));
  await evil.goto(`http://127.0.0.1:${attacker.address().port}/`);
  const status = (await answer).status();
  attacker.close();
  expect(status === 401, `the forged post is refused, got ${status}`);
  expect((await api("GET", "/v1/breakers")).every((b) => b.state === "closed"), "the breaker is still closed");
  await evil.close();
  // Browsers send cookies to every port of a host: the other server got it. Alone it opens nothing.
  expect(stolen, "the other port received the session cookie (so this attack is real)");
  const key = await page.evaluate(() => localStorage.getItem("ferry-session-key"));
  expect(/^[0-9a-f]{64}$/.test(key), "the page holds its session key");
  for (const [method, path] of [["GET", "/v1/stats"], ["GET", "/v1/events/1"], ["POST", "/v1/failed/purge"]]) {
    const r = await fetch(`${base}${path}`, { method, headers: { Cookie: stolen, "Content-Type": "application/json" }, body: method === "POST" ? '{"all":true}' : undefined });
    expect(r.status === 401, `${method} ${path} with the cookie alone is refused, got ${r.status}`);
  }
  const shell = await (await fetch(`${base}/ui`, { headers: { Cookie: stolen } })).text();
  expect(!shell.includes(key) && !shell.includes(token), "the page served for the cookie holds neither the key nor the token");

  step("text is readable: every text keeps a WCAG AA contrast with its background");
  const views = [["#/overview", "Overview"], ["#/failed", "Failed events"], [`#/event/${failedId}`, `Event ${failedId}`], ["#/routes", "Routes"], ["#/plugins", "Plugins"]];
  for (const [view, title] of views) {
    await page.goto(`${base}/ui${view}`);
    await page.getByRole("heading", { name: title, exact: true, level: 1 }).waitFor();
    await page.waitForLoadState("networkidle");
    const low = await page.evaluate(lowContrast);
    expect(low.length === 0, `contrast below AA on ${view}: ${JSON.stringify(low.slice(0, 5))}`);
  }

  step("the layout fits a narrow screen and is usable by keyboard");
  await page.setViewportSize({ width: 375, height: 800 });
  await page.goto(`${base}/ui#/overview`);
  await page.reload();
  await page.locator("#count-SENT").waitFor();
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  expect(overflow <= 1, `no sideways scrolling at 375 px (overflow ${overflow})`);
  await page.screenshot({ path: `${shots}/overview-narrow.png`, fullPage: true });
  await page.keyboard.press("Tab");
  expect((await page.evaluate(() => document.activeElement.textContent)) === "Skip to content", "Tab reaches the skip link first");
  for (let i = 0; i < 3; i++) await page.keyboard.press("Tab");
  expect((await page.evaluate(() => document.activeElement.textContent)) === "Failed", "then the sections, in order");
  await page.keyboard.press("Enter");
  await page.getByRole("heading", { name: "Failed events", exact: true }).waitFor();

  step("signing out ends the session, also for a copy of its cookie");
  const [session] = await context.cookies();
  const oldKey = await page.evaluate(() => localStorage.getItem("ferry-session-key"));
  const replayed = () => fetch(`${base}/v1/stats`, { headers: { Cookie: `ferry_session=${session.value}`, "X-Ferry-Session": oldKey } });
  expect((await replayed()).status === 200, "the cookie and key work together before signing out");
  await page.getByRole("button", { name: "Sign out" }).click();
  await page.getByLabel("Admin token").waitFor();
  expect((await page.evaluate(() => localStorage.getItem("ferry-session-key"))) === null, "signing out forgets the key");
  const replay = await replayed();
  expect(replay.status === 401, `the old cookie and key are refused, got ${replay.status}`);

  expect(pageErrors.length === 0, `no script errors or dialogs: ${pageErrors.join("; ")}`);
  console.log("dashboard: every step passed");
} catch (e) {
  console.error(`dashboard: ${e.stack || e.message}`);
  exitCode = 1;
} finally {
  await browser.close();
}
process.exit(exitCode);
