"""Credentials out of everything gentrain writes: manifests, tracker configs, log lines.

A checkpoint root is often readable by more people than the credentials
that wrote it (a shared bucket, a copied folder, an attached bug report),
so nothing a run stores may hold a secret. What is redacted:

- every value inside a `storage_options` mapping, at any depth (keys kept,
  so a reader still sees which options were set; booleans and nulls kept,
  they cannot be secrets);
- the value of any key that looks like a credential: a key whose words
  (split at `_`, `-`, `.` and camelCase) include secret, password, passwd, pwd,
  passphrase, credential(s), apikey, cookie, jwt, auth, authorization or authentication,
  or whose last word is key, token, sig, signature or pass (`key`, `aws_secret_access_key`,
  `sessionToken`, `X-Amz-Signature`, `db_pass`; but not `token_cache` or `max_tokens`);
  `..._key_id` / `..._token_id` count too;
- in any text, the user info of a URL (`s3://user:pass@host/...` ->
  `s3://<redacted>@host/...`), and the query parameters and fragment parameters
  (`#access_token=...`) named like credentials, and every `X-Amz-*` query parameter.

A password may hold `@`, `/` and `:` unescaped (users paste them so): the user
info runs to the LAST `@` before the URL's query or fragment, and is taken as user
info when it holds no `/` or a `:` comes before its first `/` (`user:pa/ss@host`).
So a path with an `@` after a `host:port` is redacted too: more than needed, never less.
A bare token (no `:`) that holds a `/` cannot be told from a path and is not redacted.

Nothing that is needed later is lost: a resume takes storage options from
the run's own config, and `sample` / `eval` from `--storage-options`.
Imports nothing from gentrain, so any layer may use it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

REDACTED = "<redacted>"

_STRONG = {
    "secret",
    "secrets",
    "password",
    "passwd",
    "pwd",
    "passphrase",
    "credential",
    "credentials",
    "apikey",
    "cookie",
    "jwt",
}
_AUTH = ("authori", "authent", "authtoken", "authkey")  # authorization, authentication (not "author")
_LAST = {"key", "token", "sig", "signature", "apikey", "pass"}
_ID_OF = {"key", "token"}  # aws_access_key_id: the id names a credential too
_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z]|$|[^A-Za-z])|[A-Z]?[a-z]+|\d+")
_URL = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<rest>[^\s'\"<>]+)")
# One name=value of a query or fragment (separated by & or ;); the value runs to the next separator.
_PARAM = re.compile(r"(?P<lead>^|[&;])(?P<name>[^&;=]+)=(?P<value>[^&;]*)")


def _words(key: str) -> list[str]:
    return [w.lower() for w in _WORDS.findall(key)]


def is_credential_key(key: object) -> bool:
    """True for a mapping key (or URL query parameter) whose name says it holds a credential."""
    if not isinstance(key, str):
        return False
    words = _words(key)
    if not words:
        return False
    if any(w in _STRONG or w == "auth" or w.startswith(_AUTH) for w in words):
        return True
    if words[-1] in _LAST:
        return True
    return len(words) >= 2 and words[-1] in {"id", "ids"} and words[-2] in _ID_OF


def _userinfo_end(rest: str) -> int:
    """Where the user info of a URL ends (the index of its `@` in `rest`, the URL after `scheme://`), or -1.

    The last `@` before the query or fragment whose text before it can be user info (no `/`, or a `:`
    before the first `/`), so a password holding `@` or `/` is taken whole, and `s3://bucket/a@b` (a `/`
    before any `:`) is a path, not user info."""
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, cut)
    while at > 0:  # an '@' in the path (`tok@host/model@v2`): the one before it may still end user info
        userinfo = rest[:at]
        slash, colon = userinfo.find("/"), userinfo.find(":")
        if slash < 0 or 0 <= colon < slash:
            return at
        at = rest.rfind("@", 0, at)
    return -1


def _is_url_credential(name: str) -> bool:
    name = unquote(name)
    return is_credential_key(name) or name.lower().startswith("x-amz-")


def _redact_params(params: str) -> str:
    """A query or fragment with the values of credential-named parameters redacted, the rest as typed."""
    return _PARAM.sub(
        lambda m: f"{m['lead']}{m['name']}={REDACTED}" if _is_url_credential(m["name"]) else m.group(0), params
    )


def _redact_url(scheme: str, rest: str) -> str:
    at = _userinfo_end(rest)
    if at > 0:
        rest = f"{REDACTED}{rest[at:]}"
    hash_at = rest.find("#")
    fragment = ""
    if hash_at >= 0:
        rest, fragment = rest[:hash_at], "#" + _redact_params(rest[hash_at + 1 :])
    query_at = rest.find("?")
    if query_at >= 0:
        rest = rest[: query_at + 1] + _redact_params(rest[query_at + 1 :])
    return f"{scheme}{rest}{fragment}"


def redact_text(text: str) -> str:
    """`text` with URL user info and credential query and fragment parameters replaced by `<redacted>`."""
    if "://" not in text:
        return text
    return _URL.sub(lambda m: _redact_url(m["scheme"], m["rest"]), text)


def _blank(value: Any) -> Any:
    """Every leaf of `value` redacted (bools and None kept: they cannot be secrets), structure kept."""
    if isinstance(value, Mapping):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_blank(v) for v in value]
    if value is None or isinstance(value, bool):
        return value
    return REDACTED


def redact(tree: Any) -> Any:
    """A copy of `tree` (JSON-like: mappings, lists, scalars) with storage options, credential-named keys
    and URL credentials redacted; `tree` itself is not changed."""
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            if k == "storage_options" or is_credential_key(k):
                out[k] = _blank(v)
            else:
                out[k] = redact(v)
        return out
    if isinstance(tree, list | tuple):
        return [redact(v) for v in tree]
    if isinstance(tree, str):
        return redact_text(tree)
    return tree


def secret_values(tree: Any, min_length: int = 4) -> set[str]:
    """The text of every credential-named value and URL password in `tree` (at least `min_length`
    characters): what a log filter must never let through, wherever a library puts it into a message.
    Other storage options (an endpoint, a region, a block size) stay visible in logs, where they help."""
    out: set[str] = set()

    def leaves(v: Any) -> Iterable[str]:
        if isinstance(v, Mapping):
            for x in v.values():
                yield from leaves(x)
        elif isinstance(v, list | tuple):
            for x in v:
                yield from leaves(x)
        elif v is not None and not isinstance(v, bool):
            yield str(v)

    def walk(v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                if is_credential_key(k):
                    out.update(leaves(x))
                else:
                    walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            for m in _URL.finditer(v):
                at = _userinfo_end(m["rest"])
                if at > 0:
                    userinfo = m["rest"][:at]
                    out.add(userinfo.split(":", 1)[1] if ":" in userinfo else userinfo)

    walk(tree)
    return {s for s in out if len(s) >= min_length}


class RedactingFilter(logging.Filter):
    """A logging filter that rewrites each record's message with URL credentials and the known secret
    values redacted; attach it to the handlers so every logger's lines pass through it."""

    def __init__(self) -> None:
        super().__init__()
        self._secrets: set[str] = set()

    def add_secrets(self, tree: Any) -> None:
        """Remember the secrets of a config tree (see `secret_values`)."""
        self._secrets |= secret_values(tree)

    def clean(self, text: str) -> str:
        """`text` with URL credentials and the known secret values redacted (lines printed, not logged)."""
        clean = redact_text(text)
        for s in sorted(self._secrets, key=len, reverse=True):
            clean = clean.replace(s, REDACTED)
        return clean

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.clean(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True
