// The node view of a hive: devices and workers as /v1/devices and /v1/workers give them, jobs per second, and
// live updates when a worker is killed with SIGKILL and restarted by the hive.

import { expect, fill, generate, shot, test } from './fixtures';

test('shows devices and workers and follows a killed worker’s restart', async ({ page, request, srv }) => {
  test.setTimeout(120_000);
  await page.goto(`${srv.nodeHive}/#node`);
  const row = page.locator('#workers-table tbody tr').first();
  await expect(row.locator('[data-col=state]')).toHaveText('ready');
  await expect(row.locator('[data-col=restarts]')).toHaveText('0');
  const device = page.locator('#devices-table tbody tr[data-device="cpu:0"]');
  await expect(device).toBeVisible();
  await expect(device.locator('meter')).toHaveCount(1);
  await expect(device).toContainText(/GiB|MiB/);

  // Jobs per second from the hive's job counters between polls.
  for (let i = 0; i < 4; i++) {
    const r = await request.post(`${srv.nodeHive}/v1/jobs`, { data: { prompt: 'x', steps: 1, width: 64, height: 64 } });
    expect(r.status()).toBe(202);
  }
  await expect(page.locator('#stat-rate')).toHaveText(/^(0\.(0[1-9]|[1-9]\d)|[1-9]\d*\.\d\d)$/, { timeout: 30_000 });
  await expect(page.locator('#stat-jobs')).toContainText('4 ok');
  await shot(page, 'node-before-kill');

  const workers = (await (await request.get(`${srv.nodeHive}/v1/workers`)).json()).workers as { id: string; pid: number }[];
  const { id, pid } = workers[0];
  expect(pid).toBeGreaterThan(0);
  await expect(row).toHaveAttribute('data-worker', id);
  // Every state the row shows from now on, as the page rendered it.
  await page.evaluate(() => {
    const w = window as unknown as { states: string[] };
    w.states = [];
    const body = document.getElementById('node-body')!;
    new MutationObserver(() => {
      const s = body.querySelector('#workers-table tbody tr [data-col=state]')?.textContent;
      if (s && w.states.at(-1) !== s) w.states.push(s);
    }).observe(body, { childList: true, subtree: true });
  });
  process.kill(pid, 'SIGKILL');

  await expect(row.locator('[data-col=restarts]')).toHaveText('1', { timeout: 30_000 });
  await expect(row.locator('[data-col=last-exit]')).toContainText(/signal|SIGKILL|9/);
  await shot(page, 'node-after-kill');
  await expect(row.locator('[data-col=state]')).toHaveText('ready', { timeout: 60_000 });
  const states = await page.evaluate(() => (window as unknown as { states: string[] }).states);
  expect(states.some((s) => s !== 'ready' && s !== 'busy'), `states shown: ${states}`).toBe(true);
  const newPid = (await (await request.get(`${srv.nodeHive}/v1/workers`)).json()).workers[0].pid;
  expect(newPid).not.toBe(pid);
  await shot(page, 'node-restarted');
});

test('a lone worker shows its own panel and generates', async ({ page, srv }) => {
  await page.goto(`${srv.worker}/`);
  await expect(page.getByRole('tab', { name: 'Worker' })).toBeVisible();
  await expect(page.locator('#server-summary')).toContainText('worker');
  await page.getByRole('tab', { name: 'Worker' }).click();
  await expect(page.locator('#stat-worker')).not.toHaveText('–');
  await expect(page.locator('#stat-model')).toContainText('sd1');
  await expect(page.locator('#stat-memory meter')).toHaveCount(1);
  await shot(page, 'worker-panel');
  await page.getByRole('tab', { name: 'Generate' }).click();
  await fill(page, { prompt: 'a lone worker', steps: 4 });
  await generate(page);
  await expect(page.locator('#results figure img')).toHaveCount(1);
});

test('a hive whose admin routes are disabled says so, and a job without workers fails with its words', async ({ page, srv }) => {
  await page.goto(`${srv.openHive}/#node`);
  await expect(page.locator('#node-error')).toContainText('admin routes are disabled');
  await expect(page.locator('#workers-table')).toHaveCount(0);
  await shot(page, 'node-admin-disabled');
  await page.getByRole('tab', { name: 'Generate' }).click();
  await page.getByLabel('Prompt', { exact: true }).fill('nobody home');
  await page.getByRole('button', { name: 'Generate', exact: true }).click();
  await expect(page.locator('#gen-error')).toContainText(/no worker/i);
});
