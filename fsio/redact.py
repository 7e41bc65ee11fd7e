"""Secrets out of whatever is recorded or printed (manifest, metrics, report, logs, error lines, dead letters,
Iceberg snapshot properties): redact() is the one function for it.

In text (a URL, a DSN, an exception message holding URLs):
- a URL's user info, whatever it holds (a user, user:password, a token, token:x-oauth-basic):
  scheme://user:password@host -> scheme://***@host, also without a scheme (user:se/cret@host, as libpq and
  SQLAlchemy take it);
- a header or mapping entry a library prints whose name is credential-like (`'X-Amz-Security-Token': b'...'`,
  `"Authorization": "..."`), and AWS Signature Version 4's `Credential=` and `Signature=` values;
- a URL's fragment, whatever it holds: https://host/a.txt#access_token=X -> https://host/a.txt#***;
- a URL query's values, quoted ("X", 'X') or not, except those of PLAIN_PARAMETERS: ?jwt=X&versionId=3 ->
  ?jwt=***&versionId=3; a parameter with a credential-like name is masked after an & or a ; outside a query too
  (https://h/x.txt;sig=X -> ;sig=***, to the next ; ? # & or space, / included); a quoted value ("X", 'X') is
  one only where its closing quote ends it (?sig="a"b is masked whole).
A text that is one URL with a space in it (it starts with its scheme, on one line: an input or a folder as the user
gave it), or such a URL quoted whole in a message (error: input 'scheme://...' matches no file), has its user info,
query values and fragment masked to their ends (the URL's closing quote's, not a value's quoted inside it with the
same quote: 'https://h/x?sig='a& b'' -> 'https://h/x?sig=***'), spaces included: a password or a token may
hold one. An unquoted value (a password, a query value, a fragment, a header's) holding a quote or an angle
bracket is masked past it: one ends the value only where it closes it (an end, a space or punctuation follows).
In a dict (storage options, flags): the string values of credential-like keys (key, secret, token, password,
aws_secret_access_key, ...) -> ***, and everything else redacted in turn. A name is credential-like when one of
its words (split at _ - . and camelCase, any case) is in SECRET_WORDS, or it holds one of SECRET_PARTS.

Text without user info or query values (local paths, plain URLs) comes back unchanged (the same string), so what
is hashed or compared from redacted values (run keys) does not move for ordinary inputs.

Linear in the text's length whatever it holds (an error quoting a crafted record never stalls a worker): the rules
that scan from many starts find their ends by position (_Positions), schemes by runs (_scheme_heads).
"""
from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Iterable, Iterator

MASK = "***"
SECRET_WORDS = frozenset({
    "password", "passwd", "pwd", "pass", "passphrase", "secret", "token", "key", "apikey", "accesskey",
    "secretkey", "sig", "signature", "credential", "credentials", "auth", "authorization", "sas", "jwt"})
# ... and, in a name run together (awsaccesskeyid, xamzsignature), these parts of it
SECRET_PARTS = ("password", "passwd", "secret", "signature", "credential", "apikey", "accesskey", "privatekey",
                "accountkey", "sessiontoken", "securitytoken", "accesstoken", "authtoken", "refreshtoken")
# Query parameters (any case) whose values are kept: they say which object or which form of it was read (an S3
# object version, a GCS generation, GCS's alt=media, a format or page) and are never credentials. Any other
# name may carry a credential (jwt, code, X-Amz-Signature, an API's own): its value is masked.
PLAIN_PARAMETERS = frozenset({"versionid", "generation", "alt", "format", "page"})

_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# quotes and angle brackets end a value only where they close it (what follows them is an end or a space, maybe
# after punctuation): ?sig=ab"cd and ?sig=a<.b are masked whole, 'https://h/x?sig=ab': keeps its closing quote
_CLOSING = r"['\"<>]{1,8}(?=[,;:.!)\]}]{0,8}(?:\s|$))"      # (runs of at most 8: linear time)


def _until_closing(excluded: str) -> str:
    """A run of characters other than `excluded` (regex class text) and closing quotes (_CLOSING)."""
    return rf"(?:[^{excluded}'\"<>]|(?!{_CLOSING})['\"<>])"


