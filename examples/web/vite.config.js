// Builds the page into dist/, which server.mjs serves. `npm run build` (scripts/setup/build_examples.sh runs it).
import { defineConfig } from "vite";

export default defineConfig({
  esbuild: { jsx: "automatic" }, // React's JSX runtime, without a plugin
  build: { outDir: "dist", emptyOutDir: true, target: "es2022", chunkSizeWarningLimit: 2048 },
});
