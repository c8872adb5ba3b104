// An OpenAI-compatible llama.cpp engine on CPU, over node-llama-cpp: serves
// one GGUF model on loopback the way llama.cpp's own server does, for tests
// and benchmarks that need real inference.
//
// Usage: node server.mjs --model FILE [--name NAME] [--host 127.0.0.1]
//        [--port 0] [--ctx 2048] [--parallel 2] [--threads 1] [--no-prompt-cache]
// Prints one line of JSON to stdout when it listens: {"listening":"HOST:PORT"}.
//
// Routes: POST /v1/chat/completions and /v1/completions (streamed or not;
// temperature 0 unless the request sets one; seed, top_p, top_k, min_p,
// stop, max_tokens, logprobs and top_logprobs honoured), GET /v1/models, /health, /props, /slots, /metrics
// (llama.cpp's llamacpp:* names). Errors are OpenAI error JSON.
//
// The prompt cache, as llama.cpp's server keeps it (cache_prompt, on by
// default): each sequence keeps what it last evaluated, prompt and answer. A
// request takes the free sequence that holds the longest prefix of its
// prompt, evaluates only the rest, and reports the prefix reused as
// usage.prompt_tokens_details.cached_tokens. "cache_prompt": false in a
// request, or --no-prompt-cache, evaluates the whole prompt.
//
// Tools: a chat request whose tool_choice is "required" (the first tool) or
// names a function gets a call of it, its arguments generated under a
// grammar of the function's JSON schema, as llama.cpp's server constrains
// a forced call; "auto" and "none" answer in text (a model this small never
// starts a call of its own).
import http from 'node:http';
import { parseArgs } from 'node:util';
import { getLlama, LlamaLogLevel, LlamaGrammarEvaluationState } from 'node-llama-cpp';

const { values: opt } = parseArgs({
  options: {
    model: { type: 'string' },
    name: { type: 'string' },
    host: { type: 'string', default: '127.0.0.1' },
    port: { type: 'string', default: '0' },
    ctx: { type: 'string', default: '2048' },
    parallel: { type: 'string', default: '2' },
    threads: { type: 'string', default: '1' },
    'no-prompt-cache': { type: 'boolean', default: false },
  },
});
if (!opt.model) {
  console.error('server.mjs: --model FILE is required');
  process.exit(2);
}
const name = opt.name || opt.model.split('/').pop();
const parallel = Math.max(1, Number(opt.parallel));
const ctxSize = Number(opt.ctx);

// One thread: ggml's worker threads spin while they wait, which on a shared
// machine costs far more than it gains for a tiny model.
const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.error });
const model = await llama.loadModel({ modelPath: opt.model });
const context = await model.createContext({ contextSize: ctxSize * parallel, sequences: parallel, threads: Number(opt.threads) });
const perSeq = ctxSize;

// A pool of sequences: a request takes one or waits its turn.
const free = [];
for (let i = 0; i < parallel; i++) free.push(context.getSequence());
const waiting = [];
let processing = 0;
let promptTotal = 0;
let predictedTotal = 0;

// acquire takes the free sequence holding the longest prefix of tokens, or
// waits for the next one released.
async function acquire(tokens) {
  if (free.length > 0) {
    let best = 0;
    let bestLen = -1;
    for (let i = 0; i < free.length; i++) {
      const n = free[i].compareContextTokens(tokens).firstDifferentIndex;
      if (n > bestLen) [best, bestLen] = [i, n];
    }
    return free.splice(best, 1)[0];
  }
  return new Promise((resolve) => waiting.push(resolve));
}

// reuse keeps the prefix of tokens seq holds (all but the last token, which
// must be evaluated to sample from) and erases the rest of its history. It
// returns the tokens kept.
async function reuse(seq, tokens, cache) {
  const keep = cache ? Math.min(seq.compareContextTokens(tokens).firstDifferentIndex, tokens.length - 1) : 0;
  if (keep === 0) await seq.clearHistory();
  else if (keep < seq.nextTokenIndex) await seq.eraseContextTokenRanges([{ start: keep, end: seq.nextTokenIndex }]);
  return keep;
}

