"""The frozen transformer blocks on a shared service, and the node's side of the link.

A node keeps its embeddings, adapter, final norm, pooling and head (docs/blocks.md).

- :mod:`~car_fl.blocks.wire`: the request and reply format (safetensors bytes) and its limits.
- :mod:`~car_fl.blocks.parts`: which parts of a model stay on the node, and its fingerprint.
- :mod:`~car_fl.blocks.compute`: the service's arithmetic: a stateless forward and VJP.
- :mod:`~car_fl.blocks.client`: the node's HTTP client, bounded retries.
- :mod:`~car_fl.blocks.errors`: why a service could not be used.
- :mod:`~car_fl.blocks.dedupe`: one computation per request however often it is retried.
- :mod:`~car_fl.blocks.remote`: the remote blocks as one autograd module.
"""
