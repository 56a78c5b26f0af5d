// Builds the watch page into deployments/api/watch_page/ (package data of the Python package), served by the
// ingress at /watch/ (deployments/api/watch.py). `npm run build`; scripts/setup.sh runs it.
import { fileURLToPath } from "node:url";
import { defineConfig } from "vite";

export default defineConfig({
  base: "/watch/",
  build: {
    outDir: fileURLToPath(new URL("../deployments/api/watch_page", import.meta.url)),
    emptyOutDir: true,
    target: "es2022",
    chunkSizeWarningLimit: 1024, // livekit-client is most of the page (~500 kB minified)
  },
});
