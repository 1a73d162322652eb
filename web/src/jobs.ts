// Native jobs: submission, the job's server-sent events read with `fetch` (EventSource cannot send the API key)
// and reconnected until a terminal event, and the list of this browser's job ids kept in localStorage so a
// reload finds its jobs again.

import { ApiError, apiFetch, apiJson, errorFrom, postJson } from './api';

export type JobState = 'queued' | 'running' | 'succeeded' | 'failed' | 'cancelled';

export interface ApiImage {
  index: number;
  seed: number;
  width: number;
  height: number;
  infotext: string;
  format: string;
  image_base64: string;
  png_base64?: string;
}

export interface JobError {
  kind: string;
  message: string;
  param?: string | null;
}

/** `GET /v1/jobs/{id}` (the fields the page reads). */
export interface Job {
  id: string;
  state: JobState;
  queue_position?: number | null;
  step?: number;
  total_steps?: number;
  image_index?: number;
  images_total?: number;
  eta_seconds?: number | null;
  error?: JobError | null;
  images?: ApiImage[];
  request?: Record<string, unknown>;
  created_at?: number;
}

/** What the page shows of a job while it is followed. */
export interface JobView {
  id: string;
  state: JobState;
  position: number | null;
  step: number;
  totalSteps: number;
  image: number;
  images: number;
  eta: number | null;
  preview: string | null;
  error: JobError | null;
  job: Job | null;
}

export const TERMINAL: readonly JobState[] = ['succeeded', 'failed', 'cancelled'];

export function submit(body: Record<string, unknown>): Promise<{ id: string; state: JobState; queue_position: number }> {
  return postJson('/v1/jobs', body);
}

export function getJob(id: string): Promise<Job> {
  return apiJson<Job>(`/v1/jobs/${encodeURIComponent(id)}`);
}

export function cancelJob(id: string): Promise<Job> {
  return postJson<Job>(`/v1/jobs/${encodeURIComponent(id)}/cancel`, {});
}

interface SseMessage {
  event: string;
  data: Record<string, unknown>;
}

/** Reads one event stream until the server closes it; calls `onEvent` for each `event:`/`data:` block. */
async function readStream(path: string, onEvent: (m: SseMessage) => void, signal: AbortSignal): Promise<void> {
  const res = await apiFetch(path, { headers: { Accept: 'text/event-stream' }, signal });
  if (!res.ok) throw await errorFrom(res);
  if (!res.body) throw new Error('the event stream has no body');
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  let event = 'message';
  let data: string[] = [];
  const dispatch = () => {
    if (data.length) {
      try {
        onEvent({ event, data: JSON.parse(data.join('\n')) as Record<string, unknown> });
      } catch {
        // A block that is not JSON is not one of ours (the API's data is always an object): skip it.
      }
    }
    event = 'message';
    data = [];
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let nl: number;
    while ((nl = buffer.search(/\r\n|\n|\r/)) >= 0) {
      const line = buffer.slice(0, nl);
      buffer = buffer.slice(nl + (buffer.startsWith('\r\n', nl) ? 2 : 1));
      if (line === '') dispatch();
      else if (line.startsWith(':')) continue;
      else {
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? '' : line.slice(colon + 1);
        if (val.startsWith(' ')) val = val.slice(1);
        if (field === 'event') event = val;
        else if (field === 'data') data.push(val);
      }
    }
  }
  dispatch();
}

function num(v: unknown, fallback: number): number {
  return typeof v === 'number' && Number.isFinite(v) ? v : fallback;
}

export function initialView(id: string): JobView {
  return {
    id,
    state: 'queued',
    position: null,
    step: 0,
    totalSteps: 0,
    image: 0,
    images: 1,
    eta: null,
    preview: null,
    error: null,
    job: null,
  };
}

/** The view a polled job gives (used after a reload and when the stream cannot be read). */
export function viewFromJob(job: Job, prev?: JobView): JobView {
  return {
    ...(prev ?? initialView(job.id)),
    state: job.state,
    position: job.queue_position ?? null,
    step: job.step ?? 0,
    totalSteps: job.total_steps ?? 0,
    image: job.image_index ?? 0,
    images: job.images_total ?? 1,
    eta: job.eta_seconds ?? null,
    error: job.error ?? null,
    job,
  };
}

