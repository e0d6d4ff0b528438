// iserve's gRPC API for Node.js: the services' clients, built at run time from the
// repository's protos/ by @grpc/proto-loader (no generated or copied stubs to go stale).
"use strict";

const fs = require("node:fs");
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

// Where each service listens, found as services/settings.py finds it: its ISERVE_*_ADDR
// variable, else what `iserve up` recorded in $ISERVE_STATE_DIR/stack.json (the ports it
// chose for host:0), else the default port on ISERVE_HOST.
const ADDRESSES = {
  model: ["ISERVE_MODEL_ADDR", 50061],
  deploy: ["ISERVE_DEPLOY_ADDR", 50063],
  scheduler: ["ISERVE_SCHEDULER_ADDR", 50064],
  estimator: ["ISERVE_ESTIMATOR_ADDR", 50062],
};

function stateDir() {
  return process.env.ISERVE_STATE_DIR || path.join(require("node:os").homedir(), ".iserve");
}

function recordedStack() {
  try {
    return JSON.parse(fs.readFileSync(path.join(stateDir(), "stack.json"), "utf8"));
  } catch {
    return {}; // no stack started from here (or not readable): the defaults
  }
}

function address(service) {
  const [variable, port] = ADDRESSES[service];
  const recorded = (recordedStack().addresses || {})[service];
  const given = process.env[variable];
  // host:port (an IPv6 host in brackets), as the Python side checks it: grpc-js said
  // "Name resolution failed for target dns:garbage" of a value without a port.
  const parts = given && /^(\[[0-9A-Fa-f:.]+(%[\w.-]+)?\]|[^\s:\[\]]+):(\d{1,5})$/.exec(given);
  if (given && !(parts && Number(parts[3]) >= 1 && Number(parts[3]) <= 65535)) {
    throw new Error(`${variable}=${JSON.stringify(given)}: not host:port (a port from 1 to 65535)`);
  }
  return given || recorded || `${process.env.ISERVE_HOST || "127.0.0.1"}:${port}`;
}

// ISERVE_TOKEN, else the administrator token `iserve up` wrote for the CLI with
// authentication on ($ISERVE_STATE_DIR/tokens/admin), as the Python CLI takes it.
// Checked as the Python CLI checks it (services/settings.py): gRPC metadata carries
// printable ASCII only, and grpc-js threw from inside the call for anything else.
function token() {
  let value = (process.env.ISERVE_TOKEN || "").trim();
  let source = "ISERVE_TOKEN";
  if (!value) {
    source = path.join(stateDir(), "tokens", "admin");
    try {
      value = fs.readFileSync(source, "utf8").trim();
    } catch {
      return null;
    }
    if (!value) return null;
  }
  if (value.length < 24 || value.length > 512) {
    throw new Error(`${source}: a token is 24-512 characters`);
  }
  if (!/^[!-~]+$/.test(value)) {
    throw new Error(`${source}: a token is printable ASCII and has no spaces`);
  }
  return value;
}

function load() {
  if (!fs.existsSync(path.join(PROTO_ROOT, FILES[0]))) {
    // A copy of this folder outside the repository finds no protos beside it.
    throw new Error(
      `no iserve protos under ${PROTO_ROOT}: set ISERVE_PROTOS to the repository's protos/ folder`,
    );
  }
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

// "METHOD: CODE: details" of a failed call, as the Python CLI says it (grpc-js ends the
// details of an unreachable server with an empty "Resolution note: ").
function describe(method, error) {
  const code = Object.keys(grpc.status).find((k) => grpc.status[k] === error.code);
  const details = String(error.details || "").replace(/\s*Resolution note:\s*$/, "");
  return `${method}: ${code}: ${details}`;
}

// Promise wrapper of a unary call that rejects with the gRPC status in the message.
function unary(client, method, request, deadlineSeconds = 120) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + deadlineSeconds * 1000);
    client[method](request, { deadline }, (error, reply) => {
      if (error) {
        // As the Python CLI hints it: most often nothing listens there.
        const hint =
          error.code === grpc.status.UNAVAILABLE ? " (is the stack up? `iserve status` says)" : "";
        const failed = new Error(describe(method, error) + hint);
        failed.code = error.code;
        reject(failed);
      } else {
        resolve(reply);
      }
    });
  });
}

// TLS from the same variables as the Python side (ISERVE_TLS_CA, and ISERVE_TLS_CERT /
// ISERVE_TLS_KEY for mutual TLS); plaintext when none is set.
function channelCredentials() {
  const read = (variable) => {
    if (!process.env[variable]) return null;
    try {
      return fs.readFileSync(process.env[variable]);
    } catch (error) {
      throw new Error(`${variable}: cannot read ${process.env[variable]}: ${error.code || error.message}`);
    }
  };
  const ca = read("ISERVE_TLS_CA");
  const cert = read("ISERVE_TLS_CERT");
  const key = read("ISERVE_TLS_KEY");
  if (!ca && !cert) return grpc.credentials.createInsecure();
  return grpc.credentials.createSsl(ca, key, cert);
}

// Every call carries `authorization: Bearer <token>` when there is one (token() above;
// authentication on, docs/security.md).
function clientOptions() {
  const options = {};
  if (process.env.ISERVE_TLS_SERVER_NAME) {
    options["grpc.ssl_target_name_override"] = process.env.ISERVE_TLS_SERVER_NAME;
  }
  const bearer = token();
  if (bearer) {
    options.interceptors = [
      (callOptions, nextCall) =>
        new grpc.InterceptingCall(nextCall(callOptions), {
          start(metadata, listener, next) {
            metadata.set("authorization", `Bearer ${bearer}`);
            next(metadata, listener);
          },
        }),
    ];
  }
  return options;
}

// The clients of the model, deployment, inference and estimator services.
function connect() {
  const v1 = load();
  const credentials = channelCredentials();
  const options = clientOptions();
  return {
    models: new v1.ModelService(address("model"), credentials, options),
    deployments: new v1.DeploymentService(address("deploy"), credentials, options),
    inference: new v1.InferenceService(address("scheduler"), credentials, options),
    estimator: new v1.EstimatorService(address("estimator"), credentials, options),
    close() {
      for (const client of [this.models, this.deployments, this.inference, this.estimator]) {
        client.close();
      }
    },
  };
}

module.exports = { connect, unary, describe, grpc, PROTO_ROOT };