async function release(seq) {
  const next = waiting.shift();
  if (next) next(seq);
  else free.push(seq);
}

class HTTPError extends Error {
  constructor(status, type, message, code) {
    super(message);
    this.status = status;
    this.type = type;
    this.code = code;
  }
}

function sendJSON(res, status, obj) {
  const body = JSON.stringify(obj);
  res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(body) });
  res.end(body);
}

function sendError(res, err) {
  const status = err.status || 500;
  sendJSON(res, status, { error: { message: err.message, type: err.type || 'server_error', param: null, code: err.code || null } });
}

async function readBody(req) {
  const chunks = [];
  let size = 0;
  for await (const c of req) {
    size += c.length;
    if (size > 8 << 20) throw new HTTPError(413, 'invalid_request_error', 'request body over 8 MiB');
    chunks.push(c);
  }
  try {
    return JSON.parse(Buffer.concat(chunks).toString('utf8'));
  } catch (e) {
    throw new HTTPError(400, 'invalid_request_error', `request body is not JSON: ${e.message}`);
  }
}

// The chat template: "ROLE: CONTENT\n" per message, then "assistant:".
function render(body, chat) {
  if (!chat) {
    if (typeof body.prompt !== 'string') throw new HTTPError(400, 'invalid_request_error', "'prompt' must be a string");
    return body.prompt;
  }
  if (!Array.isArray(body.messages) || body.messages.length === 0) {
    throw new HTTPError(400, 'invalid_request_error', "'messages' must be a non-empty array");
  }
  let text = '';
  for (const m of body.messages) {
    let content = m.content;
    if (Array.isArray(content)) content = content.map((p) => (p && p.type === 'text' ? p.text : '')).join('');
    if (typeof content !== 'string') content = '';
    if (Array.isArray(m.tool_calls)) content += JSON.stringify(m.tool_calls);
    text += `${m.role}: ${content}\n`;
  }
  return text + 'assistant:';
}

// The function a chat request forces a call of: tool_choice "required"
// (the first tool) or a named function; null for a text answer.
function forcedTool(body) {
  const tools = Array.isArray(body.tools) ? body.tools.filter((t) => t && t.function && typeof t.function.name === 'string') : [];
  const choice = body.tool_choice;
  if (tools.length === 0 || choice == null || choice === 'auto' || choice === 'none') return null;
  if (choice === 'required') return tools[0].function;
  const name = choice && choice.function && choice.function.name;
  const t = tools.find((x) => x.function.name === name);
  if (!t) throw new HTTPError(400, 'invalid_request_error', `tool_choice names ${JSON.stringify(name)}, which is not among the tools`);
  return t.function;
}

const grammars = new Map(); // JSON schema text -> grammar
async function grammarFor(schema) {
  const key = JSON.stringify(schema ?? { type: 'object' });
  if (!grammars.has(key)) {
    try {
      grammars.set(key, await llama.createGrammarForJsonSchema(schema ?? { type: 'object' }));
    } catch (e) {
      throw new HTTPError(400, 'invalid_request_error', `the tool's parameters are not a JSON schema this engine takes: ${e.message}`);
    }
  }
  return grammars.get(key);
}

function completeJSON(text) {
  try {
    JSON.parse(text);
    return true;
  } catch {
    return false;
  }
}

function tokenText(t) {
  return model.detokenize([t]);
}

