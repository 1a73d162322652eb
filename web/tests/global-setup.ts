// Starts the servers the browser tests use: three hives (plain, with an API key, and one whose worker gets
// killed) each running one CPU worker, and a lone CPU worker, all on the committed tiny fixture models copied into
// a temporary folder. Binaries: SDHIVE_HIVE_BIN (default ../target/debug/hive; it finds sd-worker-cpu beside
// it) and SDHIVE_WORKER_BIN (default: sd-worker-cpu beside the hive). Their logs go to test-results/logs/.

import { spawn, type ChildProcess } from 'node:child_process';
import { cpSync, createWriteStream, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const repo = resolve(here, '../..');
const fixtures = join(repo, 'tests/fixtures/models');
const logs = resolve(here, '../test-results/logs');
const KEY = 'web-test-key-0d5c';
/** A1111's `--api-auth` credentials of the Basic-only worker. */
const BASIC = { username: 'alice', password: 's3cret-pw' };

function prepareModels(root: string): { models: string; loras: string; embeddings: string } {
  const models = join(root, 'models');
  const loras = join(root, 'loras');
  const embeddings = join(root, 'embeddings');
  for (const d of [models, loras, embeddings]) mkdirSync(d, { recursive: true });
  // Each single file has its diffusers folder beside it: its config (the tiny model's own tokenizer).
  for (const name of ['sd1', 'sdxl', 'sd1-inpaint']) {
    cpSync(join(fixtures, `${name}.safetensors`), join(models, `${name}.safetensors`));
    cpSync(join(fixtures, name), join(models, name), { recursive: true });
  }
  for (const f of ['sd1_kohya.safetensors', 'sdxl_kohya.safetensors']) cpSync(join(fixtures, 'Lora', f), join(loras, f));
  for (const f of ['sd1_emb.safetensors', 'sdxl_emb.safetensors']) {
    cpSync(join(fixtures, 'embeddings', f), join(embeddings, f));
  }
  return { models, loras, embeddings };
}

/** Spawns a server and resolves with the URL it prints once listening (`<marker>http://…`). */
function start(
  children: ChildProcess[],
  name: string,
  bin: string,
  args: string[],
  env: NodeJS.ProcessEnv,
  marker: string,
): Promise<string> {
  if (!existsSync(bin)) {
    throw new Error(`${bin} does not exist: build it first (cargo build -p sdhive-hive -p sd-worker-cpu)`);
  }
  const child = spawn(bin, args, { env: { ...cleanEnv(), ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  children.push(child);
  const log = createWriteStream(join(logs, `${name}.log`));
  child.stdout?.pipe(log);
  return new Promise((resolvePromise, reject) => {
    let seen = '';
    const timer = setTimeout(() => reject(new Error(`${name} did not print "${marker}" within 60 s; see ${logs}/${name}.log`)), 60_000);
    child.on('exit', (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`${name} exited (${code ?? signal}) before listening; see ${logs}/${name}.log`));
    });
    let found = false;
    child.stderr?.on('data', (chunk: Buffer) => {
      log.write(chunk);
      if (found) return;
      seen += chunk.toString();
      const at = seen.indexOf(marker);
      const rest = at >= 0 ? seen.slice(at + marker.length) : '';
      // The whole address has arrived once a line break follows it.
      if (at >= 0 && /\s/.test(rest)) {
        found = true;
        clearTimeout(timer);
        child.removeAllListeners('exit');
        resolvePromise(rest.split(/\s/)[0]);
      }
    });
  });
}

/** The runner's environment without credentials that would change what the servers demand. */
function cleanEnv(): NodeJS.ProcessEnv {
  const env = { ...process.env };
  for (const k of ['SDHIVE_API_KEY', 'SDHIVE_API_AUTH', 'API_KEY', 'API_AUTH', 'RUST_LOG']) delete env[k];
  return env;
}

async function waitFor(what: string, check: () => Promise<boolean>, ms = 120_000): Promise<void> {
  const until = Date.now() + ms;
  for (;;) {
    try {
      if (await check()) return;
    } catch {
      // Not up yet.
    }
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 250));
  }
}

async function readyWorkers(url: string, key?: string): Promise<boolean> {
  const res = await fetch(`${url}/v1/workers`, { headers: key ? { Authorization: `Bearer ${key}` } : {} });
  const body = (await res.json()) as { workers?: { state: string }[] };
  return (body.workers ?? []).some((w) => w.state === 'ready');
}

/** The binaries embed web/dist at build time: testing an older build would test an older page. */
async function checkEmbedded(url: string): Promise<void> {
  for (const file of ['index.html', 'assets/app.js', 'assets/app.css']) {
    const built = readFileSync(resolve(here, '../dist', file));
    const served = Buffer.from(await (await fetch(`${url}/${file}`)).arrayBuffer());
    if (!built.equals(served)) {
      throw new Error(`the server's /${file} differs from web/dist/${file}: rebuild the binaries (cargo build -p sdhive-hive -p sd-worker-cpu) after \`npm run build\``);
    }
  }
}

