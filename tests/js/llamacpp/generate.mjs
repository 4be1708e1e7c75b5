// Greedy generation with llama.cpp (node-llama-cpp's prebuilt CPU binary) for embedq's
// tests and bench. Usage: node generate.mjs SPEC.json  (the JSON result on stdout)
//   SPEC: {"entry": file URL of node-llama-cpp's dist/index.js (scripts/setup_llamacpp.sh),
//          "models": [path], "prompts": [str], "max_tokens": n, "threads": n, "repeat": n}
// Models run in turn, "repeat" rounds (interleaved, for the bench); one thread by default:
// on a loaded machine llama.cpp's spinning thread barriers make 2 threads 10x slower.
// Per prompt: BOS + tokenize(prompt) (node-llama-cpp's tokenize adds no BOS), then
// temperature-0 tokens until max_tokens or an end-of-generation token. "decode_tps" is
// generated tokens after the first / seconds since the first (prompt evaluation excluded).
import { readFileSync } from "node:fs";

const spec = JSON.parse(readFileSync(process.argv[2], "utf8"));
const { getLlama, LlamaLogLevel } = await import(spec.entry);
const threads = spec.threads ?? 1;
const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error,
                               maxThreads: threads });
const runs = [];
for (let round = 0; round < (spec.repeat ?? 1); round++) {
    for (const path of spec.models) {
        const model = await llama.loadModel({ modelPath: path });
        const context = await model.createContext({ contextSize: spec.context_size ?? 256, threads });
        runs.push({ model: path, round, results: await generate(model, context) });
        await context.dispose();
        await model.dispose();
    }
}
await llama.dispose();
process.stdout.write(JSON.stringify({ runs }) + "\n");

async function generate(model, context) {
  const results = [];
  for (const prompt of spec.prompts) {
    const sequence = context.getSequence();
    const input = [model.tokens.bos, ...model.tokenize(prompt)];
    const tokens = [];
    let t1 = null;
    const t0 = performance.now();
    for await (const token of sequence.evaluate(input, { temperature: 0 })) {
        if (t1 === null) t1 = performance.now();
        if (model.isEogToken(token)) break;
        tokens.push(token);
        if (tokens.length >= spec.max_tokens) break;
    }
    const t2 = performance.now();
    results.push({ prompt, prompt_tokens: input.length, tokens, text: model.detokenize(tokens),
                   first_token_s: (t1 - t0) / 1000,
                   decode_tps: tokens.length > 1 ? (tokens.length - 1) / ((t2 - t1) / 1000) : null });
    sequence.dispose();
  }
  return results;
}
