"""The job spec's one table (rdzv_common/spec_table.py) and what it drives:
``JobSpec`` held equal to it (names, order, defaults, what each field takes
and refuses), job records, rdzv-agent's flags and ``--rdzv-conf`` keys, and the
torchrun plugin's. Every test walks the table: a new entry is covered by them
all without a line here."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest
from pydantic import ValidationError

from rdzv_client.config import AgentConfig, build_parser, config_from_args
from rdzv_client.spec_flags import SPEC_GROUP, conf_spec
from rdzv_common.protocol import JobSpec
from rdzv_common.spec_table import DEFAULTS, FIELDS, SAME, SPEC_FIELDS, SpecField, check_spec, spec_record
from rdzv_server import rounds

BASE = ["--endpoint", "127.0.0.1:1", "--job-id", "j"]
NODES = {"min_nodes": 1, "max_nodes": 2}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("PET_", "RDZV_", "SLURM_")):
            monkeypatch.delenv(name)


def probes(f: SpecField) -> list[Any]:
    """Values at and beyond the field's bounds, and of wrong types."""
    wrong = [True, None, "1", [1]]
    if f.kind == "count":
        return [f.lo - 1, f.lo, f.lo + 1, f.hi, f.hi + 1, 2.0, *wrong]
    if f.kind == "choice":
        return [*f.choices, "", f.choices[0].upper(), 1, *wrong]
    return [f.lo, f.lo - 1, (f.lo + f.hi) / 2, int(f.hi), f.hi, f.hi * 1.01, math.inf, math.nan, *wrong]


def other_value(f: SpecField) -> Any:
    """A valid value that is not the default (for flags, conf keys, records)."""
    if f.kind == "choice":
        return next(c for c in f.choices if c != f.default)
    if f.kind == "count":
        return f.lo + 2 if f.default != f.lo + 2 else f.lo + 1
    return 7.25 if f.hi > 7.25 else f.hi / 4


def as_text(value: Any) -> str:
    return str(value)


# ------------------------------------------------------------- JobSpec == the table


def test_jobspec_has_the_tables_fields_in_its_order() -> None:
    assert list(JobSpec.model_fields) == [f.name for f in SPEC_FIELDS]


@pytest.mark.parametrize("f", SPEC_FIELDS, ids=lambda f: f.name)
def test_jobspec_default_and_requiredness_are_the_tables(f: SpecField) -> None:
    model_field = JobSpec.model_fields[f.name]
    assert model_field.is_required() == f.required
    if not f.required:
        assert model_field.default == f.default and type(model_field.default) is type(f.default)


def _id(x: Any) -> str:
    return x.name if isinstance(x, SpecField) else repr(x)


@pytest.mark.parametrize("f,value", [(f, v) for f in SPEC_FIELDS for v in probes(f)], ids=_id)
def test_check_spec_takes_and_refuses_what_jobspec_does(f: SpecField, value: Any) -> None:
    values = {**NODES, f.name: value}
    try:
        plain = check_spec(**values)
    except ValueError as e:
        plain = None
        assert f.name in str(e)  # the refusal names the field
    try:
        model = JobSpec(**values)
    except ValidationError:
        model = None
    assert (plain is None) == (model is None), (f.name, value, plain, model)
    if model is not None:
        assert plain == json.loads(model.model_dump_json())  # the same JSON object, field for field


def test_check_spec_at_defaults_is_jobspecs_json() -> None:
    assert check_spec(**NODES) == json.loads(JobSpec(**NODES).model_dump_json())
    assert {k: v for k, v in check_spec(**NODES).items() if k not in NODES} == DEFAULTS


def test_check_spec_takes_only_the_tables_fields() -> None:
    with pytest.raises(TypeError, match="no_such_field"):
        check_spec(**NODES, no_such_field=1)
    with pytest.raises(TypeError, match="max_nodes"):
        check_spec(min_nodes=1)


# ------------------------------------------------------------- records


@pytest.mark.parametrize("f", [f for f in SPEC_FIELDS if not f.required], ids=lambda f: f.name)
def test_records_keep_a_field_as_the_table_says(f: SpecField) -> None:
    plain = rounds.new_job("j", JobSpec(**NODES), 0.0)
    rec = json.loads(json.dumps(rounds.to_record(plain)))
    assert (f.name in rec["spec"]) == f.saved_at_default  # left out at its default unless saved_at_default
    assert rounds.from_record(rec).spec == plain.spec
    changed = rounds.new_job("j", JobSpec(**NODES, **{f.name: other_value(f)}), 0.0)
    rec = json.loads(json.dumps(rounds.to_record(changed)))
    assert rec["spec"][f.name] == other_value(f)
    assert rounds.from_record(rec).spec == changed.spec


