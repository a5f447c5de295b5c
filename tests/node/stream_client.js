#!/usr/bin/env node
// Streams one generation from specdec.v1.GenerationService/GenerateStream.
//
//   node stream_client.js ADDRESS PROMPT MAX_NEW_TOKENS [REQUEST_ID]
//
// Prints one JSON line per GenerateStreamResponse (proto field names, enums
// as names, 64-bit integers as strings) and exits 0 once the message with
// is_final has arrived and the call ended OK; 1 on a gRPC error (printed to
// stderr as JSON with the status name) or a stream that ended without a
// final message; 2 on bad arguments. SPECDEC_CLIENT_TIMEOUT_S bounds the call.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const GATEWAY_PROTO = 'specdec/v1/gateway.proto';
const DEFAULT_TIMEOUT_S = 600;

function usage(message) {
  process.stderr.write(`${message}\nusage: node stream_client.js ADDRESS PROMPT MAX_NEW_TOKENS [REQUEST_ID]\n`);
  process.exit(2);
}

function parseArgs(argv) {
  if (argv.length < 3 || argv.length > 4) {
    usage(`expected 3 or 4 arguments, got ${argv.length}`);
  }
  const [address, prompt, maxNewTokensText, requestId = ''] = argv;
  const maxNewTokens = Number(maxNewTokensText);
  if (!Number.isInteger(maxNewTokens) || maxNewTokens < 0) {
    usage(`MAX_NEW_TOKENS must be a non-negative integer, got ${JSON.stringify(maxNewTokensText)}`);
  }
  return { address, prompt, maxNewTokens, requestId };
}

function loadService() {
  const definition = protoLoader.loadSync(GATEWAY_PROTO, {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // print proto field names (token_ids, is_final), as the Python side sees them
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).specdec.v1.GenerationService;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const GenerationService = loadService();
  const client = new GenerationService(args.address, grpc.credentials.createInsecure());
  const timeoutS = Number(process.env.SPECDEC_CLIENT_TIMEOUT_S || DEFAULT_TIMEOUT_S);
  const call = client.GenerateStream(
    { request_id: args.requestId, prompt: args.prompt, max_new_tokens: args.maxNewTokens },
    { deadline: new Date(Date.now() + timeoutS * 1000) },
  );
  let isFinalSeen = false;
  call.on('data', (message) => {
    process.stdout.write(`${JSON.stringify(message)}\n`);
    if (message.is_final) {
      isFinalSeen = true;
    }
  });
  call.on('error', (error) => {
    const code = grpc.status[error.code] || String(error.code);
    process.stderr.write(`${JSON.stringify({ error: code, details: error.details })}\n`);
    process.exitCode = 1;
    client.close();
  });
  call.on('status', (status) => {
    if (status.code !== grpc.status.OK) {
      return; // reported by the 'error' handler
    }
    if (!isFinalSeen) {
      process.stderr.write('{"error":"NO_FINAL_MESSAGE","details":"the stream ended without is_final"}\n');
      process.exitCode = 1;
    } else {
      process.exitCode = 0;
    }
    client.close();
  });
}

main();
