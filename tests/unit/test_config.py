"""rdzv-agent's flags -> AgentConfig (rdzv_client/config.py): every torchrun
spelling of a flag and every PET_* variable the agent accepts lands in the
same field of the one config (issue 9, "one node session")."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rdzv_client.config import (
    DEFAULT_SERVER_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    AgentConfig,
    UsageError,
    build_parser,
    config_from_args,
)
from rdzv_client.workers import Std

BASE = ["--endpoint", "127.0.0.1:1", "--job-id", "j"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults read the environment: none of the caller's leaks in."""
    for name in list(os.environ):
        if name.startswith(("PET_", "RDZV_", "SLURM_")):
            monkeypatch.delenv(name)


def cfg_of(*argv: str) -> AgentConfig:
    return config_from_args(build_parser().parse_args([*argv, "train.py", "--lr", "1"]))


def test_defaults() -> None:
    cfg = cfg_of(*BASE)
    assert (cfg.endpoint, cfg.job_id, cfg.min_nodes, cfg.max_nodes, cfg.nproc) == ("127.0.0.1:1", "j", 1, 1, 1)
    assert cfg.cmd == [sys.executable, "-u", "train.py", "--lr", "1"]
    assert cfg.server_timeout_s == DEFAULT_SERVER_TIMEOUT_S
    assert cfg.stop_timeout_s == DEFAULT_STOP_TIMEOUT_S
    assert (cfg.node_rank, cfg.local_addr, cfg.token, cfg.job_secret, cfg.log_dir) == (None, None, None, None, None)
    assert cfg.standalone is False
    spec = cfg.spec()
    assert (spec.min_nodes, spec.max_nodes) == (1, 1)


@pytest.mark.parametrize("flag", ["--endpoint", "--rdzv-endpoint", "--rdzv_endpoint"])
def test_endpoint_spellings(flag: str) -> None:
    assert cfg_of(flag, "h:7", "--job-id", "j").endpoint == "h:7"


@pytest.mark.parametrize("flag", ["--job-id", "--rdzv-id", "--rdzv_id", "--run-id"])
def test_job_id_spellings(flag: str) -> None:
    assert cfg_of("--endpoint", "h:7", flag, "exp-1").job_id == "exp-1"


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node"])
def test_nproc_spellings(flag: str) -> None:
    assert cfg_of(*BASE, flag, "3").nproc == 3


@pytest.mark.parametrize("flag", ["--max-restarts", "--max_restarts"])
def test_max_restarts_spellings(flag: str) -> None:
    cfg = cfg_of(*BASE, flag, "7")
    assert cfg.max_restarts == 7 and cfg.spec().max_restarts == 7


@pytest.mark.parametrize("flag", ["--node-rank", "--node_rank"])
def test_node_rank_spellings(flag: str) -> None:
    assert cfg_of(*BASE, flag, "2").node_rank == 2


@pytest.mark.parametrize("flag", ["--local-addr", "--local_addr"])
def test_local_addr_spellings(flag: str) -> None:
    assert cfg_of(*BASE, flag, "10.1.2.3").local_addr == "10.1.2.3"


@pytest.mark.parametrize("flag", ["--log-dir", "--log_dir"])
def test_log_dir_spellings(flag: str, tmp_path: Path) -> None:
    assert cfg_of(*BASE, flag, str(tmp_path)).log_dir == tmp_path


@pytest.mark.parametrize("flag", ["--redirects", "-r"])
def test_redirects_spellings(flag: str, tmp_path: Path) -> None:
    cfg = cfg_of(*BASE, "--log-dir", str(tmp_path), "--nproc-per-node", "2", flag, "0:3,1:2")
    assert cfg.redirects == {0: Std.ALL, 1: Std.ERR}


@pytest.mark.parametrize("flag", ["--tee", "-t"])
def test_tee_spellings(flag: str, tmp_path: Path) -> None:
    assert cfg_of(*BASE, "--log-dir", str(tmp_path), flag, "1").tee == {0: Std.OUT}


@pytest.mark.parametrize("flag", ["--local-ranks-filter", "--local_ranks_filter"])
def test_local_ranks_filter_spellings(flag: str) -> None:
    assert cfg_of(*BASE, "--nproc-per-node", "3", flag, "0,2").local_ranks_filter == {0, 2}


@pytest.mark.parametrize("flag", ["--no-python", "--no_python"])
def test_no_python_spellings(flag: str) -> None:
    assert cfg_of(*BASE, flag).cmd == ["train.py", "--lr", "1"]


