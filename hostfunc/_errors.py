"""The exception hostfunc raises for errors that happened inside host callbacks."""


class HostfuncError(RuntimeError):  # noqa: N818 (the name the public API has always had)
    """A host callback failed (see ``.errors`` for every recorded message, ``.owners`` for the owner tag of
    each, 0 for none), or broke the no-CUDA rule."""

    def __init__(self, message, errors=None, dropped=0, owners=None):
        super().__init__(message)
        self.errors = list(errors) if errors is not None else [message]
        self.owners = list(owners) if owners is not None else [0] * len(self.errors)
        self.dropped = dropped


HostfuncError.__module__ = "hostfunc"
