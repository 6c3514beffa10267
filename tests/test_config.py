import pytest

from rolloutd.config import ConfigError, load_config


def test_defaults_are_valid():
    c = load_config(environ={})
    assert c.grpc.port == 50051 and c.http.port == 8080
    assert c.checkpoint.dir == "./.rolloutd/checkpoints"


def test_file_then_environment_then_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("group_size: 8\nlimits:\n  max_in_flight: 4\ncheckpoint:\n  interval_s: 5\n")
    c = load_config(
        f,
        {"checkpoint.interval_s": 7.5},
        environ={"ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "6", "ROLLOUTD_GROUP_SIZE": "16"},
    )
    assert c.group_size == 16 and c.limits.max_in_flight == 6 and c.checkpoint.interval_s == 7.5


@pytest.mark.parametrize(
    ("tree", "environ", "key"),
    [
        ({"group_size": 0}, {}, "group_size"),
        ({"limits.max_in_flight": -1}, {}, "limits.max_in_flight"),
        ({"engine.kind": "tpu"}, {}, "engine.kind"),
        ({}, {"ROLLOUTD_CHECKPOINT__KEEP_LATESTT": "3"}, "checkpoint.keep_latestt"),
        ({"recovery.granularity": "row"}, {}, "recovery.granularity"),
    ],
)
def test_errors_name_the_key(tree, environ, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(overrides=tree, environ=environ)


def test_cross_field_check():
    with pytest.raises(ConfigError, match="max_in_flight must not exceed"):
        load_config(overrides={"limits.max_in_flight": 10, "limits.buffer_capacity": 5}, environ={})


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "sometimes", None])
def test_max_in_flight_is_a_positive_int_or_auto(value):
    with pytest.raises(
        ConfigError, match=r"'limits\.max_in_flight': .*must be a positive int or auto"
    ):
        load_config(overrides={"limits.max_in_flight": value}, environ={})


def test_max_in_flight_auto_follows_the_engine_up_to_its_ceiling():
    c = load_config(
        environ={
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "auto",
            "ROLLOUTD_LIMITS__MAX_IN_FLIGHT_CEILING": "48",
            "ROLLOUTD_LIMITS__KV_CACHE_SOFT_LIMIT": "0.8",
        }
    )
    controller = c.controller()
    assert controller.max_in_flight == c.limits.in_flight_cap == 48
    assert controller.concurrency is not None
    assert (controller.concurrency.ceiling, controller.concurrency.kv_cache_soft_limit) == (48, 0.8)
    assert load_config(environ={}).controller().concurrency is None  # a number: fixed
    with pytest.raises(ConfigError, match=r"limits\.max_in_flight_ceiling must not exceed"):
        load_config(
            overrides={"limits.max_in_flight": "auto", "limits.max_in_flight_ceiling": 300},
            environ={},
        )
    with pytest.raises(ConfigError, match=r"'limits\.kv_cache_soft_limit'"):
        load_config(overrides={"limits.kv_cache_soft_limit": 1.5}, environ={})


def test_staleness_gating_is_on_unless_turned_off():
    assert load_config(environ={}).controller().staleness_gating
    off = load_config(overrides={"limits.staleness_gating": False}, environ={})
    assert not off.controller().staleness_gating


def test_bad_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.yaml", environ={})


def test_restore_takes_a_bare_sequence_number_from_yaml_or_environment(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("restore: 42\n")
    assert load_config(f, environ={}).restore == "42"
    assert load_config(environ={"ROLLOUTD_RESTORE": "7"}).restore == "7"


KUBELET_SERVICE_LINKS = {
    # Service "rolloutd-admin" (ClusterIP, port "admin" 8080), as kubelet writes it.
    "ROLLOUTD_ADMIN_SERVICE_HOST": "10.96.0.12",
    "ROLLOUTD_ADMIN_SERVICE_PORT": "8080",
    "ROLLOUTD_ADMIN_SERVICE_PORT_ADMIN": "8080",
    "ROLLOUTD_ADMIN_PORT": "tcp://10.96.0.12:8080",
    "ROLLOUTD_ADMIN_PORT_8080_TCP": "tcp://10.96.0.12:8080",
    "ROLLOUTD_ADMIN_PORT_8080_TCP_PROTO": "tcp",
    "ROLLOUTD_ADMIN_PORT_8080_TCP_PORT": "8080",
    "ROLLOUTD_ADMIN_PORT_8080_TCP_ADDR": "10.96.0.12",
    # Service "rolloutd" given a cluster IP (not headless), UDP on a second port.
    "ROLLOUTD_SERVICE_HOST": "10.96.0.13",
    "ROLLOUTD_SERVICE_PORT": "50051",
    "ROLLOUTD_PORT": "tcp://10.96.0.13:50051",
    "ROLLOUTD_PORT_9000_UDP_ADDR": "10.96.0.13",
}


def test_kubelet_service_links_are_not_configuration():
    c = load_config(environ={**KUBELET_SERVICE_LINKS, "ROLLOUTD_GROUP_SIZE": "8"})
    assert c.group_size == 8
    assert c == load_config(environ={"ROLLOUTD_GROUP_SIZE": "8"})


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("ROLLOUTD_GROUPSIZE", "groupsize"),
        ("ROLLOUTD_GRPC__PORT_8080_TCP", "grpc.port_8080_tcp"),
        ("ROLLOUTD_HTTP__SERVICE_PORT", "http.service_port"),
        ("ROLLOUTD_ADMIN_SERVICE_HOSTNAME", "admin_service_hostname"),
        ("ROLLOUTD_ADMIN_PORT_8080_HTTP", "admin_port_8080_http"),
    ],
)
def test_mistyped_keys_are_still_refused_beside_service_links(name, key):
    with pytest.raises(ConfigError, match=f"'{key}': unknown key"):
        load_config(environ={**KUBELET_SERVICE_LINKS, name: "1"})


