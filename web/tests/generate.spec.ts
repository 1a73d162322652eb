// Generating from the page: live step progress with previews and the final image; cancelling a long job;
// switching the model; a LoRA from the picker; errors worded as the API words them, naming the field.

import { expect, fill, generate, lastJobId, open, shot, test } from './fixtures';

test('generates with live step progress, previews and the final image', async ({ page, request, pageErrors }) => {
  await open(page);
  await shot(page, 'generate-empty');
  await fill(page, { prompt: 'a red fox in the snow', steps: 48, seed: 777, previewEvery: 1 });
  // Everything the progress region shows while the job runs, as the page rendered it.
  await page.evaluate(() => {
    const w = window as unknown as { seen: { status: string[]; values: number[]; previews: number; eta: string[] } };
    w.seen = { status: [], values: [], previews: 0, eta: [] };
    const status = document.getElementById('job-status')!;
    const eta = document.getElementById('job-eta')!;
    new MutationObserver(() => w.seen.eta.push(eta.textContent ?? '')).observe(eta, { childList: true, characterData: true, subtree: true });
    const bar = document.getElementById('progress')!;
    const preview = document.getElementById('preview') as HTMLImageElement;
    new MutationObserver(() => w.seen.status.push(status.textContent ?? '')).observe(status, { childList: true, characterData: true, subtree: true });
    new MutationObserver(() => w.seen.values.push(Number(bar.getAttribute('aria-valuenow')))).observe(bar, { attributes: true, attributeFilter: ['aria-valuenow'] });
    new MutationObserver(() => preview.src.startsWith('data:image/png') && w.seen.previews++).observe(preview, { attributes: true, attributeFilter: ['src'] });
  });
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#job-status')).toHaveText(/Step \d+\/48/);
  await shot(page, 'generate-progress');
  await expect(page.locator('#job-status')).toHaveText(/^Done/, { timeout: 45_000 });
  await shot(page, 'generate-done');

  const seen = await page.evaluate(() => (window as unknown as { seen: { status: string[]; values: number[]; previews: number; eta: string[] } }).seen);
  expect(seen.eta.some((e) => /^ETA \d/.test(e)), `ETAs shown: ${seen.eta.join(' | ')}`).toBe(true);
  const steps = seen.status.map((s) => /Step (\d+)\/48/.exec(s)?.[1]).filter(Boolean).map(Number);
  expect(steps.length, `step updates seen: ${seen.status.join(' | ')}`).toBeGreaterThanOrEqual(3);
  expect(steps).toEqual([...steps].sort((a, b) => a - b));
  expect(seen.values.some((v) => v > 0 && v < 100), `intermediate progress values: ${seen.values}`).toBe(true);
  expect(await page.getByRole('progressbar').getAttribute('aria-valuenow')).toBe('100');
  expect(seen.previews, 'preview images from `preview` events').toBeGreaterThanOrEqual(2);

  const img = page.locator('#results figure img').first();
  await expect(img).toBeVisible();
  const size = await img.evaluate(async (el: HTMLImageElement) => {
    await el.decode();
    return [el.naturalWidth, el.naturalHeight];
  });
  expect(size).toEqual([64, 64]);
  await expect(page.locator('#results .infotext').first()).toContainText('a red fox in the snow');
  await expect(page.locator('#results .infotext').first()).toContainText('Seed: 777');

  const job = await (await request.get(`/v1/jobs/${await lastJobId(page)}`)).json();
  expect(job.state).toBe('succeeded');
  expect(job.request.steps).toBe(48);
  expect(pageErrors).toEqual([]);
});

test('cancels a long job', async ({ page, request }) => {
  await open(page);
  await fill(page, { steps: 150, seed: 1 });
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#job-status')).toHaveText(/Step ([2-9]|\d\d+)\/150/, { timeout: 30_000 });
  await page.getByRole('button', { name: 'Cancel' }).click();
  await expect(page.locator('#job-status')).toHaveText(/^Cancelled after step \d+/);
  await shot(page, 'cancelled');
  const job = await (await request.get(`/v1/jobs/${await lastJobId(page)}`)).json();
  expect(job.state).toBe('cancelled');
  expect(job.step).toBeLessThan(150);
  await expect(page.getByRole('button', { name: 'Cancel' })).toBeDisabled();
});

test('switches the model with the model select', async ({ page, request }) => {
  await open(page);
  await fill(page, { prompt: 'a lighthouse', steps: 4 });
  await page.getByLabel('Model', { exact: true }).selectOption({ label: 'sdxl.safetensors' });
  await generate(page);
  await expect(page.locator('#results .infotext').first()).toContainText('Model: sdxl');
  const job = await (await request.get(`/v1/jobs/${await lastJobId(page)}`)).json();
  expect(job.request.model).toBe('sdxl.safetensors');
  await shot(page, 'model-sdxl');
  // The choice persists across a reload.
  await page.reload();
  await open(page);
  await expect(page.getByLabel('Model', { exact: true })).toHaveValue('sdxl.safetensors');
});

