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


def test_rdzv_conf_new_run_job_id_and_server_as_the_plugin_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's --rdzv-conf new_run=0 / job_id= / server= do what they do in the plugin (not a note)."""
    monkeypatch.delenv("RDZV_NO_NEW_RUN", raising=False)
    cfg = cfg_of(*BASE, "--rdzv-conf", "new_run=0,job_id=conf1,server=127.0.0.1:29411")
    assert (cfg.new_run, cfg.job_id, cfg.endpoint, cfg.notes) == (False, "conf1", "127.0.0.1:29411", [])
    assert cfg_of(*BASE, "--rdzv-conf", "new_run=1").new_run is True
    assert cfg_of("--rdzv-conf", "job_id=only,server=127.0.0.1:2").job_id == "only"
    with pytest.raises(UsageError, match="--rdzv-conf new_run='maybe': use 0 or 1"):
        cfg_of(*BASE, "--rdzv-conf", "new_run=maybe")


# -- torchrun's flags (issue 12, item 6): none refused, none ignored without a word


def test_a_plain_line_has_no_notes() -> None:
    cfg = cfg_of(*BASE, "--rdzv-backend", "rdzv", "--nnodes", "1:2", "--rdzv-conf", "join_timeout=9")
    assert cfg.notes == []


@pytest.mark.parametrize(
    "argv, note",
    [
        (["--rdzv-backend", "c10d"], "--rdzv-backend c10d: rdzv-agent always uses the rdzv server"),
        (["--rdzv_backend", "static"], "--rdzv-backend static: rdzv-agent always uses the rdzv server"),
        (["--monitor-interval", "5"], "--monitor-interval: not used; rdzv-agent does not poll"),
        (["--monitor_interval", "0.1"], "--monitor-interval: not used"),
        (["--start-method", "spawn"], "--start-method spawn: not used; each worker is a process of its own"),
        (["--start_method", "forkserver"], "--start-method forkserver: not used"),
        (["--event-log-handler", "console"], "--event-log-handler console: not used; the job's events are kept"),
        (["--event_log_handler", "console"], "--event-log-handler console: not used"),
        (["--master-addr", "10.0.0.1"], "--master-addr/--master-port: not used; each round's rank 0"),
        (["--master_addr", "10.0.0.1"], "--master-addr/--master-port: not used"),
        (["--master-port", "29500"], "--master-addr/--master-port: not used"),
        (["--master_port", "29500"], "--master-addr/--master-port: not used"),
        (["--logs-specs", "mine"], "--logs-specs mine: not used; logs are laid out as torchrun's default"),
        (["--logs_specs", "mine"], "--logs-specs mine: not used"),
        (["--numa-binding", "node"], "--numa-binding node: not applied; workers run without NUMA binding"),
        (["--numa_binding", "socket"], "--numa-binding socket: not applied"),
        (["--duplicate-stdout-filters", "loss"], "--duplicate-stdout-filters: not used; --log-dir DIR with --tee 3"),
        (["--duplicate_stdout_filters", "a,b"], "--duplicate-stdout-filters: not used"),
        (["--duplicate-stderr-filters", "err"], "--duplicate-stderr-filters: not used"),
        (["--duplicate_stderr_filters", "err"], "--duplicate-stderr-filters: not used"),
        (["--rdzv-conf", "timeout=900,join_timeout=5"], "--rdzv-conf timeout: not used; rdzv-agent reads join_timeout"),
    ],
)
def test_torchrun_flags_rdzv_does_differently_are_accepted_with_a_note(argv: list[str], note: str) -> None:
    cfg = cfg_of(*BASE, *argv)
    assert cfg.job_id == "j"
    assert len(cfg.notes) == 1 and cfg.notes[0].startswith(note), cfg.notes
    assert "\n" not in cfg.notes[0]


@pytest.mark.parametrize("flag", ["--role"])
def test_role(flag: str) -> None:
    assert cfg_of(*BASE).role == "default"
    cfg = cfg_of(*BASE, flag, "trainer")
    assert cfg.role == "trainer" and cfg.notes == []
    with pytest.raises(UsageError, match="--role"):
        cfg_of(*BASE, flag, "")


@pytest.mark.parametrize("flag", ["--signals-to-handle", "--signals_to_handle"])
def test_signals_to_handle(flag: str) -> None:
    import signal

    default = cfg_of(*BASE)
    assert default.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert set(default.signals) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
    cfg = cfg_of(*BASE, flag, "SIGTERM,SIGUSR1,USR2")
    assert cfg.signals_to_handle == "SIGTERM,SIGUSR1,USR2"  # the workers see it as given, as under torchrun
    assert set(cfg.signals) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}
    with pytest.raises(UsageError, match="'SIGNOPE' is not a signal name"):
        cfg_of(*BASE, flag, "SIGTERM,SIGNOPE")
    with pytest.raises(UsageError, match="SIGKILL cannot be handled"):
        cfg_of(*BASE, flag, "SIGKILL")


