// Build config: fixed asset names (the Rust side embeds web/dist and serves /assets/<file>), one JS and one CSS
// file, no inline scripts (the server's CSP allows only 'self'), and a dev server proxying the API to a running
// hive or worker (SDHIVE_DEV_TARGET, default http://127.0.0.1:7833).
import { defineConfig } from 'vite';

const target = process.env.SDHIVE_DEV_TARGET ?? 'http://127.0.0.1:7833';
const proxied = ['/v1', '/sdapi', '/health', '/ready', '/metrics'];

export default defineConfig({
  base: '/',
  build: {
    outDir: 'dist',
    emptyOutDir: true,
    target: 'es2022',
    cssCodeSplit: false,
    modulePreload: { polyfill: false },
    assetsInlineLimit: 0,
    reportCompressedSize: true,
    rollupOptions: {
      output: {
        entryFileNames: 'assets/app.js',
        chunkFileNames: 'assets/[name].js',
        assetFileNames: (info) => (info.names.some((n) => n.endsWith('.css')) ? 'assets/app.css' : 'assets/[name][extname]'),
      },
    },
  },
  server: {
    proxy: Object.fromEntries(proxied.map((p) => [p, { target, changeOrigin: false }])),
  },
});
