"""Who may call what: bearer tokens, roles and the per-RPC policy (docs/security.md).

- :mod:`services.auth.policy`: every RPC iserve serves, with the roles that may call it.
- :mod:`services.auth.tokens`: the token format, hashing, and the registry in Redis.
- :mod:`services.auth.interceptor`: the server interceptor that enforces the policy.
- :mod:`services.auth.access`: ownership rules servicers apply to the caller.

Built on them: :mod:`services.security` wires a process (TLS, its own token, who may
call it) and :mod:`deploy_svc.tokens` serves TokenService (``iserve token``).
"""
