"""tf_dlt.cluster_from_env: TF_CONFIG parsing, with errors naming the field."""

from __future__ import annotations

import json

import pytest

import tf_dlt
from tf_dlt.cluster import ClusterSpec, parse


def test_reads_shards_workers_and_task() -> None:
    config = {
        "cluster": {"ps": ["ps-0:7000", "ps-1:7000"], "worker": ["t-0:1", "t-1:1", "t-2:1"]},
        "task": {"type": "worker", "index": 2},
    }
    spec = tf_dlt.cluster_from_env({"TF_CONFIG": json.dumps(config)})
    assert spec.pservers == ["ps-0:7000", "ps-1:7000"]
    assert (spec.num_workers, spec.task_type, spec.task_index) == (3, "worker", 2)
    assert not spec.is_chief and not spec.embedded
    assert parse(spec.to_env()) == spec


def test_a_shard_may_list_its_standbys() -> None:
    config = {"cluster": {"ps": ["ps-0:7000|ps-0b:7000", "ps-1:7000"], "worker": ["t:1"]}}
    spec = tf_dlt.cluster_from_env({"TF_CONFIG": json.dumps(config)})
    assert spec.pservers == ["ps-0:7000|ps-0b:7000", "ps-1:7000"]


def test_without_tf_config_a_single_embedded_chief() -> None:
    for env in ({}, {"TF_CONFIG": "  "}):
        spec = tf_dlt.cluster_from_env(env)
        assert spec == ClusterSpec() and spec.embedded and spec.is_chief
        assert spec.num_workers == 1


def test_ps_task_is_not_a_chief() -> None:
    spec = parse('{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}, "task": {"type": "ps"}}')
    assert spec.task_type == "ps" and not spec.is_chief


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[]", "must be a JSON object"),
        ('{"cluster": []}', '"cluster" must be an object'),
        ('{"cluster": {"evaluatorz": []}}', "unknown jobs \\['evaluatorz'\\]"),
        ('{"cluster": {"ps": "a:1"}}', 'job "ps" must be a list of "host:port"'),
        ('{"cluster": {"ps": ["no-port"]}}', 'job "ps" must be a list of "host:port"'),
        ('{"cluster": {"ps": ["a:1|b"]}}', 'job "ps" must be a list of "host:port"'),
        ('{"cluster": {"chief": ["c:1"]}}', "worker 0 is the chief"),
        ('{"task": {"type": "boss"}}', "task type must be one of"),
        ('{"task": {"index": "1"}}', "task index must be an int"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"index": 1}}', "task index 1 is outside"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "ps"}}', "task index 0 is outside"),
        (
            '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker"}}',
            'no task index, and job "worker" has 2 entries',
        ),
        ('{"cluster": {"worker": ["a:1", "b:1"]}}', 'no task index, and job "worker" has 2'),
        ('{"cluster": {"ps": ["a:1", "b:1"]}, "task": {"type": "ps"}}', 'job "ps" has 2 entries'),
    ],
)
def test_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"TF_CONFIG: .*{message}"):
        parse(text)


def test_task_index_from_an_indexed_job() -> None:
    config = '{"cluster": {"ps": ["p:1"], "worker": ["a:0", "b:0"]}, "task": {"type": "worker"}}'
    env = {"TF_CONFIG": config, "JOB_COMPLETION_INDEX": "1"}
    assert tf_dlt.cluster_from_env(env).task_index == 1
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX must be a non-negative int"):
        tf_dlt.cluster_from_env({**env, "JOB_COMPLETION_INDEX": "x"})
    with pytest.raises(ValueError, match="task index 2 is outside"):
        tf_dlt.cluster_from_env({**env, "JOB_COMPLETION_INDEX": "2"})
    null = config.replace('{"type": "worker"}', '{"type": "worker", "index": null}')
    assert tf_dlt.cluster_from_env({**env, "TF_CONFIG": null}).task_index == 1
