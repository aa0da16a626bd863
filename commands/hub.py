"""publish's Hub client: one commit through huggingface_hub, every request within a timeout, and a failing or
offline Hub said in one sentence (what failed, what exists on the Hub now, how to retry). The token is
huggingface_hub's own (HF_TOKEN or `hf auth login`), never seen here."""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path

from draftsmith.core import DraftsmithError


@contextlib.contextmanager
def hub_timeouts(seconds: float):
    """Every request huggingface_hub makes inside waits at most `seconds` to connect or for data (its default
    client has no timeout): the shared client comes from a factory wrapping the one in place, restored after."""
    from huggingface_hub.utils import _http

    if not hasattr(_http, "set_client_factory"):  # huggingface_hub < 1.0 (requests): its own defaults
        yield
        return
    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def factory():
        client = previous()
        client.timeout = seconds
        return client

    _http.set_client_factory(factory)
    try:
        yield
    finally:
        _http.set_client_factory(previous)


def hub_errors() -> tuple[type[Exception], ...]:
    """What a failing Hub raises: HTTP answers (HfHubHTTPError), offline mode and refused connections (OSErrors),
    timeouts and transport errors (the HTTP library's own), an answer that is not JSON (ValueError)."""
    errors: list[type[Exception]] = [OSError, ValueError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # either turns huggingface_hub offline


def offline_variables() -> list[str]:
    """The variables that turn the Hub off, as set in the environment now; ["HF_HUB_OFFLINE"] where huggingface_hub
    read offline mode at import but neither is set now (it no longer says which)."""
    from huggingface_hub import constants

    set_now = [v for v in OFFLINE_VARIABLES if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    return set_now or (["HF_HUB_OFFLINE"] if getattr(constants, "HF_HUB_OFFLINE", False) else [])


def hub_offline() -> bool:
    """HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set (as huggingface_hub read them at import, or in the environment now)."""
    return bool(offline_variables())


def offline_refusal() -> str:
    """One sentence naming the variable that is actually set (TRANSFORMERS_OFFLINE turns the Hub off too)."""
    names = offline_variables() or ["HF_HUB_OFFLINE"]
    said = " and ".join(names)
    return (f"{said} {'is' if len(names) == 1 else 'are'} set, so publish cannot reach the Hub and nothing was "
            f"written or uploaded: unset {said} to upload, or pass dry_run=true to write the folder only.")


def hub_failure(e: Exception, step: str, repo_id: str, endpoint: str, created: bool, timeout: float,
                out: Path) -> str:
    """One sentence: which step failed and why, what exists on the Hub now, and how to retry."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):
        return offline_refusal()
    status = getattr(getattr(e, "response", None), "status_code", None)
    hint = ""
    if isinstance(e, HfHubHTTPError) and status:
        said = " ".join(str(getattr(e, "server_message", "") or "").split())
        why = f"the Hub answered HTTP {status}" + (f" ({said})" if said else "")
        if status in (401, 403):
            hint = (f"check that HF_TOKEN (or `hf auth login`) holds a token with write access to "
                    f"{repo_id.split('/')[0]}, then ")
        elif status == 404:
            hint = "check the repo id and that the token may write to it, then "
        elif status == 429 or status >= 500:
            hint = "the Hub failed on its side: wait a little, then "
    elif "timeout" in type(e).__name__.lower() or isinstance(e, TimeoutError):
        why = f"it did not answer within hub_timeout={timeout:g} s"
        hint = "wait or raise hub_timeout=, then "
    elif isinstance(e, (ConnectionError,)) or "connect" in type(e).__name__.lower() or \
            "network" in type(e).__name__.lower():
        why = f"it cannot be reached ({' '.join(str(e).split()) or type(e).__name__})"
        hint = "check the network (and HF_ENDPOINT, if set), then "
    else:
        why = " ".join(str(e).split())[:300] or type(e).__name__
    state = (f"the repo {repo_id} exists on the Hub (created now, or there before) but nothing was committed to it"
             if created else "nothing was created or uploaded on the Hub")
    return f"publish could not {step} on {endpoint}: {why}; {state}; {hint}rerun the same command to upload {out}."


def upload(out: Path, files: list[str], repo_id: str, private: bool, commit_message: str,
           timeout: float = 60.0) -> dict:
    """Create the repo if needed and push `files` (paths in `out`: publish's `upload_files`) in ONE commit; the token
    is huggingface_hub's own. Every request waits at most `timeout` seconds; a failing Hub is one sentence
    (`hub_failure`)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()  # token: HF_TOKEN or the saved login, resolved by huggingface_hub, never seen here
    created, step = False, f"create the repo {repo_id}"
    try:
        with hub_timeouts(timeout):
            repo = api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True)
            created, step = True, f"upload {len(files)} files to {repo_id} in one commit"
            info = api.create_commit(repo_id, repo_type="model", commit_message=commit_message,
                                     operations=[CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(out / f))
                                                 for f in files])
    except hub_errors() as e:
        raise DraftsmithError(hub_failure(e, step, repo_id, api.endpoint, created, timeout, out)) from None
    return {"url": str(getattr(repo, "url", "") or f"https://huggingface.co/{repo_id}"),
            "commit": getattr(info, "oid", None), "files": files}


def has_token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())
