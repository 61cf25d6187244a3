"""RBAC as the Kubernetes API server enforces it, over the chart's rendered objects, for requests sent to kmock.

An API server authenticates a request (here: its bearer token names a ServiceAccount, as a
mounted ServiceAccount token does), turns it into request attributes, and authorizes them
against every binding of that user and its groups:

- **attributes** (:func:`attributes`, the API server's ``RequestInfoFactory``): ``/api/v1/...`` is
  the core group ``""``, ``/apis/<group>/<version>/...`` a named group; then
  ``[namespaces/<ns>/]<resource>[/<name>[/<subresource>]]``. The verb comes from the method:
  GET is ``get`` with a name, else ``list``, or ``watch`` with ``?watch=true`` (or ``1``); POST
  ``create``; PUT ``update``; PATCH ``patch``; DELETE ``delete`` with a name, else
  ``deletecollection``. Other paths (``/api``, ``/apis/<group>``, ``/version``) are non-resource
  requests.
- **bindings**: a ClusterRoleBinding grants its role's rules everywhere (cluster-scoped
  resources, every namespace, and lists across all namespaces); a RoleBinding grants its Role's,
  or a ClusterRole's, rules in its own namespace only. Subjects: a ServiceAccount by name and
  namespace, or the groups every ServiceAccount is in (``system:serviceaccounts``,
  ``system:serviceaccounts:<ns>``, ``system:authenticated``).
- **rules** match when the apiGroup, the resource (``replicasets``, or
  ``modelrollouts/status`` for a subresource; ``*`` and ``*/status`` as wildcards) and the verb
  are listed, and ``resourceNames``, when given, lists the request's name (a list or watch
  matches ``resourceNames`` only when narrowed to one name by ``fieldSelector=metadata.name=``;
  a create never does). Non-resource requests match ``nonResourceURLs`` (a trailing ``*`` is a
  prefix).
- ``aggregationRule`` ClusterRoles get the rules of the chart's ClusterRoles their selectors
  match. The cluster's own roles that every authenticated user has (``system:discovery``,
  ``system:public-info-viewer``, ``system:basic-user``) are built in.

:class:`Audit` evaluates every request kmock recorded that carries a known token, records which
granted rule entry (role, rule, apiGroup, resource, verb) allowed it, and reports what was
denied and which granted entries no request used. :meth:`Audit.enforce` turns it into the live
check of a running API server (403 for a denied request, 401 for an unknown token), for kmock's
``VersionedEmulator.authorize`` hook.

For in-cluster configuration, :func:`tls_server` serves a kmock handler over HTTPS with a
certificate for 127.0.0.1 signed by a fresh CA, and :class:`ServiceAccountMount` lays a token,
``ca.crt`` and ``namespace`` out as a mounted ServiceAccount does, with the environment a pod gets
(``KUBERNETES_SERVICE_HOST``/``_PORT`` and ``WEIGHTSHIP_KUBE_SERVICE_ACCOUNT_DIR``).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import secrets
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.test_utils
import kmock
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = [
    "Attributes",
    "Audit",
    "Grant",
    "Rbac",
    "ServiceAccountMount",
    "attributes",
    "tls_server",
]

Body = dict[str, Any]
_NAMESPACE_SUBRESOURCES = {"status", "finalize"}
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}
#: What every authenticated user may do in a stock cluster (the bootstrap ClusterRoles).
_BUILT_IN: list[Body] = [
    {
        "kind": "ClusterRole",
        "metadata": {"name": "system:discovery"},
        "rules": [{"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi",
                                       "/openapi/*", "/readyz", "/version", "/version/"], "verbs": ["get"]}],
    },
    {
        "kind": "ClusterRole",
        "metadata": {"name": "system:basic-user"},
        "rules": [{"apiGroups": ["authorization.k8s.io"], "verbs": ["create"],
                   "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"]}],
    },
]  # fmt: skip
_BUILT_IN_BINDINGS: list[Body] = [
    {
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role["metadata"]["name"]},
        "roleRef": {"kind": "ClusterRole", "name": role["metadata"]["name"]},
        "subjects": [{"kind": "Group", "name": "system:authenticated"}],
    }
    for role in _BUILT_IN
]


@dataclass(frozen=True)
class Attributes:
    """What the API server authorizes: who, which verb, on what."""

    user: str
    groups: tuple[str, ...]
    verb: str
    path: str
    resource_request: bool = True
    api_group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    def __str__(self) -> str:
        if not self.resource_request:
            return f"{self.user} {self.verb} {self.path}"
        what = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        where = f" in namespace {self.namespace}" if self.namespace else " (cluster-wide)"
        named = f" {self.name!r}" if self.name else ""
        return f"{self.user} {self.verb} {self.api_group or 'core'} {what}{named}{where}"


def service_account_user(namespace: str, name: str) -> tuple[str, tuple[str, ...]]:
    """The user name and groups a ServiceAccount's token authenticates as."""
    user = f"system:serviceaccount:{namespace}:{name}"
    return user, ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated")


