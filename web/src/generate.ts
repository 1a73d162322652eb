// The Generate tab: the form (txt2img, img2img, inpaint with a painted mask; model, VAE, LoRA and embedding
// pickers, sampler, size, steps, CFG, seed, batch, hires fix), its settings kept in localStorage, and the job it
// submits followed live (queue position, step, ETA, preview, cancel) until its images are shown and saved to the
// gallery. Jobs still running when another is submitted are followed in the background and saved all the same.

import { ApiError, describeError } from './api';
import { $, blobToDataUrl, formatSeconds, h } from './dom';
import { actionButtons, itemsOf, type Gallery, type ImageActions } from './gallery';
import { cancelJob, follow, submit, track, type JobView } from './jobs';
import { MaskPainter } from './mask';
import type { GalleryItem } from './store';

type Mode = 'txt2img' | 'img2img' | 'inpaint';

export interface Lists {
  models: { title: string; model_name?: string }[];
  selectedModel: string | null;
  vaes: { model_name: string }[];
  samplers: { name: string }[];
  schedulers: { label: string; name: string }[];
  upscalers: string[];
  loras: { name: string; alias?: string; metadata?: Record<string, unknown> }[];
  embeddings: { loaded: string[]; skipped: string[] };
  nativeSize: number | null;
}

const SETTINGS_KEY = 'sdhive.settings';
const LAST_SEED_KEY = 'sdhive.lastSeed';
/** Controls whose values persist, by element id. */
const PERSISTED = [
  'model', 'vae', 'prompt', 'negative', 'sampler', 'scheduler', 'n', 'width', 'height', 'steps', 'cfg', 'seed',
  'hires', 'hr-upscaler', 'hr-scale', 'hr-steps', 'hr-denoise', 'preview-every', 'strength',
] as const;

/** The API's field names → the control that holds them, to point at the field an error names. */
const FIELD_CONTROL: Record<string, string> = {
  prompt: 'prompt', negative_prompt: 'negative', steps: 'steps', cfg_scale: 'cfg', width: 'width',
  height: 'height', seed: 'seed', n: 'n', sampler: 'sampler', scheduler: 'scheduler', init_image: 'init-file',
  strength: 'strength', mask: 'mask-fill', model: 'model', vae: 'vae', loras: 'prompt', hires: 'hires',
  preview_every: 'preview-every',
};

type Control = HTMLInputElement | HTMLSelectElement | HTMLTextAreaElement;

export class GenerateView {
  private readonly form = $<HTMLFormElement>('gen-form');
  private readonly painter = new MaskPainter($<HTMLCanvasElement>('mask-canvas'));
  private saved: Record<string, string | boolean> = {};
  private init: { dataUrl: string; width: number; height: number } | null = null;
  private lastPromptField: HTMLTextAreaElement = $<HTMLTextAreaElement>('prompt');
  /** The job the output panel shows; others still run in the background. */
  private shown: string | null = null;
  private readonly following = new Map<string, AbortController>();
  private resultUrls: string[] = [];
  private loras: Lists['loras'] = [];
  /** Settings are written only once the selects hold the server's options, so early events cannot erase them. */
  private ready = false;

