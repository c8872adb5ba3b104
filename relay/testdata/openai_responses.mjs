// Drives a ComputeFlux relay's Responses API with the official OpenAI Node
// client: responses.create streamed and not, a two-turn
// previous_response_id conversation, and an unknown previous id. Prints one
// JSON object with what it saw.
// Usage: node openai_responses.mjs MODULE_DIR (env: RELAY_URL, API_KEY, MODEL)
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(path.join(process.argv[2], 'node_modules', 'x.js'));
const OpenAI = require('openai').default ?? require('openai');

const client = new OpenAI({ baseURL: process.env.RELAY_URL + '/v1', apiKey: process.env.API_KEY, maxRetries: 0, timeout: 30000 });
const model = process.env.MODEL;
const out = { agents: [] };

const { data: first, response } = await client.responses
  .create({ model, instructions: 'You are terse. '.repeat(60), input: 'Hello' })
  .withResponse();
out.id = first.id;
out.text = first.output_text;
out.agents.push(response.headers.get('x-computeflux-agent'));

const { data: second, response: r2 } = await client.responses
  .create({ model, input: 'And then?', previous_response_id: first.id })
  .withResponse();
out.secondPrev = second.previous_response_id;
out.secondText = second.output_text;
out.secondCached = second.usage?.input_tokens_details?.cached_tokens ?? 0;
out.agents.push(r2.headers.get('x-computeflux-agent'));

const stream = await client.responses.create({ model, input: 'Stream it', stream: true });
out.events = [];
out.streamedText = '';
for await (const ev of stream) {
  out.events.push(ev.type);
  if (ev.type === 'response.output_text.delta') out.streamedText += ev.delta;
  if (ev.type === 'response.completed') out.streamedID = ev.response.id;
}

try {
  await client.responses.create({ model, input: 'x', previous_response_id: 'resp_nobody_has_this' });
  out.missingError = 'none';
} catch (e) {
  out.missingError = `${e.status} ${e.code ?? ''}`.trim();
}

console.log(JSON.stringify(out));