@pytest.mark.parametrize("flag", ["--stop-timeout", "--shutdown-timeout", "--shutdown_timeout"])
def test_shutdown_timeout_is_the_stop_timeout(flag: str) -> None:
    assert cfg_of(*BASE, flag, "7").stop_timeout_s == 7.0


def test_shutdown_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "20")
    assert cfg_of(*BASE).stop_timeout_s == 20.0
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "25")
    assert cfg_of(*BASE).stop_timeout_s == 25.0
    assert cfg_of(*BASE, "--shutdown-timeout", "3").stop_timeout_s == 3.0


@pytest.mark.parametrize("flag", ["--virtual-local-rank", "--virtual_local_rank"])
def test_virtual_local_rank(flag: str) -> None:
    assert cfg_of(*BASE).virtual_local_rank is False
    assert cfg_of(*BASE, flag).virtual_local_rank is True


def test_virtual_local_rank_needs_a_gpu_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES='3' names fewer GPUs"):
        cfg_of(*BASE, "--virtual-local-rank", "--nproc-per-node", "2")
    assert cfg_of(*BASE, "--virtual-local-rank").virtual_local_rank is True


@pytest.mark.parametrize("flag", ["--run-path", "--run_path"])
def test_run_path_runs_the_script_with_python(flag: str) -> None:
    assert cfg_of(*BASE, flag).cmd == [sys.executable, "-u", "train.py", "--lr", "1"]
    assert cfg_of(*BASE, flag, "--no-python").cmd == [sys.executable, "-u", "train.py", "--lr", "1"]


@pytest.mark.parametrize(
    "name, value, field, expected",
    [
        ("PET_ROLE", "trainer", "role", "trainer"),
        ("PET_SIGNALS_TO_HANDLE", "SIGTERM", "signals_to_handle", "SIGTERM"),
        ("PET_VIRTUAL_LOCAL_RANK", "1", "virtual_local_rank", True),
        ("PET_VIRTUAL_LOCAL_RANK", "0", "virtual_local_rank", False),
        ("PET_RUN_PATH", "1", "cmd", [sys.executable, "-u", "train.py", "--lr", "1"]),
        ("PET_RDZV_CONF", "join_timeout=12", "join_timeout_s", 12.0),
    ],
)
def test_torchrun_environment_for_the_new_flags(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, field: str, expected
) -> None:
    monkeypatch.setenv(name, value)
    assert getattr(cfg_of(*BASE), field) == expected


