// The gallery: results saved in the browser survive a reload, open with their infotext, download as the
// server's PNG (with its `parameters` chunk), and feed the form (seed, img2img); jobs found on the server after
// a reload are followed again or saved.

import { readFileSync } from 'node:fs';
import { expect, fill, generate, lastJobId, open, shot, test } from './fixtures';
import { readPng } from './png';

test('keeps results across a reload, shows infotext and downloads the PNG', async ({ page }) => {
  await open(page);
  await fill(page, { prompt: 'a gallery test', steps: 4, seed: 4242 });
  await generate(page);
  await page.getByRole('button', { name: 'Random' }).click();
  await expect(page.getByLabel('Seed', { exact: true })).toHaveValue('-1');
  await page.getByRole('tab', { name: 'Gallery' }).click();
  await expect(page.locator('#gallery-grid .thumb')).toHaveCount(1);

  await page.reload();
  await expect(page.getByRole('tab', { name: 'Gallery' })).toHaveAttribute('aria-selected', 'true');
  await expect(page.locator('#gallery-grid .thumb')).toHaveCount(1);
  await expect(page.locator('#gallery-count')).toHaveText('1 image');
  await shot(page, 'gallery');

  await page.getByRole('button', { name: /Open image: a gallery test, seed 4242/ }).click();
  const dialog = page.getByRole('dialog', { name: /Image · seed 4242/ });
  await expect(dialog).toBeVisible();
  await expect(dialog.locator('#image-infotext')).toContainText('a gallery test');
  await expect(dialog.locator('#image-infotext')).toContainText('Seed: 4242');
  await shot(page, 'gallery-dialog');

  const [dl] = await Promise.all([page.waitForEvent('download'), dialog.getByRole('button', { name: 'Download PNG' }).click()]);
  expect(dl.suggestedFilename()).toBe('sdhive-4242.png');
  const png = readPng(readFileSync(await dl.path()));
  expect([png.width, png.height]).toEqual([64, 64]);
  expect(png.text.parameters).toContain('a gallery test');
  expect(png.text.parameters).toContain('Seed: 4242');

  // Its seed goes back into the form...
  await dialog.getByRole('button', { name: 'Use seed 4242' }).click();
  await expect(page.getByRole('tab', { name: 'Generate' })).toHaveAttribute('aria-selected', 'true');
  await expect(page.getByLabel('Seed', { exact: true })).toHaveValue('4242');

  // ...and the image into img2img.
  await page.getByRole('tab', { name: 'Gallery' }).click();
  await page.getByRole('button', { name: /Open image: a gallery test/ }).click();
  await dialog.getByRole('button', { name: 'Send to img2img' }).click();
  await expect(page.getByRole('radio', { name: 'img2img' })).toBeChecked();
  await expect(page.locator('#init-hint')).toHaveText('64×64');
  expect(await page.locator('#init-preview').evaluate((el: HTMLImageElement) => el.naturalWidth)).toBe(64);
  await expect(page.getByLabel('Prompt', { exact: true })).toHaveValue('a gallery test');

  // Deleted from the dialog: gone, and still gone after a reload.
  await page.getByRole('tab', { name: 'Gallery' }).click();
  await page.getByRole('button', { name: /Open image: a gallery test/ }).click();
  await dialog.getByRole('button', { name: 'Delete' }).click();
  await expect(page.locator('#gallery-grid .thumb')).toHaveCount(0);
  await page.reload();
  await expect(page.locator('#gallery-count')).toHaveText('0 images');
});

test('follows a running job again after a reload', async ({ page, request }) => {
  await open(page);
  await fill(page, { steps: 150, seed: 9 });
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#job-status')).toHaveText(/Step \d+\/150/, { timeout: 30_000 });
  const id = await lastJobId(page);
  await page.reload();
  // The page finds its job on the server and reads its events again.
  await expect(page.locator('#job-status')).toHaveText(/Step \d+\/150/, { timeout: 30_000 });
  await page.getByRole('button', { name: 'Cancel' }).click();
  await expect(page.locator('#job-status')).toHaveText(/^Cancelled/);
  expect((await (await request.get(`/v1/jobs/${id}`)).json()).state).toBe('cancelled');
});

test('saves a job that finished while the page was closed', async ({ page, request }) => {
  await open(page);
  await fill(page, { prompt: 'finished while away', steps: 40, seed: 31 });
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#job-status')).toHaveText(/Queued|Step/);
  const id = await lastJobId(page);
  await page.goto('about:blank');
  await expect
    .poll(async () => (await (await request.get(`/v1/jobs/${id}`)).json()).state, { timeout: 45_000 })
    .toBe('succeeded');
  await page.goto('/#gallery');
  await expect(page.getByRole('button', { name: /Open image: finished while away, seed 31/ })).toBeVisible();
});