async function complete(req, res, chat) {
  const body = await readBody(req);
  const prompt = render(body, chat);
  const maxTokens = Number(body.max_completion_tokens ?? body.max_tokens ?? 64);
  if (!Number.isInteger(maxTokens) || maxTokens < 1) throw new HTTPError(400, 'invalid_request_error', "'max_tokens' must be a positive integer");
  const tokens = model.tokenize(prompt);
  if (tokens.length + maxTokens > perSeq) {
    throw new HTTPError(400, 'invalid_request_error', `the request needs ${tokens.length + maxTokens} tokens, the context holds ${perSeq}`, 'context_length_exceeded');
  }
  const temperature = Number(body.temperature ?? 0);
  const wantLogprobs = chat ? body.logprobs === true : body.logprobs != null;
  const topN = chat ? Number(body.top_logprobs ?? 0) : Number(body.logprobs ?? 0);
  const stream = body.stream === true;
  const stops = (Array.isArray(body.stop) ? body.stop : body.stop != null ? [body.stop] : []).filter((x) => typeof x === 'string' && x !== '');
  const includeUsage = stream && body.stream_options && body.stream_options.include_usage === true;
  const tool = chat ? forcedTool(body) : null;
  const grammar = tool ? await grammarFor(tool.parameters) : null;
  const callID = 'call_' + Math.random().toString(36).slice(2);
  const id = (chat ? 'chatcmpl-' : 'cmpl-') + Math.random().toString(36).slice(2);
  const created = Math.floor(Date.now() / 1000);
  const object = chat ? (stream ? 'chat.completion.chunk' : 'chat.completion') : 'text_completion';

  const cache = !opt['no-prompt-cache'] && body.cache_prompt !== false;
  const seq = await acquire(tokens);
  processing++;
  let cached = 0;
  let aborted = false;
  res.on('close', () => {
    if (!res.writableFinished) aborted = true;
  });
  const out = [];
  const logprobs = [];
  let text = '';
  let stopped = false;
  let sentCall = false;
  try {
    if (stream) {
      res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache' });
      if (chat) sse(res, { id, object, created, model: name, choices: [{ index: 0, delta: { role: 'assistant', content: '' }, finish_reason: null }] });
    }
    const options = {
      temperature,
      seed: body.seed != null ? Number(body.seed) : undefined,
      topP: body.top_p != null ? Number(body.top_p) : undefined,
      topK: body.top_k != null ? Number(body.top_k) : undefined,
      minP: body.min_p != null ? Number(body.min_p) : undefined,
    };
    if (grammar) options.grammarEvaluationState = new LlamaGrammarEvaluationState({ model, grammar });
    cached = await reuse(seq, tokens, cache);
    const rest = tokens.slice(cached);
    const it = wantLogprobs
      ? seq.evaluateWithMetadata(rest, { probabilities: true }, options)
      : seq.evaluate(rest, options);
    for await (const item of it) {
      const t = wantLogprobs ? item.token : item;
      out.push(t);
      let full = model.detokenize(out);
      const hit = stops.map((x) => full.indexOf(x)).filter((i) => i >= 0);
      if (hit.length > 0) {
        full = full.slice(0, Math.min(...hit));
        stopped = true;
      }
      const piece = full.slice(text.length);
      text = full;
      let lp = null;
      if (wantLogprobs) {
        const top = [];
        let chosen = -Infinity;
        for (const [tok, p] of item.probabilities) {
          if (tok === t) chosen = Math.log(p);
          if (top.length < topN) top.push({ token: tokenText(tok), logprob: Math.log(p) });
        }
        lp = { token: tokenText(t), logprob: chosen, bytes: [...Buffer.from(tokenText(t))], top_logprobs: top };
        logprobs.push(lp);
      }
      if (tool && completeJSON(text)) stopped = true; // the call's arguments are whole
      if (stream && piece !== '' && tool) {
        const call = { index: 0, function: { arguments: piece } };
        if (!sentCall) Object.assign(call, { id: callID, type: 'function', function: { name: tool.name, arguments: piece } });
        sentCall = true;
        sse(res, { id, object, created, model: name, choices: [{ index: 0, delta: { tool_calls: [call] }, finish_reason: null }] });
      } else if (stream && piece !== '') {
        const choice = chat ? { index: 0, delta: { content: piece }, finish_reason: null } : { index: 0, text: piece, finish_reason: null };
        if (lp) choice.logprobs = { content: [lp] };
        sse(res, { id, object, created, model: name, choices: [choice] });
      }
      if (aborted || stopped || out.length >= maxTokens) break;
    }
  } finally {
    processing--;
    promptTotal += tokens.length - cached;
    predictedTotal += out.length;
    await release(seq);
  }
  if (aborted) return;
  let finish = out.length >= maxTokens && !stopped ? 'length' : 'stop';
  if (tool && finish === 'stop') finish = 'tool_calls';
  const usage = { prompt_tokens: tokens.length, completion_tokens: out.length, total_tokens: tokens.length + out.length, prompt_tokens_details: { cached_tokens: cached } };
  if (stream) {
    const last = chat ? { index: 0, delta: {}, finish_reason: finish } : { index: 0, text: '', finish_reason: finish };
    sse(res, { id, object, created, model: name, choices: [last] });
    if (includeUsage) sse(res, { id, object, created, model: name, choices: [], usage });
    res.end('data: [DONE]\n\n');
    return;
  }
  const message = tool
    ? { role: 'assistant', content: null, tool_calls: [{ id: callID, type: 'function', function: { name: tool.name, arguments: text } }] }
    : { role: 'assistant', content: text };
  const choice = chat ? { index: 0, message, finish_reason: finish } : { index: 0, text, finish_reason: finish };
  if (wantLogprobs) choice.logprobs = { content: logprobs };
  sendJSON(res, 200, { id, object, created, model: name, choices: [choice], usage });
}

