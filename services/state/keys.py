"""The one place Redis key names are built. Every key lives under ``iserve:``."""

from __future__ import annotations

PREFIX = "iserve:"


def _part(value: str) -> str:
    if not value or ":" in value:
        raise ValueError(f"invalid key component {value!r}: empty or contains ':'")
    return value


def model(model_id: str) -> str:
    return f"{PREFIX}model:{_part(model_id)}"


def model_deleting(model_id: str) -> str:
    """Exists while a DeleteModel of the model runs (a Deploy then refuses it)."""
    return f"{model(model_id)}:deleting"


def model_index() -> str:
    return f"{PREFIX}models"


def profile(model_id: str) -> str:
    return f"{PREFIX}profile:{_part(model_id)}"


def profile_progress(model_id: str) -> str:
    """Profiling progress of a model (WatchModelResponse JSON), written by the profiler."""
    return f"{PREFIX}profile-progress:{_part(model_id)}"


def profile_sources(model_id: str) -> str:
    """Hash: hardware type -> where that hardware's profile rows came from (JSON)."""
    return f"{PREFIX}profile-sources:{_part(model_id)}"


def calibration(hardware_type: str) -> str:
    """Latency-model constants of one hardware type (Calibration JSON)."""
    return f"{PREFIX}calibration:{_part(hardware_type)}"


def calibration_index() -> str:
    return f"{PREFIX}calibrations"


def config_map(model_id: str, hardware_type: str) -> str:
    """The estimator's configuration map of a model on a hardware type."""
    return f"{PREFIX}config-map:{_part(model_id)}:{_part(hardware_type)}"


def config_maps(model_id: str) -> str:
    """A SCAN pattern of every configuration map of a model (ids hold no glob character)."""
    return f"{PREFIX}config-map:{_part(model_id)}:*"


def deployment(deployment_id: str) -> str:
    return f"{PREFIX}deployment:{_part(deployment_id)}"


def deployment_index() -> str:
    return f"{PREFIX}deployments"


def deployment_restarts(deployment_id: str) -> str:
    """A deployment's restart record (``deploy_svc.healing.RestartRecord`` JSON)."""
    return f"{PREFIX}deployment-restarts:{_part(deployment_id)}"


def state_format() -> str:
    """The newest format of records any iserve has written into this Redis
    (``services.state.store.STATE_FORMAT``)."""
    return f"{PREFIX}state-format"


def deployer_stopped() -> str:
    """Set when the deployment service stopped cleanly (SIGTERM), taken when it starts."""
    return f"{PREFIX}deployer-stopped"


def _scoped(owner: str, request_id: str) -> str:
    """A request id within its owner's own keys: a tenant's idempotency key must not
    claim another's (one tenant could take the keys another retries with). Calls
    without a subject (authentication off) keep the unscoped name; no subject holds a
    ':', so the two never meet."""
    return f"{_part(owner)}:{_part(request_id)}" if owner else _part(request_id)


def deploy_request(request_id: str, owner: str = "") -> str:
    """Maps an owner's Deploy request id to its deployment id (idempotency)."""
    return f"{PREFIX}deploy-request:{_scoped(owner, request_id)}"


def deploy_request_asked(request_id: str, owner: str = "") -> str:
    """What the Deploy that claimed a request id asked (JSON of its DeployRequest, the
    request id and the wait cleared): a repeat must ask the same."""
    return f"{PREFIX}deploy-request-asked:{_scoped(owner, request_id)}"


def node(node_id: str) -> str:
    return f"{PREFIX}node:{_part(node_id)}"


def node_index() -> str:
    return f"{PREFIX}nodes"


def node_stopped(node_id: str) -> str:
    """Set when the node's agent stopped cleanly (SIGTERM), deleted when it registers."""
    return f"{PREFIX}node-stopped:{_part(node_id)}"


def node_back_after_stop(node_id: str) -> str:
    """Set for a minute when the node's agent registers again after a clean stop (its
    value the stop's time): the deployer, which checks nodes each second, may not have
    seen the stop, and an agent started again at once then read as one that crashed."""
    return f"{PREFIX}node-back-after-stop:{_part(node_id)}"


def node_holder(node_id: str) -> str:
    """The token of the agent process that registered the node last (a new process
    takes it over; the one it replaced, registering again, finds another's and stops)."""
    return f"{PREFIX}node-holder:{_part(node_id)}"


def node_heartbeat(node_id: str) -> str:
    """Exists while the node's agent is alive (TTL)."""
    return f"{PREFIX}heartbeat:{_part(node_id)}"


def node_devices(node_id: str) -> str:
    return f"{PREFIX}node-devices:{_part(node_id)}"


def device(node_id: str, device_id: str) -> str:
    """Hash: ``info`` (DeviceState JSON), ``total``, ``used``, ``reserved``, ``load``, ``updated_ms``."""
    return f"{PREFIX}device:{_part(node_id)}:{_part(device_id)}"


def reservation(owner: str) -> str:
    """Hash: device key -> bytes reserved by ``owner`` (a deployment or profiling job)."""
    return f"{PREFIX}reservation:{_part(owner)}"


def reservation_index() -> str:
    return f"{PREFIX}reservations"


# Every worker group's hash key starts so (a scan for them: StateStore.worker_groups).
WORKERS = f"{PREFIX}workers:"


def workers(deployment_id: str) -> str:
    """Hash: rank -> WorkerInfo JSON, written by the agents."""
    return f"{WORKERS}{_part(deployment_id)}"


def events() -> str:
    """Stream of cluster events (worker deaths, deployment changes)."""
    return f"{PREFIX}events"


def token(token_id: str) -> str:
    """Hash: ``info`` (TokenInfo JSON) and ``sha256`` (of the whole token), by token id."""
    return f"{PREFIX}token:{_part(token_id)}"


def token_index() -> str:
    return f"{PREFIX}tokens"
