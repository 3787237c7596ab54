"""The record codec: every record type survives encode/decode unchanged, and each kind of
malformed payload is a RecordError that names the offending field."""

from __future__ import annotations

import orjson
import pytest

from pipeline_rl.streams.records import (
    DeadLetter,
    Metrics,
    MicroBatch,
    RecordError,
    Rollout,
    RolloutGroup,
    WeightUpdate,
    decode,
    encode,
)


def rollout(n: int = 3, **extra) -> Rollout:
    return Rollout(
        prompt_ids=[5, 6],
        completion_ids=list(range(n)),
        logprobs=[-0.1 * (i + 1) for i in range(n)],
        versions=[2] * n,
        reward=0.5,
        finish_reason="stop",
        **extra,
    )


def micro_batch(**extra) -> MicroBatch:
    return MicroBatch(
        step=3,
        index=1,
        count=2,
        input_ids=[1, 2, 3, 4, 5],
        position_ids=[0, 1, 2, 0, 1],
        loss_mask=[0, 1, 1, 0, 1],
        advantages=[0.0, 0.25, 0.25, 0.0, -1.5],
        old_logprobs=[0.0, -0.3, -1e-9, 0.0, -12.75],
        versions=[-1, 4, 4, -1, 5],
        seq_lengths=[3, 2],
        sample_versions=[4, 5],
        group_ids=["g1", "g2"],
        rewards=[1.0, 0.0],
        step_tokens=9,
        step_samples=4,
        **extra,
    )


