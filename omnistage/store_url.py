"""What omnistage reads from a job store URL (sqlite:///FILE, postgresql://USER:PASS@HOST/DB) without opening it:
the URL as a message or a log line may show it (its password hidden), and a SQLite URL's file.

Pure: strings in, strings out. A malformed URL (one validation is about to refuse) is handled too: a message
must never echo the password of a URL that fails to parse.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from urllib.parse import unquote

HIDDEN = "***"
SQLITE = "sqlite:"


def redacted_url(url: str) -> str:
    """`url` with the password of its userinfo (`scheme://user:PASSWORD@host...`) and of its query string
    (`?password=...`) replaced by HIDDEN; a URL without one unchanged. The userinfo runs to the last "@" (a
    password may hold an unescaped "/", "?" or
    "#" where a URL parser would end the host early and miss it); text whose part before its first ":" holds a
    "/" is no userinfo (an "@" in a path, as in hf://ORG/NAME@REVISION) and is kept."""
    return _query_password_hidden(_userinfo_password_hidden(url))


def _userinfo_password_hidden(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, _, host = rest.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    if not colon or "/" in user:
        return url
    return f"{scheme}://{user}:{HIDDEN}@{host}"


def _query_password_hidden(url: str) -> str:
    """A `password=` field of the query string (libpq takes one there too) replaced by HIDDEN."""
    head, sep, query = url.partition("?")
    if not sep:
        return url
    fields = [f.partition("=") for f in query.split("&")]
    return head + "?" + "&".join(f"{key}{eq}{HIDDEN}" if unquote(key) == "password" else f"{key}{eq}{value}"
                                 for key, eq, value in fields)


def sqlite_file(url: str) -> str | None:
    """The file a `sqlite:///abs/path.db` (or `sqlite:relative/path.db`, `sqlite:////abs/path.db`) URL names, as
    the orchestrator's store opens it; None for another scheme, a URL naming a host, or one naming no file."""
    if not url.lower().startswith(SQLITE):
        return None
    rest = url[len(SQLITE):]
    if rest.startswith("//"):
        host, _, rest = rest[2:].partition("/")
        if host:
            return None
        rest = "/" + rest.lstrip("/")
    return None if rest in ("", "/") else rest


def sqlite_file_under(url: str, folder: str) -> bool:
    """Whether a SQLite URL's file lies inside `folder` (an absolute path; no ".." may climb out of it)."""
    path = sqlite_file(url)
    if path is None:
        return False
    p, root = PurePosixPath(path), PurePosixPath(folder)
    return p.is_absolute() and ".." not in p.parts and p != root and p.is_relative_to(root)