  constructor(
    private readonly gallery: Gallery,
    private readonly actions: ImageActions,
  ) {
    this.restoreSettings();
    this.form.addEventListener('submit', (e) => {
      e.preventDefault();
      void this.generate();
    });
    this.form.addEventListener('input', () => this.persist());
    this.form.addEventListener('change', () => this.persist());
    for (const id of ['prompt', 'negative']) {
      const ta = $<HTMLTextAreaElement>(id);
      ta.addEventListener('focus', () => (this.lastPromptField = ta));
      ta.addEventListener('keydown', (e) => {
        if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
          e.preventDefault();
          this.form.requestSubmit();
        }
      });
    }
    this.form.querySelectorAll<HTMLInputElement>('input[name=mode]').forEach((r) =>
      r.addEventListener('change', () => this.applyMode()),
    );
    $('cancel').addEventListener('click', () => void this.cancel());
    $('seed-random').addEventListener('click', () => this.setValue('seed', '-1'));
    $('seed-reuse').addEventListener('click', () => {
      const last = localStorage.getItem(LAST_SEED_KEY);
      if (last) this.setValue('seed', last);
      else this.showError('No image generated yet: there is no last seed to reuse.');
    });
    $<HTMLInputElement>('init-file').addEventListener('change', (e) => {
      const file = (e.target as HTMLInputElement).files?.[0];
      if (file) void this.setInit(file);
    });
    const brush = $<HTMLInputElement>('brush');
    brush.addEventListener('input', () => (this.painter.brush = Number(brush.value)));
    this.painter.brush = Number(brush.value);
    const erase = $<HTMLInputElement>('erase');
    erase.addEventListener('change', () => (this.painter.erase = erase.checked));
    $('mask-clear').addEventListener('click', () => this.painter.clear());
    $('mask-fill').addEventListener('click', () => this.painter.fill());
    $('mask-invert').addEventListener('click', () => this.painter.invert());
    $<HTMLInputElement>('lora-filter').addEventListener('input', () => this.renderLoras());
    this.applyMode();
  }

  /** Fills the selects and pickers from the server's lists, then puts the saved choices back. */
  populate(lists: Lists): void {
    const modelSel = $<HTMLSelectElement>('model');
    const def = lists.selectedModel ? `Server default (${lists.selectedModel})` : 'Server default';
    modelSel.replaceChildren(
      h('option', { value: '' }, def),
      ...lists.models.map((m) => h('option', { value: m.title }, m.title)),
    );
    $<HTMLSelectElement>('vae').replaceChildren(
      h('option', { value: 'Automatic' }, 'Automatic'),
      h('option', { value: 'None' }, 'None (the checkpoint’s own)'),
      ...lists.vaes.map((v) => h('option', { value: v.model_name }, v.model_name)),
    );
    const samplers = lists.samplers.length ? lists.samplers.map((s) => s.name) : ['Euler a'];
    $<HTMLSelectElement>('sampler').replaceChildren(...samplers.map((s) => h('option', { value: s }, s)));
    $<HTMLSelectElement>('sampler').value = samplers.includes('Euler a') ? 'Euler a' : samplers[0];
    const schedulers = lists.schedulers.length ? lists.schedulers.map((s) => s.label) : ['Automatic'];
    $<HTMLSelectElement>('scheduler').replaceChildren(...schedulers.map((s) => h('option', { value: s }, s)));
    $<HTMLSelectElement>('hr-upscaler').replaceChildren(...lists.upscalers.map((u) => h('option', { value: u }, u)));
    if (lists.nativeSize && this.saved.width === undefined) {
      this.setValue('width', String(lists.nativeSize), false);
      this.setValue('height', String(lists.nativeSize), false);
    }
    this.loras = lists.loras;
    this.renderLoras();
    $('lora-count').textContent = `(${lists.loras.length})`;
    const emb = lists.embeddings;
    $('emb-count').textContent = `(${emb.loaded.length + emb.skipped.length})`;
    $('emb-list').replaceChildren(
      ...emb.loaded.map((name) => this.chip(name, name, () => this.insert(name))),
      ...emb.skipped.map((name) =>
        this.chip(name, `${name} (does not fit the loaded model)`, () => this.insert(name), 'dim'),
      ),
    );
    if (!emb.loaded.length && !emb.skipped.length) $('emb-list').replaceChildren(h('li', { class: 'muted' }, 'None found.'));
    this.restoreSettings(['model', 'vae', 'sampler', 'scheduler', 'hr-upscaler']);
    this.ready = true;
  }

  private renderLoras(): void {
    const filter = $<HTMLInputElement>('lora-filter').value.trim().toLowerCase();
    const shown = this.loras.filter(
      (l) => !filter || l.name.toLowerCase().includes(filter) || (l.alias ?? '').toLowerCase().includes(filter),
    );
    const list = $('lora-list');
    if (!shown.length) {
      list.replaceChildren(h('li', { class: 'muted' }, this.loras.length ? 'No LoRA matches.' : 'None found.'));
      return;
    }
    list.replaceChildren(
      ...shown.map((l) => {
        const base = l.metadata?.ss_base_model_version;
        const label = typeof base === 'string' ? `${l.name} (${base})` : l.name;
        return this.chip(l.name, `Insert LoRA ${label}`, () => this.insert(`<lora:${l.name}:1>`), undefined, label);
      }),
    );
  }

  private chip(name: string, aria: string, onclick: () => void, cls?: string, text?: string): HTMLLIElement {
    return h(
      'li',
      {},
      h('button', { type: 'button', class: `chip ${cls ?? ''}`, 'aria-label': aria, 'data-name': name, onclick }, text ?? name),
    );
  }

  /** Inserts text at the cursor of the prompt field last used, with a space on either side where needed. */
  private insert(text: string): void {
    const ta = this.lastPromptField;
    const start = ta.selectionStart ?? ta.value.length;
    const end = ta.selectionEnd ?? start;
    const before = ta.value.slice(0, start);
    const after = ta.value.slice(end);
    const pre = before && !/\s$/.test(before) ? ' ' : '';
    const post = after && !/^\s/.test(after) ? ' ' : '';
    ta.value = `${before}${pre}${text}${post}${after}`;
    const caret = before.length + pre.length + text.length;
    ta.focus();
    ta.setSelectionRange(caret, caret);
    this.persist();
  }

  private mode(): Mode {
    return (this.form.querySelector<HTMLInputElement>('input[name=mode]:checked')?.value as Mode) ?? 'txt2img';
  }

  setMode(mode: Mode): void {
    const radio = this.form.querySelector<HTMLInputElement>(`input[name=mode][value=${mode}]`);
    if (radio) radio.checked = true;
    this.applyMode();
  }

  private applyMode(): void {
    const mode = this.mode();
    $('init-section').hidden = mode === 'txt2img';
    const inpaint = mode === 'inpaint';
    $('mask-tools').hidden = !inpaint || !this.init;
    $('mask-canvas').hidden = !inpaint;
    $<HTMLInputElement>('hires').disabled = mode !== 'txt2img';
    this.persist();
  }

  /** Loads an init image (a file, or a result sent to img2img); the size fields follow it. */
  async setInit(blob: Blob): Promise<void> {
    try {
      const dataUrl = await blobToDataUrl(blob);
      const img = $<HTMLImageElement>('init-preview');
      img.src = dataUrl;
      await img.decode();
      const { naturalWidth: width, naturalHeight: height } = img;
      this.init = { dataUrl, width, height };
      this.painter.reset(width, height);
      $('init-stage').hidden = false;
      $('init-hint').textContent = `${width}×${height}`;
      this.setValue('width', String(Math.max(64, Math.floor(width / 8) * 8)));
      this.setValue('height', String(Math.max(64, Math.floor(height / 8) * 8)));
      this.applyMode();
    } catch {
      this.showError('This file is not an image the browser can read (PNG, JPEG or WebP).', 'init_image');
    }
  }

  sendToImg2img(item: GalleryItem): void {
    const r = item.request;
    if (typeof r.prompt === 'string') this.setValue('prompt', r.prompt);
    if (typeof r.negative_prompt === 'string') this.setValue('negative', r.negative_prompt);
    this.setMode('img2img');
    void this.setInit(item.blob);
  }

  useSeed(seed: number): void {
    this.setValue('seed', String(seed));
  }

  private setValue(id: string, value: string, persist = true): void {
    const el = $<Control>(id);
    el.value = value;
    if (persist) this.persist();
  }

  private num(id: string): number | undefined {
    const raw = $<HTMLInputElement>(id).value.trim();
    if (raw === '') return undefined;
    const v = Number(raw);
    if (!Number.isFinite(v)) throw new ApiError(`\`${id}\` is not a number: ${raw}`, 0, id);
    return v;
  }

  /** The request body of the form as it stands. */
  body(): Record<string, unknown> {
    const mode = this.mode();
    const body: Record<string, unknown> = {
      prompt: $<HTMLTextAreaElement>('prompt').value,
      negative_prompt: $<HTMLTextAreaElement>('negative').value,
      sampler: $<HTMLSelectElement>('sampler').value || undefined,
      scheduler: $<HTMLSelectElement>('scheduler').value || undefined,
      steps: this.num('steps'),
      cfg_scale: this.num('cfg'),
      width: this.num('width'),
      height: this.num('height'),
      seed: this.num('seed'),
      n: this.num('n'),
    };
    const preview = this.num('preview-every');
    if (preview && preview > 0) body.preview_every = preview;
    const model = $<HTMLSelectElement>('model').value;
    if (model) body.model = model;
    const vae = $<HTMLSelectElement>('vae').value;
    if (vae && vae !== 'Automatic') body.vae = vae;
    if (mode !== 'txt2img') {
      if (!this.init) throw new ApiError(`${mode} needs an init image: choose a file first.`, 0, 'init_image');
      body.init_image = this.init.dataUrl;
      body.strength = this.num('strength');
      if (mode === 'inpaint') {
        if (!this.painter.hasMask()) {
          throw new ApiError('Paint the mask over the area to repaint (or use "Mask all").', 0, 'mask');
        }
        body.mask = this.painter.toDataUrl();
      }
    } else if ($<HTMLInputElement>('hires').checked) {
      const steps = this.num('hr-steps');
      body.hires = {
        upscaler: $<HTMLSelectElement>('hr-upscaler').value || undefined,
        scale: this.num('hr-scale'),
        steps: steps && steps > 0 ? steps : undefined,
        denoising_strength: this.num('hr-denoise'),
      };
    }
    return Object.fromEntries(Object.entries(body).filter(([, v]) => v !== undefined));
  }

  private async generate(): Promise<void> {
    this.clearError();
    let body: Record<string, unknown>;
    try {
      body = this.body();
    } catch (e) {
      this.showError(describeError(e), e instanceof ApiError ? e.param : undefined);
      return;
    }
    const button = $<HTMLButtonElement>('generate');
    button.disabled = true;
    try {
      const accepted = await submit(body);
      track(accepted.id);
      this.show(accepted.id);
    } catch (e) {
      this.setStatus('Not submitted.');
      this.showError(describeError(e), e instanceof ApiError ? e.param : undefined);
    } finally {
      button.disabled = false;
    }
  }

  /** Shows a job in the output panel and follows it (a job found running after a reload comes here too). */
  show(id: string): void {
    this.shown = id;
    this.clearResults();
    this.clearError();
    const preview = $<HTMLImageElement>('preview');
    preview.hidden = true;
    preview.removeAttribute('src');
    $('placeholder').hidden = true;
    $('stage').hidden = false;
    this.setStatus('Submitted…');
    this.setProgress(0);
    $<HTMLButtonElement>('cancel').disabled = false;
    if (this.following.has(id)) return;
    const abort = new AbortController();
    this.following.set(id, abort);
    void follow(id, (v) => this.shown === id && this.render(v), abort.signal)
      .then(async (v) => {
        const job = v.job;
        if (job) {
          await this.gallery.save(job).catch((e: unknown) => {
            if (this.shown === id) this.showError(`The image could not be saved in this browser: ${describeError(e)}`);
          });
          const seeds = (job.images ?? []).map((i) => i.seed);
          if (seeds.length) localStorage.setItem(LAST_SEED_KEY, String(seeds[0]));
        }
        if (this.shown === id) this.finish(v);
      })
      .catch((e: unknown) => {
        if (abort.signal.aborted) return;
        if (this.shown === id) {
          this.setStatus('Lost track of the job.');
          this.showError(describeError(e));
          $<HTMLButtonElement>('cancel').disabled = true;
        }
      })
      .finally(() => this.following.delete(id));
  }

  private render(v: JobView): void {
    if (v.state === 'queued') {
      const p = v.position;
      this.setStatus(p === null ? 'Queued.' : p === 0 ? 'Queued: next to run.' : `Queued: ${p} job${p === 1 ? '' : 's'} ahead.`);
      $('job-eta').textContent = '';
    } else if (v.state === 'running') {
      const img = v.images > 1 ? `Image ${v.image + 1}/${v.images} · ` : '';
      this.setStatus(v.totalSteps ? `${img}Step ${v.step}/${v.totalSteps}` : 'Running…');
      $('job-eta').textContent = v.eta !== null && v.eta > 0 ? `ETA ${formatSeconds(v.eta)}` : '';
      const total = v.totalSteps * Math.max(1, v.images);
      this.setProgress(total ? ((v.image * v.totalSteps + v.step) / total) * 100 : 0);
    }
    if (v.preview) {
      const preview = $<HTMLImageElement>('preview');
      preview.src = v.preview;
      preview.hidden = false;
    }
  }

  private finish(v: JobView): void {
    $<HTMLButtonElement>('cancel').disabled = true;
    $('job-eta').textContent = '';
    const job = v.job;
    if (v.state === 'succeeded') {
      this.setProgress(100);
      const secs = (job as { run_seconds?: number } | null)?.run_seconds;
      this.setStatus(`Done${typeof secs === 'number' ? ` in ${formatSeconds(secs)}` : ''}.`);
    } else if (v.state === 'cancelled') {
      this.setStatus(`Cancelled after step ${v.step}.`);
    } else if (v.state === 'failed') {
      this.setStatus('Failed.');
      const err = v.error;
      this.showError(err ? err.message : 'The job failed.', err?.param ?? undefined);
    }
    $<HTMLImageElement>('preview').hidden = true;
    const items = job ? itemsOf(job) : [];
    this.showResults(items);
    $('stage').hidden = items.length > 0;
    $('placeholder').hidden = items.length > 0;
    if (!items.length) $('placeholder').textContent = 'No image.';
  }

  private showResults(items: GalleryItem[]): void {
    this.clearResults();
    $('results').replaceChildren(
      ...items.map((item) => {
        const url = URL.createObjectURL(item.blob);
        this.resultUrls.push(url);
        return h(
          'figure',
          { class: 'result', 'data-seed': item.seed },
          h('img', { src: url, alt: `Result: seed ${item.seed}, ${item.width}×${item.height}`, width: item.width, height: item.height }),
          h(
            'figcaption',
            {},
            h('details', {}, h('summary', {}, `Seed ${item.seed} · ${item.width}×${item.height} · infotext`), h('pre', { class: 'infotext' }, item.infotext)),
            actionButtons(item, this.actions),
          ),
        );
      }),
    );
  }

  private clearResults(): void {
    this.resultUrls.forEach((u) => URL.revokeObjectURL(u));
    this.resultUrls = [];
    $('results').replaceChildren();
  }

  private async cancel(): Promise<void> {
    const id = this.shown;
    if (!id) return;
    $<HTMLButtonElement>('cancel').disabled = true;
    this.setStatus('Cancelling…');
    try {
      await cancelJob(id);
    } catch (e) {
      this.showError(describeError(e));
      $<HTMLButtonElement>('cancel').disabled = false;
    }
  }

  private setStatus(text: string): void {
    $('job-status').textContent = text;
  }

  private setProgress(pct: number): void {
    const v = Math.max(0, Math.min(100, Math.round(pct)));
    const bar = $('progress');
    bar.setAttribute('aria-valuenow', String(v));
    bar.setAttribute('aria-valuetext', `${v}%`);
    $('progress-fill').style.width = `${v}%`;
  }

  showError(message: string, param?: string): void {
    const box = $('gen-error');
    box.replaceChildren(h('strong', {}, 'Error: '), message);
    if (param) box.append(h('span', { class: 'param' }, ` (field: ${param})`));
    box.hidden = false;
    this.form.querySelectorAll('[aria-invalid]').forEach((el) => el.removeAttribute('aria-invalid'));
    const control = param ? document.getElementById(FIELD_CONTROL[param] ?? param) : null;
    if (control) control.setAttribute('aria-invalid', 'true');
  }

  private clearError(): void {
    $('gen-error').hidden = true;
    $('gen-error').replaceChildren();
    this.form.querySelectorAll('[aria-invalid]').forEach((el) => el.removeAttribute('aria-invalid'));
  }

  private persist(): void {
    if (!this.ready) return;
    const out: Record<string, string | boolean> = { mode: this.mode() };
    for (const id of PERSISTED) {
      const el = $<Control>(id);
      out[id] = el instanceof HTMLInputElement && el.type === 'checkbox' ? el.checked : el.value;
    }
    this.saved = out;
    try {
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(out));
    } catch {
      // Storage full or disabled: the settings just do not persist.
    }
  }

  /** Puts saved values back (all of them, or those of the controls named, once their options exist). */
  private restoreSettings(only?: string[]): void {
    if (!only) {
      try {
        this.saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) ?? '{}') as Record<string, string | boolean>;
      } catch {
        this.saved = {};
      }
    }
    for (const id of only ?? PERSISTED) {
      const v = this.saved[id];
      if (v === undefined) continue;
      const el = $<Control>(id);
      if (el instanceof HTMLInputElement && el.type === 'checkbox') el.checked = v === true;
      else if (el instanceof HTMLSelectElement) {
        if ([...el.options].some((o) => o.value === v)) el.value = String(v);
      } else el.value = String(v);
    }
    if (!only && typeof this.saved.mode === 'string') {
      const radio = this.form.querySelector<HTMLInputElement>(`input[name=mode][value="${this.saved.mode}"]`);
      if (radio) radio.checked = true;
    }
  }
}
