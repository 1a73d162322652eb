// Accessibility: an axe-core pass over every view (no serious or critical violations), and the page driven by
// the keyboard alone.

import AxeBuilder from '@axe-core/playwright';
import type { Page } from '@playwright/test';
import { expect, fill, generate, open, shot, test } from './fixtures';
import { encodePng } from './png';

async function axe(page: Page, what: string): Promise<void> {
  const result = await new AxeBuilder({ page }).withTags(['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa', 'best-practice']).analyze();
  // Serious and critical ones are what the page must not have; it has none of the others either, so any
  // violation fails the pass, with its impact in the report.
  const report = result.violations.map((v) => `${v.id} (${v.impact}): ${v.help}\n  ${v.nodes.map((n) => n.target.join(' ')).join('\n  ')}`);
  expect(report, `axe violations on ${what}`).toEqual([]);
  expect(result.passes.length, 'axe checked something').toBeGreaterThan(10);
}

test('axe finds no violations on any view, light and dark', async ({ page, srv }) => {
  for (const scheme of ['light', 'dark'] as const) {
    await page.emulateMedia({ colorScheme: scheme });
    await open(page);
    await fill(page, { steps: 4 });
    await generate(page);
    await page.getByText('LoRAs', { exact: false }).first().click();
    await page.getByText('Embeddings', { exact: false }).first().click();
    await page.locator('#hires-section summary').click();
    await axe(page, `generate (${scheme})`);
    await shot(page, `a11y-generate-${scheme}`);

    await page.getByRole('radio', { name: 'Inpaint' }).check();
    await page.getByLabel('Image file').setInputFiles({ name: 'i.png', mimeType: 'image/png', buffer: encodePng(64, 64, () => [90, 90, 90]) });
    await expect(page.locator('#mask-canvas')).toBeVisible();
    await axe(page, `inpaint (${scheme})`);
    await page.getByRole('radio', { name: 'txt2img' }).check();

    await page.getByRole('tab', { name: 'Gallery' }).click();
    await axe(page, `gallery (${scheme})`);
    await page.locator('#gallery-grid .thumb').first().click();
    await expect(page.getByRole('dialog')).toBeVisible();
    await axe(page, `image dialog (${scheme})`);
    await page.keyboard.press('Escape');
    await expect(page.getByRole('dialog')).toBeHidden();

    await page.goto(`${srv.nodeHive}/#node`);
    await expect(page.locator('#workers-table')).toBeVisible();
    await axe(page, `node (${scheme})`);
    await shot(page, `a11y-node-${scheme}`);

    await page.goto(`${srv.keyedHive}/`);
    await expect(page.getByRole('dialog', { name: 'API key' })).toBeVisible();
    await axe(page, `key dialog (${scheme})`);
  }
});

test('works from the keyboard', async ({ page }) => {
  await open(page);
  // The first stops: the skip link, then the selected tab.
  await page.keyboard.press('Tab');
  const skip = page.getByRole('button', { name: 'Skip to content' });
  await expect(skip).toBeFocused();
  await expect(skip).toBeInViewport();
  // It skips the header: the next stop is the form's first control.
  await page.keyboard.press('Enter');
  await page.keyboard.press('Tab');
  await expect(page.getByRole('radio', { name: 'txt2img' })).toBeFocused();
  // Back out of the form: the selected tab is the one stop of the tab list.
  await page.keyboard.press('Shift+Tab');
  const generateTab = page.getByRole('tab', { name: 'Generate' });
  await expect(generateTab).toBeFocused();
  await page.keyboard.press('ArrowRight');
  await expect(page.getByRole('tab', { name: 'Gallery' })).toBeFocused();
  await expect(page.getByRole('tab', { name: 'Gallery' })).toHaveAttribute('aria-selected', 'true');
  await expect(page.locator('#panel-gallery')).toBeVisible();
  await page.keyboard.press('End');
  await expect(page.getByRole('tab', { name: 'Node' })).toHaveAttribute('aria-selected', 'true');
  await page.keyboard.press('Home');
  await expect(generateTab).toHaveAttribute('aria-selected', 'true');
  await expect(page.locator('#panel-generate')).toBeVisible();

  // Into the form: mode radios, then the model select, … up to the prompt.
  await page.keyboard.press('Tab');
  await expect(page.getByRole('radio', { name: 'txt2img' })).toBeFocused();
  await page.keyboard.press('ArrowRight');
  await expect(page.getByRole('radio', { name: 'img2img' })).toBeChecked();
  await page.keyboard.press('ArrowLeft');
  await expect(page.getByRole('radio', { name: 'txt2img' })).toBeChecked();
  const prompt = page.getByLabel('Prompt', { exact: true });
  for (let i = 0; i < 6 && !(await prompt.evaluate((el) => el === document.activeElement)); i++) await page.keyboard.press('Tab');
  await expect(prompt).toBeFocused();
  await page.keyboard.type('a keyboard cat');

  // The LoRA picker: open it, reach a LoRA, insert it, back in the prompt.
  await page.keyboard.press('Tab');
  await expect(page.locator('#lora-picker summary')).toBeFocused();
  await page.keyboard.press('Enter');
  await page.keyboard.press('Tab');
  await expect(page.getByLabel('Filter LoRAs')).toBeFocused();
  await page.keyboard.press('Tab');
  await expect(page.getByRole('button', { name: /Insert LoRA sd1_kohya/ })).toBeFocused();
  await page.keyboard.press('Enter');
  await expect(prompt).toBeFocused();
  await expect(prompt).toHaveValue('a keyboard cat <lora:sd1_kohya:1>');
  await expect(page.locator(':focus-visible')).toHaveCount(1);

  // Ctrl+Enter in the prompt generates.
  await prompt.fill('a keyboard cat');
  await page.getByLabel('Steps', { exact: true }).fill('4');
  await page.getByLabel('Width').fill('64');
  await page.getByLabel('Height').fill('64');
  await prompt.focus();
  await page.keyboard.press('Control+Enter');
  await expect(page.locator('#job-status')).toHaveText(/^Done/, { timeout: 30_000 });
  await shot(page, 'keyboard');
});
