// Drives a ComputeFlux relay with Anthropic's TypeScript SDK (npm
// @anthropic-ai/sdk): messages.create with a system prompt (twice, the
// second finding the first's prefix cached), messages.stream, a forced tool
// call created and streamed, the tool's result sent back, and the errors
// the SDK types. Prints one JSON object with what it saw.
// Usage: node anthropic_client.mjs MODULE_DIR (env: RELAY_URL, API_KEY, MODEL)
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(path.join(process.argv[2], 'node_modules', 'x.js'));
const sdk = require('@anthropic-ai/sdk');
const Anthropic = sdk.default ?? sdk.Anthropic ?? sdk;

const client = new Anthropic({ baseURL: process.env.RELAY_URL, apiKey: process.env.API_KEY, maxRetries: 0, timeout: 60000 });
const model = process.env.MODEL;
const system = 'You are a terse assistant. ' + 'Answer in one short line. '.repeat(20);
const out = { usage: [] };
const text = (m) => m.content.filter((b) => b.type === 'text').map((b) => b.text).join('');

for (let i = 0; i < 2; i++) {
  const m = await client.messages.create({ model, max_tokens: 8, system, messages: [{ role: 'user', content: 'Hello there' }] });
  out.usage.push(m.usage);
  if (i === 0) {
    out.created = { id: m.id, type: m.type, role: m.role, text: text(m), stop: m.stop_reason };
  }
}

const stream = client.messages.stream({ model, max_tokens: 8, system, messages: [{ role: 'user', content: 'Stream to me' }] });
const events = [];
let deltas = '';
stream.on('text', (t) => { deltas += t; });
for await (const ev of stream) events.push(ev.type);
const streamed = await stream.finalMessage();
out.streamed = { text: text(streamed), deltas, events, stop: streamed.stop_reason, usage: streamed.usage };
out.usage.push(streamed.usage);

const tools = [{
  name: 'get_weather',
  description: 'The weather in a city',
  input_schema: { type: 'object', properties: { city: { enum: ['Paris', 'Oslo'] }, unit: { enum: ['c', 'f'] } }, required: ['city', 'unit'] },
}];
const ask = { role: 'user', content: 'What is the weather in Paris?' };
const call = await client.messages.create({ model, max_tokens: 48, tools, tool_choice: { type: 'tool', name: 'get_weather' }, messages: [ask] });
out.usage.push(call.usage);
const use = call.content.find((b) => b.type === 'tool_use');
out.tool = { stop: call.stop_reason, name: use?.name, input: use?.input, id: use?.id };

const callStream = client.messages.stream({ model, max_tokens: 48, tools, tool_choice: { type: 'tool', name: 'get_weather' }, messages: [ask] });
const streamedCall = await callStream.finalMessage();
out.usage.push(streamedCall.usage);
const suse = streamedCall.content.find((b) => b.type === 'tool_use');
out.streamedTool = { stop: streamedCall.stop_reason, name: suse?.name, input: suse?.input };

const answer = await client.messages.create({
  model, max_tokens: 8, tools,
  messages: [ask, { role: 'assistant', content: call.content }, { role: 'user', content: [{ type: 'tool_result', tool_use_id: use?.id ?? 'x', content: '21 degrees, sunny' }] }],
});
out.usage.push(answer.usage);
out.afterTool = { stop: answer.stop_reason, text: text(answer), types: answer.content.map((b) => b.type) };

try {
  await new Anthropic({ baseURL: process.env.RELAY_URL, apiKey: 'wrong', maxRetries: 0 }).messages.create({ model, max_tokens: 8, messages: [ask] });
  out.authError = 'none';
} catch (e) {
  out.authError = `${e.constructor.name} ${e.status} ${e.error?.error?.type ?? e.error?.type}`;
}
try {
  await client.messages.create({ model: 'no-such-model', max_tokens: 8, messages: [ask] });
  out.modelError = 'none';
} catch (e) {
  out.modelError = `${e.constructor.name} ${e.status} ${e.error?.error?.type}`;
}
console.log(JSON.stringify(out));
