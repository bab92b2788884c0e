// Browser test of the demo page: Debian chromium (driven by playwright-core) loads web/, is
// given a real PNG and a real JPEG from tests/fixtures/images/, and what the page shows
// (identities, token counts, block layout, shared prefix) must equal what the native
// `mmrouter inspect` prints for the same bytes. Saves a screenshot of the page.
//
// Needs web/pkg (scripts/build-web) and /usr/bin/chromium; run through scripts/test-web.
// Environment: CARGO (default `cargo`), CARGO_TARGET_DIR (honoured by cargo),
// MMROUTER_CHROMIUM (default /usr/bin/chromium), MMROUTER_SCREENSHOT (default
// $CARGO_TARGET_DIR/web-demo.png, else target/web-demo.png, so that a test run never rewrites
// a tracked file; MMROUTER_SCREENSHOT=docs/web-demo.png refreshes the documentation's copy;
// empty to skip).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync, rmSync, existsSync, mkdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, extname, resolve, dirname, sep } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const HERE = dirname(fileURLToPath(import.meta.url));
const ROOT = resolve(HERE, '..', '..');
const WEB = join(ROOT, 'web');
const FIXTURES = join(ROOT, 'tests', 'fixtures', 'images');
const PNG = join(FIXTURES, 'png_rgb8_37x23.png');
const JPEG = join(FIXTURES, 'jpeg_baseline_37x23.jpg');
const CHROMIUM = process.env.MMROUTER_CHROMIUM || '/usr/bin/chromium';
const SCREENSHOT = process.env.MMROUTER_SCREENSHOT
  ?? join(process.env.CARGO_TARGET_DIR || join(ROOT, 'target'), 'web-demo.png');
const TYPES = {
  '.html': 'text/html; charset=utf-8', '.js': 'text/javascript', '.css': 'text/css',
  '.wasm': 'application/wasm', '.json': 'application/json', '.png': 'image/png',
};

let server, baseUrl, context, page, scratch;
const consoleErrors = [];

// `mmrouter inspect` on a body, natively, through cargo.
function cliInspect(bodyText, args = []) {
  const file = join(scratch, `body-${Math.random().toString(36).slice(2)}.json`);
  writeFileSync(file, bodyText);
  const out = execFileSync(process.env.CARGO || 'cargo',
    ['run', '-q', '--bin', 'mmrouter', '--', 'inspect', ...args, file],
    { cwd: ROOT, encoding: 'utf8', maxBuffer: 64 << 20, stdio: ['ignore', 'pipe', 'inherit'] });
  return JSON.parse(out);
}

function dataUrl(path) {
  const mime = extname(path) === '.png' ? 'image/png' : 'image/jpeg';
  return `data:${mime};base64,${readFileSync(path).toString('base64')}`;
}

// A body built here, independently of the page, from the same files.
function bodyOf(paths) {
  return JSON.stringify({
    model: 'Qwen/Qwen2.5-VL-7B-Instruct',
    messages: [{
      role: 'user',
      content: [...paths.map((p) => ({ type: 'image_url', image_url: { url: dataUrl(p) } })),
        { type: 'text', text: 'What is in these images?' }],
    }],
  });
}

async function tableRows() {
  return page.$$eval('#image-table tbody tr[data-id]', (rows) => rows.map((r) => ({
    name: r.dataset.name,
    id: r.dataset.id,
    tokens: Object.fromEntries([...r.querySelectorAll('td[data-profile]')]
      .map((td) => [td.dataset.profile, Number(td.dataset.tokens)])),
  })));
}

before(async () => {
  assert.ok(existsSync(join(WEB, 'pkg', 'mmrouter.js')), 'web/pkg missing: run scripts/build-web');
  assert.ok(existsSync(CHROMIUM), `${CHROMIUM} missing: apt-get install chromium`);
  scratch = mkdtempSync(join(tmpdir(), 'mmrouter-web-'));
  server = createServer((req, res) => {
    const path = decodeURIComponent(new URL(req.url, 'http://x').pathname);
    const file = resolve(WEB, `.${path.endsWith('/') ? `${path}index.html` : path}`);
    if (!file.startsWith(WEB + sep) || !existsSync(file)) {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200, { 'content-type': TYPES[extname(file)] || 'application/octet-stream' });
    res.end(readFileSync(file));
  });
  await new Promise((ok) => server.listen(0, '127.0.0.1', ok));
  baseUrl = `http://127.0.0.1:${server.address().port}/`;
  context = await chromium.launchPersistentContext(join(scratch, 'profile'), {
    executablePath: CHROMIUM,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    viewport: { width: 1280, height: 900 },
  });
  page = context.pages()[0] || await context.newPage();
  page.on('console', (m) => { if (m.type() === 'error') consoleErrors.push(m.text()); });
  page.on('pageerror', (e) => consoleErrors.push(String(e)));
  // Nothing may leave the page: fail any request that is not to our loopback server.
  await page.route('**/*', (route) => (route.request().url().startsWith(baseUrl)
    ? route.continue() : route.abort()));
  await page.goto(baseUrl);
  await page.waitForSelector('body[data-ready="true"]', { timeout: 30000 });
});

