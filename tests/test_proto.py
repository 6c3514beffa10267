"""The committed stubs match the .proto, and the .proto is buf-lint clean."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubs_do_not_drift_from_the_proto():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_buf_lint_is_clean():
    buf = Path(sys.executable).parent / "buf"
    r = subprocess.run([str(buf), "lint"], cwd=ROOT / "proto", capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_field_names_clients_rely_on():
    from rolloutd.v1 import rollout_pb2 as pb

    expected = {
        "FetchGroupsRequest": {"max_groups", "wait_ms", "consumer"},
        "FetchGroupsResponse": {"lease_id", "groups"},
        "Group": {"group_id", "prompt_id", "epoch", "samples"},
        "Sample": {
            "index",
            "token_ids",
            "logprobs",
            "text",
            "finish_reason",
            "policy_version",
            "prompt_token_ids",
        },
        "AckGroupsRequest": {"lease_id", "trainer_step"},
        "SubmitPromptsRequest": {"prompts"},
        "Prompt": {"prompt_id", "text", "metadata"},
        "CheckpointRequest": {"trainer_step", "tag"},
        "CheckpointResponse": {"outcome", "reason", "sequence", "phase_seconds"},
        "RewindRequest": {"trainer_step"},
        "UpdateWeightsRequest": {"version", "weights_path"},
    }
    for message, fields in expected.items():
        have = set(pb.DESCRIPTOR.message_types_by_name[message].fields_by_name)
        assert fields <= have, f"{message} lacks {fields - have}"


def test_the_stub_generator_is_pinned_to_the_version_the_stubs_demand():
    """A fresh install resolves the newest grpcio-tools unless it is pinned, and a newer generator
    writes a newer GRPC_GENERATED_VERSION, which the drift check above reads as out of date; the
    grpcio floor must be that version too, or the stubs refuse to import."""
    import re
    import tomllib

    stub = (ROOT / "service" / "rolloutd" / "v1" / "rollout_pb2_grpc.py").read_text()
    generated = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", stub).group(1)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"grpcio-tools=={generated}" in project["optional-dependencies"]["dev"]
    assert f"grpcio>={generated}" in project["dependencies"]
