"""kubelet's part for the pod specs of deploy/kubernetes: their containers run by containerd over CRI, as written.

What kubelet makes of a pod spec, this makes the same way, from the spec itself:

- the sandbox: host network (``hostNetwork``), privileged when a container is;
- each container's command and args (``$(VAR)`` expanded from its environment, ``$$`` an
  escaped ``$``), its environment (the API server's Service variables, KUBERNETES_SERVICE_HOST
  and the others kubelet always gives, then plain values, ``fieldRef`` to ``spec.nodeName``,
  ``status.hostIP``, ``status.podIP``, ``metadata.name``, ``metadata.namespace``),
  ``securityContext`` (privileged, user and group, capabilities, no privilege escalation,
  read-only root), ``workingDir``;
- volumes: ``hostPath`` (made for ``DirectoryOrCreate``, checked for ``Directory``),
  ``secret`` and ``configMap`` (their keys as files with the declared mode, from objects
  given here as the API server would serve them), ``emptyDir``; each ``volumeMount`` with its
  ``subPath``, ``readOnly`` and ``mountPropagation``;
- the kubelet-managed ``/etc/hosts`` of a host-network pod: the node's, then ``hostAliases``;
- the service account's credentials (unless ``automountServiceAccountToken`` is false): its
  token, the cluster's CA and the pod's namespace, read-only at
  ``/var/run/secrets/kubernetes.io/serviceaccount`` in every container, where in-cluster
  clients look for them;
- init containers in order, each run to a successful exit before the next, then the
  containers; ``exec`` probes run in the container as kubelet runs them (ExecSync, with the
  probe's ``timeoutSeconds``), ``httpGet`` and ``tcpSocket`` probes from the node.

What it does not do: pull images (they are imported), restart containers, apply resource
limits (the tests' containerd runs without cgroups), or anything that needs the API server.
Anything else in a spec is an error naming the field, never silently skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc

Obj = dict[str, Any]

PROPAGATION = {
    None: api_pb2.PROPAGATION_PRIVATE,
    "None": api_pb2.PROPAGATION_PRIVATE,
    "HostToContainer": api_pb2.PROPAGATION_HOST_TO_CONTAINER,
    "Bidirectional": api_pb2.PROPAGATION_BIDIRECTIONAL,
}
#: What kubelet gives a container that declares nothing (Kubernetes' probe defaults).
#: Where kubelet mounts a pod's service account credentials (and in-cluster clients read them).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PROBE_DEFAULTS = {"periodSeconds": 10, "timeoutSeconds": 1, "failureThreshold": 3, "successThreshold": 1}
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodSpecError(ValueError):
    """A part of a pod spec this stand-in cannot run; the message names the field."""


def expand(text: str, env: dict[str, str]) -> str:
    """kubelet's expansion: ``$(NAME)`` of a variable defined before, ``$$`` for ``$``; others kept."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR.sub(one, text)


@dataclass(frozen=True)
class NodeFacts:
    """What kubelet knows of its node, for ``fieldRef``s and probes."""

    name: str
    host_ip: str
    #: A node path as this process sees it (the node has directories of its own in its mount namespace).
    host_view: Callable[[str], Path] = Path
    #: Runs a command on the node (its network namespace), for httpGet/tcpSocket probes.
    on_node: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None
    #: The API server's Service (default/kubernetes: the first address of the service range, 443),
    #: which kubelet gives every container as KUBERNETES_SERVICE_HOST and the variables with it.
    api_server: tuple[str, int] = ("10.96.0.1", 443)


def service_environment(node: NodeFacts) -> dict[str, str]:
    """The variables kubelet puts in every container for the API server's Service, whatever the
    pod's enableServiceLinks (the kubernetes Service's are always given)."""
    host, port = node.api_server
    url = f"tcp://{host}:{port}"
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": url,
        f"KUBERNETES_PORT_{port}_TCP": url,
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
    }


