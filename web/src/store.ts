// The gallery's storage in this browser: finished images (the server's bytes, infotext, seed, the job's request)
// in IndexedDB, so they outlive the server's job TTL and a reload. Newest first; the oldest beyond a cap are
// dropped so the store cannot grow without bound.

export interface GalleryItem {
  /** `<job id>:<image index>` */
  key: string;
  jobId: string;
  index: number;
  seed: number;
  width: number;
  height: number;
  infotext: string;
  format: string;
  blob: Blob;
  request: Record<string, unknown>;
  created: number;
}

const DB_NAME = 'sdhive';
const STORE = 'images';
const MAX_ITEMS = 500;

let dbPromise: Promise<IDBDatabase> | null = null;

function db(): Promise<IDBDatabase> {
  dbPromise ??= new Promise((resolve, reject) => {
    const req = indexedDB.open(DB_NAME, 1);
    req.onupgradeneeded = () => {
      const store = req.result.createObjectStore(STORE, { keyPath: 'key' });
      store.createIndex('created', 'created');
    };
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error ?? new Error('IndexedDB is not available'));
  });
  return dbPromise;
}

function done(tx: IDBTransaction): Promise<void> {
  return new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve();
    tx.onerror = () => reject(tx.error ?? new Error('IndexedDB transaction failed'));
    tx.onabort = () => reject(tx.error ?? new Error('IndexedDB transaction aborted'));
  });
}

export async function putItems(items: GalleryItem[]): Promise<void> {
  const tx = (await db()).transaction(STORE, 'readwrite');
  const store = tx.objectStore(STORE);
  for (const item of items) store.put(item);
  await done(tx);
  await prune();
}

export async function listItems(): Promise<GalleryItem[]> {
  const tx = (await db()).transaction(STORE, 'readonly');
  const req = tx.objectStore(STORE).index('created').getAll();
  await done(tx);
  return (req.result as GalleryItem[]).reverse();
}

export async function hasJob(jobId: string): Promise<boolean> {
  const tx = (await db()).transaction(STORE, 'readonly');
  const req = tx.objectStore(STORE).get(`${jobId}:0`);
  await done(tx);
  return req.result !== undefined;
}

export async function deleteItem(key: string): Promise<void> {
  const tx = (await db()).transaction(STORE, 'readwrite');
  tx.objectStore(STORE).delete(key);
  await done(tx);
}

export async function clearItems(): Promise<void> {
  const tx = (await db()).transaction(STORE, 'readwrite');
  tx.objectStore(STORE).clear();
  await done(tx);
}

async function prune(): Promise<void> {
  const tx = (await db()).transaction(STORE, 'readwrite');
  const store = tx.objectStore(STORE);
  const countReq = store.count();
  countReq.onsuccess = () => {
    let excess = countReq.result - MAX_ITEMS;
    if (excess <= 0) return;
    store.index('created').openCursor().onsuccess = (ev) => {
      const cursor = (ev.target as IDBRequest<IDBCursorWithValue | null>).result;
      if (!cursor || excess <= 0) return;
      cursor.delete();
      excess--;
      cursor.continue();
    };
  };
  await done(tx);
}
