from __future__ import annotations

import json
import shutil
import stat
import time
from pathlib import Path

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID as EKU

from deploy_svc.healing import GiveUp, RestartPolicy, after_failure
from services.settings import (
    DEFAULT_PORTS,
    GIB,
    STACK_FILE,
    certificate_name_warnings,
    check_tls_identity,
    load_settings,
    read_stack_file,
    redacted_url,
    tls_warnings,
    write_stack_file,
)
from tests.pki import DAY, make_pki


def test_defaults(tmp_path):
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    assert s.state_dir == tmp_path.resolve()
    assert s.models_root == (tmp_path / "models").resolve()
    assert s.address("deploy") == f"127.0.0.1:{DEFAULT_PORTS['deploy']}"
    assert s.redis_url is None
    assert s.virtual_devices == 2 and s.device_memory_bytes == 4 * GIB
    assert s.drain_timeout_s == 30.0
    assert s.gateway_address == "127.0.0.1:8000"
    assert s.worker_ports is None  # any free port
    ranged = load_settings(
        {"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_WORKER_PORTS": " 41000-41999"}
    )
    assert ranged.worker_ports == range(41000, 42000)


def test_iserve_host_is_the_host_of_every_default_address(tmp_path):
    """The gateway's too: ISERVE_HOST=0.0.0.0 left the gateway on loopback alone."""
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_HOST": "0.0.0.0"})
    assert s.address("deploy") == f"0.0.0.0:{DEFAULT_PORTS['deploy']}"
    assert s.gateway_address == "0.0.0.0:8000"


def test_an_ipv6_host_is_bracketed_and_a_bare_ipv6_address_refused(tmp_path):
    """On an IPv6 cluster $(POD_IP) is a bare address: ISERVE_HOST=fd00::5 made
    "fd00::5:50061", and ISERVE_AGENT_ADDR=::1:45999 passed the check and then failed to
    bind ("misformatted domain name")."""
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_HOST": "fd00::5"})
    assert s.host == "[fd00::5]"
    assert s.address("deploy") == f"[fd00::5]:{DEFAULT_PORTS['deploy']}"
    assert s.gateway_address == "[fd00::5]:8000"
    given = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_AGENT_ADDR": "[::1]:7"})
    assert given.address("agent") == "[::1]:7"
    with pytest.raises(ValueError) as bare:
        load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_AGENT_ADDR": "::1:45999"})
    assert str(bare.value) == (
        "ISERVE_AGENT_ADDR='::1:45999': an IPv6 address goes in brackets: [::1]:45999"
    )


def test_environment_beats_stack_file_beats_defaults(tmp_path):
    (tmp_path / "stack.json").write_text(
        json.dumps({"redis_url": "redis://x:1/0", "addresses": {"model": "h:1", "deploy": "h:2"}})
    )
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_DEPLOY_ADDR": "e:3"})
    assert s.address("model") == "h:1"
    assert s.address("deploy") == "e:3"
    assert s.redis_url == "redis://x:1/0"
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "REDIS_URL": "redis://y:2/0"})
    assert s.redis_url == "redis://y:2/0"


