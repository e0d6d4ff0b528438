from __future__ import annotations

import json

import pytest

from services.settings import DEFAULT_PORTS, GIB, load_settings


def test_defaults(tmp_path):
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path)})
    assert s.state_dir == tmp_path.resolve()
    assert s.models_root == (tmp_path / "models").resolve()
    assert s.address("deploy") == f"127.0.0.1:{DEFAULT_PORTS['deploy']}"
    assert s.redis_url is None
    assert s.virtual_devices == 2 and s.device_memory_bytes == 4 * GIB
    assert s.drain_timeout_s == 30.0


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
        ("ISERVE_DEVICE_MEMORY_GIB", "-1"),
        ("ISERVE_DRAIN_TIMEOUT_S", "0"),
        ("ISERVE_DRAIN_TIMEOUT_S", "soon"),
    ],
)
def test_bad_values_are_named(tmp_path, name, value):
    with pytest.raises(ValueError, match=name):
        load_settings({"ISERVE_STATE_DIR": str(tmp_path), name: value})


def test_the_drain_timeout_may_be_a_fraction_of_a_second(tmp_path):
    s = load_settings({"ISERVE_STATE_DIR": str(tmp_path), "ISERVE_DRAIN_TIMEOUT_S": "0.5"})
    assert s.drain_timeout_s == 0.5
