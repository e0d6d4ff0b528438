#!/usr/bin/env node
// Register a checkpoint, deploy it, stream one generation and print its timings, then
// remove the deployment: iserve from Node.js.
//
//   node demo.js MODEL_ID CHECKPOINT_PATH [PROMPT] [--max-tokens N] [--keep]
//
// CHECKPOINT_PATH is relative to the stack's models root. Addresses come from the
// ISERVE_*_ADDR variables (see README "Configuration"), as for the Python CLI.
"use strict";

const path = require("node:path");
const { connect, unary, describe } = require("./iserve");

const USAGE =
  "usage: node demo.js MODEL_ID CHECKPOINT_PATH [PROMPT] [--max-tokens N] [--keep] [-- PROMPT]";
const UINT32_MAX = 4294967295; // max_tokens is a uint32: protobufjs wraps a larger number

function usageError(message) {
  console.error(message ? `${message}\n${USAGE}` : USAGE);
  process.exit(2);
}

function parse(argv) {
  const args = { positional: [], maxTokens: 24, keep: false };
  for (let i = 0; i < argv.length; i += 1) {
    if (argv[i] === "--") {
      args.positional.push(...argv.slice(i + 1)); // a prompt that starts with "--"
      break;
    } else if (argv[i] === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else if (argv[i] === "--keep") args.keep = true;
    // A mistyped flag became the prompt (`--max-token 3` generated 24 tokens of it).
    else if (argv[i].startsWith("--")) usageError(`unknown option ${argv[i]}`);
    else args.positional.push(argv[i]);
  }
  const [modelId, checkpoint, prompt = "Once upon a time", ...extra] = args.positional;
  if (!modelId || !checkpoint) usageError();
  if (extra.length) usageError(`unexpected argument ${JSON.stringify(extra[0])}`);
  // Before anything is deployed: 2.7 was cut to 2 and 2^32 + 1 wrapped to 1.
  if (!Number.isInteger(args.maxTokens) || args.maxTokens < 1 || args.maxTokens > UINT32_MAX) {
    usageError(`--max-tokens must be a whole number from 1 to ${UINT32_MAX}`);
  }
  return { ...args, modelId, checkpoint, prompt };
}

// Ctrl-C (or SIGTERM) ends the stream and still removes the deployment: Node's default
// exit skipped the `finally` below, and the deployment stayed READY.
const stop = { signal: null, call: null };
for (const name of ["SIGINT", "SIGTERM"]) {
  process.on(name, () => {
    if (stop.signal) process.exit(130); // a second one: leave now
    stop.signal = name;
    if (stop.call) stop.call.cancel();
  });
}

function checkStopped() {
  if (stop.signal) throw new Error(`stopped by ${stop.signal}`);
}

function stream(inference, request) {
  return new Promise((resolve, reject) => {
    let text = "";
    let final = null;
    const call = inference.Generate(request);
    stop.call = call;
    call.on("data", (message) => {
      if (message.delta) {
        text += message.delta.text;
        process.stdout.write(message.delta.text);
      } else if (message.final) {
        final = message.final;
      }
    });
    call.on("error", (error) => {
      stop.call = null;
      reject(new Error(stop.signal ? `stopped by ${stop.signal}` : describe("Generate", error)));
    });
    call.on("end", () => {
      stop.call = null;
      resolve({ text, final });
    });
  });
}

async function main() {
  const args = parse(process.argv.slice(2));
  const iserve = connect();
  const requestId = () => Math.random().toString(16).slice(2, 14);
  let deploymentId = "";
  try {
    try {
      await unary(iserve.models, "RegisterModel", {
        request_id: requestId(),
        model_id: args.modelId,
        checkpoint_path: args.checkpoint,
        skip_profiling: true,
      });
      console.log(`registered ${args.modelId}`);
    } catch (error) {
      if (!String(error.message).includes("ALREADY_EXISTS")) throw error;
      // Registered from another checkpoint: this one would not be what is served.
      const { model } = await unary(iserve.models, "GetModel", {
        request_id: requestId(),
        model_id: args.modelId,
      });
      if (path.normalize(model.checkpoint_path) !== path.normalize(args.checkpoint)) {
        throw new Error(
          `model ${args.modelId} is registered from checkpoint ` +
            `${JSON.stringify(model.checkpoint_path)}, not ${JSON.stringify(args.checkpoint)}: ` +
            "give another model id"
        );
      }
      console.log(`${args.modelId} was registered already`);
    }
    checkStopped();
    const deployed = await unary(iserve.deployments, "Deploy", {
      request_id: requestId(),
      model_id: args.modelId,
      config: { tensor_parallel: 1, pipeline_parallel: 1 },
    });
    deploymentId = deployed.deployment.deployment_id;
    console.log(`deployed ${deploymentId} on ${deployed.deployment.worker_address}`);
    checkStopped();
    const { final } = await stream(iserve.inference, {
      request_id: requestId(),
      deployment_id: deploymentId,
      prompt: args.prompt,
      max_tokens: args.maxTokens,
      sampling: { temperature: 0 },
    });
    const t = final.timings;
    console.log(
      `\n[${final.usage.completion_tokens} tokens, ${final.finish_reason}; ` +
        `queue ${t.queue_ms.toFixed(1)} ms, TTFT ${t.ttft_ms.toFixed(1)} ms, ` +
        `TPOT ${t.tpot_ms.toFixed(2)} ms, total ${t.total_ms.toFixed(0)} ms]`
    );
  } finally {
    if (deploymentId && !args.keep) {
      await unary(iserve.deployments, "RemoveDeployment", {
        request_id: requestId(),
        deployment_id: deploymentId,
      });
      console.log(`removed ${deploymentId}`);
    }
    iserve.close();
  }
}

main().catch((error) => {
  console.error(`error: ${error.message}`);
  process.exit(stop.signal ? 130 : 1);
});