@pytest.mark.parametrize(
    "name,value",
    [
        ("ISERVE_DEVICES", "0"),
        ("ISERVE_DEVICES", "two"),
        ("ISERVE_DEVICES", "257"),  # MAX_VIRTUAL_DEVICES: 4294967295 would hang the agent
        ("ISERVE_DEVICE_MEMORY_GIB", "-1"),
        ("ISERVE_DEVICE_MEMORY_GIB", "nan"),
        ("ISERVE_DEVICE_MEMORY_GIB", "inf"),
        ("ISERVE_HEARTBEAT_TTL_S", "nan"),
        ("ISERVE_DRAIN_TIMEOUT_S", "0"),
        ("ISERVE_DRAIN_TIMEOUT_S", "soon"),
        ("ISERVE_MAX_RESTARTS", "-1"),
        ("ISERVE_MAX_RESTARTS", "2.5"),
        ("ISERVE_RESTART_BACKOFF_S", "0"),
        ("ISERVE_RESTART_BACKOFF_S", "inf"),
        ("ISERVE_NODE_FORGET_AFTER_S", "-1"),
        ("ISERVE_NODE_FORGET_AFTER_S", "nan"),
        ("ISERVE_NODE_FORGET_AFTER_S", "2592001"),  # more than 30 days
        ("ISERVE_CORS_ORIGINS", "localhost:3000"),
        ("ISERVE_CORS_ORIGINS", "http://localhost:3000/"),  # a browser sends no path
        ("ISERVE_CORS_ORIGINS", "http://a.test,ftp://b.test"),
        ("ISERVE_WORKER_PORTS", "41000"),
        ("ISERVE_WORKER_PORTS", "41000-40000"),
        ("ISERVE_WORKER_PORTS", "80-90"),
        ("ISERVE_WORKER_PORTS", "41000-70000"),
        ("ISERVE_WORKER_PORTS", "a-b"),
    ],
)
def test_bad_values_are_named(tmp_path, name, value):
    with pytest.raises(ValueError, match=name):
        load_settings({"ISERVE_STATE_DIR": str(tmp_path), name: value})


def test_the_restart_policy_is_the_operators_to_set(tmp_path):
    default = RestartPolicy.of(load_settings({"ISERVE_STATE_DIR": str(tmp_path)}))
    assert default == RestartPolicy()  # 5 restarts, 1 s doubling to 30 s
    never = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_MAX_RESTARTS": "0"})
    assert RestartPolicy.of(never).max_restarts == 0
    assert isinstance(after_failure(RestartPolicy.of(never), None, "exited", 1), GiveUp)
    patient = RestartPolicy.of(
        load_settings(
            {
                "ISERVE_STATE_DIR": str(tmp_path),
                "ISERVE_MAX_RESTARTS": "10",
                "ISERVE_RESTART_BACKOFF_S": "0.25",
            }
        )
    )
    assert patient.max_restarts == 10
    assert [patient.backoff_s(n) for n in (1, 2, 3, 9)] == [0.25, 0.5, 1.0, 30.0]
    # A first backoff above the usual cap is not cut to it.
    slow = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_RESTART_BACKOFF_S": "60"})
    assert [RestartPolicy.of(slow).backoff_s(n) for n in (1, 2)] == [60.0, 60.0]


def test_dead_nodes_are_forgotten_after_an_hour_unless_the_operator_says_otherwise(tmp_path):
    assert load_settings({"ISERVE_STATE_DIR": str(tmp_path)}).node_forget_after_s == 3600
    kept = {"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_NODE_FORGET_AFTER_S": "0"}
    assert load_settings(kept).node_forget_after_s == 0  # listed for ever


def test_the_drain_timeout_may_be_a_fraction_of_a_second(tmp_path):
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_DRAIN_TIMEOUT_S": "0.5"})
    assert s.drain_timeout_s == 0.5