@dataclass(frozen=True)
class ApiObjects:
    """The objects kubelet would fetch from the API server for volumes: Secrets and ConfigMaps by name."""

    secrets: dict[str, dict[str, bytes]] = field(default_factory=dict)
    config_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    #: ServiceAccount name -> the token the API server issues for it (its TokenRequest).
    tokens: dict[str, str] = field(default_factory=dict)
    #: The cluster's CA certificate, which kubelet puts beside the token (the API server's issuer).
    cluster_ca: bytes = b""


def environment(container: Obj, pod: Obj, node: NodeFacts) -> dict[str, str]:
    """The container's environment as kubelet builds it, in order (later entries see earlier ones)."""
    spec = pod["spec"]
    fields = {
        "spec.nodeName": node.name,
        "status.hostIP": node.host_ip,
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"].get("namespace", "default"),
    }
    if spec.get("hostNetwork"):
        fields["status.podIP"] = node.host_ip
    # The Services' variables first: the container's own entries see them, and override them.
    env: dict[str, str] = service_environment(node)
    for i, entry in enumerate(container.get("env", [])):
        where = f"containers[{container['name']}].env[{i}] ({entry['name']})"
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
        elif "fieldRef" in entry.get("valueFrom", {}):
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            if path not in fields:
                raise PodSpecError(f"{where}: fieldRef {path} is not one this node can give ({', '.join(fields)})")
            env[entry["name"]] = fields[path]
        else:
            raise PodSpecError(f"{where}: valueFrom {sorted(entry.get('valueFrom', {}))} is not supported here")
    for source in container.get("envFrom", []):
        raise PodSpecError(f"containers[{container['name']}].envFrom {source}: not supported here")
    return env


@dataclass
class Pod:
    """A pod spec run on the node: its sandbox, its containers' ids, its folder of volumes and logs."""

    obj: Obj
    sandbox: str
    directory: Path
    containers: dict[str, str] = field(default_factory=dict)
    #: Init container -> its exit code.
    init_exits: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def spec(self) -> Obj:
        return dict(self.obj["spec"])

    def container(self, name: str) -> Obj:
        for c in self.spec.get("initContainers", []) + self.spec["containers"]:
            if c["name"] == name:
                return dict(c)
        raise KeyError(name)

    def log(self, name: str) -> str:
        path = self.directory / "logs" / f"{name}.log"
        try:
            lines = path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        # CRI's log format: "<time> <stream> <tag> <message>".
        return "\n".join(line.split(" ", 3)[-1] for line in lines)


