"""Secrets out of whatever is recorded or printed (manifest, metrics, report, logs, error lines, dead letters,
Iceberg snapshot properties): redact() is the one function for it.

In text (a URL, a DSN, an exception message holding URLs):
- a URL's password: scheme://user:password@host -> scheme://user:***@host (the user is kept), also without a
  scheme (user:se/cret@host, as libpq and SQLAlchemy take it);
- credential-like query parameters: ?password=...&sig=...&X-Amz-Signature=... -> their values ***.
In a dict (storage options, flags): the string values of credential-like keys (key, secret, token, password,
aws_secret_access_key, ...) -> ***, and everything else redacted in turn. A name is credential-like when one of
its words (split at _ - . and camelCase, any case) is in SECRET_WORDS, or it holds one of SECRET_PARTS.

Text without a secret comes back unchanged (the same string), so what is hashed or compared from redacted values
(run keys) does not move for ordinary inputs.
"""
from __future__ import annotations

import logging
import re

MASK = "***"
SECRET_WORDS = frozenset({
    "password", "passwd", "pwd", "pass", "passphrase", "secret", "token", "key", "apikey", "accesskey",
    "secretkey", "sig", "signature", "credential", "credentials", "auth", "authorization", "sas"})
# ... and, in a name run together (awsaccesskeyid, xamzsignature), these parts of it
SECRET_PARTS = ("password", "passwd", "secret", "signature", "credential", "apikey", "accesskey", "privatekey",
                "accountkey", "sessiontoken", "securitytoken", "accesstoken", "authtoken", "refreshtoken")

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# scheme://user:password@ : the password runs to the authority's last @ (an unescaped @ inside it too); one
# holding a / (taken unescaped by SQLAlchemy) only when what follows the colon is no port (digits then /?#)
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][\w+.-]*://[^\s:/?#@'\"<>]*):"
                           r"(?P<secret>[^\s/?#]+|(?!\d*[/?#])[^\s?#'\"<>]+)@")
# user:password@host with no scheme; not a path's part (after / or :) and not a port
_BARE_PASSWORD = re.compile(r"(?<![\w.+%/:@-])(?P<head>[\w.+-]+):(?P<secret>(?!\d*[/?#])[^\s@/][^\s@]*)"
                            r"@(?=[\w\[])")
_QUERY_PARAMETER = re.compile(r"(?P<head>[?&](?P<name>[^=&#\s?'\"<>]+)=)(?P<value>[^&#\s'\"<>]+)")


def secret_name(name: str) -> bool:
    """Whether a query parameter or option named `name` holds a credential (X-Amz-Signature, aws_secret_access_key,
    apiKey: yes; max_tokens_per_batch, author: no)."""
    joined = re.sub(r"[\W_]", "", name.lower())
    return any(w.lower() in SECRET_WORDS for w in _WORDS.findall(name)) or any(p in joined for p in SECRET_PARTS)


def redact(value):
    """`value` with its secrets replaced by *** (see the module docstring): str, dict, list and tuple (in turn);
    anything else as it is."""
    if isinstance(value, str):
        return _redact_text(value)
    if isinstance(value, dict):
        return {redact(k): MASK if isinstance(k, str) and secret_name(k) and isinstance(v, str) and v else redact(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def _redact_text(text: str) -> str:
    if "@" in text:
        text = _URL_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", text)
        text = _BARE_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", text)
    if "=" in text:
        text = _QUERY_PARAMETER.sub(lambda m: m["head"] + MASK if secret_name(m["name"])
                                    and not m["value"].startswith(MASK) else m[0], text)   # ***:1#0: an id
    return text


class _RedactRecords(logging.Filter):
    """A log record's message, and the traceback it carries, redacted before a handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed log call: logging reports it when the handler formats it
            return True
        record.msg, record.args = redact(message), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


_RECORDS = _RedactRecords()


def redact_logs() -> None:
    """Idempotent: every handler of the root logger (logging.basicConfig's) prints records redacted."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RECORDS)
