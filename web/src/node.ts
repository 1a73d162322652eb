// The Node tab. Behind a hive: its devices (backend, memory used and free, the workers on each), its workers
// (state, device, loaded model, queue, restarts, last exit) and the hive's queue and jobs per second, polled
// while the tab is open. A lone worker shows a compact panel about itself from `/v1/info`.

import { apiFetch, apiJson, describeError, errorFrom } from './api';
import { $, formatBytes, h } from './dom';

export interface Info {
  role?: string;
  auth_required?: boolean;
  version?: string;
  worker_id?: string;
  backend?: string;
  engine?: string;
  dtype?: string;
  device?: DeviceInfo;
  model?: { name?: string; title?: string; family?: string; native_width?: number; native_height?: number } | null;
  selected_model?: string | null;
  /** The hive's: the selected model's native size, as a worker holding it reported it. */
  native_width?: number | null;
  queue?: { depth?: number; max?: number };
  workers?: number;
  jobs?: { submitted?: number; succeeded?: number; failed?: number; cancelled?: number };
  capabilities?: { native_width?: number; max_steps?: number; max_n?: number };
}

interface DeviceInfo {
  backend?: string;
  index?: number;
  name?: string;
  vendor?: string;
  memory_total_bytes?: number | null;
  memory_free_bytes?: number | null;
  driver?: string | null;
}

interface DeviceRow extends DeviceInfo {
  /** Older answers nest the device; current ones are flat. Both are read. */
  device?: DeviceInfo;
  status?: string;
  max_workers?: number;
  workers?: { id: string; state?: string; loaded_model?: string | null }[];
}

interface WorkerRow {
  id: string;
  state: string;
  backend?: string;
  device_index?: number;
  model?: string | null;
  loaded_model?: string | null;
  pid?: number | null;
  queue_depth?: number | null;
  inflight?: number | null;
  running_job?: string | null;
  restarts?: number;
  last_exit?: string | null;
  managed?: boolean;
  on_demand?: unknown;
}

const POLL_MS = 1500;
/** Jobs per second over about this window of polls. */
const RATE_WINDOW_MS = 15_000;

function finished(info: Info): number | null {
  const j = info.jobs;
  if (!j) return null;
  return (j.succeeded ?? 0) + (j.failed ?? 0) + (j.cancelled ?? 0);
}

export class NodeView {
  private timer: number | null = null;
  private samples: { t: number; done: number }[] = [];
  private busy = false;

  constructor(private info: Info) {
    $('tab-node').textContent = this.isHive() ? 'Node' : 'Worker';
    $('node-title').textContent = this.isHive() ? 'Node' : 'This worker';
  }

  private isHive(): boolean {
    return this.info.role === 'hive';
  }

  start(): void {
    if (this.timer !== null) return;
    void this.poll();
    this.timer = window.setInterval(() => void this.poll(), POLL_MS);
  }

  stop(): void {
    if (this.timer !== null) window.clearInterval(this.timer);
    this.timer = null;
  }

  private async poll(): Promise<void> {
    if (this.busy || document.hidden) return;
    this.busy = true;
    try {
      this.info = await apiJson<Info>('/v1/info');
      if (this.isHive()) await this.pollHive();
      else this.renderWorker();
      $('node-error').hidden = true;
      $('node-updated').textContent = `Updated ${new Date().toLocaleTimeString()}`;
    } catch (e) {
      this.error(describeError(e));
    } finally {
      this.busy = false;
    }
  }

  private error(message: string): void {
    const box = $('node-error');
    box.textContent = message;
    box.hidden = false;
  }

  private async pollHive(): Promise<void> {
    const [workersRes, devicesRes] = await Promise.all([apiFetch('/v1/workers'), apiFetch('/v1/devices')]);
    // 403 `admin_disabled`: the hive listens beyond loopback without a key; its words say what to do.
    for (const res of [workersRes, devicesRes]) {
      if (!res.ok) {
        const err = await errorFrom(res);
        $('node-body').replaceChildren();
        throw err;
      }
    }
    const workers = ((await workersRes.json()) as { workers?: WorkerRow[] }).workers ?? [];
    const devices = ((await devicesRes.json()) as { devices?: DeviceRow[] }).devices ?? [];
    const now = performance.now();
    const done = finished(this.info);
    if (done !== null) {
      this.samples.push({ t: now, done });
      while (this.samples.length > 2 && now - this.samples[0].t > RATE_WINDOW_MS) this.samples.shift();
    }
    $('node-body').replaceChildren(this.summary(workers), this.devicesTable(devices), this.workersTable(workers));
  }

  private rate(): string {
    if (this.samples.length < 2) return '–';
    const a = this.samples[0];
    const b = this.samples[this.samples.length - 1];
    const secs = (b.t - a.t) / 1000;
    return secs > 0 ? ((b.done - a.done) / secs).toFixed(2) : '–';
  }

