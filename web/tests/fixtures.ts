// What every browser test shares: the servers, a page that fails the test on any uncaught page error, and
// helpers that drive the Generate form the way a user does.

import { test as base, expect, type Page } from '@playwright/test';
import { servers, type Servers } from './servers';

export const test = base.extend<{ srv: Servers; pageErrors: string[] }>({
  srv: async ({}, use) => {
    await use(servers());
  },
  baseURL: async ({}, use) => {
    await use(servers().hive);
  },
  pageErrors: async ({ page }, use) => {
    const errors: string[] = [];
    page.on('pageerror', (e) => errors.push(e.message));
    await use(errors);
    expect(errors, 'uncaught errors in the page').toEqual([]);
  },
});

export { expect };

export async function shot(page: Page, name: string): Promise<void> {
  await page.screenshot({ path: `test-results/screens/${name}.png`, fullPage: true });
}

/** Opens the page and waits until the form holds the server's lists. */
export async function open(page: Page, url = '/'): Promise<void> {
  await page.goto(url);
  await expect(page.locator('#sampler option')).not.toHaveCount(0);
  await expect(page.locator('#server-summary')).not.toBeEmpty();
}

export interface Params {
  prompt?: string;
  size?: number;
  steps?: number;
  seed?: number;
  n?: number;
  previewEvery?: number;
}

/** Fills the form's usual fields (tiny sizes: the fixture models generate fast at 64×64). */
export async function fill(page: Page, p: Params = {}): Promise<void> {
  await page.getByLabel('Prompt', { exact: true }).fill(p.prompt ?? 'a photo of a cat');
  await page.getByLabel('Width').fill(String(p.size ?? 64));
  await page.getByLabel('Height').fill(String(p.size ?? 64));
  await page.getByLabel('Steps', { exact: true }).fill(String(p.steps ?? 6));
  await page.getByLabel('Seed', { exact: true }).fill(String(p.seed ?? 1234));
  await page.getByLabel('Batch size').fill(String(p.n ?? 1));
  if (p.previewEvery !== undefined) {
    await page.getByText('Settings', { exact: true }).click();
    await page.getByLabel(/Preview every/).fill(String(p.previewEvery));
  }
}

/** The id of the latest job this page submitted (the page tracks them in localStorage). */
export async function lastJobId(page: Page): Promise<string> {
  const id = await page.evaluate(() => {
    const list = JSON.parse(localStorage.getItem('sdhive.jobs') ?? '[]') as { id: string }[];
    return list.at(-1)?.id ?? null;
  });
  expect(id, 'the page tracks the job it submitted').toBeTruthy();
  return id as string;
}

/** Clicks Generate and waits for the job to end with the status given. */
export async function generate(page: Page, status: RegExp = /^Done/): Promise<void> {
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#job-status')).toHaveText(status, { timeout: 45_000 });
}