@pytest.mark.parametrize(
    "name, value",
    [
        ("PET_MONITOR_INTERVAL", "5"),
        ("PET_START_METHOD", "fork"),
        ("PET_EVENT_LOG_HANDLER", "console"),
        ("PET_MASTER_ADDR", "10.0.0.1"),
        ("PET_MASTER_PORT", "29500"),
        ("PET_DUPLICATE_STDOUT_FILTERS", "x"),
        ("PET_DUPLICATE_STDERR_FILTERS", "x"),
        ("PET_RDZV_BACKEND", "c10d"),
    ],
)
def test_torchrun_environment_for_flags_rdzv_does_differently_gets_a_note(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert len(cfg_of(*BASE).notes) == 1


def _torchrun_parser():
    pytest.importorskip("torch")
    from torch.distributed.run import get_args_parser

    return get_args_parser()


# A value each of torchrun's flags takes (by dest) in the comparison below.
_SAMPLES = {
    "nnodes": "1:2",
    "nproc_per_node": "2",
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "127.0.0.1:29400",
    "rdzv_id": "j",
    "rdzv_conf": "join_timeout=5",
    "max_restarts": "2",
    "monitor_interval": "1",
    "start_method": "spawn",
    "event_log_handler": "console",
    "role": "trainer",
    "log_dir": "LOGDIR",
    "redirects": "3",
    "tee": "1",
    "local_ranks_filter": "0",
    "duplicate_stdout_filters": "loss",
    "duplicate_stderr_filters": "warn",
    "node_rank": "1",
    "master_addr": "127.0.0.1",
    "master_port": "29500",
    "local_addr": "127.0.0.1",
    "logs_specs": "default",
    "numa_binding": "node",
    "signals_to_handle": "SIGTERM,SIGUSR1",
    "shutdown_timeout": "5",
}


def _torchrun_options() -> list[tuple[str, str, int]]:
    """(option string, dest, nargs==0) of every flag of the venv's torchrun."""
    out = []
    for action in _torchrun_parser()._actions:
        for opt in action.option_strings:
            if opt not in ("-h", "--help"):
                out.append((opt, action.dest, action.nargs == 0))
    return out


def test_every_flag_of_torchrun_is_known_here() -> None:
    """Compared with torch/distributed/run.py's own parser: each of its option
    strings (dashes and underscores) is one of rdzv-agent's, and the samples
    below cover every value-taking one."""
    ours = {opt for action in build_parser()._actions for opt in action.option_strings}
    options = _torchrun_options()
    assert len(options) > 40
    missing = sorted(opt for opt, _, _ in options if opt not in ours)
    assert missing == [], f"torchrun flags rdzv-agent refuses: {missing}"
    unsampled = sorted({dest for _, dest, switch in options if not switch and dest not in _SAMPLES})
    assert unsampled == [], f"add a sample value for {unsampled}"


def test_every_torchrun_flag_alone_is_accepted_and_said(tmp_path: Path) -> None:
    """Each of torchrun's flags, with a value torchrun takes, gives a config;
    the ones rdzv does differently say so in one note."""
    for opt, dest, switch in _torchrun_options():
        value = [] if switch else [_SAMPLES[dest].replace("LOGDIR", str(tmp_path))]
        argv = [opt, *value] if dest in ("rdzv_endpoint", "rdzv_id") else [*BASE, opt, *value]
        if dest == "rdzv_endpoint":
            argv += ["--job-id", "j"]
        elif dest == "rdzv_id":
            argv += ["--endpoint", "127.0.0.1:1"]
        cfg = cfg_of(*argv)
        assert all("\n" not in n for n in cfg.notes), (opt, cfg.notes)
        said = dest in (
            "rdzv_backend",
            "monitor_interval",
            "start_method",
            "event_log_handler",
            "master_addr",
            "master_port",
            "logs_specs",
            "numa_binding",
            "duplicate_stdout_filters",
            "duplicate_stderr_filters",
        )
        assert len(cfg.notes) == int(said), (opt, cfg.notes)


def test_every_torchrun_variable_does_what_its_flag_does(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torchrun reads PET_<DEST> for each flag that has an env or check_env
    action; the same variable here gives the same config as the flag."""
    checked = []
    for action in _torchrun_parser()._actions:
        if type(action).__name__ not in ("env", "check_env"):
            continue
        dest, switch = action.dest, action.nargs == 0
        value = "1" if switch else _SAMPLES[dest].replace("LOGDIR", str(tmp_path))
        base = ["--log-dir", str(tmp_path)]
        if dest != "rdzv_endpoint":
            base += ["--endpoint", "127.0.0.1:1"]
        if dest != "rdzv_id":
            base += ["--job-id", "j"]
        by_flag = cfg_of(*base, action.option_strings[0], *([] if switch else [value]))
        with monkeypatch.context() as m:
            m.setenv(f"PET_{dest.upper()}", value)
            by_env = cfg_of(*base)
        assert by_env == by_flag, dest
        checked.append(dest)
    assert len(checked) > 20 and {"module", "no_python", "standalone", "role", "signals_to_handle"} <= set(checked)


def test_a_whole_torchrun_line_with_every_flag(tmp_path: Path) -> None:
    argv = [*BASE]
    for opt, dest, switch in _torchrun_options():
        if opt.startswith("--") and "_" not in opt[2:] and dest not in ("rdzv_endpoint", "rdzv_id", "standalone"):
            if dest == "no_python" or dest == "module":
                continue  # -m with --no-python is refused by torchrun too
            argv += [opt] if switch else [opt, _SAMPLES[dest].replace("LOGDIR", str(tmp_path))]
    cfg = cfg_of(*argv)
    assert (cfg.role, cfg.nproc, cfg.max_restarts, cfg.stop_timeout_s) == ("trainer", 2, 2, 5.0)
    assert cfg.virtual_local_rank is True and cfg.signals_to_handle == "SIGTERM,SIGUSR1"
    assert cfg.cmd[:3] == [sys.executable, "-u", "train.py"]  # --run-path
    assert len(cfg.notes) == 9, cfg.notes  # master-addr and master-port share one


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
        ("RDZV_JOB_SECRET", "sec-0123456789abcdef", "job_secret", "sec-0123456789abcdef"),
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
    monkeypatch.setenv("PET_STANDALONE", "0")  # torchrun's check_env: 0 is off
    assert cfg_of(*BASE).standalone is False


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
        ([*BASE, "--nproc-per-node", "many"], "expected N, gpu, xpu, cpu or auto"),
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


def test_help_says_the_max_restarts_default_and_torchruns() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "restarts after worker failures before the job fails (default 3; torchrun: 0)" in text
    assert cfg_of(*BASE).max_restarts == 3


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


def test_a_bad_never_reached_timeout_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """$RDZV_NEVER_REACHED_TIMEOUT is checked with the flags (exit 2, one line), not when the link first fails."""
    monkeypatch.setenv("RDZV_NEVER_REACHED_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="RDZV_NEVER_REACHED_TIMEOUT='soon': must be a number of seconds"):
        cfg_of(*BASE)
    monkeypatch.setenv("RDZV_NEVER_REACHED_TIMEOUT", "0")
    with pytest.raises(UsageError, match="must be a positive number"):
        cfg_of(*BASE)
