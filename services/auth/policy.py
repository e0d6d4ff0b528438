"""Every RPC iserve serves, with the roles that may call it. Deny by default: a method
missing here is refused to every caller, and ``tests/unit/test_auth_policy.py`` fails
when a service gains an RPC this table does not list.

Roles are the personas of DESIGN.md (``Role`` in token_service.proto): the model developer
registers models, the application developer deploys them, the application user
generates, the administrator does everything, and ``service`` is iserve's own processes
calling each other. Ownership (a developer deletes only its own models and deployments;
a user generates only on the deployments its token grants) is checked by the servicers
through :mod:`services.auth.access`, after this table has let the call in.
"""

from __future__ import annotations

from services.api import token_service_pb2 as token_pb

ADMIN = token_pb.ROLE_ADMIN
MODEL_DEVELOPER = token_pb.ROLE_MODEL_DEVELOPER
APP_DEVELOPER = token_pb.ROLE_APP_DEVELOPER
APP_USER = token_pb.ROLE_APP_USER
SERVICE = token_pb.ROLE_SERVICE

ROLE_NAMES = {
    ADMIN: "admin",
    MODEL_DEVELOPER: "model-developer",
    APP_DEVELOPER: "app-developer",
    APP_USER: "app-user",
    SERVICE: "service",
}
ROLES_BY_NAME = {name: role for role, name in ROLE_NAMES.items()}

# Callable without a token: the probes compose and Kubernetes run. Health says only
# SERVING or NOT_SERVING of a service name.
OPEN: frozenset[int] = frozenset()
_ALL = frozenset(ROLE_NAMES)
_DEVELOPERS = frozenset({ADMIN, MODEL_DEVELOPER, APP_DEVELOPER})

_M = "/iserve.v1.ModelService/"
_E = "/iserve.v1.EstimatorService/"
_D = "/iserve.v1.DeploymentService/"
_I = "/iserve.v1.InferenceService/"
_A = "/iserve.v1.AgentService/"
_W = "/iserve.v1.WorkerService/"
_T = "/iserve.v1.TokenService/"

# Reading a deployment's record: the roles of this method read deployments wherever
# their records appear (services.auth.access.readable).
READ_DEPLOYMENT = _D + "GetDeployment"
# What an application generates through (the scheduler): usable deployments are its.
GENERATE = _I + "Generate"

POLICY: dict[str, frozenset[int]] = {
    # Model catalogue: registered and deleted (own) by model developers; read by developers.
    _M + "RegisterModel": frozenset({ADMIN, MODEL_DEVELOPER}),
    _M + "DeleteModel": frozenset({ADMIN, MODEL_DEVELOPER}),
    _M + "ImportProfiles": frozenset({ADMIN, MODEL_DEVELOPER}),
    _M + "GetModel": _DEVELOPERS | {SERVICE},
    _M + "ListModels": _DEVELOPERS | {SERVICE},
    _M + "WatchModel": _DEVELOPERS,
    _M + "GetProfile": _DEVELOPERS | {SERVICE},
    # Estimates are read by developers and by the deployer; calibration changes what
    # every deployment on a hardware type is estimated at: administrators only.
    _E + "EstimateConfigs": _DEVELOPERS | {SERVICE},
    _E + "RankConfigs": _DEVELOPERS | {SERVICE},
    _E + "GetCalibration": _DEVELOPERS | {SERVICE},
    _E + "Calibrate": frozenset({ADMIN}),
    # Deployments: made, planned and removed (own) by application developers. Users see
    # only the deployments their token grants (access.visible).
    _D + "Deploy": frozenset({ADMIN, APP_DEVELOPER}),
    _D + "PlanDeployment": frozenset({ADMIN, APP_DEVELOPER}),
    _D + "RemoveDeployment": frozenset({ADMIN, APP_DEVELOPER}),
    READ_DEPLOYMENT: frozenset({ADMIN, APP_DEVELOPER, APP_USER, SERVICE}),
    _D + "ListDeployments": frozenset({ADMIN, APP_DEVELOPER, APP_USER, SERVICE}),
    _D + "GetClusterState": _DEVELOPERS | {SERVICE},
    # Generation: users on granted deployments, developers on their own (access).
    GENERATE: frozenset({ADMIN, APP_DEVELOPER, APP_USER}),
    _I + "GetServingStats": frozenset({ADMIN, APP_DEVELOPER}),
    # A node's agent starts and stops processes: the deployer, the profiler, admins.
    _A + "StartWorkers": frozenset({ADMIN, SERVICE}),
    _A + "StopWorkers": frozenset({ADMIN, SERVICE}),
    _A + "ListWorkers": frozenset({ADMIN, SERVICE}),
    _A + "RunProfilingJob": frozenset({ADMIN, SERVICE}),
    # Workers hold no token registry: they know only the service token.
    _W + "Generate": frozenset({SERVICE}),
    _W + "Session": frozenset({SERVICE}),
    _W + "GetWorkerStats": frozenset({SERVICE}),
    # Tokens.
    _T + "CreateToken": frozenset({ADMIN}),
    _T + "ListTokens": frozenset({ADMIN}),
    _T + "RevokeToken": frozenset({ADMIN}),
    # Probes.
    "/grpc.health.v1.Health/Check": OPEN,
    "/grpc.health.v1.Health/Watch": OPEN,
    # List names every service a server hosts: any valid token.
    "/grpc.health.v1.Health/List": _ALL,
    # Reflection describes the API (public in this repository, but it also names what a
    # server hosts): any valid token.
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": _ALL,
}

# The roles told what only the operator should see (an internal address in an error:
# services.errors.IServeError.told_to_tenants); with authentication off every caller
# is an administrator.
OPERATORS = frozenset({ADMIN, SERVICE})
# The Prometheus endpoints (ISERVE_<S>_METRICS_ADDR) name models and deployments: with
# authentication on they answer only the operators' bearer tokens.
METRICS_ROLES = OPERATORS


def roles_for(method: str) -> frozenset[int] | None:
    """The roles that may call ``method`` (``/package.Service/Method``): empty when it is
    open to anyone, None when it is not listed (refused to everyone)."""
    return POLICY.get(method)


def role_name(role: int) -> str:
    return ROLE_NAMES.get(role, f"role {role}")
