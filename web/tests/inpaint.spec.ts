// Inpainting from the page: an uploaded init image, a mask painted on the canvas with the mouse, and the job
// the page sends (init image, a black-and-white mask of the image's size) running on an inpainting model.

import { expect, fill, generate, lastJobId, open, shot, test } from './fixtures';
import { encodePng } from './png';

test('inpaints with a mask drawn on the canvas', async ({ page, request }) => {
  await open(page);
  await fill(page, { prompt: 'a blue door', steps: 8 });
  await page.getByLabel('Model', { exact: true }).selectOption({ label: 'sd1-inpaint.safetensors' });
  await page.getByRole('radio', { name: 'Inpaint' }).check();
  const init = encodePng(64, 64, (x, y) => [x * 4, y * 4, 128]);
  await page.getByLabel('Image file').setInputFiles({ name: 'init.png', mimeType: 'image/png', buffer: init });
  const canvas = page.locator('#mask-canvas');
  await expect(canvas).toBeVisible();
  await expect(page.locator('#init-hint')).toHaveText('64×64');

  // A diagonal stroke across the upper left of the image.
  const box = await canvas.boundingBox();
  if (!box) throw new Error('the mask canvas has no box');
  await page.getByLabel('Brush size').fill('20');
  await page.mouse.move(box.x + box.width * 0.15, box.y + box.height * 0.15);
  await page.mouse.down();
  for (let i = 1; i <= 10; i++) {
    await page.mouse.move(box.x + box.width * (0.15 + i * 0.03), box.y + box.height * (0.15 + i * 0.02));
  }
  await page.mouse.up();
  await shot(page, 'inpaint-mask');

  const sent = page.waitForRequest((r) => r.method() === 'POST' && new URL(r.url()).pathname === '/v1/jobs');
  await generate(page);
  const body = (await sent).postDataJSON() as Record<string, unknown>;
  expect(typeof body.init_image).toBe('string');
  expect(body.model).toBe('sd1-inpaint.safetensors');
  // The mask, decoded by the browser: the init image's size, white where painted, black elsewhere.
  const mask = await page.evaluate(async (url: string) => {
    const img = new Image();
    img.src = url;
    await img.decode();
    const c = document.createElement('canvas');
    c.width = img.naturalWidth;
    c.height = img.naturalHeight;
    const ctx = c.getContext('2d')!;
    ctx.drawImage(img, 0, 0);
    const px = ctx.getImageData(0, 0, c.width, c.height).data;
    let white = 0;
    let black = 0;
    for (let i = 0; i < px.length; i += 4) {
      if (px[i] > 250 && px[i + 1] > 250 && px[i + 2] > 250) white++;
      else if (px[i] < 5 && px[i + 1] < 5 && px[i + 2] < 5) black++;
    }
    // Painted at the stroke's start (about 15 % in), not in the far corner.
    const at = (x: number, y: number) => px[(y * c.width + x) * 4];
    return { width: c.width, height: c.height, white, black, start: at(10, 10), corner: at(60, 60) };
  }, body.mask as string);
  expect([mask.width, mask.height]).toEqual([64, 64]);
  expect(mask.white).toBeGreaterThan(50);
  expect(mask.black).toBeGreaterThan(1000);
  expect(mask.start).toBe(255);
  expect(mask.corner).toBe(0);

  await shot(page, 'inpaint-done');
  const job = await (await request.get(`/v1/jobs/${await lastJobId(page)}`)).json();
  expect(job.state).toBe('succeeded');
  expect(job.request.inpaint).toBe(true);
  expect(job.request.img2img).toBe(true);
  await expect(page.locator('#results figure img')).toHaveCount(1);
});

test('img2img needs an init image, and says so before sending anything', async ({ page }) => {
  await open(page);
  await fill(page, { steps: 4 });
  await page.getByRole('radio', { name: 'img2img' }).check();
  let posted = false;
  page.on('request', (r) => {
    if (r.method() === 'POST' && r.url().endsWith('/v1/jobs')) posted = true;
  });
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#gen-error')).toContainText('needs an init image');
  await expect(page.locator('#gen-error')).toContainText('(field: init_image)');
  expect(posted).toBe(false);
});