@pytest.mark.parametrize(
    "env,named",
    [
        # The documented on/off first (it said "must be 1 or 0", which the docs never use).
        ({"ISERVE_AUTH": "maybe"}, "ISERVE_AUTH must be on or off .*got .maybe."),
        ({"ISERVE_TOKEN": "short"}, "ISERVE_TOKEN"),
        ({"ISERVE_SERVICE_TOKEN": "has a space in it somewhere ok"}, "ISERVE_SERVICE_TOKEN"),
        ({"ISERVE_ADMIN_TOKEN": "x" * 513}, "ISERVE_ADMIN_TOKEN"),
        # gRPC metadata and HTTP headers carry ASCII: such a token could never be sent.
        ({"ISERVE_ADMIN_TOKEN": "admin-token-with-an-accent-é-0123"}, "ISERVE_ADMIN_TOKEN"),
        ({"ISERVE_TLS_CERT": "/nonexistent/cert.pem"}, "ISERVE_TLS_CERT"),
        ({"REDIS_URL": "localhost:6379"}, "REDIS_URL.*schemes"),
        # redis-py took database 0 for a path it cannot read, and passed an unknown option
        # on to fail at the first connection, after 10 s of "unreachable".
        ({"REDIS_URL": "redis://127.0.0.1:6379/5x"}, "REDIS_URL.*'5x' is no database index"),
        (
            {"REDIS_URL": "redis://127.0.0.1:6379/0?dbx=2"},
            "REDIS_URL.*unexpected keyword argument 'dbx'",
        ),
        # A port past 65535 used to wrap around to another (99999 - 65536).
        ({"ISERVE_MODEL_ADDR": "127.0.0.1:99999"}, "ISERVE_MODEL_ADDR.*port from 0 to 65535"),
        ({"ISERVE_GATEWAY_ADDR": "bogus"}, "ISERVE_GATEWAY_ADDR.*not host:port"),
        ({"ISERVE_TLS_CLIENT_AUTH": "on"}, "ISERVE_TLS_CLIENT_AUTH"),
    ],
)
def test_bad_security_settings_are_named(tmp_path, env, named):
    with pytest.raises(ValueError, match=named):
        load_settings({"ISERVE_STATE_DIR": str(tmp_path), **env})


def test_tls_files_go_together_and_tokens_come_from_the_stack(tmp_path):
    pki = make_pki(tmp_path / "pki")
    with pytest.raises(ValueError, match="ISERVE_TLS_KEY go together"):
        load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_TLS_CERT": str(pki["cert"])})
    ca = pki["ca"]
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_TLS_CA": str(ca)})
    assert s.tls is not None and s.tls.ca == ca and not s.tls.serves  # a client of TLS
    assert load_settings({"ISERVE_STATE_DIR": str(tmp_path)}).tls is None

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "admin").write_text("admin-token-from-the-stack-0123\n")
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    assert s.token == s.admin_token == "admin-token-from-the-stack-0123"
    assert "admin-token" not in repr(s)  # tokens never appear in logged settings
    with pytest.raises(ValueError, match="ISERVE_SERVICE_TOKEN"):
        s.require_service_token()
    s = load_settings(
        {"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_TOKEN": "a-user-token-0123456789abcdef"}
    )
    assert s.token == "a-user-token-0123456789abcdef"
    assert s.admin_token == "admin-token-from-the-stack-0123"


def test_a_service_with_authentication_on_and_no_service_token_says_so(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("ISERVE_")}
    env.update(ISERVE_STATE_DIR=str(tmp_path), ISERVE_AUTH="on", REDIS_URL="redis://127.0.0.1:1/0")
    out = subprocess.run(
        [sys.executable, "-m", "estimator_svc"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "ISERVE_AUTH=on needs ISERVE_SERVICE_TOKEN" in out.stderr


def test_cors_origins_are_a_list_of_origins(tmp_path):
    def origins(raw: str) -> tuple[str, ...]:
        return load_settings(
            {"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_CORS_ORIGINS": raw}
        ).cors_origins

    assert load_settings({"ISERVE_STATE_DIR": str(tmp_path)}).cors_origins == ()
    assert origins("*") == ("*",)
    assert origins(" http://localhost:3000 ,https://chat.example.com:8443,") == (
        "http://localhost:3000",
        "https://chat.example.com:8443",
    )
    assert origins("http://[::1]:8080") == ("http://[::1]:8080",)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:S3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://iserve:p%40ss@[::1]:6380/1", "rediss://iserve:***@[::1]:6380/1"),
        ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
        ("unix:///tmp/redis.sock?db=2", "unix:///tmp/redis.sock?db=2"),
        # redis-py takes the password as an option too: it was printed at `up` and in
        # `iserve status`, and in an agent's log when wrong.
        (
            "redis://127.0.0.1:6379/0?username=iserve&password=Is3rve%21pw",
            "redis://127.0.0.1:6379/0?username=iserve&password=***",
        ),
        ("unix:///tmp/r.sock?password=x&db=2", "unix:///tmp/r.sock?password=***&db=2"),
    ],
)
def test_a_redis_url_is_shown_without_its_password(url, shown):
    assert redacted_url(url) == shown