@pytest.mark.parametrize("flag", ["-m", "--module"])
def test_module_spellings(flag: str) -> None:
    assert cfg_of(*BASE, flag).cmd == [sys.executable, "-u", "-m", "train.py", "--lr", "1"]


@pytest.mark.parametrize("flag", ["--rdzv-conf", "--rdzv_conf"])
def test_rdzv_conf_spellings(flag: str) -> None:
    cfg = cfg_of(*BASE, flag, "join_timeout=77,last_call_timeout=3")
    assert (cfg.join_timeout_s, cfg.last_call_s) == (77.0, 3.0)
    assert (cfg.spec().join_timeout_s, cfg.spec().last_call_s) == (77.0, 3.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--rdzv-backend", "c10d"],
        ["--rdzv_backend", "static"],
        ["--rdzv-backend", "rdzv"],
        ["--monitor-interval", "5"],
        ["--monitor_interval", "5"],
        ["--start-method", "spawn"],
        ["--start_method", "fork"],
        ["--role", "trainer"],
    ],
)
def test_torchrun_flags_that_mean_nothing_here_are_accepted(argv: list[str]) -> None:
    assert cfg_of(*BASE, *argv).job_id == "j"


@pytest.mark.parametrize("flag", ["--rdzv-backend", "--rdzv_backend"])
def test_another_backend_is_refused(flag: str) -> None:
    with pytest.raises(UsageError, match="always uses an rdzv server"):
        cfg_of(*BASE, flag, "etcd")


def test_job_settings_flags() -> None:
    cfg = cfg_of(
        *BASE,
        "--nnodes",
        "2:4",
        "--last-call",
        "2",
        "--heartbeat-timeout",
        "9",
        "--join-timeout",
        "99",
        "--scale-up-window",
        "4",
        "--stop-timeout",
        "5",
        "--server-timeout",
        "60",
    )
    spec = cfg.spec()
    assert (
        spec.min_nodes,
        spec.max_nodes,
        spec.last_call_s,
        spec.heartbeat_timeout_s,
        spec.join_timeout_s,
        spec.scale_up_window_s,
    ) == (2, 4, 2.0, 9.0, 99.0, 4.0)
    assert (cfg.stop_timeout_s, cfg.server_timeout_s) == (5.0, 60.0)


def test_standalone_is_one_node_with_its_own_server() -> None:
    cfg = cfg_of("--standalone", "--nnodes", "3")
    assert (cfg.standalone, cfg.min_nodes, cfg.max_nodes, cfg.job_id) == (True, 1, 1, "standalone")


# -- the environment: torchrun's PET_* variables (Kubernetes operators set them), then ours


@pytest.mark.parametrize(
    "name, value, field, expected",
    [
        ("PET_RDZV_ENDPOINT", "pet:5", "endpoint", "pet:5"),
        ("RDZV_ENDPOINT", "ours:6", "endpoint", "ours:6"),
        ("PET_RDZV_ID", "pet-job", "job_id", "pet-job"),
        ("SLURM_JOB_ID", "12345", "job_id", "12345"),
        ("PET_NPROC_PER_NODE", "4", "nproc", 4),
        ("PET_MAX_RESTARTS", "9", "max_restarts", 9),
        ("PET_NODE_RANK", "1", "node_rank", 1),
        ("PET_LOCAL_ADDR", "10.9.8.7", "local_addr", "10.9.8.7"),
        ("PET_LOCAL_RANKS_FILTER", "0", "local_ranks_filter", {0}),
        ("RDZV_TOKEN", "tok", "token", "tok"),
        ("RDZV_JOB_SECRET", "sec", "job_secret", "sec"),
        ("RDZV_SERVER_TIMEOUT", "42", "server_timeout_s", 42.0),
    ],
)
def test_environment(monkeypatch: pytest.MonkeyPatch, name: str, value: str, field: str, expected) -> None:
    monkeypatch.setenv(name, value)
    argv = [] if field in ("endpoint", "job_id") else BASE
    if field == "endpoint":
        argv = ["--job-id", "j"]
    elif field == "job_id":
        argv = ["--endpoint", "h:1"]
    assert getattr(cfg_of(*argv), field) == expected


