"""kvdiag: make the KV cache of LLM serving engines observable."""

__version__ = "0.1.0"


def track(obj, nbytes: int, owner, label: str = "") -> int:
    """Track a cache object (``nbytes``) owned by ``owner`` (an object, or a key such as a
    request id ended with ``kvdiag.end_owner``); see :mod:`kvdiag.collectors.release`."""
    from kvdiag.collectors.release import default_tracker
    return default_tracker().track(obj, nbytes, owner, label)


def end_owner(owner) -> None:
    """Mark an owner key (e.g. a finished request id) as done for ``kvdiag.track``."""
    from kvdiag.collectors.release import default_tracker
    default_tracker().end_owner(owner)
