// The one way the page talks to the server: every call carries the stored API key (`Authorization: Bearer`),
// a 401 asks for a key (one prompt shared by all calls waiting on it) and retries, and error bodies become an
// `ApiError` worded as the API words them (`{"error": {message, type, param, code}}`, A1111's
// `{error, detail, field}`).

const KEY_STORAGE = 'sdhive.apiKey';

export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly param?: string,
    readonly code?: string,
  ) {
    super(message);
    this.name = 'ApiError';
  }
}

export function storedKey(): string | null {
  try {
    return localStorage.getItem(KEY_STORAGE);
  } catch {
    return null;
  }
}

export function saveKey(key: string): void {
  localStorage.setItem(KEY_STORAGE, key);
  keyListeners.forEach((f) => f());
}

export function forgetKey(): void {
  localStorage.removeItem(KEY_STORAGE);
  keyListeners.forEach((f) => f());
}

const keyListeners: (() => void)[] = [];
export function onKeyChange(f: () => void): void {
  keyListeners.push(f);
}

/** Shows the key prompt with a reason; resolves with the key typed, or null when the user dismissed it. */
export type KeyPrompt = (reason: string) => Promise<string | null>;
let prompt: KeyPrompt = async () => null;
let pendingPrompt: Promise<string | null> | null = null;

export function setKeyPrompt(p: KeyPrompt): void {
  prompt = p;
}

function askKey(reason: string): Promise<string | null> {
  pendingPrompt ??= prompt(reason).finally(() => {
    pendingPrompt = null;
  });
  return pendingPrompt;
}

export async function apiFetch(path: string, init: RequestInit = {}): Promise<Response> {
  for (;;) {
    const key = storedKey();
    const headers = new Headers(init.headers);
    if (key) headers.set('Authorization', `Bearer ${key}`);
    const res = await fetch(path, { ...init, headers });
    if (res.status !== 401) return res;
    const err = await errorFrom(res);
    // Another call may have stored a new key while this one was in flight: try that one first.
    if (storedKey() !== key) continue;
    const reason = key ? `The server refused this key: ${err.message}` : 'This server needs an API key.';
    const typed = await askKey(reason);
    if (typed === null) throw err;
    if (typed !== storedKey()) saveKey(typed);
  }
}

export async function apiJson<T>(path: string, init: RequestInit = {}): Promise<T> {
  const res = await apiFetch(path, init);
  if (!res.ok) throw await errorFrom(res);
  return (await res.json()) as T;
}

export function postJson<T>(path: string, body: unknown, signal?: AbortSignal): Promise<T> {
  return apiJson<T>(path, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify(body),
    signal,
  });
}

interface ErrorBody {
  error?: { message?: string; param?: string | null; code?: string | null } | string;
  detail?: string;
  field?: string;
  message?: string;
}

export async function errorFrom(res: Response): Promise<ApiError> {
  const text = await res.text().catch(() => '');
  let body: ErrorBody | null = null;
  try {
    body = JSON.parse(text) as ErrorBody;
  } catch {
    body = null;
  }
  if (body && typeof body === 'object') {
    if (body.error && typeof body.error === 'object' && body.error.message) {
      return new ApiError(body.error.message, res.status, body.error.param ?? undefined, body.error.code ?? undefined);
    }
    const message = body.detail ?? body.message ?? (typeof body.error === 'string' ? body.error : undefined);
    if (message) return new ApiError(message, res.status, body.field);
  }
  const snippet = text.trim().slice(0, 300);
  return new ApiError(`HTTP ${res.status} ${res.statusText}${snippet ? `: ${snippet}` : ''}`, res.status);
}

/** A message for any thrown value, naming the field when the API gave one. */
export function describeError(e: unknown): string {
  if (e instanceof ApiError) return e.param ? `${e.message} (field: ${e.param})` : e.message;
  if (e instanceof Error) return e.message;
  return String(e);
}