def test_spec_record_is_the_spec_less_its_left_out_defaults() -> None:
    spec = JobSpec(**NODES).model_dump()
    assert spec_record(spec) == {f.name: spec[f.name] for f in SPEC_FIELDS if f.saved_at_default}


# ------------------------------------------------------------- rdzv-agent's flags and --rdzv-conf


def cfg_of(*argv: str) -> AgentConfig:
    return config_from_args(build_parser().parse_args([*BASE, *argv, "train.py"]))


def flagged() -> list[SpecField]:
    return [f for f in SPEC_FIELDS if f.flag]


def test_every_field_but_the_node_counts_has_a_flag_with_help() -> None:
    assert [f.name for f in SPEC_FIELDS if not f.flag] == ["min_nodes", "max_nodes"]  # --nnodes MIN:MAX
    assert all(f.help for f in flagged())


@pytest.mark.parametrize("f", flagged(), ids=lambda f: f.name)
def test_a_flags_default_and_help_are_the_tables(f: SpecField) -> None:
    parser = build_parser()
    (action,) = [a for a in parser._actions if f.flag in a.option_strings]
    assert action.default == f.default and set(action.option_strings) == {f.flag, *f.aliases}
    group = next(g for g in parser._action_groups if action in g._group_actions)
    assert group.title == SPEC_GROUP
    text = " ".join(parser.format_help().split())
    assert f.flag in text
    assert cfg_of().spec_values[f.name] == f.default


@pytest.mark.parametrize("f", flagged(), ids=lambda f: f.name)
def test_a_flag_sets_its_field_once_checked(f: SpecField) -> None:
    value = other_value(f)
    cfg = cfg_of(f.flag or "", as_text(value))
    assert cfg.spec_values[f.name] == value and getattr(cfg, f.name) == value
    assert getattr(cfg.spec(), f.name) == value and cfg.spec_fields() == cfg.spec_values


@pytest.mark.parametrize("f", [f for f in SPEC_FIELDS if f.pet], ids=lambda f: f.name)
def test_torchruns_variable_gives_the_flags_default(f: SpecField, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"PET_{f.name.upper()}", as_text(other_value(f)))
    assert cfg_of().spec_values[f.name] == other_value(f)


@pytest.mark.parametrize("f", [f for f in SPEC_FIELDS if f.conf], ids=lambda f: f.name)
def test_rdzv_agent_reads_the_conf_keys_the_table_marks_and_notes_the_others(f: SpecField) -> None:
    cfg = cfg_of("--rdzv-conf", f"{f.conf}={as_text(other_value(f))}")
    if f.agent_conf:
        assert cfg.spec_values[f.name] == other_value(f) and cfg.notes == []
    else:
        assert cfg.spec_values[f.name] == f.default
        assert len(cfg.notes) == 1 and cfg.notes[0].startswith(f"--rdzv-conf {f.conf}: not used")


def test_conf_values_are_parsed_as_their_fields_type() -> None:
    conf = {f.conf: as_text(other_value(f)) for f in SPEC_FIELDS if f.conf}
    got = conf_spec(conf.get, plugin=True)
    assert got == {f.name: other_value(f) for f in SPEC_FIELDS if f.conf}
    assert all(type(got[f.name]) is type(other_value(f)) for f in SPEC_FIELDS if f.conf)
    with pytest.raises(ValueError):
        conf_spec({"join_timeout": "soon"}.get, plugin=False)


# ------------------------------------------------------------- the torchrun plugin


def plugin_spec(**conf: str) -> JobSpec:
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    params = RendezvousParameters(
        backend="rdzv", endpoint="127.0.0.1:29400", run_id="j", local_addr="127.0.0.1", **NODES, **conf
    )
    return RdzvRendezvousHandler(params).spec


def test_the_plugins_spec_is_the_tables_defaults_or_its_own() -> None:
    """No default written in the plugin: the table's, or the plugin's own the table gives."""
    spec = plugin_spec()
    for f in SPEC_FIELDS:
        if not f.required:
            want = f.default if f.plugin_default is SAME else f.plugin_default
            assert getattr(spec, f.name) == want, f.name


@pytest.mark.parametrize("f", [f for f in SPEC_FIELDS if f.conf], ids=lambda f: f.name)
def test_the_plugin_reads_every_conf_key_of_the_table(f: SpecField) -> None:
    assert f.conf is not None
    assert getattr(plugin_spec(**{f.conf: as_text(other_value(f))}), f.name) == other_value(f)


def test_the_conf_keys_are_unique() -> None:
    keys = [f.conf for f in SPEC_FIELDS if f.conf]
    assert len(keys) == len(set(keys)) and set(FIELDS) == {f.name for f in SPEC_FIELDS}
