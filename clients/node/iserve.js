// iserve's gRPC API for Node.js: the services' clients, built at run time from the
// repository's protos/ by @grpc/proto-loader (no generated or copied stubs to go stale).
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = process.env.ISERVE_PROTOS || path.resolve(__dirname, "..", "..", "protos");
const FILES = [
  "model_service.proto",
  "deployment_service.proto",
  "inference_service.proto",
  "estimator_service.proto",
].map((name) => path.join("iserve", "v1", name));

// Where each service listens: the same variables and defaults as services/settings.py.
const ADDRESSES = {
  model: ["ISERVE_MODEL_ADDR", "127.0.0.1:50061"],
  deploy: ["ISERVE_DEPLOY_ADDR", "127.0.0.1:50063"],
  scheduler: ["ISERVE_SCHEDULER_ADDR", "127.0.0.1:50064"],
  estimator: ["ISERVE_ESTIMATOR_ADDR", "127.0.0.1:50062"],
};

function address(service) {
  const [variable, fallback] = ADDRESSES[service];
  return process.env[variable] || fallback;
}

function load() {
  const definition = protoLoader.loadSync(FILES, {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto files (snake_case)
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).iserve.v1;
}

// Promise wrapper of a unary call that rejects with the gRPC status in the message.
function unary(client, method, request, deadlineSeconds = 120) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + deadlineSeconds * 1000);
    client[method](request, { deadline }, (error, reply) => {
      if (error) {
        const code = Object.keys(grpc.status).find((k) => grpc.status[k] === error.code);
        reject(new Error(`${method}: ${code}: ${error.details}`));
      } else {
        resolve(reply);
      }
    });
  });
}

// The clients of the model, deployment, inference and estimator services.
function connect() {
  const v1 = load();
  const credentials = grpc.credentials.createInsecure();
  return {
    models: new v1.ModelService(address("model"), credentials),
    deployments: new v1.DeploymentService(address("deploy"), credentials),
    inference: new v1.InferenceService(address("scheduler"), credentials),
    estimator: new v1.EstimatorService(address("estimator"), credentials),
    close() {
      for (const client of [this.models, this.deployments, this.inference, this.estimator]) {
        client.close();
      }
    },
  };
}

module.exports = { connect, unary, grpc, PROTO_ROOT };
