// mmrouter inspector: the page around the wasm-bindgen build of the Rust core (web/pkg).
// Everything is computed here; no request leaves the page.
import init, { inspect, describe_image, profiles as listProfiles } from './pkg/mmrouter.js';

const MODEL = 'Qwen/Qwen2.5-VL-7B-Instruct';
const QUESTIONS = [
  'Describe these images in detail.',
  'Which of these images is brighter, and why?',
];
const MIME = { png: 'image/png', jpeg: 'image/jpeg', webp: 'image/webp', gif: 'image/gif' };
const PALETTE = ['#2563eb', '#d97706', '#059669', '#db2777', '#7c3aed', '#0891b2', '#65a30d', '#dc2626'];
const TEXT_FILL = '#e2e8f0';
// Profiles ticked at first (the others are one click away): keeps the table within the page.
const DEFAULT_SHOWN = ['qwen2.5-vl', 'qwen3-vl', 'gemma3', 'gemma4:280', 'llava'];
const SVG_NS = 'http://www.w3.org/2000/svg';

const state = {
  profiles: [],          // every spec the core offers
  selected: new Set(),   // specs shown in the image table
  images: [],            // {name, bytes, info | null, error | null, url}
  colors: new Map(),     // image id -> colour, in order of first appearance
  reports: { a: null, b: null },
};

const $ = (id) => document.getElementById(id);

function setStatus(text, kind = '') {
  const el = $('status');
  el.textContent = text;
  el.className = `status ${kind}`;
}

