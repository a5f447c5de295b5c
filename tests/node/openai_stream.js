#!/usr/bin/env node
// Streams one chat completion through the OpenAI-compatible HTTP API with the official `openai`
// npm package.
//
//   node openai_stream.js BASE_URL MODEL PROMPT MAX_TOKENS
//
// BASE_URL is the API root with /v1 (http://127.0.0.1:8000/v1). Prints one JSON line per chunk
// the SDK yields (its parsed object) and exits 0 when the stream ended; 1 on an API error
// (printed to stderr as JSON with the HTTP status); 2 on bad arguments. SPECDEC_API_KEY is sent
// as the bearer key when set.
'use strict';

const { OpenAI } = require('openai');

function usage(message) {
  process.stderr.write(`${message}\nusage: node openai_stream.js BASE_URL MODEL PROMPT MAX_TOKENS\n`);
  process.exit(2);
}

async function main(argv) {
  if (argv.length !== 4) {
    usage(`expected 4 arguments, got ${argv.length}`);
  }
  const [baseURL, model, prompt, maxTokensText] = argv;
  const maxTokens = Number(maxTokensText);
  if (!Number.isInteger(maxTokens) || maxTokens < 1) {
    usage(`MAX_TOKENS must be a positive integer, got ${maxTokensText}`);
  }
  const client = new OpenAI({ baseURL, apiKey: process.env.SPECDEC_API_KEY || 'none', maxRetries: 0 });
  const stream = await client.chat.completions.create({
    model,
    messages: [{ role: 'user', content: prompt }],
    max_tokens: maxTokens,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
  });
  for await (const chunk of stream) {
    process.stdout.write(`${JSON.stringify(chunk)}\n`);
  }
}

main(process.argv.slice(2)).catch((error) => {
  process.stderr.write(`${JSON.stringify({ status: error.status ?? null, message: String(error.message) })}\n`);
  process.exit(1);
});