def attributes(
    method: str, path: str, params: Mapping[str, str], user: str, groups: Sequence[str]
) -> Attributes:
    """The request attributes of one HTTP request, as the API server's ``RequestInfoFactory`` derives them."""
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        rest = []
    if not rest:  # /api, /api/v1, /apis/<group>[/<version>], /version...: discovery
        return Attributes(user, tuple(groups), method.lower(), path, resource_request=False)
    watch = params.get("watch", "").lower() in ("true", "1")
    if rest[0] == "watch":  # the deprecated /watch/ prefix
        rest, watch = rest[1:], True
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource, name, subresource = [*rest, "", "", ""][:3]
    if method in ("GET", "HEAD"):
        verb = "get" if name else ("watch" if watch else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _VERBS.get(method, method.lower())
    if not name and verb in ("list", "watch"):
        selected = params.get("fieldSelector", "")
        if selected.startswith("metadata.name=") and "," not in selected:
            name = selected.removeprefix("metadata.name=")
    return Attributes(user, tuple(groups), verb, path, True, group, resource, subresource, namespace, name)


@dataclass(frozen=True)
class Grant:
    """One entry a rule grants: (role, rule index, apiGroup, resource, verb), the unit of "used"."""

    role: str
    rule: int
    api_group: str
    resource: str
    verb: str

    def __str__(self) -> str:
        return f"{self.role} rule {self.rule}: {self.verb} {self.api_group or 'core'} {self.resource}"


@dataclass
class _Binding:
    name: str
    namespace: str | None  # None: a ClusterRoleBinding
    role: str  # "ClusterRole/<name>" or "Role/<ns>/<name>"
    subjects: list[Body]


def _match(granted: Iterable[str], wanted: str) -> bool:
    return any(g in ("*", wanted) for g in granted)


def _resource_match(granted: Iterable[str], resource: str, subresource: str) -> bool:
    full = f"{resource}/{subresource}" if subresource else resource
    for g in granted:
        if g in ("*", full):
            return True
        if subresource and g == f"*/{subresource}":
            return True
    return False


def _url_match(granted: Iterable[str], path: str) -> bool:
    return any(g == path or (g.endswith("*") and path.startswith(g[:-1])) for g in granted)


class Rbac:
    """The roles and bindings of a rendered chart (plus the cluster's built-in ones), evaluated as the API server does."""

    def __init__(self, objects: Iterable[Body]) -> None:
        objs = [*objects, *_BUILT_IN, *_BUILT_IN_BINDINGS]
        self.rules: dict[str, list[Body]] = {}
        self.bindings: list[_Binding] = []
        self.service_accounts: set[tuple[str, str]] = set()
        self.built_in = {f"ClusterRole/{r['metadata']['name']}" for r in _BUILT_IN}
        cluster_roles = [o for o in objs if o.get("kind") == "ClusterRole"]
        for obj in objs:
            meta = obj.get("metadata") or {}
            kind = obj.get("kind")
            if kind == "ClusterRole":
                self.rules[f"ClusterRole/{meta['name']}"] = list(obj.get("rules") or [])
            elif kind == "Role":
                self.rules[f"Role/{meta['namespace']}/{meta['name']}"] = list(obj.get("rules") or [])
            elif kind in ("ClusterRoleBinding", "RoleBinding"):
                ref = obj["roleRef"]
                namespace = meta.get("namespace") if kind == "RoleBinding" else None
                ref_name = f"ClusterRole/{ref['name']}" if ref["kind"] == "ClusterRole" else f"Role/{namespace}/{ref['name']}"
                self.bindings.append(_Binding(meta["name"], namespace, ref_name, list(obj.get("subjects") or [])))
            elif kind == "ServiceAccount":
                self.service_accounts.add((meta["namespace"], meta["name"]))
        for cluster_role in cluster_roles:  # aggregated ClusterRoles collect the rules of those their selectors match
            aggregation = cluster_role.get("aggregationRule")
            if not aggregation:
                continue
            collected: list[Body] = []
            for selector in aggregation.get("clusterRoleSelectors") or []:
                wanted = selector.get("matchLabels") or {}
                for other in cluster_roles:
                    labels = (other.get("metadata") or {}).get("labels") or {}
                    if other is not cluster_role and wanted.items() <= labels.items():
                        collected.extend(other.get("rules") or [])
            self.rules[f"ClusterRole/{cluster_role['metadata']['name']}"] = collected

    def _bound(self, binding: _Binding, user: str, groups: Sequence[str]) -> bool:
        for subject in binding.subjects:
            kind = subject.get("kind")
            if kind == "ServiceAccount":
                if user == f"system:serviceaccount:{subject.get('namespace', binding.namespace)}:{subject['name']}":
                    return True
            elif (kind, subject.get("name")) == ("User", user) or (kind == "Group" and subject.get("name") in groups):
                return True
        return False

    def roles_of(self, user: str, groups: Sequence[str]) -> list[tuple[_Binding, str]]:
        """(binding, role) pairs that apply to ``user``."""
        return [(b, b.role) for b in self.bindings if self._bound(b, user, groups) and b.role in self.rules]

    def authorize(self, attrs: Attributes) -> list[Grant]:
        """The granted entries that allow ``attrs`` (empty: the request is forbidden)."""
        allowed: list[Grant] = []
        for binding, role in self.roles_of(attrs.user, attrs.groups):
            if attrs.resource_request and binding.namespace is not None and binding.namespace != attrs.namespace:
                continue  # a RoleBinding grants in its own namespace only
            for index, rule in enumerate(self.rules[role]):
                if not _match(rule.get("verbs") or [], attrs.verb):
                    continue
                if not attrs.resource_request:
                    if _url_match(rule.get("nonResourceURLs") or [], attrs.path):
                        allowed.append(Grant(role, index, "", attrs.path, attrs.verb))
                    continue
                if not _match(rule.get("apiGroups") or [], attrs.api_group):
                    continue
                if not _resource_match(rule.get("resources") or [], attrs.resource, attrs.subresource):
                    continue
                names = rule.get("resourceNames") or []
                if names and (attrs.verb == "create" or attrs.name not in names):
                    continue
                resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
                allowed.append(Grant(role, index, attrs.api_group, resource, attrs.verb))
        return allowed

    def granted(self, user: str, groups: Sequence[str]) -> set[Grant]:
        """Every entry the chart grants ``user`` (the cluster's built-in roles left out)."""
        out: set[Grant] = set()
        for _, role in self.roles_of(user, groups):
            if role in self.built_in:
                continue
            for index, rule in enumerate(self.rules[role]):
                for verb in rule.get("verbs") or []:
                    for url in rule.get("nonResourceURLs") or []:
                        out.add(Grant(role, index, "", url, verb))
                    for group in rule.get("apiGroups") or []:
                        for resource in rule.get("resources") or []:
                            out.add(Grant(role, index, group, resource, verb))
        return out


@dataclass
class Audit:
    """Tokens of ServiceAccounts under test, and what their requests to kmock were allowed and denied."""

    rbac: Rbac
    tokens: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    denied: list[Attributes] = field(default_factory=list)
    used: dict[Grant, int] = field(default_factory=dict)
    requests: int = 0

    def token_for(self, namespace: str, name: str) -> str:
        """A fresh token that authenticates as ServiceAccount ``namespace/name`` (which the chart must create)."""
        assert (namespace, name) in self.rbac.service_accounts, (
            f"the chart creates no ServiceAccount {namespace}/{name}; it has {sorted(self.rbac.service_accounts)}"
        )
        token = f"sa-{name}-{secrets.token_hex(16)}"
        self.tokens[token] = service_account_user(namespace, name)
        return token

    def _user(self, headers: Mapping[str, str]) -> tuple[str, tuple[str, ...]] | None:
        header = headers.get("Authorization") or headers.get("authorization") or ""
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        if token.strip() not in self.tokens:
            raise PermissionError("an unknown bearer token")
        return self.tokens[token.strip()]

    def check(self, method: str, path: str, params: Mapping[str, str], headers: Mapping[str, str]) -> bool | None:
        """Evaluate one request: True allowed, False denied, None not sent by a ServiceAccount under test."""
        who = self._user(headers)
        if who is None:
            return None
        attrs = attributes(method, path, params, *who)
        self.requests += 1
        grants = self.rbac.authorize(attrs)
        for grant in grants:
            self.used[grant] = self.used.get(grant, 0) + 1
        if not grants:
            self.denied.append(attrs)
        return bool(grants)

    def enforce(self, request: Any) -> None:
        """The live check for ``VersionedEmulator.authorize``: 401 for an unknown token, 403 for a denied request."""
        try:
            allowed = self.check(request.method.value, request.url.path, dict(request.params), dict(request.headers))
        except PermissionError:
            raise kmock.KubernetesError(status=401, reason="Unauthorized", message="Unauthorized") from None
        if allowed is False:
            attrs = self.denied[-1]
            raise kmock.KubernetesError(
                status=403, reason="Forbidden", message=f"{attrs.user} cannot {attrs.verb} {attrs} (chart RBAC)"
            )

    def unused(self, needed_elsewhere: Mapping[tuple[str, str, str], str] = {}) -> list[Grant]:
        """Entries the chart grants any of its ServiceAccounts that no request used, except ``needed_elsewhere``.

        ``needed_elsewhere`` maps (apiGroup, resource, verb) to why the run does not take the path that needs it.
        """
        users = [service_account_user(namespace, name) for namespace, name in sorted(self.rbac.service_accounts)]
        granted: set[Grant] = set().union(*(self.rbac.granted(user, groups) for user, groups in users))
        used = {(g.role, g.rule, g.api_group, g.resource, g.verb) for g in self.used}
        return sorted(
            (
                g
                for g in granted
                if (g.role, g.rule, g.api_group, g.resource, g.verb) not in used
                and (g.api_group, g.resource, g.verb) not in needed_elsewhere
            ),
            key=str,
        )


@dataclass(frozen=True)
class ServiceAccountMount:
    """A ServiceAccount's token, CA and namespace laid out as Kubernetes mounts them in a pod."""

    directory: Path
    token: str
    ca: Path
    namespace: str

    @classmethod
    def write(cls, directory: Path, token: str, ca: Path, namespace: str) -> ServiceAccountMount:
        """Write ``token``, ``ca.crt`` and ``namespace`` into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(token, encoding="utf-8")
        (directory / "ca.crt").write_bytes(ca.read_bytes())
        (directory / "namespace").write_text(namespace, encoding="utf-8")
        return cls(directory, token, directory / "ca.crt", namespace)

    def env(self, server: kmock.Server) -> dict[str, str]:
        """The environment a pod gets for its API server (``server``), with this mount's directory."""
        return {
            "KUBERNETES_SERVICE_HOST": server.host,
            "KUBERNETES_SERVICE_PORT": str(server.port),
            "WEIGHTSHIP_KUBE_SERVICE_ACCOUNT_DIR": str(self.directory),
        }


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A fresh CA and a server certificate for 127.0.0.1 signed by it: (ca.crt, tls.crt, tls.key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kmock-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                    x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@contextlib.asynccontextmanager
async def tls_server(handler: kmock.RawHandler, directory: Path) -> AsyncIterator[tuple[kmock.Server, Path]]:
    """Serve ``handler`` over HTTPS too (a second kmock server on the same objects); yields it and its CA file."""
    ca, cert, key = _certificates(directory)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(ca))

    class _TlsTestServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
            await super().start_server(loop, ssl=context, **kwargs)

    def client(url: Any) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(ssl=trusting))

    async with kmock.Server(handler, server_cls=_TlsTestServer, client_fct=client) as server:
        yield server, ca