def test_stack_json_is_readable_by_its_owner_only(tmp_path):
    """It holds the Redis URL, password and all; an older, wider file is narrowed."""
    (tmp_path / STACK_FILE).write_text("{}")
    (tmp_path / STACK_FILE).chmod(0o644)
    write_stack_file(tmp_path, {"redis_url": "redis://:S3cret@redis:6379/0"})
    assert stat.S_IMODE((tmp_path / STACK_FILE).stat().st_mode) == 0o600
    assert read_stack_file(tmp_path)["redis_url"] == "redis://:S3cret@redis:6379/0"


def test_metrics_urls_say_https_where_the_processes_serve_tls(tmp_path):
    plain = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    assert plain.metrics_url("deploy").startswith("http://")
    pki = make_pki(tmp_path / "pki")
    tls = load_settings(
        {
            "ISERVE_STATE_DIR": str(tmp_path),
            "ISERVE_TLS_CERT": str(pki["cert"]),
            "ISERVE_TLS_KEY": str(pki["key"]),
            "ISERVE_TLS_CA": str(pki["ca"]),
        }
    )
    assert tls.metrics_url("deploy") == f"https://{tls.metrics_address('deploy')}/metrics"
    # Port 0 (any free one) names no URL until a stack records the port it chose:
    # `iserve status` with the stack down showed http://127.0.0.1:0/metrics.
    anywhere = load_settings(
        {"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_DEPLOY_METRICS_ADDR": "127.0.0.1:0"}
    )
    assert anywhere.metrics_url("deploy") == "-"


@pytest.mark.parametrize(
    ("max_positions", "prompt", "outputs"),
    [
        (0, (64, 256, 1024), (8, 16)),  # unknown: unchanged
        (2048, (64, 256, 1024), (8, 16)),
        (1040, (64, 256, 1024), (8, 16)),  # exactly fits
        (1039, (64, 256, 1023), (8, 16)),
        (272, (64, 256), (8, 16)),  # the two longest at what is left: one length
        (271, (64, 255), (8, 16)),
        (80, (64,), (8, 16)),  # both prompts at what is left: one length
        (79, (63,), (8, 16)),
        (32, (16,), (8, 16)),
        (20, (10,), (5, 10)),
        (3, (2,), (1,)),
        (2, (1,), (1,)),
    ],
)
def test_profiling_lengths_shrink_to_a_short_context(max_positions, prompt, outputs):
    from services.settings import ProfilingSettings

    fitted = ProfilingSettings().fitted(max_positions)
    assert (fitted.input_tokens, fitted.output_tokens) == (prompt, outputs)
    assert not max_positions or fitted.max_seq_len <= max_positions
    with pytest.raises(ValueError, match="a context of 1 position holds no prompt"):
        ProfilingSettings().fitted(1)


def test_tls_files_that_are_not_what_they_claim_are_named_at_load(tmp_path):
    # Checked where the settings are read, not at the first handshake, whose error
    # (gRPC's "Failed to create security handshaker") names no file.
    pki, other = make_pki(tmp_path / "pki"), make_pki(tmp_path / "other")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    base = {"ISERVE_STATE_DIR": str(tmp_path)}
    cases = [
        ({"ISERVE_TLS_CA": str(junk)}, "ISERVE_TLS_CA.*not a PEM CA certificate"),
        (
            {"ISERVE_TLS_CERT": str(junk), "ISERVE_TLS_KEY": str(pki["key"])},
            "ISERVE_TLS_CERT.*not a PEM certificate",
        ),
        (
            {"ISERVE_TLS_CERT": str(pki["cert"]), "ISERVE_TLS_KEY": str(junk)},
            "ISERVE_TLS_KEY.*not a PEM private key",
        ),
        (
            {"ISERVE_TLS_CERT": str(pki["cert"]), "ISERVE_TLS_KEY": str(other["key"])},
            "ISERVE_TLS_KEY.*does not match ISERVE_TLS_CERT",
        ),
    ]
    for env, message in cases:
        with pytest.raises(ValueError, match=message):
            load_settings({**base, **env})


