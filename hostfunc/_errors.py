"""The exception hostfunc raises for errors that happened inside host callbacks."""


class HostfuncError(RuntimeError):  # noqa: N818 (the issue names it so)
    """A host callback failed (see ``.errors`` for every recorded message), or broke the no-CUDA rule."""

    def __init__(self, message, errors=None, dropped=0):
        super().__init__(message)
        self.errors = list(errors) if errors is not None else [message]
        self.dropped = dropped


HostfuncError.__module__ = "hostfunc"
