"""The job's secret: what every launcher of one multi-machine job shares and a stranger lacks.

Machine 0's rendezvous (`unified.launcher.rendezvous`) answers only requests signed with it, and every
launcher checks that the answers are signed too. The secret comes from the environment variable
``UNIFIED_RENDEZVOUS_SECRET``, set to the same random value on every machine of the job by
whatever starts the job (a SLURM batch script before ``srun``, a Kubernetes Secret; recipes in
docs/security.md). It never travels: each request carries an HMAC-SHA256 of its body, checked
in constant time.

Example:
    >>> key = JobKey("0123456789abcdef0123456789abcdef")
    >>> tag = key.sign(b"request", b'{"op": "poll"}')
    >>> key.verify(b"request", b'{"op": "poll"}', tag)
    True
"""
from __future__ import annotations

import hashlib
import hmac
import os
from typing import Mapping, Optional

from ..errors import see

__all__ = ["SECRET_VARIABLE", "MIN_SECRET_CHARACTERS", "JobKey", "job_key", "new_secret_command"]

SECRET_VARIABLE = "UNIFIED_RENDEZVOUS_SECRET"
# 32 characters: 128 bits of randomness as hex (``secrets.token_hex(16)``); a shorter value is
# refused, since a stranger who guesses it steers the job.
MIN_SECRET_CHARACTERS = 32
new_secret_command = "python -c 'import secrets; print(secrets.token_hex(32))'"


class JobKey:
    """Signs and checks the messages of one job with a key derived from its secret."""

    def __init__(self, secret: str) -> None:
        self._key = hashlib.sha256(b"unified rendezvous v1\0" + secret.encode()).digest()

    def sign(self, purpose: bytes, message: bytes) -> str:
        """The hex HMAC-SHA256 of ``message`` for ``purpose`` (a request, or the answer to one)."""
        return hmac.new(self._key, purpose + b"\0" + message, hashlib.sha256).hexdigest()

    def verify(self, purpose: bytes, message: bytes, tag: Optional[str]) -> bool:
        """Whether ``tag`` is ``message``'s signature; constant time in what it compares."""
        return isinstance(tag, str) and hmac.compare_digest(self.sign(purpose, message), tag)


def job_key(environ: Mapping[str, str] = os.environ) -> JobKey:
    """The job's key from ``UNIFIED_RENDEZVOUS_SECRET``; raises `SystemExit` saying how to set
    one when it is missing or too short to be safe.

    Example:
        >>> job_key({"UNIFIED_RENDEZVOUS_SECRET": "0123456789abcdef0123456789abcdef"})  # doctest: +ELLIPSIS
        <unified.launcher.job_secret.JobKey object at ...>
    """
    secret = environ.get(SECRET_VARIABLE, "")
    if not secret:
        raise SystemExit(
            f"unified launch: several machines with --max-restarts need a secret that every machine of the job "
            f"shares and nobody else has: machine 0's rendezvous answers only the job's own launchers. Set "
            f"{SECRET_VARIABLE} to the same random value on every machine before starting the job, e.g. "
            f"`export {SECRET_VARIABLE}=$({new_secret_command})` in the batch script, before srun."
            + see("launch-secret"))
    if len(secret) < MIN_SECRET_CHARACTERS or len(set(secret)) < 8:
        raise SystemExit(
            f"unified launch: {SECRET_VARIABLE} is too weak to keep strangers out ({len(secret)} characters, "
            f"{len(set(secret))} different); use at least {MIN_SECRET_CHARACTERS} random characters, e.g. "
            f"`export {SECRET_VARIABLE}=$({new_secret_command})`." + see("launch-secret"))
    return JobKey(secret)