RECORDS = [
    RolloutGroup(problem_id="p1", group_id="g1", rollouts=[rollout(), rollout(0)], actor=2, metadata={"a": [1]}),
    RolloutGroup(
        problem_id="p2",
        group_id="g2",
        rollouts=[
            rollout(
                4,
                mask=[1, 0, 0, 1],
                token_rewards=[0.0, 0.0, 0.0, 1.0],
                ref_logprobs=[-0.2, 0.0, 0.0, -3.25],
                metadata={"turns": 2},
            )
        ],
    ),
    RolloutGroup(problem_id="p3", group_id="g3", rollouts=[]),
    micro_batch(),
    micro_batch(ref_logprobs=[0.0, -0.5, -0.5, 0.0, -0.125]),
    WeightUpdate(
        version=7,
        names=["w", "b"],
        shapes=[[2, 3], []],
        dtypes=["float32", "bfloat16"],
        bucket_sizes=[2],
        group="7-ab",
        plan="1",
    ),
    Metrics(process="trainer0", time=12.5, values={"loss": 0.1, "nested": {"x": [1, 2]}}, step=4),
    Metrics(process="actor0", time=1.0, values={}),
    DeadLetter(topic="actor", partition=0, offset="17-0", error="bad", payload='{"x": 1'),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_round_trip_keeps_every_field(record):
    got = decode(encode(record), type(record))
    assert type(got) is type(record) and got == record
    if isinstance(record, RolloutGroup):
        assert all(type(r) is Rollout for r in got.rollouts)
    assert decode(encode(got), type(record)) == record  # a decoded record encodes again


def test_left_out_optional_fields_get_their_defaults():
    payload = orjson.dumps(
        {
            "kind": "rollout_group",
            "problem_id": "p",
            "group_id": "g",
            "rollouts": [
                {
                    "prompt_ids": [1],
                    "completion_ids": [2],
                    "logprobs": [-0.5],
                    "versions": [0],
                    "reward": 1,
                    "finish_reason": "stop",
                }
            ],
        }
    )
    group = decode(payload, RolloutGroup)
    assert group.actor == 0 and group.metadata == {}
    r = group.rollouts[0]
    assert r.mask is None and r.token_rewards is None and r.ref_logprobs is None and r.metadata == {}
    # Defaults are fresh objects, not shared between records.
    r.metadata["x"] = 1
    assert decode(payload, RolloutGroup).rollouts[0].metadata == {}


def group_payload(**rollout_changes) -> dict:
    data = orjson.loads(encode(RolloutGroup(problem_id="p", group_id="g", rollouts=[rollout(), rollout()])))
    for key, value in rollout_changes.items():
        if value is ...:
            del data["rollouts"][1][key]
        else:
            data["rollouts"][1][key] = value
    return data


def mb_payload(**changes) -> dict:
    data = orjson.loads(encode(micro_batch()))
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "payload, expected, message",
    [
        (b'{"kind": "rollout_group", "problem_id": "p"', RolloutGroup, "not valid JSON"),
        (b"[1, 2]", RolloutGroup, "expected a 'rollout_group' record, got 'list'"),
        (
            encode(Metrics(process="p", time=0.0, values={})),
            RolloutGroup,
            "expected a 'rollout_group' record, got 'metrics'",
        ),
        (
            {"kind": "rollout_group", "problem_id": "p", "group_id": "g"},
            RolloutGroup,
            "rollout_group: Object missing required field `rollouts`",
        ),
        (
            {"kind": "rollout_group", "problem_id": 3, "group_id": "g", "rollouts": []},
            RolloutGroup,
            "rollout_group.problem_id: Expected `str`, got `int`",
        ),
        (
            {"kind": "rollout_group", "problem_id": "p", "group_id": "g", "rollouts": {}},
            RolloutGroup,
            "rollout_group.rollouts: Expected `array`, got `object`",
        ),
        (
            {"kind": "rollout_group", "problem_id": "p", "group_id": "g", "rollouts": [], "extra": 1},
            RolloutGroup,
            "rollout_group: Object contains unknown field `extra`",
        ),
        (
            {"kind": "rollout_group", "problem_id": "p", "group_id": "g", "rollouts": [], "actor": True},
            RolloutGroup,
            "rollout_group.actor: Expected `int`, got `bool`",
        ),
        (
            {"kind": "rollout_group", "problem_id": "p", "group_id": "g", "rollouts": [7]},
            RolloutGroup,
            "rollout_group.rollouts[0]: Expected `object`, got `int`",
        ),
        (
            group_payload(logprobs=...),
            RolloutGroup,
            "rollout_group.rollouts[1]: Object missing required field `logprobs`",
        ),
        (
            group_payload(logprobs="AAAA"),
            RolloutGroup,
            "rollout_group.rollouts[1].logprobs: Expected `array`, got `str`",
        ),
        (group_payload(reward=None), RolloutGroup, "rollout_group.rollouts[1].reward: Expected `float`, got `null`"),
        (group_payload(reward="1"), RolloutGroup, "rollout_group.rollouts[1].reward: Expected `float`, got `str`"),
        (
            group_payload(metadata=[]),
            RolloutGroup,
            "rollout_group.rollouts[1].metadata: Expected `object`, got `array`",
        ),
        (
            group_payload(versions=[0]),
            RolloutGroup,
            "rollout_group.rollouts[1].versions: length 1 != len(completion_ids) 3",
        ),
        (group_payload(mask=[1, 1]), RolloutGroup, "rollout_group.rollouts[1].mask: length 2 != len(completion_ids) 3"),
        (group_payload(bogus=1), RolloutGroup, "rollout_group.rollouts[1]: Object contains unknown field `bogus`"),
        (
            group_payload(logprobs=[-0.5, "x", -0.5]),
            RolloutGroup,
            "rollout_group.rollouts[1].logprobs[1]: Expected `float`, got `str`",
        ),
        # orjson writes a NaN as null: the reader refuses it rather than hand a None to torch.
        (
            group_payload(logprobs=[-0.5, float("nan"), -0.5]),
            RolloutGroup,
            "rollout_group.rollouts[1].logprobs[1]: Expected `float`, got `null`",
        ),
        (mb_payload(input_ids=[1, 2, 3.5, 4, 5]), MicroBatch, "micro_batch.input_ids[2]: Expected `int`, got `float`"),
        (mb_payload(advantages=[0.0]), MicroBatch, "micro_batch.advantages: length 1 != len(input_ids) 5"),
        (mb_payload(group_ids=["g"]), MicroBatch, "micro_batch.group_ids: length 1 != number of sequences 2"),
        (mb_payload(seq_lengths=[3, 3]), MicroBatch, "micro_batch.seq_lengths: sum 6 != len(input_ids) 5"),
        (mb_payload(seq_lengths=[3, "2"]), MicroBatch, "micro_batch.seq_lengths[1]: Expected `int`, got `str`"),
        (mb_payload(step=1.5), MicroBatch, "micro_batch.step: Expected `int`, got `float`"),
        (mb_payload(ref_logprobs=[0.0]), MicroBatch, "micro_batch.ref_logprobs: length 1 != len(input_ids) 5"),
        (
            {"kind": "metrics", "process": "p", "time": 0.0, "values": {}, "step": "4"},
            Metrics,
            "metrics.step: Expected `int | null`, got `str`",
        ),
        (
            {"kind": "weight_update", "version": 1, "names": [], "shapes": [], "dtypes": []},
            WeightUpdate,
            "weight_update: Object missing required field `bucket_sizes`",
        ),
    ],
)
def test_malformed_payload_is_a_record_error_naming_the_field(payload, expected, message):
    raw = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    with pytest.raises(RecordError) as info:
        decode(raw, expected)
    assert message in str(info.value)


def reversed_fields(value):
    """`value` with the fields of every object in reverse order (encode writes declaration order)."""
    if isinstance(value, dict):
        return {k: reversed_fields(v) for k, v in reversed(value.items())}
    if isinstance(value, list):
        return [reversed_fields(v) for v in value]
    return value


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_fields_in_any_order_decode_alike(record):
    payload = orjson.dumps(reversed_fields(orjson.loads(encode(record))))
    assert decode(payload, type(record)) == record


def test_a_bad_field_is_named_whatever_the_field_order():
    data = reversed_fields(group_payload(reward="1"))
    with pytest.raises(RecordError, match=r"rollout_group\.rollouts\[1\]\.reward: Expected `float`, got `str`"):
        decode(orjson.dumps(data), RolloutGroup)