function colorFor(id) {
  if (!state.colors.has(id)) {
    state.colors.set(id, PALETTE[state.colors.size % PALETTE.length]);
  }
  return state.colors.get(id);
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') node.className = v;
    else if (k.startsWith('data-') || k === 'title' || k === 'style') node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function fmtBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(2)} MiB`;
}

function base64(bytes) {
  let bin = '';
  const step = 0x8000;
  for (let i = 0; i < bytes.length; i += step) {
    bin += String.fromCharCode.apply(null, bytes.subarray(i, i + step));
  }
  return btoa(bin);
}

// ---- images ---------------------------------------------------------------------------

async function addFiles(files) {
  for (const file of files) {
    const bytes = new Uint8Array(await file.arrayBuffer());
    const entry = { name: file.name, bytes, info: null, error: null, url: URL.createObjectURL(file) };
    try {
      entry.info = JSON.parse(describe_image(bytes, state.profiles));
      colorFor(entry.info.id);
    } catch (e) {
      entry.error = String(e.message || e);
    }
    state.images.push(entry);
  }
  renderImages();
  writeRequests();
  analyse();
}

function renderImages() {
  const table = $('image-table');
  const shown = state.profiles.filter((p) => state.selected.has(p));
  const head = el('tr', {},
    el('th', {}, '#'), el('th', {}, ''), el('th', {}, 'File · identity (xxh3-128 of the bytes)'),
    el('th', {}, 'Format'), el('th', { class: 'num' }, 'Size'), el('th', { class: 'num' }, 'Bytes'),
    ...shown.map((p) => el('th', { class: 'num tok', title: 'placeholder tokens (+ markers)' }, p)));
  table.tHead.replaceChildren(head);
  const body = table.tBodies[0];
  if (state.images.length === 0) {
    body.replaceChildren(el('tr', { class: 'empty' }, el('td', { colSpan: 6 + shown.length }, 'No images yet.')));
    return;
  }
  const rows = state.images.map((im, i) => {
    const thumb = el('img', { src: im.url, alt: '', class: 'thumb' });
    if (im.error) {
      return el('tr', { class: 'bad', 'data-name': im.name },
        el('td', {}, String(i)), el('td', {}, thumb), el('td', { class: 'file' }, im.name),
        el('td', { colSpan: 3 + shown.length, class: 'err' }, im.error));
    }
    const info = im.info;
    const swatch = el('span', { class: 'swatch', style: `background:${colorFor(info.id)}` });
    const cells = shown.map((p) => {
      const r = info.profiles.find((x) => x.profile === p);
      if (!r || r.error) return el('td', { class: 'num muted', title: r ? r.error : '' }, '—');
      return el('td', { class: 'num tok', 'data-profile': p, 'data-tokens': String(r.tokens) },
        String(r.tokens), el('span', { class: 'markers' }, ` +${r.markers}`));
    });
    return el('tr', { 'data-id': info.id, 'data-name': im.name },
      el('td', {}, swatch, String(i)), el('td', {}, thumb),
      el('td', { class: 'file', title: im.name }, el('div', { class: 'name' }, im.name),
        el('code', { class: 'id' }, info.id)),
      el('td', {}, info.format.toUpperCase()),
      el('td', { class: 'num' }, `${info.width}×${info.height}`),
      el('td', { class: 'num' }, fmtBytes(info.bytes)),
      ...cells);
  });
  body.replaceChildren(...rows);
}

function renderProfiles() {
  const list = $('profile-list');
  list.replaceChildren(...state.profiles.map((p) => {
    const box = el('input', { type: 'checkbox', checked: state.selected.has(p), value: p });
    box.addEventListener('change', () => {
      if (box.checked) state.selected.add(p); else state.selected.delete(p);
      renderImages();
    });
    return el('label', { class: 'chip' }, box, el('span', {}, p));
  }));
  const select = $('layout-profile');
  for (const p of state.profiles) select.append(el('option', { value: p }, p));
}

// A chat request carrying the picked images, then a question.
function requestBody(question) {
  const parts = state.images.filter((im) => im.info).map((im) => ({
    type: 'image_url',
    image_url: { url: `data:${MIME[im.info.format] || 'image/png'};base64,${base64(im.bytes)}` },
  }));
  parts.push({ type: 'text', text: question });
  return JSON.stringify({
    model: MODEL,
    messages: [
      { role: 'system', content: 'You are a helpful assistant.' },
      { role: 'user', content: parts },
    ],
    max_tokens: 256,
  }, null, 2);
}

function writeRequests() {
  $('body-a').value = requestBody(QUESTIONS[0]);
  $('body-b').value = requestBody(QUESTIONS[1]);
}

// ---- analysis and layout ----------------------------------------------------------------

function analyse() {
  const profile = $('layout-profile').value;
  const blockSize = Number($('block-size').value) || 0;
  for (const side of ['a', 'b']) {
    const text = $(`body-${side}`).value;
    $(`err-${side}`).textContent = '';
    state.reports[side] = null;
    if (!text.trim()) continue;
    try {
      state.reports[side] = JSON.parse(inspect(text, profile, blockSize));
    } catch (e) {
      $(`err-${side}`).textContent = String(e.message || e);
    }
    $(`json-${side}`).textContent = state.reports[side] ? JSON.stringify(state.reports[side], null, 2) : '';
  }
  renderLayouts();
}

function sharedBlocks(a, b) {
  if (!a || !b) return null;
  const n = Math.min(a.blocks.length, b.blocks.length);
  let i = 0;
  while (i < n && a.blocks[i].key === b.blocks[i].key) i += 1;
  return i;
}

function renderLayouts() {
  const { a, b } = state.reports;
  for (const r of [a, b]) if (r) r.images.forEach((im) => colorFor(im.id));
  const shared = sharedBlocks(a, b);
  renderLayout($('layout-a'), 'A', a, shared, b);
  renderLayout($('layout-b'), 'B', b, shared, a);
  const summary = $('prefix-summary');
  summary.replaceChildren();
  if (shared === null) {
    summary.textContent = a || b ? 'Analyse both requests to compare their prefixes.' : '';
  } else {
    const bs = a.block_size;
    const same = shared === a.blocks.length && shared === b.blocks.length;
    summary.append(
      el('strong', {}, `${shared}`), ` shared block${shared === 1 ? '' : 's'} (${shared * bs} tokens)`,
      same ? ' — identical keys.' : ` · first differing block #${shared}`,
    );
    summary.dataset.shared = String(shared);
  }
  renderLegend();
}