/**
 * Follows a job to its end: its events update the view as they come; a stream that ends before a terminal
 * event is opened again (the server replays a condensed state first). Resolves with the final view, whose
 * `job` is the finished job as `GET` returns it (images, infotext, request).
 */
export async function follow(id: string, onUpdate: (v: JobView) => void, signal: AbortSignal): Promise<JobView> {
  let view = initialView(id);
  const update = (patch: Partial<JobView>) => {
    view = { ...view, ...patch };
    onUpdate(view);
  };
  let failures = 0;
  while (!TERMINAL.includes(view.state)) {
    if (signal.aborted) throw new DOMException('stopped following the job', 'AbortError');
    try {
      await readStream(
        `/v1/jobs/${encodeURIComponent(id)}/events`,
        ({ event, data }) => {
          failures = 0;
          switch (event) {
            case 'queued':
              update({ state: 'queued', position: num(data.position, 0) });
              break;
            case 'started':
              update({ state: 'running', position: null });
              break;
            case 'progress':
              update({
                state: 'running',
                position: null,
                step: num(data.step, view.step),
                totalSteps: num(data.total_steps, view.totalSteps),
                image: num(data.image, view.image),
                images: num(data.images, view.images),
                eta: typeof data.eta_seconds === 'number' ? data.eta_seconds : null,
              });
              break;
            case 'preview':
              {
                const b64 = data.png_base64 ?? data.image_base64;
                if (typeof b64 === 'string') update({ preview: `data:image/png;base64,${b64}` });
              }
              break;
            case 'completed':
              update({ state: 'succeeded', eta: null });
              break;
            case 'failed':
              update({ state: 'failed', error: (data.error as JobError | undefined) ?? null, eta: null });
              break;
            case 'cancelled':
              update({ state: 'cancelled', step: num(data.step, view.step), eta: null });
              break;
          }
        },
        signal,
      );
    } catch (e) {
      if (signal.aborted) throw e;
      // The job is gone from the store (expired, or another server): nothing to reconnect to.
      if (e instanceof ApiError && (e.status === 404 || e.status === 410)) {
        update({ state: 'failed', error: { kind: 'not_found', message: e.message } });
        break;
      }
      // Refused outright (a key the user would not give, a bad id): reconnecting cannot help.
      if (e instanceof ApiError && e.status >= 400 && e.status < 500 && e.status !== 429) throw e;
      failures++;
      if (failures > 20) throw e;
    }
    if (!TERMINAL.includes(view.state)) {
      await sleep(Math.min(500 * 2 ** failures, 5000), signal);
    }
  }
  try {
    const job = await getJob(id);
    update({ job, error: job.error ?? view.error });
  } catch (e) {
    if (view.state !== 'failed') throw e;
  }
  return view;
}

export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener(
      'abort',
      () => {
        clearTimeout(t);
        reject(new DOMException('aborted', 'AbortError'));
      },
      { once: true },
    );
  });
}

const JOBS_STORAGE = 'sdhive.jobs';
const MAX_TRACKED = 50;

export interface TrackedJob {
  id: string;
  created: number;
  /** Saved to the gallery already: nothing more to fetch. */
  done?: boolean;
}

export function trackedJobs(): TrackedJob[] {
  try {
    const list = JSON.parse(localStorage.getItem(JOBS_STORAGE) ?? '[]') as unknown;
    return Array.isArray(list) ? list.filter((j): j is TrackedJob => typeof j?.id === 'string') : [];
  } catch {
    return [];
  }
}

function saveTracked(list: TrackedJob[]): void {
  localStorage.setItem(JOBS_STORAGE, JSON.stringify(list.slice(-MAX_TRACKED)));
}

export function track(id: string): void {
  saveTracked([...trackedJobs().filter((j) => j.id !== id), { id, created: Date.now() }]);
}

export function markDone(id: string): void {
  saveTracked(trackedJobs().map((j) => (j.id === id ? { ...j, done: true } : j)));
}

export function untrack(id: string): void {
  saveTracked(trackedJobs().filter((j) => j.id !== id));
}