function sse(res, obj) {
  res.write(`data: ${JSON.stringify(obj)}\n\n`);
}

function metrics() {
  return [
    '# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.',
    '# TYPE llamacpp:prompt_tokens_total counter',
    `llamacpp:prompt_tokens_total ${promptTotal}`,
    '# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.',
    '# TYPE llamacpp:tokens_predicted_total counter',
    `llamacpp:tokens_predicted_total ${predictedTotal}`,
    '# HELP llamacpp:requests_processing Number of requests processing.',
    '# TYPE llamacpp:requests_processing gauge',
    `llamacpp:requests_processing ${processing}`,
    '# HELP llamacpp:requests_deferred Number of requests deferred.',
    '# TYPE llamacpp:requests_deferred gauge',
    `llamacpp:requests_deferred ${waiting.length}`,
    '',
  ].join('\n');
}

const server = http.createServer(async (req, res) => {
  try {
    const path = req.url.split('?')[0];
    if (req.method === 'POST' && path === '/v1/chat/completions') return await complete(req, res, true);
    if (req.method === 'POST' && path === '/v1/completions') return await complete(req, res, false);
    if (req.method === 'GET' && path === '/v1/models') {
      return sendJSON(res, 200, { object: 'list', data: [{ id: name, object: 'model', created: 0, owned_by: 'llamacpp' }] });
    }
    if (req.method === 'GET' && path === '/health') return sendJSON(res, 200, { status: 'ok' });
    if (req.method === 'GET' && path === '/props') {
      return sendJSON(res, 200, { default_generation_settings: { n_ctx: perSeq }, total_slots: parallel, build_info: `node-llama-cpp-${llama.llamaCppRelease.release}` });
    }
    if (req.method === 'GET' && path === '/slots') {
      const slots = [];
      for (let i = 0; i < parallel; i++) slots.push({ id: i, n_ctx: perSeq, is_processing: i < processing });
      return sendJSON(res, 200, slots);
    }
    if (req.method === 'GET' && path === '/metrics') {
      res.writeHead(200, { 'Content-Type': 'text/plain; version=0.0.4' });
      return res.end(metrics());
    }
    throw new HTTPError(404, 'invalid_request_error', `no route ${req.method} ${path}`);
  } catch (err) {
    if (res.headersSent) {
      res.destroy(err);
      return;
    }
    sendError(res, err instanceof HTTPError ? err : new HTTPError(500, 'server_error', String(err && err.message)));
  }
});

server.listen(Number(opt.port), opt.host, () => {
  const a = server.address();
  process.stdout.write(JSON.stringify({ listening: `${a.address}:${a.port}`, model: name }) + '\n');
});

for (const sig of ['SIGTERM', 'SIGINT']) {
  process.on(sig, () => {
    server.close();
    process.exit(0);
  });
}