function renderLayout(container, label, report, shared, other) {
  container.replaceChildren();
  if (!report) return;
  container.dataset.blocks = String(report.blocks.length);
  const bs = report.block_size;
  const tail = report.prompt_tokens - report.blocks.length * bs;
  const tokensOf = new Map(report.images.map((im) => [im.id, im.tokens]));
  const imageNo = new Map();
  report.images.forEach((im) => { if (!imageNo.has(im.id)) imageNo.set(im.id, im.index); });

  const head = el('div', { class: 'layout-head' },
    el('span', { class: 'tag' }, label),
    el('span', {}, `${report.blocks.length} full blocks · ${report.prompt_tokens} prompt tokens · `),
    el('span', {}, `${report.images.length} image${report.images.length === 1 ? '' : 's'} · `),
    el('span', {}, `profile `), el('code', {}, report.profile), el('span', {}, ` · block size ${bs}`));
  container.append(head);

  const W = 22, H = 30, GAP = 3, TOP = 16, BOTTOM = 16;
  const width = Math.max(320, container.clientWidth || 900);
  const cols = Math.max(8, Math.floor((width + GAP) / (W + GAP)));
  const cells = report.blocks.length + (tail > 0 ? 1 : 0);
  const rows = Math.max(1, Math.ceil(cells / cols));
  const rowH = TOP + H + BOTTOM;
  const root = svg('svg', {
    viewBox: `0 0 ${cols * (W + GAP)} ${rows * rowH}`, width: '100%', role: 'img',
    'aria-label': `KV blocks of request ${label}`, class: 'blocks',
  });
  const firstDiff = shared !== null && other && shared < report.blocks.length ? shared : -1;

  report.blocks.forEach((block, i) => {
    const x = (i % cols) * (W + GAP);
    const y = Math.floor(i / cols) * rowH + TOP;
    const g = svg('g', { class: 'block', 'data-index': i });
    const title = [`block ${i} · key ${block.key}`];
    g.append(svg('rect', { x, y, width: W, height: H, rx: 3, fill: TEXT_FILL }));
    for (const o of block.images) {
      const n = tokensOf.get(o.id) ?? bs;
      const start = Math.max(0, o.offset);
      const end = Math.min(bs, o.offset + n);
      if (end <= start) continue;
      g.append(svg('rect', {
        x: x + (start / bs) * W, y, width: ((end - start) / bs) * W, height: H,
        fill: colorFor(o.id),
      }));
      title.push(`image #${imageNo.get(o.id)} (${o.id.slice(0, 12)}…) at offset ${o.offset}`);
    }
    if (block.images.length === 0) title.push('text only');
    const isShared = shared !== null && other && i < shared;
    if (isShared) {
      g.append(svg('rect', { x, y: y + H + 2, width: W, height: 4, rx: 1, fill: '#16a34a' }));
      title.push('shared with the other request');
    }
    if (i === firstDiff) {
      g.append(svg('rect', {
        x: x - 1, y: y - 1, width: W + 2, height: H + 2, rx: 4, fill: 'none', stroke: '#dc2626', 'stroke-width': 2.5,
      }));
      g.append(svg('path', { d: `M${x + W / 2 - 5} ${y - 10} L${x + W / 2 + 5} ${y - 10} L${x + W / 2} ${y - 3} Z`, fill: '#dc2626' }));
      title.push('first block that differs');
      g.dataset.firstDiff = 'true';
    }
    if (i % 10 === 0) {
      const t = svg('text', { x: x + 1, y: y + H + 15, class: 'idx' });
      t.textContent = String(i);
      g.append(t);
    }
    const tt = svg('title');
    tt.textContent = title.join('\n');
    g.append(tt);
    root.append(g);
  });
  if (tail > 0) {
    const i = report.blocks.length;
    const x = (i % cols) * (W + GAP);
    const y = Math.floor(i / cols) * rowH + TOP;
    root.append(svg('rect', {
      x, y, width: (tail / bs) * W, height: H, rx: 3, fill: 'none', stroke: '#94a3b8', 'stroke-dasharray': '3 2',
    }));
    const tt = svg('title');
    tt.textContent = `${tail} tail tokens: not a full block, not keyed`;
    root.lastChild.append(tt);
  }
  container.append(root);
}

function renderLegend() {
  const items = [
    el('li', {}, el('span', { class: 'key', style: `background:${TEXT_FILL}` }), 'text tokens'),
  ];
  const seen = new Set();
  for (const r of [state.reports.a, state.reports.b]) {
    if (!r) continue;
    for (const im of r.images) {
      if (seen.has(im.id)) continue;
      seen.add(im.id);
      items.push(el('li', {}, el('span', { class: 'key', style: `background:${colorFor(im.id)}` }),
        `image #${im.index} · ${im.tokens} tokens`));
    }
  }
  items.push(el('li', {}, el('span', { class: 'key bar' }), 'shared prefix'));
  items.push(el('li', {}, el('span', { class: 'key diff' }), 'first differing block'));
  items.push(el('li', {}, el('span', { class: 'key tail' }), 'unkeyed tail'));
  $('legend').replaceChildren(...items);
}

