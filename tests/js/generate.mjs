// Greedy generation with transformers.js from a local folder (no hub):
//   node generate.mjs ROOT MODEL_ID DTYPE TEXT STEPS
// ROOT/MODEL_ID holds config.json, tokenizer files and onnx/model_<dtype suffix>.onnx.
// Prints one JSON line: {"input_ids": [...], "tokens": [...]} (the new tokens only).
import { env, AutoTokenizer, AutoModelForCausalLM } from "@huggingface/transformers";

const [root, id, dtype, text, steps] = process.argv.slice(2);
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = root;
const tokenizer = await AutoTokenizer.from_pretrained(id);
const model = await AutoModelForCausalLM.from_pretrained(id, { dtype, device: "cpu" });
const inputs = tokenizer(text, { add_special_tokens: false });
const n = Number(steps);
const out = await model.generate({ ...inputs, max_new_tokens: n, do_sample: false });
const all = Array.from(out.data, Number);
const prompt = Array.from(inputs.input_ids.data, Number);
console.log(JSON.stringify({ input_ids: prompt, tokens: all.slice(prompt.length) }));
