// The gallery: every finished image of this browser's jobs, kept in IndexedDB (store.ts), shown newest first;
// an image opens in a dialog with its infotext and the actions a result has (use its seed, send it to img2img,
// download the server's PNG as it is, with its `parameters` chunk). On load, jobs this browser submitted that the
// server still holds are fetched again, and those still queued or running are followed once more.

import { ApiError, describeError } from './api';
import { base64ToBlob, download, h, $ } from './dom';
import { getJob, markDone, TERMINAL, trackedJobs, untrack, type Job } from './jobs';
import { clearItems, deleteItem, hasJob, listItems, putItems, type GalleryItem } from './store';

export interface ImageActions {
  useSeed(seed: number): void;
  sendToImg2img(item: GalleryItem): void;
}

const MIME: Record<string, string> = { png: 'image/png', jpeg: 'image/jpeg', jpg: 'image/jpeg', webp: 'image/webp' };

/** The items a finished job's images make (cancelled jobs keep the images finished before the cancel). */
export function itemsOf(job: Job): GalleryItem[] {
  const created = job.created_at ? job.created_at * 1000 : Date.now();
  return (job.images ?? []).map((img) => {
    const format = img.format || 'png';
    return {
      key: `${job.id}:${img.index}`,
      jobId: job.id,
      index: img.index,
      seed: img.seed,
      width: img.width,
      height: img.height,
      infotext: img.infotext,
      format,
      blob: base64ToBlob(img.image_base64 ?? img.png_base64 ?? '', MIME[format] ?? 'application/octet-stream'),
      request: job.request ?? {},
      // Keeps a batch's images in their order within the newest-first listing.
      created: created + img.index / 1000,
    };
  });
}

export function fileName(item: GalleryItem): string {
  const ext = item.format === 'jpeg' ? 'jpg' : item.format;
  return `sdhive-${item.seed}.${ext}`;
}

/** The buttons every shown image has. */
export function actionButtons(item: GalleryItem, actions: ImageActions, extra: HTMLElement[] = []): HTMLElement {
  return h(
    'div',
    { class: 'actions wrap' },
    h('button', { type: 'button', onclick: () => actions.useSeed(item.seed) }, `Use seed ${item.seed}`),
    h('button', { type: 'button', onclick: () => actions.sendToImg2img(item) }, 'Send to img2img'),
    h('button', { type: 'button', onclick: () => download(item.blob, fileName(item)) }, `Download ${item.format.toUpperCase()}`),
    ...extra,
  );
}

export class Gallery {
  private urls: string[] = [];
  private dialogUrl: string | null = null;
  private readonly grid = $<HTMLUListElement>('gallery-grid');
  private readonly dialog = $<HTMLDialogElement>('image-dialog');

  constructor(private readonly actions: ImageActions) {
    $('image-close').addEventListener('click', () => this.dialog.close());
    this.dialog.addEventListener('close', () => {
      if (this.dialogUrl) URL.revokeObjectURL(this.dialogUrl);
      this.dialogUrl = null;
    });
    $('gallery-clear').addEventListener('click', () => {
      if (!confirm('Remove every image from this browser’s gallery?')) return;
      void clearItems()
        .catch((e: unknown) => alert(`The gallery could not be cleared: ${describeError(e)}`))
        .then(() => this.refresh());
    });
  }

  async save(job: Job): Promise<GalleryItem[]> {
    const items = itemsOf(job);
    if (items.length) await putItems(items);
    markDone(job.id);
    await this.refresh();
    return items;
  }

  async refresh(): Promise<void> {
    let items: GalleryItem[];
    try {
      items = await listItems();
    } catch (e) {
      this.grid.replaceChildren(h('li', { class: 'error' }, `The gallery cannot be read: ${describeError(e)}`));
      return;
    }
    this.urls.forEach((u) => URL.revokeObjectURL(u));
    this.urls = [];
    $('gallery-count').textContent = items.length === 1 ? '1 image' : `${items.length} images`;
    if (!items.length) {
      this.grid.replaceChildren(h('li', { class: 'empty muted' }, 'No images yet.'));
      return;
    }
    this.grid.replaceChildren(
      ...items.map((item) => {
        const url = URL.createObjectURL(item.blob);
        this.urls.push(url);
        const prompt = String(item.request.prompt ?? '').trim() || '(no prompt)';
        return h(
          'li',
          { 'data-key': item.key },
          h(
            'button',
            {
              type: 'button',
              class: 'thumb',
              'aria-label': `Open image: ${prompt.slice(0, 80)}, seed ${item.seed}, ${item.width}×${item.height}`,
              onclick: () => this.open(item),
            },
            h('img', { src: url, alt: '', width: item.width, height: item.height, loading: 'lazy' }),
          ),
          h('span', { class: 'thumb-caption' }, `${item.width}×${item.height} · seed ${item.seed}`),
        );
      }),
    );
  }

  open(item: GalleryItem): void {
    if (this.dialogUrl) URL.revokeObjectURL(this.dialogUrl);
    this.dialogUrl = URL.createObjectURL(item.blob);
    const img = $<HTMLImageElement>('image-full');
    img.src = this.dialogUrl;
    img.alt = `Generated image: ${String(item.request.prompt ?? '')}`;
    $('image-title').textContent = `Image · seed ${item.seed} · ${item.width}×${item.height}`;
    $('image-infotext').textContent = item.infotext;
    const close = (f: () => void) => () => {
      this.dialog.close();
      f();
    };
    const del = h(
      'button',
      {
        type: 'button',
        class: 'danger',
        onclick: () => {
          this.dialog.close();
          void deleteItem(item.key)
            .catch((e: unknown) => alert(`The image could not be deleted: ${describeError(e)}`))
            .then(() => this.refresh());
        },
      },
      'Delete',
    );
    $('image-actions').replaceChildren(
      actionButtons(
        item,
        {
          useSeed: (s) => close(() => this.actions.useSeed(s))(),
          sendToImg2img: (i) => close(() => this.actions.sendToImg2img(i))(),
        },
        [del],
      ),
    );
    this.dialog.showModal();
  }

  /**
   * Fetches this browser's jobs that are not saved yet: finished ones are saved, live ones handed to `resume`,
   * and ids the server no longer knows (expired, or another server) are forgotten.
   */
  async sync(resume: (id: string) => void): Promise<void> {
    for (const tracked of trackedJobs()) {
      if (tracked.done) continue;
      try {
        const job = await getJob(tracked.id);
        if (TERMINAL.includes(job.state)) {
          if (!(await hasJob(job.id))) await this.save(job);
          else markDone(job.id);
        } else {
          resume(job.id);
        }
      } catch (e) {
        if (e instanceof ApiError && (e.status === 404 || e.status === 410)) untrack(tracked.id);
        else throw e;
      }
    }
    await this.refresh();
  }
}
