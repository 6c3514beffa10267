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
