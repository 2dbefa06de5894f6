"""Why a node's blocks service could not be used: free of torch, so that a ClientApp that only
relays a worker's rounds can name the failure without loading it."""


class BlocksUnavailable(RuntimeError):
    """The blocks service did not answer within the node's retries (down, slow, restarting)."""


class BlocksRefused(RuntimeError):
    """The blocks service refused a request (4xx): wrong token, model or request."""