_ENDS = r"[\s&#,;:.)\]}'\"<>]|$"     # what may follow a quoted value's closing quote
# a quoted value ("X", 'X', or as a repr escapes it: \'X\'), one only where its closing quote ends it
_QUOTED_VALUE = rf"\\?\"[^\"\n]*\"(?={_ENDS})|\\?'[^'\n]*'(?={_ENDS})"
_PASSWORD, _VALUE, _FRAGMENT, _QUOTED, _AWS4_VALUE = (_until_closing(c)
                                                      for c in (r"\s?#", r"&#\s", r"\s", r"\n", r",\s&"))
# a URL's scheme and :// (_scheme_heads): found from a whole run of scheme characters then ://, its start the
# run's first letter that starts a word (as \b[a-zA-Z][\w+.-]*:// would find it, without a scan from every letter)
_SCHEME_RUN = re.compile(r"(?<![\w+.-])[\w+.-]+://")
_SCHEME_START = re.compile(r"\b[a-zA-Z]")
# scheme://userinfo@ (_mask_userinfo): to the authority's last @ (an unescaped @ inside it too); a password holding
# a / (taken unescaped by SQLAlchemy) only when what follows the colon is no port (digits then /?#)
_AT = re.compile("@")
_AUTHORITY_END = re.compile(r"[\s/?#]")
_USER_END = re.compile(r"[\s:/?#@'\"<>]")
_PASSWORD_END = re.compile(rf"(?=[\s?#]|{_CLOSING})")
_PORT = re.compile(r"\d*[/?#]")
# user:password@host with no scheme, where a value starts (text's start, after a space, a quote, ( = , ;): not a
# path's part, and not a port; the password to the next @ or space (_mask_userinfo)
_BARE_HEAD = re.compile(r"(?<![^\s'\"(=,;])[\w.+-]+:(?!\d*[/?#])[^\s@/]")
_BARE_END = re.compile(r"[\s@]")
_HOST_START = re.compile(r"[\w\[]")
# ?name=value or &name=value, the value quoted or not; a lone ?name or &name keeps a query going
_PARAMETER = re.compile(r"(?P<sep>[?&])(?P<name>[^=&#\s?'\"<>]*)"
                        rf"(?:=(?P<value>{_QUOTED_VALUE}|{_VALUE}*))?")
# ;name=value in a path (a matrix parameter): its value to the next ; ? # & or space, / included
_PATH_PARAMETER = re.compile(rf";(?P<name>[^=;/?#&\s'\"<>]+)=(?!\*\*\*)(?P<value>{_QUOTED_VALUE}|"
                             rf"(?:(?![;?#&]){_VALUE})*)")
# a URL's fragment (#access_token=..., as OAuth's implicit flow hands tokens): never sent to a server, masked whole
# (_mask_fragments: a # that ends a run of characters holding a URL's scheme)
_FRAGMENT_RUN = re.compile(r"(?<![^\s#'\"<>])[^\s#'\"<>]*#")
_FRAGMENT_VALUE = re.compile(rf"(?!\*\*\*){_FRAGMENT}+")
# a header or mapping printed by a library (botocore's DEBUG lines): 'X-Amz-Security-Token': b'...', "authorization": "..."
_HEADER = re.compile(r"(?P<head>(?P<q>['\"])(?P<name>[\w.-]+)(?P=q)\s*:\s*b?)(?P<v>['\"])"
                     rf"(?P<value>{_QUOTED}*)(?P=v)")
# a header on its own line (an HTTP request's text, AWS4's canonical request): x-amz-security-token:..., Authorization: ...
# (not a sentence id: a file named like a header, then :line#sentence with nothing between)
_HEADER_LINE = re.compile(r"^(?P<head>[ \t]*(?P<name>[A-Za-z][\w-]*):(?!\d+#\d+$)[ \t]*)(?!\*\*\*$)"
                          r"(?P<value>\S[^\n]*)$", re.M)
# AWS Signature Version 4 in an Authorization header: Credential=<key id>/<scope>, Signature=<hex>
_AWS4 = re.compile(rf"(?<![\w-])(?P<name>Credential|Signature)=(?!\*\*\*){_AWS4_VALUE}+")
# masked already: a mask, then maybe an id's line number (in.txt?sig=***:1#0) or what ended a quoted value (, ))
_MASKED = re.compile(r"\*\*\*(:\d+)?\W*")


def secret_name(name: str) -> bool:
    """Whether a query parameter or option named `name` holds a credential (X-Amz-Signature, aws_secret_access_key,
    apiKey: yes; max_tokens_per_batch, author: no)."""
    joined = re.sub(r"[\W_]", "", name.lower())
    return any(w.lower() in SECRET_WORDS for w in _WORDS.findall(name)) or any(p in joined for p in SECRET_PARTS)