class Kubelet:
    """Runs pod specs through a CRI runtime on one node."""

    def __init__(self, socket_path: Path, node: NodeFacts, pods_dir: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        self.runtime = api_pb2_grpc.RuntimeServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.images = api_pb2_grpc.ImageServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.node = node
        self.pods_dir = pods_dir
        self.pods: list[Pod] = []

    def close(self) -> None:
        for pod in list(self.pods):
            self.remove(pod)
        self.channel.close()

    # -- volumes ---------------------------------------------------------------------------

    def _volumes(self, pod: Obj, directory: Path, api: ApiObjects) -> dict[str, str]:
        """Volume name -> the path the runtime mounts (node paths for hostPath, pod folders for the rest).

        A StatefulSet's volumeClaimTemplates are bound to a folder of the pod's (a local volume). The
        folders kubelet makes belong to the pod's fsGroup, as kubelet sets their ownership.
        """
        out: dict[str, str] = {}
        claims = [{"name": c["metadata"]["name"], "emptyDir": {}} for c in pod.get("volumeClaimTemplates", [])]
        for volume in pod["spec"].get("volumes", []) + claims:
            name = volume["name"]
            where = f"volumes[{name}]"
            if "hostPath" in volume:
                path, kind = volume["hostPath"]["path"], volume["hostPath"].get("type", "")
                seen = self.node.host_view(path)
                if kind == "DirectoryOrCreate":
                    seen.mkdir(parents=True, exist_ok=True)
                elif kind == "Directory" and not seen.is_dir():
                    raise PodSpecError(f"{where}: hostPath {path} (type Directory) is not a directory on the node")
                elif kind not in ("", "Directory"):
                    raise PodSpecError(f"{where}: hostPath type {kind} is not supported here")
                out[name] = path
            elif "secret" in volume or "configMap" in volume:
                kind = "secret" if "secret" in volume else "configMap"
                source = volume[kind]
                ref = source["secretName"] if kind == "secret" else source["name"]
                objects: dict[str, Any] = api.secrets if kind == "secret" else api.config_maps
                if ref not in objects:
                    raise PodSpecError(f"{where}: {kind} {ref} does not exist (give it to the kubelet)")
                target = directory / "volumes" / kind / name
                target.mkdir(parents=True, exist_ok=True)
                mode = source.get("defaultMode", 0o644)
                items = {i["key"]: i["path"] for i in source.get("items", [])} or {k: k for k in objects[ref]}
                for key, rel in items.items():
                    data = objects[ref][key]
                    path = target / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data if isinstance(data, bytes) else data.encode())
                    path.chmod(mode)
                out[name] = str(target)
            elif "emptyDir" in volume:
                target = directory / "volumes" / "empty-dir" / name
                target.mkdir(parents=True, exist_ok=True)
                target.chmod(0o777)
                out[name] = str(target)
            else:
                raise PodSpecError(f"{where}: {sorted(set(volume) - {'name'})} volumes are not supported here")
            group = pod_security(pod).get("fsGroup")
            if group is not None and "hostPath" not in volume:
                for path in [Path(out[name]), *Path(out[name]).rglob("*")]:
                    os.chown(path, -1, int(group))
                    if path.is_dir():
                        path.chmod(path.stat().st_mode | 0o2070)
        return out

    def _service_account(self, pod: Obj, directory: Path, api: ApiObjects) -> Path | None:
        """The folder kubelet projects for the pod's service account (token, ca.crt, namespace), or
        None when the pod opts out (``automountServiceAccountToken: false``)."""
        spec = pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        account = spec.get("serviceAccountName", "default")
        if account not in api.tokens or not api.cluster_ca:
            raise PodSpecError(
                f"spec.serviceAccountName {account}: the pod mounts its token (automountServiceAccountToken "
                "is not false) but the kubelet was given no token for it or no cluster CA"
            )
        target = directory / "volumes" / "serviceaccount"
        target.mkdir(parents=True, exist_ok=True)
        files = {
            "token": api.tokens[account].encode(),
            "ca.crt": api.cluster_ca,
            "namespace": pod["metadata"].get("namespace", "default").encode(),
        }
        group = pod_security(pod).get("fsGroup")
        for name, data in files.items():
            path = target / name
            path.write_bytes(data)
            # A projected volume's default mode, readable by the pod's group as kubelet sets it.
            path.chmod(0o644)
            if group is not None:
                os.chown(path, -1, int(group))
        return target

    def _etc_hosts(self, pod: Obj, directory: Path) -> Path:
        lines = [Path("/etc/hosts").read_text().rstrip("\n"), "", "# Entries added by HostAliases."]
        for alias in pod["spec"].get("hostAliases", []):
            lines.append("\t".join([alias["ip"], *alias["hostnames"]]))
        path = directory / "etc-hosts"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o644)
        return path

    # -- the pod ---------------------------------------------------------------------------

    def _sandbox_config(self, pod: Obj, directory: Path) -> api_pb2.PodSandboxConfig:
        meta, spec = pod["metadata"], pod["spec"]
        host = spec.get("hostNetwork", False)
        privileged = any(
            c.get("securityContext", {}).get("privileged", False)
            for c in spec.get("initContainers", []) + spec["containers"]
        )
        namespaces = api_pb2.NamespaceOption(network=api_pb2.NODE if host else api_pb2.POD)
        for flag in ("hostPID", "hostIPC"):
            if spec.get(flag):
                raise PodSpecError(f"spec.{flag}: not supported here")
        return api_pb2.PodSandboxConfig(
            metadata=api_pb2.PodSandboxMetadata(
                name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta["uid"], attempt=0
            ),
            hostname="" if host else meta["name"],
            log_directory=str(directory / "logs"),
            labels={"io.kubernetes.pod.name": meta["name"], "io.kubernetes.pod.namespace": meta.get("namespace", "")},
            linux=api_pb2.LinuxPodSandboxConfig(
                security_context=api_pb2.LinuxSandboxSecurityContext(
                    namespace_options=namespaces, privileged=privileged
                )
            ),
        )

    def _container_config(
        self, pod: Obj, container: Obj, volumes: dict[str, str], hosts: Path, account: Path | None = None
    ) -> api_pb2.ContainerConfig:
        name = container["name"]
        env = environment(container, pod, self.node)
        pod_context = pod_security(pod)
        # The pod's settings, each overridden by the container's own (as kubelet merges them).
        inherited = {k: pod_context[k] for k in ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile")
                     if k in pod_context}  # fmt: skip
        context = {**inherited, **container.get("securityContext", {})}
        known = {"privileged", "runAsUser", "runAsGroup", "runAsNonRoot", "allowPrivilegeEscalation", "capabilities",
                 "readOnlyRootFilesystem", "seccompProfile"}  # fmt: skip
        if set(context) - known:
            raise PodSpecError(f"containers[{name}].securityContext: {sorted(set(context) - known)} not supported here")
        if context.get("runAsNonRoot") and context.get("runAsUser", 1) == 0:
            raise PodSpecError(f"containers[{name}]: runAsNonRoot with runAsUser 0")
        security = api_pb2.LinuxContainerSecurityContext(
            privileged=bool(context.get("privileged", False)),
            namespace_options=api_pb2.NamespaceOption(
                network=api_pb2.NODE if pod["spec"].get("hostNetwork") else api_pb2.POD
            ),
            no_new_privs=context.get("allowPrivilegeEscalation") is False,
            readonly_rootfs=bool(context.get("readOnlyRootFilesystem", False)),
            capabilities=api_pb2.Capability(
                add_capabilities=context.get("capabilities", {}).get("add", []),
                drop_capabilities=context.get("capabilities", {}).get("drop", []),
            ),
        )
        profile = context.get("seccompProfile", {}).get("type", "Unconfined")
        if profile == "RuntimeDefault":
            security.seccomp_profile_path = "runtime/default"
            security.seccomp.profile_type = api_pb2.SecurityProfile.RuntimeDefault
        elif profile != "Unconfined":
            raise PodSpecError(f"containers[{name}]: seccompProfile {profile} is not supported here")
        if "fsGroup" in pod_context:
            security.supplemental_groups.append(int(pod_context["fsGroup"]))
        if "runAsUser" in context:
            security.run_as_user.value = int(context["runAsUser"])
        if "runAsGroup" in context:
            security.run_as_group.value = int(context["runAsGroup"])
        mounts = [api_pb2.Mount(container_path="/etc/hosts", host_path=str(hosts))] if pod["spec"].get(
            "hostNetwork"
        ) else []  # fmt: skip
        if account is not None:
            mounts.append(api_pb2.Mount(container_path=SERVICE_ACCOUNT_DIR, host_path=str(account), readonly=True))
        for m in container.get("volumeMounts", []):
            if m["name"] not in volumes:
                raise PodSpecError(f"containers[{name}].volumeMounts[{m['name']}]: no such volume")
            if m.get("mountPropagation") not in PROPAGATION:
                raise PodSpecError(
                    f"containers[{name}].volumeMounts[{m['name']}]: mountPropagation {m['mountPropagation']}"
                )
            source = os.path.join(volumes[m["name"]], m["subPath"]) if m.get("subPath") else volumes[m["name"]]
            mounts.append(
                api_pb2.Mount(
                    container_path=m["mountPath"],
                    host_path=source,
                    readonly=bool(m.get("readOnly", False)),
                    propagation=PROPAGATION[m.get("mountPropagation")],
                )
            )
        return api_pb2.ContainerConfig(
            metadata=api_pb2.ContainerMetadata(name=name, attempt=0),
            image=api_pb2.ImageSpec(image=container["image"]),
            command=[expand(c, env) for c in container.get("command", [])],
            args=[expand(a, env) for a in container.get("args", [])],
            working_dir=container.get("workingDir", ""),
            envs=[api_pb2.KeyValue(key=k, value=v) for k, v in env.items()],
            mounts=mounts,
            log_path=f"{name}.log",
            linux=api_pb2.LinuxContainerConfig(security_context=security),
        )

    def run(self, obj: Obj, api: ApiObjects, init_timeout: float = 300.0) -> Pod:
        """Start ``obj`` (a Pod, or a workload's template made into one): init containers to completion,
        then the containers. An init container that fails raises, with its log."""
        directory = self.pods_dir / obj["metadata"]["uid"]
        (directory / "logs").mkdir(parents=True, exist_ok=True)
        volumes = self._volumes(obj, directory, api)
        hosts = self._etc_hosts(obj, directory)
        account = self._service_account(obj, directory, api)
        sandbox_config = self._sandbox_config(obj, directory)
        sandbox = self.runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=sandbox_config), timeout=120)
        pod = Pod(obj, str(sandbox.pod_sandbox_id), directory)
        self.pods.append(pod)
        for container in obj["spec"].get("initContainers", []):
            cid = self._start(pod, sandbox_config, container, volumes, hosts, account)
            code = self.wait_exit(cid, init_timeout)
            pod.init_exits[container["name"]] = code
            if code != 0:
                raise AssertionError(f"init container {container['name']} exited {code}:\n{pod.log(container['name'])}")
        for container in obj["spec"]["containers"]:
            pod.containers[container["name"]] = self._start(pod, sandbox_config, container, volumes, hosts, account)
        return pod

    def sandbox(self, obj: Obj) -> Pod:
        """Only the pod's sandbox (its network, through the node's CNI configuration), as for a pod whose
        containers do not matter here."""
        directory = self.pods_dir / obj["metadata"]["uid"]
        (directory / "logs").mkdir(parents=True, exist_ok=True)
        config = self._sandbox_config(obj, directory)
        sandbox = self.runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=120)
        pod = Pod(obj, str(sandbox.pod_sandbox_id), directory)
        self.pods.append(pod)
        return pod

    def sandbox_netns(self, pod: Pod) -> str:
        """The sandbox's network namespace as this process reaches it (its pause process's)."""
        status = self.runtime.PodSandboxStatus(
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox, verbose=True), timeout=30
        )
        return f"/proc/{json.loads(status.info['info'])['pid']}/ns/net"

    def sandbox_ip(self, pod: Pod) -> str:
        status = self.runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox), timeout=30)
        return str(status.status.network.ip)

    def _start(
        self,
        pod: Pod,
        sandbox_config: api_pb2.PodSandboxConfig,
        container: Obj,
        volumes: dict[str, str],
        hosts: Path,
        account: Path | None = None,
    ) -> str:
        config = self._container_config(pod.obj, container, volumes, hosts, account)
        request = api_pb2.CreateContainerRequest(
            pod_sandbox_id=pod.sandbox, config=config, sandbox_config=sandbox_config
        )
        cid = str(self.runtime.CreateContainer(request, timeout=120).container_id)
        self.runtime.StartContainer(api_pb2.StartContainerRequest(container_id=cid), timeout=120)
        return cid

    def state(self, cid: str) -> tuple[int, int]:
        status = self.runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=cid), timeout=30).status
        return int(status.state), int(status.exit_code)

    def wait_exit(self, cid: str, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            state, code = self.state(cid)
            if state == api_pb2.CONTAINER_EXITED:
                return code
            if time.monotonic() > deadline:
                raise AssertionError(f"container {cid} still runs after {timeout} s")
            time.sleep(0.2)

    # -- probes ----------------------------------------------------------------------------

    def probe(self, pod: Pod, container: str, kind: str) -> tuple[bool, str]:
        """One run of the container's ``kind`` probe ("startupProbe", ...): (passed, what it said)."""
        spec = pod.container(container)[kind]
        timeout = int(spec.get("timeoutSeconds", PROBE_DEFAULTS["timeoutSeconds"]))
        if "exec" in spec:
            request = api_pb2.ExecSyncRequest(
                container_id=pod.containers[container], cmd=spec["exec"]["command"], timeout=timeout
            )
            try:
                out = self.runtime.ExecSync(request, timeout=timeout + 30)
            except grpc.RpcError as exc:
                return False, str(exc.details())
            return out.exit_code == 0, (out.stdout + out.stderr).decode(errors="replace")
        port_of = {p.get("name"): p["containerPort"] for p in pod.container(container).get("ports", [])}
        if "httpGet" in spec or "tcpSocket" in spec:
            action = spec.get("httpGet") or spec["tcpSocket"]
            port = port_of.get(action["port"], action["port"])
            host = action.get("host") or self.node.host_ip
            if not pod.spec.get("hostNetwork"):
                raise PodSpecError(f"{container}.{kind}: network probes of pod-network pods are not supported here")
            if "httpGet" in spec:
                url = f"{action.get('scheme', 'HTTP').lower()}://{host}:{port}{action.get('path', '/')}"
                return self._on_node(_HTTP_GET, url, str(timeout))
            return self._on_node(_TCP_CONNECT, host, str(port), str(timeout))
        raise PodSpecError(f"{container}.{kind}: {sorted(set(spec) - set(PROBE_DEFAULTS))} probes are not supported")

    def _on_node(self, script: str, *args: str) -> tuple[bool, str]:
        command = ["python3", "-c", script, *args]
        done = (
            self.node.on_node(command) if self.node.on_node else subprocess.run(command, capture_output=True, text=True)
        )
        return done.returncode == 0, done.stdout + done.stderr

    def wait_probe(self, pod: Pod, container: str, kind: str) -> tuple[bool, str]:
        """Run the probe as kubelet does until it passes, or its failureThreshold runs out (its own bound)."""
        spec = {**PROBE_DEFAULTS, **pod.container(container)[kind]}
        said = ""
        for _ in range(int(spec["failureThreshold"])):
            ok, said = self.probe(pod, container, kind)
            if ok:
                return True, said
            state, code = self.state(pod.containers[container])
            if state == api_pb2.CONTAINER_EXITED:
                return False, f"the container exited {code}: {said}"
            time.sleep(float(spec["periodSeconds"]))
        return False, said

    def remove(self, pod: Pod) -> None:
        self.runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox), timeout=120)
        self.runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox), timeout=120)
        self.pods.remove(pod)


