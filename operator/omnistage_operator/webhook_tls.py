"""The admission webhook's serving certificate, reloaded in place when its files change.

kopf's WebhookServer loads certfile/pkeyfile into an SSLContext once and, when it sees the files change,
tears the HTTPS site down and starts it again (a gap in which the apiserver's calls fail, and in-flight
reviews are cut). Here the server gets a context we own and no files of its own to watch; when the mounted
Secret changes (cert-manager renewed it, or a new `webhook.existingSecret`) the new chain is loaded into the
same context: every new handshake presents it, established connections finish with the old one, and the
listening socket never closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

import kopf

log = logging.getLogger("omnistage.operator")


class ServingCertificate:
    """A server-side SSLContext holding the chain in `certfile`/`keyfile`, reloaded by `reload_if_changed`."""

    def __init__(self, certfile: str | os.PathLike, keyfile: str | os.PathLike):
        self.certfile, self.keyfile = Path(certfile), Path(keyfile)
        self.context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
        self._stamp: tuple | None = None
        if not self.reload_if_changed():
            raise FileNotFoundError(f"webhook certificate {self.certfile} or key {self.keyfile}: cannot read")

    def _stamp_now(self) -> tuple | None:
        # stat() follows the Secret volume's symlinks: the kubelet swaps `..data`, so the inode changes.
        try:
            return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in (p.stat() for p in
                                                                            (self.certfile, self.keyfile)))
        except OSError:
            return None

    def reload_if_changed(self) -> bool:
        """Load the files into the context when they changed since the last load; True when loaded. A pair
        that does not load (a key and certificate written one after the other) keeps the old chain, and
        is tried again on the next call."""
        stamp = self._stamp_now()
        if stamp is None or stamp == self._stamp:
            return False
        # Tried on a scratch context first: load_cert_chain is not atomic, and a key that does not match
        # leaves the new certificate in the context beside the old key, failing every handshake.
        ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.certfile, self.keyfile)
        self.context.load_cert_chain(self.certfile, self.keyfile)
        self._stamp = stamp
        return True

    async def follow(self, period: float) -> None:
        """Reload every `period` seconds when the files changed; forever."""
        while True:
            await asyncio.sleep(period)
            try:
                if self.reload_if_changed():
                    log.info("webhook: serving the renewed certificate from %s", self.certfile)
            except (ssl.SSLError, OSError) as e:
                log.warning("webhook: the changed certificate %s does not load yet (%s); keeping the old one",
                            self.certfile, e)


class ReloadingWebhookServer(kopf.WebhookServer):
    """kopf's WebhookServer serving with a ServingCertificate's context (see the module docstring)."""

    def __init__(self, *, serving: ServingCertificate, **kwargs):
        # No certfile/pkeyfile for kopf: it would watch them and restart the site on a change.
        super().__init__(**kwargs)
        self.serving = serving

    # kopf (1.45) builds its context in `_build_ssl`; given `context=` without files it would load a
    # self-signed certificate into it, so the method itself is replaced (tests/unit/test_webhook_reload.py
    # runs kopf's real server through it).
    def _build_ssl(self) -> tuple[bytes | None, ssl.SSLContext | None]:
        # The CA bundle kopf writes into a managed webhook configuration: the given one, else the
        # certificate itself (as kopf does for a certificate given without a CA).
        cadata = self.cadata
        if cadata is None and self.cafile is not None:
            cadata = Path(self.cafile).read_bytes()
        if cadata is None:
            cadata = self.serving.certfile.read_bytes()
        return cadata, self.serving.context
