// node check.mjs ENTRY_URL: the prebuilt CPU llama.cpp loads (no build, no download).
// A file, not `node -e`: node-llama-cpp forks a test process that inherits execArgv.
const { getLlama } = await import(process.argv[2]);
const llama = await getLlama({ gpu: false, build: "never" });
console.error(`[setup_llamacpp] llama.cpp (${llama.buildType} binary) loads`);
await llama.dispose();