def _served(env: dict[str, str]):
    """The settings of a process that serves with these TLS files, as checked at start."""
    return check_tls_identity(load_settings(env), serving=True)


def _tls_env(tmp_path, pki, mutual: bool, **others) -> dict[str, str]:
    return {
        "ISERVE_STATE_DIR": str(tmp_path),
        "ISERVE_TLS_CERT": str(pki["cert"]),
        "ISERVE_TLS_KEY": str(pki["key"]),
        "ISERVE_TLS_CA": str(pki["ca"]),
        "ISERVE_TLS_CLIENT_AUTH": "on" if mutual else "off",
        **others,
    }


@pytest.mark.parametrize("mutual", [False, True])
@pytest.mark.parametrize(
    ("made", "says"),
    [
        ({"cert_valid": (-2 * DAY, -DAY)}, "ISERVE_TLS_CERT=.* has expired"),
        ({"cert_valid": (DAY, 2 * DAY)}, "ISERVE_TLS_CERT=.* is not valid yet"),
        ({"ca_valid": (-3 * DAY, -DAY)}, "ISERVE_TLS_CA=.*: its CA certificate expired on"),
        ({"ca_valid": (DAY, 2 * DAY)}, "ISERVE_TLS_CA=.*: its CA certificate is not valid before"),
        ({"usages": (EKU.CLIENT_AUTH,)}, "is refused as a TLS server certificate"),
    ],
)
def test_a_certificate_every_handshake_would_refuse_is_named_at_load(tmp_path, made, says, mutual):
    # Before, the settings loaded and the stack started; each call then failed with
    # gRPC's UNAVAILABLE "Handshake failed" naming no file.
    pki = make_pki(tmp_path / "pki", **made)
    with pytest.raises(ValueError, match=says):
        _served(_tls_env(tmp_path, pki, mutual))


def test_a_certificate_is_checked_against_the_ca_and_the_role_it_is_used_in(tmp_path):
    pki, other = make_pki(tmp_path / "pki"), make_pki(tmp_path / "other", "another CA")
    for env, says in [
        ({"ISERVE_TLS_CA": str(other["ca"])}, "is not issued by the CA in ISERVE_TLS_CA="),
        ({"ISERVE_TLS_CA": ""}, "not issued by a CA among the system's root certificates"),
    ]:
        with pytest.raises(ValueError, match=says):
            _served(_tls_env(tmp_path, pki, False, **env))
    # A server-only certificate serves plain TLS, but mutual TLS presents it as a client.
    server_only = make_pki(tmp_path / "server-only", usages=(EKU.SERVER_AUTH,))
    assert _served(_tls_env(tmp_path, server_only, False)).tls.serves
    with pytest.raises(ValueError, match="is refused as a TLS client certificate"):
        _served(_tls_env(tmp_path, server_only, True))


