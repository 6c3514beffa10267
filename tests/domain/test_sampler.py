import pytest

from rolloutd.checkpoint import sidecar
from rolloutd.domain.errors import ResourceExhausted
from rolloutd.domain.group import Position, Prompt
from rolloutd.domain.sampler import Admission, Sampler, fleet_share

PROMPTS = [Prompt(f"p{i}", f"text {i}") for i in range(10)]


def drain(sampler, n):
    return [sampler.next() for _ in range(n)]


def test_same_seed_same_order_and_epochs_differ():
    a = [x.prompt.prompt_id for x in drain(Sampler(PROMPTS, seed=3), 20)]
    b = [x.prompt.prompt_id for x in drain(Sampler(PROMPTS, seed=3), 20)]
    assert a == b
    assert sorted(a[:10]) == sorted(p.prompt_id for p in PROMPTS)  # each epoch is a permutation
    assert a[:10] != a[10:]  # a fresh permutation per epoch
    assert a != [x.prompt.prompt_id for x in drain(Sampler(PROMPTS, seed=4), 20)]


def test_cursor_positions_and_epoch_limit():
    s = Sampler(PROMPTS, seed=0, epochs=2)
    positions = [x.position for x in drain(s, 20)]
    assert positions[0] == Position(0, 0) and positions[9] == Position(0, 9)
    assert positions[10] == Position(1, 0)
    assert s.exhausted and s.next() is None and not s.has_next()


def test_restored_cursor_continues_exactly():
    s = Sampler(PROMPTS, seed=1)
    drain(s, 13)
    state = sidecar.sampler_to_json(s.capture())
    rest = [x.prompt.prompt_id for x in drain(s, 9)]
    t = Sampler(PROMPTS, seed=1)
    t.restore(sidecar.sampler_from_json(state))
    assert t.cursor == Position(1, 3)
    assert [x.prompt.prompt_id for x in drain(t, 9)] == rest


def test_submitted_prompts_first_idempotent_and_bounded():
    s = Sampler(PROMPTS, seed=0, max_pending=3)
    assert s.submit([Prompt("x", "a"), Prompt("y", "b"), Prompt("x", "a")]) == (2, 1)
    assert s.submit([Prompt("x", "a")]) == (0, 1)
    with pytest.raises(ResourceExhausted, match="max_pending_prompts=3"):
        s.submit([Prompt("z1", "c"), Prompt("z2", "d")])
    first = s.next()
    assert first.prompt.prompt_id == "x" and first.position is None
    assert s.next().prompt.prompt_id == "y"
    assert s.next().position == Position(0, 0)


def test_readmitted_prompts_come_first_and_survive_state():
    s = Sampler(PROMPTS, seed=0)
    a = s.next()
    s.readmit(Admission(a.prompt, a.position))
    t = Sampler(PROMPTS, seed=0)
    t.restore(sidecar.sampler_from_json(sidecar.sampler_to_json(s.capture())))
    again = t.next()
    assert again.position == a.position and again.prompt == a.prompt


def test_capture_is_a_stable_cut_while_the_sampler_moves_on():
    s = Sampler(PROMPTS, seed=0)
    s.submit([Prompt("a", "x")])
    cut = s.capture()
    s.submit([Prompt("b", "y")])
    s.next()
    state = sidecar.sampler_to_json(cut)
    assert cut.submitted_prompts == [Prompt("a", "x")]
    assert state["submitted_len"] == 1 and state["submitted_head"] == 0


def test_skipped_positions_are_never_admitted():
    s = Sampler(PROMPTS, seed=0, epochs=1)
    s.skip(Admission(PROMPTS[0], Position(0, 1)))
    s.skip(Admission(PROMPTS[0], Position(0, 2)))
    positions = [a.position for a in iter(s.next, None)]
    assert Position(0, 1) not in positions and Position(0, 2) not in positions
    assert len(positions) == len(PROMPTS) - 2


def test_a_fleet_shares_the_dataset_once_with_a_fixed_owner_per_prompt():
    prompts = [Prompt(f"p{i}", f"q{i}") for i in range(10)]
    owners: dict[str, list[int]] = {}
    for epoch in range(2):
        for replica in range(3):
            s = Sampler(fleet_share(prompts, replica, 3), seed=5, epochs=epoch + 1)
            while (a := s.next()) is not None:
                if a.position is not None and a.position.epoch == epoch:
                    owners.setdefault(a.prompt.prompt_id, []).append(replica)
    assert sorted(owners) == sorted(p.prompt_id for p in prompts)  # the union is the dataset
    assert all(len(set(r)) == 1 and len(r) == 2 for r in owners.values())  # once an epoch, same
    with pytest.raises(ValueError, match="not within a fleet of 3"):
        fleet_share(prompts, 3, 3)
