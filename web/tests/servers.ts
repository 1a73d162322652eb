// The servers the browser tests run against, started by global-setup.ts and described to the tests through
// environment variables (Playwright passes the runner's environment to its workers).

export interface Servers {
  /** A hive with one CPU worker and no API key: most tests. */
  hive: string;
  /** A hive with `--api-key`: the key flow. */
  keyedHive: string;
  key: string;
  /** A hive whose worker the node-view test kills. */
  nodeHive: string;
  /** A lone `sd-worker-cpu serve`. */
  worker: string;
  /** A lone worker with A1111's `--api-auth` (HTTP Basic) and no API key. */
  basicWorker: string;
  basic: { username: string; password: string };
  /** A hive without workers listening beyond loopback without a key: its admin routes answer 403. */
  openHive: string;
}

export function servers(): Servers {
  const need = (name: string): string => {
    const v = process.env[name];
    if (!v) throw new Error(`${name} is not set: run the tests with \`npx playwright test\` (global-setup starts the servers)`);
    return v;
  };
  return {
    hive: need('SDHIVE_TEST_HIVE'),
    keyedHive: need('SDHIVE_TEST_KEYED_HIVE'),
    key: need('SDHIVE_TEST_KEY'),
    nodeHive: need('SDHIVE_TEST_NODE_HIVE'),
    worker: need('SDHIVE_TEST_WORKER'),
    basicWorker: need('SDHIVE_TEST_BASIC_WORKER'),
    basic: { username: need('SDHIVE_TEST_BASIC_USER'), password: need('SDHIVE_TEST_BASIC_PASSWORD') },
    openHive: need('SDHIVE_TEST_OPEN_HIVE'),
  };
}