def test_a_client_certificate_is_checked_as_a_clients_only(tmp_path):
    """An operator's certificate made for clients alone (clientAuth) is what mutual TLS
    asks of the CLI; only a process that serves presents its certificate as a server."""
    client_only = make_pki(tmp_path / "client-only", usages=(EKU.CLIENT_AUTH,))
    env = _tls_env(tmp_path, client_only, True)
    checked = check_tls_identity(load_settings(env), serving=False)
    assert checked.tls.expires_at is not None
    with pytest.raises(ValueError, match="is refused as a TLS server certificate"):
        _served(env)
    other = make_pki(tmp_path / "other", "another CA")
    with pytest.raises(ValueError, match="is not issued by the CA in .*refuse every call"):
        mixed = _tls_env(tmp_path, client_only, True, ISERVE_TLS_CA=str(other["ca"]))
        check_tls_identity(load_settings(mixed), serving=False)
    expired = make_pki(tmp_path / "expired", cert_valid=(-2 * DAY, -DAY))
    with pytest.raises(ValueError, match="has expired"):
        check_tls_identity(load_settings(_tls_env(tmp_path, expired, True)), serving=False)
    # Without mutual TLS a client presents no certificate: nothing to check of it.
    unused = check_tls_identity(load_settings(_tls_env(tmp_path, expired, False)), serving=False)
    assert unused.tls.expires_at is None


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("ed25519", "an Ed25519 key; gRPC's TLS signs with RSA and ECDSA"),
        ("secp256k1", "an elliptic-curve key on secp256k1"),
        ("p256-empty-passphrase", "an encrypted key; gRPC reads unencrypted keys only"),
    ],
)
def test_a_key_openssl_takes_and_grpc_cannot_use_is_named_at_load(tmp_path, key, says):
    """Python's OpenSSL handshakes with these; gRPC's BoringSSL failed every call
    (Ed25519: NO_COMMON_SIGNATURE_ALGORITHMS), and a key encrypted with an empty
    passphrase made OpenSSL ask for it on the terminal, where `iserve` then hung."""
    if key.endswith("passphrase") and shutil.which("openssl") is None:
        pytest.skip("the openssl command writes the key")
    pki = make_pki(tmp_path / "pki", key=key)
    with pytest.raises(ValueError, match=f"ISERVE_TLS_KEY=.*: {says}"):
        load_settings(_tls_env(tmp_path, pki, True))


def test_a_tls_file_that_cannot_be_read_is_named(tmp_path, monkeypatch):
    # A permission error left the CLI with "[Errno 13] Permission denied", naming
    # neither the variable nor the file, and the services with a traceback.
    pki = make_pki(tmp_path / "pki")
    real_open = Path.open

    def refusing(self, *args, **kwargs):
        if self == pki["ca"]:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refusing)
    with pytest.raises(ValueError, match=r"ISERVE_TLS_CA='.*ca.pem': cannot be read \(Permission"):
        load_settings(_tls_env(tmp_path, pki, True))


def test_a_certificate_near_its_end_is_warned_of_at_start(tmp_path):
    pki = make_pki(tmp_path / "pki", cert_valid=(-DAY, 3 * DAY))
    settings = _served(_tls_env(tmp_path, pki, True))
    assert settings.tls.expires_at == pytest.approx(time.time() + 3 * 86400, abs=120)
    [warning] = tls_warnings(settings)
    assert "expires on" in warning and "(in 3.0 days)" in warning and str(pki["cert"]) in warning
    assert tls_warnings(settings, now=settings.tls.expires_at - 30 * 86400) == []
    assert tls_warnings(load_settings({"ISERVE_STATE_DIR": str(tmp_path)})) == []


def test_a_token_file_others_may_read_is_made_the_owners_alone(tmp_path):
    from services.cli.stack import write_stack_tokens

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    admin = tokens / "admin"
    admin.write_text("admin-token-placed-by-hand-0123\n")
    admin.chmod(0o644)
    settings = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_AUTH": "on"})
    written = write_stack_tokens(settings)
    assert written == [tokens / "service"]
    assert oct(admin.stat().st_mode & 0o777) == "0o600"
    assert oct((tokens / "service").stat().st_mode & 0o777) == "0o600"
    assert admin.read_text() == "admin-token-placed-by-hand-0123\n"


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("ISERVE_LOG_LEVEL", "bogus", "ISERVE_LOG_LEVEL must be one of"),
        ("ISERVE_NODE_ID", "", "ISERVE_NODE_ID must be"),
        ("ISERVE_NODE_ID", "a:b", "ISERVE_NODE_ID must be"),
        ("ISERVE_NODE_ID", "a b/c", "ISERVE_NODE_ID must be"),
    ],
)
def test_a_bad_log_level_or_node_id_is_refused_naming_it(variable, value, says, tmp_path):
    """The gateway died of uvicorn's KeyError on a bad level, the agent of a traceback on
    an empty node id; both now stop `iserve up` with the variable named."""
    from services.settings import load_settings

    with pytest.raises(ValueError, match=says):
        load_settings({"ISERVE_STATE_DIR": str(tmp_path), variable: value})
    assert load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_LOG_LEVEL": "debug"})
    node = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_NODE_ID": "gpu-07.rack2"})
    assert node.node_id == "gpu-07.rack2"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ISERVE_ENGINE", "foo"),
        ("ISERVE_CPU_COLLECTIVES", "mpi"),
        ("ISERVE_PROFILE_INPUT_TOKENS", "64,0"),
        ("ISERVE_PROFILE_BATCH_SIZES", "one"),
        ("ISERVE_PROFILE_TIMED_RUNS", "0"),
        # More than an agent takes in one job (RunProfilingJob's bounds).
        ("ISERVE_PROFILE_TIMED_RUNS", "101"),
        ("ISERVE_PROFILE_OUTPUT_TOKENS", ",".join(map(str, range(1, 18)))),
    ],
)
def test_settings_the_services_read_themselves_are_checked_before_up(variable, value):
    """Read only when workers start, a bad engine setting let `iserve up` come up healthy
    and failed every deploy; a bad ISERVE_PROFILE_* stopped the model service, and `up`
    only showed its log."""
    from services.settings import check_service_settings

    with pytest.raises(ValueError, match=variable):
        check_service_settings({variable: value})
    check_service_settings({})


