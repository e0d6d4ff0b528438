#!/usr/bin/env node
// Register a checkpoint, deploy it, stream one generation and print its timings, then
// remove the deployment: iserve from Node.js.
//
//   node demo.js MODEL_ID CHECKPOINT_PATH [PROMPT] [--max-tokens N] [--keep]
//
// CHECKPOINT_PATH is relative to the stack's models root. Addresses come from the
// ISERVE_*_ADDR variables (see README "Configuration"), as for the Python CLI.
"use strict";

const { connect, unary } = require("./iserve");

const USAGE = "usage: node demo.js MODEL_ID CHECKPOINT_PATH [PROMPT] [--max-tokens N] [--keep]";
const UINT32_MAX = 4294967295; // max_tokens is a uint32: protobufjs wraps a larger number

function parse(argv) {
  const args = { positional: [], maxTokens: 24, keep: false };
  for (let i = 0; i < argv.length; i += 1) {
    if (argv[i] === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else if (argv[i] === "--keep") args.keep = true;
    else args.positional.push(argv[i]);
  }
  const [modelId, checkpoint, prompt = "Once upon a time"] = args.positional;
  if (!modelId || !checkpoint) {
    console.error(USAGE);
    process.exit(2);
  }
  // Before anything is deployed: 2.7 was cut to 2 and 2^32 + 1 wrapped to 1.
  if (!Number.isInteger(args.maxTokens) || args.maxTokens < 1 || args.maxTokens > UINT32_MAX) {
    console.error(`--max-tokens must be a whole number from 1 to ${UINT32_MAX}\n${USAGE}`);
    process.exit(2);
  }
  return { ...args, modelId, checkpoint, prompt };
}

function stream(inference, request) {
  return new Promise((resolve, reject) => {
    let text = "";
    let final = null;
    const call = inference.Generate(request);
    call.on("data", (message) => {
      if (message.delta) {
        text += message.delta.text;
        process.stdout.write(message.delta.text);
      } else if (message.final) {
        final = message.final;
      }
    });
    call.on("error", (error) => reject(new Error(`Generate: ${error.details}`)));
    call.on("end", () => resolve({ text, final }));
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
      console.log(`${args.modelId} was registered already`);
    }
    const deployed = await unary(iserve.deployments, "Deploy", {
      request_id: requestId(),
      model_id: args.modelId,
      config: { tensor_parallel: 1, pipeline_parallel: 1 },
    });
    deploymentId = deployed.deployment.deployment_id;
    console.log(`deployed ${deploymentId} on ${deployed.deployment.worker_address}`);
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
  process.exit(1);
});