// ---- sample images (drawn here, encoded by the browser's own PNG/JPEG encoders) -------------

async function sampleImages() {
  const specs = [
    { name: 'sample-sunset-640x480.png', w: 640, h: 480, type: 'image/png', hue: 20 },
    { name: 'sample-lake-1024x768.jpg', w: 1024, h: 768, type: 'image/jpeg', hue: 200 },
  ];
  const files = [];
  for (const s of specs) {
    const canvas = document.createElement('canvas');
    canvas.width = s.w;
    canvas.height = s.h;
    const ctx = canvas.getContext('2d');
    const grad = ctx.createLinearGradient(0, 0, 0, s.h);
    grad.addColorStop(0, `hsl(${s.hue}, 80%, 70%)`);
    grad.addColorStop(1, `hsl(${s.hue + 40}, 60%, 30%)`);
    ctx.fillStyle = grad;
    ctx.fillRect(0, 0, s.w, s.h);
    ctx.fillStyle = `hsl(${s.hue + 180}, 70%, 85%)`;
    ctx.beginPath();
    ctx.arc(s.w * 0.7, s.h * 0.35, s.h * 0.12, 0, Math.PI * 2);
    ctx.fill();
    ctx.fillStyle = `hsl(${s.hue + 60}, 40%, 20%)`;
    ctx.beginPath();
    ctx.moveTo(0, s.h);
    ctx.lineTo(s.w * 0.3, s.h * 0.55);
    ctx.lineTo(s.w * 0.55, s.h * 0.75);
    ctx.lineTo(s.w * 0.8, s.h * 0.5);
    ctx.lineTo(s.w, s.h * 0.7);
    ctx.lineTo(s.w, s.h);
    ctx.fill();
    const blob = await new Promise((resolve) => canvas.toBlob(resolve, s.type, 0.9));
    files.push(new File([blob], s.name, { type: s.type }));
  }
  await addFiles(files);
}

// ---- wiring -------------------------------------------------------------------------------

function debounce(fn, ms) {
  let t = 0;
  return () => { clearTimeout(t); t = setTimeout(fn, ms); };
}

function wire() {
  const input = $('file-input');
  input.addEventListener('change', async () => {
    await addFiles([...input.files]);
    input.value = '';
  });
  const drop = $('drop');
  for (const ev of ['dragenter', 'dragover']) {
    drop.addEventListener(ev, (e) => { e.preventDefault(); drop.classList.add('over'); });
  }
  for (const ev of ['dragleave', 'drop']) {
    drop.addEventListener(ev, () => drop.classList.remove('over'));
  }
  drop.addEventListener('drop', (e) => {
    e.preventDefault();
    addFiles([...e.dataTransfer.files]);
  });
  $('sample-btn').addEventListener('click', () => sampleImages());
  $('clear-btn').addEventListener('click', () => {
    for (const im of state.images) URL.revokeObjectURL(im.url);
    state.images = [];
    state.colors.clear();
    renderImages();
    writeRequests();
    analyse();
  });
  const later = debounce(analyse, 250);
  $('body-a').addEventListener('input', later);
  $('body-b').addEventListener('input', later);
  $('layout-profile').addEventListener('change', analyse);
  $('block-size').addEventListener('input', later);
  window.addEventListener('resize', debounce(renderLayouts, 150));
}

async function main() {
  try {
    await init();
  } catch (e) {
    setStatus(`Could not load the WebAssembly core (web/pkg): ${e.message || e}. Build it with scripts/build-web.`, 'error');
    return;
  }
  state.profiles = JSON.parse(listProfiles());
  const preferred = state.profiles.filter((p) => DEFAULT_SHOWN.includes(p));
  state.selected = new Set(preferred.length ? preferred : state.profiles);
  renderProfiles();
  renderImages();
  wire();
  writeRequests();
  analyse();
  setStatus('Ready. Pick or drop images, or paste a chat request below.', 'ok');
  document.body.dataset.ready = 'true';
}

main();