_HTTP_GET = """
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as r:
        sys.exit(0 if 200 <= r.status < 400 else 1)
except Exception as exc:
    print(exc)
    sys.exit(1)
"""
_TCP_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as exc:
    print(exc)
    sys.exit(1)
"""


def pod_security(pod: Obj) -> Obj:
    """The pod's securityContext, checked for fields this stand-in knows."""
    context = dict(pod["spec"].get("securityContext", {}))
    unknown = set(context) - {"runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "seccompProfile"}
    if unknown:
        raise PodSpecError(f"spec.securityContext: {sorted(unknown)} not supported here")
    return context


def pod_of(workload: Obj, node: str, uid: str, ordinal: int | None = None) -> Obj:
    """A Pod as a workload's controller would make it from its template (name, uid, node): a
    StatefulSet's member ``ordinal`` is named NAME-ORDINAL, other pods NAME-<5 of the uid>.
    A StatefulSet's volumeClaimTemplates go with it (kubelet binds each to a local folder)."""
    template = workload["spec"]["template"]
    meta = workload["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **template.get("metadata", {}),
            "name": f"{meta['name']}-{uid[:5] if ordinal is None else ordinal}",
            "namespace": meta.get("namespace", "default"),
            "uid": uid,
        },
        "spec": {**template["spec"], "nodeName": node},
        "volumeClaimTemplates": workload["spec"].get("volumeClaimTemplates", []),
    }


def kustomized_image(image: str, kustomization: Obj) -> str:
    """``image`` with the kustomization's ``images`` override applied (newName, newTag)."""
    name, _, tag = image.partition(":")
    for rule in kustomization.get("images", []):
        if rule["name"] == name:
            return f"{rule.get('newName', name)}:{rule.get('newTag', tag)}"
    return image