test('inserts a LoRA from the picker and generates with it', async ({ page, request }) => {
  await open(page);
  await fill(page, { prompt: 'a castle', steps: 4 });
  await page.getByLabel('Model', { exact: true }).selectOption({ label: 'sd1.safetensors' });
  await page.getByText('LoRAs', { exact: false }).first().click();
  await page.getByRole('button', { name: /Insert LoRA sd1_kohya/ }).click();
  await expect(page.getByLabel('Prompt', { exact: true })).toHaveValue('a castle <lora:sd1_kohya:1>');
  await shot(page, 'lora-picker');
  await generate(page);
  const info = page.locator('#results .infotext').first();
  await expect(info).toContainText('<lora:sd1_kohya:1>');
  await expect(info).toContainText('Lora hashes: "sd1_kohya:');
  const job = await (await request.get(`/v1/jobs/${await lastJobId(page)}`)).json();
  expect(job.images[0].infotext).toContain('Lora hashes');
});

test('shows the API’s errors, naming the field', async ({ page }) => {
  await open(page);
  await fill(page, { steps: 4 });
  await page.getByLabel('Steps', { exact: true }).fill('0');
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  const error = page.locator('#gen-error');
  await expect(error).toContainText('invalid `steps`');
  await expect(error).toContainText('(field: steps)');
  await expect(page.getByLabel('Steps', { exact: true })).toHaveAttribute('aria-invalid', 'true');
  await shot(page, 'error-400');

  // A job the engine refuses once queued fails through its `failed` event: an SDXL LoRA on an SD1 model.
  await page.getByLabel('Steps', { exact: true }).fill('4');
  await page.getByLabel('Model', { exact: true }).selectOption({ label: 'sd1.safetensors' });
  await page.getByLabel('Prompt', { exact: true }).fill('a cat <lora:sdxl_kohya:1>');
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#job-status')).toHaveText('Failed.', { timeout: 30_000 });
  await expect(error).toContainText('sdxl_kohya');
  await expect(error).toContainText('(field: loras)');
  await expect(page.getByLabel('Steps', { exact: true })).not.toHaveAttribute('aria-invalid', 'true');
});

test('shows the queue position, then runs the job when the queue moves', async ({ page, request }) => {
  await open(page);
  // Two long jobs ahead of the page's (the hive hands a worker two at a time; the second waits there).
  const ahead: string[] = [];
  for (let i = 0; i < 3; i++) {
    const r = await request.post('/v1/jobs', { data: { prompt: 'ahead', steps: 150, width: 64, height: 64 } });
    expect(r.status()).toBe(202);
    ahead.push((await r.json()).id);
  }
  await fill(page, { steps: 4 });
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#job-status')).toHaveText(/^Queued: [1-9]\d* jobs? ahead\.$/);
  await shot(page, 'queued');
  for (const id of ahead) await request.post(`/v1/jobs/${id}/cancel`);
  await expect(page.locator('#job-status')).toHaveText(/^Done/, { timeout: 45_000 });
});

test('a batch with a random seed, then reuse of its seed', async ({ page }) => {
  await open(page);
  await fill(page, { steps: 4, n: 2 });
  await page.getByRole('button', { name: 'Random' }).click();
  await generate(page);
  const figures = page.locator('#results figure');
  await expect(figures).toHaveCount(2);
  const seeds = await figures.evaluateAll((els) => els.map((e) => Number(e.getAttribute('data-seed'))));
  expect(seeds[1]).toBe(seeds[0] + 1);
  await expect(page.getByLabel('Seed', { exact: true })).toHaveValue('-1');
  await page.getByRole('button', { name: 'Reuse last' }).click();
  await expect(page.getByLabel('Seed', { exact: true })).toHaveValue(String(seeds[0]));
  await expect(figures.first().locator('.infotext')).toContainText(`Seed: ${seeds[0]}`);
});

test('hires fix makes the second pass at the larger size', async ({ page, request }) => {
  await open(page);
  await fill(page, { steps: 3 });
  await page.locator('#hires-section summary').click();
  await page.getByLabel('Enable hires fix').check();
  await page.getByLabel('Upscaler').selectOption('Latent');
  await page.getByLabel('Hires steps').fill('2');
  await page.getByLabel('Denoising', { exact: true }).fill('0.5');
  await generate(page);
  const size = await page.locator('#results figure img').first().evaluate(async (el: HTMLImageElement) => {
    await el.decode();
    return [el.naturalWidth, el.naturalHeight];
  });
  expect(size).toEqual([128, 128]);
  const job = await (await request.get(`/v1/jobs/${await lastJobId(page)}`)).json();
  expect(job.images[0].infotext).toContain('Hires upscale: 2');
  expect(job.images[0].infotext).toContain('Denoising strength: 0.5');
});