def test_environment_nnodes_log_dir_redirects_tee(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PET_NNODES", "2:3")
    monkeypatch.setenv("PET_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("PET_REDIRECTS", "2")
    monkeypatch.setenv("PET_TEE", "1")
    cfg = cfg_of(*BASE)
    assert (cfg.min_nodes, cfg.max_nodes, cfg.log_dir) == (2, 3, tmp_path)
    assert (cfg.redirects, cfg.tee) == ({0: Std.ERR}, {0: Std.OUT})


def test_environment_standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_STANDALONE", "1")
    assert cfg_of().standalone is True


def test_a_flag_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "pet:5")
    monkeypatch.setenv("PET_RDZV_ID", "pet-job")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("RDZV_TOKEN", "env-token")
    cfg = cfg_of("--rdzv-endpoint", "flag:1", "--rdzv_id", "flag-job", "--nproc_per_node", "2", "--token", "t")
    assert (cfg.endpoint, cfg.job_id, cfg.nproc, cfg.token) == ("flag:1", "flag-job", 2, "t")


def test_rdzv_endpoint_beats_pet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "pet:5")
    monkeypatch.setenv("RDZV_ENDPOINT", "ours:6")
    assert cfg_of("--job-id", "j").endpoint == "ours:6"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--job-id", "j"], "no server"),
        (["--endpoint", "h:1"], "no job id"),
        ([*BASE, "--nnodes", "3:2"], "MIN <= MAX"),
        ([*BASE, "--nnodes", "x"], "expected N or MIN:MAX"),
        ([*BASE, "--nproc-per-node", "0"], "at least 1"),
        ([*BASE, "--nproc-per-node", "many"], "expected N, gpu, cpu or auto"),
        ([*BASE, "-m", "--no-python"], "do not go together"),
        ([*BASE, "--rdzv-conf", "oops"], "expected key=value"),
        ([*BASE, "--server-timeout", "0"], "positive number"),
        (["--endpoint", "h:1", "--job-id", "a/b"], "--job-id"),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        cfg_of(*argv)


def test_the_agent_module_still_exports_the_config_names() -> None:
    from rdzv_client import agent

    assert agent.build_parser is build_parser and agent.config_from_args is config_from_args
    assert agent.UsageError is UsageError and agent.DEFAULT_SERVER_TIMEOUT_S == DEFAULT_SERVER_TIMEOUT_S


def test_hang_timeout_is_off_by_default_and_part_of_the_spec() -> None:
    assert cfg_of(*BASE).hang_timeout_s is None and cfg_of(*BASE).spec().hang_timeout_s is None
    cfg = cfg_of(*BASE, "--hang-timeout", "90")
    assert cfg.hang_timeout_s == 90.0 and cfg.spec().hang_timeout_s == 90.0
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(UsageError, match="hang_timeout_s"):
            cfg_of(*BASE, "--hang-timeout", bad)


def test_storm_flags_have_defaults_and_are_part_of_the_spec() -> None:
    spec = cfg_of(*BASE).spec()
    assert spec.storm_restarts == 3 and spec.min_round_s == 60.0
    cfg = cfg_of(*BASE, "--storm-restarts", "0", "--min-round-s", "5")
    assert (cfg.storm_restarts, cfg.min_round_s) == (0, 5.0)
    assert (cfg.spec().storm_restarts, cfg.spec().min_round_s) == (0, 5.0)
    with pytest.raises(UsageError, match="storm_restarts"):
        cfg_of(*BASE, "--storm-restarts", "-1")
    for bad in ("0", "-3", "inf", "nan"):
        with pytest.raises(UsageError, match="min_round_s"):
            cfg_of(*BASE, "--min-round-s", bad)


def test_straggler_flags_have_defaults_and_are_part_of_the_spec() -> None:
    spec = cfg_of(*BASE).spec()
    assert (spec.straggler_policy, spec.straggler_fraction, spec.straggler_window_s) == ("warn", 0.5, 30.0)
    cfg = cfg_of(*BASE, "--straggler-policy", "replace", "--straggler-fraction", "0.3", "--straggler-window-s", "10")
    assert (cfg.spec().straggler_policy, cfg.spec().straggler_fraction, cfg.spec().straggler_window_s) == (
        "replace",
        0.3,
        10.0,
    )
    for bad in ("0", "1.5", "nan", "inf"):
        with pytest.raises(UsageError, match="straggler_fraction"):
            cfg_of(*BASE, "--straggler-fraction", bad)
    for bad in ("0", "-1", "inf"):
        with pytest.raises(UsageError, match="straggler_window_s"):
            cfg_of(*BASE, "--straggler-window-s", bad)
    with pytest.raises(SystemExit):  # argparse: not one of warn, replace
        cfg_of(*BASE, "--straggler-policy", "evict")
