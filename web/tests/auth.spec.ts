// The API key flow against a hive started with --api-key: the page loads without a key, asks for one on the
// first 401, says when a key is refused, keeps the key in the browser, sends it with every call (the event
// stream included), and forgets it on request.

import { expect, fill, generate, shot, test } from './fixtures';

test('asks for the key, refuses a wrong one, works with the right one', async ({ page, srv }) => {
  await page.goto(`${srv.keyedHive}/`);
  const dialog = page.getByRole('dialog', { name: 'API key' });
  await expect(dialog).toBeVisible();
  await expect(dialog).toContainText('This server needs an API key.');
  await expect(dialog.getByLabel('API key')).toBeFocused();
  await shot(page, 'key-prompt');

  await dialog.getByLabel('API key').fill('not-the-key');
  await dialog.getByRole('button', { name: 'Use key' }).click();
  await expect(dialog).toBeVisible();
  await expect(dialog).toContainText('The server refused this key');
  await shot(page, 'key-refused');

  await dialog.getByLabel('API key').fill(srv.key);
  await dialog.getByLabel('API key').press('Enter');
  await expect(dialog).toBeHidden();
  await expect(page.locator('#server-summary')).toContainText('hive');
  await expect(page.locator('#sampler option')).not.toHaveCount(0);
  expect(await page.evaluate(() => localStorage.getItem('sdhive.apiKey'))).toBe(srv.key);

  const authorized: string[] = [];
  page.on('request', (r) => {
    if (new URL(r.url()).pathname.startsWith('/v1/jobs')) authorized.push(r.headers().authorization ?? '');
  });
  await fill(page, { prompt: 'a keyed cat', steps: 4 });
  await generate(page);
  expect(authorized.length).toBeGreaterThanOrEqual(3);
  expect(authorized.every((a) => a === `Bearer ${srv.key}`), authorized.join(', ')).toBe(true);

  // The node view's admin routes take the same key.
  await page.getByRole('tab', { name: 'Node' }).click();
  await expect(page.locator('#workers-table [data-col=state]').first()).toHaveText(/ready|busy/);

  // Forgotten: the next load asks again.
  await page.getByRole('button', { name: 'Forget API key' }).click();
  expect(await page.evaluate(() => localStorage.getItem('sdhive.apiKey'))).toBeNull();
  await page.reload();
  await expect(dialog).toBeVisible();
  await dialog.getByRole('button', { name: 'Cancel' }).click();
  await expect(page.locator('#global-error')).toContainText('API key');
  await shot(page, 'key-dismissed');
});

test('with only Basic credentials (--api-auth) the browser answers the challenge and the page asks nothing', async ({ browser, srv }) => {
  const context = await browser.newContext({ httpCredentials: srv.basic });
  const page = await context.newPage();
  const sent: string[] = [];
  page.on('request', (r) => {
    if (new URL(r.url()).pathname.startsWith('/v1/jobs')) sent.push(r.url());
  });
  await page.goto(`${srv.basicWorker}/`);
  await expect(page.locator('#server-summary')).toContainText('worker');
  await fill(page, { prompt: 'a basic cat', steps: 4 });
  await generate(page);
  await expect(page.locator('#results figure img')).toHaveCount(1);
  await expect(page.getByRole('dialog', { name: 'API key' })).toBeHidden();
  expect(sent.length).toBeGreaterThanOrEqual(2);
  await shot(page, 'basic-auth');
  await context.close();
});