def test_fleet_from_flags_or_environment_and_checked():
    c = load_config(environ={"ROLLOUTD_FLEET__REPLICA": "2", "ROLLOUTD_FLEET__REPLICAS": "4"})
    assert (c.fleet.replica, c.fleet.replicas) == (2, 4)
    assert (c.controller().replica, c.controller().replicas) == (2, 4)
    assert c.semantic_fingerprint("d", "m")["fleet.replicas"] == 4
    assert load_config(environ={}).fleet.replicas == 1
    with pytest.raises(ConfigError, match=r"fleet\.replica must be below fleet\.replicas"):
        load_config(overrides={"fleet.replica": 3, "fleet.replicas": 3}, environ={})


@pytest.mark.parametrize(
    ("granularity", "captured"),
    [(None, True), ("token", True), ("sibling", False), ("group", False)],
)
def test_only_token_granularity_streams_partial_siblings(granularity, captured):
    environ = {} if granularity is None else {"ROLLOUTD_RECOVERY__GRANULARITY": granularity}
    assert load_config(environ=environ).controller().capture_partials is captured


def test_stop_strings_reach_the_sampling_params():
    config = load_config(environ={"ROLLOUTD_ENGINE__STOP": '["</s>", "Answer:"]'})
    assert config.controller().sampling.stop == ("</s>", "Answer:")


def test_both_ports_bind_loopback_unless_told_otherwise():
    """`rolloutd serve` with no flags (`make run`) is reachable from this machine only."""
    config = load_config(environ={})
    assert (config.grpc.host, config.http.host) == ("127.0.0.1", "127.0.0.1")
    assert config.unauthenticated_binds() == []


@pytest.mark.parametrize(
    ("overrides", "open_ports"),
    [
        ({"grpc.host": "0.0.0.0"}, ["grpc.host"]),
        ({"grpc.host": "::", "http.host": "10.0.0.5"}, ["grpc.host", "http.host"]),
        ({"grpc.host": "rolloutd.example"}, ["grpc.host"]),  # a name could resolve to anything
        ({"grpc.host": "::1", "http.host": "localhost"}, []),
        ({"grpc.host": "127.0.0.2"}, []),
        ({"grpc.host": "0.0.0.0", "http.host": "0.0.0.0", "auth.token": "t0ken"}, []),
        ({"http.host": "0.0.0.0", "http.enabled": False}, []),
    ],
)
def test_public_binds_without_authentication(overrides, open_ports):
    assert load_config(overrides=overrides, environ={}).unauthenticated_binds() == open_ports


def test_mutual_tls_authenticates_a_port_too(tmp_path):
    tls = {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_client_ca": "ca.pem"}
    overrides = {f"{port}.{k}": v for port in ("grpc", "http") for k, v in tls.items()}
    overrides |= {"grpc.host": "0.0.0.0", "http.host": "0.0.0.0"}
    assert load_config(overrides=overrides, environ={}).unauthenticated_binds() == []


@pytest.mark.parametrize("overrides", [{"http.tls_cert": "c.pem"}, {"http.tls_client_ca": "a"}])
def test_admin_tls_keys_go_together(overrides):
    with pytest.raises(ConfigError, match=r"http\.tls_"):
        load_config(overrides=overrides, environ={})


def test_a_token_from_a_file_loses_its_newline_and_must_be_sendable():
    environ = {"ROLLOUTD_AUTH__TOKEN": "0123abcd\n"}
    assert load_config(environ=environ).auth.token == "0123abcd"
    for bad in ("two words", "tök", "   "):
        with pytest.raises(ConfigError, match=r"config key 'auth\.token'"):
            load_config(overrides={"auth.token": bad}, environ={})


@pytest.mark.parametrize(("raw", "umask"), [("027", 0o027), ("0o007", 0o007), ("0", 0)])
def test_the_umask_is_octal(raw, umask):
    assert load_config(environ={"ROLLOUTD_UMASK": raw}).umask == umask
    assert load_config(environ={}).umask == 0o077


def test_a_umask_that_is_not_octal_names_the_key():
    with pytest.raises(ConfigError, match=r"config key 'umask'"):
        load_config(environ={"ROLLOUTD_UMASK": "0o9"})


def test_the_switch_interval_is_half_a_millisecond_unless_set_and_a_bad_one_names_the_key():
    assert load_config(environ={}).switch_interval_ms == 0.5
    assert load_config(environ={"ROLLOUTD_SWITCH_INTERVAL_MS": "5"}).switch_interval_ms == 5.0
    with pytest.raises(ConfigError, match=r"config key 'switch_interval_ms'"):
        load_config(environ={"ROLLOUTD_SWITCH_INTERVAL_MS": "0"})
