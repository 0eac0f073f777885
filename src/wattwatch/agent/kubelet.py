"""Pod names, labels, annotations and owners from the kubelet's pods API, looked up by pod UID.

The agent finds a GPU process's pod UID in its cgroup path (``agent.discover``); the kubelet of the same
node knows the rest. ``GET {url}`` returns a ``PodList`` (``https://NODE:10250/pods`` with a service
account token that may read ``nodes/proxy``; the read-only port ``http://NODE:10255/pods`` where it is
still enabled). The list is cached and fetched again only when an unknown UID shows up, at most every
``min_refresh_s``, so a tick never waits on the kubelet more than once per new pod.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from wattwatch.client import make_client
from wattwatch.tls import client_verify

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


@dataclass(frozen=True)
class PodInfo:
    """What the agent uses of a pod. ``owner_*`` is its controller (a Job, a PyTorchJob, a ReplicaSet)."""

    uid: str
    name: str
    namespace: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    owner_kind: str | None = None
    owner_name: str | None = None
    owner_uid: str | None = None


class PodLookup(Protocol):
    """Anything that can name a pod from its UID."""

    def pod(self, uid: str) -> PodInfo | None:
        """The pod with this UID, or None when unknown."""
        ...


class KubeletPods:
    """``PodLookup`` over the kubelet's pods API at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        token_file: Path | None = None,
        verify: bool | str = True,
        timeout_s: float = 2.0,
        min_refresh_s: float = 5.0,
        client: httpx.Client | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self._token_file = token_file
        # A CA file as a path: its own context (httpx takes a context or a bool).
        context = client_verify(verify, named="WATTWATCH_KUBELET_CA_FILE") if isinstance(verify, str) else verify
        self._client = client or make_client(timeout_s=timeout_s, verify=context)
        self._min_refresh_s = min_refresh_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._pods: dict[str, PodInfo] = {}
        self._fetched_at = -float("inf")
        self._last_error = ""

    def pod(self, uid: str) -> PodInfo | None:
        """The pod with this UID; fetches the list again when the UID is new (rate-limited)."""
        with self._lock:
            found = self._pods.get(uid)
            if found is None and self._monotonic() - self._fetched_at >= self._min_refresh_s:
                self._refresh()
                found = self._pods.get(uid)
            return found

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()

    def _refresh(self) -> None:
        self._fetched_at = self._monotonic()
        headers = {"Accept": "application/json"}
        if self._token_file is not None:
            try:
                # Projected service account tokens rotate: read the file on every fetch.
                headers["Authorization"] = f"Bearer {self._token_file.read_text().strip()}"
            except OSError as exc:
                self._warn(f"cannot read the kubelet token {self._token_file} ({exc.strerror})")
        try:
            resp = self._client.get(self.url, headers=headers)
        except httpx.LocalProtocolError:
            # Never log the exception: its text would carry the token.
            self._warn(f"the kubelet token in {self._token_file} is not a valid bearer token; check the file")
            return
        except httpx.HTTPError as exc:
            self._warn(f"kubelet pods API {self.url} unreachable ({exc}); pods are named by UID only")
            return
        if resp.status_code in (401, 403):
            self._warn(
                f"kubelet {self.url} refused us (HTTP {resp.status_code}); give the agent's service account "
                "`get` on `nodes/proxy`, or set WATTWATCH_KUBELET_TOKEN_FILE"
            )
            return
        if not resp.is_success:
            self._warn(f"kubelet {self.url} answered HTTP {resp.status_code}")
            return
        try:
            self._pods = parse_pod_list(resp.json())
            self._last_error = ""
        except ValueError as exc:
            self._warn(f"kubelet {self.url} sent something that is not a PodList ({exc})")

    def _warn(self, message: str) -> None:
        if message != self._last_error:
            log.warning("%s", message)
        self._last_error = message


def parse_pod_list(body: Any) -> dict[str, PodInfo]:
    """UID -> PodInfo from a Kubernetes ``PodList`` object; raises ValueError when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("items"), list):
        raise ValueError("expected an object with an `items` list")
    pods: dict[str, PodInfo] = {}
    for item in body["items"]:
        meta = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or not meta.get("uid"):
            continue
        owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        uid = str(meta["uid"])
        pods[uid] = PodInfo(
            uid=uid,
            name=str(meta.get("name", "")),
            namespace=str(meta.get("namespace", "")),
            labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
            annotations={str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
            owner_kind=str(owner["kind"]) if owner and owner.get("kind") else None,
            owner_name=str(owner["name"]) if owner and owner.get("name") else None,
            owner_uid=str(owner["uid"]) if owner and owner.get("uid") else None,
        )
    return pods
