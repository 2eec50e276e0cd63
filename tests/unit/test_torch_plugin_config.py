"""How the torchrun handler reads its configuration (issue 12, item 2): the
server, the job id and the number of local workers, from what torchrun (or
accelerate, which runs torchrun in its own process) hands it. No server is
contacted: a handler connects on its first next_rendezvous."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rdzv_client.torch_params import spec_nproc as _spec_nproc
from rdzv_client.torch_plugin import RdzvRendezvousHandler


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RDZV_ENDPOINT", "SLURM_JOB_ID", "RDZV_TOKEN", "RDZV_JOB_SECRET"):
        monkeypatch.setenv(name, "x")  # restored after the test (the handler pops the credentials)
        monkeypatch.delenv(name)


def handler(endpoint: str = "127.0.0.1:29400", run_id: str = "exp1", **conf: str) -> RdzvRendezvousHandler:
    params = RendezvousParameters(
        backend="rdzv", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=2, local_addr="127.0.0.1", **conf
    )
    return RdzvRendezvousHandler(params)


def test_torchruns_endpoint_and_id() -> None:
    h = handler()
    assert (h.endpoint, h.run_id) == ("127.0.0.1:29400", "exp1")


def test_empty_endpoint_says_how_to_name_the_server() -> None:
    """accelerate --same_network hands torchrun no endpoint (was: "endpoint '' has no host")."""
    with pytest.raises(ValueError, match=r"no server: .*--rdzv-conf server=HOST:PORT.*RDZV_ENDPOINT"):
        handler(endpoint="")


def test_empty_endpoint_falls_back_to_rdzv_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDZV_ENDPOINT", "127.0.0.1:29411")
    assert handler(endpoint="").endpoint == "127.0.0.1:29411"


def test_conf_server_overrides_the_endpoint() -> None:
    """accelerate builds --rdzv-endpoint from --main_process_ip/port; server= wins."""
    assert handler(endpoint="127.0.0.1:29500", server="127.0.0.1:29400").endpoint == "127.0.0.1:29400"


def test_conf_nnodes_overrides_torchruns_node_range() -> None:
    """accelerate's --num_machines 3 is torchrun's --nnodes 3 (MIN = MAX):
    ``--rdzv_conf nnodes=2:3`` lets the survivors of a node loss go on at 2."""
    h = handler(nnodes="2:3")
    assert (h.spec.min_nodes, h.spec.max_nodes) == (2, 3)
    assert (handler().spec.min_nodes, handler().spec.max_nodes) == (1, 2)  # torchrun's own --nnodes
    assert (handler(nnodes="4").spec.min_nodes, handler(nnodes="4").spec.max_nodes) == (4, 4)


@pytest.mark.parametrize("text", ["x", "3:2", "0", "2:"])
def test_a_bad_conf_nnodes_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"--rdzv-conf nnodes=.*MIN"):
        handler(nnodes=text)


def test_conf_server_is_checked() -> None:
    with pytest.raises(ValueError, match="has no host"):
        handler(server=":29400")


def test_conf_job_id_overrides_torchruns_default() -> None:
    assert handler(run_id="none", job_id="acc1").run_id == "acc1"


def test_rdzv_no_new_run_is_read_as_rdzv_agent_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """RDZV_NO_NEW_RUN=1 (the Kubernetes manifest's way) holds under torchrun too; --rdzv-conf new_run wins."""
    monkeypatch.delenv("RDZV_NO_NEW_RUN", raising=False)
    assert handler().session.new_run is True
    monkeypatch.setenv("RDZV_NO_NEW_RUN", "1")
    assert handler().session.new_run is False
    assert handler(new_run="1").session.new_run is True
    monkeypatch.setenv("RDZV_NO_NEW_RUN", "0")
    assert handler().session.new_run is True


def test_under_kubernetes_the_plugin_starts_no_new_run_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25, item 2: torchrun in a Kubernetes pod (Kubeflow Trainer, JobSet) restarted after its job ended
    is refused by the finished job id, as rdzv-agent is; --rdzv-conf new_run=1 or RDZV_NO_NEW_RUN=0 allow it."""
    monkeypatch.delenv("RDZV_NO_NEW_RUN", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert handler().session.new_run is False
    assert handler(new_run="1").session.new_run is True
    monkeypatch.setenv("RDZV_NO_NEW_RUN", "0")
    assert handler().session.new_run is True


def test_a_bad_never_reached_timeout_is_refused_when_the_handler_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDZV_NEVER_REACHED_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="RDZV_NEVER_REACHED_TIMEOUT=-1: must be a positive number"):
        handler()


def test_bad_job_id_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"job id 'a b': use 1-128 characters"):
        handler(job_id="a b")


def test_default_none_under_slurm_is_the_slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert handler(run_id="none").run_id == "4242"
    assert handler(run_id="exp1").run_id == "exp1"


def test_default_none_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rdzv_client.torch_plugin"):
        h = handler(run_id="none")
    assert h.run_id == "none"
    assert "torchrun's default 'none'" in caplog.text and "--rdzv_conf job_id=NAME" in caplog.text


def _spec(h: RdzvRendezvousHandler, nproc: int) -> WorkerSpec:
    return WorkerSpec(role="trainer", local_world_size=nproc, rdzv_handler=h, entrypoint="python", args=())


def test_local_workers_come_from_torchs_worker_spec() -> None:
    """torch's agent calls next_rendezvous from _rendezvous(worker_group): the
    spec whose rdzv_handler is this handler gives --nproc-per-node, whatever the
    process's command line says (accelerate: --num_processes 8 --num_machines 2)."""
    h, other = handler(), handler()

    def _rendezvous(worker_group: WorkerGroup) -> int | None:  # as torch's agent holds it
        spec = worker_group.spec
        assert spec.rdzv_handler is h
        return _spec_nproc(h)

    assert _rendezvous(WorkerGroup(_spec(h, 4))) == 4
    spec_of_other = _spec(other, 3)  # another handler's spec on the stack is not ours
    assert spec_of_other.local_world_size == 3 and _spec_nproc(h) is None


def test_importing_the_plugin_before_torchs_registry_still_registers_it() -> None:
    """Importing rdzv_client.torch_plugin first imports torch's rendezvous
    registry, whose entry-point scan then finds this module half-initialized
    and skips it with a warning: the backend must be registered all the same
    (the suite's order did this and torch said 'rdzv' is not registered)."""
    code = (
        "import rdzv_client.torch_plugin\n"
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
        "from rdzv_client.torch_plugin import create_handler\n"
        "print(r._registry.get('rdzv') is create_handler)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_a_short_job_secret_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19 item 7: a job secret is at least 16 characters (from --rdzv-conf or the environment)."""
    with pytest.raises(ValueError, match=r"job secret .*must be 16-256 printable ASCII characters \(this one has 3"):
        handler(job_secret="abc")
    monkeypatch.setenv("RDZV_JOB_SECRET", "0123456789abcde")
    with pytest.raises(ValueError, match="this one has 15"):
        handler()
    assert handler(job_secret="0123456789abcdef").job_secret == "0123456789abcdef"
