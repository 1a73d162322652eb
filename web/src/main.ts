// Entry point: wires the tabs, the API key prompt, and the three views, then loads what the server offers
// (`/v1/info` says whether this is a hive or a lone worker; the A1111 lists fill the form's pickers).

import './style.css';
import { ApiError, apiJson, describeError, forgetKey, onKeyChange, setKeyPrompt, storedKey } from './api';
import { $, h } from './dom';
import { Gallery } from './gallery';
import { GenerateView, type Lists } from './generate';
import { NodeView, type Info } from './node';

const TABS = ['generate', 'gallery', 'node'] as const;
type Tab = (typeof TABS)[number];

let nodeView: NodeView | null = null;
let current: Tab = 'generate';

function selectTab(tab: Tab, focus = false): void {
  current = tab;
  for (const t of TABS) {
    const button = $(`tab-${t}`);
    const on = t === tab;
    button.setAttribute('aria-selected', String(on));
    button.tabIndex = on ? 0 : -1;
    $(`panel-${t}`).hidden = !on;
    if (on && focus) button.focus();
  }
  if (tab === 'node') nodeView?.start();
  else nodeView?.stop();
  if (location.hash !== `#${tab}`) history.replaceState(null, '', tab === 'generate' ? location.pathname : `#${tab}`);
}

function setupTabs(): void {
  TABS.forEach((t, i) => {
    const button = $(`tab-${t}`);
    button.addEventListener('click', () => selectTab(t));
    button.addEventListener('keydown', (e) => {
      const next: Record<string, number> = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: TABS.length - 1 };
      if (!(e.key in next)) return;
      e.preventDefault();
      selectTab(TABS[(next[e.key] + TABS.length) % TABS.length], true);
    });
  });
}

/** The key prompt: a modal dialog (focus stays inside it); resolves with the key, or null when dismissed. */
function keyPrompt(reason: string): Promise<string | null> {
  const dialog = $<HTMLDialogElement>('key-dialog');
  const input = $<HTMLInputElement>('key-input');
  $('key-reason').textContent = reason;
  input.value = '';
  return new Promise((resolve) => {
    const finish = (value: string | null) => {
      dialog.removeEventListener('close', onClose);
      $('key-form').removeEventListener('submit', onSubmit);
      $('key-cancel').removeEventListener('click', onCancel);
      if (dialog.open) dialog.close();
      resolve(value);
    };
    const onSubmit = (e: Event) => {
      e.preventDefault();
      const key = input.value.trim();
      if (!key) {
        $('key-reason').textContent = 'Type the key first.';
        input.focus();
        return;
      }
      finish(key);
    };
    const onCancel = () => finish(null);
    const onClose = () => finish(null);
    $('key-form').addEventListener('submit', onSubmit);
    $('key-cancel').addEventListener('click', onCancel);
    dialog.addEventListener('close', onClose);
    dialog.showModal();
    input.focus();
  });
}

function globalError(message: string | null, retry?: () => void, retryLabel = 'Try again'): void {
  const box = $('global-error');
  if (!message) {
    box.hidden = true;
    box.replaceChildren();
    return;
  }
  box.replaceChildren(message);
  if (retry) box.append(h('button', { type: 'button', onclick: retry }, retryLabel));
  box.hidden = false;
}

function keyButton(): void {
  $('forget-key').hidden = !storedKey();
}

async function list<T>(path: string, fallback: T): Promise<T> {
  try {
    return await apiJson<T>(path);
  } catch {
    return fallback;
  }
}

async function loadLists(info: Info): Promise<Lists> {
  const [models, vaes, samplers, schedulers, latent, upscalers, loras, embeddings] = await Promise.all([
    list<Lists['models']>('/sdapi/v1/sd-models', []),
    list<Lists['vaes']>('/sdapi/v1/sd-vae', []),
    list<Lists['samplers']>('/sdapi/v1/samplers', []),
    list<Lists['schedulers']>('/sdapi/v1/schedulers', []),
    list<{ name: string }[]>('/sdapi/v1/latent-upscale-modes', []),
    list<{ name: string }[]>('/sdapi/v1/upscalers', []),
    list<Lists['loras']>('/sdapi/v1/loras', []),
    list<{ loaded?: Record<string, unknown>; skipped?: Record<string, unknown> }>('/sdapi/v1/embeddings', {}),
  ]);
  const native = info.model?.native_width ?? info.capabilities?.native_width ?? info.native_width ?? null;
  return {
    models,
    selectedModel: info.selected_model ?? info.model?.title ?? info.model?.name ?? null,
    vaes,
    samplers,
    schedulers,
    upscalers: [...latent.map((m) => m.name), ...upscalers.map((u) => u.name).filter((n) => n !== 'None')],
    loras,
    embeddings: { loaded: Object.keys(embeddings.loaded ?? {}), skipped: Object.keys(embeddings.skipped ?? {}) },
    nativeSize: native,
  };
}

function summarise(info: Info): string {
  if (info.role === 'hive') {
    const n = info.workers ?? 0;
    return `hive · ${n} worker${n === 1 ? '' : 's'}${info.selected_model ? ` · ${info.selected_model}` : ''}`;
  }
  const model = info.model?.title ?? info.model?.name ?? 'no model';
  return `worker ${info.worker_id ?? ''} · ${info.backend ?? info.device?.backend ?? ''} · ${model}`;
}

async function boot(gen: GenerateView, gallery: Gallery): Promise<void> {
  globalError(null);
  let info: Info;
  try {
    info = await apiJson<Info>('/v1/info');
  } catch (e) {
    const retry = () => void boot(gen, gallery);
    if (e instanceof ApiError && e.status === 401) globalError(`This server needs an API key: ${e.message}`, retry, 'Enter API key');
    else globalError(`Cannot reach the server: ${describeError(e)}`, retry);
    return;
  }
  $('server-summary').textContent = summarise(info);
  nodeView?.stop();
  nodeView = new NodeView(info);
  if (current === 'node') nodeView.start();
  gen.populate(await loadLists(info));
  try {
    await gallery.sync((id) => gen.show(id));
  } catch (e) {
    globalError(`Recent jobs could not be fetched: ${describeError(e)}`);
  }
}

function main(): void {
  // A button, not an in-page link: the page's only references are its own files (the server checks that).
  $('skip').addEventListener('click', () => $('main').focus());
  setupTabs();
  setKeyPrompt(keyPrompt);
  keyButton();
  onKeyChange(keyButton);
  $('forget-key').addEventListener('click', () => {
    forgetKey();
    $('server-summary').textContent = 'API key forgotten.';
  });
  let gen: GenerateView | null = null;
  const gallery = new Gallery({
    useSeed: (seed) => {
      gen?.useSeed(seed);
      selectTab('generate');
      $('seed').focus();
    },
    sendToImg2img: (item) => {
      gen?.sendToImg2img(item);
      selectTab('generate');
      $('prompt').focus();
    },
  });
  gen = new GenerateView(gallery, {
    useSeed: (seed) => {
      gen?.useSeed(seed);
      $('seed').focus();
    },
    sendToImg2img: (item) => gen?.sendToImg2img(item),
  });
  void gallery.refresh();
  const hash = location.hash.slice(1);
  selectTab((TABS as readonly string[]).includes(hash) ? (hash as Tab) : 'generate');
  void boot(gen, gallery);
}

main();