export default async function globalSetup(): Promise<() => Promise<void>> {
  mkdirSync(logs, { recursive: true });
  const children: ChildProcess[] = [];
  const root = mkdtempSync(join(tmpdir(), 'sdhive-web-'));
  const dirs = prepareModels(root);
  const hiveBin = resolve(process.env.SDHIVE_HIVE_BIN ?? join(repo, 'target/debug/hive'));
  const workerBin = resolve(process.env.SDHIVE_WORKER_BIN ?? join(dirname(hiveBin), 'sd-worker-cpu'));
  const env = {
    SDHIVE_DRAIN_GRACE_SECS: '2',
    SDHIVE_STOP_GRACE_SECS: '2',
    SDHIVE_HASH_CACHE: join(root, 'hashes.json'),
    SDHIVE_EMBEDDINGS_DIRS: dirs.embeddings,
  };
  const hiveArgs = [
    'serve', '--bind', '127.0.0.1:0', '--token', 'web-test-token', '--heartbeat-interval', '1', '--cpu', 'always',
    '--backend', 'cpu', '--cpu-workers', '1', '--models-dir', dirs.models, '--lora-dir', dirs.loras,
  ];
  const stop = async () => {
    for (const c of children) if (c.exitCode === null) c.kill('SIGTERM');
    await Promise.all(
      children.map(
        (c) =>
          new Promise<void>((r) => {
            if (c.exitCode !== null || c.signalCode !== null) return r();
            const t = setTimeout(() => {
              c.kill('SIGKILL');
              r();
            }, 8000);
            c.on('exit', () => {
              clearTimeout(t);
              r();
            });
          }),
      ),
    );
    rmSync(root, { recursive: true, force: true });
  };
  try {
    const [hive, keyed, node, worker, openHive, basicWorker] = await Promise.all([
      start(children, 'hive', hiveBin, hiveArgs, env, 'hive listening on '),
      start(children, 'hive-keyed', hiveBin, [...hiveArgs, '--api-key', KEY], env, 'hive listening on '),
      // Restarts wait 3 s, so the node view has time to show the killed worker as not ready.
      start(children, 'hive-node', hiveBin, hiveArgs, { ...env, SDHIVE_RESTART_INITIAL_SECS: '3' }, 'hive listening on '),
      start(
        children,
        'worker',
        workerBin,
        ['serve', '--port', '0', '--models-dir', dirs.models, '--lora-dir', dirs.loras, '--embeddings-dir', dirs.embeddings],
        { HASH_CACHE: join(root, 'hashes.json') },
        'listening on ',
      ),
      // No worker and no models: only its answers matter (403 on admin routes, 503 no_workers on jobs).
      start(children, 'hive-open', hiveBin, ['serve', '--bind', '0.0.0.0:0', '--token', 'web-test-token', '--cpu', 'never'], env, 'hive listening on '),
      // A1111's Basic credentials only (no API key): the browser answers the challenge, the page asks nothing.
      start(
        children,
        'worker-basic',
        workerBin,
        ['serve', '--port', '0', '--models-dir', dirs.models, '--api-auth', `${BASIC.username}:${BASIC.password}`],
        { HASH_CACHE: join(root, 'hashes.json') },
        'listening on ',
      ),
    ]);
    const basicHeader = `Basic ${Buffer.from(`${BASIC.username}:${BASIC.password}`).toString('base64')}`;
    await Promise.all([
      waitFor('the hive’s worker', () => readyWorkers(hive)),
      waitFor('the keyed hive’s worker', () => readyWorkers(keyed, KEY)),
      waitFor('the node hive’s worker', () => readyWorkers(node)),
      waitFor('the lone worker', async () => (await fetch(`${worker}/ready`)).ok),
      waitFor('the Basic-auth worker', async () => (await fetch(`${basicWorker}/ready`, { headers: { Authorization: basicHeader } })).ok),
    ]);
    await checkEmbedded(hive);
    process.env.SDHIVE_TEST_HIVE = hive;
    process.env.SDHIVE_TEST_KEYED_HIVE = keyed;
    process.env.SDHIVE_TEST_KEY = KEY;
    process.env.SDHIVE_TEST_NODE_HIVE = node;
    process.env.SDHIVE_TEST_WORKER = worker;
    process.env.SDHIVE_TEST_BASIC_WORKER = basicWorker;
    process.env.SDHIVE_TEST_BASIC_USER = BASIC.username;
    process.env.SDHIVE_TEST_BASIC_PASSWORD = BASIC.password;
    process.env.SDHIVE_TEST_OPEN_HIVE = openHive.replace('0.0.0.0', '127.0.0.1');
  } catch (e) {
    await stop();
    throw e;
  }
  return stop;
}
