"""Preemption notices that arrive as metadata, not as a signal, and the thread that polls them.

Spot VMs are told shortly before they are taken away: AWS gives two minutes through the instance
metadata service (``spot/instance-action`` answers 404 until a stop or termination is scheduled,
then a JSON body), GCP about 30 s (``instance/preempted`` turns ``TRUE``; the VM also gets an ACPI
shutdown, which most images turn into SIGTERM). A notice is any callable returning a reason
(a non-empty string) or a falsy value; ``PreemptionCheckpoint(notice=...)`` polls it from a daemon
thread on each node's local rank 0, so that training never waits on an HTTP request.

The two ready-made notices talk to link-local metadata servers that exist only on those clouds;
``base_url`` lets a test point them at a local server.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable

Notice = Callable[[], "str | bool | None"]


class AWSSpotNotice:
    """``http://169.254.169.254/latest/meta-data/spot/instance-action`` with an IMDSv2 token.

    Args:
        base_url: the instance metadata service (the link-local default on EC2; a test server).
        timeout_s: each HTTP request's timeout: a poll never blocks the poller thread longer.
    """

    def __init__(self, base_url: str = "http://169.254.169.254", timeout_s: float = 1.0) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

    def __call__(self) -> str | None:
        token_req = urllib.request.Request(f"{self.base_url}/latest/api/token", method="PUT",
                                           headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        headers = {}
        try:
            with urllib.request.urlopen(token_req, timeout=self.timeout_s) as resp:
                headers["X-aws-ec2-metadata-token"] = resp.read().decode()
        except (urllib.error.URLError, OSError):
            pass  # IMDSv1 instances answer without a token
        req = urllib.request.Request(f"{self.base_url}/latest/meta-data/spot/instance-action", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return f"AWS spot instance-action: {resp.read().decode().strip()}"
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return None  # nothing scheduled
            raise


class GCPPreemptionNotice:
    """``http://metadata.google.internal/computeMetadata/v1/instance/preempted`` (``TRUE`` / ``FALSE``).

    Args:
        base_url: the metadata server (the default on GCE; a test server).
        timeout_s: each HTTP request's timeout: a poll never blocks the poller thread longer.
    """

    def __init__(self, base_url: str = "http://metadata.google.internal", timeout_s: float = 1.0) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

    def __call__(self) -> str | None:
        req = urllib.request.Request(f"{self.base_url}/computeMetadata/v1/instance/preempted",
                                     headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            answer = resp.read().decode().strip()
        return "GCP instance/preempted = TRUE" if answer.upper() == "TRUE" else None


class NoticePoller(threading.Thread):
    """Calls ``notice`` every ``interval_s`` until it gives a reason, then hands it to ``on_notice``.

    A notice that raises (the metadata server is unreachable) is retried at the next interval; the
    first error is kept in ``last_error`` for the log, never raised into training.
    """

    def __init__(self, notice: Notice, interval_s: float, on_notice: Callable[[str], None]) -> None:
        super().__init__(name="ldt-preemption-notice", daemon=True)
        if interval_s <= 0:
            raise ValueError(f"poll_interval_s={interval_s}: poll at a positive interval, e.g. 5")
        self.notice, self.interval_s, self.on_notice = notice, interval_s, on_notice
        self.last_error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                reason = self.notice()
            except Exception as err:  # noqa: BLE001
                self.last_error, reason = err, None
            if reason:
                self.on_notice(reason if isinstance(reason, str) else "preemption notice")
                return
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
