"""Checks of deploy/grafana and deploy/prometheus: the dashboard JSON loads and
is well formed, the alert rules are well formed, and every metric (and label)
the dashboard and the rules use is in a real rdzv-server's /metrics, scraped
with the bearer token as deploy/prometheus/prometheus.example.yaml does.

``promtool`` (Debian's ``prometheus`` package) checks the rules, runs their
unit tests (tests/deploy/data/rdzv-alerts.test.yaml) and checks the example
configuration; like shellcheck in test_deploy_slurm.py, those tests are
skipped with a line saying how to get it when it is not installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from rdzv_common.protocol import JobState
from rdzv_server.metrics import Metrics
from rdzv_server.rounds import NodeState
from tests.helpers.cluster import Cluster, managed
from tests.helpers.promlint import lint

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "rdzv-dashboard.json"
RULES = REPO / "deploy" / "prometheus" / "rdzv-alerts.yaml"
CONFIG = REPO / "deploy" / "prometheus" / "prometheus.example.yaml"
RULE_TESTS = Path(__file__).parent / "data" / "rdzv-alerts.test.yaml"
TOKEN = "obs-test-token-0123456"
PROMETHEUS_OWN = {"up"}  # series Prometheus itself makes for every target
NO_PROMTOOL = "promtool is not installed: apt-get install prometheus (Debian) to run this check"
MATCHER_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
SELECTOR_RE = re.compile(r"\b([a-z_:][a-z0-9_:]*)\s*(\{[^}]*\})?")
PROMQL_WORDS = {
    "sum",
    "by",
    "rate",
    "increase",
    "histogram_quantile",
    "and",
    "on",
    "unless",
    "offset",
    "le",
    "max",
    "min",
    "without",
    "or",
}


def _declared_labels() -> dict[str, tuple[str, ...]]:
    """Label names of every metric of rdzv_server.metrics, by the names its samples have."""
    out: dict[str, tuple[str, ...]] = {}
    for metric in vars(Metrics()).values():
        if isinstance(metric, MetricWrapperBase):
            name = metric._name + ("_total" if metric._type == "counter" else "")
            out[name] = tuple(metric._labelnames)
    return out


DECLARED = _declared_labels()
STATES = {s.value for s in JobState} | {s.value for s in NodeState}  # rdzv_job_state shows only the current one


def _exprs_of_dashboard(dash: dict) -> list[str]:
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _selectors(expr: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
    """(metric name, {label: (op, value)}) of every selector in a PromQL expression."""
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    expr = re.sub(r"\b(by|on|without)\s*\([^)]*\)", "", expr)  # grouping label lists
    out = []
    for m in SELECTOR_RE.finditer(expr):
        name, braces = m[1], m[2] or ""
        if name in PROMQL_WORDS or re.fullmatch(r"\d+m?", name):
            continue
        if expr[m.end() :].lstrip().startswith("("):  # a function call
            continue
        out.append((name, {lab: (op, val) for lab, op, val in MATCHER_RE.findall(braces)}))
    return out


def test_dashboard_loads_and_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "rdzv_job_state" in variables["job_id"]["query"]["query"]
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    titles = " ".join(p["title"] for p in dash["panels"])
    for needed in ("Nodes by state", "Round formation time", "Time since progress", "Hosts cordoned", "Job states"):
        assert needed in titles


def test_alert_rules_are_well_formed() -> None:
    doc = yaml.safe_load(RULES.read_text())
    assert [g["name"] for g in doc["groups"]] == ["rdzv"]
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    assert {"RdzvJobFailed", "RdzvJobWaitingTooLong", "RdzvNodeEvictedRepeatedly"} <= set(names)
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"Rdzv[A-Z][A-Za-z]+", rule["alert"]), rule["alert"]
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", "0s"))), rule
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest):
    yield from managed(Cluster(tmp_path), request)


def _scrape(url: str, token: str | None) -> tuple[int, str]:
    req = urllib.request.Request(url + "/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_every_metric_and_label_used_is_in_a_real_servers_metrics(cluster: Cluster) -> None:
    """A real server with --token and a real agent running a job: /metrics
    refuses a scrape without the token, answers the bearer token, passes the
    lint, and has every name, label and label value the dashboard and rules use."""
    server = cluster.start_server("--token", TOKEN)
    sleeper = cluster.tmp / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(120)\n")
    agent = cluster.start_agent(server, "obs", sleeper, nnodes="1", flags=("--token", TOKEN))
    status, _ = _scrape(server.url, None)
    assert status == 401
    text = ""
    for _ in range(600):  # the job runs within a few seconds; generous for a loaded machine
        status, text = _scrape(server.url, TOKEN)
        assert status == 200
        if 'rdzv_job_state{job_id="obs",state="running"} 1.0' in text:
            break
        agent.popen.poll()
        assert agent.popen.returncode is None, agent.text()[-2000:]
        time.sleep(0.1)
    else:
        raise AssertionError(f"job obs never ran:\n{agent.text()[-2000:]}")
    assert lint(text) == []

    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    names = set(types) | {
        f"{n}{s}" for n, k in types.items() if k == "histogram" for s in ("_bucket", "_sum", "_count")
    }
    labels: dict[str, dict[str, set[str]]] = {}
    for m in re.finditer(r"^([a-z_:][a-z0-9_:]*)\{([^}]*)\} ", text, re.M):
        for lab, val in re.findall(r'(\w+)="([^"]*)"', m[2]):
            labels.setdefault(m[1], {}).setdefault(lab, set()).add(val)

    dash = json.loads(DASHBOARD.read_text())
    used = [("dashboard", expr) for expr in _exprs_of_dashboard(dash)]
    used += [(f"rule {r['alert']}", r["expr"]) for r in _rules()]
    used.append(("dashboard variable", dash["templating"]["list"][1]["query"]["query"].replace("label_values", "")))
    problems = []
    for where, expr in used:
        selectors = _selectors(expr)
        assert selectors, f"{where}: no metric in {expr!r}"
        for name, matchers in selectors:
            if name in PROMETHEUS_OWN or name in ("job_id",):
                continue
            if name not in names:
                problems.append(f"{where}: {name} is not in /metrics")
                continue
            for lab, (op, val) in matchers.items():
                if lab in ("job", "instance"):
                    continue  # Prometheus adds them
                have = labels.get(name, {})
                if not have:  # no series yet (no eviction, no progress report): the labels it is declared with
                    if lab not in DECLARED.get(name, ()):
                        problems.append(f"{where}: {name} is not declared with a label {lab}")
                    continue
                if lab not in have:
                    problems.append(f"{where}: {name} has no label {lab}")
                elif op == "=" and lab == "state":
                    if val not in STATES:
                        problems.append(f"{where}: {name}{{state={val!r}}}: no such state")
                elif op == "=" and val not in have[lab]:
                    problems.append(f"{where}: {name}{{{lab}={val!r}}} has no series (values: {sorted(have[lab])})")
    assert not problems, "\n".join(problems)


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False)


@pytest.mark.skipif(not shutil.which("promtool"), reason=NO_PROMTOOL)
def test_promtool_checks_and_unit_tests_the_rules() -> None:
    run = _promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    run = _promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


@pytest.mark.skipif(not shutil.which("promtool"), reason=NO_PROMTOOL)
def test_promtool_accepts_the_example_configuration(tmp_path: Path) -> None:
    """The example scrape configuration, with its token file and rule file in place."""
    token = tmp_path / "rdzv-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    config = CONFIG.read_text()
    assert "credentials_file: /etc/prometheus/rdzv-token" in config
    (tmp_path / "prometheus.yaml").write_text(config.replace("/etc/prometheus/rdzv-token", str(token)))
    shutil.copy(RULES, tmp_path / RULES.name)
    run = _promtool("check", "config", "prometheus.yaml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_example_configuration_scrapes_with_a_bearer_token_file() -> None:
    doc = yaml.safe_load(CONFIG.read_text())
    (job,) = doc["scrape_configs"]
    assert job["job_name"] == "rdzv" and job["metrics_path"] == "/metrics"
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "/etc/prometheus/rdzv-token"}
    assert doc["rule_files"] == [RULES.name]