  private summary(workers: WorkerRow[]): HTMLElement {
    const q = this.info.queue ?? {};
    const ready = workers.filter((w) => w.state === 'ready' || w.state === 'busy').length;
    const j = this.info.jobs;
    return h(
      'dl',
      { class: 'cards' },
      card('Hive queue', `${q.depth ?? 0} / ${q.max ?? '–'}`, 'stat-queue'),
      card('Workers serving', `${ready} / ${workers.length}`, 'stat-workers'),
      card('Jobs per second', this.rate(), 'stat-rate'),
      j ? card('Jobs done', `${j.succeeded ?? 0} ok · ${j.failed ?? 0} failed · ${j.cancelled ?? 0} cancelled`, 'stat-jobs') : null,
    );
  }

  private devicesTable(devices: DeviceRow[]): HTMLElement {
    return h(
      'section',
      { 'aria-labelledby': 'devices-title' },
      h('h3', { id: 'devices-title' }, 'Devices'),
      h(
        'div',
        { class: 'table-wrap' },
        h(
          'table',
          { class: 'table', id: 'devices-table' },
          h('thead', {}, h('tr', {}, ...['Device', 'Backend', 'Status', 'Memory used', 'Free', 'Workers'].map((t) => h('th', { scope: 'col' }, t)))),
          h(
            'tbody',
            {},
            devices.map((d) => {
              const dev: DeviceInfo = { ...d, ...(d.device ?? {}) };
              return h(
                'tr',
                { 'data-device': `${dev.backend}:${dev.index}` },
                h('th', { scope: 'row' }, `${dev.name ?? '?'}`),
                h('td', {}, `${dev.backend ?? '?'}:${dev.index ?? '?'}`),
                h('td', {}, d.status ?? ''),
                h('td', {}, memory(dev)),
                h('td', {}, formatBytes(dev.memory_free_bytes)),
                h('td', {}, (d.workers ?? []).map((w) => `${w.id} (${w.state ?? '?'})`).join(', ') || '–'),
              );
            }),
          ),
        ),
      ),
    );
  }

  private workersTable(workers: WorkerRow[]): HTMLElement {
    const cols = ['Worker', 'State', 'Device', 'Loaded model', 'Queue', 'Running job', 'Restarts', 'Last exit', 'PID'];
    return h(
      'section',
      { 'aria-labelledby': 'workers-title' },
      h('h3', { id: 'workers-title' }, 'Workers'),
      h(
        'div',
        { class: 'table-wrap' },
        h(
          'table',
          { class: 'table', id: 'workers-table' },
          h('thead', {}, h('tr', {}, ...cols.map((t) => h('th', { scope: 'col' }, t)))),
          h(
            'tbody',
            {},
            workers.length
              ? workers.map((w) =>
                  h(
                    'tr',
                    { 'data-worker': w.id },
                    h('th', { scope: 'row' }, w.id),
                    h('td', { 'data-col': 'state' }, h('span', { class: `badge state-${w.state}` }, w.state)),
                    h('td', {}, `${w.backend ?? '?'}:${w.device_index ?? '?'}`),
                    h('td', {}, w.loaded_model ?? w.model ?? '–'),
                    h('td', { 'data-col': 'queue' }, String(w.queue_depth ?? w.inflight ?? 0)),
                    h('td', {}, w.running_job ?? '–'),
                    h('td', { 'data-col': 'restarts' }, String(w.restarts ?? 0)),
                    h('td', { 'data-col': 'last-exit' }, w.last_exit ?? '–'),
                    h('td', {}, w.pid ? String(w.pid) : '–'),
                  ),
                )
              : h('tr', {}, h('td', { colspan: cols.length, class: 'muted' }, 'No workers.')),
          ),
        ),
      ),
    );
  }

  private renderWorker(): void {
    const i = this.info;
    const dev = i.device ?? {};
    const model = i.model;
    $('node-body').replaceChildren(
      h(
        'dl',
        { class: 'cards' },
        card('Worker', i.worker_id ?? '–', 'stat-worker'),
        card('Backend', `${i.backend ?? dev.backend ?? '?'} · ${i.engine ?? ''} · ${i.dtype ?? ''}`, 'stat-backend'),
        card('Device', `${dev.name ?? '?'} (${dev.backend ?? '?'}:${dev.index ?? 0})`, 'stat-device'),
        card('Memory', memory(dev), 'stat-memory'),
        card('Model', model ? `${model.title ?? model.name ?? '?'}${model.family ? ` (${model.family})` : ''}` : 'none loaded', 'stat-model'),
        card('Queue', `${i.queue?.depth ?? 0} / ${i.queue?.max ?? '–'}`, 'stat-queue'),
        card('Version', i.version ?? '–', 'stat-version'),
      ),
    );
  }
}

function card(label: string, value: string | Node, id: string): HTMLElement {
  return h('div', { class: 'card' }, h('dt', {}, label), h('dd', { id }, value));
}

function memory(dev: DeviceInfo): HTMLElement | string {
  const total = dev.memory_total_bytes;
  const free = dev.memory_free_bytes;
  if (typeof total !== 'number' || typeof free !== 'number' || total <= 0) return '–';
  const used = Math.max(0, total - free);
  return h(
    'span',
    { class: 'mem' },
    h('meter', { min: 0, max: total, value: used, 'aria-label': 'Memory used' }),
    ` ${formatBytes(used)} / ${formatBytes(total)}`,
  );
}