def test_every_iserve_variable_the_code_reads_is_known_and_a_typo_is_named():
    """An ISERVE_* variable no process reads is warned of at `iserve up` and at each
    service's start, with the nearest known name (a misspelt one was ignored in silence
    and its default used); the known list is every name the code spells out."""
    import re
    from pathlib import Path

    from services.settings import KNOWN_VARIABLES, unknown_variables

    root = Path(__file__).resolve().parents[2]
    spelt = set(re.findall(r"ISERVE_[A-Z0-9_]*[A-Z0-9]\b", (root / "compose.yaml").read_text()))
    for package in ("services", "fingerprint_svc", "estimator_svc", "deploy_svc",
                    "scheduler_svc", "monitor_agent", "gateway_svc"):  # fmt: skip
        for path in (root / package).rglob("*.py"):
            spelt |= set(re.findall(r"ISERVE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert spelt - KNOWN_VARIABLES == set()
    assert "ISERVE_AGENT_METRICS_ADDR" in KNOWN_VARIABLES
    assert unknown_variables({"ISERVE_READY_TIMEOUT": "5", "ISERVE_READY_TIMEOUT_S": "5"}) == [
        "ISERVE_READY_TIMEOUT is set but no iserve process reads it; did you mean "
        "ISERVE_READY_TIMEOUT_S?"
    ]
    assert unknown_variables({"ISERVE_ZZZ": "1", "ISERVE_FOO": "1", "PATH": "/bin"}) == [
        "ISERVE_FOO is set but no iserve process reads it",
        "ISERVE_ZZZ is set but no iserve process reads it",
    ]
    # A name in the wrong case is the one it spells (ISERVE_Auth was offered ISERVE_TAG).
    assert unknown_variables({"ISERVE_Auth": "on", "iserve_devices": "2"}) == [
        "ISERVE_Auth is set but no iserve process reads it; did you mean ISERVE_AUTH? "
        "(names are upper case)",
        "iserve_devices is set but no iserve process reads it; did you mean ISERVE_DEVICES? "
        "(names are upper case)",
    ]


@pytest.mark.parametrize("mutual", [False, True])
def test_a_served_address_the_certificate_does_not_name_is_warned_of(tmp_path, mutual):
    """Before, such a certificate passed every check at start; each call to that address
    then failed with gRPC's "Hostname Verification Check failed"."""
    pki = make_pki(tmp_path / "pki", names=("localhost", "127.0.0.1", "*.iserve.internal"))
    settings = _served(_tls_env(tmp_path, pki, mutual))
    named = {
        "ISERVE_MODEL_ADDR": "127.0.0.1:50061",
        "ISERVE_DEPLOY_ADDR": "localhost:0",
        "ISERVE_AGENT_ADDR": "node7.iserve.internal:50065",
        "ISERVE_SCHEDULER_ADDR": "0.0.0.0:50064",  # bound everywhere: nobody dials it
    }
    assert certificate_name_warnings(settings, named) == []
    unnamed = {
        "ISERVE_MODEL_ADDR": "10.0.0.5:50061",
        "ISERVE_ESTIMATOR_ADDR": "10.0.0.5:50062",
        "ISERVE_AGENT_ADDR": "a.b.iserve.internal:50065",  # a wildcard covers one label
    }
    first, second = certificate_name_warnings(settings, unnamed)
    assert (
        "does not name '10.0.0.5' (the host of ISERVE_ESTIMATOR_ADDR, ISERVE_MODEL_ADDR)" in first
    )
    assert str(pki["cert"]) in first and "subjectAltName" in first
    assert "does not name 'a.b.iserve.internal'" in second
    # Clients then check ISERVE_TLS_SERVER_NAME instead of each address's host.
    overridden = _served(_tls_env(tmp_path, pki, mutual, ISERVE_TLS_SERVER_NAME="localhost"))
    assert certificate_name_warnings(overridden, unnamed) == []
    wrong = _served(_tls_env(tmp_path, pki, mutual, ISERVE_TLS_SERVER_NAME="gateway.example"))
    [warning] = certificate_name_warnings(wrong, named)
    assert "does not name 'gateway.example' (ISERVE_TLS_SERVER_NAME)" in warning
    assert (
        certificate_name_warnings(load_settings({"ISERVE_STATE_DIR": str(tmp_path)}), unnamed) == []
    )


@pytest.mark.parametrize(
    ("written", "said"),
    [
        ("null", "(null, not an object)"),
        ("[1]", "([1], not an object)"),
        ('{"addresses": 5}', "('addresses' is 5)"),
        ('{"addresses": {"model": 5}}', "('addresses'['model'] is 5)"),
        ('{"pids": {"agent": true}}', "('pids'['agent'] is true)"),
        ("{bad", "(not JSON: "),
    ],
)
def test_a_stack_file_iserve_up_did_not_write_is_named_not_a_traceback(
    tmp_path, monkeypatch, capsys, written, said
):
    """Every command crashed with an AttributeError on a stack.json of `null`, and `iserve
    down` said "no stack recorded" of an undecodable one and exited 0 (a probe)."""
    from services.cli.main import main

    (tmp_path / "stack.json").write_text(written)
    monkeypatch.setenv("ISERVE_STATE_DIR", str(tmp_path))
    for command in (["down"], ["models"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert f"{tmp_path / 'stack.json'} is not a stack record `iserve up` wrote {said}" in err
        assert "Traceback" not in err and err.count("\n") == 1, err
    assert (tmp_path / "stack.json").read_text() == written  # changes nothing


@pytest.mark.skipif(not shutil.which("openssl"), reason="needs the openssl command")
def test_the_security_pages_openssl_recipe_makes_files_a_mutual_tls_stack_takes(tmp_path):
    """docs/security.md's commands, run as written (in a temporary directory): the
    certificate serves and dials every process under mutual TLS (a tester had no recipe)."""
    import re
    import subprocess

    page = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    (block,) = re.findall(r"```bash\n(mkdir -p ~/.iserve/tls.*?)```", page, re.S)
    script = block.replace("~/.iserve/tls", str(tmp_path)).replace("iserve up\n", "")
    subprocess.run(["bash", "-ec", script], check=True, capture_output=True, timeout=60)
    env = {
        "ISERVE_TLS_CERT": str(tmp_path / "iserve.pem"),
        "ISERVE_TLS_KEY": str(tmp_path / "iserve.key"),
        "ISERVE_TLS_CA": str(tmp_path / "ca.pem"),
        "ISERVE_TLS_CLIENT_AUTH": "on",
    }
    for serving in (True, False):
        checked = check_tls_identity(load_settings(env), serving=serving)
        assert checked.tls.expires_at > time.time() + 80 * 86400
    assert tls_warnings(load_settings(env)) == []