after(async () => {
  await context?.close();
  server?.close();
  if (scratch) rmSync(scratch, { recursive: true, force: true });
});

test('page lists the core profiles and says nothing is uploaded', async () => {
  const chips = await page.$$eval('#profile-list input', (xs) => xs.map((x) => x.value));
  assert.ok(chips.includes('qwen2.5-vl'), chips.join(','));
  assert.match(await page.textContent('#privacy'), /Nothing is uploaded/);
});

test('ids and token counts of a real PNG and JPEG equal mmrouter inspect', async () => {
  await page.setInputFiles('#file-input', [PNG, JPEG]);
  await page.waitForFunction(() => document.querySelectorAll('#image-table tr[data-id]').length === 2);
  // Show every profile's column (some start unticked), compare, then restore the default.
  const unticked = await page.$$eval('#profile-list input:not(:checked)', (xs) => xs.map((x) => x.value));
  for (const p of unticked) await page.check(`#profile-list input[value="${p}"]`);
  const all = await page.$$eval('#profile-list input', (xs) => xs.map((x) => x.value));
  const rows = await tableRows();
  assert.deepEqual(rows.map((r) => r.name), ['png_rgb8_37x23.png', 'jpeg_baseline_37x23.jpg']);
  const profiles = Object.keys(rows[0].tokens);
  assert.deepEqual(profiles.sort(), [...all].sort(), 'a profile has no token count');
  const body = bodyOf([PNG, JPEG]);
  for (const profile of profiles) {
    const cli = cliInspect(body, ['--profile', profile]);
    assert.equal(cli.images.length, 2);
    for (const [i, row] of rows.entries()) {
      assert.equal(row.id, cli.images[i].id, `id of ${row.name}`);
      assert.match(row.id, /^[0-9a-f]{32}$/);
      assert.equal(row.tokens[profile], cli.images[i].tokens, `${profile} tokens of ${row.name}`);
    }
  }
  // The two files are different images: different identities.
  assert.notEqual(rows[0].id, rows[1].id);
  for (const p of unticked) await page.uncheck(`#profile-list input[value="${p}"]`);
});

test('layout and shared prefix of the generated requests equal mmrouter inspect', async () => {
  // Add two larger images encoded by the browser itself, so the images span many blocks.
  await page.click('#sample-btn');
  await page.waitForFunction(() => document.querySelectorAll('#image-table tr[data-id]').length === 4);
  await page.waitForSelector('#layout-a svg .block');
  const bodyA = await page.inputValue('#body-a');
  const bodyB = await page.inputValue('#body-b');
  const cliA = cliInspect(bodyA);
  const cliB = cliInspect(bodyB);
  const pageA = JSON.parse(await page.textContent('#json-a'));
  const pageB = JSON.parse(await page.textContent('#json-b'));
  assert.deepEqual(pageA, cliA, 'report A (wasm) differs from the CLI (native)');
  assert.deepEqual(pageB, cliB, 'report B (wasm) differs from the CLI (native)');
  assert.equal(cliA.images.length, 4);
  const rows = await tableRows();
  assert.deepEqual(cliA.images.map((im) => im.id), rows.map((r) => r.id));
  // The picture has one block per key, and the shared prefix is where the keys part.
  const drawn = await page.$$eval('#layout-a svg .block', (gs) => gs.length);
  assert.equal(drawn, cliA.blocks.length);
  let shared = 0;
  while (shared < Math.min(cliA.blocks.length, cliB.blocks.length)
    && cliA.blocks[shared].key === cliB.blocks[shared].key) shared += 1;
  assert.ok(shared > 0 && shared < cliA.blocks.length, `shared ${shared}`);
  assert.equal(Number(await page.getAttribute('#prefix-summary', 'data-shared')), shared);
  const marked = await page.$$eval('#layout-a svg .block[data-first-diff="true"]',
    (gs) => gs.map((g) => Number(g.dataset.index)));
  assert.deepEqual(marked, [shared]);
  // Blocks that carry an image are drawn with the image's overlaps.
  const withImage = cliA.blocks.filter((b) => b.images.length > 0).length;
  assert.ok(withImage > 0);
  if (SCREENSHOT) {
    mkdirSync(dirname(SCREENSHOT), { recursive: true });
    await page.screenshot({ path: SCREENSHOT, fullPage: true });
  }
  assert.deepEqual(consoleErrors, []);
});