REDACT_PASSES = 3      # a mask can close a quote that a secret's own quote kept open: the rules again, at most this


def redact(value):
    """`value` with its secrets replaced by *** (see the module docstring): str, dict, list and tuple (in turn);
    anything else as it is."""
    if isinstance(value, str):
        for _ in range(REDACT_PASSES):     # until nothing more is masked: redact(redact(x)) == redact(x)
            value, before = _redact_text(value), value
            if value == before:
                break
        return value
    if isinstance(value, dict):
        return {redact(k): MASK if isinstance(k, str) and secret_name(k) and isinstance(v, str) and v else redact(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


_SCHEME = re.compile(r"[a-zA-Z][\w+.-]*://")
# ;name=value in a path, its value to the next ; ? # & or the end, spaces included
_ONE_PARAMETER = re.compile(r";(?P<name>[^=;/?#&\s]+)=(?P<value>[^;?#&]*)")
# a query's parameters to its end, spaces included: name=value (the value quoted or not) then & or the end
_ONE_QUERY = re.compile(r"(?P<name>[^=&]*)(?:=(?P<value>(?:\"[^\"]*\"|'[^']*')?[^&]*))?(?P<sep>&|$)")


_IPV6_HOST = re.compile(r"\[[0-9A-Fa-f:.]*\]")     # http://[::1]/...: its colons are no user:password's


def _one_url(text: str) -> str:
    """A text that is one URL holding whitespace (see the module docstring), its parts masked to their ends: user
    info in the user:password form (not host:port) to the last @ before another URL (a password may hold / ? # and
    spaces), else to the authority's last @; its query or fragment to the end; a ;name=value with a credential-like
    name to the next ; ? # & or the end."""
    head = _SCHEME.match(text)
    if not head or "\n" in text or not re.search(r"\s", text):
        return text                         # no whitespace: the rules below find every end
    start = head.end()
    colon = text.find(":", start)
    stop = next((m.start() for m in re.finditer(r"\s[a-zA-Z][\w+.-]*://", text)), len(text))   # another URL
    if colon >= 0 and not _IPV6_HOST.match(text, start) and not re.search(r"[/?#\s]", text[start:colon]) and not re.match(r"\d*(?:[/?#]|$)",
                                                                                   text[colon + 1:]) \
            and text.rfind("@", 0, stop) > colon:
        at = text.rfind("@", 0, stop)
    else:
        end = min([i for i in (text.find(c, start) for c in "/?#") if i >= 0] or [len(text)])
        at = text.rfind("@", start, end)
    if at >= 0:
        text = f"{text[:start]}{MASK}{text[at:]}"
        start += len(MASK) + 1
    text = _ONE_PARAMETER.sub(lambda m: f";{m['name']}={MASK}" if secret_name(m["name"]) else m[0], text)
    query_at, hash_at = text.find("?", start), text.find("#", start)
    if 0 <= hash_at and (query_at < 0 or hash_at < query_at):
        return text if text[hash_at + 1:] == MASK else f"{text[:hash_at]}#{MASK}"
    if query_at >= 0:
        query_end = text.find("#", query_at) if "#" in text[query_at:] else len(text)

        text = f"{text[:query_at + 1]}{_one_query(text[query_at + 1:query_end])}{text[query_end:]}"
        hash_at = text.find("#", query_at)
        if hash_at >= 0 and text[hash_at + 1:] != MASK:
            text = f"{text[:hash_at]}#{MASK}"
    return text


def _one_query(query: str, depth: int = 0) -> str:
    """The query of a text that is one URL (after its ?), each value masked to its & or end but for
    PLAIN_PARAMETERS'; a kept value holding a ? is a query in turn (?page=1?sig=X), MAX_NESTED_QUERIES deep."""
    def mask(m: re.Match) -> str:
        name, value = m["name"], m["value"]
        if value and not (name.lower() in PLAIN_PARAMETERS and not secret_name(name)):
            return f"{name}={MASK}{m['sep']}"
        if value and "?" in value and value[0] not in "'\"":
            kept, _, rest = value.partition("?")
            nested = _one_query(rest, depth + 1) if depth < MAX_NESTED_QUERIES else MASK
            return f"{name}={kept}?{nested}{m['sep']}"
        return m[0]
    return _ONE_QUERY.sub(mask, query)


# a quote opening a URL ('scheme://..., as repr() quotes an argument); the next such quote closes it when an end
# follows it (_ENDS), unless it closes a value quoted inside (the last quote before it opens one: ?sig='a& b''),
# then the next on the line does
_QUOTED_URL_START = re.compile(r"(?P<q>['\"])(?=[a-zA-Z][\w+.-]*://)")
_QUOTE = {q: re.compile(rf"(?<!\\){q}(?={_ENDS})") for q in "'\""}    # unescaped, then an end
_ANY_QUOTE = {q: re.compile(q) for q in "'\""}
_NEWLINE = re.compile("\n")


QUOTED_URLS_A_QUOTE = 8     # URLs tried against one closing quote at most (each is read to it: linear time)


def _mask_quoted_urls(text: str) -> str:
    """Each URL quoted whole and holding whitespace (on one line) masked as a text that is one URL (_one_url); past
    QUOTED_URLS_A_QUOTE opening quotes before one closing quote, the others are left to the other rules."""
    out, done, newlines, tried = [], 0, _Positions(_NEWLINE, text), {}
    quotes = {q: _Positions(pattern, text) for q, pattern in _QUOTE.items()}
    any_quotes = {q: _Positions(pattern, text) for q, pattern in _ANY_QUOTE.items()}
    for m in _QUOTED_URL_START.finditer(text):
        if m.start() < done:
            continue
        q, line_end = m["q"], newlines.first(m.end())
        end = quotes[q].first(m.end())
        opened = any_quotes[q].last(m.end(), end)       # a value quoted inside: end is its closing quote
        if opened > 0 and text[opened - 1] == "=" and (after := quotes[q].first(end + 1)) < line_end:
            end = after
        tried[end] = tried.get(end, 0) + 1
        if end < len(text) and end < line_end and tried[end] <= QUOTED_URLS_A_QUOTE:
            inner = text[m.end():end]
            masked = _one_url(inner)
            if masked != inner:
                out += [text[done:m.end()], masked]
                done = end
    return "".join(out) + text[done:] if out else text


def redact_url_part(part: str) -> str:
    """A URL's part after its host (a path with its query: an id's file label), redacted as that whole URL would
    be: its query values masked to the end, spaces included."""
    head = "x://host/"
    whole = redact(head + part)
    return whole[len(head):] if whole.startswith(head) else MASK


def _redact_text(text: str) -> str:
    text = _one_url(text)
    if "://" in text and ("'" in text or '"' in text):
        text = _mask_quoted_urls(text)
    if "@" in text:
        text = _mask_userinfo(text, _scheme_heads(text), _url_userinfo_end, keep_head=True)
        text = _mask_userinfo(text, ((m.start(), m.end()) for m in _BARE_HEAD.finditer(text)), _bare_userinfo_end,
                              keep_head=False)
    if "=" in text:
        text = _redact_query(text)
        if ";" in text:
            text = _PATH_PARAMETER.sub(lambda m: f";{m['name']}={MASK}" if secret_name(m["name"]) and m["value"]
                                       else m[0], text)
    if "#" in text:
        text = _mask_fragments(text)
    if ":" in text and ("'" in text or '"' in text):
        text = _HEADER.sub(lambda m: f"{m['head']}{m['v']}{MASK}{m['v']}" if secret_name(m["name"]) and m["value"]
                           and m["value"] != MASK else m[0], text)
    if ":" in text:
        text = _HEADER_LINE.sub(lambda m: f"{m['head']}{MASK}" if secret_name(m["name"]) else m[0], text)
    if "Credential=" in text or "Signature=" in text:
        text = _AWS4.sub(lambda m: f"{m['name']}={MASK}", text)
    return text


class _Positions:
    """Where a pattern matches in a text (computed once, on first use): the first such position at or after p in
    O(log n), so that rules scanning from many starts stay linear in the text, whatever it holds."""

    def __init__(self, pattern: re.Pattern, text: str):
        self.pattern, self.text, self.at = pattern, text, None

    def first(self, p: int) -> int:
        """The first match's start at or after p; len(text) when none."""
        if self.at is None:
            self.at = [m.start() for m in self.pattern.finditer(self.text)]
        i = bisect.bisect_left(self.at, p)
        return self.at[i] if i < len(self.at) else len(self.text)

    def last(self, lo: int, hi: int) -> int:
        """The last match's start in [lo, hi); -1 when none."""
        if self.at is None:
            self.at = [m.start() for m in self.pattern.finditer(self.text)]
        i = bisect.bisect_left(self.at, hi) - 1
        return self.at[i] if i >= 0 and self.at[i] >= lo else -1


def _scheme_heads(text: str, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, end) of each URL scheme with its :// in text[start:end], left to right."""
    for m in _SCHEME_RUN.finditer(text, start, len(text) if end is None else end):
        if first := _SCHEME_START.search(text, m.start(), m.end() - 3):
            yield first.start(), m.end()


def _mask_userinfo(text: str, heads: Iterable[tuple[int, int]], end_of, keep_head: bool) -> str:
    """Every user info that starts after a head ((start, end) in text, left to right) and that end_of(text, head's
    end, positions) ends (the index of its @, or -1: none) replaced by *** (after the head when keep_head), left to
    right, none inside another."""
    out, done, positions = [], 0, {}
    for start, end in heads:
        if start < done:
            continue
        at = end_of(text, end, positions)
        if at >= 0:
            out += [text[done:start], text[start:end] if keep_head else "", MASK, "@"]
            done = at + 1
    return "".join(out) + text[done:] if out else text


def _found(positions: dict, pattern: re.Pattern, text: str) -> _Positions:
    return positions.setdefault(pattern, _Positions(pattern, text))


def _url_userinfo_end(text: str, h: int, positions: dict) -> int:
    """The @ that ends scheme://userinfo@ after the head ending at h: the authority's last (at least one character
    before it), else, for user:password (the colon followed by no port), the last before the password's end (a
    space, ? or #, a closing quote)."""
    ats = _found(positions, _AT, text)
    at = ats.last(h + 1, _found(positions, _AUTHORITY_END, text).first(h))
    if at >= 0:
        return at
    colon = _found(positions, _USER_END, text).first(h)
    if colon < len(text) and text[colon] == ":" and not _PORT.match(text, colon + 1):
        return ats.last(colon + 2, _found(positions, _PASSWORD_END, text).first(colon + 1))
    return -1


def _bare_userinfo_end(text: str, h: int, positions: dict) -> int:
    """The @ that ends user:password@ after the head ending at h (the user, its colon, the password's first
    character): the next @ or space, when an @ followed by a host."""
    at = _found(positions, _BARE_END, text).first(h)
    return at if at < len(text) and text[at] == "@" and _HOST_START.match(text, at + 1) else -1


def _mask_fragments(text: str) -> str:
    """Every URL's fragment replaced by ***: a # (not followed by *** already) ending a run of characters that
    holds a scheme://, the fragment to its end (a space or a closing quote)."""
    out, done = [], 0
    for m in _FRAGMENT_RUN.finditer(text):
        if m.start() < done:
            continue
        if next(_scheme_heads(text, m.start(), m.end() - 1), None) and \
                (value := _FRAGMENT_VALUE.match(text, m.end())):
            out += [text[done:m.end()], MASK]
            done = value.end()
    return "".join(out) + text[done:] if out else text


MAX_NESTED_QUERIES = 4     # a kept value holding a query holding one ...: past this depth, the rest is masked


def _redact_query(text: str, depth: int = 0) -> str:
    """Query values masked: those after a ? and the &s that follow it, but for PLAIN_PARAMETERS; credential-like
    names after any &. A kept value holding a ? is redacted as a query in turn, MAX_NESTED_QUERIES deep at most
    (the rest of the value masked past it: no recursion as deep as a crafted text's ?s, no time growing with
    their square)."""
    query_end = -1

    def mask(m: re.Match) -> str:
        nonlocal query_end
        in_query = m["sep"] == "?" or m.start() == query_end
        if in_query:
            query_end = m.end()
        name, value = m["name"], m["value"]
        if not value or _MASKED.fullmatch(value) or not (
                secret_name(name) or in_query and name.lower() not in PLAIN_PARAMETERS):
            if value and "?" in value and value[0] not in "'\"":   # a kept value holding a query: redacted as one
                kept, _, rest = value.partition("?")               # (s3://b/&=?sig=X: "&=" is the object's name)
                query_end = m.end()
                nested = _redact_query("?" + rest, depth + 1) if depth < MAX_NESTED_QUERIES else f"?{MASK}"
                return f"{m['sep']}{name}={kept}{nested}"
            return m[0]
        return f"{m['sep']}{name}={MASK}"

    return _PARAMETER.sub(mask, text)


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
