// The first load: what the page downloads (≤ 200 KB compressed) and where from (nothing but its own server).

import { gzipSync } from 'node:zlib';
import { expect, open, test } from './fixtures';

test('first load is small and only talks to its own server', async ({ page, srv }) => {
  const origin = new URL(srv.hive).origin;
  const urls: string[] = [];
  page.on('request', (r) => urls.push(r.url()));
  const bodies: { url: string; type: string; gzip: number; transfer: number }[] = [];
  page.on('requestfinished', async (r) => {
    const res = await r.response();
    if (!res || !r.url().startsWith('http')) return;
    const body = await res.body().catch(() => Buffer.alloc(0));
    const sizes = await r.sizes();
    bodies.push({ url: r.url(), type: r.resourceType(), gzip: gzipSync(body, { level: 9 }).length, transfer: sizes.responseBodySize + sizes.responseHeadersSize });
  });
  await open(page);
  await page.waitForLoadState('networkidle');

  const foreign = urls.filter((u) => !u.startsWith(`${origin}/`) && !u.startsWith('data:') && !u.startsWith('blob:'));
  expect(foreign, 'requests to other hosts').toEqual([]);
  const assets = bodies.filter((b) => ['document', 'script', 'stylesheet', 'image', 'font'].includes(b.type));
  expect(assets.map((b) => new URL(b.url).pathname).sort()).toEqual(
    expect.arrayContaining(['/', '/assets/app.css', '/assets/app.js']),
  );
  const gz = assets.reduce((n, b) => n + b.gzip, 0);
  const transferred = bodies.reduce((n, b) => n + b.transfer, 0);
  console.log(`first load: ${bodies.length} responses, page assets ${gz} B gzip-compressed, ${transferred} B transferred (API answers included)`);
  expect(gz).toBeLessThanOrEqual(200 * 1024);
  expect(transferred).toBeLessThanOrEqual(200 * 1024);
});
