// Drives a ComputeFlux relay with the official OpenAI Node client, streaming
// and not, and prints one JSON object with what it saw.
// Usage: node openai_client.mjs (env: RELAY_URL, API_KEY, MODEL, NODE_PATH-like module dir as argv[2])
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(path.join(process.argv[2], 'node_modules', 'x.js'));
const OpenAI = require('openai').default ?? require('openai');

const client = new OpenAI({ baseURL: process.env.RELAY_URL + '/v1', apiKey: process.env.API_KEY, maxRetries: 0, timeout: 30000 });
const model = process.env.MODEL;
const out = {};

const { data: completion, response } = await client.chat.completions
  .create({ model, messages: [{ role: 'user', content: 'hello' }] }, { headers: { 'X-Session-ID': 'node-session' } })
  .withResponse();
out.content = completion.choices[0].message.content;
out.agent = response.headers.get('x-computeflux-agent');

const stream = await client.chat.completions.create(
  { model, messages: [{ role: 'user', content: 'hello' }], stream: true, prompt_cache_key: 'node-session' });
let streamed = '';
let chunks = 0;
for await (const chunk of stream) {
  chunks++;
  streamed += chunk.choices[0]?.delta?.content ?? '';
}
out.streamed = streamed;
out.chunks = chunks;

const models = await client.models.list();
out.models = models.data.map((m) => m.id);

try {
  await new OpenAI({ baseURL: process.env.RELAY_URL + '/v1', apiKey: 'wrong', maxRetries: 0 }).chat.completions.create({ model, messages: [] });
  out.authError = 'none';
} catch (e) {
  out.authError = `${e.status} ${e.code ?? ''}`.trim();
}

try {
  await client.chat.completions.create({ model: 'no-such-model', messages: [] });
  out.modelError = 'none';
} catch (e) {
  out.modelError = `${e.status} ${e.code ?? ''}`.trim();
}

console.log(JSON.stringify(out));
